"""Timing of sidecar loads and predictions: warm-up, N repeats, min / median / max, written as records.

Three measurements from the ANE prefill research seed ("Qwen 3.8: the ANE loses"):

- ``time_load``: load of one function from a compiled copy of the package. Cold: every repeat
  compiles a FRESH copy (untimed, its compile time reported apart) and times the first load of it;
  warm: the package is compiled once and the same compiled path is loaded again after a warm-up.
- ``time_compositions``: the same function loaded from different package compositions (alone;
  beside another history; beside a variant that cannot load) — does the load track the function's
  own specialisation or the package?;
- ``time_predict``: one prediction per compute-units setting, inputs converted once (untimed; the
  conversion is timed apart) and a failed prediction recorded as an error, not fatal. Each sample
  is the wall time of ``predict`` AND Core ML's own predict duration; their gap is the conversion
  share. A package the ANE gate never passed is predicted under ``cpu_and_ne`` / ``all`` only in a
  child process (a failed ANE compile can kill the process, apple/coremltools#2758).

Every timing record names its components (``parameters.components``) and what the process did
before the clock started (``parameters.before_clock``: the import of coremltools and its first-use
``sw_vers``, ``CoreMLRuntime.prepare_process``). The clock stops while the handle is still alive
(a handle's release — unloading the model — is not part of a load). Each returns a record
(``anelab.core.records.make_record``, origin ``"measured"``) and writes it to ``out_dir`` when one is given. ``clock`` is
injectable so tests run on a fake clock.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anelab.core.errors import AnelabInputError
from anelab.core.progress import tqdm
from anelab.core.records import make_record, write_record
from anelab.runtimes.child import ANSWER_PREFIX, read_answer, run_child, write_answer  # noqa: F401 - ANSWER_PREFIX, read_answer: also imported from here
from anelab.runtimes.coreml.assumptions import CORE_ML_LOAD_DURATION, CORE_ML_PREDICT_DURATION, FRESH_COPY_COMPILES_COLD
from anelab.runtimes.interface import (
    CHILD_TIMED_OUT,
    FIRST_USE_OFF_ANE,
    NEURAL_ENGINE_UNITS,
    PREFLIGHT_LOAD_STEPS,
    CoreMLRuntime,
    RuntimeLoadError,
    RuntimePredictError,
    check_compute_units,
    describe_child_exit,
    gate_verdict,
    prepare_inputs,
    runtime_from_spec,
    spec_for_child,
)
from anelab.sidecar.format import require_package

COMPUTE_UNITS_ORDER = ("cpu_only", "cpu_and_gpu", "cpu_and_ne", "all")


# what a cold load can and cannot rule out (goes into every cold record's "unknown")
COLD_LOAD_CAVEAT = (
    "whether Core ML's system-wide ANE compile cache (aned) served the fresh compiled copy, and what the "
    "process had loaded before (a cold load is the first load of a freshly compiled .mlmodelc in this process)"
)


COLD_CHILD_TIMEOUT_S = 1800.0  # one cold load of a large variant (the ANE compile) can take minutes


WARM_LOAD_MEANING = "the next load of the same compiled .mlmodelc path, after a warm-up load of it"


LOAD_COMPONENTS = {
    "samples_s": "the load call alone: CompiledMLModel(<copy>.mlmodelc, compute units, function_name) = argument "
    "checks + [MLModel modelWithContentsOfURL:configuration:] (coremltools 9.0 CoreMLPython.mm:445-519); "
    "no import, no sw_vers (done before the clock, see before_clock), no compile",
    "core_ml_load_s": "modelWithContentsOfURL alone, Core ML's own load duration (CoreMLPython.mm:500-503)",
    "compile": "ct.utils.compile_model of each fresh copy, timed on its own (cold loads only)",
}


PREDICT_COMPONENTS = {
    "samples_s": "wall time of one predict call: coremltools wraps the prepared arrays as MLMultiArray "
    "(CoreMLPythonUtils.mm:45-66), Core ML predicts, the outputs are converted to NumPy (fp16 outputs "
    "concatenated to fp32 and copied, CoreMLPythonUtils.mm:443-487)",
    "core_ml_predict_s": "[MLModel predictionFromFeatures:] alone, Core ML's own duration (CoreMLPython.mm:543-562)",
    "conversion_share": "1 - median core_ml_predict_s / median samples_s: the share of the wall time spent "
    "converting inputs and outputs outside Core ML",
    "input_conversion_s": "prepare_inputs once before the timed calls (contiguous arrays, fp16 -> fp32); "
    "not in samples_s",
}


PREDICT_CHILD_TIMEOUT_S = 1800.0  # a first predict under the Neural Engine compiles for it (minutes when large)


@dataclass(frozen=True)
class TimingStats:
    """Seconds of each timed repeat (warm-ups excluded) and their min / median / max."""

    min: float
    median: float
    max: float
    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: list[float]) -> TimingStats:
        if not samples:
            raise AnelabInputError("no timing samples; repeats must be >= 1")
        return cls(min(samples), statistics.median(samples), max(samples), tuple(samples))

    def to_dict(self) -> dict:
        return {"min_s": self.min, "median_s": self.median, "max_s": self.max, "samples_s": list(self.samples)}


def _check_counts(warmup: int, repeats: int) -> None:
    if int(warmup) < 0:
        raise AnelabInputError(f"warmup must be >= 0, got {warmup}")
    if int(repeats) < 1:
        raise AnelabInputError(f"repeats must be >= 1, got {repeats}")


def measure(
    fn: Callable[..., Any],
    warmup: int = 1,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    setup: Callable[[], Any] | None = None,
    desc: str | None = None,
    keep: Callable[[Any], None] | None = None,
) -> TimingStats:
    """Call ``fn`` ``warmup`` times untimed, then ``repeats`` times timed with ``clock``.

    ``setup``: when given, called before every call (untimed) and its result passed to ``fn``.
    The clock is read while ``fn``'s result is still referenced, so releasing it (e.g. a model
    handle's teardown) is never timed; ``keep`` receives each result after the clock stopped.
    """
    _check_counts(warmup, repeats)

    def call():
        arg = setup() if setup is not None else None
        start = clock()
        result = fn(arg) if setup is not None else fn()
        elapsed = clock() - start
        if keep is not None:
            keep(result)
        del result  # released after the clock stopped
        return elapsed

    for _ in range(int(warmup)):
        call()
    samples = [
        call() for _ in tqdm(range(int(repeats)), desc=desc or "timing", unit="run", disable=desc is None, leave=False)
    ]
    return TimingStats.of(samples)


def _finish(kind: str, parameters: dict, results: dict, unknown: list[str], out_dir) -> dict:
    if FIRST_USE_OFF_ANE in parameters.get("before_clock", []):  # the ANE's first use fell in a timed call
        unknown = [*unknown, FIRST_USE_OFF_ANE]
    record = make_record(kind, parameters, results, origin="measured", unknown=unknown)
    if out_dir is not None:
        path = write_record(out_dir, record)
        record = {**record, "_file": path.name}
    return record


def _fresh_compile_factory(runtime: CoreMLRuntime, pkg: Path, work: Path, clock, compile_s: list) -> Callable:
    """Each call compiles ``pkg`` into a new ``.mlmodelc`` (a new path: no path-keyed cache applies)."""
    counter = iter(range(1, 1_000_000))

    def make() -> Path:
        dest = work / f"copy-{next(counter)}" / f"{pkg.stem}.mlmodelc"
        dest.parent.mkdir(parents=True)
        start = clock()
        compiled = runtime.compile_to(pkg, dest)
        compile_s.append(clock() - start)
        return compiled

    return make


def time_load(
    runtime: CoreMLRuntime,
    pkg: str | os.PathLike,
    function: str | None,
    compute_units: str,
    *,
    cold: bool = True,
    warmup: int = 1,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    out_dir: str | os.PathLike | None = None,
    fresh_process: bool = False,
) -> dict:
    """Seconds to load ``function`` of ``pkg`` from a compiled copy (kind ``load_timing``).

    cold=True: every load (warm-ups too) is the first load of a freshly compiled copy at a new path;
    the compile is not timed with the load (its seconds are ``results.compile``). With
    ``fresh_process`` each cold load runs in a new Python process (nothing loaded before it there).
    cold=False: the package's cached compiled copy; ``warmup`` loads of it, then the timed loads.
    ``results.core_ml_load_s``: Core ML's own load durations where coremltools exposes them.
    """

    check_compute_units(compute_units)
    runtime.require_available()
    runtime.require_assumptions(CORE_ML_LOAD_DURATION, compute_units=compute_units)
    if cold:  # a fresh copy at a new path loads cold only where no content-keyed cache serves it (ANE-only row)
        runtime.require_assumptions(FRESH_COPY_COMPILES_COLD, compute_units=compute_units)
    pkg = require_package(pkg)
    in_children = cold and fresh_process
    before_clock = runtime.prepare_process("cpu_only" if in_children else compute_units)
    if compute_units in NEURAL_ENGINE_UNITS and not in_children and not runtime.is_child:
        runtime.preflight(pkg, function, compute_units, PREFLIGHT_LOAD_STEPS)  # its loads below compile here
    work = Path(tempfile.mkdtemp(prefix=".anelab-load-")) if cold else None
    compile_s: list[float] = []
    own: list[float] = []

    def keep(handle):
        value = runtime.load_duration_s(handle)
        if value is not None:
            own.append(value)

    try:
        if cold and fresh_process:
            fresh_copy = _fresh_compile_factory(runtime, pkg, work, clock, compile_s)
            stats = measure_in_fresh_processes(
                runtime, fresh_copy, function, compute_units, warmup=warmup, repeats=repeats, own=own
            )
        elif cold:
            stats = measure(
                lambda path: runtime.load_path(path, function, compute_units),
                warmup=warmup,
                repeats=repeats,
                clock=clock,
                setup=_fresh_compile_factory(runtime, pkg, work, clock, compile_s),
                desc=f"cold load {function or pkg.stem}",
                keep=keep,
            )
        else:
            compiled = runtime.compile(pkg)
            stats = measure(
                lambda: runtime.load_path(compiled, function, compute_units),
                warmup=warmup,
                repeats=repeats,
                clock=clock,
                desc=f"warm load {function or pkg.stem}",
                keep=keep,
            )
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    parameters = _load_parameters(runtime, pkg, function, compute_units, cold, fresh_process, warmup, repeats)
    parameters["before_clock"] = fresh_before_clock(compute_units) if in_children else before_clock
    results = stats.to_dict()
    if compile_s:
        results["compile"] = TimingStats.of(compile_s).to_dict()
    results["core_ml_load_s"] = own[-int(repeats) :] if own else None
    return _finish("load_timing", parameters, results, [COLD_LOAD_CAVEAT] if cold else [], out_dir)


def _load_parameters(runtime, pkg: Path, function, compute_units, cold, fresh_process, warmup, repeats) -> dict:
    """A load record's parameters: what was loaded, how, what a sample holds (``components``)."""
    meaning = "first load of a freshly compiled .mlmodelc" + (", in a fresh process" if fresh_process else "")
    return {
        "package": pkg.name,
        "function": function,
        "compute_units": compute_units,
        "cold": bool(cold),
        "meaning": meaning if cold else WARM_LOAD_MEANING,
        "warmup": int(warmup),
        "repeats": int(repeats),
        "runtime": runtime.name,
        "load": runtime.load_description,
        "components": LOAD_COMPONENTS,
    }


