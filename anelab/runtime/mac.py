"""The Core ML runtime on macOS (coremltools' native binding); refuses clearly elsewhere."""

from __future__ import annotations

import contextlib
import io
import platform
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from anelab.runtime.interface import MIN_MACOS, CoreMLRuntime, RuntimeLoadError, check_compute_units, empty_assignment


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
    load_description = (
        "coremltools MLModel(.mlpackage, compute_units, function_name): "
        "compiles the package to .mlmodelc, then loads the function"
    )

    def __init__(
        self,
        *,
        platform_name: str | None = None,
        macos_version: Callable[[], tuple[int, ...]] | None = None,
        import_native: Callable[[], None] | None = None,
    ):
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
            return (
                f"the Core ML runtime is unavailable: it needs {need} and this is {platform.system() or self._platform} "
                f"(export, inspect and verify run here; loading, the ANE gate and timing need a Mac)"
            )
        version = self._macos_version()
        if not version or tuple(version) < MIN_MACOS:
            shown = ".".join(map(str, version)) or "an unknown version"
            return f"the Core ML runtime is unavailable: it needs {need} and this Mac runs macOS {shown}; upgrade macOS"
        try:
            self._import_native()
        except Exception as e:  # ImportError, OSError from a wheel built for another platform
            return (
                f"the Core ML runtime is unavailable: coremltools.libcoremlpython does not import "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                f"reinstall coremltools 9.0 from the macOS wheel ('make install')"
            )
        return ""

    # entries --------------------------------------------------------------------------------------
    @staticmethod
    def _compute_unit(ct, compute_units: str):
        check_compute_units(compute_units)
        return {
            "cpu_only": ct.ComputeUnit.CPU_ONLY,
            "cpu_and_gpu": ct.ComputeUnit.CPU_AND_GPU,
            "cpu_and_ne": ct.ComputeUnit.CPU_AND_NE,
            "all": ct.ComputeUnit.ALL,
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
        from anelab.sidecar.format import require_package

        pkg = require_package(pkg)
        try:
            model = ct.models.MLModel(
                str(pkg), compute_units=self._compute_unit(ct, compute_units), function_name=function
            )
        except Exception as e:  # unknown function name, corrupt package, framework refusal
            raise RuntimeLoadError(f"{pkg}: function {function or '(default)'} does not load: {e}") from e
        # coremltools turns a framework load failure into a warning and a model without a proxy
        if getattr(model, "__proxy__", None) is None:
            err = getattr(model, "_framework_error", None)
            raise RuntimeLoadError(
                f"{pkg}: function {function or '(default)'} does not load: {err or 'no Core ML model proxy'}"
            )
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

        from anelab.sidecar.format import require_package

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
