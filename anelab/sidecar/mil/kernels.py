"""NumPy kernels for the MIL ops a sidecar uses: one public table, ``KERNELS``."""

from __future__ import annotations

import contextlib
import os

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.matmul import matmul
from anelab.core.parallel import THREAD_CAP_VARIABLES

# A GEMM below this many FLOPs runs on one BLAS thread: waking OpenBLAS's other threads costs more than
# they save (measured: a 8 MFLOP matmul took 8.2 ms on 2 threads and 0.7 ms on one on a busy 2-core machine).
SMALL_GEMM_FLOPS = 1 << 27
_controller = []


MAX_WORKERS = 8  # fused attention tiles run on up to this many threads


def worker_count(items: int) -> int:
    """Threads for ``items`` independent tiles: at most the cores, MAX_WORKERS, and the BLAS thread cap
    the process was started with (e.g. ``OPENBLAS_NUM_THREADS=1`` for a notebook sharing the machine)."""
    caps = [os.cpu_count() or 1, MAX_WORKERS, max(items, 1)]
    for name in THREAD_CAP_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            caps.append(int(value))
    return min(caps)


def _blas_threads(flops: float):
    """Context: one BLAS thread for a small GEMM, the default otherwise."""
    if flops >= SMALL_GEMM_FLOPS:
        return contextlib.nullcontext()
    if not _controller:
        from threadpoolctl import ThreadpoolController

        _controller.append(ThreadpoolController())
    return _controller[0].limit(limits=1, user_api="blas")


def _k_linear(it, op):
    x = it.value(op.inputs["x"])
    w = it.value(op.inputs["weight"])
    with _blas_threads(2.0 * x.size * w.shape[0]):
        y = matmul(x, w.T)
    if "bias" in op.inputs:
        y += it.value(op.inputs["bias"])
    return y


def _k_matmul(it, op):
    x, y = it.value(op.inputs["x"]), it.value(op.inputs["y"])
    if it.param(op, "transpose_x", False):
        x = np.swapaxes(x, -1, -2)
    if it.param(op, "transpose_y", False):
        y = np.swapaxes(y, -1, -2)
    batch = (
        np.prod(np.broadcast_shapes(x.shape[:-2], y.shape[:-2]), dtype=np.float64) if x.ndim > 2 or y.ndim > 2 else 1
    )
    with _blas_threads(2.0 * batch * x.shape[-2] * x.shape[-1] * y.shape[-1]):
        return matmul(x, y)


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
    return it.raw(op.inputs["x"]).reshape(shape)


def _k_transpose(it, op):
    return np.ascontiguousarray(np.transpose(it.raw(op.inputs["x"]), [int(p) for p in it.param(op, "perm")]))


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
            raise AnelabInputError(
                f"MIL evaluation: slice_update [{start}, {stop}) is outside axis {i} of size {shape[i]}"
            )
        index.append(slice(start, stop, int(stride[i])))
    return tuple(index)


def _k_slice_by_index(it, op):
    x = it.raw(op.inputs["x"])
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
    x = it.raw(op.inputs["x"])
    for a in sorted(int(a) for a in np.atleast_1d(it.param(op, "axes"))):
        x = np.expand_dims(x, a if a >= 0 else x.ndim + 1 + a)
    return x


def _k_squeeze(it, op):
    axes = _axes(it, op)
    return np.squeeze(it.value(op.inputs["x"]), axis=axes)


def _k_rsqrt(it, op):
    x = it.value(op.inputs["x"])
    return 1.0 / np.sqrt(x + np.float32(it.param(op, "epsilon", 1e-12)))


# coremltools' int16 pass casts gather indices to int16 / uint16 (e.g. the stateful graph's RoPE
# positions); those casts are exact only inside the type's range, so out-of-range values are refused.
NARROW_INTS = {
    "int16": (-(2**15), 2**15 - 1),
    "uint16": (0, 2**16 - 1),
    "int8": (-(2**7), 2**7 - 1),
    "uint8": (0, 2**8 - 1),
}
_CAST_TYPES = {"fp16": np.float32, "fp32": np.float32, "int32": np.int32, "bool": bool}


def _k_cast(it, op):
    """fp16/fp32 stay float32 (fp16 storage is emulated by the interpreter); a narrowing integer
    cast is refused when a value falls outside the narrow type (it would wrap on the device)."""
    dtype = it.param(op, "dtype")
    x = it.value(op.inputs["x"])
    if dtype in NARROW_INTS:
        lo, hi = NARROW_INTS[dtype]
        if x.size and (np.min(x) < lo or np.max(x) > hi):
            raise AnelabInputError(
                f"MIL evaluation: cast of values in [{np.min(x)}, {np.max(x)}] to {dtype} would wrap ({op.name})"
            )
        return np.trunc(x).astype(np.int32)
    return x.astype(_CAST_TYPES[dtype])


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


