"""The Core AI runtime on macOS 27 (coreai-core's ``coreai.runtime`` over the OS framework); refuses elsewhere.

Off macOS 27 this runtime is unavailable in one line (``unavailable_reason``): Core AI's framework ships
with macOS 27, and coreai-core's in-package runtime (what Linux and older macOS get) runs assets on the
CPU only, without specialization options ("the in-package Core AI runtime doesn't support delegates",
``SpecializationOptions.is_supported``). Export, verification and inspection of ``.aimodel`` sidecars
run anywhere (``sidecar.coreai.asset``); what this runtime adds is the Mac: specialization for the
Neural Engine, its cache, ahead-of-time compilation and predictions there. The Python API is async;
every call runs on one event loop in a thread of its own, so a caller inside a running loop (a
notebook kernel) can use it too.
"""

from __future__ import annotations

import asyncio
import platform
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from anelab.core.macos import macos_version as macos_version_read_as_coremltools
from anelab.runtimes.interface import (
    COREAI_MIN_MACOS,
    CoreAIRuntime,
    RuntimeLoadError,
    RuntimePredictError,
    check_coreai_compute_unit,
)
from anelab.sidecar.coreai.coreai_import import COREAI_INSTALL

COMPILE_TIMEOUT_S = 3600.0  # coreai-build compile of a large asset
CACHE_REACH = (
    "the asset's derived artifacts (_AIModelAsset.remove_derived_artifacts); Core AI's system cache is not "
    "reachable from Python (AIModelCache.default.deleteEntries(for:) is Swift-only), so a cold load is timed "
    "on a fresh copy of the asset at a path never loaded before"
)


