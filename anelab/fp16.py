"""Fast fp16 storage emulation on float32 arrays.

``round_to_fp16(x)`` rounds float32 values in place to the nearest fp16-representable value
(round-to-nearest-even, fp16 subnormals included, overflow to +-inf) while keeping the float32
dtype, so BLAS and ufuncs keep working in fp32 between roundings. It is equivalent to
``x.astype(np.float16).astype(np.float32)`` (tested bit for bit on every nonzero result; a result
of zero may lose its sign, which no op here can observe) but several times faster: the
rounding constant 1.5 * 2**(e + 13) is built from each value's exponent (clamped at fp16's smallest
normal exponent), and ``(x + c) - c`` then drops exactly the bits fp16 cannot hold.
"""

from __future__ import annotations

import numpy as np

FP16_MAX = 65504.0
_EXP_MASK = np.int32(0x7F800000)
_MIN_NORMAL_EXP = np.int32((127 - 14) << 23)  # fp16's smallest normal exponent, 2**-14
_SHIFT = np.int32((13 << 23) | 0x00400000)  # * 2**13, and the 1.5 mantissa


def round_to_fp16(x: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """Round a float32 array in place to fp16 precision; returns ``x``.

    ``scratch``: optional int32 array of x's size, reused to avoid an allocation.
    """
    if x.dtype != np.float32:
        raise TypeError(f"round_to_fp16 needs float32, got {x.dtype}")
    if not x.flags.c_contiguous:
        x[...] = x.astype(np.float16)
        return x
    bits = x.view(np.int32)
    c = np.bitwise_and(bits, _EXP_MASK, out=scratch.reshape(x.shape) if scratch is not None else None)
    np.maximum(c, _MIN_NORMAL_EXP, out=c)
    np.add(c, _SHIFT, out=c)
    # exponents past fp32's range only arise for |x| >= 2**114, far beyond fp16: clamp instead of wrapping
    np.minimum(c, np.int32(0x7F000000 | 0x00400000), out=c)
    cf = c.view(np.float32)
    np.add(x, cf, out=x)
    np.subtract(x, cf, out=x)
    return x


def clip_overflow(x: np.ndarray) -> np.ndarray:
    """Values past fp16's range become +-inf (what storing them as fp16 does); in place."""
    big = np.abs(x) > np.float32(65519.99)
    if big.any():
        x[big] = np.copysign(np.float32(np.inf), x[big])
    return x


def to_fp16_precision(x: np.ndarray) -> np.ndarray:
    """A float32 copy of ``x`` holding exactly what fp16 storage would hold."""
    out = np.array(x, dtype=np.float32, copy=True)
    return clip_overflow(round_to_fp16(out))
