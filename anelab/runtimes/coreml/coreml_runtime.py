"""The Core ML runtime on macOS (coremltools 9.0's native binding); refuses clearly elsewhere.

Every package is compiled once (``ct.utils.compile_model``, cached by content hash, see
``anelab.runtimes.interface``) and each function is loaded from the compiled copy with
``ct.models.CompiledMLModel(path, compute_units, function_name=...)``: no per-load compile, no
temporary copy deleted when the handle dies, and the compute plan reads the same ``.mlmodelc``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import io
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from anelab.core.macos import macos_version as macos_version_read_as_coremltools
from anelab.runtimes.coreml.assumptions import (
    FP16_OUTPUTS_AS_FP32,
    FP32_FEEDS_FP16_INPUTS,
    FRESH_STATE_ZEROED,
    STATE_BY_NAME,
)
from anelab.runtimes.coreml.gate import preflight
from anelab.runtimes.coreml.probe import probe_core_ml
from anelab.runtimes.interface import (
    COMPUTE_OPERATORS,
    MIN_MACOS,
    CoreMLRuntime,
    RuntimeLoadError,
    RuntimePredictError,
    UnifiedLogUnavailable,
    check_compute_units,
    empty_assignment,
)

LOG_SHOW_TIMEOUT_S = 120.0


def _import_native() -> None:
    """Import coremltools' native module (raises ImportError/OSError when it is not there)."""
    with contextlib.redirect_stderr(io.StringIO()):  # coremltools prints its own warnings on import
        import coremltools.libcoremlpython  # noqa: F401


def _import_ct():
    with contextlib.redirect_stderr(io.StringIO()):
        import coremltools as ct
    return ct


def _one_line(err: BaseException) -> str:
    """coremltools formats Core ML errors as a multi-line NSDictionary dump: fold it to one line."""
    return " ".join(str(err).split()) or type(err).__name__


