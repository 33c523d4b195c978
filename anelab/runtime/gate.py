"""The ANE gate: what ``aneCompileVerified: true`` has to prove, in three layers.

"Core ML stayed quiet" is not "the Neural Engine got the graph" (ANE prefill research seed,
"Making 'verified' mean something"):

1. Compile markers — Core ML prints an ANE compile refusal on the native stderr and the call still
   returns normally. Each variant is loaded with fd 2 captured and refused on a known marker.
2. Load — after the merge, every function must load under its ``h<history>`` name.
3. Assignment — per variant, BEFORE the merge (the compute plan reports only a package's default
   function: the seed's 2B graph reads 74/173 standalone and 0/173 as a non-default function), the
   operations whose preferred device is the Neural Engine are counted; zero refuses, and so does a
   variant that reports no operations at all. This closes the silent case: nothing printed, the
   graph on the CPU (seed: Qwen 3.8 h12288, 0 of 173 operations on the ANE).

``anelab.sidecar.export.export_layer`` calls ``check_variants`` before merging and ``check_merged_loads``
after; only when both pass does it write ``aneCompileVerified: true`` with the evidence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from anelab.runtime.interface import CoreMLRuntime, RuntimeLoadError

# The compute units every gate step asks for: CPU + Neural Engine, so an ANE refusal cannot hide
# behind a GPU placement (with "all", Core ML may legitimately prefer the GPU).
GATE_COMPUTE_UNITS = "cpu_and_ne"


VERIFIED_REASON = (
    "verified: every variant loaded with no ANE refusal on native stderr and had operations assigned "
    "to the Neural Engine by the compute plan (cpu_and_ne), and every function loads from the merged package"
)


class AneGateError(RuntimeError):
    """The Neural Engine did not get the sidecar (one line, names the function and the evidence)."""

    def __init__(self, message: str, *, function: str | None = None, stderr_text: str = ""):
        super().__init__(" ".join(str(message).split()))
        self.function = function
        self.stderr_text = stderr_text


@dataclass(frozen=True)
class StderrMarker:
    """A line Core ML prints on native stderr when the Neural Engine refuses or drops a model."""

    name: str  # what the marker is called in messages and evidence
    pattern: str  # regular expression searched in the captured text
    source: str  # where it is documented


# Known ANE refusal markers. Each is documented in a public report of Core ML output; every one of
# them was printed while the load call itself returned (or the app kept running on another device).
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
        "E5RT encountered an STL exception",
        r"E5RT encountered an STL exception",
        "apple/coremltools#2247, #2758 (prefixes the ANE compiler failure)",
    ),
    StderrMarker(
        "ANECF error",
        r"ANECF error",
        "apple/coremltools#1548; apple/ml-stable-diffusion#26 ('failed to load ANE model ... Program load failure')",
    ),
    StderrMarker(
        "Error plan build",
        r"Error plan build: -?\d+",
        "apple/coremltools#1548, #2247; apple/ml-stable-diffusion#26 (follows the ANE failure)",
    ),
    StderrMarker(
        "ANE inference operation failed",
        r"ANE inference operation failed",
        "ggml-org/whisper.cpp#3702 (Core ML then falls back to the GPU)",
    ),
    StderrMarker(
        "ANEProgramProcessRequestDirect() Failed",
        r"ANEProgramProcessRequestDirect\(\) Failed",
        "huggingface/swift-coreml-diffusers#80 ('Program Inference error')",
    ),
)


def find_refusal_markers(text: str, markers: tuple[StderrMarker, ...] = ANE_REFUSAL_MARKERS) -> list[str]:
    """Names of the markers that occur in ``text`` (in ``markers`` order)."""
    return [m.name for m in markers if re.search(m.pattern, text)]


def _first_line_with(text: str, marker_name: str) -> str:
    marker = next(m for m in ANE_REFUSAL_MARKERS if m.name == marker_name)
    for line in text.splitlines():
        if re.search(marker.pattern, line):
            return line.strip()[:160]
    return marker_name


def _load_watched(runtime: CoreMLRuntime, pkg: Path, function: str | None, name: str, label: str, *, plan: bool):
    """Load (and optionally ask the compute plan) with fd 2 captured; refuse on failure or a marker."""
    with runtime.capture_native_stderr() as captured:
        try:
            handle = runtime.load(pkg, function, GATE_COMPUTE_UNITS)
            failure = None
        except RuntimeLoadError as e:
            handle, failure = None, e
        assignment = None
        if plan and failure is None:
            try:
                assignment = runtime.compute_plan_assignment(pkg, GATE_COMPUTE_UNITS)
            except Exception as e:  # the framework's refusal to build a plan is a gate failure, named
                failure = e
    del handle
    if failure is not None and plan and not isinstance(failure, RuntimeLoadError):
        raise AneGateError(
            f"ANE gate: the compute plan of {label} could not be read ({type(failure).__name__}: "
            f"{failure}); the sidecar is not exported",
            function=name,
            stderr_text=captured.text,
        ) from failure
    if failure is not None:
        raise AneGateError(
            f"ANE gate: {label} does not load ({failure}); the sidecar is not exported",
            function=name,
            stderr_text=captured.text,
        ) from failure
    markers = find_refusal_markers(captured.text)
    if markers:
        raise AneGateError(
            f"ANE gate: {label} was refused by the Neural Engine compiler although the load returned normally "
            f"(native stderr: {_first_line_with(captured.text, markers[0])!r}; markers: {', '.join(markers)}); "
            f"lower --histories or --chunk so the score arena fits, see docs/mac-runbook.md",
            function=name,
            stderr_text=captured.text,
        )
    return assignment, captured.text


def check_variants(runtime: CoreMLRuntime, variants: dict[str, Path]) -> dict[str, dict]:
    """Layers 1 and 3 for each single-function variant (``{"h<H>": path}``), before the merge.

    Returns evidence ``{function: {"ane_ops": int, "total_ops": int, "stderr_markers": []}}``.
    Raises ``AneGateError`` naming the first variant that fails to load, prints a refusal marker,
    reports no operations, or has none of its operations preferring the Neural Engine.
    """
    runtime.require_available()
    evidence: dict[str, dict] = {}
    for function, pkg in variants.items():
        assignment, _ = _load_watched(runtime, Path(pkg), None, function, f"variant {function}", plan=True)
        total, ane = int(assignment["total"]), int(assignment["neural_engine"])
        if total == 0:
            raise AneGateError(
                f"ANE gate: variant {function} reports no operation assignments in the compute plan (0 operations), "
                f"so nothing shows it runs on the Neural Engine; the plan covers only a package's default function — "
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
        evidence[function] = {"ane_ops": ane, "total_ops": total, "stderr_markers": []}
    return evidence


def check_merged_loads(runtime: CoreMLRuntime, merged: Path, functions: list[str]) -> None:
    """Layer 2: every function must load under its name from the merged package (and print no marker)."""
    runtime.require_available()
    for function in functions:
        _load_watched(
            runtime, Path(merged), function, function, f"function {function} of the merged package", plan=False
        )


@dataclass(frozen=True)
class AneGate:
    """The three-layer gate bound to one runtime: what ``anelab.sidecar.export`` is handed (the
    exporter never imports the runtime layer)."""

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
