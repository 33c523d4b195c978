"""Timing of sidecar loads and predictions: warm-up, N repeats, min / median / max, written as records.

Three measurements from the ANE prefill research seed ("Qwen 3.8: the ANE loses"):

- ``time_load``: ``MLModel`` load of one function, cold (each repeat loads a fresh copy of the
  package from a new path) or warm (the same path again, after a warm-up load);
- ``time_compositions``: the same function loaded from different package compositions (alone;
  beside another history; beside a variant that cannot load) — does the load track the function's
  own specialisation or the package?;
- ``time_predict``: one prediction per compute-units setting.

Each returns a record (``anelab.records.make_record``, origin ``"measured"``) and writes it to
``out_dir`` when one is given — results are never only printed. ``clock`` is injectable so tests run
on a deterministic fake clock.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from anelab.errors import AnelabInputError
from anelab.records import make_record, write_record
from anelab.runtime.interface import CoreMLRuntime, RuntimeLoadError, check_compute_units

COMPUTE_UNITS_ORDER = ("cpu_only", "cpu_and_gpu", "cpu_and_ne", "all")


# what a cold load can and cannot rule out (goes into every cold record's "unknown")
COLD_LOAD_CAVEAT = (
    "whether Core ML's system-wide ANE compile cache served a fresh copy of the package "
    "(each repeat loads it from a new path, which defeats path-keyed caches only)"
)


@dataclass(frozen=True)
class TimingStats:
    """Seconds of each timed repeat (warm-ups excluded) and their min / median / max."""

    min: float
    median: float
    max: float
    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: list[float]) -> TimingStats:
        if not samples:
            raise AnelabInputError("no timing samples; repeats must be >= 1")
        return cls(min(samples), statistics.median(samples), max(samples), tuple(samples))

    def to_dict(self) -> dict:
        return {"min_s": self.min, "median_s": self.median, "max_s": self.max, "samples_s": list(self.samples)}


def _check_counts(warmup: int, repeats: int) -> None:
    if int(warmup) < 0:
        raise AnelabInputError(f"warmup must be >= 0, got {warmup}")
    if int(repeats) < 1:
        raise AnelabInputError(f"repeats must be >= 1, got {repeats}")


def measure(
    fn: Callable[..., Any],
    warmup: int = 1,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    setup: Callable[[], Any] | None = None,
    desc: str | None = None,
) -> TimingStats:
    """Call ``fn`` ``warmup`` times untimed, then ``repeats`` times timed with ``clock``.

    ``setup``: when given, called before every call (untimed) and its result passed to ``fn``.
    """
    _check_counts(warmup, repeats)

    def call():
        arg = setup() if setup is not None else None
        start = clock()
        fn(arg) if setup is not None else fn()
        return clock() - start

    for _ in range(int(warmup)):
        call()
    samples = [
        call() for _ in tqdm(range(int(repeats)), desc=desc or "timing", unit="run", disable=desc is None, leave=False)
    ]
    return TimingStats.of(samples)


def _finish(kind: str, parameters: dict, results: dict, unknown: list[str], out_dir) -> dict:
    record = make_record(kind, parameters, results, origin="measured", unknown=unknown)
    if out_dir is not None:
        path = write_record(out_dir, record)
        record = {**record, "_file": path.name}
    return record


def _fresh_copy_factory(pkg: Path, work: Path) -> Callable[[], Path]:
    counter = iter(range(1, 1_000_000))

    def make() -> Path:
        dest = work / f"copy-{next(counter)}" / pkg.name
        shutil.copytree(pkg, dest)
        return dest

    return make


def time_load(
    runtime: CoreMLRuntime,
    pkg: str | os.PathLike,
    function: str,
    compute_units: str,
    *,
    cold: bool = True,
    warmup: int = 1,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    out_dir: str | os.PathLike | None = None,
) -> dict:
    """Seconds to load ``function`` of ``pkg`` (kind ``load_timing``).

    cold=True: every load (warm-ups too) is of a fresh copy at a new path; the copy is not timed.
    cold=False: ``warmup`` loads of the same path first, then the timed loads of that path.
    """
    check_compute_units(compute_units)
    runtime.require_available()
    pkg = Path(pkg)
    work = Path(tempfile.mkdtemp(prefix=".anelab-load-")) if cold else None
    try:
        if cold:
            stats = measure(
                lambda path: runtime.load(path, function, compute_units),
                warmup=warmup,
                repeats=repeats,
                clock=clock,
                setup=_fresh_copy_factory(pkg, work),
                desc=f"cold load {function}",
            )
        else:
            stats = measure(
                lambda: runtime.load(pkg, function, compute_units),
                warmup=warmup,
                repeats=repeats,
                clock=clock,
                desc=f"warm load {function}",
            )
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    parameters = {
        "package": pkg.name,
        "function": function,
        "compute_units": compute_units,
        "cold": bool(cold),
        "warmup": int(warmup),
        "repeats": int(repeats),
        "runtime": runtime.name,
        "load": runtime.load_description,
    }
    return _finish("load_timing", parameters, stats.to_dict(), [COLD_LOAD_CAVEAT] if cold else [], out_dir)


def time_compositions(
    runtime: CoreMLRuntime,
    packages: dict[str, str | os.PathLike],
    function: str,
    *,
    compute_units: str = "cpu_and_ne",
    cold: bool = True,
    warmup: int = 1,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    out_dir: str | os.PathLike | None = None,
) -> dict:
    """Seconds to load the same ``function`` from each package composition (kind ``composition_load_timing``).

    packages: label -> package, e.g. {"alone": h0-only, "beside_h4096": h0+h4096,
              "beside_unloadable": h0 + a variant that cannot load}. The function must load from each;
              one that does not is refused naming the composition.
    Results: {label: {min_s, median_s, max_s, samples_s}}, measured in one run so they compare.
    """
    check_compute_units(compute_units)
    runtime.require_available()
    if not packages:
        raise AnelabInputError("time_compositions needs at least one package composition")
    results, unknown = {}, []
    for label, pkg in tqdm(packages.items(), desc=f"compositions of {function}", unit="pkg", leave=False):
        try:
            record = time_load(
                runtime,
                pkg,
                function,
                compute_units,
                cold=cold,
                warmup=warmup,
                repeats=repeats,
                clock=clock,
                out_dir=None,
            )
        except RuntimeLoadError as e:
            raise AnelabInputError(f"composition {label!r}: {function} does not load from it ({e})") from e
        results[label] = {**record["results"], "package": Path(pkg).name}
        unknown = record["unknown"]
    parameters = {
        "function": function,
        "compute_units": compute_units,
        "cold": bool(cold),
        "warmup": int(warmup),
        "repeats": int(repeats),
        "compositions": list(packages),
        "runtime": runtime.name,
        "load": runtime.load_description,
    }
    return _finish("composition_load_timing", parameters, results, unknown, out_dir)


def time_predict(
    runtime: CoreMLRuntime,
    pkg: str | os.PathLike,
    function: str,
    inputs: dict,
    compute_units_list: list[str] | tuple[str, ...] = COMPUTE_UNITS_ORDER,
    *,
    warmup: int = 1,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    out_dir: str | os.PathLike | None = None,
) -> dict:
    """Seconds per ``predict`` of ``function`` for each compute-units setting (kind ``predict_timing``).

    The function is loaded once per setting (untimed). A setting under which it does not load is
    recorded as ``{"error": ...}`` rather than ending the run.
    inputs: name -> array, e.g. hidden [C, D], k_history / v_history [H, Hkv, d], mask [C, H + C].
    """
    units = [check_compute_units(u) for u in compute_units_list]
    if not units:
        raise AnelabInputError("time_predict needs at least one compute-units setting")
    runtime.require_available()
    pkg = Path(pkg)
    results = {}
    for unit in units:
        try:
            handle = runtime.load(pkg, function, unit)
        except RuntimeLoadError as e:
            results[unit] = {"error": " ".join(str(e).split())}
            continue
        stats = measure(
            lambda: runtime.predict(handle, inputs),
            warmup=warmup,
            repeats=repeats,
            clock=clock,
            desc=f"predict {function} {unit}",
        )
        results[unit] = stats.to_dict()
    shapes = {name: list(getattr(value, "shape", ())) for name, value in inputs.items()}
    parameters = {
        "package": pkg.name,
        "function": function,
        "compute_units": units,
        "warmup": int(warmup),
        "repeats": int(repeats),
        "input_shapes": shapes,
        "runtime": runtime.name,
    }
    return _finish("predict_timing", parameters, results, [], out_dir)
