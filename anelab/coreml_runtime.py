"""The Core ML runtime, behind one interface: load a sidecar function, predict, ask the compute plan.

This is the only module that touches the macOS Core ML framework (through coremltools' native
``libcoremlpython``); everything else in anelab talks to a ``CoreMLRuntime``. ``MacRuntime`` is the
real one; ``anelab.fake_runtime.FakeRuntime`` implements the same interface for tests.

Off-Mac ``coremltools.models.MLModel(path)`` "succeeds" silently and merely cannot predict, so
``MacRuntime.available()`` checks the platform, the macOS version and the native module explicitly,
and every runtime entry refuses with one ``RuntimeUnavailableError`` naming what is missing.

Compute units use the study's names: ``cpu_only``, ``cpu_and_gpu``, ``cpu_and_ne`` (CPU + Neural
Engine) and ``all``.
"""

from __future__ import annotations

import abc
import contextlib
import io
import os
import platform
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from anelab.errors import AnelabInputError

COMPUTE_UNITS = frozenset({"cpu_only", "cpu_and_gpu", "cpu_and_ne", "all"})
# compute-units settings that ask for the Neural Engine (a sidecar must be ANE-verified for these)
NEURAL_ENGINE_UNITS = frozenset({"cpu_and_ne", "all"})
MIN_MACOS = (15, 0)  # multifunction mlprograms with fp16 I/O target macOS 15 / iOS 18
# keys of compute_plan_assignment(): operations per PREFERRED device, plus operations the plan
# lists without a device usage ("unreported"); total = neural_engine + gpu + cpu
ASSIGNMENT_KEYS = ("neural_engine", "gpu", "cpu", "unreported", "total")


class RuntimeUnavailableError(AnelabInputError):
    """The Core ML runtime is not available here (not macOS 15+, or coremltools' native module missing)."""


class RuntimeLoadError(RuntimeError):
    """A package function did not load (the framework's own error is in the message)."""


def check_compute_units(name: str) -> str:
    """Return ``name`` if it is a compute-units setting; refuse an unknown one listing the valid ones."""
    if name not in COMPUTE_UNITS:
        raise AnelabInputError(f"unknown compute units {name!r}; use one of {', '.join(sorted(COMPUTE_UNITS))}")
    return name


def empty_assignment() -> dict[str, int]:
    return {key: 0 for key in ASSIGNMENT_KEYS}


# ---- native stderr capture -----------------------------------------------------------------------


@dataclass
class NativeStderr:
    """What was written to file descriptor 2 inside ``capture_native_stderr`` (set on exit)."""

    text: str = ""


