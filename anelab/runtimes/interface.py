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
import ctypes
import hashlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.paths import BUILD_DIR
from anelab.runtimes.assumptions import COMPILE_TO_MLMODELC, COMPUTE_PLAN_OF_COMPILED, LOAD_FUNCTION_BY_NAME

COMPUTE_UNITS = frozenset({"cpu_only", "cpu_and_gpu", "cpu_and_ne", "all"})


# compute-units settings that ask for the Neural Engine (a sidecar must be ANE-verified for these)
NEURAL_ENGINE_UNITS = frozenset({"cpu_and_ne", "all"})


MIN_MACOS = (15, 0)  # multifunction mlprograms with fp16 I/O target macOS 15 / iOS 18


# keys of compute_plan_assignment(): operations per PREFERRED device, plus operations the plan
# lists without a device usage ("unreported"); total = neural_engine + gpu + cpu
ASSIGNMENT_KEYS = ("neural_engine", "gpu", "cpu", "unreported", "total")


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


GATE_VERDICT_KEY = "aneCompileVerified"  # the sidecar metadata key the ANE gate writes (true / false)


def gate_verdict(pkg: str | os.PathLike) -> str:
    """The package's ANE gate verdict as recorded in its metadata: "true", "false" or "absent" (none, or no
    readable spec)."""
    from anelab.sidecar.format import read_raw_metadata

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


# ---- native output ---------------------------------------------------------------------------------
@dataclass
class NativeOutput:
    """What was written to file descriptors 1 and 2 inside ``capture_native_output`` (set on exit)."""

    stdout: str = ""
    stderr: str = ""

    @property
    def text(self) -> str:
        """Both streams, stderr first (where Core ML's ANE compiler messages usually are)."""
        return "\n".join(part for part in (self.stderr, self.stdout) if part)