def fresh_before_clock(compute_units: str) -> list[str]:
    """What each fresh cold-load process did before its clock started (``cold_load_child``)."""
    return [
        "started a new Python process and rebuilt the runtime",
        f"CoreMLRuntime.prepare_process({compute_units!r}): imported coremltools, ran its first-use sw_vers, and "
        f"loaded and predicted a tiny model under {compute_units} (Core ML's own first use of the process)",
    ]


def cold_load_child() -> None:
    """Entry point of a fresh-process cold load: JSON request on stdin, JSON answer as the last stdout line.

    The process imports coremltools, does its first-use work and has a tiny model pay Core ML's first
    load under the same compute units (``prepare_process``) BEFORE the clock starts, so the sample is the
    load call alone (``CoreMLPython.mm:500-503`` times the process's first load with Core ML's first use in it).
    """

    request = json.loads(sys.stdin.read())
    runtime = runtime_from_spec(request["runtime"])
    clock = getattr(runtime, "clock", time.perf_counter)  # a fake's own clock; perf_counter on a Mac
    before_clock = runtime.prepare_process(request["compute_units"])
    start = clock()
    handle = runtime.load_path(request["path"], request["function"], request["compute_units"])
    seconds = clock() - start
    answer = {"seconds": seconds, "core_ml_load_s": runtime.load_duration_s(handle), "before_clock": before_clock}
    write_answer(answer)


