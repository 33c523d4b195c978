"""Matrix products whose float32 results do not depend on the BLAS kernel or its thread count.

A float32 GEMM through OpenBLAS sums its products in an order its kernel picks (Haswell, SkylakeX, ... and the
number of threads each choose their own blocking), so its last bits differ from one CPU to another. Where anelab
rounds such a result to fp16 (a sidecar's stored intermediates) one value in a few thousand then lands on the
other side of an fp16 rounding boundary, and a difference between two arms moves in its third digit: enough to
move a figure's point. ``matmul`` accumulates in float64 and rounds once, so the float32 result is the exact
product correctly rounded. The one exception: an exact product within the float64 sum's own error (~1e-16 of
it, times the square root of the inner dimension) of a float32 rounding boundary, about one element in 1e7 for
the studies' shapes; that element differs by one float32 last bit, which reaches an fp16 rounding only about
once in 8,000 such elements. Products of float64 operands stay float64 (their last bits, ~1e-16 of a value,
are far below anything drawn).
"""

from __future__ import annotations

import numpy as np


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``a @ b`` (NumPy's broadcasting: a [..., M, K], b [..., K, N] -> [..., M, N]) accumulated in float64.

    The result has NumPy's dtype for ``a @ b`` (float32 operands: float32; either float64: float64), the float64
    product rounded once to it (past float32's range: inf). ``out`` (the result's shape) receives the result,
    rounded to its own dtype.
    """
    a, b = np.asarray(a), np.asarray(b)
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN pass silently, as through a float32 GEMM
        product = np.matmul(a.astype(np.float64, copy=False), b.astype(np.float64, copy=False))
        if out is not None:
            out[...] = product
            return out
        return product.astype(np.result_type(a.dtype, b.dtype), copy=False)
