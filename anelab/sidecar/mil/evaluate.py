"""Evaluate a saved package's MIL program with NumPy, on any OS.

The package is read back from disk (``milproto.load``), never taken from the builder's memory.
Each op is executed by a NumPy kernel in float32; with ``fp16=True`` (the default) every fp16
tensor the program stores is rounded to fp16 precision (``anelab.core.fp16``), as storing it would.

The attention core — ``matmul(Q, K^T) -> [reshape] -> add(mask) -> softmax -> matmul(., V)`` — is
recognised and evaluated in query tiles: the scores of one (batch, group, query tile) live in a
small float32 buffer, so neither a [heads, C, T] score matrix nor its softmax is materialised and
the big matmuls run in BLAS. Rounding points are the same as op-by-op, except that the score
matmul and mask add round once (as a fused matmul+add does), and row sums and the P V product are
accumulated in blocks of ``KEY_BLOCK`` keys (float32 summation order, so not op by op's bits; the
same bits whether or not dropped key blocks are scored). Everything else runs op by op, and each
intermediate is freed after its last use.

One key tile of online softmax (the stateful-tiled graph's inner step) is also run as one step
(``anelab.sidecar.mil.online_step``), which skips a tile every row of which provably ends at weight 0.
``fuse=False`` runs every op as written (the program's own working set, e.g. for a design's peak).

States (``evaluate_with_state``) keep fp16 storage: a state is read as the caller's fp16 array and
updated in place, as Core ML updates an ``MLState``; a read that other ops still see is copied first.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from threadpoolctl import threadpool_limits

from anelab.core.errors import AnelabInputError
from anelab.core.fp16 import ROUNDING_BLOCK, clip_overflow, round_to_fp16
from anelab.core.matmul import matmul
from anelab.core.reference import score_bound, scored_widths
from anelab.sidecar.coremltools_import import coremltools_modules, quiet_coremltools
from anelab.sidecar.format import load_package_spec, require_package
from anelab.sidecar.mil.kernels import KERNELS, worker_count
from anelab.sidecar.mil.online_step import find_online_steps, run_online_step

SHARED_CONST_ELEMENTS = 1 << 16  # consts this large (weights, RoPE tables) are also cached by content

# ops that only move or select values: with fp16 inputs their outputs are fp16-exact already
VALUE_PRESERVING_OPS = frozenset(
    {
        "reshape",
        "transpose",
        "concat",
        "split",
        "slice_by_index",
        "expand_dims",
        "squeeze",
        "tile",
        "gather",
        "gather_along_axis",
        "identity",
        "maximum",
        "minimum",
        "abs",
        "reduce_max",
        "reduce_min",
        "select",
    }
)


QUERY_TILE_ELEMENTS = 1 << 20  # fp32 score elements per tile (4 MiB): tile rows = this // keys
KEY_BLOCK = 512  # keys per block of the attention core's row sums and P V product (see _attention_core)


@dataclass
class TensorSignature:
    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, e.g. "float16"

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype}


@dataclass
class FunctionInfo:
    name: str
    inputs: list[TensorSignature]
    outputs: list[TensorSignature]
    op_counts: dict[str, int] = field(default_factory=dict)
    largest_intermediate_bytes: int = 0


_ML_DTYPES = {65552: "float16", 65568: "float32", 131104: "int32", 65600: "float64", 131080: "int8"}


def _signature(feature) -> TensorSignature:
    arr = feature.type.multiArrayType
    return TensorSignature(
        feature.name, tuple(int(s) for s in arr.shape), _ML_DTYPES.get(arr.dataType, str(arr.dataType))
    )


@functools.cache
def _mil_types():
    """coremltools' MIL types module (imported once; the interpreter asks per op)."""
    return coremltools_modules()[2]


def _numpy_dtype(var) -> np.dtype:
    types = _mil_types()
    t = var.dtype
    if t == types.fp16 or t == types.fp32 or t == types.fp64:
        return np.dtype(np.float32)
    if t == types.bool:
        return np.dtype(bool)
    return np.dtype(np.int32)


