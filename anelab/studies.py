"""Studies 3 and 4 of the ANE prefill research seed: dense offload and per-variant setup cost.

The data preparation behind ``notebooks/01_dense_offload.ipynb`` and ``notebooks/04_setup_cost.ipynb``:

- recorded A/B rows as a table (:func:`recorded_ab_rows`) and the two explanations of their shape,
  the full-attention share (:func:`offload_shares`) and the prompt length (:func:`ratio_sweep`);
- where offload starts to pay: :func:`break_even` searches the planner's predicted ratio over
  prompt lengths for the intervals where the ANE arm wins, and :func:`break_even_setup` gives the
  per-variant setup at which a plan stops winning;
- fresh measurements: package size against the number of functions (:func:`export_function_sweep`,
  :func:`package_size_record`, runs anywhere), and on a Mac the attention block per compute-units
  setting (:func:`time_attention_ab`) and resident memory against the number of functions in one
  package (:func:`memory_vs_functions`, coremltools issue 2351).

Everything here calls the planner (:mod:`anelab.plan`) and the timing module; it adds no cost model
of its own. Names follow the seed: a *variant* is one ``(layer, history)`` function, the *setup* is
the sum of its loads, the *attention saved* is GPU attention minus ANE attention for the offloaded
chunks.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

from anelab.coreml_runtime import CoreMLRuntime, check_compute_units
from anelab.errors import AnelabInputError
from anelab.plan import (
    DATA_DIR,
    REFERENCE_CHUNK,
    REFERENCE_TOKENS,
    PrefillPlan,
    get_family,
    plan,
)
from anelab.records import make_record, read_records, write_record

# compute-units settings of the attention-block A/B: the GPU arm and the Neural Engine arm
AB_COMPUTE_UNITS = ("cpu_and_gpu", "cpu_and_ne")
MEMORY_CHILD_TIMEOUT = 900  # seconds one isolated memory measurement may take


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
            rows.append({
                "record": rec["_file"], "family": r["family"], "model": r["model"],
                "bits": int(r["family"].rsplit("-", 1)[1].removesuffix("bit")),
                "prompt_tokens": workload["prompt_tokens_approx"], "chunk": workload["chunk"],
                "gpu_seconds": r["gpu_seconds"], "ane_seconds": r["ane_seconds"], "ratio": r["ratio"],
            })
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
        out.append({
            "family": row["family"], "model": row["model"], "bits": row["bits"], "record": row["record"],
            "layers": g.num_layers, "full_attention_layers": len(g.full_attention_layers),
            "layer_share": len(g.full_attention_layers) / g.num_layers,
            "time_share": offloaded / p.gpu_prefill_seconds,
            "speedup": offloaded / (p.ane_attention_seconds + p.setup_seconds),
            "predicted_ratio": p.predicted_ratio, "recorded_ratio": row["ratio"],
        })
    return out


# ---- explanation 2: the prompt length -----------------------------------------------------------
SWEEP_KEYS = ("predicted_ratio", "decision", "fits", "variants_visited", "setup_seconds", "attention_saved_seconds",
              "gpu_attention_seconds", "ane_attention_seconds", "non_attention_seconds", "gpu_prefill_seconds",
              "ane_prefill_seconds", "coverage")


def ratio_sweep(family: str | None, prompt_tokens: Sequence[int], **plan_args) -> list[dict]:
    """The planner at each prompt length: one dict per length with ``prompt_tokens``, ``chunk`` and ``SWEEP_KEYS``.

    ``plan_args`` go to :func:`anelab.plan.plan` (chunk, histories, costs, geometry overrides). A
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


# ---- break-even -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class BreakEven:
    """Where the planner predicts the ANE arm wins (``decision == "ane"``), over prompts 1..``searched_up_to``.

    ``win_intervals``: maximal runs ``[first, last]`` of winning prompt lengths (inclusive);
    ``first_win``: the shortest winning prompt (None: none wins); ``wins_from``: the shortest prompt
    from which every longer one up to ``searched_up_to`` wins (None: the last one searched loses);
    ``plans``: planner calls the search made.
    """

    family: str | None
    chunk: int
    searched_up_to: int
    win_intervals: tuple[tuple[int, int], ...]
    first_win: int | None
    wins_from: int | None
    plans: int

    def to_dict(self) -> dict:
        d = asdict(self)
        d["win_intervals"] = [list(w) for w in self.win_intervals]
        return d


