"""The ANE gate: what ``aneCompileVerified: true`` has to prove, each variant in its own process.

"Core ML stayed quiet" is not "the Neural Engine got the graph" (ANE prefill research seed,
"Making 'verified' mean something"). Before anything is loaded the gate refuses a machine that is
not arm64 or where Core ML lists no Neural Engine. Then, per single-function variant, in a CHILD
process (a first predict can kill the process, apple/coremltools#2758; a compute plan of the wrong
path aborts it, #2757):

1. the variant is compiled once and loaded from its compiled copy (``cpu_and_ne``);
2. one prediction runs on zero inputs (ANE compile failures are also reported at first inference);
3. the compute plan of that compiled copy counts the operations that prefer the Neural Engine —
   zero, or no operations at all, refuses (the silent case: nothing printed, the graph on the CPU).

After the merge, every function of the merged package is loaded under its name AND predicted once, again
in a child: each function of a merged ``.mlmodelc`` is compiled for the Neural Engine by whichever process
loads it (coremltools 9.0 ``CoreMLPython.mm:489-503``), so surviving the variant is not surviving the merge.
``preflight`` does the same for any package before its first Neural Engine load or compute plan in the
measuring process (``CoreMLRuntime.load``), once per package content, function, setting and Mac.

The child's fd 1 and fd 2 are captured per step (and whatever reaches them until it exits, since
Core ML may print only at exit), and the unified log of the child is read for its lifetime (Core
ML's ``[espresso]``/``[coreml]`` lines reach neither fd). A known ANE compiler failure in any of
them refuses; a crash or signal refuses naming it and the step.

``anelab.sidecar.export.export_layer`` calls ``check_variants`` before merging and
``check_merged_loads`` after; only when both pass does it write ``aneCompileVerified: true``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from anelab.runtimes.child import run_child as run_python_child
from anelab.runtimes.coreml.assumptions import (
    COMPILE_TO_MLMODELC,
    COMPUTE_PLAN_OF_COMPILED,
    CORE_ML_LOGS_FOR_CLIENT,
    FP16_OUTPUTS_AS_FP32,
    FP32_FEEDS_FP16_INPUTS,
    LOAD_FUNCTION_BY_NAME,
    MERGED_LIKE_VARIANT,
    NATIVE_OUTPUT_ON_FDS,
    STATE_BY_NAME,
    UNIFIED_LOG_READABLE,
)
from anelab.runtimes.interface import (
    CORE_ML_HELPERS,
    PREFLIGHT_LOAD_STEPS,
    CoreMLRuntime,
    PreflightRefusedError,
    UnifiedLogUnavailable,
    capture_native_output,
    describe_child_exit,
    prepare_inputs,
    runtime_from_spec,
    spec_for_child,
    zero_inputs,
)

# The compute units every gate step asks for: CPU + Neural Engine, so an ANE refusal cannot hide
# behind a GPU placement (with "all", Core ML may legitimately prefer the GPU).
GATE_COMPUTE_UNITS = "cpu_and_ne"


# what a child's steps rely on (the parent makes sure they were probed before it starts one: a child never probes)
CHILD_STEP_ASSUMPTIONS = (COMPILE_TO_MLMODELC, LOAD_FUNCTION_BY_NAME, STATE_BY_NAME, FP32_FEEDS_FP16_INPUTS,
                          FP16_OUTPUTS_AS_FP32)  # fmt: skip


# the Core ML behaviours the gate's evidence rests on (refused by name when the probe found one false)
GATE_ASSUMPTIONS = (
    *CHILD_STEP_ASSUMPTIONS,
    COMPUTE_PLAN_OF_COMPILED,
    NATIVE_OUTPUT_ON_FDS,
    UNIFIED_LOG_READABLE,
    MERGED_LIKE_VARIANT,
)
# CORE_ML_LOGS_FOR_CLIENT is not among them: where Core ML's lines are redacted or not persisted the gate still
# judges on the compute plan and a survived predict, and its evidence carries that caveat (``unified_log_caveat``)


CHILD_TIMEOUT_S = 1800.0  # an ANE compile of a large variant takes minutes; a VM without an ANE can hang
CHILD_TIMEOUT_TEXT = f"did not finish within {CHILD_TIMEOUT_S:.0f} s (a hung ANE compile?)"


VERIFIED_REASON = (
    "verified: each variant, in its own process, loaded from its compiled copy, ran one prediction on zero "
    "inputs with no ANE compiler failure on fd 1, fd 2, at exit or in the unified log, and had operations "
    "assigned to the Neural Engine by the compute plan of that compiled copy (cpu_and_ne); every function "
    "of the merged package loaded under its name and ran one prediction, in a child process (cpu_and_ne)"
)


class AneGateError(RuntimeError):
    """The Neural Engine did not get the sidecar (one line, names the function and the evidence)."""

    def __init__(self, message: str, *, function: str | None = None, stderr_text: str = ""):
        super().__init__(" ".join(str(message).split()))
        self.function = function
        self.stderr_text = stderr_text


@dataclass(frozen=True)
class StderrMarker:
    """A line Core ML prints (fd 1, fd 2 or the unified log) when the Neural Engine refuses a model."""

    name: str  # what the marker is called in messages and evidence
    pattern: str  # regular expression searched per line of the captured text
    source: str  # where it is documented


# ANE compiler names: an E5RT line is a refusal only when it names one of them (E5RT also reports
# translation errors that have nothing to do with the Neural Engine).
ANE_COMPILER_NAMES = r"(?:MILCompilerForANE|MILCompileForANE|ANECCompile|_ANECompiler|ANECF|ANEF\b)"


ANE_REFUSAL_MARKERS: tuple[StderrMarker, ...] = (
    StderrMarker(
        "ANECCompile() FAILED",
        r"ANECCompile\([^)\n]*\) FAILED",
        "apple/coremltools#2247, #2758 (load returns after it), #1548 (path inside the parentheses); "
        "apple/ml-stable-diffusion#255; the ANE prefill research seed",
    ),
    StderrMarker(
        "MILCompilerForANE error",
        r"MILCompilerForANE error",
        "apple/coremltools#2247, #2758; the ANE prefill research seed",
    ),
    StderrMarker(
        "MILCompileForANE error",
        r"MILCompileForANE error",
        "apple/ml-stable-diffusion#255 (iOS 17 spelling of the same E5RT message)",
    ),
    StderrMarker(
        "E5RT with an ANE compiler error",
        r"E5RT\b.*" + ANE_COMPILER_NAMES,
        "apple/coremltools#2247, #2758 ('E5RT encountered an STL exception. msg = MILCompilerForANE error ...'); "
        "an E5RT line without an ANE compiler name is not ANE-specific",
    ),
    StderrMarker(
        "ANECF error",
        r"ANECF error",
        "apple/coremltools#1548; apple/ml-stable-diffusion#26 ('failed to load ANE model ... Program load failure')",
    ),
    StderrMarker(
        "Error plan build",
        r"Error plan build: -?\d+",
        "apple/coremltools#1548, #2247; apple/ml-stable-diffusion#26 (unified log, follows the ANE failure)",
    ),
    StderrMarker(
        "ANE inference operation failed",
        r"ANE inference operation failed",
        "ggml-org/whisper.cpp#3702 (at inference; Core ML then falls back to the GPU)",
    ),
    StderrMarker(
        "ANEProgramProcessRequestDirect() Failed",
        r"ANEProgramProcessRequestDirect\(\) Failed",
        "huggingface/swift-coreml-diffusers#80 ('Program Inference error', at predict)",
    ),
)


def find_refusal_markers(text: str, markers: tuple[StderrMarker, ...] = ANE_REFUSAL_MARKERS) -> list[str]:
    """Names of the markers that occur in ``text`` (in ``markers`` order; matched line by line)."""
    lines = text.splitlines()
    return [m.name for m in markers if any(re.search(m.pattern, line) for line in lines)]


def _first_line_with(text: str, marker_name: str) -> str:
    marker = next(m for m in ANE_REFUSAL_MARKERS if m.name == marker_name)
    for line in text.splitlines():
        if re.search(marker.pattern, line):
            return line.strip()[:160]
    return marker_name


# ---- the child process -----------------------------------------------------------------------------
def _child_steps(runtime: CoreMLRuntime, request: dict, record) -> None:
    """Run the requested steps, recording each step's captured fd 1 / fd 2 before and after it."""
    pkg, units = Path(request["package"]), request["compute_units"]
    for function in request["functions"]:
        for step in request["steps"]:
            record(function, step, "started")
            with capture_native_output() as out:
                try:
                    if step == "load":
                        handle = runtime.load(pkg, function, units)
                    elif step == "predict":
                        sig = runtime.signature(pkg, function)
                        state = runtime.make_state(handle) if sig.states else None
                        runtime.predict(handle, prepare_inputs(zero_inputs(sig)), state=state)
                    elif step == "plan":
                        record(function, step, "assignment", runtime.compute_plan_assignment(pkg, units))
                    error = None
                except Exception as e:  # recorded; the parent refuses naming the step
                    error = f"{type(e).__name__}: {' '.join(str(e).split())}"
            record(function, step, "output", {"stdout": out.stdout, "stderr": out.stderr})
            if error is not None:
                record(function, step, "error", error)
                return
            record(function, step, "done")