def _block_expand(small: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Repeat a per-block array [n0, n1, ...] to ``shape`` (block size = shape[i] / n_i per axis)."""
    out = small
    for axis, (n, full) in enumerate(zip(small.shape, shape)):
        if full % n:
            raise AnelabInputError(
                f"MIL evaluation: block count {n} does not divide dimension {full}; the package is malformed"
            )
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


def _k_read_state(it, op):
    """The state's current value as stored (fp16 for an fp16 state), not a copy: ``slice_update``
    copies it unless nothing else can still see it (``Interpreter.owns``)."""
    return it.raw(op.inputs["input"])


def _k_coreml_update_state(it, op):
    state, value = op.inputs["state"], it.raw(op.inputs["value"])
    it.env[state.name] = value
    it.updated_states[state.name] = value
    return value


def _k_slice_update(it, op):
    """x with x[begin:end] = update; in place when x's value has no other viewer (a state read only
    for this update), else on a copy — a read that later ops still use keeps its old values."""
    x = it.raw(op.inputs["x"]) if it.owns(op.inputs["x"]) else np.array(it.raw(op.inputs["x"]), copy=True)
    update = it.value(op.inputs["update"])
    index = _slice_index(it, op, x.shape, name="slice_update")
    target = x[index]
    if target.shape != tuple(update.shape):
        raise AnelabInputError(
            f"MIL evaluation: slice_update writes {list(update.shape)} into a {list(target.shape)} slice"
        )
    x[index] = update
    return x


GELU_TANH_C = float(np.sqrt(2.0 / np.pi))  # MIL gelu TANH_APPROXIMATION: 0.5 x (1 + tanh(c (x + 0.044715 x^3)))


def _k_gelu(it, op):
    """MIL ``gelu`` in its TANH_APPROXIMATION mode (the Gemma MLP's); EXACT and SIGMOID_APPROXIMATION refused."""
    mode = str(it.param(op, "mode", "EXACT"))
    if mode != "TANH_APPROXIMATION":
        raise AnelabInputError(f"MIL evaluation: gelu mode {mode} is not evaluated (only TANH_APPROXIMATION)")
    x = it.value(op.inputs["x"])
    return 0.5 * x * (1.0 + np.tanh(np.float32(GELU_TANH_C) * (x + np.float32(0.044715) * x * x * x)))


KERNELS = {  # MIL op name -> kernel(interpreter, op) -> float32/int32 array
    "linear": _k_linear,
    "matmul": _k_matmul,
    "add": _binary(np.add),
    "sub": _binary(np.subtract),
    "mul": _binary(np.multiply),
    "real_div": _binary(np.divide),
    "maximum": _binary(np.maximum),
    "minimum": _binary(np.minimum),
    "pow": _binary(np.power),
    "floor_div": _binary(np.floor_divide),
    "greater": _binary(np.greater),
    "less": _binary(np.less),
    "less_equal": _binary(np.less_equal),
    "greater_equal": _binary(np.greater_equal),
    "equal": _binary(np.equal),
    "logical_and": _binary(np.logical_and),
    "logical_or": _binary(np.logical_or),
    "abs": _unary(np.abs),
    "exp": _unary(np.exp),
    "sqrt": _unary(np.sqrt),
    "square": _unary(np.square),
    "sigmoid": _unary(lambda x: 1.0 / (1.0 + np.exp(-x))),
    "tanh": _unary(np.tanh),
    "silu": _unary(lambda x: x / (1.0 + np.exp(-x))),
    "gelu": _k_gelu,
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
        it.value(op.inputs["x"]), it.value(op.inputs["indices"]).astype(np.int64), axis=int(it.param(op, "axis", 0))
    ),
    "tile": _k_tile,
    "select": _k_select,
    "clip": _k_clip,
    "identity": _unary(lambda x: x),
    "constexpr_blockwise_shift_scale": _k_constexpr_blockwise_shift_scale,
    "constexpr_lut_to_dense": _k_constexpr_lut_to_dense,
    "constexpr_affine_dequantize": _k_constexpr_affine_dequantize,
    "read_state": _k_read_state,
    "coreml_update_state": _k_coreml_update_state,
    "slice_update": _k_slice_update,
}
SUPPORTED_OPS = tuple(sorted(KERNELS))
