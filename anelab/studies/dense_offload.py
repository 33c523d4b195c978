"""Notebook 01's back-end: recorded A/B rows, offload shares, ratio sweeps, fresh block A/B."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from anelab.errors import AnelabInputError
from anelab.paths import DATA_DIR
from anelab.progress import tqdm
from anelab.records import read_records
from anelab.runtime.interface import CoreMLRuntime, check_compute_units
from anelab.studies.planner.catalogue import REFERENCE_CHUNK, REFERENCE_TOKENS, get_family
from anelab.studies.planner.plan import plan

# compute-units settings of the attention-block A/B: the GPU arm and the Neural Engine arm
AB_COMPUTE_UNITS = ("cpu_and_gpu", "cpu_and_ne")


# ---- recorded rows ------------------------------------------------------------------------------
def recorded_ab_rows(data_dir: str | os.PathLike | None = None) -> list[dict]:
    """Every recorded GPU-vs-ANE prefill row (records of kind ``prefill_ab``), one dict each.

    Keys: record (file name), family, model, bits (4 or 8), prompt_tokens, chunk, gpu_seconds,
    ane_seconds (None where the ANE arm was not recorded), ratio (as recorded, GPU / ANE).
    """
    rows = []
    for rec in read_records(Path(data_dir or DATA_DIR), kind="prefill_ab"):
        workload = rec["parameters"]["workload"]
        for r in rec["results"]["rows"]:
            rows.append(
                {
                    "record": rec["_file"],
                    "family": r["family"],
                    "model": r["model"],
                    "bits": int(r["family"].rsplit("-", 1)[1].removesuffix("bit")),
                    "prompt_tokens": workload["prompt_tokens_approx"],
                    "chunk": workload["chunk"],
                    "gpu_seconds": r["gpu_seconds"],
                    "ane_seconds": r["ane_seconds"],
                    "ratio": r["ratio"],
                }
            )
    if not rows:
        raise AnelabInputError(f"no prefill_ab records in {data_dir or DATA_DIR}; restore data/v5.5-ane-matrix-3.json")
    return rows


# ---- explanation 1: the full-attention share ----------------------------------------------------
def amdahl_ratio(share: float, speedup: float) -> float:
    """Prefill ratio when a ``share`` of the GPU prefill runs ``speedup`` times faster (Amdahl's law).

    ``1 / ((1 - share) + share / speedup)``; ``speedup`` counts the setup against the offloaded part.
    """
    if not 0.0 <= share <= 1.0:
        raise AnelabInputError(f"share must lie in [0, 1], got {share}")
    if not speedup > 0:
        raise AnelabInputError(f"speedup must be positive, got {speedup}")
    return 1.0 / ((1.0 - share) + share / speedup)


def offload_shares(data_dir: str | os.PathLike | None = None) -> list[dict]:
    """Each family with a recorded ANE arm at the seed's workload, with its two full-attention shares.

    - ``layer_share``: offloaded (full-attention) layers / all layers — the seed's "10 of 40", "6 of 24";
    - ``time_share``: the planner's offloaded GPU attention seconds / GPU prefill seconds at the
      reference prompt (4,333 tokens, chunk 4,096) — inferred by the fit, not measured;
    - ``speedup``: offloaded GPU attention / (ANE attention + setup) — the offloaded part's speed-up;
    - ``predicted_ratio`` (= ``amdahl_ratio(time_share, speedup)``) and ``recorded_ratio``.
    """
    out = []
    for row in recorded_ab_rows(data_dir):
        if row["ane_seconds"] is None or (row["prompt_tokens"], row["chunk"]) != (REFERENCE_TOKENS, REFERENCE_CHUNK):
            continue
        family = get_family(row["family"])
        p = plan(REFERENCE_TOKENS, family=row["family"], chunk=REFERENCE_CHUNK, data_dir=data_dir)
        offloaded = p.gpu_attention_seconds  # every chunk of the reference prompt runs on the ANE
        g = family.geometry
        out.append(
            {
                "family": row["family"],
                "model": row["model"],
                "bits": row["bits"],
                "record": row["record"],
                "layers": g.num_layers,
                "full_attention_layers": len(g.full_attention_layers),
                "layer_share": len(g.full_attention_layers) / g.num_layers,
                "time_share": offloaded / p.gpu_prefill_seconds,
                "speedup": offloaded / (p.ane_attention_seconds + p.setup_seconds),
                "predicted_ratio": p.predicted_ratio,
                "recorded_ratio": row["ratio"],
            }
        )
    return out


# ---- explanation 2: the prompt length -----------------------------------------------------------
SWEEP_KEYS = (
    "predicted_ratio",
    "decision",
    "fits",
    "variants_visited",
    "setup_seconds",
    "attention_saved_seconds",
    "gpu_attention_seconds",
    "ane_attention_seconds",
    "non_attention_seconds",
    "gpu_prefill_seconds",
    "ane_prefill_seconds",
    "coverage",
)


def ratio_sweep(family: str | None, prompt_tokens: Sequence[int], **plan_args) -> list[dict]:
    """The planner at each prompt length: one dict per length with ``prompt_tokens``, ``chunk`` and ``SWEEP_KEYS``.

    ``plan_args`` go to :func:`anelab.studies.planner.plan` (chunk, histories, costs, geometry overrides). A
    prompt past coverage is not refused here: it is planned with ``allow_past_coverage`` (``fits``
    False, everything on the GPU, ratio 1).
    """
    tokens = list(prompt_tokens)
    if not tokens:
        raise AnelabInputError("ratio_sweep needs at least one prompt length")
    rows = []
    for n in tokens:
        p = plan(int(n), family=family, allow_past_coverage=True, **plan_args)
        rows.append({"prompt_tokens": p.prompt_tokens, "chunk": p.chunk, **{k: getattr(p, k) for k in SWEEP_KEYS}})
    return rows


# ---- measured on a Mac: the attention block per compute-units setting ---------------------------
def block_inputs(geometry, chunk: int, history: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs of one sidecar function ``h<history>`` (fp16): a full chunk under the causal mask.

    hidden [chunk, hidden_size]; k_history, v_history [history, kv_heads, head_dim] (only when
    history > 0); mask [chunk, history + chunk]. Random values from ``seed``: timing does not depend on them.
    """
    from anelab.masks import causal

    rng = np.random.default_rng([int(seed), int(history)])
    inputs = {
        "hidden": rng.standard_normal((chunk, geometry.hidden_size)).astype(np.float16),
        "mask": causal(chunk, history),
    }
    if history > 0:
        kv = (history, geometry.num_kv_heads, geometry.head_dim)
        inputs["k_history"] = rng.standard_normal(kv).astype(np.float16)
        inputs["v_history"] = rng.standard_normal(kv).astype(np.float16)
    return inputs


def time_attention_ab(
    runtime: CoreMLRuntime,
    pkg: str | os.PathLike,
    geometry,
    *,
    chunk: int,
    histories: Sequence[int],
    compute_units: Sequence[str] = AB_COMPUTE_UNITS,
    warmup: int = 1,
    repeats: int = 3,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    out_dir: str | os.PathLike | None = None,
) -> list[dict]:
    """One ``predict_timing`` record per function ``h<history>`` of ``pkg``, each over ``compute_units``.

    A function at history H serves the last full chunk of a prompt of H + chunk tokens. Records go
    to ``out_dir`` (see :func:`anelab.runtime.timing.time_predict`); ``clock`` is injectable for tests.
    """
    from anelab.runtime.timing import time_predict

    units = [check_compute_units(u) for u in compute_units]
    records = []
    for h in tqdm(list(histories), desc="attention A/B", unit="fn"):
        inputs = block_inputs(geometry, chunk, int(h), seed)
        records.append(
            time_predict(
                runtime, pkg, f"h{int(h)}", inputs, units, warmup=warmup, repeats=repeats, clock=clock, out_dir=out_dir
            )
        )
    return records


def ab_table(records: Sequence[dict]) -> list[dict]:
    """Rows {function, history, prompt_tokens, <units>_s (median), ane_over_gpu} from predict_timing records.

    ``prompt_tokens`` = history + chunk (the chunk is the hidden input's row count). ``ane_over_gpu``
    = cpu_and_gpu median / cpu_and_ne median (above 1: the Neural Engine arm is faster); None when
    either setting did not load.
    """
    rows = []
    for rec in records:
        if rec.get("kind") != "predict_timing":
            raise AnelabInputError(f"ab_table reads predict_timing records, got kind {rec.get('kind')!r}")
        p = rec["parameters"]
        history = int(p["function"][1:])
        chunk = int(p["input_shapes"]["hidden"][0])
        row = {"function": p["function"], "history": history, "prompt_tokens": history + chunk}
        for unit, result in rec["results"].items():
            row[f"{unit}_s"] = result.get("median_s")
        gpu, ane = row.get("cpu_and_gpu_s"), row.get("cpu_and_ne_s")
        row["ane_over_gpu"] = gpu / ane if gpu and ane else None
        rows.append(row)
    return sorted(rows, key=lambda r: r["history"])
