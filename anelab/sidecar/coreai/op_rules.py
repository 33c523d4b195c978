"""The Core AI lowering's rules, one per MIL op (``LOWERINGS``): each emits the op's Core AI form into the
function being lowered (``coreai_lower.FunctionLowering``, passed in as ``lw``), with the element types and the
drop value the Neural Engine rules ask for (``coreai_lower``'s docstring lists the deviations)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.masks import MASKED
from anelab.sidecar.coremltools_import import coremltools_modules

NE_MASKED = np.float16(-40000.0)  # the rules' drop value: representable in fp16, exp() of it is 0, never -inf

_INT_TYPES = {"int32": np.int16, "int16": np.int16, "uint16": np.uint16, "int8": np.int8, "uint8": np.uint8}


def numpy_dtype(var) -> type:
    """The Core AI element type of a MIL var: fp16 stays fp16, int32 becomes int16 (see the module docstring)."""
    _, _, types = coremltools_modules()
    t = var.dtype
    if t == types.fp16 or t == types.fp32:  # fp32 never reaches the saved fp16 program; if it did: fp16
        return np.float16
    if t == types.bool:
        return np.bool_
    name = types.builtin_to_string(t)
    if name not in _INT_TYPES:
        raise AnelabInputError(
            f"the Core AI lowering has no element type for MIL {name}; re-export with --weights fp16"
        )
    return _INT_TYPES[name]


def static_shape(var) -> tuple[int, ...]:
    shape = tuple(var.shape or ())
    if any(not isinstance(s, (int, np.integer)) for s in shape):
        raise AnelabInputError(f"MIL var {var.name} has a symbolic shape {shape}; Core AI entrypoints are static")
    return tuple(int(s) for s in shape)


# ---- op rules ------------------------------------------------------------------------------------------------
def authoring(lw):
    """coreai's authoring module, as the lowering ``lw`` imported it."""
    return lw.ca.authoring


def shape_of(value) -> tuple[int, ...]:
    return tuple(value.type.shape)


def _binary(plain: str | None, broadcasting: str, swap: bool = False, negate: bool = False):
    """An elementwise MIL binary op: the plain Core AI op when both shapes match, else its broadcasting
    form (``swap``: operands exchanged; ``negate``: logical not of the result, for <= and >=)."""

    def rule(lw, op):
        au = authoring(lw)
        x, y = lw.value(op.inputs["x"]), lw.value(op.inputs["y"])
        if swap:
            x, y = y, x
        same = plain is not None and shape_of(x) == shape_of(y)
        out = getattr(au, plain if same else broadcasting)(x, y)
        return au.not_(out) if negate else out

    return rule


def _unary(name: str):
    return lambda lw, op: getattr(authoring(lw), name)(lw.value(op.inputs["x"]))


def _epsilon(lw, op, default: float):
    return lw.constant(np.array(lw.param(op, "epsilon", default), np.float16))


def _l_rsqrt(lw, op):
    au = authoring(lw)
    return au.rsqrt(au.broadcasting_add(lw.value(op.inputs["x"]), _epsilon(lw, op, 1e-12)))


def _l_inverse(lw, op):
    au = authoring(lw)
    shifted = au.broadcasting_add(lw.value(op.inputs["x"]), _epsilon(lw, op, 1e-4))
    return au.broadcasting_divide(lw.constant(np.array(1.0, np.float16)), shifted)


def _l_square(lw, op):
    x = lw.value(op.inputs["x"])
    return authoring(lw).mul(x, x)


def _matmul(lw, x, y):
    """x [..., M, K] @ y [..., K, N]: ``batch_matmul`` when the batch dims match, else the broadcasting form."""
    au = authoring(lw)
    same = shape_of(x)[:-2] == shape_of(y)[:-2] and len(shape_of(x)) >= 2 and len(shape_of(y)) >= 2
    return au.batch_matmul(x, y) if same else au.broadcasting_batch_matmul(x, y)


def _swap_last(lw, value):
    rank = len(shape_of(value))
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    return authoring(lw).transpose(value, np.array(perm, np.uint32))


