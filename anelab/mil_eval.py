"""Evaluate a saved package's MIL program with NumPy, on any OS.

The package is read back from disk (``milproto.load``), never taken from the builder's memory.
Each op is executed by a NumPy kernel in float32; with ``fp16=True`` (the default) every fp16
tensor the program stores is rounded to fp16 precision (``anelab.fp16``), as storing it would.

The attention core — ``matmul(Q, K^T) -> [reshape] -> add(mask) -> softmax -> matmul(., V)`` — is
recognised and evaluated in query tiles: the scores of one (batch, group, query tile) live in a
small float32 buffer, so neither a [heads, C, T] score matrix nor its softmax is materialised and
the big matmuls run in BLAS. Rounding points are the same as op-by-op, except that the score
matmul and mask add round once (as a fused matmul+add does). Everything else runs op by op, and
each intermediate is freed after its last use.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from threadpoolctl import threadpool_limits

from anelab.errors import AnelabInputError
from anelab.export import require_package
from anelab.fp16 import clip_overflow, round_to_fp16
from anelab.graph import coremltools_modules, quiet_coremltools

# ops that only move or select values: with fp16 inputs their outputs are fp16-exact already
VALUE_PRESERVING_OPS = frozenset({"reshape", "transpose", "concat", "split", "slice_by_index", "expand_dims",
                                  "squeeze", "tile", "gather", "gather_along_axis", "identity", "maximum", "minimum", "abs",
                                  "reduce_max", "reduce_min", "select"})
QUERY_TILE_ELEMENTS = 1 << 19   # fp32 score elements per tile (2 MiB): tile rows = this // keys
MAX_WORKERS = 8                 # attention-core tiles run on up to this many threads (capped by cores)


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
    return TensorSignature(feature.name, tuple(int(s) for s in arr.shape), _ML_DTYPES.get(arr.dataType, str(arr.dataType)))


def _numpy_dtype(var) -> np.dtype:
    _, _, types = coremltools_modules()
    t = var.dtype
    if t == types.fp16 or t == types.fp32 or t == types.fp64:
        return np.dtype(np.float32)
    if t == types.bool:
        return np.dtype(bool)
    return np.dtype(np.int32)


def _is_fp16(var) -> bool:
    _, _, types = coremltools_modules()
    return var.dtype == types.fp16


def _var_bytes(var) -> int:
    _, _, types = coremltools_modules()
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
        try:
            self.spec = ct.utils.load_spec(str(self.path))
        except Exception as e:
            raise AnelabInputError(f"{self.path}: cannot read the package's model spec ({type(e).__name__}); re-export it") from None
        if self.spec.WhichOneof("Type") != "mlProgram":
            raise AnelabInputError(f"{self.path}: not an ML program package; anelab evaluates mlprogram sidecars only")
        weights_dir = self.path / "Data/com.apple.CoreML/weights"
        with quiet_coremltools():
            self.program = milproto_load(self.spec, self.spec.specificationVersion, str(weights_dir))
        desc = self.spec.description
        self.functions: dict[str, FunctionInfo] = {}
        if len(desc.functions):
            for f in desc.functions:
                self.functions[f.name] = FunctionInfo(f.name, [_signature(i) for i in f.input], [_signature(o) for o in f.output])
            self.default_function = desc.defaultFunctionName or next(iter(self.functions))
        else:
            self.functions["main"] = FunctionInfo("main", [_signature(i) for i in desc.input], [_signature(o) for o in desc.output])
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
                    largest = max(largest, _var_bytes(out))
            info.op_counts = dict(sorted(counts.items()))
            info.largest_intermediate_bytes = largest
        self._const_cache: dict[int, np.ndarray] = {}

    def mil_function(self, name: str):
        key = name if name in self.program.functions else "main"
        return self.program.functions[key]

    def function(self, name: str) -> FunctionInfo:
        if name not in self.functions:
            raise AnelabInputError(f"{self.path.name} has no function {name!r}; it has: {', '.join(self.functions)}")
        return self.functions[name]

    def const_value(self, var) -> np.ndarray:
        """A const var's value as float32/int32/bool NumPy array (cached per package)."""
        key = id(var)
        if key not in self._const_cache:
            val = np.asarray(var.val)
            if val.dtype.kind == "f":
                val = val.astype(np.float32)
            elif val.dtype.kind in "iu":
                val = val.astype(np.int32) if val.dtype.itemsize <= 4 else val.astype(np.int64)
            self._const_cache[key] = val
        return self._const_cache[key]

    def check_inputs(self, function: str, inputs: dict[str, np.ndarray]) -> None:
        """Refuse missing inputs, wrong shapes or dtypes (one line naming the input)."""
        info = self.function(function)
        for sig in info.inputs:
            if sig.name not in inputs:
                raise AnelabInputError(f"input {sig.name!r} of {function} is missing; expected {sig.dtype} {list(sig.shape)}")
            arr = inputs[sig.name]
            if tuple(arr.shape) != sig.shape:
                raise AnelabInputError(f"input {sig.name!r} of {function} has shape {list(arr.shape)}; expected {list(sig.shape)}")
            if arr.dtype != np.dtype(sig.dtype):
                raise AnelabInputError(f"input {sig.name!r} of {function} has dtype {arr.dtype}; expected {sig.dtype}")


