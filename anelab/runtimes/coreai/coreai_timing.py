"""Timing of Core AI specialization, loads and predictions on the Neural Engine, written as records.

What the seed says would re-open Qwen 3.8 is a cheaper per-variant specialization; Core AI caches
specializations per asset and options and moves compilation to a build machine. Each function here
times one of those on a ``CoreAIRuntime`` (``runtimes.coreai.coreai_runtime`` on macOS 27, ``runtimes.coreai.coreai_fake`` in
the tests) and returns a record (kind ``coreai_specialization`` or ``coreai_predict``):

- ``time_specialization`` cold: each repeat loads a fresh copy of the asset at a new path, its derived
  artifacts cleared (what coreai-core can reach of the cache: ``CoreAIRuntime.clear_cache``); warm: the
  same path loaded again after a warm-up load (a cache hit);
- ``time_fresh_process``: after a load in this process, each repeat loads the same path in a new Python
  process (the persistent cache entry, what every later app launch pays);
- ``time_entrypoint_counts``: cold specialization of assets of 1, 3, 9, 30 entrypoints (does it grow
  with the entrypoints, or is it paid once per asset?);
- ``time_compiled``: the ahead-of-time compiled ``.aimodelc`` (``coreai-build compile``) loaded cold and warm;
- ``time_predictions``: one predict per entrypoint on the Neural Engine (after a warm-up each).

Every record names what a cold load could not rule out (``COLD_CAVEAT``) and, when a cold median is not
above the warm one, says so (``cold_not_above_warm``): the cache was then not cleared.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.records import make_record
from anelab.runtimes.child import read_answer, run_child, write_answer
from anelab.runtimes.interface import CoreAIRuntime, describe_child_exit, runtime_from_spec
from anelab.sidecar.coreai.asset import raw_asset_metadata, read_asset_metadata
from anelab.sidecar.format import COREAI_META

COLD_CAVEAT = (
    "whether Core AI's system cache (AIModelCache) keyed the fresh copy as new: coreai-core cannot clear that "
    "cache (deleteEntries(for:) is Swift-only), so a cold load is the first load of a copy at a new path"
)
FRESH_CHILD_TIMEOUT_S = 1800.0
PREDICT_TIMED = ("predict alone: inputs wrapped in Core AI's arrays once before the clock, states made once from the "
                 "entrypoint's descriptors and kept across calls, outputs returned as zero-copy views")  # fmt: skip
ENTRYPOINT_COUNTS = (1, 3, 9, 30)


def _stats(samples: list[float]) -> dict:
    if not samples:
        raise AnelabInputError("no timing samples; repeats must be >= 1")
    return {"min_s": min(samples), "median_s": statistics.median(samples), "max_s": max(samples), "samples_s": samples}


def _entrypoints(asset: Path) -> list[str]:

    return read_asset_metadata(asset).functions


def _fresh_copy(asset: Path, work: Path) -> Path:
    copy = work / f"{asset.stem}-{uuid.uuid4().hex[:12]}{asset.suffix}"
    shutil.copytree(asset, copy)
    return copy


def _load_once(runtime: CoreAIRuntime, asset: Path, unit: str, clock, names: list[str]) -> tuple[float, dict]:
    """(seconds of the specializing load, {entrypoint: seconds of load_function}) of one load."""
    t = clock()
    model = runtime.specialize(asset, unit)
    load = clock() - t
    functions = {}
    for name in names:
        t = clock()
        runtime.load_function(model, name)
        functions[name] = clock() - t
    runtime.release(model)
    return load, functions


def _record(mode: str, asset: Path, unit: str, names: list[str], samples, functions, cleared, extra=None) -> dict:
    parameters = {"asset": asset.name, "mode": mode, "compute_unit": unit, "entrypoints": len(names),
                  "entrypoint_names": names, "repeats": len(samples), **(extra or {})}  # fmt: skip
    per_function = {n: statistics.median(f[n] for f in functions) for n in names} if functions else {}
    results = {**_stats(samples), "load_function_s": per_function, "cache_cleared": cleared}
    unknown = [COLD_CAVEAT] if mode in ("cold", "compiled_cold") else []
    return make_record("coreai_specialization", parameters, results, origin="measured", unknown=unknown)


def time_specialization(
    runtime: CoreAIRuntime, asset: str | os.PathLike, *, cold: bool, repeats: int, work: Path,
    clock: Callable[[], float] = time.perf_counter, compute_unit: str = "neural_engine", extra: dict | None = None,
    names: list[str] | None = None,
) -> dict:  # fmt: skip
    """Cold or warm specializing loads of ``asset`` (module docstring); each repeat also loads every entrypoint
    (``names``; default: the asset's own, from its metadata — a compiled ``.aimodelc`` is given its source's)."""
    runtime.require_available()
    asset, work = Path(asset), Path(work)
    work.mkdir(parents=True, exist_ok=True)
    names = _entrypoints(asset) if names is None else list(names)
    samples, functions, cleared = [], [], None
    if not cold:
        _load_once(runtime, asset, compute_unit, clock, names)  # warm-up: the entry the next loads hit
    for _ in range(int(repeats)):
        target = _fresh_copy(asset, work) if cold else asset
        if cold:
            cleared = runtime.clear_cache(target)
        load, fns = _load_once(runtime, target, compute_unit, clock, names)
        samples.append(load)
        functions.append(fns)
        if cold:
            shutil.rmtree(target, ignore_errors=True)
    return _record("cold" if cold else "warm", asset, compute_unit, names, samples, functions, cleared, extra)


def time_fresh_process(
    runtime: CoreAIRuntime, asset: str | os.PathLike, *, repeats: int, compute_unit: str = "neural_engine",
    clock: Callable[[], float] = time.perf_counter, extra: dict | None = None,
) -> dict:  # fmt: skip
    """Loads of the cached entry, each in a new Python process, after one load here (module docstring)."""
    runtime.require_available()
    asset = Path(asset)
    names = _entrypoints(asset)
    _load_once(runtime, asset, compute_unit, clock, names)
    request = {"spec": runtime.child_spec(), "asset": str(asset), "compute_unit": compute_unit, "names": names}
    samples, functions, exits, before = [], [], [], []
    for _ in range(int(repeats)):
        run = run_child("anelab.runtimes.coreai.coreai_timing:fresh_process_child", request, FRESH_CHILD_TIMEOUT_S)
        answer, why = read_answer(run.stdout)  # read whatever the exit: Core AI may abort after the answer
        if answer is None:
            raise RuntimeError(
                f"a fresh-process Core AI load of {asset.name} {describe_child_exit(run.returncode)}: "
                f"{why}; {run.stderr_tail(200)}"
            )
        samples.append(answer["load_s"])
        functions.append(answer["load_function_s"])
        before = answer.get("before_clock", [])
        exits.append(0 if run.returncode == 0 else describe_child_exit(run.returncode))
    more = {**(extra or {}), "before_clock": before, "child_exits": exits}
    record = _record("fresh_process", asset, compute_unit, names, samples, functions, None, more)
    if any(e != 0 for e in exits):
        record["unknown"] = [*record.get("unknown", []), "some fresh-process children ended abnormally after their "
                             "answer (child_exits): the load they timed had finished"]  # fmt: skip
    return record


def fresh_process_child() -> None:
    """The child of ``time_fresh_process``: the process's Core AI import paid before the clock (``prepare_process``),
    then one load of the asset; its duration as the answer line on stdout (``runtimes.child``)."""
    request = json.loads(sys.stdin.read())
    runtime = runtime_from_spec(request["spec"])
    clock = getattr(runtime, "clock", None) or time.perf_counter
    before_clock = runtime.prepare_process()
    load, functions = _load_once(runtime, Path(request["asset"]), request["compute_unit"], clock, request["names"])
    write_answer({"load_s": load, "load_function_s": functions, "before_clock": before_clock})


def time_entrypoint_counts(
    runtime: CoreAIRuntime, assets: dict[int, Path], *, repeats: int, work: Path,
    clock: Callable[[], float] = time.perf_counter, extra: dict | None = None,
) -> list[dict]:  # fmt: skip
    """Cold specialization of one asset per entrypoint count (``ENTRYPOINT_COUNTS``), one record each."""
    return [
        time_specialization(
            runtime,
            path,
            cold=True,
            repeats=repeats,
            work=Path(work) / f"count{n}",
            clock=clock,
            extra={**(extra or {}), "sweep": "entrypoint_count"},
        )  # fmt: skip
        for n, path in sorted(assets.items())
    ]


def time_compiled(
    runtime: CoreAIRuntime, asset: str | os.PathLike, *, repeats: int, work: Path,
    clock: Callable[[], float] = time.perf_counter, extra: dict | None = None,
) -> list[dict]:  # fmt: skip
    """``coreai-build compile`` (timed), then each compiled ``.aimodelc`` loaded cold and warm."""
    runtime.require_available()  # the process's coreai import, before the clock
    asset, work = Path(asset), Path(work)
    names = _entrypoints(asset)
    t = clock()
    compiled = runtime.compile_ahead(asset, work / "compiled")
    compile_s = clock() - t
    records = []
    for path in compiled:
        more = {**(extra or {}), "compiled_from": asset.name, "compile_s": compile_s}
        timed = {"repeats": repeats, "clock": clock, "extra": more, "names": names}
        cold = time_specialization(runtime, path, cold=True, work=work / "cold", **timed)
        warm = time_specialization(runtime, path, cold=False, work=work / "warm", **timed)
        cold["parameters"]["mode"], warm["parameters"]["mode"] = "compiled_cold", "compiled_warm"
        records += [cold, warm]
    return records


def time_predictions(
    runtime: CoreAIRuntime, asset: str | os.PathLike, *, repeats: int,
    clock: Callable[[], float] = time.perf_counter, compute_unit: str = "neural_engine", extra: dict | None = None,
) -> list[dict]:  # fmt: skip
    """One predict per entrypoint (zero inputs of its signature; fresh zero states), after a warm-up each."""

    runtime.require_available()
    asset = Path(asset)
    signatures = raw_asset_metadata(asset)[COREAI_META]["signatures"]
    model = runtime.specialize(asset, compute_unit)
    records = []
    for name in _entrypoints(asset):
        sig = signatures[name]
        function = runtime.load_function(model, name)
        # Core AI's own arrays, made before the clock: the timed predict copies nothing in (states kept across calls)
        inputs = runtime.prepare_inputs({n: np.zeros(shape, dtype) for n, (shape, dtype) in sig["inputs"].items()})
        state = runtime.make_state(function) if sig["states"] else None
        runtime.predict(function, inputs, state)  # warm-up
        samples = []
        for _ in range(int(repeats)):
            t = clock()
            runtime.predict(function, inputs, state)
            samples.append(clock() - t)
        parameters = {"asset": asset.name, "entrypoint": name, "compute_unit": compute_unit, "repeats": int(repeats),
                      "score_arena_bytes": sig.get("score_arena_bytes"), "timed": PREDICT_TIMED, **(extra or {})}  # fmt: skip
        records.append(make_record("coreai_predict", parameters, _stats(samples), origin="measured", unknown=[
            "which compute unit each op ran on: Core AI's Python API reports no per-operation placement"]))  # fmt: skip
    runtime.release(model)
    return records


def flag_uncleared(records: list[dict]) -> list[dict]:
    """Mark cold records whose median is not above the warm one of the same asset: the cache was not cleared."""
    warm = {
        r["parameters"]["asset"]: r["results"]["median_s"] for r in records if r["parameters"].get("mode") == "warm"
    }
    for r in records:
        asset = r["parameters"].get("asset")
        if r["parameters"].get("mode") == "cold" and asset in warm:
            r["results"]["cold_not_above_warm"] = r["results"]["median_s"] <= warm[asset]
    return records
