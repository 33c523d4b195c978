"""The attention block's A/B on a Mac: one sidecar function predicted per compute-units setting (the GPU arm
``cpu_and_gpu`` against the Neural Engine arm ``cpu_and_ne``), the table of its ``predict_timing`` records, and
the one A/B ratio.

One ratio everywhere: ``timing_stats`` reads a timing result as Core ML's own predict duration
(``[MLModel predictionFromFeatures:]`` alone, coremltools 9.0 ``CoreMLPython.mm:543-562``) where it was
recorded, and ``ab_ratio`` divides two such readings only when both arms were timed the same way. The wall
time of ``predict`` (which adds coremltools' fp16 -> fp32 output copies, ``CoreMLPythonUtils.mm:448-484``) is
kept beside it, labelled ``wall``. Notebook 01, the study's headline and ``anelab decide`` read these.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from anelab.checkpoints.checkpoint import Checkpoint
from anelab.core.errors import AnelabInputError
from anelab.core.masks import causal
from anelab.core.progress import tqdm
from anelab.core.records import make_record, write_record
from anelab.runtimes.coreml.gate import AneGateError
from anelab.runtimes.coreml.timing import time_predict
from anelab.runtimes.interface import CoreMLRuntime, check_compute_units
from anelab.sidecar.export import export_sidecars

# compute-units settings of the attention-block A/B: the GPU arm and the Neural Engine arm
AB_COMPUTE_UNITS = ("cpu_and_gpu", "cpu_and_ne")
CORE_ML_TIMED = "core_ml_predict_s"  # timing_stats' label: Core ML's own predict duration
WALL_TIMED = "wall"  # ... the wall time of predict (conversions included): only where Core ML's was not recorded


def timing_stats(results: dict) -> dict | None:
    """Median / min / max seconds of one timing result (one compute-units setting of a ``predict_timing`` record,
    or a load's results): Core ML's own predict duration where recorded, else the wall time; ``timed`` says
    which (``CORE_ML_TIMED`` / ``WALL_TIMED``). None for a setting that did not load or predict."""
    if "median_s" not in results:
        return None
    own = results.get("core_ml_predict_s")
    source, timed = (own, CORE_ML_TIMED) if own else (results, WALL_TIMED)
    return {"median_s": source["median_s"], "min_s": source["min_s"], "max_s": source["max_s"], "timed": timed}


def ab_ratio(gpu: dict | None, ane: dict | None) -> float | None:
    """The A/B ratio: GPU-arm median / Neural-Engine-arm median of two ``timing_stats`` (above 1: the Neural
    Engine arm is faster); None when an arm is missing or the two were not timed the same way."""
    if not gpu or not ane or gpu["timed"] != ane["timed"] or not ane["median_s"]:
        return None
    return gpu["median_s"] / ane["median_s"]


def block_inputs(geometry, chunk: int, history: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs of one sidecar function ``h<history>`` (fp16): a full chunk under the causal mask.

    hidden [chunk, hidden_size]; k_history, v_history [history, kv_heads, head_dim] (only when
    history > 0); mask [chunk, history + chunk]. Random values from ``seed``: timing does not depend on them.
    """

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
    to ``out_dir`` (see :func:`anelab.runtimes.coreml.timing.time_predict`); ``clock`` is injectable for tests.
    """

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
    """Rows {function, history, prompt_tokens, <units>_s, <units>_wall_s, timed, ane_over_gpu, ane_over_gpu_wall}
    from predict_timing records.

    ``prompt_tokens`` = history + chunk (the chunk is the hidden input's row count). ``<units>_s``: the setting's
    ``timing_stats`` median (Core ML's own duration; ``timed`` names it); ``<units>_wall_s``: the wall median,
    kept beside it. ``ane_over_gpu`` = ``ab_ratio`` (cpu_and_gpu over cpu_and_ne, above 1: the Neural Engine arm
    is faster), None when either setting did not load or the two were timed differently; ``ane_over_gpu_wall``:
    the same of the wall times (labelled, not the study's ratio).
    """
    rows = []
    for rec in records:
        if rec.get("kind") != "predict_timing":
            raise AnelabInputError(f"ab_table reads predict_timing records, got kind {rec.get('kind')!r}")
        p = rec["parameters"]
        history = int(p["function"][1:])
        chunk = int(p["input_shapes"]["hidden"][0])
        row = {"function": p["function"], "history": history, "prompt_tokens": history + chunk}
        stats = {unit: timing_stats(result) for unit, result in rec["results"].items()}
        for unit, result in rec["results"].items():
            row[f"{unit}_s"] = stats[unit]["median_s"] if stats[unit] else None
            row[f"{unit}_wall_s"] = result.get("median_s")
        row["timed"] = sorted({s["timed"] for s in stats.values() if s})
        row["ane_over_gpu"] = ab_ratio(stats.get("cpu_and_gpu"), stats.get("cpu_and_ne"))
        gpu, ane = row.get("cpu_and_gpu_wall_s"), row.get("cpu_and_ne_wall_s")
        row["ane_over_gpu_wall"] = gpu / ane if gpu and ane else None
        rows.append(row)
    return sorted(rows, key=lambda r: r["history"])


def export_gated_ab(
    checkpoint: Checkpoint,
    out_dir: str | os.PathLike,
    chunk: int,
    histories: Sequence[int],
    layer: int,
    gate,
    *,
    records_dir: str | os.PathLike | None = None,
) -> tuple[object | None, list[dict]]:
    """Export the A/B package with the ANE gate; a history whose variant the gate refuses is recorded (kind
    ``ane_gate_refusal``, written to ``records_dir``) and left out, and the export goes on with the rest.

    Returns (the ``ExportResult`` of the histories that passed, or None when every one was refused; the refusal
    records). ``gate``: an ``AneGate`` (None: exported ungated, nothing refused). A refusal that names no
    single history (the Mac, the probe, the merged package) is raised: no history would fare better.
    """

    left, refusals = [int(h) for h in histories], []
    while left:
        try:
            [result] = export_sidecars(checkpoint, out_dir, chunk, left, [layer], gate=gate)
            return result, refusals
        except AneGateError as e:
            refused = int(e.function[1:]) if (e.function or "").startswith("h") and e.function[1:].isdigit() else None
            if refused not in left:
                raise
            left.remove(refused)
            record = make_record("ane_gate_refusal", {"function": e.function, "layer": layer, "chunk": chunk},
                                 {"refused": str(e), "histories_left": list(left)}, origin="measured")  # fmt: skip
            if records_dir is not None:
                record = {**record, "_file": write_record(records_dir, record).name}
            refusals.append(record)
    return None, refusals
