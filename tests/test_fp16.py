"""fp16 storage emulation must equal a real float16 round trip, bit for bit."""

import numpy as np

from anelab.fp16 import round_to_fp16, to_fp16_precision


def _edge_and_random():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(200_000) * np.exp(rng.uniform(-25, 12, 200_000))).astype(np.float32)
    edges = [
        0.0,
        -0.0,
        65504.0,
        65519.0,
        65520.0,
        -70000.0,
        1e-8,
        2.0**-24,
        2.0**-25,
        3 * 2.0**-26,
        2.0**-14,
        2.0**-14 * (1 + 2.0**-11),
        1 + 2.0**-11,
        1 + 3 * 2.0**-11,
        1e30,
        -1e38,
        np.inf,
        -np.inf,
    ]
    return np.concatenate([np.array(edges, np.float32), x])


def test_matches_float16_round_trip_bit_for_bit():
    x = _edge_and_random()
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16).astype(np.float32)
    got = to_fp16_precision(x)
    assert np.array_equal(got, expected)  # values (a signed zero may come back as +0)
    nonzero = expected != 0
    assert np.array_equal(got[nonzero].view(np.int32), expected[nonzero].view(np.int32))  # and bits


def test_round_to_fp16_is_in_place_and_changes_values():
    x = np.array([1 + 2.0**-12, 1 + 3 * 2.0**-12, 0.1], np.float32)
    before = x.copy()
    out = round_to_fp16(x)
    assert out is x
    assert not np.array_equal(before, x)  # these values are not fp16-representable
    assert x[0] == 1.0 and x[1] == 1 + 2.0**-10  # ties to even: 1+2^-12 -> 1, 1+3*2^-12 -> 1+2^-10


def test_truncation_would_be_caught():
    """Negative control: chopping mantissa bits (no rounding) differs from fp16 rounding."""
    x = _edge_and_random()[18:]
    chopped = (x.view(np.int32) & np.int32(~0x1FFF)).view(np.float32)
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16).astype(np.float32)
    assert not np.array_equal(chopped, expected)