class _Loop:
    """One asyncio loop in a daemon thread: ``run(coro)`` waits for the result."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="coreai", daemon=True).start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


class CoreAIMacRuntime(CoreAIRuntime):
    """Core AI through coreai-core on macOS 27 (``platform_name``, ``machine`` and ``macos_version`` let the
    refusals be tested on any machine; by default they read this one)."""

    name = "coreai"

    def __init__(
        self,
        *,
        platform_name: str | None = None,
        machine: str | None = None,
        macos_version: Callable[[], tuple[int, ...]] | None = None,
    ):
        self._platform = platform_name if platform_name is not None else sys.platform
        self._machine = machine if machine is not None else platform.machine()
        self._macos_version = macos_version or macos_version_read_as_coremltools
        self._loop: _Loop | None = None

    def unavailable_reason(self) -> str:
        need = f"macOS {'.'.join(map(str, COREAI_MIN_MACOS))}+ on Apple silicon (Core AI's framework and Neural Engine)"
        here = "export, verify and inspect .aimodel sidecars run here on coreai-core's CPU runtime"
        if self._platform != "darwin":
            return f"the Core AI runtime is unavailable: it needs {need} and this is {platform.system() or self._platform}; {here}"
        version = self._macos_version()
        if version < COREAI_MIN_MACOS:
            shown = ".".join(map(str, version)) or "unknown"
            return f"the Core AI runtime is unavailable: it needs {need} and this Mac runs macOS {shown}; {here}"
        if self._machine != "arm64":
            return f"the Core AI runtime is unavailable: it needs {need} and this Mac is {self._machine}"
        try:
            from coreai.runtime import SpecializationOptions
        except ImportError as e:
            return f"the Core AI runtime is unavailable: coreai-core does not import ({e}); {COREAI_INSTALL}"
        if not SpecializationOptions.is_supported():
            return (
                "the Core AI runtime is unavailable: coreai-core runs its in-package CPU runtime here (no specialization "
                "options); unset USE_LOCAL_COREAI, or set USE_OS_COREAI=1 for a development install"
            )
        return ""

    def _run(self, coro):
        if self._loop is None:
            self._loop = _Loop()
        return self._loop.run(coro)

    @staticmethod
    def _options(compute_unit: str):
        from coreai.runtime import ComputeUnitKind, SpecializationOptions

        unit = check_coreai_compute_unit(compute_unit)
        if unit == "default":
            return SpecializationOptions.default()
        if unit == "cpu":
            return SpecializationOptions.cpu_only()
        kind = ComputeUnitKind.neural_engine() if unit == "neural_engine" else ComputeUnitKind.gpu()
        return SpecializationOptions.from_preferred_compute_unit_kind(kind)

    def clear_cache(self, asset: Path) -> str:
        self.require_available()
        from coreai.runtime import _AIModelAsset

        _AIModelAsset(str(asset)).remove_derived_artifacts()
        return CACHE_REACH

    def specialize(self, asset: Path, compute_unit: str) -> Any:
        self.require_available()
        from coreai.runtime import AIModel

        options = self._options(compute_unit)
        try:
            return self._run(AIModel.load(Path(asset), options))
        except Exception as e:  # the framework's refusal, one line
            raise RuntimeLoadError(
                f"{Path(asset).name}: Core AI did not load it ({' '.join(str(e).split())})"
            ) from None

    def load_function(self, model: Any, name: str) -> Any:
        async def load():
            return model.load_function(name)

        return self._run(load())

    def prepare_process(self) -> list[str]:
        """Import ``coreai.runtime`` (0.11-0.44 s measured here) before any clock: a fresh-process load times the load."""
        self.require_available()
        from coreai.runtime import SpecializationOptions

        SpecializationOptions.is_supported()
        return ["imported coreai.runtime and read SpecializationOptions.is_supported()"]

    def prepare_inputs(self, inputs: dict[str, np.ndarray]) -> dict:
        from coreai.runtime import NDArray

        return {k: v if isinstance(v, NDArray) else NDArray(np.ascontiguousarray(v)) for k, v in inputs.items()}

    def make_state(self, function: Any) -> dict:
        """Each state as the entrypoint describes it (``NDArray.from_descriptor(state_descriptor(name))``: the backing
        the lowering asked for, IOSurface for K/V), zero-filled through its zero-copy NumPy view."""
        from coreai.runtime import NDArray

        states = {}
        for name in function.state_names:
            array = NDArray.from_descriptor(function.state_descriptor(name))
            array.numpy()[...] = 0
            states[name] = array
        return states

    def predict(self, function: Any, inputs: dict[str, np.ndarray], state: dict | None = None) -> dict:
        """Inputs and states already in Core AI's arrays pass as they are (``prepare_inputs``, ``make_state``); NumPy
        ones are wrapped (a copy) — a NumPy state once: the caller's dict keeps the array Core AI updates in place.
        Outputs are zero-copy NumPy views of the arrays Core AI returned."""
        arrays = self.prepare_inputs(inputs)
        if state is not None:
            state.update(self.prepare_inputs(state))

        async def call():
            out = await function(arrays, state=state or {})
            return {k: v.numpy() for k, v in out.items()}

        try:
            return self._run(call())
        except (RuntimeError, TypeError) as e:
            raise RuntimePredictError(" ".join(str(e).split())) from None

    def release(self, model: Any) -> None:
        async def drop(holder):
            holder.clear()

        self._run(drop([model]))

    def compile_ahead(self, asset: Path, out_dir: Path) -> list[Path]:
        """``xcrun coreai-build compile ASSET --platform macOS --preferred-compute neural-engine`` (the flags
        Apple's recipes use) run in ``out_dir`` on a copy of the asset; the ``.aimodelc`` it leaves there."""
        self.require_available()
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        copy = out_dir / Path(asset).name
        if not copy.exists():
            shutil.copytree(asset, copy)
        command = [
            "xcrun",
            "coreai-build",
            "compile",
            str(copy),
            "--platform",
            "macOS",
            "--preferred-compute",
            "neural-engine",
        ]
        try:
            done = subprocess.run(command, cwd=out_dir, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeLoadError(
                f"coreai-build compile did not run ({type(e).__name__}: {e}); is Xcode 27 installed?"
            ) from None
        compiled = sorted(out_dir.glob("*.aimodelc"))
        if done.returncode != 0 or not compiled:
            tail = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1][:200]
            raise RuntimeLoadError(
                f"coreai-build compile of {copy.name} left no .aimodelc (exit {done.returncode}: {tail}); "
                "see 'xcrun coreai-build compile --help'"
            )
        return compiled

    def child_spec(self) -> dict:
        return {"factory": "anelab.runtimes.coreai.coreai_runtime:CoreAIMacRuntime", "args": {}}


def default_coreai_runtime() -> CoreAIRuntime:
    """The Core AI runtime of this machine (check ``available()`` first)."""
    return CoreAIMacRuntime()