def _l_linear(lw, op):
    """x [..., I] @ W^T + b: the weight [O, I] is stored transposed ([I, O]) once for every function."""
    au = authoring(lw)
    x = lw.value(op.inputs["x"])
    w = lw.const_array(op.inputs["weight"])
    y = _matmul(lw, x, lw.constant(np.ascontiguousarray(w.T)))
    if "bias" in op.inputs:
        y = au.broadcasting_add(y, lw.value(op.inputs["bias"]))
    return y


def _l_matmul(lw, op):
    def operand(name, flag):
        var = op.inputs[name]
        if bool(lw.param(op, flag, False)):
            if var.val is not None:  # a constant is transposed once, in NumPy
                return lw.constant(np.swapaxes(lw.const_array(var), -1, -2))
            return _swap_last(lw, lw.value(var))
        return lw.value(var)

    return _matmul(lw, operand("x", "transpose_x"), operand("y", "transpose_y"))


def _l_reduce(name: str):
    def rule(lw, op):
        au = authoring(lw)
        x = lw.value(op.inputs["x"])
        axes = lw.param(op, "axes")
        axes = list(range(len(shape_of(x)))) if axes is None else [int(a) for a in np.atleast_1d(axes)]
        out = getattr(au, name)(x, np.array(axes, np.int32))  # Core AI keeps the reduced dims
        if not bool(lw.param(op, "keep_dims", False)):
            out = au.reshape(out, np.array(static_shape(op.outputs[0]), np.int32))
        return out

    return rule


def _to_shape(lw, op):
    """reshape / squeeze / identity-like ops: the MIL output's static shape."""
    return authoring(lw).reshape(lw.value(op.inputs["x"]), np.array(static_shape(op.outputs[0]), np.int32))


def _l_transpose(lw, op):
    return authoring(lw).transpose(lw.value(op.inputs["x"]), np.array(lw.param(op, "perm"), np.uint32))


def _l_concat(lw, op):
    values = [lw.value(v) for v in op.inputs["values"]]
    if len(values) == 1:
        return values[0]
    return authoring(lw).concat(np.array(int(lw.param(op, "axis")), np.int32), values)


def _l_split(lw, op):
    x = lw.value(op.inputs["x"])
    axis = int(lw.param(op, "axis"))
    sizes = [static_shape(v)[axis] for v in op.outputs]
    return authoring(lw).split(x, np.array(sizes, np.uint32), np.array(axis, np.int32))


def _l_expand_dims(lw, op):
    axes = [int(a) for a in np.atleast_1d(lw.param(op, "axes"))]
    return authoring(lw).expand_dims(lw.value(op.inputs["x"]), np.array(axes, np.int32))


def _l_softmax(lw, op):
    return authoring(lw).softmax(lw.value(op.inputs["x"]), np.array(int(lw.param(op, "axis", -1)), np.int32))


def _l_cast(lw, op):
    """cast: an int32 <-> int16 cast of the Core ML graph is the identity here (both are int16)."""
    target = numpy_dtype(op.outputs[0])
    if target is numpy_dtype(op.inputs["x"]):
        return lw.value(op.inputs["x"])
    return authoring(lw).cast(lw.value(op.inputs["x"]), target)


def _l_tile(lw, op):
    return authoring(lw).tile(lw.value(op.inputs["x"]), np.array(lw.param(op, "reps"), np.uint32))


def _l_clip(lw, op):
    au = authoring(lw)
    x = au.broadcasting_maximum(lw.value(op.inputs["x"]), lw.value(op.inputs["alpha"]))
    return au.broadcasting_minimum(x, lw.value(op.inputs["beta"]))


def _l_select(lw, op):
    """select(cond, a, b): a drop value of ``masks.MASKED`` becomes ``NE_MASKED`` (an in-graph mask)."""
    au = authoring(lw)
    b_var = op.inputs["b"]
    if b_var.val is not None and np.size(b_var.val) == 1 and np.float16(np.asarray(b_var.val).item()) == MASKED:
        lw.notes.mask_fills += 1
        b = lw.constant(np.array(NE_MASKED, np.float16))
    else:
        b = lw.value(b_var)
    cond, a = lw.value(op.inputs["cond"]), lw.value(op.inputs["a"])
    same = shape_of(cond) == shape_of(a) == shape_of(b)
    return (au.where if same else au.broadcasting_where)(cond, a, b)