def _intervals(wins: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Merge touching or overlapping [lo, hi] runs (sorted by lo)."""
    merged: list[list[int]] = []
    for lo, hi in wins:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return tuple((lo, hi) for lo, hi in merged)


def break_even(family: str | None = None, *, max_tokens: int | None = None, chunk: int | None = None,
               **plan_args) -> BreakEven:
    """Search the prompt lengths 1..``max_tokens`` for those where the planner says offload wins.

    ``max_tokens`` defaults to the family's coverage cap (``max_history + chunk``) or, for a family
    without one, to 8 chunks. ``plan_args`` go to :func:`anelab.plan.plan`.

    Why a bisection per chunk count is exact: prompts with the same number of chunks
    (``(k-1)*chunk < P <= k*chunk``) visit the same variants and run the same padded ANE chunks, so
    setup and ANE attention are fixed while the GPU attention of the last chunk grows with its rows;
    non-attention time is in both arms. So the ANE arm wins (attention saved > setup) on an upper
    part of each such run — one threshold per chunk count — and the search bisects for it (about
    log2(chunk) planner calls per chunk instead of one per token). ``tests/test_studies.py`` checks
    the result against planning every prompt length.
    """
    fam = get_family(family) if family is not None else None
    if chunk is None:
        if fam is None:
            raise AnelabInputError("pass chunk= (the sidecar's width) or a family")
        chunk = REFERENCE_CHUNK
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk <= 0:
        raise AnelabInputError(f"chunk must be a positive integer, got {chunk}")
    if max_tokens is None:
        max_tokens = (fam.max_history + chunk) if fam is not None and fam.max_history is not None else 8 * chunk
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens <= 0:
        raise AnelabInputError(f"max_tokens must be a positive integer, got {max_tokens}")
    calls = 0

    def wins(n: int) -> bool:
        nonlocal calls
        calls += 1
        return plan(n, family=family, chunk=chunk, allow_past_coverage=True, **plan_args).decision == "ane"

    runs = []
    for k in range(1, math.ceil(max_tokens / chunk) + 1):
        lo, hi = (k - 1) * chunk + 1, min(k * chunk, max_tokens)
        if not wins(hi):
            continue
        if wins(lo):
            runs.append((lo, hi))
            continue
        bad, good = lo, hi  # wins(bad) is False, wins(good) is True
        while good - bad > 1:
            mid = (bad + good) // 2
            if wins(mid):
                good = mid
            else:
                bad = mid
        runs.append((good, hi))
    intervals = _intervals(runs)
    first = intervals[0][0] if intervals else None
    wins_from = intervals[-1][0] if intervals and intervals[-1][1] == max_tokens else None
    return BreakEven(family, int(chunk), int(max_tokens), intervals, first, wins_from, calls)


def break_even_setup(p: PrefillPlan) -> float | None:
    """Per-variant setup (seconds) at which this plan's ANE arm would tie the GPU arm.

    The arms differ by ``attention saved - setup`` (non-attention time is in both), so the tie is at
    ``attention_saved_seconds / variants_visited`` per variant. None when nothing is offloaded.
    """
    if p.variants_visited == 0:
        return None
    return p.attention_saved_seconds / p.variants_visited


PLANNER_NOTE = "lines: planner (anelab.plan) fitted on these records"
SOURCE_LINE_CHARS = 64  # wrap a label's source list past this many characters


def compact_provenance(records: Sequence[dict], *, planner: bool = False) -> str:
    """A figure label short enough for one panel: one line per machine, one listing the sources.

    ``recorded on <model> (<chip>), <os> — replayed, not measured here`` (or ``measured here: ...``),
    then ``source: a.json, b.json``; with ``planner`` a last line says the lines are the planner's.
    The full per-record text (``anelab.figures.provenance_text``) belongs in the manifest.
    """
    if not records:
        raise AnelabInputError("compact_provenance needs at least one record")
    machines, sources = [], []
    for r in records:
        prov = r.get("provenance") or {}
        chip = str(prov.get("chip", "unknown")).removeprefix("Apple ")
        machine = f"{prov.get('machine_model', 'unknown')} ({chip}), {prov.get('os_version', 'unknown')}"
        if r.get("origin") == "recorded":
            line = f"recorded on {machine} — replayed, not measured here"
        elif r.get("origin") == "measured":
            line = f"measured here: {machine}"
        else:
            raise AnelabInputError(f"record {r.get('_file', '?')} has origin {r.get('origin')!r}; expected measured or recorded")
        if line not in machines:
            machines.append(line)
        name = r.get("_file") or (r.get("source") or {}).get("record") or "unnamed record"
        if name not in sources:
            sources.append(name)
    lines = [f"source: {sources[0]}"]
    for name in sources[1:]:  # wrap the source list at SOURCE_LINE_CHARS
        if len(lines[-1]) + 2 + len(name) > SOURCE_LINE_CHARS:
            lines[-1] += ","
            lines.append(name)
        else:
            lines[-1] += f", {name}"
    return "\n".join(machines + lines + ([PLANNER_NOTE] if planner else []))


def describe_plan(p: PrefillPlan) -> str:
    """A short text of a plan for the notebooks' interactive control."""
    head = f"{p.family or 'custom geometry'}: {p.prompt_tokens:,} tokens, chunk {p.chunk:,}"
    return "\n".join([
        head,
        f"  decision: {p.decision} (predicted ratio {p.predicted_ratio:.2f}x) — {p.reason}",
        f"  GPU arm {p.gpu_prefill_seconds:.1f} s; ANE arm {p.ane_prefill_seconds:.1f} s "
        f"= non-attention {p.non_attention_seconds:.1f} + ANE attention {p.ane_attention_seconds:.1f} "
        f"+ setup {p.setup_seconds:.1f} ({p.variants_visited} variant loads)"
        + ("" if p.fits else f"; past coverage {p.coverage:,}"),
    ])


# ---- measured here: package size against the number of functions ------------------------------
def package_size(pkg: str | os.PathLike) -> dict:
    """Bytes of one .mlpackage: ``weight_bytes`` (weight.bin), ``spec_bytes`` (model.mlmodel), ``total_bytes`` (all files)."""
    from anelab.export import WEIGHTS_RELATIVE, require_package

    pkg = require_package(pkg)
    total = sum(f.stat().st_size for f in pkg.rglob("*") if f.is_file())
    weights = pkg / WEIGHTS_RELATIVE
    spec = pkg / "Data" / "com.apple.CoreML" / "model.mlmodel"
    return {"weight_bytes": weights.stat().st_size if weights.is_file() else 0,
            "spec_bytes": spec.stat().st_size if spec.is_file() else 0, "total_bytes": total}


def export_function_sweep(checkpoint_dir: str | os.PathLike, out_root: str | os.PathLike, *, layer: int, chunk: int,
                          counts: Sequence[int], runtime: CoreMLRuntime | None = None) -> dict[int, Path]:
    """Export ``layer`` once per count n in ``counts``, with the n histories 0, chunk, ..., (n-1)*chunk.

    Returns {n: path of ``out_root/n<n>/layer_<L>.mlpackage``}. ``runtime``: the ANE gate of
    :func:`anelab.export.export_layer` (None: not gated, as off-Mac).
    """
    from anelab.checkpoint import load_checkpoint
    from anelab.export import export_layer

    counts = sorted({int(n) for n in counts})
    if not counts or counts[0] < 1:
        raise AnelabInputError(f"function counts must be positive integers, got {list(counts)}")
    checkpoint = load_checkpoint(checkpoint_dir)
    packages = {}
    with tqdm(total=sum(counts), desc="export functions", unit="fn") as bar:
        for n in counts:
            bar.set_postfix_str(f"{n} functions")
            result = export_layer(checkpoint, layer, chunk, [i * chunk for i in range(n)], Path(out_root) / f"n{n}",
                                  runtime=runtime, progress=bar)
            packages[n] = result.package
    return packages


def package_size_record(packages: dict[int, str | os.PathLike], *, layer: int, chunk: int, checkpoint: str,
                        out_dir: str | os.PathLike | None = None) -> dict:
    """A ``package_size`` record (origin measured): the sizes of each package by its function count.

    results.rows: [{functions, weight_bytes, spec_bytes, total_bytes}] in function-count order.
    Written to ``out_dir`` when given (``_file`` then names it).
    """
    if not packages:
        raise AnelabInputError("package_size_record needs at least one package")
    rows = [{"functions": int(n), **package_size(p)} for n, p in sorted(packages.items())]
    record = make_record("package_size", {"checkpoint": checkpoint, "layer": layer, "chunk": chunk,
                                          "histories": "0, chunk, ..., (functions - 1) * chunk"},
                         {"rows": rows}, origin="measured",
                         unknown=["how Core ML lays the package out once compiled (.mlmodelc), which is what loads"])
    if out_dir is not None:
        record = {**record, "_file": write_record(out_dir, record).name}
    return record


# ---- measured on a Mac: the attention block per compute-units setting ---------------------------
def block_inputs(geometry, chunk: int, history: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs of one sidecar function ``h<history>`` (fp16): a full chunk under the causal mask.

    hidden [chunk, hidden_size]; k_history, v_history [history, kv_heads, head_dim] (only when
    history > 0); mask [chunk, history + chunk]. Random values from ``seed``: timing does not depend on them.
    """
    from anelab.masks import causal

    rng = np.random.default_rng([int(seed), int(history)])
    inputs = {"hidden": rng.standard_normal((chunk, geometry.hidden_size)).astype(np.float16),
              "mask": causal(chunk, history)}
    if history > 0:
        kv = (history, geometry.num_kv_heads, geometry.head_dim)
        inputs["k_history"] = rng.standard_normal(kv).astype(np.float16)
        inputs["v_history"] = rng.standard_normal(kv).astype(np.float16)
    return inputs


def time_attention_ab(runtime: CoreMLRuntime, pkg: str | os.PathLike, geometry, *, chunk: int,
                      histories: Sequence[int], compute_units: Sequence[str] = AB_COMPUTE_UNITS, warmup: int = 1,
                      repeats: int = 3, seed: int = 0, clock: Callable[[], float] = time.perf_counter,
                      out_dir: str | os.PathLike | None = None) -> list[dict]:
    """One ``predict_timing`` record per function ``h<history>`` of ``pkg``, each over ``compute_units``.

    A function at history H serves the last full chunk of a prompt of H + chunk tokens. Records go
    to ``out_dir`` (see :func:`anelab.timing.time_predict`); ``clock`` is injectable for tests.
    """
    from anelab.timing import time_predict

    units = [check_compute_units(u) for u in compute_units]
    records = []
    for h in tqdm(list(histories), desc="attention A/B", unit="fn"):
        inputs = block_inputs(geometry, chunk, int(h), seed)
        records.append(time_predict(runtime, pkg, f"h{int(h)}", inputs, units, warmup=warmup, repeats=repeats,
                                    clock=clock, out_dir=out_dir))
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


# ---- measured on a Mac: resident memory against the number of functions (coremltools #2351) -----
def current_rss_bytes() -> int:
    """Resident set size of this process, in bytes."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def measure_load_memory(runtime: CoreMLRuntime, pkg: str | os.PathLike, functions: Sequence[str], *,
                        compute_units: str = "cpu_and_ne", rss: Callable[[], int] = current_rss_bytes) -> dict:
    """Resident memory as the functions of one package are loaded one after another (handles kept).

    Returns {"rss_before_bytes", "loads": [{"function", "rss_bytes", "delta_bytes"}]}, where
    ``delta_bytes`` is the growth since before the first load. Run it in a fresh process
    (:func:`load_memory_isolated`) so earlier loads do not blur the numbers.
    """
    check_compute_units(compute_units)
    runtime.require_available()
    if not functions:
        raise AnelabInputError("measure_load_memory needs at least one function name")
    before = int(rss())
    handles, loads = [], []
    for name in functions:
        handles.append(runtime.load(pkg, name, compute_units))
        now = int(rss())
        loads.append({"function": name, "rss_bytes": now, "delta_bytes": now - before})
    del handles
    return {"rss_before_bytes": before, "loads": loads}


def _memory_child() -> None:
    """Entry point of the isolated measurement: JSON request on stdin, JSON answer on stdout."""
    from anelab.coreml_runtime import default_runtime

    request = json.loads(sys.stdin.read())
    try:
        answer = measure_load_memory(default_runtime(), request["package"], request["functions"],
                                     compute_units=request["compute_units"])
    except AnelabInputError as e:
        answer = {"error": str(e)}
    sys.stdout.write("\n" + json.dumps(answer) + "\n")


def load_memory_isolated(pkg: str | os.PathLike, functions: Sequence[str], *, compute_units: str = "cpu_and_ne",
                         timeout: float = MEMORY_CHILD_TIMEOUT) -> dict:
    """:func:`measure_load_memory` with this machine's runtime, in a fresh Python process."""
    check_compute_units(compute_units)
    request = json.dumps({"package": str(Path(pkg).resolve()), "functions": list(functions), "compute_units": compute_units})
    done = subprocess.run([sys.executable, "-c", "from anelab.studies import _memory_child; _memory_child()"],
                          input=request, capture_output=True, text=True, timeout=timeout)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    try:
        answer = json.loads(last)
    except json.JSONDecodeError:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise AnelabInputError(f"memory measurement of {Path(pkg).name} failed (exit {done.returncode}): {tail}") from None
    if "error" in answer:
        raise AnelabInputError(answer["error"])
    return answer


def memory_vs_functions(packages: dict[int, str | os.PathLike], *, compute_units: str = "cpu_and_ne",
                        measure: Callable[..., dict] | None = None, out_dir: str | os.PathLike | None = None) -> dict:
    """A ``load_memory`` record (origin measured): memory of loading one package's functions, by function count.

    packages: {n: package with n functions}. For each, in a fresh process (``measure`` defaults to
    :func:`load_memory_isolated`; tests pass a fake): load the first function, then every other one.
    results.rows: [{functions, first_function_delta_bytes, all_functions_delta_bytes, loads}].
    """
    from anelab.export import read_sidecar_metadata

    if not packages:
        raise AnelabInputError("memory_vs_functions needs at least one package")
    measure = measure or load_memory_isolated
    rows = []
    for n, pkg in tqdm(sorted(packages.items()), desc="memory by functions", unit="pkg"):
        functions = read_sidecar_metadata(pkg).functions
        result = measure(pkg, functions, compute_units=compute_units)
        loads = result["loads"]
        rows.append({"functions": int(n), "package": Path(pkg).parent.name + "/" + Path(pkg).name,
                     "first_function_delta_bytes": loads[0]["delta_bytes"],
                     "all_functions_delta_bytes": loads[-1]["delta_bytes"], "loads": loads})
    record = make_record("load_memory", {"compute_units": compute_units, "measure": "resident set size (psutil)",
                                         "isolated": measure is load_memory_isolated},
                         {"rows": rows}, origin="measured",
                         unknown=["memory the Neural Engine's own process (aned) holds for the program, "
                                  "which this process's resident set does not include"])
    if out_dir is not None:
        record = {**record, "_file": write_record(out_dir, record).name}
    return record


__all__ = [
    "AB_COMPUTE_UNITS", "BreakEven", "ab_table", "amdahl_ratio", "block_inputs", "break_even", "break_even_setup",
    "compact_provenance", "current_rss_bytes", "describe_plan", "export_function_sweep", "load_memory_isolated",
    "measure_load_memory", "memory_vs_functions", "offload_shares", "package_size", "package_size_record",
    "ratio_sweep", "recorded_ab_rows", "time_attention_ab",
]
