"""A scripted ``CoreMLRuntime`` for tests: per-function stderr, load failures, assignments and timings.

Functions are identified by name: ``load(pkg, "h4096", ...)`` is function ``h4096``; a
single-function package loaded with ``function=None`` is identified by its file stem (the exporter
writes each variant as ``h<H>.mlpackage`` before the merge). Behaviour is configured per function
with ``FakeFunction``; functions not configured get ``default``.

Stderr text is written to the real file descriptor 2 (``os.write(2, ...)``), so a caller's
fd-level capture is exercised exactly as native Core ML output would be. Time comes from a
``FakeClock`` that only moves when the fake "works" (load: cold on the first load of a
(package, function), warm after; predict: per compute-units setting), so timings are exact.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from anelab.runtime.interface import ASSIGNMENT_KEYS, CoreMLRuntime, RuntimeLoadError, check_compute_units


class FakeClock:
    """A clock for ``anelab.runtime.timing.measure``: ``clock()`` returns seconds; only ``advance`` moves it."""

    def __init__(self, start: float = 1000.0):
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self.now += float(seconds)


@dataclass
class FakeFunction:
    """Scripted behaviour of one function.

    load_stderr:   text written to fd 2 during ``load`` (e.g. an ANE refusal marker), the load still returning.
    plan_stderr:   text written to fd 2 during ``compute_plan_assignment``.
    plan_error:    when set, ``compute_plan_assignment`` raises ``RuntimeError`` with this text.
    load_error:    when set, ``load`` raises ``RuntimeLoadError`` with this text.
    unloadable_units: compute-units settings under which ``load`` raises (e.g. {"cpu_and_ne"}).
    assignment:    operations per preferred device: neural_engine, gpu, cpu (and optionally unreported);
                   total is derived. ``None`` means the plan reports nothing (a non-default function).
    cold_load_s / warm_load_s: seconds the clock advances on the first / a later load.
    predict_s:     seconds per predict, by compute-units setting (missing setting: ``predict_default_s``).
    outputs:       what ``predict`` returns (a copy).
    """

    load_stderr: str = ""
    plan_stderr: str = ""
    plan_error: str | None = None
    load_error: str | None = None
    unloadable_units: frozenset[str] = frozenset()
    assignment: dict[str, int] | None = field(default_factory=lambda: {"neural_engine": 64, "gpu": 0, "cpu": 109})
    cold_load_s: float = 6.0
    warm_load_s: float = 1.0
    predict_s: dict[str, float] = field(default_factory=dict)
    predict_default_s: float = 0.5
    outputs: dict = field(default_factory=dict)


class FakeRuntime(CoreMLRuntime):
    """``CoreMLRuntime`` driven by a script; records every call in ``calls`` and every load in ``loads``."""

    name = "fake"
    load_description = "scripted fake load (FakeClock seconds)"

    def __init__(
        self,
        functions: dict[str, FakeFunction] | None = None,
        *,
        default: FakeFunction | None = None,
        available: bool = True,
        reason: str = "fake runtime switched off",
        clock: FakeClock | None = None,
    ):
        self.functions = dict(functions or {})
        self.default = default if default is not None else FakeFunction()
        self._available = available
        self._reason = reason
        self.clock = clock if clock is not None else FakeClock()
        self.calls: list[tuple] = []
        self.loads: list[tuple[str, str, str]] = []  # (package path, function, compute units)
        self._loaded_before: set[tuple[str, str]] = set()

    def available(self) -> bool:
        return self._available

    def unavailable_reason(self) -> str:
        return "" if self._available else self._reason

    def function_of(self, pkg, function: str | None) -> str:
        return function if function is not None else Path(pkg).stem

    def script(self, name: str) -> FakeFunction:
        return self.functions.get(name, self.default)

    @staticmethod
    def _emit(text: str) -> None:
        if text:
            os.write(2, text.encode())

    def load(self, pkg, function, compute_units):
        check_compute_units(compute_units)
        self.require_available()
        name = self.function_of(pkg, function)
        self.calls.append(("load", str(pkg), name, compute_units))
        f = self.script(name)
        self._emit(f.load_stderr)
        key = (str(Path(pkg).resolve()), name)
        self.clock.advance(f.warm_load_s if key in self._loaded_before else f.cold_load_s)
        self._loaded_before.add(key)
        if f.load_error is not None:
            raise RuntimeLoadError(f"{pkg}: function {name} does not load: {f.load_error}")
        if compute_units in f.unloadable_units:
            raise RuntimeLoadError(f"{pkg}: function {name} does not load under {compute_units}")
        self.loads.append((str(pkg), name, compute_units))
        return {"package": str(pkg), "function": name, "compute_units": compute_units}

    def predict(self, handle, inputs):
        self.require_available()
        name, units = handle["function"], handle["compute_units"]
        self.calls.append(("predict", handle["package"], name, units))
        f = self.script(name)
        self.clock.advance(f.predict_s.get(units, f.predict_default_s))
        return dict(f.outputs)

    def compute_plan_assignment(self, pkg, compute_units):
        check_compute_units(compute_units)
        self.require_available()
        name = self.function_of(pkg, None)
        self.calls.append(("compute_plan", str(pkg), name, compute_units))
        f = self.script(name)
        self._emit(f.plan_stderr)
        if f.plan_error is not None:
            raise RuntimeError(f.plan_error)
        counts = {key: 0 for key in ASSIGNMENT_KEYS}
        for key, value in (f.assignment or {}).items():
            if key not in counts or key == "total":
                raise ValueError(f"FakeFunction.assignment key {key!r}; use neural_engine, gpu, cpu, unreported")
            counts[key] = int(value)
        counts["total"] = counts["neural_engine"] + counts["gpu"] + counts["cpu"]
        return counts
