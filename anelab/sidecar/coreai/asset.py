"""A Core AI sidecar on disk: ``layer_<L>.aimodel`` written from a saved Core ML package, read back and run.

``write_asset`` lowers the saved Core ML package (``coreai_lower``) into one ``.aimodel`` with one
entrypoint per function (equal weights stored once), writes the package's ``SidecarMetadata`` and the
Core AI fields (``COREAI_META``: the Neural Engine rules it follows or not, the mask's drop value,
weights-once bytes) into the asset's metadata, and renames it into place.

``CoreAIAsset`` is the saved asset read back from disk: its metadata, its entrypoints' signatures (the
asset's own summary), and its functions run on coreai-core's bundled CPU runtime in a child process
(``coreai_cpu_runtime``), with the calls ``verify`` makes of a saved package (``evaluate``,
``evaluate_with_state``, ``new_state``). Masks are fed with the asset's drop value (``NE_MASKED``) in
place of anelab's ``masks.MASKED``, as its metadata records. That runtime sums fp16 matmuls in fp16
(a sequential fp16 sum's error, ~17x fp32 accumulation's over 576 terms: tests/sidecar/coreai/test_coreai_sidecar.py),
so its error against the reference is larger than the NumPy evaluation's fp32-accumulated one — on
SmolLM2-135M's layer 0, attn_out 2.3e-2 against 4.0e-3: past the 1e-2 threshold.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.files import open_regular, read_bytes
from anelab.core.geometry import score_bytes
from anelab.core.masks import MASKED
from anelab.sidecar.coreai.coreai_import import coreai_modules, coreai_version
from anelab.sidecar.coreai.cpu_runtime import CpuRuntimeProcess
from anelab.sidecar.coreai.lowering import MAX_INT16_POSITION, NE_MASKED, deviations, lower_program
from anelab.sidecar.format import COREAI_META, SidecarMetadata
from anelab.sidecar.inspection import largest_working_output
from anelab.sidecar.mil.evaluate import FunctionInfo, SavedPackage, TensorSignature, state_signatures
from anelab.sidecar.out_dir import replace_directory

SUFFIX = ".aimodel"
VERIFIED_REASON = (
    "not verified: coreai-core's Python API exposes no per-operation compute-unit plan, so Neural Engine "
    "residency is unchecked; time it on macOS 27 with 'anelab measure'"
)
# coreai-core's asset layout (coreai/authoring/asset.py, save_asset): the program's bytecode and its SHA-256 digest
PROGRAM_FILE, PROGRAM_HASH_FILE, PROGRAM_HASH_BYTES = "main.mlirb", "main.hash", 32
_SUMMARY_DTYPES = {"Float16": "float16", "Float32": "float32", "Int32": "int32", "Int16": "int16", "Bool": "bool"}


def require_asset(path: str | os.PathLike) -> Path:
    """Refuse a path that is not a saved ``.aimodel`` directory (one line)."""
    path = Path(path)
    if path.suffix != SUFFIX:
        raise AnelabInputError(f"{path}: not a Core AI asset (no {SUFFIX} suffix); give a layer_<L>{SUFFIX}")
    if not path.is_dir() or not (path / "metadata.json").is_file():
        raise AnelabInputError(f"{path}: no such Core AI asset; give the path of a {SUFFIX} written by 'anelab export'")
    require_program_hash(path)
    return path


def require_program_hash(path: Path) -> None:
    """Refuse (one line) an asset whose program (``main.mlirb``) is not the one its ``main.hash`` records: truncated,
    a byte changed, or either file missing — before coreai-core parses it (a truncated program stops its reader
    with a StopIteration)."""
    program, recorded = path / PROGRAM_FILE, path / PROGRAM_HASH_FILE
    digest = hashlib.sha256()
    try:
        want = read_bytes(recorded, "Core AI program hash", PROGRAM_HASH_BYTES)
        with open_regular(program, "Core AI program") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except AnelabInputError as e:
        raise AnelabInputError(f"{path}: not a complete Core AI asset ({e}); re-export it") from None
    if digest.digest() != want:
        raise AnelabInputError(
            f"{path}: {PROGRAM_FILE} does not match the SHA-256 in {PROGRAM_HASH_FILE} (truncated or changed after "
            "export); re-export it"
        )


# ---- writing --------------------------------------------------------------------------------------------
def write_asset(
    package: str | os.PathLike, dest: str | os.PathLike, meta: SidecarMetadata, histories: list[int] | None = None
) -> tuple[Path, dict]:
    """Lower the saved Core ML ``package`` into ``dest`` (``layer_<L>.aimodel``), atomically; return (dest,
    the Core AI fields written). ``meta``: the package's metadata (the asset records it, unverified).
    ``histories``: only these functions of a per-history package (their graphs as built for its coverage)."""
    ca = coreai_modules()
    saved = SavedPackage(package)
    if histories is not None:
        if meta.state_functions or not set(histories) <= set(meta.histories):
            raise AnelabInputError(f"{Path(package).name}: histories {histories} are not a subset of {meta.histories}")
        meta = SidecarMetadata(**{**meta.__dict__, "histories": sorted(histories)})
    functions = list(meta.functions)
    check_options(meta.weights, meta.chunk, meta.state_capacity)
    program, notes = lower_program(saved, functions)
    constraints = _state_constraints(ca, program, functions) if notes.states else None
    fields = {
        "backend": "coreai",
        "coreaiCore": coreai_version(),
        "maskedValue": float(NE_MASKED),
        "neuralEngineRules": [d.to_dict() for d in deviations(notes, functions, constraints)],
        "weightsOnce": notes.weights_once(),
        "entrypoints": functions,
        "signatures": {name: _entrypoint_signature(saved, name, meta) for name in functions},
    }
    record = {**meta.to_strings(), "aneCompileVerified": "false", "aneCompileVerifiedReason": VERIFIED_REASON}
    dest = Path(dest)
    work = dest.with_name(f".{dest.stem}.{os.getpid()}.tmp{SUFFIX}")
    shutil.rmtree(work, ignore_errors=True)
    metadata = ca.runtime.AIModelAssetMetadata()
    metadata.model_description = (
        f"anelab sidecar: layer {meta.layer}, {meta.graph} design, entrypoints {','.join(functions)}"
    )
    for key, value in record.items():
        metadata.set_custom(key, value)
    metadata.set_custom(COREAI_META, fields)
    try:
        program.save_asset(work, metadata=metadata)
        replace_directory(work, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest, fields


def check_options(weights: str, chunk: int, capacity: int | None) -> None:
    """Refuse (one line, before anything is built) what the Core AI lowering does not serve: compressed
    weights, and a state whose positions would not fit the int16 index arithmetic."""
    if weights != "fp16":
        raise AnelabInputError(
            f"--backend coreai lowers fp16 weights only (got --weights {weights}); drop --weights or use --backend coreml"
        )
    if capacity is not None and capacity + chunk > MAX_INT16_POSITION:
        most = (MAX_INT16_POSITION - chunk) // chunk * chunk
        raise AnelabInputError(
            f"--backend coreai keeps index arithmetic in int16 (Neural Engine rule): capacity {capacity} + chunk {chunk} "
            f"passes {MAX_INT16_POSITION}; use a --capacity of at most {most}"
        )


def _entrypoint_signature(saved: SavedPackage, name: str, meta: SidecarMetadata) -> dict:
    """One entrypoint's I/O as the asset takes it (name -> [shape, dtype]), its states, its score arena (the
    fp16 scores of one call, heads x rows x keys: one key tile and query tile for the tiled state) and its
    working arena (the largest op output besides the state)."""

    info = saved.function(name)
    sig = lambda s: [list(s.shape), s.dtype]  # noqa: E731
    rows = next(s.shape[0] for s in info.inputs if s.name == "hidden")
    mask = next((s for s in info.inputs if s.name == "mask"), None)
    keys = mask.shape[-1] if mask is not None else (meta.key_tile or meta.state_capacity or rows)
    if mask is None and meta.query_tile:
        rows = min(rows, meta.query_tile)
    return {
        "inputs": {s.name: sig(s) for s in info.inputs},
        "outputs": {s.name: sig(s) for s in info.outputs},
        "states": {n: sig(s) for n, s in state_signatures(saved, name).items()},
        "score_arena_bytes": score_bytes(meta.geometry["num_heads"], rows, keys),
        "working_arena_bytes": largest_working_output(saved, name)[0],
    }


def _state_constraints(ca, program, functions: list[str]) -> str:
    """Put the K/V states on IOSurface-backed memory (the shipped iOS export's hardware constraints) where
    the beta accepts it; say what happened (recorded in the asset's metadata)."""
    au = ca.authoring
    try:
        constraint = au.HardwareConstraints(au.AllocationType.IOSurface, interleave=[1, 1, 1], alignments=[1, 1, 1, 1])
        for name in functions:
            program.set_hardware_constraints(name, {"k_cache": constraint, "v_cache": constraint})
    except Exception as e:  # the beta's refusal is the finding: recorded, the states left unconstrained
        return f"IOSurface hardware constraints on the states refused by the beta ({type(e).__name__}: {str(e)[:120]})"
    return "IOSurface hardware constraints on both states (interleave 1, alignment 1), as the iOS export sets them"


# ---- reading back -----------------------------------------------------------------------------------------
def read_asset_metadata(path: str | os.PathLike) -> SidecarMetadata:
    """The ``SidecarMetadata`` an asset records; refused in one line when missing or malformed."""
    raw = raw_asset_metadata(path)
    return SidecarMetadata.from_strings({k: v for k, v in raw.items() if isinstance(v, str)}, str(path))


def raw_asset_metadata(path: str | os.PathLike) -> dict:
    ca = coreai_modules()
    path = require_asset(path)
    try:
        return custom_metadata(ca.authoring.AIModelAsset.load(path).metadata)
    except RuntimeError as e:
        raise AnelabInputError(f"{path}: cannot read the asset's metadata ({e}); re-export it") from None


def custom_metadata(metadata) -> dict:
    """An asset's custom metadata as a dict. The 1.0.0b3 stub names it ``custom_metadata``; the binary's
    object has ``creator_defined_metadata`` (and writes it under ``creatorDefinedMetadata``)."""
    for name in ("custom_metadata", "creator_defined_metadata"):
        if hasattr(metadata, name):
            return dict(getattr(metadata, name))
    raise AnelabInputError("coreai-core's asset metadata has neither custom_metadata nor creator_defined_metadata")


def _signature(name: str, text: str) -> TensorSignature:
    """A summary entry like ("hidden", "NDArray (Float16, 64 × 256)") as a TensorSignature."""
    m = re.match(r"NDArray \((\w+), ([^)]*)\)", text)
    if m is None:
        raise AnelabInputError(f"unexpected Core AI signature {text!r} for {name}")
    dims = tuple(int(d) for d in m.group(2).split("×") if d.strip())
    return TensorSignature(name, dims, _SUMMARY_DTYPES.get(m.group(1), m.group(1).lower()))


class CoreAIAsset:
    """A saved ``.aimodel`` read back: metadata, entrypoint signatures, and its functions run on the bundled
    CPU runtime (the calls ``verify`` makes of a saved package; see the module docstring)."""

    def __init__(self, path: str | os.PathLike):
        ca = coreai_modules()
        self.path = require_asset(path)
        self.ca = ca
        try:
            self.asset = ca.authoring.AIModelAsset.load(self.path)
            summary = self.asset.summary(include_statistics=False)
        except RuntimeError as e:
            raise AnelabInputError(f"{self.path}: not a readable Core AI asset ({e}); re-export it") from None
        if summary is None:
            raise AnelabInputError(f"{self.path}: the asset holds no source program; re-export it")
        raw = custom_metadata(self.asset.metadata)
        self.metadata = SidecarMetadata.from_strings({k: v for k, v in raw.items() if isinstance(v, str)}, str(path))
        self.coreai = raw.get(COREAI_META) or {}
        self.masked_value = np.float16(self.coreai.get("maskedValue", float(MASKED)))
        self.functions: dict[str, FunctionInfo] = {
            name: FunctionInfo(
                name,
                [_signature(n, t) for n, t in summary.function_inputs(name)],
                [_signature(n, t) for n, t in summary.function_outputs(name)],
            )
            for name in _in_export_order(summary.function_names, self.metadata.functions)
        }
        self.default_function = next(iter(self.functions))
        self._process: CpuRuntimeProcess | None = None
        self._states: dict[str, dict[str, TensorSignature]] = {}

    def description(self, fp16: bool = True) -> str:
        """How this asset's functions are run, for a verification report."""
        return (
            f"Core AI CPU runtime bundled with coreai-core {coreai_version()} (fp16 matmuls summed in fp16), "
            f"running the saved {SUFFIX}"
        )

    def function(self, name: str) -> FunctionInfo:
        if name not in self.functions:
            raise AnelabInputError(f"{self.path.name} has no entrypoint {name!r}; it has: {', '.join(self.functions)}")
        return self.functions[name]

    # ---- the runtime (a child process: ``coreai_cpu_runtime``) ------------------------------------------------
    def _runtime(self) -> CpuRuntimeProcess:
        if self._process is None:
            self._process = CpuRuntimeProcess(self.path)
        return self._process

    def close(self) -> None:
        """Release the runtime's model and its temporary compiled copy (the child process is ended)."""
        if self._process is not None:
            process, self._process = self._process, None
            process.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to release
            pass

    def __enter__(self) -> CoreAIAsset:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _feed(self, function: str, inputs: dict[str, np.ndarray]) -> dict:
        """Inputs checked against the signature, contiguous, the mask's drop value as the asset takes it."""
        info = self.function(function)
        feed = {}
        for sig in info.inputs:
            if sig.name not in inputs:
                raise AnelabInputError(
                    f"input {sig.name!r} of {function} is missing; expected {sig.dtype} {list(sig.shape)}"
                )
            arr = np.asarray(inputs[sig.name])
            if tuple(arr.shape) != sig.shape or arr.dtype != np.dtype(sig.dtype):
                raise AnelabInputError(
                    f"input {sig.name!r} of {function} is {arr.dtype} {list(arr.shape)}; expected {sig.dtype} {list(sig.shape)}"
                )
            if sig.name == "mask":
                arr = np.where(arr <= MASKED, self.masked_value, arr).astype(np.float16)
            feed[sig.name] = np.ascontiguousarray(arr)
        return feed

    def _call(self, function: str, feed: dict, state: dict | None) -> dict[str, np.ndarray]:
        outputs, states = self._runtime().call(function, feed, state)
        if state is not None:
            state.update(states)
        return outputs

    def evaluate(self, function: str, inputs: dict[str, np.ndarray], *, fp16: bool = True) -> dict[str, np.ndarray]:
        """Run one entrypoint on the CPU runtime; outputs by name (fp16, as the asset stores them)."""
        _refuse_fp32(fp16)
        if self.metadata.state_functions:
            raise AnelabInputError(f"{function} is stateful; run it with evaluate_with_state")
        return self._call(function, self._feed(function, inputs), None)

    def evaluate_with_state(self, function: str, inputs: dict, state: dict[str, np.ndarray], *, fp16: bool = True):
        """Run one stateful entrypoint; ``state`` (name -> fp16 array) holds the caches the call leaves."""
        _refuse_fp32(fp16)
        missing = [name for name in self.state_signatures(function) if name not in state]
        if missing:
            raise AnelabInputError(f"state {missing[0]!r} of {function} is missing; create it with new_state()")
        return self._call(function, self._feed(function, inputs), state)

    def state_signatures(self, function: str) -> dict[str, TensorSignature]:
        """The states of one entrypoint (name -> shape/dtype), from the loaded function's descriptor."""
        self.function(function)
        if function not in self._states:
            shapes = self._runtime().states(function)
            self._states[function] = {
                n: TensorSignature(n, shape, _SUMMARY_DTYPES.get(dtype, dtype)) for n, (shape, dtype) in shapes.items()
            }
        return self._states[function]

    def new_state(self, function: str) -> dict[str, np.ndarray]:
        """Zero-filled states for ``function`` (a fresh KV cache)."""
        return {n: np.zeros(s.shape, dtype=s.dtype) for n, s in self.state_signatures(function).items()}


def _in_export_order(names: list[str], exported: list[str]) -> list[str]:
    """The summary's entrypoint names (sorted by the beta) in the order the sidecar exported them."""
    return [n for n in exported if n in names] + sorted(n for n in names if n not in exported)


def _refuse_fp32(fp16: bool) -> None:
    if not fp16:
        raise AnelabInputError(
            "--fp32 applies to the NumPy evaluation of a Core ML package; a Core AI asset runs as stored"
        )