def child_main() -> None:
    """Entry point of a gate child: JSON request on stdin; results appended to the request's result file."""
    request = json.loads(sys.stdin.read())
    runtime = runtime_from_spec(request["runtime"])
    result_path = Path(request["result"])

    def record(function, step, what, value=None):
        with open(result_path, "a") as f:
            f.write(json.dumps({"function": function, "step": step, "what": what, "value": value}) + "\n")

    _child_steps(runtime, request, record)


@dataclass
class ChildReport:
    """What one gate child did: per-step events, its exit, and every text it left behind."""

    events: list[dict]
    returncode: int
    leftover_stdout: str  # fd 1 / fd 2 outside the per-step captures (e.g. printed at exit)
    leftover_stderr: str
    unified_log: str
    texts: list[tuple[str, str, str | None]] = field(default_factory=list)  # (where, text, function or None)
    unified_log_error: str = ""  # why the unified log could not be read ("": it was read)

    def last_step(self) -> tuple[str, str]:
        started = [e for e in self.events if e["what"] == "started"]
        return (started[-1]["function"], started[-1]["step"]) if started else ("", "start")

    def value(self, function: str, step: str, what: str):
        for e in self.events:
            if (e["function"], e["step"], e["what"]) == (function, step, what):
                return e["value"]
        return None