def _run_child(entry: str, request: dict, timeout: float) -> tuple[int, dict | None, str]:
    """Run ``entry`` in a new Python process (``runtimes.child``); (exit status, answer or None, why: the last
    stderr line, or what was wrong with its answer). A Core ML child's answer counts only when it exited 0."""
    run = run_child(entry, request, timeout)
    if run.returncode == CHILD_TIMED_OUT:
        return CHILD_TIMED_OUT, None, f"no answer within {timeout:.0f} s"
    if run.returncode != 0:
        return run.returncode, None, run.stderr_tail(200)
    answer, why = read_answer(run.stdout)
    return run.returncode, answer, why or run.stderr_tail(200)


def measure_in_fresh_processes(runtime, fresh_copy, function, compute_units, *, warmup, repeats, own) -> TimingStats:
    """Cold loads, each in a new Python process rebuilt from ``runtime.child_spec()``; the copy is made here."""
    _check_counts(warmup, repeats)
    samples = []
    for i in tqdm(range(int(warmup) + int(repeats)), desc=f"cold load {function} (fresh process)", leave=False):
        request = {"runtime": spec_for_child(runtime), "path": str(fresh_copy()), "function": function,
                   "compute_units": compute_units}  # fmt: skip
        code, answer, tail = _run_child("anelab.runtimes.coreml.timing:cold_load_child", request, COLD_CHILD_TIMEOUT_S)
        if answer is None:
            raise RuntimeLoadError(
                f"{function}: the cold load in a fresh process failed (it {describe_child_exit(code)}): {tail}"
            )
        if i >= int(warmup):
            samples.append(float(answer["seconds"]))
            if answer["core_ml_load_s"] is not None:
                own.append(float(answer["core_ml_load_s"]))
    return TimingStats.of(samples)


