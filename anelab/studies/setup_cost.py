"""Notebook 04's back-end: package size vs functions, load memory, compositions."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.core.progress import tqdm
from anelab.core.records import make_record, read_records, write_record
from anelab.planner.catalogue import REFERENCE_CHUNK, REFERENCE_TOKENS, get_family
from anelab.planner.coreai_loads import coreai_ratios
from anelab.planner.load_flip import flip_load
from anelab.planner.plan import PrefillPlan, plan
from anelab.runtimes.coreml.assumptions import LOAD_FUNCTION_BY_NAME
from anelab.runtimes.coreml.coreml_runtime import default_runtime
from anelab.runtimes.interface import CoreMLRuntime, check_compute_units, package_functions
from anelab.sidecar.coremltools_import import coremltools_modules
from anelab.sidecar.export import export_layer
from anelab.sidecar.format import WEIGHTS_RELATIVE, require_package

MEMORY_CHILD_TIMEOUT = 900  # seconds one isolated memory measurement may take


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


def break_even(
    family: str | None = None, *, max_tokens: int | None = None, chunk: int | None = None, **plan_args
) -> BreakEven:
    """Search the prompt lengths 1..``max_tokens`` for those where the planner says offload wins.

    ``max_tokens`` defaults to the family's coverage cap (``max_history + chunk``) or, for a family
    without one, to 8 chunks. ``plan_args`` go to :func:`anelab.planner.plan`.

    Why a bisection per chunk count is exact: prompts with the same number of chunks
    (``(k-1)*chunk < P <= k*chunk``) visit the same variants and run the same padded ANE chunks, so
    setup and ANE attention are fixed while the GPU attention of the last chunk grows with its rows;
    non-attention time is in both arms. So the ANE arm wins (attention saved > setup) on an upper
    part of each such run — one threshold per chunk count — and the search bisects for it (about
    log2(chunk) planner calls per chunk instead of one per token). ``tests/studies/test_studies.py`` checks
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


# ---- measured here: package size against the number of functions ------------------------------
def package_size(pkg: str | os.PathLike) -> dict:
    """Bytes of one .mlpackage: ``weight_bytes`` (weight.bin), ``spec_bytes`` (model.mlmodel), ``total_bytes``
    (all files) — the spec counted without its user-defined metadata, which records the checkpoint's
    absolute path (a checkout elsewhere would change the sizes, not the programs)."""

    pkg = require_package(pkg)
    total = sum(f.stat().st_size for f in pkg.rglob("*") if f.is_file())
    weights = pkg / WEIGHTS_RELATIVE
    spec_file = pkg / "Data" / "com.apple.CoreML" / "model.mlmodel"
    spec_bytes = 0
    if spec_file.is_file():
        spec = coremltools_modules()[0].utils.load_spec(str(spec_file))
        spec.description.metadata.userDefined.clear()
        spec_bytes = len(spec.SerializeToString(deterministic=True))
        total -= spec_file.stat().st_size - spec_bytes
    return {
        "weight_bytes": weights.stat().st_size if weights.is_file() else 0,
        "spec_bytes": spec_bytes,
        "total_bytes": total,
    }


def export_function_sweep(
    checkpoint_dir: str | os.PathLike,
    out_root: str | os.PathLike,
    *,
    layer: int,
    chunk: int,
    counts: Sequence[int],
    gate=None,
) -> dict[int, Path]:
    """Export ``layer`` once per count n in ``counts``, with the n histories 0, chunk, ..., (n-1)*chunk.

    Returns {n: path of ``out_root/n<n>/layer_<L>.mlpackage``}. ``gate``: the ANE gate handed to
    :func:`anelab.sidecar.export.export_layer` (None: not gated, as off-Mac).
    """

    counts = sorted({int(n) for n in counts})
    if not counts or counts[0] < 1:
        raise AnelabInputError(f"function counts must be positive integers, got {list(counts)}")
    checkpoint = load_checkpoint(checkpoint_dir)
    packages = {}
    with tqdm(total=sum(counts), desc="export functions", unit="fn") as bar:
        for n in counts:
            bar.set_postfix_str(f"{n} functions")
            result = export_layer(
                checkpoint,
                layer,
                chunk,
                [i * chunk for i in range(n)],
                Path(out_root) / f"n{n}",
                gate=gate,
                progress=bar,
            )
            packages[n] = result.package
    return packages