def run_child(
    runtime: CoreMLRuntime,
    package: Path,
    functions: list,
    steps: list[str],
    *,
    compute_units: str = GATE_COMPUTE_UNITS,
    cache_dir: str | os.PathLike | None = None,
) -> ChildReport:
    """Run ``steps`` for ``functions`` of ``package`` in a fresh Python process rebuilt from the runtime's spec
    (it reads this runtime's probe verdicts). ``cache_dir``: the child's compiled-copy cache (default: a
    throw-away one, as the gate's variants are)."""
    runtime.require_assumptions(*CHILD_STEP_ASSUMPTIONS, compute_units=compute_units)  # a child never probes
    with tempfile.TemporaryDirectory(prefix="anelab-gate-") as work:
        result = Path(work) / "events.jsonl"
        spec = spec_for_child(runtime, cache_dir=cache_dir if cache_dir is not None else Path(work) / "compiled")
        request = {
            "runtime": spec,
            "package": str(Path(package).resolve()),
            "functions": functions,
            "steps": steps,
            "compute_units": compute_units,
            "result": str(result),
        }
        run = run_python_child("anelab.runtimes.coreml.gate:child_main", request, CHILD_TIMEOUT_S)
        events = [json.loads(line) for line in result.read_text().splitlines()] if result.is_file() else []
    out, err = run.stdout, run.stderr
    try:  # the child's own lines and the Neural Engine compiler's helper processes' (they compile for it)
        log, log_error = runtime.read_unified_log(run.pid, run.start, run.end, helpers=CORE_ML_HELPERS), ""
    except UnifiedLogUnavailable as e:
        log, log_error = "", str(e)
    report = ChildReport(events, run.returncode, out, err, log, unified_log_error=log_error)
    for e in events:
        if e["what"] == "output":
            step = e["step"] + (f" of {e['function']}" if e["function"] else "")
            report.texts += [
                (f"fd 2 during {step}", e["value"]["stderr"], e["function"]),
                (f"fd 1 during {step}", e["value"]["stdout"], e["function"]),
            ]
    report.texts += [
        ("fd 2 outside the steps (e.g. at exit)", err, None),
        ("fd 1 outside the steps (e.g. at exit)", out, None),
        ("the unified log", report.unified_log, None),
    ]
    return report


