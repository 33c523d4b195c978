"""Chunk-size sweep: what one prompt costs the three sidecar designs at each chunk width.

The designs (``--graph``), for a prompt of P tokens cut into chunks of width C:

- ``dense``    one function ``h<H>`` per history H = 0, C, 2C, ...; each scores all H + C keys at
               once, so its score arena is ``[heads, C, H + C]`` (the seed's per-history sidecar);
- ``tiled``    the same functions, with the keys visited in tiles of ``key_tile`` positions and an
               online softmax: the largest score tensor is ``[heads, C, key_tile]``;
- ``stateful`` one function ``c<C>`` (plus ``c1`` for decode) whose K/V cache is Core ML state of
               ``capacity`` slots; as built (``anelab.sidecar.graphs.stateful.build_stateful_program``) every call
               scores all ``capacity`` slots and masks the unfilled ones: ``[heads, C, capacity]``.

``chunk_sweep`` computes, per chunk width, the numbers that follow from the geometry alone
(calls, functions, arenas, arithmetic, fp16 weight bytes) and prices the functions each design
loads with the planner's recorded load model (``anelab.planner``: Qwen 3.8's measured variant loads,
a power law in score-arena bytes elsewhere). Nothing in it is timed.

The rest of the module measures saved packages on this machine: ``export_designs`` exports the
three designs for one prompt, ``package_facts`` reads sizes and the largest intermediate back from
disk, ``prefill_prompt`` runs a whole prompt through a saved package with NumPy (``anelab.sidecar.mil.evaluate``
— the CPU of this machine, not the Neural Engine), and ``numpy_prefill_record`` times that run and
writes a record (origin ``measured``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anelab import planner
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import FP16_BYTES, AttentionGeometry, chunk_starts, score_arena_bytes, score_bytes
from anelab.core.progress import tqdm
from anelab.core.records import make_record, write_record
from anelab.runtimes.coreml.timing import measure
from anelab.sidecar.checks.comparison import relative_error
from anelab.sidecar.designs import DENSE, STATEFUL, TILED, design_of, get_design
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.format import read_sidecar_metadata, weight_bytes
from anelab.sidecar.mil.evaluate import SavedPackage, var_bytes
from anelab.sidecar.prompt import prefill_prompt, prompt_reference
from anelab.studies.setup_cost import package_size

DEFAULT_CHUNKS = (64, 128, 256, 512, 1024, 4096)


DEFAULT_KEY_TILE = 64  # key positions per tile of the tiled design (capped at the chunk)


DESIGNS = (DENSE, TILED, STATEFUL)  # the designs this study sweeps


FLOPS_PER_MAC = 2


SCORE_MATMULS = 2  # Q K^T and P V


WEIGHT_BYTES_SOURCE = (
    "computed: projection, norm and bias parameters x 2 bytes (fp16), stored once per "
    "package for every design (the multifunction merge shares them)"
)


SETUP_SOURCE = (
    "planner load model (anelab.planner.fit.fit_costs().recorded_load_model()): Qwen 3.8's recorded "
    "variant loads where history, chunk and heads match, else a power law in score-arena bytes"
)


NUMPY_EVALUATOR = (
    "anelab.sidecar.mil.evaluate: NumPy evaluation of the saved MIL program on this machine's CPU (not the ANE)"
)


# ---- the computed sweep -------------------------------------------------------------------------------
def _check_sweep_args(prompt_tokens: int, chunks: Sequence[int], key_tile: int) -> list[int]:
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, (int, np.integer)) or prompt_tokens <= 0:
        raise AnelabInputError(f"--prompt-tokens must be a positive integer, got {prompt_tokens!r}")
    chunks = list(chunks)
    if not chunks:
        raise AnelabInputError("the sweep needs at least one chunk width, e.g. 64,128,256")
    for c in chunks:
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c <= 0:
            raise AnelabInputError(f"chunk widths must be positive integers, got {c!r}")
    if len(set(chunks)) != len(chunks):
        raise AnelabInputError(f"chunk widths {chunks} list one twice; give each once")
    if isinstance(key_tile, bool) or not isinstance(key_tile, (int, np.integer)) or key_tile <= 0:
        raise AnelabInputError(f"--tile must be a positive integer, got {key_tile!r}")
    for c in chunks:
        if c % min(key_tile, c):
            raise AnelabInputError(f"--tile {key_tile} does not divide the chunk {c}; use a power of two such as 64")
    return [int(c) for c in chunks]


def chunk_sweep(
    geometry: AttentionGeometry,
    prompt_tokens: int,
    chunks: Sequence[int] = DEFAULT_CHUNKS,
    *,
    key_tile: int = DEFAULT_KEY_TILE,
    decode: bool = False,
    load_floor_seconds: float | None = None,
    data_dir: str | os.PathLike | None = None,
) -> list[dict]:
    """One row per chunk width C: the cost of a ``prompt_tokens``-token prompt under each design.

    The prompt is ``calls = ceil(P / C)`` chunks at starts 0, C, ..., (calls - 1) C (the last one
    padded to C rows), so the designs need ``coverage = calls * C`` positions. Per row (per
    full-attention layer unless the key says otherwise; ``L`` = full-attention layers, ``Hq`` =
    heads, ``d`` = head_dim, fp16 = 2 bytes):

    - ``chunk``, ``calls``, ``coverage``; ``on_ane``: the planner's routing rule (a prompt shorter
      than one chunk is a single partial chunk that stays on the GPU);
    - ``dense_variants_per_layer`` = calls (one ``h<H>`` per chunk start); ``dense_variants`` = L x calls;
    - ``stateful_functions_per_layer`` = 1 (+1 with ``decode``); ``stateful_functions`` = L x that;
    - ``dense_arena_bytes``: Hq x C x (H_max + C) x 2 at the largest history H_max = (calls - 1) C;
    - ``key_tile`` = min(key_tile, C); ``tiled_arena_bytes``: Hq x C x key_tile x 2;
    - ``stateful_arena_bytes``: Hq x C x coverage x 2 (every call scores every cache slot);
    - ``score_flops``: sum over chunks k of Hq x C x (kC + C) x d x 2 x 2 (QK^T and PV, 2 FLOPs per
      multiply-add), the dense and the tiled graph alike (the tiled graph visits every key tile);
      ``stateful_score_flops``: calls x Hq x C x coverage x d x 2 x 2; ``causal_score_flops``: the
      causal minimum, Hq x d x 2 x 2 x P (P + 1) / 2 (each real row scores only keys at or before it);
    - ``weight_bytes``: fp16 weight bytes of one package (``geometry.parameter_count()`` x 2), the same for
      every design and chunk; ``weight_bytes_source`` says it is computed, not measured;
    - ``dense_setup_seconds``: L x the sum of the planner's load of each ``h<H>`` the prompt
      visits; ``stateful_setup_seconds``: L x the load of one function with the stateful arena
      (the decode function's arena, Hq x 1 x coverage, is added when ``decode``). Both use the
      planner's recorded load model, which was fitted on dense variants; ``setup_sources`` names
      where each number came from; ``dense_setup_extrapolated`` / ``stateful_setup_extrapolated``
      are True when one of that design's arenas lies outside the recorded loads' arena range (then
      the power law is an extrapolation).
      ``load_floor_seconds``: when given, every load is priced at least this much (the power law
      falls towards zero for small arenas; a recorded small-graph load is a floor to compare with),
      and ``setup_sources`` then includes ``"floor"`` where it applied.
    """
    chunks = _check_sweep_args(prompt_tokens, chunks, key_tile)
    if load_floor_seconds is not None and (
        isinstance(load_floor_seconds, bool)
        or not isinstance(load_floor_seconds, (int, float))
        or not load_floor_seconds >= 0
    ):
        raise AnelabInputError(f"the load floor must be a non-negative number of seconds, got {load_floor_seconds!r}")
    pricer = LoadPricer.recorded(geometry, data_dir, load_floor_seconds)
    return [_sweep_row(geometry, int(prompt_tokens), C, min(int(key_tile), C), decode, pricer) for C in chunks]


@dataclass
class LoadPricer:
    """Prices one function load with the planner's recorded load model (optionally floored), and
    knows the arena range the recorded loads cover (outside it the power law extrapolates)."""

    plan_geometry: planner.PlanGeometry
    model: planner.LoadModel
    recorded_arena_range: tuple[int, int]
    floor_seconds: float | None = None

    @classmethod
    def recorded(cls, geometry: AttentionGeometry, data_dir, floor_seconds: float | None) -> LoadPricer:
        g = geometry
        pg = planner.PlanGeometry(g.num_layers, tuple(g.full_attention_layers), g.num_heads, g.num_kv_heads, g.head_dim)
        fit = planner.fit_costs(data_dir)
        arenas = [score_arena_bytes(fit.recorded_load_heads, fit.recorded_load_chunk, h) for h in fit.recorded_loads]
        # the sweep shows the power law itself at kB arenas: its own floor (``floor_seconds``), not the planner's;
        # a function's cold load (specialization + reload, issue 30's one load model)
        model = dataclasses.replace(fit.recorded_load_model(specialize=True), floor_seconds=None)
        return cls(pg, model, (min(arenas), max(arenas)), floor_seconds)

    def load(self, chunk: int, history: int) -> tuple[float, str]:
        """(seconds, source) of loading a function whose score arena is that of h<history> at ``chunk``."""
        seconds, source = self.model.seconds(self.plan_geometry, chunk, history)
        if self.floor_seconds is not None and seconds < self.floor_seconds:
            return float(self.floor_seconds), "floor"
        return seconds, source

    def extrapolated(self, arenas: Sequence[int]) -> bool:
        lo, hi = self.recorded_arena_range
        return any(not lo <= a <= hi for a in arenas)


def _sweep_row(g: AttentionGeometry, P: int, C: int, tile: int, decode: bool, pricer: LoadPricer) -> dict:
    """One chunk width's row of :func:`chunk_sweep` (see its docstring for every key)."""
    n_layers = len(g.full_attention_layers)
    histories = chunk_starts(P, C)
    calls, coverage = len(histories), len(histories) * C
    per_entry = g.head_dim * FLOPS_PER_MAC * SCORE_MATMULS  # FLOPs per score entry (QK^T + PV)
    dense_loads = [pricer.load(C, h) for h in histories]
    dense_arenas = [score_arena_bytes(g.num_heads, C, h) for h in histories]
    with_decode = decode and C != 1
    stateful_load = [pricer.load(C, coverage - C)]  # arena Hq x C x coverage, as h<coverage - C>
    stateful_arenas = [score_arena_bytes(g.num_heads, C, coverage - C)]
    if with_decode:
        stateful_load.append(pricer.load(1, coverage - 1))
        stateful_arenas.append(score_arena_bytes(g.num_heads, 1, coverage - 1))
    return {
        "chunk": C,
        "calls": calls,
        "coverage": coverage,
        "on_ane": P >= C,
        "dense_variants_per_layer": calls,
        "dense_variants": n_layers * calls,
        "stateful_functions_per_layer": 1 + with_decode,
        "stateful_functions": n_layers * (1 + with_decode),
        "dense_arena_bytes": dense_arenas[-1],
        "key_tile": tile,
        "tiled_arena_bytes": score_bytes(g.num_heads, C, tile),
        "stateful_arena_bytes": stateful_arenas[0],
        "score_flops": sum(g.num_heads * C * (h + C) for h in histories) * per_entry,
        "stateful_score_flops": calls * g.num_heads * C * coverage * per_entry,
        "causal_score_flops": g.num_heads * per_entry * P * (P + 1) // 2,
        "weight_bytes": g.parameter_count() * FP16_BYTES,
        "weight_bytes_source": WEIGHT_BYTES_SOURCE,
        "dense_setup_seconds": n_layers * sum(s for s, _ in dense_loads),
        "stateful_setup_seconds": n_layers * sum(s for s, _ in stateful_load),
        "setup_sources": sorted({src for _, src in dense_loads + stateful_load}),
        "dense_setup_extrapolated": pricer.extrapolated(dense_arenas),
        "stateful_setup_extrapolated": pricer.extrapolated(stateful_arenas),
    }


# ---- the seed's claim (not a measurement) -----------------------------------------------------------
SEED_UTILIZATION_SOURCE = "claim from flash-attention-on-ane.txt, not measured"


SEED_UTILIZATION_CLAIM = (  # chunk, ANE utilization, DRAM pressure, prefill throughput — as that seed's table states them
    (64, "Low (dispatch overhead)", "Minimal", "Moderate"),
    (128, "Moderate", "Low", "Good"),
    (256, "High", "Low", "Best (typical)"),
    (512, "High–saturated", "Moderate", "Varies by model"),
    (1024, "May spill", "High", "Degrades"),
)


def seed_utilization_table() -> str:
    """The seed's qualitative chunk-size table as text, headed by ``SEED_UTILIZATION_SOURCE``."""
    lines = [
        f"[{SEED_UTILIZATION_SOURCE}]",
        f"{'chunk':>5}  {'ANE utilization (claimed)':<26} {'DRAM pressure (claimed)':<24} {'throughput (claimed)':<20}",
    ]
    lines += [f"{c:>5}  {u:<26} {d:<24} {t:<20}" for c, u, d, t in SEED_UTILIZATION_CLAIM]
    return "\n".join(lines)


# ---- measured here: the three designs as saved packages ----------------------------------------------
def export_designs(
    checkpoint_dir: str | os.PathLike,
    out_root: str | os.PathLike,
    *,
    layer: int,
    chunk: int,
    prompt_tokens: int,
    key_tile: int = DEFAULT_KEY_TILE,
    weights_mode: str = "fp16",
    decode: bool = False,
    designs: Sequence[str] = DESIGNS,
    gate=None,
    ends_only: bool = False,
    function_cache: str | os.PathLike | None = None,
) -> dict:
    """Export ``layer`` once per design, each covering a ``prompt_tokens``-token prompt in chunks of ``chunk``.

    dense / tiled: functions ``h0 .. h<(calls-1) C>``; tiled with key tile min(key_tile, chunk);
    stateful: ``c<C>`` (+ ``c1`` with ``decode``) with capacity calls x C. ``ends_only``: dense /
    tiled carry only the first and the last chunk's functions (``h0``, ``h<(calls-1) C>``: no history
    and the longest; the same coverage, so the same RoPE table and weight.bin) — enough to verify
    what does not depend on the history, such as a weight compression. Packages go to
    ``out_root/<design>-<weights_mode>[-ends]/layer_<L>.mlpackage``. Returns {design: ExportResult}.
    ``function_cache``: converted fp16 functions shared across modes and designs (``sidecar.function_cache``).
    """

    unknown = [d for d in designs if d not in DESIGNS]
    if unknown:
        raise AnelabInputError(f"unknown design {unknown[0]!r}; choose from {', '.join(DESIGNS)}")
    starts, checkpoint = chunk_starts(prompt_tokens, chunk), load_checkpoint(checkpoint_dir)
    out = {}
    given = {"key_tile": min(key_tile, chunk), "capacity": len(starts) * chunk, "decode": decode}
    for design in designs:
        extra = {k: v for k, v in given.items() if k in get_design(design).option_names}
        ends = ends_only and not get_design(design).stateful  # a stateful package has one prefill function anyway
        histories = sorted({starts[0], starts[-1]}) if ends else starts
        [result] = export_sidecars(
            checkpoint,
            Path(out_root) / (f"{design}-{weights_mode}" + ("-ends" if ends else "")),
            chunk,
            histories,
            [layer],
            graph=design,
            weights_mode=weights_mode,
            gate=gate,
            function_cache=function_cache,
            **extra,
        )
        out[design] = result
    return out


def package_facts(package: str | os.PathLike) -> dict:
    """What a saved package holds, read back from disk.

    {functions: [names], weight_bytes (weight.bin), spec_bytes (model.mlmodel), total_bytes,
    largest_intermediate_bytes: {function: bytes of its largest op output}, largest_op: {function:
    op type of that output}}.
    """

    saved = SavedPackage(package)
    largest_op = {}
    for name in saved.functions:
        best, kind = -1, ""
        for op in saved.mil_function(name).operations:
            if op.op_type == "const":
                continue
            for out in op.outputs:
                size = var_bytes(out)
                if size > best:
                    best, kind = size, op.op_type
        largest_op[name] = kind
    return {
        "functions": list(saved.functions),
        **package_size(package),
        "largest_intermediate_bytes": {n: f.largest_intermediate_bytes for n, f in saved.functions.items()},
        "largest_op": largest_op,
    }


def summarize_verification(report) -> dict:
    """One row from an ``anelab.sidecar.checks.verify.VerifyReport``: passed, vacuous, ``graph_error`` (worst
    non-control comparison against the reference with the package's own weights),
    ``weights_error`` (the compression's cost: worst comparison against the checkpoint's uncompressed weights,
    reported, not judged; None for fp16 packages) and ``weakest_control`` (the smallest error a negative control
    reached)."""
    graph = [c.worst for c in report.comparisons if not c.control and not c.cost]
    weights = [c.worst for c in report.comparisons if c.cost]
    controls = [c.worst for c in report.comparisons if c.control]
    return {
        "passed": report.passed,
        "vacuous": report.vacuous,
        "threshold": report.threshold,
        "graph_error": max(graph) if graph else None,
        "weights_error": max(weights) if weights else None,
        "weakest_control": min(controls) if controls else None,
    }


@dataclass(frozen=True)
class PrefillTiming:
    """A timed NumPy prefill: seconds per repeat and the output's error against the reference."""

    design: str
    chunk: int
    prompt_tokens: int
    calls: int
    stats: object  # anelab.runtimes.coreml.timing.TimingStats
    attn_out_error: float


def time_numpy_prefill(
    package: str | os.PathLike,
    hidden: np.ndarray,
    expected: np.ndarray,
    *,
    repeats: int = 3,
    warmup: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> PrefillTiming:
    """Time ``prefill_prompt`` over the whole prompt (NumPy on this machine) and measure its relative
    error against ``expected`` [P, D] (``prompt_reference``)."""

    meta = read_sidecar_metadata(package)
    saved = SavedPackage(package)
    outputs = []  # the first timed run's output is the one compared (every run computes the same)

    def run():
        out = prefill_prompt(package, hidden, saved=saved)
        if not outputs:
            outputs.append(out)

    stats = measure(run, warmup=warmup, repeats=repeats, clock=clock)
    P = hidden.shape[0]
    return PrefillTiming(
        design_of(meta).name, meta.chunk, P, -(-P // meta.chunk), stats, relative_error(outputs[0], expected)
    )


def numpy_prefill_record(
    timings: Sequence[PrefillTiming],
    *,
    checkpoint: str,
    layer: int,
    key_tile: int,
    out_dir: str | os.PathLike | None = None,
) -> dict:
    """A ``numpy_prefill_timing`` record (origin measured) of ``time_numpy_prefill`` results; written
    to ``out_dir`` when given (``_file`` then names it)."""

    if not timings:
        raise AnelabInputError("numpy_prefill_record needs at least one timing")
    rows = [
        {
            "design": t.design,
            "chunk": t.chunk,
            "prompt_tokens": t.prompt_tokens,
            "calls": t.calls,
            **t.stats.to_dict(),
            "attn_out_error": t.attn_out_error,
        }
        for t in timings
    ]
    record = make_record(
        "numpy_prefill_timing",
        {"checkpoint": checkpoint, "layer": layer, "key_tile": key_tile, "evaluator": NUMPY_EVALUATOR},
        {"rows": rows},
        origin="measured",
        unknown=["how any of these times relate to the Neural Engine: this is NumPy on a CPU"],
    )
    if out_dir is not None:
        record = {**record, "_file": write_record(out_dir, record).name}
    return record


@contextlib.contextmanager
def _quiet_workers():
    """Inside the block, processes started inherit ``TQDM_DISABLE=1``: no progress bars of their own
    (tqdm reads it when a worker imports it; the caller shows one bar for every job)."""
    saved = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = saved


def export_many(checkpoint_dir: str | os.PathLike, jobs: dict, *, workers: int = 1) -> dict:
    """``export_designs(checkpoint_dir, **options)`` for every ``{key: options}`` of ``jobs`` (each with
    its own ``out_root``); returns ``{key: {design: ExportResult}}``. The exports are independent, so
    ``workers`` > 1 runs them in that many processes (coremltools conversion is single-threaded
    Python, and on a shared machine a second process takes up a core another study leaves idle);
    the packages are the same either way."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from multiprocessing import get_context

    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise AnelabInputError(f"export workers must be a positive integer, got {workers!r}")
    out = {}
    with tqdm(total=len(jobs), desc="export designs", unit="job") as bar:
        if workers == 1:
            for key, options in jobs.items():
                bar.set_postfix_str(str(key))
                out[key] = export_designs(checkpoint_dir, **options)
                bar.update()
            return out
        with _quiet_workers(), ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(export_designs, checkpoint_dir, **options): key for key, options in jobs.items()}
            for future in as_completed(futures):
                out[futures[future]] = future.result()
                bar.set_postfix_str(str(futures[future]))
                bar.update()
    return {key: out[key] for key in jobs}


def export_design_grid(
    checkpoint_dir: str | os.PathLike,
    out_root: str | os.PathLike,
    *,
    layer: int,
    prompt_tokens: int,
    chunks: Sequence[int],
    designs: Sequence[str] = DESIGNS,
    key_tile: int = DEFAULT_KEY_TILE,
    workers: int = 1,
) -> dict[int, dict]:
    """``export_designs`` for every chunk width and design of one prompt: {chunk: {design: ExportResult}}
    (packages under ``out_root/chunk<C>/``), one job per package (``export_many``, ``workers`` processes)."""
    jobs = {
        (C, d): {
            "out_root": Path(out_root) / f"chunk{C}",
            "layer": layer,
            "chunk": C,
            "prompt_tokens": prompt_tokens,
            "key_tile": key_tile,
            "designs": (d,),
        }
        for C in chunks
        for d in designs
    }
    done = export_many(checkpoint_dir, jobs, workers=workers)
    return {C: {d: done[(C, d)][d] for d in designs} for C in chunks}


def numpy_prefill_sweep(
    checkpoint_dir: str | os.PathLike,
    out_root: str | os.PathLike,
    *,
    repeats: int = 3,
    seed: int = 0,
    export_workers: int = 1,
    **grid,
) -> list[PrefillTiming]:
    """For each chunk width and design: export the design for the prompt (``export_design_grid`` of ``grid``: its
    ``layer``, ``prompt_tokens``, ``chunks``, ``designs``, ``key_tile``, in ``export_workers`` processes), then —
    every export finished, one at a time — run the whole prompt through it with NumPy (timed) and compare with the
    reference. The same random fp16 prompt (``seed``) is used throughout."""
    layer, prompt_tokens = grid["layer"], grid["prompt_tokens"]
    designs, key_tile = grid.get("designs", DESIGNS), grid.get("key_tile", DEFAULT_KEY_TILE)
    chunks = _check_sweep_args(prompt_tokens, grid["chunks"], key_tile)
    checkpoint = load_checkpoint(checkpoint_dir)
    g = checkpoint.geometry
    hidden = (
        np.random.default_rng([seed, prompt_tokens]).standard_normal((prompt_tokens, g.hidden_size)).astype(np.float16)
    )
    expected = prompt_reference(hidden, checkpoint.layer(layer), g).attn_out
    exports = export_design_grid(checkpoint_dir, out_root, workers=export_workers, **{**grid, "chunks": chunks})
    timings = []
    with tqdm(total=len(chunks) * len(designs), desc="numpy prefill", unit="pkg") as bar:
        for C in chunks:
            for design in designs:
                bar.set_postfix_str(f"{design} C={C}")
                timings.append(time_numpy_prefill(exports[C][design].package, hidden, expected, repeats=repeats))
                bar.update()
    return timings


def design_comparison_record(
    exports: dict[str, dict],
    checks: dict[tuple[str, str], dict],
    computed: dict,
    *,
    checkpoint: str,
    layer: int,
    chunk: int,
    prompt_tokens: int,
    key_tile: int,
    decode: bool,
    facts: dict[str, dict] | None = None,
) -> dict:
    """The record of notebook 05's comparison: each fp16 design's package facts (``facts``, when the
    caller already read them with ``package_facts``), every (design, weights) verification summary
    (weight bytes read from weight.bin; ``functions``: the functions the package carries, all of them
    verified), and the computed row at the exported chunk."""

    facts = {d: package_facts(r.package) for d, r in exports["fp16"].items()} if facts is None else facts
    verification = [
        {
            "design": d,
            "weights": mode,
            "weight_bytes": weight_bytes(exports[mode][d].package),
            "functions": list(exports[mode][d].functions),
            **c,
        }
        for (d, mode), c in checks.items()
    ]
    return make_record(
        "design_comparison",
        {
            "checkpoint": checkpoint,
            "layer": layer,
            "chunk": chunk,
            "prompt_tokens": prompt_tokens,
            "key_tile": min(key_tile, chunk),
            "decode": decode,
            "evaluator": "anelab.sidecar.checks.verify (NumPy evaluation of the saved packages)",
        },
        {
            "packages": facts,
            "verification": verification,
            "computed": {k: v for k, v in computed.items() if k != "weight_bytes_source"},
        },
        origin="measured",
        unknown=["whether the Neural Engine accepts each design (needs the Mac gate)"],
    )