def _is_fp16(var) -> bool:
    types = _mil_types()
    return var.dtype == types.fp16


def var_bytes(var) -> int:
    types = _mil_types()
    shape = getattr(var, "shape", None)
    if shape is None or any(not isinstance(s, (int, np.integer)) for s in shape):
        return 0
    width = types.nbits_from_type(var.dtype) // 8 if hasattr(types, "nbits_from_type") else 2
    return int(np.prod(shape, dtype=np.int64)) * max(width, 1)


class SavedPackage:
    """A saved .mlpackage read back from disk: its spec, MIL program and function signatures."""

    def __init__(self, path: str | os.PathLike):
        ct, _, _ = coremltools_modules()
        from coremltools.converters.mil.frontend.milproto.load import load as milproto_load

        self.path = require_package(path)
        self.spec = load_package_spec(self.path)  # read only: coremltools' load_spec rewrites Manifest.json
        if self.spec.WhichOneof("Type") != "mlProgram":
            raise AnelabInputError(f"{self.path}: not an ML program package; anelab evaluates mlprogram sidecars only")
        weights_dir = self.path / "Data/com.apple.CoreML/weights"
        try:
            with quiet_coremltools():
                self.program = milproto_load(self.spec, self.spec.specificationVersion, str(weights_dir))
        except Exception as e:  # a truncated, empty or missing weight.bin, a corrupt program: the loader's own errors
            raise AnelabInputError(
                f"{self.path}: its program or weights cannot be read ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:80]}); re-export the package"
            ) from None
        desc = self.spec.description
        self.functions: dict[str, FunctionInfo] = {}
        if len(desc.functions):
            for f in desc.functions:
                self.functions[f.name] = FunctionInfo(
                    f.name, [_signature(i) for i in f.input], [_signature(o) for o in f.output]
                )
            self.default_function = desc.defaultFunctionName or next(iter(self.functions))
        else:
            self.functions["main"] = FunctionInfo(
                "main", [_signature(i) for i in desc.input], [_signature(o) for o in desc.output]
            )
            self.default_function = "main"
        for name, info in self.functions.items():
            ops = self.mil_function(name).operations
            counts: dict[str, int] = {}
            largest = 0
            for op in ops:
                if op.op_type == "const":
                    continue
                counts[op.op_type] = counts.get(op.op_type, 0) + 1
                for out in op.outputs:
                    largest = max(largest, var_bytes(out))
            info.op_counts = dict(sorted(counts.items()))
            info.largest_intermediate_bytes = largest
        self._const_cache: dict[int, np.ndarray] = {}
        self._by_content: dict[tuple, np.ndarray] = {}  # large consts by (dtype, shape, sha1 of their bytes)

    def mil_function(self, name: str):
        key = name if name in self.program.functions else "main"
        return self.program.functions[key]

    def function(self, name: str) -> FunctionInfo:
        if name not in self.functions:
            raise AnelabInputError(f"{self.path.name} has no function {name!r}; it has: {', '.join(self.functions)}")
        return self.functions[name]

    def const_value(self, var) -> np.ndarray:
        """A const var's value as float32/int32/bool NumPy array (cached per package; read-only by contract).

        A weight the package's functions share (one blob in the file, one const per function once loaded)
        is converted once: consts of ``SHARED_CONST_ELEMENTS`` values or more are also cached by content,
        so the four functions of an 8B layer hold one fp32 copy of its weights (168 MB), not four."""
        key = id(var)
        if key not in self._const_cache:
            raw = np.asarray(var.val)
            content = None
            if raw.size >= SHARED_CONST_ELEMENTS:
                raw = np.ascontiguousarray(raw)
                content = (raw.dtype.str, raw.shape, hashlib.sha1(raw.view(np.uint8)).digest())
            if content is not None and content in self._by_content:
                val = self._by_content[content]
            else:
                val = raw
                if val.dtype.kind == "f":
                    val = val.astype(np.float32)
                elif val.dtype.kind in "iu":
                    val = val.astype(np.int32) if val.dtype.itemsize <= 4 else val.astype(np.int64)
                if content is not None:
                    self._by_content[content] = val
            self._const_cache[key] = val
        return self._const_cache[key]

    # ---- what verify asks of any saved sidecar (a Core AI asset answers the same: sidecar.coreai.asset) ----
    def description(self, fp16: bool = True) -> str:
        """How this package's functions are run, for a verification report."""
        return "NumPy evaluation of the saved MIL program (" + ("fp16 storage emulated" if fp16 else "fp32") + ")"

    def evaluate(self, function: str, inputs: dict[str, np.ndarray], *, fp16: bool = True) -> dict[str, np.ndarray]:
        return evaluate(self, function, inputs, fp16=fp16)

    def evaluate_with_state(self, function: str, inputs: dict, state: dict[str, np.ndarray], *, fp16: bool = True):
        return evaluate_with_state(self, function, inputs, state, fp16=fp16)

    def new_state(self, function: str) -> dict[str, np.ndarray]:
        return new_state(self, function)

    def close(self) -> None:
        """Nothing to release (the NumPy evaluation holds no runtime)."""

    def check_inputs(self, function: str, inputs: dict[str, np.ndarray]) -> None:
        """Refuse missing inputs, wrong shapes or dtypes (one line naming the input)."""
        info = self.function(function)
        for sig in info.inputs:
            if sig.name not in inputs:
                raise AnelabInputError(
                    f"input {sig.name!r} of {function} is missing; expected {sig.dtype} {list(sig.shape)}"
                )
            arr = inputs[sig.name]
            if tuple(arr.shape) != sig.shape:
                raise AnelabInputError(
                    f"input {sig.name!r} of {function} has shape {list(arr.shape)}; expected {list(sig.shape)}"
                )
            if arr.dtype != np.dtype(sig.dtype):
                raise AnelabInputError(f"input {sig.name!r} of {function} has dtype {arr.dtype}; expected {sig.dtype}")


