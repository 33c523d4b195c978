"""core.matmul: a float32 product rounded once from float64 accumulation — the correctly rounded exact product, which
a float32 GEMM is not — with NumPy's dtypes, an ``out`` buffer, and inf/NaN passed as a float32 GEMM passes them."""

from __future__ import annotations

import math
import warnings

import numpy as np

from anelab.core.matmul import matmul


def _exactly_rounded(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Each element: the exact sum of the exact products (float32 x float32 is exact in float64; ``math.fsum`` sums
    exactly and rounds once) rounded to float32."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    out = np.empty((a.shape[0], b.shape[1]), np.float32)
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            out[i, j] = np.float32(math.fsum(a64[i] * b64[:, j]))
    return out


def test_a_float32_product_is_the_exact_product_rounded_once():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((12, 700)).astype(np.float32), rng.standard_normal((700, 9)).astype(np.float32)
    exact = _exactly_rounded(a, b)
    got = matmul(a, b)
    assert got.dtype == np.float32 and np.array_equal(got, exact)
    assert not np.array_equal(a @ b, exact)  # control: a float32 GEMM rounds along its way and misses some


def test_dtypes_batches_and_the_out_buffer():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((3, 5, 64)).astype(np.float32), rng.standard_normal((3, 64, 4)).astype(np.float32)
    assert matmul(a, b).shape == (3, 5, 4) and matmul(a, b).dtype == np.float32
    wide = matmul(a.astype(np.float64), b)
    assert wide.dtype == np.float64 and np.allclose(wide, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-13)
    out = np.full((3, 5, 4), np.nan, np.float32)
    assert matmul(a, b, out=out) is out and np.array_equal(out, matmul(a, b))


def test_inf_and_nan_pass_without_a_warning_as_through_a_float32_gemm():
    a = np.array([[np.inf, 0.0], [3e38, 3e38]], np.float32)
    b = np.array([[1.0], [1.0]], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = matmul(a, b)
        nan = matmul(np.array([[np.inf]], np.float32), np.array([[0.0]], np.float32))
    assert got[0, 0] == np.inf and got[1, 0] == np.inf and np.isnan(nan[0, 0])  # 6e38 is past float32's range