def refuse_on(report: ChildReport, label_of, name: str) -> None:
    """Refuse a marker anywhere the child wrote (naming where), a failed step, or a crash.

    ``label_of(function)`` names the subject in the message (``function``: the one the text or the
    error belongs to; ``None`` when it is not known, e.g. text printed at exit); ``name`` is the default.
    """
    everything = "\n".join(text for _, text, _ in report.texts if text)
    for where, text, function in report.texts:
        markers = find_refusal_markers(text or "")
        if markers:
            raise AneGateError(
                f"ANE gate: {label_of(function)} was refused by the Neural Engine compiler ({where}: "
                f"{_first_line_with(text, markers[0])!r}; markers: {', '.join(markers)}); "
                f"lower --histories or --chunk so the score arena fits, see docs/mac-runbook.md",
                function=function or name,
                stderr_text=everything,
            )
    errors = [e for e in report.events if e["what"] == "error"]
    if errors:
        e = errors[0]
        what = "does not load" if e["step"] == "load" else f"failed at {e['step']}"
        raise AneGateError(
            f"ANE gate: {label_of(e['function'])} {what} ({e['value']}); the sidecar is not exported",
            function=e["function"] or name,
            stderr_text=everything,
        )
    if report.returncode != 0:
        function, step = report.last_step()
        tail = (report.leftover_stderr.strip().splitlines() or ["no output"])[-1][:160]
        ended = describe_child_exit(report.returncode, CHILD_TIMEOUT_TEXT)
        raise AneGateError(
            f"ANE gate: {label_of(function or None)} {ended} during {step} "
            f"(last stderr line: {tail!r}); the sidecar is not exported",
            function=function or name,
            stderr_text=everything,
        )
    if report.unified_log_error:  # an unread log is not a clean log
        raise AneGateError(
            f"ANE gate verdict unknown for {label_of(None)}: the unified log could not be read "
            f"({report.unified_log_error}), so an ANE compiler failure reported only there would be missed; "
            f"the sidecar is not exported — check that 'log show' works (docs/mac-runbook.md) and export again",
            function=name,
            stderr_text=everything,
        )


# ---- the gate -------------------------------------------------------------------------------------
def refuse_without_neural_engine(runtime: CoreMLRuntime) -> None:
    """Refuse up front (nothing loaded) where the runtime is missing, the Mac is not arm64, or no ANE is listed."""
    runtime.require_available()
    runtime.require_assumptions(*GATE_ASSUMPTIONS, compute_units=GATE_COMPUTE_UNITS)
    reason = runtime.neural_engine_reason()
    if reason:
        raise AneGateError(f"ANE gate: {reason}; nothing was loaded and the sidecar is not exported")


def unified_log_caveat(runtime: CoreMLRuntime) -> str:
    """ "" where the probe read Core ML's own lines in the unified log on this Mac; else the caveat every gate verdict
    carries beside its compute plan and survived predict (the probe row ``core_ml_logs_reach_the_client_pid``)."""
    state, detail = runtime.assumption_verdict(CORE_ML_LOGS_FOR_CLIENT, GATE_COMPUTE_UNITS)
    if state == "passed":
        return ""
    return (
        f"no readable Core ML line reached the unified log on this Mac ({state}: {detail}): an ANE compiler failure "
        "reported only there would be missed; this verdict rests on the compute plan and a survived predict"
    )


# ---- what children survived on this Mac (content, function, setting, steps, versions) -----------------------------
def _memo_file(runtime: CoreMLRuntime, kind: str) -> Path:
    return runtime.probe_file.with_name(f"core-ml-{kind}.jsonl")


def _memo_key(runtime: CoreMLRuntime, content: str, function: str | None, units: str, steps) -> str:
    return json.dumps([content, function, units, list(steps), runtime.versions()], sort_keys=True)


def _memo_get(runtime: CoreMLRuntime, kind: str, key: str):
    path = _memo_file(runtime, kind)
    if not path.is_file():
        return None
    found = None
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if entry.get("key") == key:
                found = entry.get("value", True)
    return found


