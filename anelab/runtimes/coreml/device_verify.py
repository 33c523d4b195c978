"""Verify a sidecar on this Mac: Core ML's own predictions as the evaluator of ``anelab.sidecar.checks.verify``.

Every case of the verification (full and partial chunk, both negative controls) runs through Core
ML ``predict`` under the requested compute units, from the package's compiled copy; the report
adds, per case, Core ML against the NumPy evaluation of the same package and NumPy against the
reference — three comparisons per output. A stateful sidecar runs its prompt through one Core ML
state; its attn_out and the caches it leaves (read back with ``MLState.read_state``) are compared.
"""

from __future__ import annotations

import os

import numpy as np

from anelab.checkpoints.checkpoint import Checkpoint
from anelab.runtimes.coreml.assumptions import STATE_SHARED_BY_FUNCTIONS
from anelab.runtimes.coreml.coreml_runtime import default_runtime
from anelab.runtimes.interface import (
    NEURAL_ENGINE_UNITS,
    CoreMLRuntime,
    check_compute_units,
    prepare_inputs,
    require_gate_verdict,
)
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD
from anelab.sidecar.checks.verify import verify_package
from anelab.sidecar.format import STATE_NAMES, read_sidecar_metadata

# fp16 accumulation of a 576-wide projection: 2.3e-2 relative error, measured here on coreai-core's CPU runtime
# (issue 41, SmolLM2-135M's hidden 576). Whether the Neural Engine accumulates so is a Mac's to answer; until then a
# device comparison under it allows that error, grown as the square root of the reduction width (a random walk).
FP16_ACCUMULATION_AT_576 = 2.3e-2
ACCUMULATION_WIDTH = 576


def fp16_accumulation_error(width: int) -> float:
    """The relative error fp16 accumulation adds over a ``width``-long reduction (scaled from 576's measurement)."""
    return FP16_ACCUMULATION_AT_576 * float(np.sqrt(max(int(width), 1) / ACCUMULATION_WIDTH))


def device_threshold(package: str | os.PathLike, compute_units: str) -> tuple[float, str]:
    """(the threshold device comparisons are held to, why): the fp16 threshold, plus under the Neural Engine the fp16
    accumulation error of the block's widest reduction (hidden size or heads x head_dim)."""
    if compute_units not in NEURAL_ENGINE_UNITS:
        return RELATIVE_ERROR_THRESHOLD, "fp16 storage"
    g = read_sidecar_metadata(package).geometry
    width = max(int(g["hidden_size"]), int(g["num_heads"]) * int(g["head_dim"]))
    extra = fp16_accumulation_error(width)
    return RELATIVE_ERROR_THRESHOLD + extra, (
        f"fp16 storage {RELATIVE_ERROR_THRESHOLD:.0e} + fp16 accumulation over {width} ({extra:.1e}: "
        f"{FP16_ACCUMULATION_AT_576:.1e} measured at {ACCUMULATION_WIDTH}, scaled by its square root)"
    )


class CoreMLEvaluator:
    """``anelab.sidecar.checks.verify.Evaluator`` backed by Core ML: one handle per function, loaded on first use."""

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
    checkpoint: Checkpoint | None = None,
    *,
    compute_units: str,
    seed: int = 0,
    runtime: CoreMLRuntime | None = None,
):
    """``anelab.sidecar.checks.verify.verify_package`` with Core ML as the evaluator; refuses off-Mac (one line).

    Under ``cpu_and_ne`` / ``all`` a package the ANE gate never passed is refused before anything
    loads: its predicts would run in this process, and a failed ANE compile can kill it (#2758).
    """

    check_compute_units(compute_units)
    runtime = runtime if runtime is not None else default_runtime()
    runtime.require_available()
    require_gate_verdict(package, compute_units, "verify it on the device")
    evaluator = CoreMLEvaluator(runtime, package, compute_units)
    threshold, why = device_threshold(package, compute_units)
    evaluator.name += f"; threshold {threshold:.1e}: {why}"
    report = verify_package(package, checkpoint, seed=seed, evaluator=evaluator)
    report.threshold = max(report.threshold, threshold)  # every comparison without its own bound is held to it
    return report
