"""A ``CoreAIRuntime`` for tests that behaves like Core AI through coreai-core 1.0.0b3 — never kinder.

Each rule follows coreai-core's stubs and sources (``coreai/runtime/__init__.pyi``, ``_aimodel.py``,
``_specialization_options.py``, ``authoring/asset.py``) or Apple's Swift runtime utilities
(apple/coreai-models, ``swift/Sources/CoreAIShared/Runtime/ModelStructure.swift``):

- **assets**: a load takes a directory ending ``.aimodel`` (or ``.aimodelc``, compiled) that holds a
  source program or a derived artifact (``_AIModelAsset.is_valid``), else it fails as Core AI does;
- **specialization**: ``AIModel.load(path, options)`` specializes the whole asset when no cache entry
  matches (path, options) — ``AIModelCache.model(for: url, options:)`` is keyed by both — charging
  ``specialize_base_s`` + ``specialize_per_entrypoint_s`` per entrypoint + ``specialize_per_gb_s`` per GB
  of score arena (the sum over its entrypoints); a cache hit charges ``cache_hit_s``. The cache lives in a
  file, so a child process (``child_spec``) finds what its parent specialized (the ``.persistent`` policy);
- **clear_cache** reaches what the Python API reaches: the asset's derived artifacts. With
  ``python_clears_system_cache=False`` (the default, as coreai-core) the system entry survives a clear: a
  "cold" load of the same path is then warm, and only a fresh copy at a new path is cold;
- **compile ahead** (``coreai-build compile``) writes ``<stem>.<arch>.aimodelc`` and charges
  ``compile_s``; loading it charges ``compiled_fraction`` of the specialization (the compile moved off
  the device, "Core AI generates the executable code on device without repeating the compilation step");
- **options**: a compute unit outside ``SpecializationOptions``' constructors is refused;
- **functions**: ``load_function`` of an unknown name raises ``KeyError("No function named 'x'")``
  (``_aimodel.py``); it charges ``load_function_s``;
- **predict**: a missing input, a wrong dtype ("start has an invalid scalar type: int16, expected: int32",
  as the bundled runtime words it), a wrong shape or a stateful entrypoint without its state raise
  ``RuntimePredictError``; a non-contiguous array is read as raw memory, ignoring its strides, as
  ``NDArray`` does (Apple: "The runtime reads raw memory as if contiguous"); ``predict_s`` per call on
  ``neural_engine`` (``predict_other_s`` elsewhere). Outputs are zeros of the output shapes: the fake
  times and refuses, it computes nothing (the CPU runtime in ``sidecar.coreai.asset`` does that). An input or a
  state given as NumPy is copied into Core AI's arrays on every call (``copy_s_per_mb``); ``prepare_inputs`` and
  ``make_state`` give arrays that pass as they are (``FakeNDArray``);
- **import**: a process's first use of Core AI imports ``coreai`` (``import_s``, 0.11-0.44 s measured here) unless
  ``prepare_process`` paid it before the clock;
- **exit**: with ``abort_at_exit`` a child process aborts (SIGABRT) after its work, as coreai-core has been seen
  to about one process in six — its answer, already written, must still be read.

Time comes from a ``FakeClock`` (``runtimes.coreml.coreml_fake``) that moves only when the fake works.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from anelab.runtimes.coreml.coreml_fake import FakeClock
from anelab.runtimes.interface import CoreAIRuntime, RuntimeLoadError, RuntimePredictError, check_coreai_compute_unit

DEVICE_ARCHITECTURE = "h15g"  # the fake Mac's Core AI architecture name (AIModel.deviceArchitectureName)


@dataclass
class FakeCoreAICosts:
    """Seconds the fake charges (assumed numbers for the tests, not measurements)."""

    specialize_base_s: float = 2.0
    specialize_per_entrypoint_s: float = 0.8
    specialize_per_gb_s: float = 6.0
    cache_hit_s: float = 0.15
    compiled_fraction: float = 0.3
    compile_s: float = 20.0
    load_function_s: float = 0.02
    predict_s: float = 0.05
    predict_other_s: float = 0.4
    teardown_s: float = 0.1
    import_s: float = 0.3
    copy_s_per_mb: float = 0.002


@dataclass
class FakeModel:
    path: str
    options: str
    entrypoints: dict  # name -> {"inputs": {n: [shape, dtype]}, "outputs": {...}, "states": {...}}


@dataclass
class FakeFunction:
    name: str
    signature: dict
    compute_unit: str


@dataclass
class FakeCoreAIRuntime(CoreAIRuntime):
    """The fake Mac's Core AI (module docstring). ``cache_file``: where its specialization cache lives."""

    cache_file: str | None = None
    costs: FakeCoreAICosts = field(default_factory=FakeCoreAICosts)
    python_clears_system_cache: bool = False
    abort_at_exit: bool = False  # a child of this fake aborts at exit (after answering)
    unavailable: str = ""
    clock: FakeClock = field(default_factory=FakeClock)
    calls: list = field(default_factory=list)
    name = "fake-coreai"

    def __post_init__(self):
        self._imported = False
        if self.cache_file is None:  # its own cache folder, removed with it (tests make many fakes)
            own = tempfile.mkdtemp(prefix="anelab-fake-coreai-")
            weakref.finalize(self, shutil.rmtree, own, True)
            self.cache_file = str(Path(own) / "cache.json")

    def unavailable_reason(self) -> str:
        if not self.unavailable:  # as on a Mac: the check imports coreai.runtime (the process's first use)
            self._import()
        return self.unavailable

    # ---- the cache (a file: shared with child processes) ---------------------------------------------
    def _cache(self) -> dict:
        path = Path(self.cache_file)
        return json.loads(path.read_text()) if path.is_file() else {}

    def _save(self, cache: dict) -> None:
        Path(self.cache_file).write_text(json.dumps(cache, sort_keys=True))

    @staticmethod
    def _key(asset: Path, compute_unit: str) -> str:
        return f"{Path(asset).resolve()}|{compute_unit}"

    def clear_cache(self, asset: Path) -> str:
        self.require_available()
        cache = self._cache()
        derived = [k for k in cache if k.startswith(f"{Path(asset).resolve()}|") and cache[k].get("derived")]
        for k in derived:
            cache[k]["derived"] = False
        if self.python_clears_system_cache:
            cache = {k: v for k, v in cache.items() if not k.startswith(f"{Path(asset).resolve()}|")}
        self._save(cache)
        self.calls.append(("clear_cache", str(asset)))
        return "derived artifacts" + (" and the system cache entry" if self.python_clears_system_cache else "")

    # ---- loading ----------------------------------------------------------------------------------
    def prepare_process(self) -> list[str]:
        self.require_available()
        self._import()
        return ["imported coreai (fake: import_s)"]

    def _import(self) -> None:
        if not self._imported:
            self._imported = True
            self.clock.advance(self.costs.import_s)

    def specialize(self, asset: Path, compute_unit: str) -> FakeModel:
        self.require_available()
        self._import()  # the process's first Core AI call imports coreai
        unit = check_coreai_compute_unit(compute_unit)
        asset = Path(asset)
        entrypoints = _entrypoints(asset)
        key, cache = self._key(asset, unit), self._cache()
        if key in cache:
            seconds = self.costs.cache_hit_s
        else:
            seconds = self._specialization_s(asset, entrypoints)
            cache[key] = {"derived": True}
            self._save(cache)
        self.clock.advance(seconds)
        self.calls.append(("specialize", str(asset), unit, seconds))
        return FakeModel(str(asset), unit, entrypoints)

    def _specialization_s(self, asset: Path, entrypoints: dict) -> float:
        c = self.costs
        arena_gb = sum(e.get("score_arena_bytes", 0) for e in entrypoints.values()) / 1e9
        seconds = (
            c.specialize_base_s + c.specialize_per_entrypoint_s * len(entrypoints) + c.specialize_per_gb_s * arena_gb
        )
        return seconds * (c.compiled_fraction if asset.suffix == ".aimodelc" else 1.0)

    def load_function(self, model: FakeModel, name: str) -> FakeFunction:
        if name not in model.entrypoints:
            raise KeyError(f"No function named {name!r}")
        self.clock.advance(self.costs.load_function_s)
        return FakeFunction(name, model.entrypoints[name], model.options)

    def release(self, model: Any) -> None:
        self.clock.advance(self.costs.teardown_s)

    def compile_ahead(self, asset: Path, out_dir: Path) -> list[Path]:
        self.require_available()
        asset, out_dir = Path(asset), Path(out_dir)
        _entrypoints(asset)  # a bad asset fails here too
        dest = out_dir / f"{asset.stem}.{DEVICE_ARCHITECTURE}.aimodelc"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(asset, dest)
        self.clock.advance(self.costs.compile_s)
        return [dest]

    # ---- predicting -------------------------------------------------------------------------------------
    def prepare_inputs(self, inputs: dict[str, np.ndarray]) -> dict:
        return {k: np.ascontiguousarray(v).view(FakeNDArray) for k, v in inputs.items()}

    def make_state(self, function: FakeFunction) -> dict:
        states = function.signature.get("states") or {}
        return {n: np.zeros(shape, dtype=dtype).view(FakeNDArray) for n, (shape, dtype) in states.items()}

    def _copy_in(self, arrays: dict) -> None:
        """NumPy arrays are copied into Core AI's arrays (NDArray(data)) on every call: charged per MB."""
        copied = sum(np.asarray(v).nbytes for v in arrays.values() if not isinstance(v, FakeNDArray))
        self.clock.advance(self.costs.copy_s_per_mb * copied / 1e6)

    def predict(self, function: FakeFunction, inputs: dict[str, np.ndarray], state: dict | None = None) -> dict:
        self._copy_in({**inputs, **(state or {})})
        sig = function.signature
        for name, (shape, dtype) in sig["inputs"].items():
            if name not in inputs:
                raise RuntimePredictError(f"missing input {name!r} of {function.name}")
            arr = np.asarray(inputs[name])
            if arr.dtype != np.dtype(dtype):
                raise RuntimePredictError(f"{name} has an invalid scalar type: {arr.dtype}, expected: {dtype}")
            if list(arr.shape) != list(shape):
                raise RuntimePredictError(f"{name} has shape {list(arr.shape)}, expected {list(shape)}")
            _as_raw_memory(arr)  # what the runtime reads (no error: it reads the wrong numbers)
        if sig.get("states") and not all(n in (state or {}) for n in sig["states"]):
            raise RuntimePredictError(f"{function.name} is stateful: pass its states {', '.join(sig['states'])}")
        self.clock.advance(
            self.costs.predict_s if function.compute_unit == "neural_engine" else self.costs.predict_other_s
        )
        return {n: np.zeros(shape, dtype=dtype) for n, (shape, dtype) in sig["outputs"].items()}

    def child_spec(self) -> dict:
        args = {"cache_file": self.cache_file, "costs": asdict(self.costs),
                "python_clears_system_cache": self.python_clears_system_cache, "abort_at_exit": self.abort_at_exit}  # fmt: skip
        return {"factory": "anelab.runtimes.coreai.coreai_fake:fake_from_args", "args": args}