def _l_gather(lw, op):
    """gather(x, indices, axis): indices flattened, broadcast to x's rank, ``gather_along_axis``, reshaped."""
    au = authoring(lw)
    x, idx = lw.value(op.inputs["x"]), lw.value(op.inputs["indices"])
    if numpy_dtype(op.inputs["indices"]) is not np.int16:  # Core AI gathers by signed index tensors
        idx = au.cast(idx, np.int16)
    if int(lw.param(op, "batch_dims", 0)) != 0:
        raise AnelabInputError(f"{lw.name}: gather {op.name} with batch_dims is not lowered")
    shape, axis = list(shape_of(x)), int(lw.param(op, "axis", 0)) % len(shape_of(x))
    count = math.prod(shape_of(idx)) if shape_of(idx) else 1
    lead = [1] * axis + [count] + [1] * (len(shape) - axis - 1)
    flat = au.reshape(idx, np.array(lead, np.int32))
    target = shape[:axis] + [count] + shape[axis + 1 :]
    wide = au.broadcast_to(flat, np.array(target, np.int32))
    out = au.gather_along_axis(x, wide, np.array(axis, np.int32))
    return au.reshape(out, np.array(static_shape(op.outputs[0]), np.int32))


def _slice_bounds(lw, op, shape: tuple[int, ...]):
    """(begin, end, stride) of a slice_by_index / slice_update: constants resolved with their masks into
    index arrays; a runtime begin / end stays a Value (its masked entries replaced by their static bound)."""
    au = authoring(lw)
    rank = len(shape)
    stride = np.asarray(lw.param(op, "stride", [1] * rank), np.int64)
    bmask = np.asarray(lw.param(op, "begin_mask", [False] * rank), bool)
    emask = np.asarray(lw.param(op, "end_mask", [False] * rank), bool)
    ends_at = np.array([n if s > 0 else -(n + 1) for n, s in zip(shape, stride, strict=True)])
    begins_at = np.array([0 if s > 0 else n - 1 for n, s in zip(shape, stride, strict=True)])

    def bound(name, mask, static):
        var = op.inputs.get(name)
        if var is not None and var.val is None:  # a runtime bound (the stateful cache update)
            value = lw.value(var)
            if mask.any():
                value = au.where(lw.constant(mask), lw.constant(static.astype(np.int16)), value)
            return value
        given = np.zeros(rank, np.int64) if var is None else np.asarray(var.val, np.int64)
        return np.where(mask, static, given)

    begin, end = bound("begin", bmask, begins_at), bound("end", emask, ends_at)
    return begin, end, stride


def _index_dtype(*bounds):
    """int16 for the bounds when a runtime one is int16, else int32 constants (static parameters)."""
    runtime = [b for b in bounds if not isinstance(b, np.ndarray)]
    return (np.int16 if runtime else np.int32), runtime


def _as_index(lw, bound, dtype):
    return lw.constant(bound.astype(dtype)) if isinstance(bound, np.ndarray) else bound


def _l_slice_by_index(lw, op):
    au = authoring(lw)
    x = lw.value(op.inputs["x"])
    begin, end, stride = _slice_bounds(lw, op, shape_of(x))
    dtype, _ = _index_dtype(begin, end)
    out = au.slice_(x, _as_index(lw, begin, dtype), _as_index(lw, end, dtype), lw.constant(stride.astype(dtype)))
    if any(np.atleast_1d(lw.param(op, "squeeze_mask", [False]))):
        out = au.reshape(out, np.array(static_shape(op.outputs[0]), np.int32))
    return out