def evaluate(
    package: SavedPackage | str | os.PathLike,
    function: str,
    inputs: dict[str, np.ndarray],
    *,
    fp16: bool = True,
    fuse: bool = True,
) -> dict[str, np.ndarray]:
    """Run one function of a saved package on NumPy inputs; returns outputs by name.

    Inputs must match the function's signature exactly (names, shapes, dtypes — fp16 for sidecars).
    Outputs are returned as float16 when the program's outputs are fp16 (``fp16=True``) and as
    float32 when evaluated with ``fp16=False`` (no rounding anywhere). ``fuse=False``: every op as
    written (no attention-core or online-softmax step fusion; same results, the program's own memory).
    """
    pkg = package if isinstance(package, SavedPackage) else SavedPackage(package)
    info = pkg.function(function)
    if state_signatures(pkg, function):
        raise AnelabInputError(
            f"{function} is stateful (its KV cache lives in Core ML state); evaluate it with "
            "anelab.sidecar.mil.evaluate.evaluate_with_state, or check it with 'anelab verify'"
        )
    pkg.check_inputs(function, inputs)
    return Interpreter(pkg, pkg.mil_function(function), fp16, fuse=fuse).run(inputs, info)


class Interpreter:
    """Runs one MIL function op by op on NumPy arrays (float32 compute, fp16 storage emulated)."""

    def __init__(self, pkg: SavedPackage, fn, fp16: bool, *, fuse: bool = True):
        self.pkg, self.fn, self.fp16, self.fuse = pkg, fn, fp16, fuse
        self.env: dict[str, np.ndarray] = {}
        self.updated_states: dict[str, np.ndarray] = {}  # state name -> the value the call leaves in it
        self.tile_counts = {"scored": 0, "skipped": 0}  # online-softmax key tiles x batches (online_step)
        self.uses: dict[str, int] = {}
        for op in fn.operations:
            for v in _input_vars(op):
                self.uses[v.name] = self.uses.get(v.name, 0) + 1
        for v in fn.outputs:
            self.uses[v.name] = self.uses.get(v.name, 0) + 1

    def value(self, var) -> np.ndarray:
        """The var's value for computing: float32 (an fp16 state value is widened), int32 or bool."""
        arr = self.raw(var)
        return arr.astype(np.float32) if arr.dtype == np.float16 else arr

    def raw(self, var) -> np.ndarray:
        """The var's value as stored: fp16 for a state (and views of it), else as ``value``."""
        if var.name in self.env:
            return self.env[var.name]
        if var.op is not None and var.op.op_type == "const" or var.val is not None:
            return self.pkg.const_value(var)
        raise AnelabInputError(f"MIL evaluation: value of {var.name!r} is not available (unsupported graph)")

    def param(self, op, name, default=None):
        var = op.inputs.get(name)
        if var is None:
            return default
        val = self.value(var)
        return val.item() if isinstance(val, np.ndarray) and val.ndim == 0 else val

    def store(self, var, arr: np.ndarray, exact: bool = False) -> None:
        """Keep an op's result; fp16 results are rounded to fp16 unless ``exact`` (the op only moved
        values that were already fp16)."""
        arr = np.asarray(arr)
        if arr.dtype == np.float16 and _is_fp16(var):  # fp16 storage already (a state or a view of one)
            self.env[var.name] = arr
            return
        dtype = _numpy_dtype(var)
        if arr.dtype != dtype:
            arr = arr.astype(dtype)
        if self.fp16 and _is_fp16(var) and not exact:
            if not arr.flags.writeable or not arr.flags.c_contiguous or _shares_env(arr, self.env):
                arr = np.array(arr, dtype=np.float32, copy=True)
            clip_overflow(round_to_fp16(arr))
        self.env[var.name] = arr

    def round_stored(self, var, arr: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
        """In place, what storing a float32 ``arr`` as ``var`` does (fp16 rounding for an fp16 var)."""
        if self.fp16 and _is_fp16(var):
            clip_overflow(round_to_fp16(arr, scratch))
        return arr

    def owns(self, var) -> bool:
        """True when ``var``'s value may be written in place: it lives in this call's env (not a
        const), the op about to run is its last user, and no other live value but the state inputs
        (which a state update replaces anyway) shares its memory."""
        arr = self.env.get(var.name)
        if arr is None or var.name in self.fn.inputs or self.uses.get(var.name) != 1 or not arr.flags.writeable:
            return False
        base = arr if arr.base is None else arr.base
        for name, other in self.env.items():
            if name == var.name or name in self.state_names:
                continue
            if other is base or other.base is base or (other.base is not None and other.base is arr):
                return False
        return True

    def release(self, op) -> None:
        for v in _input_vars(op):
            n = self.uses.get(v.name)
            if n is None:
                continue
            self.uses[v.name] = n - 1
            if n - 1 == 0 and v.name in self.env:
                del self.env[v.name]

    state_names: frozenset[str] = frozenset()

    def run(
        self, inputs: dict[str, np.ndarray], info: FunctionInfo, states: dict[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """Outputs by name; ``states`` (name -> array) are read as given when fp16 (and updated in place)."""
        states = states or {}
        self.state_names = frozenset(states)
        for name in self.fn.inputs:
            arr = states[name] if name in states else inputs[name]
            if name in states and self.fp16 and arr.dtype == np.float16:
                self.env[name] = arr
            else:
                self.env[name] = np.asarray(arr, dtype=np.float32 if arr.dtype.kind == "f" else arr.dtype)
        ops = list(self.fn.operations)
        fused = _find_attention_cores(ops, self.uses) if self.fuse else {}
        steps = find_online_steps(ops, self.uses) if self.fuse else {}
        skip = {id(o) for core in fused.values() for o in core.ops[:-1]}
        skip |= {id(o) for step in steps.values() for o in step.ops if o is not step.last}
        for op in ops:
            if op.op_type == "const" or id(op) in skip:
                continue
            core = fused.get(id(op))
            if core is not None:
                self.store(op.outputs[0], _attention_core(self, core))
                for o in core.ops:
                    self.release(o)
                continue
            step = steps.get(id(op))
            if step is not None:
                for var, arr in run_online_step(self, step):
                    self.store(var, arr, exact=True)
                for o in step.ops:
                    self.release(o)
                continue
            kernel = KERNELS.get(op.op_type)
            if kernel is None:
                raise AnelabInputError(
                    f"MIL evaluation does not support op {op.op_type!r} (in {op.name}); supported: {', '.join(sorted(KERNELS))}"
                )
            results = kernel(self, op)
            if not isinstance(results, (list, tuple)):
                results = [results]
            exact = op.op_type in VALUE_PRESERVING_OPS and all(
                _is_fp16(v) for v in _input_vars(op) if v.name in self.env
            )
            for var, arr in zip(op.outputs, results):
                self.store(var, arr, exact=exact)
            self.release(op)
        out = {}
        for var, sig in zip(self.fn.outputs, info.outputs):
            arr = self.env[var.name]
            out[sig.name] = (
                arr.astype(np.float16) if (self.fp16 and sig.dtype == "float16") else np.array(arr, dtype=np.float32)
            )
        return out


def _shares_env(arr: np.ndarray, env: dict) -> bool:
    base = arr.base if arr.base is not None else arr
    return any((v is base) or (v.base is not None and v.base is base) for v in env.values())


def _input_vars(op):
    out = []
    for v in op.inputs.values():
        if isinstance(v, (list, tuple)):
            out.extend(v)
        else:
            out.append(v)
    return out


@dataclass
class _AttentionCore:
    ops: list  # [matmul_qk, (reshape), add, softmax, matmul_pv]
    qk: object
    reshape: object
    add: object
    softmax: object
    pv: object


def _find_attention_cores(ops, uses) -> dict[int, _AttentionCore]:
    """Map id(final matmul) -> the core it closes, for every recognisable attention core."""
    producer = {}
    for op in ops:
        for v in op.outputs:
            producer[v.name] = op
    consumers: dict[str, list] = {}
    for op in ops:
        for v in _input_vars(op):
            consumers.setdefault(v.name, []).append(op)
    cores = {}
    for sm in ops:
        if sm.op_type != "softmax":
            continue
        axis = sm.inputs["axis"].val
        rank = len(sm.outputs[0].shape)
        if axis not in (-1, rank - 1):
            continue
        add = producer.get(sm.inputs["x"].name)
        if add is None or add.op_type != "add" or uses.get(add.outputs[0].name) != 1:
            continue
        # scores is x, mask is y (or the other way round)
        for s_name, m_name in (("x", "y"), ("y", "x")):
            src = producer.get(add.inputs[s_name].name)
            reshape = None
            if src is not None and src.op_type == "reshape" and uses.get(src.outputs[0].name) == 1:
                reshape, src = src, producer.get(src.inputs["x"].name)
            if src is None or src.op_type != "matmul" or uses.get(src.outputs[0].name) != 1:
                continue
            if bool(src.inputs["transpose_x"].val) or not bool(src.inputs["transpose_y"].val):
                continue
            users = consumers.get(sm.outputs[0].name, [])
            if len(users) != 1 or users[0].op_type != "matmul" or users[0].inputs["x"] is not sm.outputs[0]:
                continue
            pv = users[0]
            if bool(pv.inputs["transpose_x"].val) or bool(pv.inputs["transpose_y"].val):
                continue
            qk_shape, sc_shape = src.outputs[0].shape, sm.outputs[0].shape
            q_shape, k_shape = src.inputs["x"].shape, src.inputs["y"].shape
            if len(qk_shape) != 3 or len(q_shape) != 3 or len(k_shape) != 3 or q_shape[0] != k_shape[0]:
                continue
            if len(sc_shape) not in (3, 4) or sc_shape[-1] != qk_shape[-1] or sc_shape[0] != qk_shape[0]:
                continue
            if len(sc_shape) == 4 and sc_shape[1] * sc_shape[2] != qk_shape[1]:
                continue
            cores[id(pv)] = _AttentionCore(
                [o for o in (src, reshape, add, sm, pv) if o is not None], src, reshape, add, sm, pv
            )
            cores[id(pv)].mask_name = m_name
            cores[id(pv)].score_name = s_name
            break
    return cores


def _visible_widths(q, k, mask_rows: np.ndarray, tile: int) -> list[int]:
    """Keys each query tile must score (``reference.scored_widths``): past its width every row of the
    tile has a softmax weight of exactly 0. q [B, R, d], k [B, T, d], mask_rows [C, T] (shared by all
    batches and groups); one width per tile of ``tile`` rows."""
    return scored_widths(mask_rows, score_bound(q, k), tile)


def _attention_core(it: Interpreter, core: _AttentionCore) -> np.ndarray:
    """softmax(Q K^T + mask) V evaluated per (batch, group, query tile), fp16 rounding emulated.

    A tile scores only its visible keys (``_visible_widths``), rounded up to whole ``KEY_BLOCK``s. The
    row sums and the P V product are accumulated block by block (blocks of ``KEY_BLOCK`` keys from key
    0, in order): a block past the visible width holds weights that are exactly 0 — its sum and its
    product are exactly 0 and add nothing — so skipping it gives the same bits as scoring every key.
    """
    q = it.value(core.qk.inputs["x"])  # [B, R, d]   (R = G*C rows)
    k = it.raw(core.qk.inputs["y"])  # [B, T, d] (fp16 when read from a state)
    mask = it.value(core.add.inputs[core.mask_name])
    v = it.value(core.pv.inputs["y"])  # broadcastable to [B, (G,) T, d]
    sc_shape = tuple(core.softmax.outputs[0].shape)
    B, R, T = core.qk.outputs[0].shape
    G, C = (sc_shape[1], sc_shape[2]) if len(sc_shape) == 4 else (1, R)
    mask_full = np.broadcast_to(mask, sc_shape)
    if len(sc_shape) == 3:
        mask_full = mask_full[:, None]  # [B, 1, C, T]
    out_shape = tuple(core.pv.outputs[0].shape)
    d_out = out_shape[-1]
    v_b = np.broadcast_to(v, (B, G, T, d_out) if v.ndim == 4 else (B, T, d_out))
    out = np.empty((B, G, C, d_out), dtype=np.float32)
    tile = max(1, min(C, QUERY_TILE_ELEMENTS // max(T, 1)))
    rounding = it.fp16
    k_t = [np.ascontiguousarray(k[b].T, dtype=np.float32) for b in range(B)]  # [d, T] per batch, shared by the workers
    shared_mask = mask_full.strides[0] == 0 and mask_full.strides[1] == 0
    widths = _visible_widths(q, k, mask_full[0, 0], tile) if shared_mask else None
    work = [(b, g, r0) for b in range(B) for g in range(G) for r0 in range(0, C, tile)]
    local = threading.local()

    def score_tile(item, V: int) -> bool:
        """One tile over its first V keys; False (nothing written) when a row overflows fp16 with V < T."""
        b, g, r0 = item
        if not hasattr(local, "head"):
            local.head = np.empty(tile * T, dtype=np.float32)
            local.scratch = np.empty(min(tile * T, ROUNDING_BLOCK), dtype=np.int32)
        r1 = min(C, r0 + tile)
        V = min(T, -(-V // KEY_BLOCK) * KEY_BLOCK)  # whole blocks: the block sums must not depend on V
        h = local.head[: (r1 - r0) * V].reshape(r1 - r0, V)  # the scored columns, contiguous
        matmul(q[b, g * C + r0 : g * C + r1], k_t[b][:, :V], out=h)
        np.add(h, mask_full[b, g, r0:r1, :V], out=h)
        if rounding:
            round_to_fp16(h, local.scratch)
        row_max = h.max(axis=1, keepdims=True)
        if rounding and np.abs(row_max).max() > 65519.99:  # a row past fp16's range: store as +-inf
            if V < T:
                return False  # every column then, as op by op
            clip_overflow(h)
            row_max = h.max(axis=1, keepdims=True)
        np.subtract(h, row_max, out=h)
        np.exp(h, out=h)
        blocks = [slice(k0, min(k0 + KEY_BLOCK, V)) for k0 in range(0, V, KEY_BLOCK)]
        total = h[:, blocks[0]].sum(axis=1, keepdims=True)
        for blk in blocks[1:]:
            total += h[:, blk].sum(axis=1, keepdims=True)
        np.multiply(h, 1.0 / total, out=h)
        if rounding:
            round_to_fp16(h, local.scratch)
        vb = v_b[b, g] if v_b.ndim == 4 else v_b[b]
        target = out[b, g, r0:r1]
        matmul(h[:, blocks[0]], vb[blocks[0]], out=target)
        for blk in blocks[1:]:
            target += matmul(h[:, blk], vb[blk])
        return True

    def run(item) -> None:  # (not recursive: a self-referencing closure would keep this frame's arrays alive)
        V = widths[item[2] // tile] if widths is not None else T
        if not score_tile(item, V):
            score_tile(item, T)

    workers = worker_count(len(work))
    if workers <= 1:
        for item in work:
            run(item)
    else:  # ufuncs and BLAS release the GIL: one single-threaded BLAS per worker, no oversubscription
        with threadpool_limits(limits=1, user_api="blas"), ThreadPoolExecutor(workers) as pool:
            list(pool.map(run, work))
    return out.reshape(out_shape)


def state_signatures(package: SavedPackage, function: str) -> dict[str, TensorSignature]:
    """The states of one function (name -> shape/dtype), from its saved program."""
    _, _, types = coremltools_modules()
    package.function(function)
    out = {}
    for name, var in package.mil_function(function).inputs.items():
        if types.is_state(var.sym_type):
            tensor = var.sym_type.wrapped_type()
            dtype = "float16" if tensor.get_primitive() == types.fp16 else "float32"
            out[name] = TensorSignature(name, tuple(int(s) for s in tensor.get_shape()), dtype)
    return out


def evaluate_with_state(
    package: SavedPackage | str | os.PathLike,
    function: str,
    inputs: dict[str, np.ndarray],
    state: dict[str, np.ndarray],
    *,
    fp16: bool = True,
    fuse: bool = True,
) -> dict[str, np.ndarray]:
    """Run one function of a saved stateful package; ``state`` (name -> array, e.g. from
    ``new_state``) holds the values the call leaves in it afterwards.

    As Core ML updates an ``MLState``, an fp16 state array (``fp16=True``) is updated in place when
    the program writes it; otherwise its entry is replaced by a new array. ``fuse``: as ``evaluate``."""
    pkg = package if isinstance(package, SavedPackage) else SavedPackage(package)
    info = pkg.function(function)
    pkg.check_inputs(function, inputs)
    states = state_signatures(pkg, function)
    for name, sig in states.items():
        if name not in state:
            raise AnelabInputError(f"state {name!r} of {function} is missing; create it with new_state()")
        if tuple(state[name].shape) != sig.shape:
            raise AnelabInputError(
                f"state {name!r} of {function} has shape {list(state[name].shape)}; expected {list(sig.shape)}"
            )
    it = Interpreter(pkg, pkg.mil_function(function), fp16, fuse=fuse)
    out = it.run(inputs, info, states={n: state[n] for n in states})
    for name, value in it.updated_states.items():
        if fp16 and states[name].dtype == "float16":
            state[name] = value if value.dtype == np.float16 else value.astype(np.float16)
        else:
            state[name] = np.array(value, dtype=np.float32)
    return out


def new_state(package: SavedPackage | str | os.PathLike, function: str) -> dict[str, np.ndarray]:
    """Zero-filled states for ``function`` (as ``MLModel.make_state()`` gives a fresh state)."""
    pkg = package if isinstance(package, SavedPackage) else SavedPackage(package)
    return {n: np.zeros(s.shape, dtype=s.dtype) for n, s in state_signatures(pkg, function).items()}