class FakeNDArray(np.ndarray):
    """An array already in (fake) Core AI's form: a predict given it copies nothing."""


def fake_from_args(cache_file: str, costs: dict, python_clears_system_cache: bool,
                   abort_at_exit: bool = False) -> FakeCoreAIRuntime:  # fmt: skip
    """The fake rebuilt in a child process (``child_spec``): the same cache file, a fresh clock; with
    ``abort_at_exit`` the process aborts when it exits (after its answer is written)."""
    if abort_at_exit:
        atexit.register(os.abort)
    return FakeCoreAIRuntime(cache_file, FakeCoreAICosts(**costs), python_clears_system_cache, abort_at_exit)


def _as_raw_memory(arr: np.ndarray) -> np.ndarray:
    """The array as NDArray reads it: its buffer in C order whatever its strides."""
    if arr.flags.c_contiguous:
        return arr
    base = arr
    while base.base is not None and isinstance(base.base, np.ndarray):
        base = base.base
    flat = np.ascontiguousarray(base).reshape(-1)[: arr.size]
    return flat.reshape(arr.shape)


def _entrypoints(asset: Path) -> dict:
    """name -> signature of the asset's entrypoints (from anelab's own metadata: the fake reads no MLIR)."""
    if asset.suffix not in (".aimodel", ".aimodelc") or not asset.is_dir():
        raise RuntimeLoadError(f"{asset}: not a Core AI model asset (a .aimodel or .aimodelc directory)")
    if not any((asset / n).exists() for n in ("main.mlirb", "main-universal.odix")) and not list(asset.glob("*.odix")):
        raise RuntimeLoadError(f"{asset}: the asset holds neither a source program nor a derived artifact")
    meta = json.loads((asset / "metadata.json").read_text()).get("creatorDefinedMetadata", {})
    fields = meta.get("anelab.coreai", {})
    signatures = fields.get("signatures")
    if not signatures:
        raise RuntimeLoadError(
            f"{asset}: the fake Core AI reads entrypoint signatures from anelab's metadata; re-export"
        )
    return signatures


def fake_asset_signatures(asset: str | os.PathLike) -> dict:
    """What the fake knows of an asset's entrypoints (for tests)."""
    return _entrypoints(Path(asset))