def package_size_record(
    packages: dict[int, str | os.PathLike],
    *,
    layer: int,
    chunk: int,
    checkpoint: str,
    out_dir: str | os.PathLike | None = None,
) -> dict:
    """A ``package_size`` record (origin measured): the sizes of each package by its function count.

    results.rows: [{functions, weight_bytes, spec_bytes, total_bytes}] in function-count order;
    results.spec_bytes_per_function: the least-squares slope of the program bytes against the
    function count (None for a single package). Written to ``out_dir`` when given (``_file`` names it).
    """
    if not packages:
        raise AnelabInputError("package_size_record needs at least one package")
    rows = [{"functions": int(n), **package_size(p)} for n, p in sorted(packages.items())]
    per_function = (
        float(np.polyfit([r["functions"] for r in rows], [r["spec_bytes"] for r in rows], 1)[0])
        if len(rows) > 1
        else None
    )
    record = make_record(
        "package_size",
        {
            "checkpoint": checkpoint,
            "layer": layer,
            "chunk": chunk,
            "histories": "0, chunk, ..., (functions - 1) * chunk",
        },
        {"rows": rows, "spec_bytes_per_function": per_function},
        origin="measured",
        unknown=["how Core ML lays the package out once compiled (.mlmodelc), which is what loads"],
    )
    if out_dir is not None:
        record = {**record, "_file": write_record(out_dir, record).name}
    return record


# ---- measured on a Mac: resident memory against the number of functions (coremltools #2351) -----
def current_rss_bytes() -> int:
    """Resident set size of this process, in bytes."""
    import psutil

    return int(psutil.Process().memory_info().rss)


MEMORY_READ_WHEN = "after the package was compiled and coremltools imported, before the first load"


def measure_load_memory(
    runtime: CoreMLRuntime,
    pkg: str | os.PathLike,
    functions: Sequence[str],
    *,
    compute_units: str = "cpu_and_ne",
    rss: Callable[[], int] = current_rss_bytes,
) -> dict:
    """Resident memory as the functions of one package are loaded one after another (handles kept).

    Returns {"rss_before_bytes", "loads": [{"function", "rss_bytes", "delta_bytes"}], "read": ...},
    where ``delta_bytes`` is the growth since before the first load. The package is compiled (and
    the process's first-use work done) BEFORE the first reading, so every reading holds loads only.
    Run it in a fresh process (:func:`load_memory_isolated`) so earlier loads do not blur the numbers.
    """
    check_compute_units(compute_units)
    runtime.require_available()
    if not functions:
        raise AnelabInputError("measure_load_memory needs at least one function name")
    runtime.require_assumptions(LOAD_FUNCTION_BY_NAME)
    runtime.prepare_process()
    compiled = runtime.compile(pkg)  # not inside the window: a compile is not a load
    before = int(rss())
    handles, loads = [], []
    for name in functions:
        handles.append(runtime.load_path(compiled, name, compute_units))
        now = int(rss())
        loads.append({"function": name, "rss_bytes": now, "delta_bytes": now - before})
    del handles
    return {"rss_before_bytes": before, "loads": loads, "read": MEMORY_READ_WHEN}


def run_memory_child() -> None:
    """Entry point of the isolated measurement: JSON request on stdin, JSON answer on stdout."""

    request = json.loads(sys.stdin.read())
    try:
        answer = measure_load_memory(
            default_runtime(), request["package"], request["functions"], compute_units=request["compute_units"]
        )
    except AnelabInputError as e:
        answer = {"error": str(e)}
    sys.stdout.write("\n" + json.dumps(answer) + "\n")


