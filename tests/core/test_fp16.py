"""fp16 storage emulation must equal a real float16 round trip, bit for bit."""

import numpy as np

from anelab.core.fp16 import round_to_fp16, to_fp16_precision


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


# ---- the evaluator's per-op fp16 rounding, tested directly ----------------------------------------------------
def _add_then_subtract_one(tmp_path, n: int):
    """A saved program y = (x + 1) - 1 over fp16 x [n]: stored in fp16, x + 1 keeps only x's bits above
    2**-10, so y differs from x wherever x has lower bits."""
    from anelab.sidecar.coremltools_import import coremltools_modules
    from anelab.sidecar.export import convert_program
    from anelab.sidecar.mil.evaluate import SavedPackage

    ct, mb, types = coremltools_modules()

    @mb.program(input_specs=[mb.TensorSpec((n,), types.fp16)], opset_version=ct.target.iOS18)
    def prog(x):
        one = np.float16(1.0)
        return mb.sub(x=mb.add(x=x, y=one, name="x_plus_one"), y=one, name="y")

    return SavedPackage(convert_program(prog, tmp_path / "add_sub.mlpackage"))


def test_the_evaluator_rounds_every_fp16_op_result(tmp_path, monkeypatch):
    """Each op's fp16 result is rounded before the next op reads it: the evaluation equals NumPy's float16
    arithmetic step by step (each op computed exactly, then rounded), bit for bit. Negative controls: the
    same program with fp16=False, and with the evaluator's rounding switched off, both miss it."""
    from anelab.sidecar.mil import evaluate as evaluator

    x = np.random.default_rng(0).uniform(1e-4, 1e-2, 64).astype(np.float16)
    saved = _add_then_subtract_one(tmp_path, x.size)
    one = np.float16(1.0)
    expected = (x + one) - one  # float16 + float16 in NumPy: the exact sum rounded to fp16, per op
    assert np.count_nonzero(expected != x) > 48  # the intermediate rounding is visible at the output
    got = evaluator.evaluate(saved, "main", {"x": x})["y"]
    assert got.dtype == np.float16 and np.array_equal(got, expected)
    unrounded = evaluator.evaluate(saved, "main", {"x": x}, fp16=False)["y"]
    assert not np.array_equal(unrounded.astype(np.float16), expected)
    np.testing.assert_allclose(unrounded, x.astype(np.float32), rtol=1e-4)
    monkeypatch.setattr(evaluator, "round_to_fp16", lambda a, scratch=None: a)  # the rounding switched off
    assert not np.array_equal(evaluator.evaluate(saved, "main", {"x": x})["y"], expected)
