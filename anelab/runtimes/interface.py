"""The macOS Core ML runtime's interface: what anelab asks of Core ML, and its errors.

How a package is run is fixed here, once, for every runtime (``CoreMLRuntime.load``): the package is
compiled ONCE into a ``.mlmodelc`` cached under the build directory, keyed by the package's content
hash, and each function is loaded from that compiled copy by name. Loading an ``.mlpackage``
directly would recompile the whole package on every load into a temporary copy that is deleted
when the handle dies (coremltools 9.0, ``CoreMLPython.mm:457-466``, ``436-443``).
"""

from __future__ import annotations

import abc
import contextlib
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.paths import BUILD_DIR
from anelab.core.records import machine_description
from anelab.runtimes.coreml.assumptions import (
    COMPILE_TO_MLMODELC,
    COMPUTE_PLAN_OF_COMPILED,
    LOAD_FUNCTION_BY_NAME,
    assumption,
    settings_needed,
)
from anelab.runtimes.coreml.first_use import first_use_package  # noqa: F401 - re-exported
from anelab.runtimes.coreml.native_output import NativeOutput, capture_native_output  # noqa: F401 - re-exported
from anelab.sidecar.coremltools_import import coremltools_modules
from anelab.sidecar.format import (
    STATE_FUNCTIONS_META,
    load_package_spec,
    package_content_hash,  # noqa: F401 (runtimes' callers read it here too)
    read_raw_metadata,
    read_sidecar_metadata,
    require_package,
)

COMPUTE_UNITS = frozenset({"cpu_only", "cpu_and_gpu", "cpu_and_ne", "all"})


# compute-units settings that ask for the Neural Engine (a sidecar must be ANE-verified for these)
NEURAL_ENGINE_UNITS = frozenset({"cpu_and_ne", "all"})


MIN_MACOS = (15, 0)  # multifunction mlprograms with fp16 I/O target macOS 15 / iOS 18


# keys of compute_plan_assignment(): operations per PREFERRED device, plus operations the plan
# lists without a device usage ("unreported"); total = neural_engine + gpu + cpu; compute_ops: the operations
# that carry an attention block's arithmetic (COMPUTE_OPERATORS), compute_ops_on_neural_engine: those the plan
# puts on the Neural Engine (an operation count alone weighs a reshape like a matmul)
ASSIGNMENT_KEYS = ("neural_engine", "gpu", "cpu", "unreported", "total", "compute_ops", "compute_ops_on_neural_engine")
COMPUTE_OPERATORS = frozenset({"matmul", "linear", "softmax", "einsum", "conv", "scaled_dot_product_attention"})


# the processes that compile and run a client's model on the Neural Engine and log about it under their own PID
# (the client's PID sees none of their lines): read beside a child's own lines by the gate and the probe
CORE_ML_HELPERS = ("ANECompilerService", "aned")


COMPILED_CACHE_DIR = BUILD_DIR / "compiled"  # compiled packages: <stem>-<content hash>.mlmodelc


class RuntimeUnavailableError(AnelabInputError):
    """The Core ML runtime is not available here (not macOS 15+, or coremltools' native module missing)."""


class RuntimeLoadError(RuntimeError):
    """A package function did not load (the framework's own error is in the message)."""


class RuntimePredictError(RuntimeError):
    """A prediction failed (missing/extra input, wrong shape, missing state, or the framework's error)."""


class UnifiedLogUnavailable(RuntimeError):
    """``log show`` failed or timed out: what the unified log held is unknown (never "clean")."""


class UngatedPackageError(AnelabInputError):
    """A predict under the Neural Engine was asked, in this process, of a package the ANE gate never passed."""


class AssumptionFailedError(AnelabInputError):
    """Code relies on a Core ML behaviour that ``anelab doctor --probe`` found false on this Mac."""


class AssumptionUnprobedError(AnelabInputError):
    """Code relies on a Core ML behaviour no probe of this Mac (this macOS and coremltools) has judged."""