def load_memory_isolated(
    pkg: str | os.PathLike,
    functions: Sequence[str],
    *,
    compute_units: str = "cpu_and_ne",
    timeout: float = MEMORY_CHILD_TIMEOUT,
) -> dict:
    """:func:`measure_load_memory` with this machine's runtime, in a fresh Python process."""
    check_compute_units(compute_units)
    request = json.dumps(
        {"package": str(Path(pkg).resolve()), "functions": list(functions), "compute_units": compute_units}
    )
    done = subprocess.run(
        [sys.executable, "-c", "from anelab.studies.setup_cost import run_memory_child; run_memory_child()"],
        input=request,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    try:
        answer = json.loads(last)
    except json.JSONDecodeError:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise AnelabInputError(
            f"memory measurement of {Path(pkg).name} failed (exit {done.returncode}): {tail}"
        ) from None
    if "error" in answer:
        raise AnelabInputError(answer["error"])
    return answer


def memory_vs_functions(
    packages: dict[int, str | os.PathLike],
    *,
    compute_units: str = "cpu_and_ne",
    measure: Callable[..., dict] | None = None,
    out_dir: str | os.PathLike | None = None,
) -> dict:
    """A ``load_memory`` record (origin measured): memory of loading one package's functions, by function count.

    packages: {n: package with n functions}. For each, in a fresh process (``measure`` defaults to
    :func:`load_memory_isolated`; tests pass a fake): load the first function, then every other one.
    results.rows: [{functions, first_function_delta_bytes, all_functions_delta_bytes, loads}].
    """

    if not packages:
        raise AnelabInputError("memory_vs_functions needs at least one package")
    measure = measure or load_memory_isolated
    rows = []
    for n, pkg in tqdm(sorted(packages.items()), desc="memory by functions", unit="pkg"):
        functions = package_functions(pkg)  # c<C> (and c1) for a stateful package, h<H> otherwise
        result = measure(pkg, functions, compute_units=compute_units)
        loads = result["loads"]
        rows.append(
            {
                "functions": int(n),
                "package": Path(pkg).parent.name + "/" + Path(pkg).name,
                "first_function_delta_bytes": loads[0]["delta_bytes"],
                "all_functions_delta_bytes": loads[-1]["delta_bytes"],
                "loads": loads,
            }
        )
    record = make_record(
        "load_memory",
        {
            "compute_units": compute_units,
            "measure": "resident set size (psutil)",
            "read": MEMORY_READ_WHEN,
            "isolated": measure is load_memory_isolated,
        },
        {"rows": rows},
        origin="measured",
        unknown=[
            "memory the Neural Engine's own process (aned) holds for the program, "
            "which this process's resident set does not include"
        ],
    )
    if out_dir is not None:
        record = {**record, "_file": write_record(out_dir, record).name}
    return record


# ---- Core ML against Core AI ------------------------------------------------------------------------------
def coreai_setup_comparison(records_dir, data_dir=None, family: str = "qwen3.8-125b-a6b-4bit") -> dict:
    """What notebook 04's Core ML vs Core AI figure draws, at the seed's workload (``REFERENCE_TOKENS``):
    the family's per-variant loads as Core ML records them (the variants the prompt visits), the per-variant
    load at which its verdict turns to the ANE (``planner.load_flip.flip_load``), and — where ``anelab
    measure`` recorded Core AI beside Core ML on a Mac (``records_dir``) — each Core AI mode's per-variant
    price (its Core AI / Core ML ratio times the family's loads) and the cold specialization against the
    number of entrypoints. ``coreai`` / ``per_count`` are empty until such records exist."""

    base = plan(REFERENCE_TOKENS, family=family, data_dir=data_dir)
    loads = {int(h): v["seconds"] for h, v in base.load_seconds.items()}
    flip = flip_load(base, data_dir)
    ratios = coreai_ratios(records_dir)
    # the setup is linear in a uniform scale of the loads: the plan turns to the ANE iff the ratio is below the flip's
    coreai = {mode: {"ratio": r.ratio, "per_variant_s": r.ratio * flip["load_per_variant_s"], "machine": r.machine,
                     "turns_to_ane": r.ratio < flip["max_fraction_of_loads"]} for mode, r in ratios.items()}  # fmt: skip
    per_count = []
    if ratios and Path(records_dir).is_dir():
        sweep = [r for r in read_records(records_dir, kind="coreai_specialization")
                 if r["parameters"].get("sweep") == "entrypoint_count"
                 and str(r["provenance"].get("os_version", "")).startswith("macOS")]  # fmt: skip
        per_count = sorted((r["parameters"]["entrypoints"], r["results"]["median_s"]) for r in sweep)
    return {"family": family, "prompt_tokens": REFERENCE_TOKENS, "recorded_loads_s": loads, "flip": flip,
            "coreai": coreai, "per_count": per_count}  # fmt: skip