@contextlib.contextmanager
def capture_native_stderr() -> Iterator[NativeStderr]:
    """Capture everything written to file descriptor 2 — by C/Objective-C code too, not only ``sys.stderr``.

    Core ML reports an ANE compile refusal on the process's native stderr and returns normally, so
    redirecting ``sys.stderr`` would miss it. fd 2 is pointed at a temporary file with ``os.dup2``
    for the duration and restored afterwards; ``.text`` holds the captured text after the block.
    """
    captured = NativeStderr()
    for stream in (sys.stderr, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            for stream in (sys.stderr, sys.__stderr__):
                with contextlib.suppress(Exception):
                    stream.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.text = sink.read().decode("utf-8", errors="replace")


# ---- the interface -------------------------------------------------------------------------------


class CoreMLRuntime(abc.ABC):
    """Load, predict and compute-plan queries for sidecar packages."""

    name = "abstract"
    load_description = "abstract"  # what one load() does, recorded with load timings

    @abc.abstractmethod
    def available(self) -> bool:
        """Whether this runtime can load and run packages on this machine."""

    @abc.abstractmethod
    def unavailable_reason(self) -> str:
        """Why ``available()`` is False (one line naming what is missing); "" when available."""

    @abc.abstractmethod
    def load(self, pkg: str | os.PathLike, function: str | None, compute_units: str) -> Any:
        """Load one function of a package (``None``: the package's default function); return a handle.

        Raises ``RuntimeLoadError`` when the function does not load.
        """

    @abc.abstractmethod
    def predict(self, handle: Any, inputs: dict) -> dict:
        """Run a loaded function on ``inputs`` (name -> array) and return its outputs (name -> array)."""

    @abc.abstractmethod
    def compute_plan_assignment(self, pkg: str | os.PathLike, compute_units: str) -> dict[str, int]:
        """Operations of the package's program per preferred compute device (keys: ``ASSIGNMENT_KEYS``).

        Counts the device the plan PREFERS for each operation, not the devices that merely support
        it. Core ML reports usage only for a package's default function, so a non-default function
        of a multifunction package reports nothing (total 0).
        """

    def capture_native_stderr(self) -> contextlib.AbstractContextManager[NativeStderr]:
        """fd-level capture of native stderr (see ``capture_native_stderr``)."""
        return capture_native_stderr()

    def require_available(self) -> None:
        """Raise ``RuntimeUnavailableError`` (one line, the reason) unless ``available()``."""
        if not self.available():
            raise RuntimeUnavailableError(self.unavailable_reason())


# ---- the real runtime: coremltools on macOS ------------------------------------------------------


def _macos_version() -> tuple[int, ...]:
    text = platform.mac_ver()[0]
    try:
        return tuple(int(x) for x in text.split(".")) if text else ()
    except ValueError:
        return ()


def _import_native() -> None:
    """Import coremltools' native module (raises ImportError/OSError when it is not there)."""
    with contextlib.redirect_stderr(io.StringIO()):  # coremltools prints its own warnings on import
        import coremltools.libcoremlpython  # noqa: F401


class MacRuntime(CoreMLRuntime):
    """Core ML through coremltools (``MLModel(path, compute_units=..., function_name=...)``).

    ``platform_name``, ``macos_version`` and ``import_native`` exist so the availability logic can
    be tested on any machine; by default they read this machine.
    """

    name = "coreml"
    load_description = ("coremltools MLModel(.mlpackage, compute_units, function_name): "
                        "compiles the package to .mlmodelc, then loads the function")

    def __init__(self, *, platform_name: str | None = None,
                 macos_version: Callable[[], tuple[int, ...]] | None = None,
                 import_native: Callable[[], None] | None = None):
        self._platform = platform_name if platform_name is not None else sys.platform
        self._macos_version = macos_version or _macos_version
        self._import_native = import_native or _import_native
        self._reason: str | None = None

    # availability ---------------------------------------------------------------------------------
    def unavailable_reason(self) -> str:
        if self._reason is None:
            self._reason = self._find_reason()
        return self._reason

    def available(self) -> bool:
        return self.unavailable_reason() == ""

    def _find_reason(self) -> str:
        need = f"macOS {MIN_MACOS[0]}+"
        if self._platform != "darwin":
            return (f"the Core ML runtime is unavailable: it needs {need} and this is {platform.system() or self._platform} "
                    f"(export, inspect and verify run here; loading, the ANE gate and timing need a Mac)")
        version = self._macos_version()
        if not version or tuple(version) < MIN_MACOS:
            shown = ".".join(map(str, version)) or "an unknown version"
            return f"the Core ML runtime is unavailable: it needs {need} and this Mac runs macOS {shown}; upgrade macOS"
        try:
            self._import_native()
        except Exception as e:  # ImportError, OSError from a wheel built for another platform
            return (f"the Core ML runtime is unavailable: coremltools.libcoremlpython does not import "
                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                    f"reinstall coremltools 9.0 from the macOS wheel ('make install')")
        return ""

    # entries --------------------------------------------------------------------------------------
    @staticmethod
    def _compute_unit(ct, compute_units: str):
        check_compute_units(compute_units)
        return {
            "cpu_only": ct.ComputeUnit.CPU_ONLY, "cpu_and_gpu": ct.ComputeUnit.CPU_AND_GPU,
            "cpu_and_ne": ct.ComputeUnit.CPU_AND_NE, "all": ct.ComputeUnit.ALL,
        }[compute_units]

    @staticmethod
    def _ct():
        with contextlib.redirect_stderr(io.StringIO()):
            import coremltools as ct
        return ct

    def load(self, pkg, function, compute_units):
        check_compute_units(compute_units)
        self.require_available()
        ct = self._ct()
        from anelab.export import require_package

        pkg = require_package(pkg)
        try:
            model = ct.models.MLModel(str(pkg), compute_units=self._compute_unit(ct, compute_units),
                                      function_name=function)
        except Exception as e:  # unknown function name, corrupt package, framework refusal
            raise RuntimeLoadError(f"{pkg}: function {function or '(default)'} does not load: {e}") from e
        # coremltools turns a framework load failure into a warning and a model without a proxy
        if getattr(model, "__proxy__", None) is None:
            err = getattr(model, "_framework_error", None)
            raise RuntimeLoadError(f"{pkg}: function {function or '(default)'} does not load: {err or 'no Core ML model proxy'}")
        return model

    def predict(self, handle, inputs):
        self.require_available()
        return handle.predict(inputs)

    def compute_plan_assignment(self, pkg, compute_units):
        check_compute_units(compute_units)
        self.require_available()
        ct = self._ct()
        from coremltools.models.compute_device import (
            MLCPUComputeDevice,
            MLGPUComputeDevice,
            MLNeuralEngineComputeDevice,
        )
        from coremltools.models.compute_plan import MLComputePlan

        from anelab.export import require_package

        pkg = require_package(pkg)
        counts = empty_assignment()
        work = Path(tempfile.mkdtemp(prefix=".compute-plan-"))
        try:
            compiled = ct.utils.compile_model(str(pkg), str(work / f"{pkg.stem}.mlmodelc"))
            plan = MLComputePlan.load_from_path(compiled, compute_units=self._compute_unit(ct, compute_units))
            program = plan.model_structure.program
            if program is None:  # not an mlprogram (e.g. what is left after an ANE refusal): nothing to count
                return counts

            def visit(block):
                for op in block.operations:
                    usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
                    device = None if usage is None else usage.preferred_compute_device
                    if isinstance(device, MLNeuralEngineComputeDevice):
                        counts["neural_engine"] += 1
                    elif isinstance(device, MLGPUComputeDevice):
                        counts["gpu"] += 1
                    elif isinstance(device, MLCPUComputeDevice):
                        counts["cpu"] += 1
                    else:
                        counts["unreported"] += 1
                    for inner in op.blocks:
                        visit(inner)

            for function in program.functions.values():
                visit(function.block)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        counts["total"] = counts["neural_engine"] + counts["gpu"] + counts["cpu"]
        return counts


def default_runtime() -> CoreMLRuntime:
    """The runtime of this machine (``MacRuntime``; check ``available()`` before using it)."""
    return MacRuntime()
