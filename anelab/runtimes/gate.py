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

The child's fd 1 and fd 2 are captured per step (and whatever reaches them until it exits, since
Core ML may print only at exit), and the unified log of the child is read for its lifetime (Core
ML's ``[espresso]``/``[coreml]`` lines reach neither fd). A known ANE compiler failure in any of
them refuses; a crash or signal refuses naming it and the step. After the merge, every function
must load under its name from the merged package (also in a child).

``anelab.sidecar.export.export_layer`` calls ``check_variants`` before merging and
``check_merged_loads`` after; only when both pass does it write ``aneCompileVerified: true``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from anelab.core.paths import REPO_ROOT
from anelab.runtimes.assumptions import (
    COMPILE_TO_MLMODELC,
    COMPUTE_PLAN_OF_COMPILED,
    LOAD_FUNCTION_BY_NAME,
    NATIVE_OUTPUT_ON_FDS,
    UNIFIED_LOG_READABLE,
)
from anelab.runtimes.interface import (
    CHILD_TIMED_OUT,
    CoreMLRuntime,
    UnifiedLogUnavailable,
    capture_native_output,
    describe_child_exit,
    prepare_inputs,
    runtime_from_spec,
    zero_inputs,
)

# The compute units every gate step asks for: CPU + Neural Engine, so an ANE refusal cannot hide
# behind a GPU placement (with "all", Core ML may legitimately prefer the GPU).
GATE_COMPUTE_UNITS = "cpu_and_ne"


# the Core ML behaviours the gate's evidence rests on (refused by name when the probe found one false)
GATE_ASSUMPTIONS = (
    COMPILE_TO_MLMODELC,
    LOAD_FUNCTION_BY_NAME,
    COMPUTE_PLAN_OF_COMPILED,
    NATIVE_OUTPUT_ON_FDS,
    UNIFIED_LOG_READABLE,
)


CHILD_TIMEOUT_S = 1800.0  # an ANE compile of a large variant takes minutes; a VM without an ANE can hang
CHILD_TIMEOUT_TEXT = f"did not finish within {CHILD_TIMEOUT_S:.0f} s (a hung ANE compile?)"


VERIFIED_REASON = (
    "verified: each variant, in its own process, loaded from its compiled copy, ran one prediction on zero "
    "inputs with no ANE compiler failure on fd 1, fd 2, at exit or in the unified log, and had operations "
    "assigned to the Neural Engine by the compute plan of that compiled copy (cpu_and_ne); every function "
    "loads from the merged package"
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


def run_child(runtime: CoreMLRuntime, package: Path, functions: list, steps: list[str]) -> ChildReport:
    """Run ``steps`` for ``functions`` of ``package`` in a fresh Python process built from ``runtime.child_spec()``."""
    with tempfile.TemporaryDirectory(prefix="anelab-gate-") as work:
        result = Path(work) / "events.jsonl"
        spec = runtime.child_spec()  # compiled copies of these throw-away variants stay in the child's work dir
        spec = {**spec, "args": {**spec.get("args", {}), "cache_dir": str(Path(work) / "compiled")}}
        request = {
            "runtime": spec,
            "package": str(Path(package).resolve()),
            "functions": functions,
            "steps": steps,
            "compute_units": GATE_COMPUTE_UNITS,
            "result": str(result),
        }
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        }
        start = time.time()
        proc = subprocess.Popen(
            [sys.executable, "-c", "from anelab.runtimes.gate import child_main; child_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            out, err = proc.communicate(json.dumps(request), timeout=CHILD_TIMEOUT_S)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            code = None
        end = time.time()
        events = [json.loads(line) for line in result.read_text().splitlines()] if result.is_file() else []
    try:
        log, log_error = runtime.read_unified_log(proc.pid, start, end), ""
    except UnifiedLogUnavailable as e:
        log, log_error = "", str(e)
    report = ChildReport(
        events, code if code is not None else CHILD_TIMED_OUT, out, err, log, unified_log_error=log_error
    )
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


def _refuse_on(report: ChildReport, label_of, name: str) -> None:
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
    runtime.require_assumptions(*GATE_ASSUMPTIONS)
    reason = runtime.neural_engine_reason()
    if reason:
        raise AneGateError(f"ANE gate: {reason}; nothing was loaded and the sidecar is not exported")


def check_variants(runtime: CoreMLRuntime, variants: dict[str, Path]) -> dict[str, dict]:
    """Per single-function variant (``{"h<H>": path}``), before the merge, each in a child process.

    Returns evidence ``{function: {"ane_ops", "total_ops", "stderr_markers": [], "predicted": True}}``.
    Raises ``AneGateError`` naming the first variant that crashes, fails to load or predict, prints a
    refusal marker anywhere, reports no operations, or has none preferring the Neural Engine.
    """
    refuse_without_neural_engine(runtime)
    evidence: dict[str, dict] = {}
    for function, pkg in variants.items():
        report = run_child(runtime, Path(pkg), [None], ["load", "predict", "plan"])
        _refuse_on(report, lambda _, function=function: f"variant {function}", function)
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
        evidence[function] = {"ane_ops": ane, "total_ops": total, "stderr_markers": [], "predicted": True}
    return evidence


def check_merged_loads(runtime: CoreMLRuntime, merged: Path, functions: list[str]) -> None:
    """Every function must load under its name from the merged package's compiled copy (in a child), with no marker."""
    refuse_without_neural_engine(runtime)
    report = run_child(runtime, Path(merged), list(functions), ["load"])
    last = report.last_step()[0] or functions[0]
    _refuse_on(report, lambda f: f"function {f or last} of the merged package", last)


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