class PreflightRefusedError(RuntimeLoadError, AnelabInputError):
    """A Neural Engine load, predict or compute plan was refused in this process: its child process failed first."""


GATE_VERDICT_KEY = "aneCompileVerified"  # the sidecar metadata key the ANE gate writes (true / false)


def gate_verdict(pkg: str | os.PathLike) -> str:
    """The package's ANE gate verdict as recorded in its metadata: "true", "false" or "absent" (none, or no
    readable spec)."""

    try:
        return read_raw_metadata(pkg).get(GATE_VERDICT_KEY, "absent") or "absent"
    except AnelabInputError:  # no readable spec: no verdict either
        return "absent"


def require_gate_verdict(pkg: str | os.PathLike, compute_units: str, doing: str) -> None:
    """Refuse ``doing`` under ``cpu_and_ne`` / ``all`` in this process unless the gate passed ``pkg``.

    A failed ANE compile can kill the process at the first predict (apple/coremltools#2758): only a
    package whose metadata records ``aneCompileVerified: true`` is predicted in the measuring process.
    """
    if compute_units not in NEURAL_ENGINE_UNITS:
        return
    verdict = gate_verdict(pkg)
    if verdict != "true":
        raise UngatedPackageError(
            f"{pkg}: refusing to {doing} under {compute_units} in this process: the ANE gate never passed this "
            f"package ({GATE_VERDICT_KEY}: {verdict}) and a failed ANE compile can kill the process at its first "
            f"predict (apple/coremltools#2758); export it on a Mac so the gate runs, or use cpu_only / cpu_and_gpu"
        )


def check_compute_units(name: str) -> str:
    """Return ``name`` if it is a compute-units setting; refuse an unknown one listing the valid ones."""
    if name not in COMPUTE_UNITS:
        raise AnelabInputError(f"unknown compute units {name!r}; use one of {', '.join(sorted(COMPUTE_UNITS))}")
    return name


def empty_assignment() -> dict[str, int]:
    return {key: 0 for key in ASSIGNMENT_KEYS}


# ---- what a package holds --------------------------------------------------------------------------
def package_stat_key(pkg: str | os.PathLike) -> tuple:
    """What identifies a package's bytes without reading them: its resolved path and every file's relative path,
    size, inode and modification time (a rewrite in place or a new package at the same path changes it)."""
    root = Path(pkg).resolve()
    files = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        st = path.stat()
        files.append((path.relative_to(root).as_posix(), st.st_size, st.st_ino, st.st_mtime_ns))
    return (str(root), tuple(files))


def package_functions(pkg: str | os.PathLike) -> list[str]:
    """The functions a sidecar package serves, from its metadata: ``c<C>`` (and ``c1``) for a stateful
    sidecar, ``h<H>`` per history otherwise."""

    raw = read_raw_metadata(pkg)
    if raw.get(STATE_FUNCTIONS_META):
        return raw[STATE_FUNCTIONS_META].split(",")
    return read_sidecar_metadata(pkg).functions


@dataclass(frozen=True)
class FunctionSignature:
    """Inputs, states and outputs of one function (name -> (shape, numpy dtype name))."""

    inputs: dict[str, tuple[tuple[int, ...], str]]
    states: dict[str, tuple[tuple[int, ...], str]]
    outputs: dict[str, tuple[tuple[int, ...], str]]