def evaluate(package: SavedPackage | str | os.PathLike, function: str, inputs: dict[str, np.ndarray],
             *, fp16: bool = True) -> dict[str, np.ndarray]:
    """Run one function of a saved package on NumPy inputs; returns outputs by name.

    Inputs must match the function's signature exactly (names, shapes, dtypes — fp16 for sidecars).
    Outputs are returned as float16 when the program's outputs are fp16 (``fp16=True``) and as
    float32 when evaluated with ``fp16=False`` (no rounding anywhere).
    """
    pkg = package if isinstance(package, SavedPackage) else SavedPackage(package)
    info = pkg.function(function)
    if state_signatures(pkg, function):
        raise AnelabInputError(
            f"{function} is stateful (its KV cache lives in Core ML state); evaluate it with "
            "anelab.mil_eval.evaluate_with_state, or check it with 'anelab verify'"
        )
    pkg.check_inputs(function, inputs)
    return _Interpreter(pkg, pkg.mil_function(function), fp16).run(inputs, info)


# ---- interpreter ---------------------------------------------------------------------------------

class _Interpreter:
    def __init__(self, pkg: SavedPackage, fn, fp16: bool):
        self.pkg, self.fn, self.fp16 = pkg, fn, fp16
        self.env: dict[str, np.ndarray] = {}
        self.uses: dict[str, int] = {}
        for op in fn.operations:
            for v in _input_vars(op):
                self.uses[v.name] = self.uses.get(v.name, 0) + 1
        for v in fn.outputs:
            self.uses[v.name] = self.uses.get(v.name, 0) + 1

    def value(self, var) -> np.ndarray:
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
        dtype = _numpy_dtype(var)
        if arr.dtype != dtype:
            arr = arr.astype(dtype)
        if self.fp16 and _is_fp16(var) and not exact:
            if not arr.flags.writeable or not arr.flags.c_contiguous or _shares_env(arr, self.env):
                arr = np.array(arr, dtype=np.float32, copy=True)
            clip_overflow(round_to_fp16(arr))
        self.env[var.name] = arr

    def release(self, op) -> None:
        for v in _input_vars(op):
            n = self.uses.get(v.name)
            if n is None:
                continue
            self.uses[v.name] = n - 1
            if n - 1 == 0 and v.name in self.env:
                del self.env[v.name]

    def run(self, inputs: dict[str, np.ndarray], info: FunctionInfo) -> dict[str, np.ndarray]:
        for name, var in self.fn.inputs.items():
            self.env[name] = np.asarray(inputs[name], dtype=np.float32 if inputs[name].dtype.kind == "f" else inputs[name].dtype)
        ops = list(self.fn.operations)
        fused = _find_attention_cores(ops, self.uses)
        skip = {id(o) for core in fused.values() for o in core.ops[:-1]}
        for op in ops:
            if op.op_type == "const" or id(op) in skip:
                continue
            core = fused.get(id(op))
            if core is not None:
                self.store(op.outputs[0], _attention_core(self, core))
                for o in core.ops:
                    self.release(o)
                continue
            kernel = _KERNELS.get(op.op_type)
            if kernel is None:
                raise AnelabInputError(
                    f"MIL evaluation does not support op {op.op_type!r} (in {op.name}); supported: {', '.join(sorted(_KERNELS))}"
                )
            results = kernel(self, op)
            if not isinstance(results, (list, tuple)):
                results = [results]
            exact = op.op_type in VALUE_PRESERVING_OPS and all(_is_fp16(v) for v in _input_vars(op) if v.name in self.env)
            for var, arr in zip(op.outputs, results):
                self.store(var, arr, exact=exact)
            self.release(op)
        out = {}
        for var, sig in zip(self.fn.outputs, info.outputs):
            arr = self.env[var.name]
            out[sig.name] = arr.astype(np.float16) if (self.fp16 and sig.dtype == "float16") else np.array(arr, dtype=np.float32)
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