def time_compositions(
    runtime: CoreMLRuntime,
    packages: dict[str, str | os.PathLike],
    function: str,
    *,
    compute_units: str = "cpu_and_ne",
    cold: bool = True,
    warmup: int = 1,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    out_dir: str | os.PathLike | None = None,
) -> dict:
    """Seconds to load the same ``function`` from each package composition (kind ``composition_load_timing``).

    packages: label -> package, e.g. {"alone": h0-only, "beside_h4096": h0+h4096,
              "beside_unloadable": h0 + a variant that cannot load}. The function must load from each;
              one that does not is refused naming the composition.
    Results: {label: {min_s, median_s, max_s, samples_s, ...}}, measured in one run so they compare.
    """
    check_compute_units(compute_units)
    runtime.require_available()
    if not packages:
        raise AnelabInputError("time_compositions needs at least one package composition")
    results, unknown = {}, []
    for label, pkg in tqdm(packages.items(), desc=f"compositions of {function}", unit="pkg", leave=False):
        try:
            record = time_load(
                runtime,
                pkg,
                function,
                compute_units,
                cold=cold,
                warmup=warmup,
                repeats=repeats,
                clock=clock,
                out_dir=None,
            )
        except RuntimeLoadError as e:
            raise AnelabInputError(f"composition {label!r}: {function} does not load from it ({e})") from e
        results[label] = {**record["results"], "package": Path(pkg).name}
        unknown = record["unknown"]
    parameters = {
        "function": function,
        "compute_units": compute_units,
        "cold": bool(cold),
        "warmup": int(warmup),
        "repeats": int(repeats),
        "compositions": list(packages),
        "runtime": runtime.name,
        "load": runtime.load_description,
    }
    return _finish("composition_load_timing", parameters, results, unknown, out_dir)


def _predict_one_setting(runtime, pkg, function, inputs, unit, *, stateful, warmup, repeats, clock) -> dict:
    """Load (untimed), convert the inputs once (timed apart), time predict (wall and Core ML's own
    duration); errors become entries. Runs in whichever process calls it."""
    try:
        handle = runtime.load(pkg, function, unit)
    except RuntimeLoadError as e:
        return {"error": " ".join(str(e).split())}
    start = clock()
    ready = prepare_inputs(inputs)
    conversion_s = clock() - start
    own: list[float | None] = []
    try:
        state = runtime.make_state(handle) if stateful else None
        stats = measure(
            lambda: runtime.predict(handle, ready, state=state),
            warmup=warmup,
            repeats=repeats,
            clock=clock,
            desc=f"predict {function} {unit}",
            keep=lambda _: own.append(runtime.predict_duration_s(handle)),
        )
    except (RuntimePredictError, RuntimeError, KeyError, ValueError, TypeError) as e:
        return {"error": f"predict: {' '.join(str(e).split())}"}
    core_ml = [s for s in own[-int(repeats) :] if s is not None]
    result = {**stats.to_dict(), "input_conversion_s": conversion_s, "core_ml_predict_s": None}
    if len(core_ml) == int(repeats):
        result["core_ml_predict_s"] = TimingStats.of(core_ml).to_dict()
        result["conversion_share"] = 1.0 - statistics.median(core_ml) / stats.median if stats.median > 0 else None
    return result