def function_signatures(pkg: str | os.PathLike) -> tuple[str, dict[str, FunctionSignature]]:
    """(default function, {function: FunctionSignature}) read from a package's spec (no load)."""

    coremltools_modules()
    from coremltools.proto import FeatureTypes_pb2

    spec = load_package_spec(pkg)  # read only (coremltools' load_spec rewrites Manifest.json)
    names = FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.Name

    def arrays(features, state=False):
        out = {}
        for f in features:
            arr = f.type.stateType.arrayType if state else f.type.multiArrayType
            out[f.name] = (tuple(int(s) for s in arr.shape), names(arr.dataType).lower())
        return out

    desc = spec.description
    if len(desc.functions):
        sigs = {
            f.name: FunctionSignature(arrays(f.input), arrays(f.state, state=True), arrays(f.output))
            for f in desc.functions
        }
        return desc.defaultFunctionName or next(iter(sigs)), sigs
    return "main", {"main": FunctionSignature(arrays(desc.input), arrays(desc.state, True), arrays(desc.output))}


def zero_inputs(signature: FunctionSignature) -> dict[str, np.ndarray]:
    """Zero-filled inputs of a function (what the gate's one prediction runs on)."""
    return {name: np.zeros(shape, dtype=np.dtype(dtype)) for name, (shape, dtype) in signature.inputs.items()}


def prepare_inputs(inputs: dict) -> dict[str, np.ndarray]:
    """The inputs as Core ML takes them, in a NEW dict: contiguous arrays, fp16 cast to fp32.

    coremltools casts fp16 arrays to fp32 inside ``predict`` (in the caller's dict); doing it here,
    once, keeps that conversion out of a timed prediction and leaves the caller's dict untouched.
    """
    out = {}
    for name, value in inputs.items():
        arr = np.ascontiguousarray(value)
        out[name] = arr.astype(np.float32) if arr.dtype == np.float16 else arr
    return out