def _l_slice_update(lw, op):
    """slice_update with int32 bounds: coreai-core 1.0.0b3's CPU runtime aborts the process on int16 ones
    ("Fatal error: Type Int32 does not match scalar type Optional(Swift.Int16)"), so runtime bounds are
    cast back to int32 here (the only int32 tensors of the asset besides the start input)."""
    au = authoring(lw)
    x, update = lw.value(op.inputs["x"]), lw.value(op.inputs["update"])
    begin, end, stride = _slice_bounds(lw, op, shape_of(x))
    wide = [b if isinstance(b, np.ndarray) else au.cast(b, np.int32) for b in (begin, end)]
    lw.notes.int32_slice_bounds += sum(not isinstance(b, np.ndarray) for b in (begin, end))
    begin, end = (_as_index(lw, b, np.int32) for b in wide)
    return au.slice_update(x, begin, end, lw.constant(stride.astype(np.int32)), update)


def _l_read_state(lw, op):
    """The state's current value, read through its handle's token chain."""
    name = op.inputs["input"].name
    dialect = lw.ca.dialect
    token = lw.tokens.get(name) or dialect.create_token()
    value, lw.tokens[name] = dialect.read_handle(lw.handles[name], token)
    return lw.ca.authoring.Value._from_mlir(value)


def _l_update_state(lw, op):
    """Write the new value into the state; later ops use the written value itself (as Core ML's does)."""
    name = op.inputs["state"].name
    dialect = lw.ca.dialect
    value = lw.value(op.inputs["value"])
    token = lw.tokens.get(name) or dialect.create_token()
    lw.tokens[name] = dialect.write_handle(lw.handles[name], value._to_mlir(), token)
    return value


LOWERINGS: dict[str, Callable] = {  # MIL op name -> rule(lowering, op) -> Core AI value(s)
    "linear": _l_linear,
    "matmul": _l_matmul,
    "add": _binary("add", "broadcasting_add"),
    "sub": _binary("sub", "broadcasting_sub"),
    "mul": _binary("mul", "broadcasting_mul"),
    "real_div": _binary("divide", "broadcasting_divide"),
    "maximum": _binary("maximum", "broadcasting_maximum"),
    "minimum": _binary("minimum", "broadcasting_minimum"),
    "floor_div": _binary("floor_divide", "broadcasting_floor_divide"),
    "pow": _binary("pow_", "broadcasting_pow"),
    "greater": _binary("greater", "broadcasting_greater"),
    "less": _binary("greater", "broadcasting_greater", swap=True),
    "greater_equal": _binary("greater", "broadcasting_greater", swap=True, negate=True),
    "less_equal": _binary("greater", "broadcasting_greater", negate=True),
    "equal": _binary("equal", "broadcasting_equal"),
    "not_equal": _binary("not_equal", "broadcasting_not_equal"),
    "logical_and": _binary("and_", "broadcasting_and"),
    "logical_or": _binary("or_", "broadcasting_or"),
    "abs": _unary("abs_"),
    "exp": _unary("exp"),
    "sqrt": _unary("sqrt"),
    "sigmoid": _unary("sigmoid"),
    "tanh": _unary("tanh"),
    "silu": _unary("silu"),
    "square": _l_square,
    "inverse": _l_inverse,
    "rsqrt": _l_rsqrt,
    "reduce_max": _l_reduce("reduce_max"),
    "reduce_min": _l_reduce("reduce_min"),
    "reduce_mean": _l_reduce("reduce_mean"),
    "reduce_sum": _l_reduce("reduce_sum"),
    "reshape": _to_shape,
    "squeeze": _to_shape,
    "identity": lambda lw, op: lw.value(op.inputs["x"]),
    "transpose": _l_transpose,
    "concat": _l_concat,
    "split": _l_split,
    "slice_by_index": _l_slice_by_index,
    "slice_update": _l_slice_update,
    "softmax": _l_softmax,
    "expand_dims": _l_expand_dims,
    "cast": _l_cast,
    "gather": _l_gather,
    "tile": _l_tile,
    "select": _l_select,
    "clip": _l_clip,
    "read_state": _l_read_state,
    "coreml_update_state": _l_update_state,
}