class MacRuntime(CoreMLRuntime):
    """Core ML through coremltools: compile once, ``CompiledMLModel`` per function, state, compute plan.

    ``platform_name``, ``machine``, ``macos_version``, ``import_native`` and ``ct`` exist so the
    logic can be tested on any machine (``ct``: a callable returning a coremltools-like module);
    by default they read this machine.
    """

    name = "coreml"
    load_description = (
        "coremltools CompiledMLModel(<package>.mlmodelc, compute_units, function_name): the package is "
        "compiled once (ct.utils.compile_model, cached by content hash) and each function loads from that copy"
    )

    def __init__(
        self,
        *,
        platform_name: str | None = None,
        machine: str | None = None,
        macos_version: Callable[[], tuple[int, ...]] | None = None,
        import_native: Callable[[], None] | None = None,
        ct: Callable[[], object] | None = None,
        cache_dir: str | Path | None = None,
    ):
        self._platform = platform_name if platform_name is not None else sys.platform
        self._machine = machine if machine is not None else platform.machine()
        self._macos_version = macos_version or macos_version_read_as_coremltools
        self._import_native = import_native or _import_native
        self._ct_loader = ct or _import_ct
        if cache_dir is not None:
            self.cache_dir = Path(cache_dir)
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
        except Exception as e:  # ImportError, OSError from a broken install
            return (
                f"the Core ML runtime is unavailable: coremltools.libcoremlpython does not import "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                f"reinstall coremltools 9.0 ('make install')"
            )
        return ""

    def neural_engine_reason(self) -> str:
        if not self.available():
            return self.unavailable_reason()
        if self._machine != "arm64":
            return (
                f"no Neural Engine: this Mac is {self._machine}, not Apple silicon (arm64); "
                f"the ANE gate and ANE timings need an Apple-silicon Mac"
            )
        ct = self._ct()
        from_devices = getattr(ct.models.MLModel, "get_available_compute_devices", None)
        try:
            devices = from_devices() if from_devices is not None else []
        except Exception as e:  # macOS < 14: MLComputeDevice unavailable
            return f"no Neural Engine could be listed ({_one_line(e)})"
        engine = ct.models.compute_device.MLNeuralEngineComputeDevice
        if not any(isinstance(d, engine) for d in devices):
            return "no Neural Engine: Core ML lists none among this Mac's compute devices (a virtual machine?)"
        return ""

    def child_spec(self) -> dict:
        return {
            "factory": "anelab.runtimes.coreml.coreml_runtime:MacRuntime",
            "args": {"cache_dir": str(self.cache_dir)},
        }

    # helpers --------------------------------------------------------------------------------------
    def _ct(self):
        return self._ct_loader()

    @staticmethod
    def _compute_unit(ct, compute_units: str):
        check_compute_units(compute_units)
        return {
            "cpu_only": ct.ComputeUnit.CPU_ONLY,
            "cpu_and_gpu": ct.ComputeUnit.CPU_AND_GPU,
            "cpu_and_ne": ct.ComputeUnit.CPU_AND_NE,
            "all": ct.ComputeUnit.ALL,
        }[compute_units]

    # compile / load -------------------------------------------------------------------------------
    def compile_to(self, pkg, dest):
        ct = self._ct()
        try:
            return Path(ct.utils.compile_model(str(pkg), str(dest)))
        except Exception as e:
            raise RuntimeLoadError(f"{pkg}: does not compile: {_one_line(e)}") from e

    def load_path(self, path, function, compute_units):
        check_compute_units(compute_units)
        self.require_available()
        ct = self._ct()
        path = Path(path)
        units = self._compute_unit(ct, compute_units)
        label = f"{path}: function {function or '(default)'}"
        try:
            if path.suffix == ".mlmodelc":  # raises RuntimeError when Core ML refuses the load
                return ct.models.CompiledMLModel(str(path), units, function_name=function)
            model = ct.models.MLModel(str(path), compute_units=units, function_name=function)
        except Exception as e:  # unknown function name, corrupt package, framework refusal
            raise RuntimeLoadError(f"{label} does not load: {_one_line(e)}") from e
        # MLModel turns a framework load failure into a warning and a model without a proxy
        if getattr(model, "__proxy__", None) is None:
            err = getattr(model, "_framework_error", None)
            raise RuntimeLoadError(f"{label} does not load: {_one_line(err) if err else 'no Core ML model proxy'}")
        return model

    def prepare_process(self, compute_units="cpu_only"):
        """Import coremltools and its native module, run ``_macos_version()`` (``sw_vers``, lru-cached, coremltools
        9.0 ``utils.py:959-968``) that the first ``CompiledMLModel`` would run (``_compiled_model.py:34``), then pay
        Core ML's own first load and predict on a tiny model (``CoreMLRuntime.prepare_process``)."""
        self.require_available()
        ct = self._ct()
        macos_version = getattr(ct.utils, "_macos_version", None)
        if macos_version is not None:
            macos_version()
        return [
            "imported coremltools and coremltools.libcoremlpython",
            "ran coremltools.models.utils._macos_version() (sw_vers subprocess, cached for the process)",
            *super().prepare_process(compute_units)[1:],
        ]

    # the probe and pre-flight -------------------------------------------------------------------
    def probe_first(self, reason):
        """First contact: the probe runs (in children) before code relies on an unprobed assumption."""

        print(f"anelab: {reason}: probing Core ML first (anelab doctor --probe)", file=sys.stderr)
        probe_core_ml(self, reason=reason)

    def preflight(self, pkg, function, compute_units, steps):

        preflight(self, pkg, function, compute_units, steps)

    def write_log_marker(self, text: str) -> None:
        """Log one line to the unified log under this process's PID (syslog(3) reaches os_log on macOS)."""
        import syslog

        syslog.syslog(syslog.LOG_NOTICE, text)

    @staticmethod
    def _proxy_seconds(handle, getter_name: str) -> float | None:
        proxy = getattr(handle, "_proxy", None) or getattr(handle, "__proxy__", None)
        getter = getattr(proxy, getter_name, None)
        value = getter() if getter is not None else None
        return None if value is None else value / 1e9

    def load_duration_s(self, handle):
        return self._proxy_seconds(handle, "get_load_duration_in_nano_seconds")  # CoreMLPython.mm:1041-1047

    def predict_duration_s(self, handle):
        return self._proxy_seconds(handle, "get_last_predict_duration_in_nano_seconds")  # CoreMLPython.mm:1049-1055

    # predict --------------------------------------------------------------------------------------
    def make_state(self, handle):
        self.require_assumptions(STATE_BY_NAME, FRESH_STATE_ZEROED, compute_units=self.handle_units(handle))
        try:
            return handle.make_state()
        except Exception as e:
            raise RuntimePredictError(f"no state for this function: {_one_line(e)}") from e

    def predict(self, handle, inputs, state=None):
        self.require_available()
        self.require_assumptions(FP32_FEEDS_FP16_INPUTS, FP16_OUTPUTS_AS_FP32, compute_units=self.handle_units(handle))
        try:
            return handle.predict(inputs) if state is None else handle.predict(inputs, state=state)
        except (RuntimeError, KeyError, TypeError, ValueError) as e:
            raise RuntimePredictError(f"predict failed: {_one_line(e)}") from e

    # compute plan ---------------------------------------------------------------------------------
    def plan_path(self, compiled, compute_units, function=None):
        check_compute_units(compute_units)
        self.require_available()
        compiled = Path(compiled)
        if compiled.suffix != ".mlmodelc":  # coremltools 9.0 aborts the process on an .mlpackage (#2757)
            raise ValueError(f"{compiled}: the compute plan needs a compiled .mlmodelc; compile the package first")
        ct = self._ct()
        from coremltools.models.compute_device import (
            MLCPUComputeDevice,
            MLGPUComputeDevice,
            MLNeuralEngineComputeDevice,
        )
        from coremltools.models.compute_plan import MLComputePlan

        counts = empty_assignment()
        plan = MLComputePlan.load_from_path(str(compiled), compute_units=self._compute_unit(ct, compute_units))
        program = plan.model_structure.program
        if program is None:  # the plan describes no ML program: nothing to count (the gate refuses total 0)
            return counts

        def visit(block):
            for op in block.operations:
                usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
                device = None if usage is None else usage.preferred_compute_device
                if op.operator_name in COMPUTE_OPERATORS:
                    counts["compute_ops"] += 1
                    counts["compute_ops_on_neural_engine"] += isinstance(device, MLNeuralEngineComputeDevice)
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

        listed = program.functions
        for name in [function] if function in listed else list(listed):  # a merged plan: the function asked only
            visit(listed[name].block)
        counts["total"] = counts["neural_engine"] + counts["gpu"] + counts["cpu"]
        return counts

    # unified log ----------------------------------------------------------------------------------
    def read_unified_log(self, pid, start, end, helpers=()):
        """``log show`` for one process (and the named helper processes) and time window (Core ML's
        [espresso]/[coreml] lines reach no fd)."""
        fmt = "%Y-%m-%d %H:%M:%S"
        window = [
            _dt.datetime.fromtimestamp(start - 1).strftime(fmt),
            _dt.datetime.fromtimestamp(end + 1).strftime(fmt),
        ]
        predicate = " OR ".join([f"processID == {int(pid)}", *(f'process == "{name}"' for name in helpers)])
        cmd = ["log", "show", "--style", "compact", "--info", "--debug", "--predicate", predicate]
        cmd += ["--start", window[0], "--end", window[1]]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=LOG_SHOW_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise UnifiedLogUnavailable(f"'log show' did not finish within {LOG_SHOW_TIMEOUT_S:.0f} s") from None
        except (OSError, subprocess.SubprocessError) as e:
            raise UnifiedLogUnavailable(f"'log show' failed ({type(e).__name__}: {e})") from None
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
            raise UnifiedLogUnavailable(f"'log show' exited with status {done.returncode} ({tail})")
        return done.stdout


def default_runtime() -> CoreMLRuntime:
    """The runtime of this machine (``MacRuntime``; check ``available()`` before using it)."""
    return MacRuntime()