# ---- the runtime ------------------------------------------------------------------------------------
class CoreMLRuntime(abc.ABC):
    """Compile, load, state, predict and compute-plan queries for sidecar packages."""

    name = "abstract"
    load_description = "abstract"  # what one load() does, recorded with load timings
    cache_dir: Path = COMPILED_CACHE_DIR
    ignore_probe_file = False  # True while ``anelab doctor --probe`` judges the assumptions afresh
    is_child = False  # True in a gate, probe, pre-flight or timing child: it IS the process that may die
    probe_path: Path | None = None  # where the verdicts live (default beside the cache; children are told it)

    @abc.abstractmethod
    def available(self) -> bool:
        """Whether this runtime can load and run packages on this machine."""

    @abc.abstractmethod
    def unavailable_reason(self) -> str:
        """Why ``available()`` is False (one line naming what is missing); "" when available."""

    @abc.abstractmethod
    def neural_engine_reason(self) -> str:
        """Why this machine cannot run on the Neural Engine (not arm64, none listed by Core ML); "" if it can."""

    def signature(self, pkg: str | os.PathLike, function: str | None) -> FunctionSignature:
        """Inputs, states and outputs of one function of ``pkg`` (``None``: the default), from its spec."""
        default, sigs = function_signatures(pkg)
        name = function or default
        if name not in sigs:
            raise AnelabInputError(f"{pkg} has no function {name!r}; it has: {', '.join(sigs)}")
        return sigs[name]

    # compile once ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def compile_to(self, pkg: Path, dest: Path) -> Path:
        """Compile ``pkg`` (.mlpackage) into ``dest`` (.mlmodelc, not existing yet); return ``dest``."""

    def content_hash(self, pkg: str | os.PathLike) -> str:
        """``package_content_hash(pkg)``, computed once per package bytes in this runtime (``package_stat_key``): a
        load, a pre-flight memo lookup or a compile-cache lookup inside a clock hashes nothing."""
        memo = self.__dict__.setdefault("_content_hashes", {})
        key = package_stat_key(pkg)
        if key not in memo:
            memo[key] = package_content_hash(pkg)
        return memo[key]

    def compiled_path(self, pkg: str | os.PathLike) -> Path:
        """Where the compiled copy of ``pkg`` lives in the cache (``<stem>-<content hash>.mlmodelc``)."""
        pkg = Path(pkg)
        return Path(self.cache_dir) / f"{pkg.stem}-{self.content_hash(pkg)[:20]}.mlmodelc"

    def compile(self, pkg: str | os.PathLike) -> Path:
        """The compiled copy of ``pkg``: compiled once, then reused for every load and compute plan."""

        self.require_available()
        self.require_assumptions(COMPILE_TO_MLMODELC)
        pkg = require_package(pkg)
        dest = self.compiled_path(pkg)
        if dest.is_dir():
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{dest.stem}.", dir=dest.parent))
        try:
            built = self.compile_to(pkg, work / dest.name)
            try:
                os.replace(built, dest)
            except OSError:  # another process compiled it first
                if not dest.is_dir():
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return dest

    # load -------------------------------------------------------------------------------------------
    def load(self, pkg: str | os.PathLike, function: str | None, compute_units: str) -> Any:
        """Load one function (``None``: the default) from the compiled copy of ``pkg``; return a handle.

        Raises ``RuntimeLoadError`` when the function does not load.
        """
        check_compute_units(compute_units)
        self.require_available()
        self.require_assumptions(LOAD_FUNCTION_BY_NAME, compute_units=compute_units)
        if compute_units in NEURAL_ENGINE_UNITS and not self.is_child:  # never first in the measuring process
            self.preflight(pkg, function, compute_units, PREFLIGHT_LOAD_STEPS)
        return self.load_path(self.compile(pkg), function, compute_units)

    def handle_units(self, handle: Any) -> str | None:
        """The compute-units setting ``handle`` was loaded with (None when the handle does not say)."""
        unit = getattr(handle, "compute_unit", None)
        return unit.name.lower() if unit is not None and hasattr(unit, "name") else None

    @abc.abstractmethod
    def preflight(
        self, pkg: str | os.PathLike, function: str | None, compute_units: str, steps: tuple[str, ...]
    ) -> None:
        """Run ``steps`` (``load`` + ``predict``, or ``plan``) of ``function`` of ``pkg`` under ``compute_units`` in a
        child process first, once per package content, function and setting on this machine; raise
        ``PreflightRefusedError`` (one line: how the child ended) when it did not survive or printed an ANE refusal.

        Each function of a merged ``.mlmodelc`` is compiled for the device in whichever process loads it
        (coremltools 9.0 ``CoreMLPython.mm:489-503``), so a failed ANE compile (apple/coremltools#2758) must land
        in a child, never in the measuring process.
        """

    @abc.abstractmethod
    def load_path(self, path: str | os.PathLike, function: str | None, compute_units: str) -> Any:
        """Load exactly what coremltools loads for ``path``: a ``.mlmodelc`` as it is; an ``.mlpackage``
        compiled afresh into a temporary copy (what a cold-from-package load costs)."""

    def load_duration_s(self, handle: Any) -> float | None:
        """Core ML's own load duration of ``handle`` (excludes any compile), where coremltools exposes it."""
        return None

    def prepare_process(self, compute_units: str | tuple[str, ...] = "cpu_only") -> list[str]:
        """Do this process's one-time Core ML work before any clock starts; return what was done.

        The first availability check imports coremltools' native module; the first compile or
        ``CompiledMLModel`` runs ``sw_vers`` in a subprocess (coremltools 9.0 ``_compiled_model.py:34``
        -> ``utils.py:959-968``, cached afterwards); the process's first ``modelWithContentsOfURL`` pays
        Core ML's own first use inside the load it times (``CoreMLPython.mm:500-503``). A tiny model
        (``first_use_package``) is loaded and predicted once under each of ``compute_units``, so a load timed
        after this holds the load only.
        """
        self.require_available()
        done = ["checked the runtime is available"]
        tiny = first_use_package()
        for units in (compute_units,) if isinstance(compute_units, str) else tuple(compute_units):
            handle = self.load(tiny, None, units)
            self.predict(handle, prepare_inputs(zero_inputs(self.signature(tiny, None))))
            del handle
            done.append(f"loaded and predicted a tiny model ({tiny.name}) under {units}: Core ML's first use")
            # its plan, read in this process (it just loaded and predicted here): on the CPU, the ANE's first use is ahead
            if units in NEURAL_ENGINE_UNITS and not self.plan_path(self.compile(tiny), units)["neural_engine"]:
                done.append(FIRST_USE_OFF_ANE)
        return done

    # predict ----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def make_state(self, handle: Any) -> Any:
        """A fresh state for a stateful function (Core ML ``MLState``); one state may serve every function."""

    def predict_duration_s(self, handle: Any) -> float | None:
        """Core ML's own duration of ``handle``'s last predict (``[MLModel predictionFromFeatures:]`` alone,
        coremltools 9.0 ``CoreMLPython.mm:543-562``): no input or output conversion. None where not exposed."""
        return None

    @abc.abstractmethod
    def predict(self, handle: Any, inputs: dict, state: Any = None) -> dict:
        """Run a loaded function on ``inputs`` (name -> array, see ``prepare_inputs``); stateful functions
        need ``state``. Raises ``RuntimePredictError`` when the framework refuses."""

    # compute plan -----------------------------------------------------------------------------------
    def compute_plan_assignment(self, pkg: str | os.PathLike, compute_units: str) -> dict[str, int]:
        """Operations of the package's program per preferred compute device (keys: ``ASSIGNMENT_KEYS``).

        Asked of the compiled copy (the plan needs a ``.mlmodelc``). Counts the device the plan
        PREFERS for each operation. Only the default function is counted: coremltools 9.0's binding
        (``MLComputePlan.load_from_path``) takes no function name, and a plan that lists every function of a
        merged package is read for the package's default function alone (``plan_path(function=...)``).
        """
        check_compute_units(compute_units)
        self.require_available()
        self.require_assumptions(COMPUTE_PLAN_OF_COMPILED, compute_units=compute_units)
        if compute_units in NEURAL_ENGINE_UNITS and not self.is_child:
            self.preflight(pkg, None, compute_units, PREFLIGHT_PLAN_STEPS)
        try:
            default, functions = function_signatures(pkg)
        except AnelabInputError:  # no readable spec (a stand-in): the plan says what it holds
            default, functions = None, {}
        return self.plan_path(self.compile(pkg), compute_units, function=default if len(functions) > 1 else None)

    @abc.abstractmethod
    def plan_path(self, compiled: Path, compute_units: str, function: str | None = None) -> dict[str, int]:
        """``compute_plan_assignment`` of an already compiled ``.mlmodelc``: the operations of ``function`` where the
        plan lists it (None: of every function the plan lists — one, for a single-function package)."""

    # evidence ---------------------------------------------------------------------------------------
    def read_unified_log(self, pid: int, start: float, end: float, helpers: tuple[str, ...] = ()) -> str:
        """Unified-log lines of process ``pid`` — and of the processes named in ``helpers`` (``CORE_ML_HELPERS``:
        the Neural Engine compiler logs from its own processes) — between two ``time.time()`` stamps ("" where
        there is no log).

        Raises ``UnifiedLogUnavailable`` when the log could not be read (its contents are then unknown)."""
        return ""

    def write_log_marker(self, text: str) -> None:
        """Log one line to the unified log under this process's PID (the probe's marker; nothing where no log)."""

    @abc.abstractmethod
    def child_spec(self) -> dict:
        """How a child process rebuilds this runtime: ``{"factory": "module:callable", "args": {...}}``."""

    def capture_native_output(self) -> contextlib.AbstractContextManager[NativeOutput]:
        """fd-level capture of native stdout and stderr (see ``capture_native_output``)."""
        return capture_native_output()

    def require_available(self) -> None:
        """Raise ``RuntimeUnavailableError`` (one line, the reason) unless ``available()``."""
        if not self.available():
            raise RuntimeUnavailableError(self.unavailable_reason())

    # assumptions probed by ``anelab doctor --probe`` ----------------------------------------------
    @property
    def probe_file(self) -> Path:
        """Where this machine's latest probe verdicts live (beside the compiled-copy cache unless told)."""
        return (
            Path(self.probe_path) if self.probe_path is not None else Path(self.cache_dir).parent / "core-ml-probe.json"
        )

    def versions(self) -> dict[str, str]:
        """What a probe verdict holds for: the chip, the macOS and the coremltools version of this machine — read
        once per runtime (``read_versions`` spawns ``sysctl`` and ``sw_vers`` on a Mac: never inside a clock)."""
        cached = self.__dict__.get("_versions")
        if cached is None:
            cached = self.__dict__["_versions"] = self.read_versions()
        return dict(cached)

    def read_versions(self) -> dict[str, str]:
        """``versions()`` read afresh (``machine_description``: two ``sysctl`` and one ``sw_vers`` on a Mac)."""
        from importlib.metadata import version

        described = machine_description()
        return {"chip": described["chip"], "macos": described["os_version"], "coremltools": version("coremltools")}

    def probe_verdicts(self) -> tuple[dict | None, str]:
        """(the latest probe's assumption table, "") or (None, why there is none: never probed, or stale)."""
        import json

        path = self.probe_file
        if not path.is_file():
            return None, "no probe has run on this Mac"
        stamp = path.stat().st_mtime_ns
        cached = getattr(self, "_probe_cache", None)
        if cached is None or cached[0] != stamp:
            try:
                payload = json.loads(path.read_text())
            except (OSError, ValueError):
                payload = {}
            self._probe_cache = cached = (stamp, payload)
        payload = cached[1]
        probed, here = payload.get("versions"), self.versions()
        if probed != here:
            seen = ", ".join(f"{k} {v}" for k, v in (probed or {}).items()) or "no versions"
            return (
                None,
                f"the last probe ran under {seen}, this Mac is {', '.join(f'{k} {v}' for k, v in here.items())}",
            )
        return payload.get("assumptions", {}), ""

    def assumption_verdict(self, name: str, compute_units: str | None = None) -> tuple[str, str]:
        """("passed" | "failed" | "unprobed", what the probe saw or why it is unknown) for ``name`` under
        ``compute_units`` (see ``anelab.runtimes.coreml.assumptions.settings_needed``)."""
        table, why = self.probe_verdicts()
        if table is None:
            return "unprobed", why
        row = table.get(name)
        if row is None:
            return "unprobed", f"the last probe had no row {name!r} (an older anelab)"
        for units in settings_needed(name, compute_units):
            verdict = row.get("units", {}).get(units)
            if verdict is None:
                return "unprobed", f"the last probe did not run it under {units}"
            if not verdict.get("passed"):
                return "failed", f"under {units}: {verdict.get('detail', '')}"
        return "passed", ""

    def failed_assumptions(self) -> dict[str, str]:
        """Assumptions the latest probe on this machine found false (any setting): name -> what it saw."""
        table, _ = self.probe_verdicts()
        return {n: v.get("detail", "") for n, v in (table or {}).items() if not v.get("passed")}

    def probe_first(self, reason: str) -> None:
        """Judge the assumptions now (``anelab doctor --probe``) because ``reason``; a runtime that cannot refuses."""
        raise AssumptionUnprobedError(f"{reason}; run 'anelab doctor --probe' on this Mac first")

    def require_assumptions(self, *names: str, compute_units: str | None = None) -> None:
        """Refuse, naming the assumption, unless the probe passed every one of ``names`` under ``compute_units``.

        Unprobed or stale verdicts (no probe file, another macOS or coremltools) run the probe first where this
        runtime can (never in a child: children read the verdicts their parent has); still unknown: refused.
        """
        if self.ignore_probe_file:
            return
        # what passed is resolved once per runtime while the verdicts file stays the same (a stat, no read)
        stamp = self.probe_file.stat().st_mtime_ns if self.probe_file.is_file() else None
        memo = self.__dict__.get("_passed_assumptions")
        if memo is None or memo[0] != stamp:
            memo = self.__dict__["_passed_assumptions"] = (stamp, set())
        passed = memo[1]
        for name in names:
            if (name, compute_units) in passed:
                continue
            state, detail = self.assumption_verdict(name, compute_units)
            if state == "unprobed" and not self.is_child:
                self.probe_first(f"Core ML assumption {name!r} is unprobed ({detail})")
                state, detail = self.assumption_verdict(name, compute_units)
            if state == "failed":
                raise AssumptionFailedError(
                    f"refusing to measure: it relies on the Core ML assumption {name!r} "
                    f"({assumption(name).behaviour}), which 'anelab doctor --probe' found false on this Mac "
                    f"({detail}); see docs/mac-runbook.md"
                )
            if state == "unprobed":
                raise AssumptionUnprobedError(
                    f"refusing to measure: it relies on the Core ML assumption {name!r}, which no probe of this Mac "
                    f"has judged ({detail}); run 'anelab doctor --probe' on this Mac first"
                )
            passed.add((name, compute_units))

    def forget_verdicts(self) -> None:
        """Drop what this runtime resolved of the probe verdicts (a probe in this process just replaced them)."""
        self.__dict__.pop("_passed_assumptions", None)
        self.__dict__.pop("_probe_cache", None)


