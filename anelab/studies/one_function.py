"""Study 6 back-end: does one stateful, tiled function per layer re-open the Qwen 3.8 case?

Exports the three designs (dense per-history, stateful, stateful-tiled) of one layer, reads their
saved programs (op counts, largest intermediates), times a NumPy prefill through each, measures the
online-softmax fp16 error against the tile count, and draws the planner's per-design prediction.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from anelab.checkpoints.checkpoint import load_checkpoint, write_checkpoint
from anelab.core.geometry import AttentionGeometry, chunk_starts
from anelab.core.progress import tqdm
from anelab.core.weights import random_attention_weights
from anelab.planner.design_plans import DESIGNS, compare_designs
from anelab.planner.from_checkpoint import checkpoint_designs
from anelab.sidecar.checks.comparison import relative_error
from anelab.sidecar.checks.verify import verify_package
from anelab.sidecar.designs import STATEFUL_TILED, get_design
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.inspection import inspect_package, largest_working_output
from anelab.sidecar.mil.evaluate import SavedPackage
from anelab.sidecar.prompt import prefill_prompt, prompt_reference

DESIGN_COLOURS = ("tab:red", "tab:orange", "tab:blue")  # one per design of DESIGNS, in order


def intermediate_profile(package: str | os.PathLike) -> dict[str, dict]:
    """Per function of a saved package: non-const op count, the largest op output (bytes), the
    largest op output that is not cache-shaped ([Hkv, capacity, d]: the state itself, read and
    updated), and the score entries one call computes (outputs of every ``matmul(., K, transpose_y)``)."""
    saved = SavedPackage(package)
    out = {}
    for name, info in saved.functions.items():
        ops = [op for op in saved.mil_function(name).operations if op.op_type != "const"]
        top = largest_working_output(saved, name)
        out[name] = {
            "ops": len(ops),
            "largest_bytes": info.largest_intermediate_bytes,
            "largest_working_bytes": top[0],
            "largest_working_shape": list(top[1]),
            "largest_working_op": top[2],
            "score_entries": sum(
                int(np.prod(op.outputs[0].shape))
                for op in ops
                if op.op_type == "matmul" and bool(op.inputs["transpose_y"].val)
            ),
        }
    return out


def export_three(
    checkpoint_dir,
    out_root,
    *,
    layer: int,
    chunk: int,
    prompt_tokens: int,
    key_tile: int | None = None,
    query_tile: int | None = None,
    decode: bool = False,
) -> dict:
    """Export ``layer`` as each design of ``DESIGNS`` covering a ``prompt_tokens`` prompt in chunks of
    ``chunk`` (stateful capacity = calls x chunk). Returns {design: ExportResult}."""

    histories, checkpoint = chunk_starts(prompt_tokens, chunk), load_checkpoint(checkpoint_dir)
    given = {"capacity": len(histories) * chunk, "decode": decode, "key_tile": key_tile, "query_tile": query_tile}
    out = {}
    for design in DESIGNS:
        options = {k: v for k, v in given.items() if k in get_design(design).option_names}
        [out[design]] = export_sidecars(
            checkpoint, Path(out_root) / design, chunk, histories, [layer], graph=design, **options
        )
    return out


def prefill_times(exports: dict, hidden: np.ndarray, weights, geometry, *, repeats: int = 1) -> dict[str, dict]:
    """NumPy prefill of ``hidden`` [P, D] through each exported design: best-of-``repeats`` seconds and
    the attn_out relative error against the fp64 reference over the whole prompt."""
    ref = prompt_reference(hidden, weights, geometry).attn_out
    out = {}
    for design, result in tqdm(exports.items(), desc="NumPy prefill", unit="design"):
        saved = SavedPackage(result.package)
        best = np.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            attn = prefill_prompt(result.package, hidden, saved=saved)
            best = min(best, time.perf_counter() - t0)
        out[design] = {"seconds": float(best), "attn_out_error": float(relative_error(attn, ref))}
    return out


def tile_error_exports(
    checkpoint_dir, out_root, *, layer: int, chunk: int, capacity: int, key_tiles, query_tile: int | None = None
) -> dict[int, Path]:
    """One stateful-tiled export of ``layer`` per key tile, ``capacity`` cache slots each -> {key tile: package}."""
    ck = load_checkpoint(checkpoint_dir)
    packages = {}
    for kt in tqdm(key_tiles, desc="tile-count exports", unit="export"):
        [r] = export_sidecars(
            ck,
            Path(out_root) / f"kt{kt}",
            chunk,
            None,
            [layer],
            graph=STATEFUL_TILED,
            capacity=capacity,
            key_tile=kt,
            query_tile=query_tile,
        )
        packages[int(kt)] = r.package
    return packages


def tile_errors(checkpoint_dir, packages: dict[int, Path], *, layer: int, capacity: int, seed=0) -> list[dict]:
    """fp16 error of the online softmax per key tile: a prompt of random fp16 rows [capacity, D] filling each
    package (``tile_error_exports``) prefilled, attn_out against the fp64 reference."""

    ck = load_checkpoint(checkpoint_dir)
    g, w = ck.geometry, ck.layer(layer)
    hidden = np.random.default_rng(seed).standard_normal((capacity, g.hidden_size)).astype(np.float16)
    ref = prompt_reference(hidden, w, g).attn_out
    rows = []
    for kt, package in packages.items():
        out = prefill_prompt(package, hidden)
        rows.append({"key_tile": kt, "tiles": capacity // kt, "attn_out_error": float(relative_error(out, ref))})
    return rows


def tile_error_table(
    checkpoint_dir, out_root, *, layer: int, chunk: int, capacity: int, key_tiles, query_tile: int | None = None, seed=0
) -> list[dict]:
    """fp16 error of the online softmax against the number of key tiles: one stateful-tiled export per
    key tile (``tile_error_exports``), a prompt filling the capacity, attn_out against the fp64 reference."""

    packages = tile_error_exports(checkpoint_dir, out_root, layer=layer, chunk=chunk, capacity=capacity,
                                  key_tiles=key_tiles, query_tile=query_tile)  # fmt: skip
    return tile_errors(checkpoint_dir, packages, layer=layer, capacity=capacity, seed=seed)


def prediction_rows(family: str, prompt_tokens: int, chunks, *, key_tile=None, query_tile=None) -> list[dict]:
    """The planner's per-design prediction at each chunk width (``DesignPlan`` dicts)."""
    return [
        d.to_dict()
        for c in chunks
        for d in compare_designs(prompt_tokens, family, c, key_tile=key_tile, query_tile=query_tile)
    ]


