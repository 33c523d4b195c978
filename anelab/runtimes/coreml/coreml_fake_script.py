"""The scripted pieces of the fake Core ML runtime (``runtimes.coreml.coreml_fake``): its clock, its crash, one function's
script, a loaded handle and a fresh state — what a test writes down about a fake Mac, apart from the runtime
that plays it."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from anelab.runtimes.interface import RuntimePredictError


class FakeClock:
    """A clock for ``anelab.runtimes.coreml.timing.measure``: ``clock()`` returns seconds; only ``advance`` moves it."""

    def __init__(self, start: float = 1000.0):
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self.now += float(seconds)


class FakeCrash(BaseException):  # noqa: N818 - it stands for a signal, not an error
    """What would have been a fatal signal in a real process (in-process fake only)."""

    def __init__(self, signal_name: str, where: str):
        super().__init__(f"{signal_name} in {where}")
        self.signal_name = signal_name


@dataclass
class FakeFunction:
    """Scripted behaviour of one function.

    load_stdout / load_stderr: text written to fd 1 / fd 2 during a load (the load still returns).
    exit_stderr:   text written to fd 2 only when the process exits (after a load).
    log_text:      text that reaches only the unified log (during a load).
    predict_stderr: text written to fd 2 during a predict.
    plan_stderr / plan_error: fd-2 text while the compute plan is built / a RuntimeError instead of a plan.
    load_error / unloadable_units: the load raises (always / under these compute units).
    predict_error: every predict raises ``RuntimePredictError`` with this text.
    predict_signal: e.g. "SIGKILL": the process dies at the first predict (no exception) — under
                   ``signal_units`` only (None: every setting), and with ``signal_when_merged`` only when the
                   function was loaded from a package of more than one function.
    exit_stdout:   text written to fd 1 only when the process exits (after a load).
    load_call_s:   wall seconds of a load outside Core ML's own load duration.
    assignment:    operations per preferred device (neural_engine, gpu, cpu[, unreported]); total derived.
    compute_ops / compute_ops_on_ane: the plan's matmuls, linears and softmaxes, and how many prefer the ANE.
    inputs / states / output_shapes: name -> shape; ``None``: read from the package's spec when it has one.
    cold_load_s / warm_load_s / teardown_s / convert_s: seconds on the clock (convert_s: the fp16 -> fp32
                   cast of inputs coremltools does in the caller's dict).
    output_convert_s: seconds per predict converting the outputs to NumPy, outside Core ML's duration.
    predict_s:     seconds per predict, by compute-units setting (missing setting: ``predict_default_s``).
    outputs:       what ``predict`` returns (a copy); empty: zeros of the output shapes.
    """

    load_stdout: str = ""
    load_stderr: str = ""
    exit_stderr: str = ""
    log_text: str = ""
    predict_stderr: str = ""
    plan_stderr: str = ""
    plan_error: str | None = None
    load_error: str | None = None
    unloadable_units: frozenset[str] = frozenset()
    predict_error: str | None = None
    predict_signal: str | None = None
    signal_units: frozenset[str] | None = None
    signal_when_merged: bool = False
    exit_stdout: str = ""
    load_call_s: float = 0.0
    assignment: dict[str, int] | None = field(default_factory=lambda: {"neural_engine": 64, "gpu": 0, "cpu": 109})
    compute_ops: int = 12  # of the plan's operations, the matmuls, linears and softmaxes (COMPUTE_OPERATORS)
    compute_ops_on_ane: int | None = None  # how many of them prefer the Neural Engine (None: all, when any op does)
    inputs: dict[str, tuple] | None = None
    states: dict[str, tuple] | None = None
    output_shapes: dict[str, tuple] | None = None
    cold_load_s: float = 6.0
    warm_load_s: float = 1.0
    teardown_s: float = 0.2
    convert_s: float = 0.05
    output_convert_s: float = 0.02
    predict_s: dict[str, float] = field(default_factory=dict)
    predict_default_s: float = 0.5
    outputs: dict = field(default_factory=dict)

    def to_args(self) -> dict:
        """JSON-able fields (for a child process); ``outputs`` are not carried."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "outputs"}
        d["unloadable_units"] = sorted(self.unloadable_units)
        d["signal_units"] = None if self.signal_units is None else sorted(self.signal_units)
        return d

    @classmethod
    def from_args(cls, d: dict) -> FakeFunction:
        d = dict(d)
        d["unloadable_units"] = frozenset(d.get("unloadable_units", ()))
        if d.get("signal_units") is not None:
            d["signal_units"] = frozenset(d["signal_units"])
        return cls(**d)


FIRST_USE_SCRIPT = FakeFunction(
    assignment={"neural_engine": 1, "gpu": 0, "cpu": 0}, cold_load_s=0.002, warm_load_s=0.001, teardown_s=0.0,
    convert_s=0.0, output_convert_s=0.0, predict_default_s=0.0005,
)  # fmt: skip


FIRST_USE_ON_CPU = FakeFunction(
    **{**FIRST_USE_SCRIPT.to_args(), "assignment": {"neural_engine": 0, "gpu": 0, "cpu": 1}}
)


class CallList(list):
    """``calls``: a list that also appends each call to a file (in a child process, for the parent)."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def append(self, item):
        super().append(item)
        if self.path:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(list(item)) + "\n")


class FakeHandle:
    """A loaded function; releasing it costs ``teardown_s`` and deletes a temporary compiled copy.

    ``temporary``: loaded from an ``.mlpackage`` (an ``MLModel``), else from a ``.mlmodelc``
    (a ``CompiledMLModel``). ``load_s`` / ``last_predict_s``: Core ML's own durations.
    """

    def __init__(self, runtime: Any, package: str, compiled: Path, name: str, units: str, temporary: bool):
        self.runtime, self.package, self.compiled = runtime, package, compiled
        self.function, self.compute_units, self.temporary = name, units, temporary
        self.load_s: float | None = None
        self.last_predict_s: float | None = None
        self.merged = False  # loaded from a package of more than one function

    def __getitem__(self, key):  # older callers read handle["function"]
        return {"package": self.package, "function": self.function, "compute_units": self.compute_units}[key]

    def __del__(self):
        try:
            self.runtime.clock.advance(self.runtime.script(self.function).teardown_s)
            if self.runtime._calls_of(self.package) is self.runtime.calls:  # noqa: SLF001 - its own runtime
                self.runtime.released.append(self.function)
            if self.temporary:
                shutil.rmtree(self.compiled, ignore_errors=True)
        except Exception:  # interpreter shutdown
            pass


class FakeState(dict):
    """A fresh ``MLState``: state name -> zeros; ``read_state(name)`` as coremltools 9.0's ``MLState``
    (a bad name raises ``RuntimeError``, ``CoreMLPython.mm:697-704``). ``made_by``: the function whose
    handle made it."""

    made_by: str | None = None

    def read_state(self, name: str) -> np.ndarray:
        if name not in self:
            raise RuntimeError(f"no state named {name!r}")
        return np.array(self[name], dtype=np.float32)


def check_predict_inputs(inputs, state, expected, states, _outputs, *, names_checked: bool) -> None:
    """Core ML's checks of a predict's inputs and state, as ``FakeRuntime.predict`` applies them."""
    for (
        key
    ) in inputs:  # MLModel checks names (model.py:1055-1060); CompiledMLModel does not (_compiled_model.py:227-231)
        if names_checked and key not in expected:
            raise RuntimePredictError(
                f'predict failed: Provided key "{key}", in the input dict, does not match any of the model '
                f"input name(s), which are: {set(expected)}"
            )
    for key, shape in expected.items():
        if key not in inputs:
            raise RuntimePredictError(
                f'predict failed: {{ NSLocalizedDescription = "Feature {key} is required but not specified."; }}'
            )
        if tuple(np.shape(inputs[key])) != tuple(shape):
            raise RuntimePredictError(
                f"predict failed: {{ NSLocalizedDescription = \"For input feature '{key}', the provided shape "
                f"{tuple(np.shape(inputs[key]))} is not compatible with the model's feature description.\"; }}"
            )
    if states and state is None:
        first = next(iter(states))
        raise RuntimePredictError(
            f'predict failed: {{ NSLocalizedDescription = "The input feature for {first} must be an MLState, '
            f'but it was not."; }}'
        )