FIRST_USE_OFF_ANE = (
    "the tiny first-use model's compute plan put nothing on the Neural Engine: the Neural Engine's own first use "
    "falls inside the first timed load or predict under it"
)
PREFLIGHT_LOAD_STEPS = ("load", "predict")  # what a child survives before a function is loaded in this process
PREFLIGHT_PLAN_STEPS = ("plan",)  # ... before a compute plan is built here


CHILD_TIMED_OUT = -9999  # the exit code recorded for a child process stopped for not finishing in time


def describe_child_exit(code: int, timed_out: str = "did not finish in time") -> str:
    """How a child process ended, for a one-line refusal: ``timed_out`` for ``CHILD_TIMED_OUT``, the signal's
    name for a killed child, else its exit status."""
    if code == CHILD_TIMED_OUT:
        return timed_out
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def spec_for_child(
    runtime: CoreMLRuntime, *, cache_dir: str | os.PathLike | None = None, judging: bool = False
) -> dict:
    """How a child rebuilds ``runtime``: its ``child_spec()``, the probe verdicts it must read (the parent's file,
    whatever cache dir the child gets) and, for a probe child (``judging``), that no verdict refuses anything."""
    spec = runtime.child_spec()
    if cache_dir is not None:
        spec = {**spec, "args": {**spec.get("args", {}), "cache_dir": str(cache_dir)}}
    return {
        **spec,
        "probe_file": str(runtime.probe_file),
        "ignore_probe_file": bool(judging or runtime.ignore_probe_file),
    }