# ---- fused attention core --------------------------------------------------------------------------

@dataclass
class _AttentionCore:
    ops: list           # [matmul_qk, (reshape), add, softmax, matmul_pv]
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
            cores[id(pv)] = _AttentionCore([o for o in (src, reshape, add, sm, pv) if o is not None], src, reshape, add, sm, pv)
            cores[id(pv)].mask_name = m_name
            cores[id(pv)].score_name = s_name
            break
    return cores


def _attention_core(it: _Interpreter, core: _AttentionCore) -> np.ndarray:
    """softmax(Q K^T + mask) V evaluated per (batch, group, query tile), fp16 rounding emulated."""
    q = it.value(core.qk.inputs["x"])          # [B, R, d]   (R = G*C rows)
    k = it.value(core.qk.inputs["y"])          # [B, T, d]
    mask = it.value(core.add.inputs[core.mask_name])
    v = it.value(core.pv.inputs["y"])          # broadcastable to [B, (G,) T, d]
    sc_shape = tuple(core.softmax.outputs[0].shape)
    B, R, T = core.qk.outputs[0].shape
    G, C = (sc_shape[1], sc_shape[2]) if len(sc_shape) == 4 else (1, R)
    mask_full = np.broadcast_to(mask, sc_shape)
    if len(sc_shape) == 3:
        mask_full = mask_full[:, None]       # [B, 1, C, T]
    out_shape = tuple(core.pv.outputs[0].shape)
    d_out = out_shape[-1]
    v_b = np.broadcast_to(v, (B, G, T, d_out) if v.ndim == 4 else (B, T, d_out))
    out = np.empty((B, G, C, d_out), dtype=np.float32)
    tile = max(1, min(C, QUERY_TILE_ELEMENTS // max(T, 1)))
    rounding = it.fp16
    k_t = [np.ascontiguousarray(k[b].T) for b in range(B)]  # [d, T] per batch, shared by the workers
    work = [(b, g, r0) for b in range(B) for g in range(G) for r0 in range(0, C, tile)]
    local = threading.local()

    def run(item):
        b, g, r0 = item
        if not hasattr(local, "scores"):
            local.scores = np.empty((tile, T), dtype=np.float32)
            local.scratch = np.empty(tile * T, dtype=np.int32)
        r1 = min(C, r0 + tile)
        s = local.scores[: r1 - r0]
        np.matmul(q[b, g * C + r0: g * C + r1], k_t[b], out=s)
        np.add(s, mask_full[b, g, r0:r1], out=s)
        if rounding:
            round_to_fp16(s, local.scratch[: s.size])
        row_max = s.max(axis=1, keepdims=True)
        if rounding and np.abs(row_max).max() > 65519.99:  # a row past fp16's range: store as +-inf
            clip_overflow(s)
            row_max = s.max(axis=1, keepdims=True)
        np.subtract(s, row_max, out=s)
        np.exp(s, out=s)
        total = s.sum(axis=1, keepdims=True)
        np.multiply(s, 1.0 / total, out=s)
        if rounding:
            round_to_fp16(s, local.scratch[: s.size])
        vb = v_b[b, g] if v_b.ndim == 4 else v_b[b]
        np.matmul(s, vb, out=out[b, g, r0:r1])

    workers = min(len(work), os.cpu_count() or 1, MAX_WORKERS)
    if workers <= 1:
        for item in work:
            run(item)
    else:  # ufuncs and BLAS release the GIL: one single-threaded BLAS per worker, no oversubscription
        with threadpool_limits(limits=1, user_api="blas"), ThreadPoolExecutor(workers) as pool:
            list(pool.map(run, work))
    return out.reshape(out_shape)


# ---- op kernels -------------------------------------------------------------------------------------

def _k_linear(it, op):
    x = it.value(op.inputs["x"])
    w = it.value(op.inputs["weight"])
    y = x @ w.T
    if "bias" in op.inputs:
        y += it.value(op.inputs["bias"])
    return y


def _k_matmul(it, op):
    x, y = it.value(op.inputs["x"]), it.value(op.inputs["y"])
    if it.param(op, "transpose_x", False):
        x = np.swapaxes(x, -1, -2)
    if it.param(op, "transpose_y", False):
        y = np.swapaxes(y, -1, -2)
    return np.matmul(x, y)


def _binary(fn):
    return lambda it, op: fn(it.value(op.inputs["x"]), it.value(op.inputs["y"]))


def _unary(fn):
    return lambda it, op: fn(it.value(op.inputs["x"]))


def _axes(it, op):
    axes = it.param(op, "axes")
    return None if axes is None else tuple(int(a) for a in np.atleast_1d(axes))


def _reduce(fn):
    def kernel(it, op):
        return fn(it.value(op.inputs["x"]), axis=_axes(it, op), keepdims=bool(it.param(op, "keep_dims", False)))
    return kernel


def _k_reshape(it, op):
    shape = [int(s) for s in np.atleast_1d(it.param(op, "shape"))]
    return it.value(op.inputs["x"]).reshape(shape)


def _k_transpose(it, op):
    return np.ascontiguousarray(np.transpose(it.value(op.inputs["x"]), [int(p) for p in it.param(op, "perm")]))


def _k_concat(it, op):
    return np.concatenate([it.value(v) for v in op.inputs["values"]], axis=int(it.param(op, "axis")))


def _k_split(it, op):
    x = it.value(op.inputs["x"])
    axis = int(it.param(op, "axis"))
    sizes = it.param(op, "split_sizes")
    if sizes is not None:
        idx = np.cumsum(np.atleast_1d(sizes))[:-1]
        parts = np.split(x, idx, axis=axis)
    else:
        parts = np.split(x, int(it.param(op, "num_splits")), axis=axis)
    return [np.ascontiguousarray(p) for p in parts]


def _slice_index(it, op, shape: tuple[int, ...], *, name: str = "slice") -> tuple:
    """The NumPy index of a slice_by_index / slice_update op (begin, end, stride and the three masks).

    With ``name="slice_update"`` bounds must lie inside the axis (a write cannot wrap or clip)."""
    rank = len(shape)
    begin = np.atleast_1d(it.param(op, "begin")).astype(np.int64)
    end = np.atleast_1d(it.param(op, "end")).astype(np.int64)
    stride = np.atleast_1d(it.param(op, "stride", np.ones(rank, np.int32)))
    bm = np.atleast_1d(it.param(op, "begin_mask", np.zeros(rank, bool)))
    em = np.atleast_1d(it.param(op, "end_mask", np.zeros(rank, bool)))
    sq = np.atleast_1d(it.param(op, "squeeze_mask", np.zeros(rank, bool)))
    strict = name == "slice_update"
    index = []
    for i in range(rank):
        if sq[i]:
            index.append(int(begin[i]))
            continue
        start = (0 if strict else None) if bm[i] else int(begin[i])
        stop = (shape[i] if strict else None) if em[i] else int(end[i])
        if strict and not (0 <= start <= shape[i] and 0 <= stop <= shape[i]):
            raise AnelabInputError(f"MIL evaluation: slice_update [{start}, {stop}) is outside axis {i} of size {shape[i]}")
        index.append(slice(start, stop, int(stride[i])))
    return tuple(index)


def _k_slice_by_index(it, op):
    x = it.value(op.inputs["x"])
    index = _slice_index(it, op, x.shape)
    return np.ascontiguousarray(x[index])


def _k_softmax(it, op):
    x = np.array(it.value(op.inputs["x"]), dtype=np.float32, copy=True)
    axis = int(it.param(op, "axis"))
    x -= x.max(axis=axis, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=axis, keepdims=True)
    return x


def _k_expand_dims(it, op):
    x = it.value(op.inputs["x"])
    for a in sorted(int(a) for a in np.atleast_1d(it.param(op, "axes"))):
        x = np.expand_dims(x, a if a >= 0 else x.ndim + 1 + a)
    return x


def _k_squeeze(it, op):
    axes = _axes(it, op)
    return np.squeeze(it.value(op.inputs["x"]), axis=axes)


def _k_rsqrt(it, op):
    x = it.value(op.inputs["x"])
    return 1.0 / np.sqrt(x + np.float32(it.param(op, "epsilon", 1e-12)))


def _k_cast(it, op):
    dtype = {"fp16": np.float32, "fp32": np.float32, "int32": np.int32, "bool": bool, "int16": np.int32}[it.param(op, "dtype")]
    return it.value(op.inputs["x"]).astype(dtype)


def _k_gather(it, op):
    x = it.value(op.inputs["x"])
    idx = it.value(op.inputs["indices"]).astype(np.int64)
    axis = int(it.param(op, "axis", 0))
    return np.take(x, idx, axis=axis)


def _k_tile(it, op):
    return np.tile(it.value(op.inputs["x"]), [int(r) for r in it.param(op, "reps")])


def _k_select(it, op):
    return np.where(it.value(op.inputs["cond"]).astype(bool), it.value(op.inputs["a"]), it.value(op.inputs["b"]))


def _k_clip(it, op):
    return np.clip(it.value(op.inputs["x"]), it.param(op, "alpha"), it.param(op, "beta"))


_KERNELS = {
    "linear": _k_linear,
    "matmul": _k_matmul,
    "add": _binary(np.add),
    "sub": _binary(np.subtract),
    "mul": _binary(np.multiply),
    "real_div": _binary(np.divide),
    "maximum": _binary(np.maximum),
    "minimum": _binary(np.minimum),
    "pow": _binary(np.power),
    "greater": _binary(np.greater),
    "less": _binary(np.less),
    "less_equal": _binary(np.less_equal),
    "greater_equal": _binary(np.greater_equal),
    "equal": _binary(np.equal),
    "abs": _unary(np.abs),
    "exp": _unary(np.exp),
    "sqrt": _unary(np.sqrt),
    "square": _unary(np.square),
    "sigmoid": _unary(lambda x: 1.0 / (1.0 + np.exp(-x))),
    "silu": _unary(lambda x: x / (1.0 + np.exp(-x))),
    "inverse": lambda it, op: 1.0 / (it.value(op.inputs["x"]) + np.float32(it.param(op, "epsilon", 1e-4))),
    "rsqrt": _k_rsqrt,
    "reduce_max": _reduce(np.max),
    "reduce_min": _reduce(np.min),
    "reduce_mean": _reduce(np.mean),
    "reduce_sum": _reduce(np.sum),
    "reshape": _k_reshape,
    "transpose": _k_transpose,
    "concat": _k_concat,
    "split": _k_split,
    "slice_by_index": _k_slice_by_index,
    "softmax": _k_softmax,
    "expand_dims": _k_expand_dims,
    "squeeze": _k_squeeze,
    "cast": _k_cast,
    "gather": _k_gather,
    "gather_along_axis": lambda it, op: np.take_along_axis(
        it.value(op.inputs["x"]), it.value(op.inputs["indices"]).astype(np.int64), axis=int(it.param(op, "axis", 0))),
    "tile": _k_tile,
    "select": _k_select,
    "clip": _k_clip,
    "identity": _unary(lambda x: x),
}

SUPPORTED_OPS = tuple(sorted(_KERNELS))


# ---- compressed-weight kernels (iOS 18 constexpr ops; anelab.quantize) -----------------------------

def _block_expand(small: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Repeat a per-block array [n0, n1, ...] to ``shape`` (block size = shape[i] / n_i per axis)."""
    out = small
    for axis, (n, full) in enumerate(zip(small.shape, shape)):
        if full % n:
            raise AnelabInputError(f"MIL evaluation: block count {n} does not divide dimension {full}; the package is malformed")
        out = np.repeat(out, full // n, axis=axis)
    return out


def _k_constexpr_blockwise_shift_scale(it, op):
    """output = scale * (data - offset), scale/offset repeated over their blocks (iOS 18)."""
    data = it.value(op.inputs["data"]).astype(np.float32)
    scale = it.value(op.inputs["scale"]).astype(np.float32)
    if scale.ndim != data.ndim:
        raise AnelabInputError("MIL evaluation: constexpr_blockwise_shift_scale scale rank differs from data rank")
    if "offset" in op.inputs:
        data = data - _block_expand(it.value(op.inputs["offset"]).astype(np.float32), data.shape)
    return data * _block_expand(scale, data.shape)


def _k_constexpr_lut_to_dense(it, op):
    """output[i...] = lut[block(i...), indices[i...]] for scalar palettes (lut [*blocks, entries, 1])."""
    indices = it.value(op.inputs["indices"]).astype(np.int64)
    lut = it.value(op.inputs["lut"]).astype(np.float32)
    if lut.ndim != indices.ndim + 2:
        raise AnelabInputError("MIL evaluation: constexpr_lut_to_dense lut rank must be indices rank + 2")
    if lut.shape[-1] != 1:
        raise AnelabInputError("MIL evaluation: vector palettization (lut vector size > 1) is not supported")
    blocks = lut.shape[:-2]
    grid = np.meshgrid(*[np.arange(s) // (s // n) for s, n in zip(indices.shape, blocks)], indexing="ij")
    return lut[(*grid, indices, np.zeros_like(indices))]


def _k_constexpr_affine_dequantize(it, op):
    """iOS 16 form: (quantized_data - zero_point) * scale along ``axis``."""
    data = it.value(op.inputs["quantized_data"]).astype(np.float32)
    zero = np.asarray(it.value(op.inputs["zero_point"]), dtype=np.float32)
    scale = np.asarray(it.value(op.inputs["scale"]), dtype=np.float32)
    axis = int(it.param(op, "axis"))
    shape = [1] * data.ndim
    if scale.ndim == 1 and scale.size > 1:
        shape[axis] = scale.size
        scale = scale.reshape(shape)
    if zero.ndim == 1 and zero.size > 1:
        shape[axis] = zero.size
        zero = zero.reshape(shape)
    return (data - zero) * scale


_KERNELS.update({
    "constexpr_blockwise_shift_scale": _k_constexpr_blockwise_shift_scale,
    "constexpr_lut_to_dense": _k_constexpr_lut_to_dense,
    "constexpr_affine_dequantize": _k_constexpr_affine_dequantize,
})
SUPPORTED_OPS = tuple(sorted(_KERNELS))


# ---- state (iOS 18 stateful programs; anelab.graph.build_stateful_program) -------------------------
# A state is a function input whose value the interpreter keeps in its environment like any other;
# ``coreml_update_state`` overwrites it there (later ``read_state`` ops see the new value) and
# records it in ``updated_states`` so ``evaluate_with_state`` can hand it to the next call.

def _k_read_state(it, op):
    return np.array(it.value(op.inputs["input"]), dtype=np.float32, copy=True)


def _k_coreml_update_state(it, op):
    state, value = op.inputs["state"], np.array(it.value(op.inputs["value"]), copy=True)
    it.env[state.name] = value
    it.__dict__.setdefault("updated_states", {})[state.name] = value
    return value


def _k_slice_update(it, op):
    x = np.array(it.value(op.inputs["x"]), copy=True)
    update = it.value(op.inputs["update"])
    index = _slice_index(it, op, x.shape, name="slice_update")
    target = x[index]
    if target.shape != tuple(update.shape):
        raise AnelabInputError(f"MIL evaluation: slice_update writes {list(update.shape)} into a {list(target.shape)} slice")
    x[index] = update
    return x


_KERNELS.update({
    "read_state": _k_read_state,
    "coreml_update_state": _k_coreml_update_state,
    "slice_update": _k_slice_update,
})
SUPPORTED_OPS = tuple(sorted(_KERNELS))


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


def evaluate_with_state(package: SavedPackage | str | os.PathLike, function: str, inputs: dict[str, np.ndarray],
                        state: dict[str, np.ndarray], *, fp16: bool = True) -> dict[str, np.ndarray]:
    """Run one function of a saved stateful package; ``state`` (name -> array, e.g. from
    ``new_state``) is read and replaced in place by the values the call leaves in it."""
    pkg = package if isinstance(package, SavedPackage) else SavedPackage(package)
    info = pkg.function(function)
    pkg.check_inputs(function, inputs)
    states = state_signatures(pkg, function)
    for name, sig in states.items():
        if name not in state:
            raise AnelabInputError(f"state {name!r} of {function} is missing; create it with new_state()")
        if tuple(state[name].shape) != sig.shape:
            raise AnelabInputError(f"state {name!r} of {function} has shape {list(state[name].shape)}; expected {list(sig.shape)}")
    it = _Interpreter(pkg, pkg.mil_function(function), fp16)
    out = it.run({**inputs, **{n: state[n] for n in states}}, info)
    for name, value in getattr(it, "updated_states", {}).items():
        state[name] = value.astype(np.float16) if (fp16 and states[name].dtype == "float16") else np.array(value, dtype=np.float32)
    return out


def new_state(package: SavedPackage | str | os.PathLike, function: str) -> dict[str, np.ndarray]:
    """Zero-filled states for ``function`` (as ``MLModel.make_state()`` gives a fresh state)."""
    pkg = package if isinstance(package, SavedPackage) else SavedPackage(package)
    return {n: np.zeros(s.shape, dtype=s.dtype) for n, s in state_signatures(pkg, function).items()}


# coremltools' int16 pass casts gather indices to int16 / uint16 (e.g. the stateful graph's RoPE
# positions); those casts are exact only inside the type's range, so out-of-range values are refused.
_NARROW_INTS = {"int16": (-2**15, 2**15 - 1), "uint16": (0, 2**16 - 1), "int8": (-2**7, 2**7 - 1), "uint8": (0, 2**8 - 1)}
_cast_base = _KERNELS["cast"]


def _k_cast_narrow(it, op):
    dtype = it.param(op, "dtype")
    return _cast_checked(it, op, dtype) if dtype in _NARROW_INTS else _cast_base(it, op)


def _cast_checked(it, op, dtype):
    x = it.value(op.inputs["x"])
    lo, hi = _NARROW_INTS[dtype]
    if x.size and (np.min(x) < lo or np.max(x) > hi):
        raise AnelabInputError(f"MIL evaluation: cast of values in [{np.min(x)}, {np.max(x)}] to {dtype} would wrap ({op.name})")
    return np.trunc(x).astype(np.int32)


_KERNELS["cast"] = _k_cast_narrow
SUPPORTED_OPS = tuple(sorted(_KERNELS))
