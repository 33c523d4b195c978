"""The attention block's A/B on a Mac: one sidecar function predicted per compute-units setting (the GPU arm
``cpu_and_gpu`` against the Neural Engine arm ``cpu_and_ne``), and the table of its ``predict_timing`` records."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.progress import tqdm
from anelab.runtimes.interface import CoreMLRuntime, check_compute_units

# compute-units settings of the attention-block A/B: the GPU arm and the Neural Engine arm
AB_COMPUTE_UNITS = ("cpu_and_gpu", "cpu_and_ne")


def block_inputs(geometry, chunk: int, history: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs of one sidecar function ``h<history>`` (fp16): a full chunk under the causal mask.

    hidden [chunk, hidden_size]; k_history, v_history [history, kv_heads, head_dim] (only when
    history > 0); mask [chunk, history + chunk]. Random values from ``seed``: timing does not depend on them.
    """
    from anelab.core.masks import causal

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
    to ``out_dir`` (see :func:`anelab.runtimes.timing.time_predict`); ``clock`` is injectable for tests.
    """
    from anelab.runtimes.timing import time_predict

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
