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
_FP16_LIMIT = np.float32(65519.99)  # the largest float32 that fp16 storage keeps finite (rounds to 65504)
_EXP_MASK = np.int32(0x7F800000)
_MIN_NORMAL_EXP = np.int32((127 - 14) << 23)  # fp16's smallest normal exponent, 2**-14
_SHIFT = np.int32((13 << 23) | 0x00400000)  # * 2**13, and the 1.5 mantissa
ROUNDING_BLOCK = 1 << 17  # elements rounded per block (512 kB of float32 + 512 kB of scratch: stays in cache)
_MAX_EXP = np.int32((0x7F000000 | 0x00400000) - _SHIFT)  # so that c + _SHIFT <= 1.5 * 2**127


def round_to_fp16(x: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """Round a float32 array in place to fp16 precision; returns ``x``.

    ``scratch``: optional int32 array of at least min(x.size, ROUNDING_BLOCK) elements, reused to avoid
    an allocation. A large array is rounded ``ROUNDING_BLOCK`` elements at a time, so the five passes
    of each block run in cache and the array itself is streamed through memory once.
    """
    if x.dtype != np.float32:
        raise TypeError(f"round_to_fp16 needs float32, got {x.dtype}")
    if not x.flags.c_contiguous:
        x[...] = x.astype(np.float16)
        return x
    flat = x.reshape(-1)
    block = min(flat.size, ROUNDING_BLOCK)
    if scratch is None or scratch.size < block:
        scratch = np.empty(block, dtype=np.int32)
    for start in range(0, flat.size, block):
        part = flat[start : start + block]
        _round_block(part, scratch[: part.size])
    return x


def _round_block(x: np.ndarray, scratch: np.ndarray) -> None:
    """round_to_fp16 on one contiguous 1-D float32 block, with an int32 scratch of its size."""
    c = np.bitwise_and(x.view(np.int32), _EXP_MASK, out=scratch)
    # np.clip on int32 is vectorised (np.maximum with a scalar is not); the upper clamp keeps c + _SHIFT
    # inside fp32's range: exponents that large only arise for |x| >= 2**114, far beyond fp16
    np.clip(c, _MIN_NORMAL_EXP, _MAX_EXP, out=c)
    np.add(c, _SHIFT, out=c)
    cf = c.view(np.float32)
    np.add(x, cf, out=x)
    np.subtract(x, cf, out=x)


def clip_overflow(x: np.ndarray) -> np.ndarray:
    """Values past fp16's range become +-inf (what storing them as fp16 does); in place."""
    if x.size == 0 or (x.max() <= _FP16_LIMIT and x.min() >= -_FP16_LIMIT):  # two fast reductions; NaN falls through
        return x
    big = np.abs(x) > _FP16_LIMIT
    x[big] = np.copysign(np.float32(np.inf), x[big])
    return x


def to_fp16_precision(x: np.ndarray) -> np.ndarray:
    """A float32 copy of ``x`` holding exactly what fp16 storage would hold."""
    out = np.array(x, dtype=np.float32, copy=True)
    return clip_overflow(round_to_fp16(out))