def predict_timing_child() -> None:
    """Entry point of a predict timed in a child process: JSON request on stdin (inputs in an .npz)."""
    import numpy as np

    request = json.loads(sys.stdin.read())
    runtime = runtime_from_spec(request["runtime"])
    with np.load(request["inputs"]) as data:
        inputs = {name: data[name] for name in data.files}
    runtime.prepare_process(request["compute_units"])
    clock = getattr(runtime, "clock", time.perf_counter)
    result = _predict_one_setting(
        runtime, Path(request["package"]), request["function"], inputs, request["compute_units"],
        stateful=request["with_state"], warmup=request["warmup"], repeats=request["repeats"], clock=clock,
    )  # fmt: skip
    write_answer(result)


def _predict_in_child(runtime, pkg, function, inputs, unit, *, stateful, warmup, repeats) -> dict:
    """``_predict_one_setting`` in a new Python process: a crash there is recorded, not shared."""
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="anelab-predict-") as work:
        np.savez(Path(work) / "inputs.npz", **{name: np.asarray(value) for name, value in inputs.items()})
        request = {
            "runtime": spec_for_child(runtime), "package": str(Path(pkg).resolve()), "function": function,
            "inputs": str(Path(work) / "inputs.npz"), "compute_units": unit, "with_state": bool(stateful),
            "warmup": int(warmup), "repeats": int(repeats),
        }  # fmt: skip
        code, answer, tail = _run_child(
            "anelab.runtimes.coreml.timing:predict_timing_child", request, PREDICT_CHILD_TIMEOUT_S
        )
    if answer is None:
        return {"error": f"predict in a child process: it {describe_child_exit(code)} ({tail})"}
    return answer


def time_predict(
    runtime: CoreMLRuntime,
    pkg: str | os.PathLike,
    function: str | None,
    inputs: dict,
    compute_units_list: list[str] | tuple[str, ...] = COMPUTE_UNITS_ORDER,
    *,
    stateful: bool = False,
    warmup: int = 1,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    out_dir: str | os.PathLike | None = None,
) -> dict:
    """Seconds per ``predict`` of ``function`` for each compute-units setting (kind ``predict_timing``).

    The function is loaded once per setting (untimed, from the compiled copy). The inputs are
    converted once as Core ML takes them (``prepare_inputs``; ``input_conversion_s``), so the timed
    call is the prediction only. A setting under which it does not load or predict is recorded as
    ``{"error": ...}`` rather than ending the run. ``stateful``: each setting gets a fresh state.
    inputs: name -> array, e.g. hidden [C, D], k_history / v_history [H, Hkv, d], mask [C, H + C].
    """
    units = [check_compute_units(u) for u in compute_units_list]
    if not units:
        raise AnelabInputError("time_predict needs at least one compute-units setting")
    runtime.require_available()
    for unit in units:
        runtime.require_assumptions(CORE_ML_PREDICT_DURATION, compute_units=unit)
    pkg = Path(pkg)
    verdict = gate_verdict(pkg)
    here = [u for u in units if u not in NEURAL_ENGINE_UNITS or verdict == "true"]  # the rest: in a child each
    before_clock = runtime.prepare_process(tuple(here) or "cpu_only")
    results, processes = {}, {}
    for unit in units:
        if unit in NEURAL_ENGINE_UNITS and verdict != "true":  # never in this process: #2758 can kill it
            processes[unit] = f"a child process (the ANE gate never passed this package: aneCompileVerified {verdict})"
            results[unit] = _predict_in_child(
                runtime, pkg, function, inputs, unit, stateful=stateful, warmup=warmup, repeats=repeats
            )
        else:
            processes[unit] = "this process"
            results[unit] = _predict_one_setting(
                runtime, pkg, function, inputs, unit, stateful=stateful, warmup=warmup, repeats=repeats, clock=clock
            )
    shapes = {name: list(getattr(value, "shape", ())) for name, value in inputs.items()}
    parameters = {
        "package": pkg.name,
        "function": function,
        "compute_units": units,
        "warmup": int(warmup),
        "repeats": int(repeats),
        "input_shapes": shapes,
        "runtime": runtime.name,
        "timed": "predict only; inputs converted once beforehand (input_conversion_s)",
        "components": PREDICT_COMPONENTS,
        "before_clock": before_clock,
        "process": processes,
    }
    return _finish("predict_timing", parameters, results, [], out_dir)