def _memo_put(runtime: CoreMLRuntime, kind: str, key: str, value=True) -> None:
    path = _memo_file(runtime, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:  # one short line per append: concurrent writers never interleave a line
        f.write(json.dumps({"key": key, "value": value}) + "\n")


def record_survived(runtime: CoreMLRuntime, package: Path, functions, compute_units: str, steps) -> None:
    """Remember that a child ran ``steps`` of each of ``functions`` of ``package`` under ``compute_units`` and lived."""
    content = runtime.content_hash(package)
    for function in functions:
        _memo_put(runtime, "survived", _memo_key(runtime, content, function, compute_units, steps))


def preflight(runtime: CoreMLRuntime, package, function: str | None, compute_units: str, steps) -> None:
    """``CoreMLRuntime.preflight``: ``steps`` of ``function`` in a child first (once per content, function, setting,
    steps and Mac); a crash, a failed step or an ANE refusal marker refuses in one line, and this process lives."""
    package, steps = Path(package), tuple(steps)
    key = _memo_key(runtime, runtime.content_hash(package), function, compute_units, steps)
    if _memo_get(runtime, "survived", key):
        return
    report = run_child(runtime, package, [function], list(steps), compute_units=compute_units,
                       cache_dir=runtime.cache_dir)  # fmt: skip
    name = function or "(default)"
    try:
        refuse_on(report, lambda _: f"function {name} of {package.name}", name)
    except AneGateError as e:
        raise PreflightRefusedError(
            f"refusing to {' and '.join(steps)} {name} of {package} under {compute_units} in this process: its "
            f"child process failed first — {str(e).removeprefix('ANE gate: ')}"
        ) from None
    _memo_put(runtime, "survived", key)


def check_variants(runtime: CoreMLRuntime, variants: dict[str, Path]) -> dict[str, dict]:
    """Per single-function variant (``{"h<H>": path}``), before the merge, each in a child process.

    Returns evidence ``{function: {"ane_ops", "total_ops", "stderr_markers": [], "predicted": True}}``.
    Raises ``AneGateError`` naming the first variant that crashes, fails to load or predict, prints a
    refusal marker anywhere, reports no operations, or has none preferring the Neural Engine. A variant whose
    program and weights (``Data/``) passed on this Mac before is not gated again (a retry after a refusal).
    """
    refuse_without_neural_engine(runtime)
    evidence: dict[str, dict] = {}
    for function, pkg in variants.items():
        key = _memo_key(runtime, runtime.content_hash(Path(pkg) / "Data"), function, GATE_COMPUTE_UNITS, ("variant",))
        passed = _memo_get(runtime, "gated-variants", key)
        evidence[function] = passed if isinstance(passed, dict) else _gate_variant(runtime, function, Path(pkg))
        _memo_put(runtime, "gated-variants", key, evidence[function])
        evidence[function] = {**evidence[function], "log_caveat": unified_log_caveat(runtime)}
    return evidence


def _gate_variant(runtime: CoreMLRuntime, function: str, pkg: Path) -> dict:
    report = run_child(runtime, pkg, [None], ["load", "predict", "plan"])
    refuse_on(report, lambda _: f"variant {function}", function)
    assignment = report.value(None, "plan", "assignment")
    total, ane = int(assignment["total"]), int(assignment["neural_engine"])
    if total == 0:
        raise AneGateError(
            f"ANE gate: variant {function} reports no operation assignments in the compute plan (0 operations), "
            f"so nothing shows it runs on the Neural Engine; coremltools 9.0 plans only a package's default function — "
            f"check the variant is a single-function mlprogram",
            function=function,
        )
    if ane == 0:
        raise AneGateError(
            f"ANE gate: variant {function} has 0 of {total} operations on the Neural Engine "
            f"(cpu {assignment['cpu']}, gpu {assignment['gpu']}); it would run silently off the ANE — "
            f"lower --histories or --chunk, see docs/mac-runbook.md",
            function=function,
        )
    return {"ane_ops": ane, "total_ops": total, "stderr_markers": [], "predicted": True}


def check_merged_loads(runtime: CoreMLRuntime, merged: Path, functions: list[str]) -> None:
    """Every function must load under its name from the merged package's compiled copy AND predict once (in a
    child, ``cpu_and_ne``), with no marker; the survival is remembered, so the package's first use in the measuring
    process needs no second child."""
    refuse_without_neural_engine(runtime)
    report = run_child(runtime, Path(merged), list(functions), list(PREFLIGHT_LOAD_STEPS))
    last = report.last_step()[0] or functions[0]
    refuse_on(report, lambda f: f"function {f or last} of the merged package", last)
    record_survived(runtime, Path(merged), functions, GATE_COMPUTE_UNITS, PREFLIGHT_LOAD_STEPS)


@dataclass(frozen=True)
class AneGate:
    """The gate bound to one runtime: what ``anelab.sidecar.export`` is handed (the exporter never
    imports the runtime layer)."""

    runtime: CoreMLRuntime
    verified_reason: str = VERIFIED_REASON

    @classmethod
    def for_runtime(cls, runtime: CoreMLRuntime | None) -> AneGate | None:
        """A gate where the runtime can load packages; None elsewhere (the export then records why not)."""
        return cls(runtime) if runtime is not None and runtime.available() else None

    def check_variants(self, variants: dict[str, Path]) -> dict[str, dict]:
        return check_variants(self.runtime, variants)

    def check_merged_loads(self, merged: Path, functions: list[str]) -> None:
        check_merged_loads(self.runtime, merged, functions)