def _flush_all() -> None:
    """Flush Python's streams and every C stdio buffer (``fflush(NULL)``), so no byte crosses the swap."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def capture_native_output() -> Iterator[NativeOutput]:
    """Capture everything written to file descriptors 1 and 2 — by C/Objective-C code too.

    Core ML reports ANE compiler failures on the process's native stdout or stderr while the call
    returns normally, so redirecting ``sys.stdout``/``sys.stderr`` would miss them. Both fds are
    pointed at temporary files with ``os.dup2``; C stdio buffers are flushed (libc ``fflush``)
    before the fds are restored. Messages Core ML prints only at process exit, or only to the
    unified log, are not seen here: run the call in a child process (``anelab.runtimes.gate``).
    """
    captured = NativeOutput()
    _flush_all()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    sinks = {fd: tempfile.TemporaryFile(mode="w+b") for fd in (1, 2)}
    try:
        for fd, sink in sinks.items():
            os.dup2(sink.fileno(), fd)
        try:
            yield captured
        finally:
            _flush_all()
            for fd, old in saved.items():
                os.dup2(old, fd)
            texts = {}
            for fd, sink in sinks.items():
                sink.seek(0)
                texts[fd] = sink.read().decode("utf-8", errors="replace")
            captured.stdout, captured.stderr = texts[1], texts[2]
    finally:
        for fd in saved.values():
            os.close(fd)
        for sink in sinks.values():
            sink.close()


# ---- what a package holds --------------------------------------------------------------------------
def package_content_hash(pkg: str | os.PathLike) -> str:
    """SHA-256 over the package's files (relative path and bytes, in sorted order): the compile cache key."""
    root = Path(pkg)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def package_functions(pkg: str | os.PathLike) -> list[str]:
    """The functions a sidecar package serves, from its metadata: ``c<C>`` (and ``c1``) for a stateful
    sidecar, ``h<H>`` per history otherwise."""
    from anelab.sidecar.format import STATE_FUNCTIONS_META, read_raw_metadata, read_sidecar_metadata

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
    from anelab.sidecar.coremltools_import import coremltools_modules

    ct, _, _ = coremltools_modules()
    from coremltools.proto import FeatureTypes_pb2

    spec = ct.utils.load_spec(str(pkg))
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

    def compiled_path(self, pkg: str | os.PathLike) -> Path:
        """Where the compiled copy of ``pkg`` lives in the cache (``<stem>-<content hash>.mlmodelc``)."""
        pkg = Path(pkg)
        return Path(self.cache_dir) / f"{pkg.stem}-{package_content_hash(pkg)[:20]}.mlmodelc"

    def compile(self, pkg: str | os.PathLike) -> Path:
        """The compiled copy of ``pkg``: compiled once, then reused for every load and compute plan."""
        from anelab.sidecar.format import require_package

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
        self.require_assumptions(LOAD_FUNCTION_BY_NAME)
        return self.load_path(self.compile(pkg), function, compute_units)

    @abc.abstractmethod
    def load_path(self, path: str | os.PathLike, function: str | None, compute_units: str) -> Any:
        """Load exactly what coremltools loads for ``path``: a ``.mlmodelc`` as it is; an ``.mlpackage``
        compiled afresh into a temporary copy (what a cold-from-package load costs)."""

    def load_duration_s(self, handle: Any) -> float | None:
        """Core ML's own load duration of ``handle`` (excludes any compile), where coremltools exposes it."""
        return None

    def prepare_process(self) -> list[str]:
        """Do this process's one-time Core ML work before any clock starts; return what was done.

        The first availability check imports coremltools' native module; the first compile or
        ``CompiledMLModel`` runs ``sw_vers`` in a subprocess (coremltools 9.0 ``_compiled_model.py:34``
        -> ``utils.py:959-968``, cached afterwards). A load timed after this holds the load only.
        """
        self.require_available()
        return ["checked the runtime is available"]

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
        PREFERS for each operation. Only the default function is planned: coremltools 9.0's binding
        (``MLComputePlan.load_from_path``) takes no function name and loads the plan without one.
        """
        check_compute_units(compute_units)
        self.require_available()
        self.require_assumptions(COMPUTE_PLAN_OF_COMPILED)
        return self.plan_path(self.compile(pkg), compute_units)

    @abc.abstractmethod
    def plan_path(self, compiled: Path, compute_units: str) -> dict[str, int]:
        """``compute_plan_assignment`` of an already compiled ``.mlmodelc``."""

    # evidence ---------------------------------------------------------------------------------------
    def read_unified_log(self, pid: int, start: float, end: float) -> str:
        """Unified-log lines of process ``pid`` between two ``time.time()`` stamps ("" where there is no log).

        Raises ``UnifiedLogUnavailable`` when the log could not be read (its contents are then unknown)."""
        return ""

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
        """Where this machine's latest probe verdicts live (beside the compiled-copy cache)."""
        return Path(self.cache_dir).parent / "core-ml-probe.json"

    def failed_assumptions(self) -> dict[str, str]:
        """Assumptions the latest probe on this machine found false: name -> what it saw ({} if never probed)."""
        import json

        path = self.probe_file
        if self.ignore_probe_file or not path.is_file():
            return {}
        stamp = path.stat().st_mtime_ns
        cached = getattr(self, "_failed_cache", None)
        if cached is None or cached[0] != stamp:
            verdicts = json.loads(path.read_text()).get("assumptions", {})
            failed = {name: v.get("detail", "") for name, v in verdicts.items() if not v.get("passed")}
            self._failed_cache = cached = (stamp, failed)
        return cached[1]

    def require_assumptions(self, *names: str) -> None:
        """Refuse, naming the assumption, when the probe found one of ``names`` false on this machine."""
        failed = self.failed_assumptions()
        for name in names:
            if name in failed:
                raise AssumptionFailedError(
                    f"refusing to measure: it relies on the Core ML assumption {name!r}, which 'anelab doctor --probe' "
                    f"found false on this Mac ({failed[name]}); see docs/mac-runbook.md"
                )


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


def runtime_from_spec(spec: dict) -> CoreMLRuntime:
    """Rebuild a runtime from ``CoreMLRuntime.child_spec()`` (in a child process)."""
    import importlib

    module, _, attr = spec["factory"].partition(":")
    factory = importlib.import_module(module)
    for part in attr.split("."):
        factory = getattr(factory, part)
    return factory(**spec.get("args", {}))


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
    Implemented by ``runtimes.coreai.CoreAIMacRuntime`` and, for the tests, ``runtimes.coreai_fake``.
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
        """Run an entrypoint; raises ``RuntimePredictError`` when Core AI refuses (the framework's text)."""

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
