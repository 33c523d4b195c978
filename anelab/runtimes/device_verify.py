"""Verify a sidecar on this Mac: Core ML's own predictions as the evaluator of ``anelab.sidecar.verify``.

Every case of the verification (full and partial chunk, both negative controls) runs through Core
ML ``predict`` under the requested compute units, from the package's compiled copy; the report
adds, per case, Core ML against the NumPy evaluation of the same package and NumPy against the
reference — three comparisons per output. A stateful sidecar runs its prompt through one Core ML
state; its attn_out and the caches it leaves (read back with ``MLState.read_state``) are compared.
"""

from __future__ import annotations

import os

import numpy as np

from anelab.runtimes.assumptions import STATE_SHARED_BY_FUNCTIONS
from anelab.runtimes.coreml import default_runtime
from anelab.runtimes.interface import CoreMLRuntime, check_compute_units, prepare_inputs, require_gate_verdict
from anelab.sidecar.format import STATE_NAMES


class CoreMLEvaluator:
    """``anelab.sidecar.verify.Evaluator`` backed by Core ML: one handle per function, loaded on first use."""

    def __init__(self, runtime: CoreMLRuntime, package: str | os.PathLike, compute_units: str):
        self.runtime, self.package, self.compute_units = runtime, package, check_compute_units(compute_units)
        self.name = f"Core ML predict ({compute_units}, {runtime.name})"
        self._handles: dict = {}
        self._made_by: dict[int, str] = {}  # id(state) -> the function whose handle made it

    def handle(self, function: str):
        if function not in self._handles:
            self._handles[function] = self.runtime.load(self.package, function, self.compute_units)
        return self._handles[function]

    def make_state(self, function: str):
        """A fresh Core ML state (``MLState``) for a stateful function, remembered as made by ``function``."""
        state = self.runtime.make_state(self.handle(function))
        self._made_by[id(state)] = function
        return state

    def state_arrays(self, state) -> dict[str, np.ndarray]:
        """The K/V cache a Core ML state holds after the calls (``MLState.read_state``), name -> array."""
        return {name: np.asarray(state.read_state(name)) for name in STATE_NAMES}

    def __call__(self, function: str, inputs: dict, state=None) -> dict:
        if state is not None and self._made_by.get(id(state), function) != function:  # c1 after c<C>
            self.runtime.require_assumptions(STATE_SHARED_BY_FUNCTIONS, compute_units=self.compute_units)
        out = self.runtime.predict(self.handle(function), prepare_inputs(inputs), state=state)
        return {name: np.asarray(value) for name, value in out.items()}


def verify_on_device(
    package: str | os.PathLike,
    checkpoint_dir: str | os.PathLike | None = None,
    *,
    compute_units: str,
    seed: int = 0,
    runtime: CoreMLRuntime | None = None,
):
    """``anelab.sidecar.verify.verify_package`` with Core ML as the evaluator; refuses off-Mac (one line).

    Under ``cpu_and_ne`` / ``all`` a package the ANE gate never passed is refused before anything
    loads: its predicts would run in this process, and a failed ANE compile can kill it (#2758).
    """
    from anelab.sidecar.verify import verify_package

    check_compute_units(compute_units)
    runtime = runtime if runtime is not None else default_runtime()
    runtime.require_available()
    require_gate_verdict(package, compute_units, "verify it on the device")
    return verify_package(
        package, checkpoint_dir, seed=seed, evaluator=CoreMLEvaluator(runtime, package, compute_units)
    )