def runtime_from_spec(spec: dict) -> CoreMLRuntime:
    """Rebuild a runtime from ``spec_for_child`` (in a child process: it reads the parent's verdicts, never probes,
    never pre-flights — it is the process that may die)."""
    import importlib

    module, _, attr = spec["factory"].partition(":")
    factory = importlib.import_module(module)
    for part in attr.split("."):
        factory = getattr(factory, part)
    runtime = factory(**spec.get("args", {}))
    runtime.is_child = True
    if spec.get("probe_file"):
        runtime.probe_path = Path(spec["probe_file"])
    runtime.ignore_probe_file = bool(spec.get("ignore_probe_file"))
    return runtime


# ---- Core AI (macOS 27): the same sidecar as an .aimodel ---------------------------------------------------
COREAI_MIN_MACOS = (27, 0)  # Core AI ships with macOS 27 / iOS 27; coreai-core uses the OS runtime from there
COREAI_COMPUTE_UNITS = frozenset({"neural_engine", "gpu", "cpu", "default"})  # SpecializationOptions' choices


class CoreAIRuntime(abc.ABC):
    """What anelab asks of Core AI through coreai-core's Python runtime (``coreai.runtime``), per its stubs:

    ``specialize`` is ``await AIModel.load(path, SpecializationOptions...)`` — the asset is specialized for
    this device and options while it loads, and cached (Core AI's ``AIModelCache``); ``clear_cache`` forgets
    what the Python API can reach of that cache (``_AIModelAsset.remove_derived_artifacts``: the asset's
    derived artifacts; the system cache's ``deleteEntries(for:)`` is Swift-only) and says what it cleared;
    ``load_function`` / ``predict`` are ``AIModel.load_function(name)`` and ``await function(inputs, state=)``;
    ``compile_ahead`` is ``xcrun coreai-build compile`` (``.aimodel`` -> ``.aimodelc`` per device architecture).
    Implemented by ``runtimes.coreai.coreai_runtime.CoreAIMacRuntime`` and, for the tests, ``runtimes.coreai.coreai_fake``.
    """

    name = "abstract-coreai"

    @abc.abstractmethod
    def unavailable_reason(self) -> str:
        """Why Core AI cannot specialize for the Neural Engine here (one line), "" when it can."""

    def available(self) -> bool:
        return self.unavailable_reason() == ""

    def require_available(self) -> None:
        if not self.available():
            raise RuntimeUnavailableError(self.unavailable_reason())

    @abc.abstractmethod
    def clear_cache(self, asset: Path) -> str:
        """Forget the specialization of ``asset`` this runtime can reach; return what was cleared (recorded)."""

    @abc.abstractmethod
    def specialize(self, asset: Path, compute_unit: str) -> Any:
        """The asset loaded (specialized when not cached) for ``compute_unit`` (``COREAI_COMPUTE_UNITS``)."""

    @abc.abstractmethod
    def load_function(self, model: Any, name: str) -> Any:
        """One entrypoint of a loaded model (``KeyError`` naming it when the asset has none of that name)."""

    @abc.abstractmethod
    def predict(self, function: Any, inputs: dict[str, np.ndarray], state: dict | None = None) -> dict:
        """Run an entrypoint; raises ``RuntimePredictError`` when Core AI refuses (the framework's text). Inputs and
        states given as NumPy are copied into the runtime's arrays on every call: a timed predict takes
        ``prepare_inputs`` and ``make_state`` made before its clock."""

    def prepare_process(self) -> list[str]:
        """This process's one-time Core AI work (importing ``coreai.runtime``), done before any clock starts."""
        return []

    def prepare_inputs(self, inputs: dict[str, np.ndarray]) -> dict:
        """The inputs as the runtime takes them, made once (a predict given these copies nothing in)."""
        return dict(inputs)

    def make_state(self, function: Any) -> dict:
        """A fresh zero state of ``function`` in the runtime's own arrays, kept across predicts ({} if stateless)."""
        return {}

    @abc.abstractmethod
    def release(self, model: Any) -> None:
        """Drop a loaded model (what a load leaves behind is not part of the next one's time)."""

    @abc.abstractmethod
    def compile_ahead(self, asset: Path, out_dir: Path) -> list[Path]:
        """``coreai-build compile`` of ``asset`` into ``out_dir``: the ``.aimodelc`` assets it wrote."""

    @abc.abstractmethod
    def child_spec(self) -> dict:
        """How a child process rebuilds this runtime: ``{"factory": "module:callable", "args": {...}}``."""


def check_coreai_compute_unit(name: str) -> str:
    if name not in COREAI_COMPUTE_UNITS:
        raise AnelabInputError(
            f"unknown Core AI compute unit {name!r}; use one of {', '.join(sorted(COREAI_COMPUTE_UNITS))}"
        )
    return name