def recorded_gpu_prefill(family: str, records: list[dict]) -> tuple[float, str] | None:
    """(GPU prefill seconds, record file) of ``family``'s recorded A/B row at the seed's workload (the
    ``v5.6`` family records), or None when none is recorded."""
    for r in records:
        rows = r.get("results", {}).get("rows", []) if isinstance(r.get("results"), dict) else []
        for row in rows:
            if (
                isinstance(row, dict)
                and row.get("family") == family
                and row.get("gpu_seconds")
                and "v5.6" in r["_file"]
            ):
                return float(row["gpu_seconds"]), r["_file"]
    return None


def prediction_figure(rows: list[dict], family_label: str, recorded_gpu: tuple[float, str] | None = None):
    """Setup + ANE attention per design and chunk width, with the GPU arm's prefill as the line to beat
    (the planner's, per chunk; and ``recorded_gpu`` = (seconds, record file) when given). Titled as a
    prediction."""
    import matplotlib.pyplot as plt

    chunks = sorted({r["chunk"] for r in rows})
    fig, ax = plt.subplots(figsize=(8.6, 5.2))
    width = 0.27
    for i, (design, colour) in enumerate(zip(DESIGNS, DESIGN_COLOURS, strict=True)):
        by_chunk = {r["chunk"]: r for r in rows if r["design"] == design}
        xs = np.arange(len(chunks)) + (i - 1) * width
        setup = [by_chunk[c]["setup_seconds"] for c in chunks]
        attn = [by_chunk[c]["ane_attention_seconds"] for c in chunks]
        ax.bar(xs, setup, width, color=colour, label=f"{design}: setup (loads)")
        ax.bar(xs, attn, width, bottom=setup, color=colour, alpha=0.45, hatch="//", label=f"{design}: attention")
    gpu = [next(r["gpu_prefill_seconds"] for r in rows if r["chunk"] == c) for c in chunks]
    ax.plot(np.arange(len(chunks)), gpu, "k--", marker="_", label="GPU prefill, planner (fitted on the records)")
    if recorded_gpu is not None:
        ax.axhline(recorded_gpu[0], color="tab:red", ls=":", lw=1.2, label=f"GPU prefill, recorded ({recorded_gpu[1]})")
    ax.set_xticks(np.arange(len(chunks)), [str(c) for c in chunks])
    ax.set_xlabel("chunk width C (tokens)")
    ax.set_ylabel("seconds (predicted)")
    ax.set_title(f"PREDICTION — {family_label}: ANE setup + attention per design vs the GPU prefill")
    ax.legend(ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    return fig, ax


# ---- a windowed model: Gemma 3's pattern, every layer one stateful-tiled function ---------------------
GEMMA3_PATTERN = 6  # configuration_gemma3.py: sliding_window_pattern = 6 (five sliding layers, then one full)


def gemma3_style_geometry(
    window: int, *, hidden_size: int = 48, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16
) -> AttentionGeometry:
    """Six Gemma 3 text layers (``gemma3_text``: per-head zero-centred q/k norms, query_pre_attn_scalar
    32, global RoPE base 1e6, local base 1e4): layers 0-4 slide over ``window`` tokens, layer 5 is full."""
    return AttentionGeometry(
        variant="qwen3",
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=1e6,
        num_layers=GEMMA3_PATTERN,
        full_attention_layers=tuple(range(GEMMA3_PATTERN)),
        sliding_window=window,
        sliding_layers=tuple(range(GEMMA3_PATTERN - 1)),
        local_rope_theta=10000.0,
        query_scale=32**-0.5,
    )


def write_gemma3_style_checkpoint(directory, geometry: AttentionGeometry, seed: int = 0) -> Path:
    """config.json + safetensors of ``geometry`` (random weights) in the gemma3_text layout, by the
    project's checkpoint writer."""

    weights = {i: random_attention_weights(geometry, i, seed) for i in geometry.full_attention_layers}
    return write_checkpoint(directory, geometry, weights, model_type="gemma3_text")


def windowed_model_rows(
    checkpoint_dir, out_root, *, chunk: int, window: int, layers=None, decode: bool = False
) -> list[dict]:
    """The attention layers of a windowed model (``layers``, default all) exported as one stateful-tiled
    function at capacity 4W and verified from disk (a prompt of about 4W, the last chunk partial), plus
    each layer's largest intermediate at capacity 16W. One row per layer: functions, ring slots, worst
    error, controls, largest intermediate (bytes) at 4W and 16W."""

    def largest(result) -> int:
        return max(f["largest_intermediate_bytes"] for f in inspect_package(result.package)["functions"].values())

    options, checkpoint = {"graph": STATEFUL_TILED, "decode": decode}, load_checkpoint(checkpoint_dir)
    short, long = (
        export_sidecars(checkpoint, Path(out_root) / f"{n}W", chunk, None, layers, capacity=n * window, **options)
        for n in (4, 16)
    )
    rows = []
    for r, r16 in tqdm(list(zip(short, long)), desc="verify layers", unit="layer"):
        report = verify_package(r.package, checkpoint)
        rows.append(
            {
                "layer": r.metadata.layer,
                "window": r.metadata.sliding_window,
                "functions": r.functions,
                "ring_slots": r.metadata.ring_slots,
                "passed": report.passed,
                "worst_error": max(c.worst for c in report.comparisons if not c.control),
                "controls": {c.case.removeprefix("control: "): c.worst for c in report.comparisons if c.control},
                "largest_4w": largest(r),
                "largest_16w": largest(r16),
            }
        )
    return rows


def windowed_plan_rows(checkpoint_dir, prompt_tokens: int, chunk: int, family: str | None = None) -> list[dict]:
    """Per design, a windowed model's functions, loads and planned setup (seconds) over all its
    attention layers, each kind of layer priced as built (``planner.from_checkpoint.checkpoint_designs``;
    costs from ``family`` or the closest recorded dense family)."""

    checkpoint_plan, by_kind = checkpoint_designs(
        load_checkpoint(checkpoint_dir), prompt_tokens, chunk=chunk, family=family
    )
    layers = {"full": len(checkpoint_plan.full_layers), "windowed": len(checkpoint_plan.windowed_layers)}
    rows = []
    for i, design in enumerate(DESIGNS):
        kinds = {kind: plans[i] for kind, plans in by_kind.items()}
        rows.append(
            {
                "design": design,
                "functions": sum(layers[k] * p.functions_per_layer for k, p in kinds.items()),
                "loads": sum(p.loads for p in kinds.values()),
                "setup_seconds": sum(p.setup_seconds for p in kinds.values()),
                "ring_slots": kinds["windowed"].ring_slots if "windowed" in kinds else None,
                "windowed_arena_bytes": kinds["windowed"].per_call_arena_bytes if "windowed" in kinds else None,
            }
        )
    return rows
