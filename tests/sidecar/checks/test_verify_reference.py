"""verify's cheaper reference: fp32 with its own fp64 error measured, first-rows runs, the partial chunk
taken from the full chunk's reference, timings and the progress-independent report."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY_GEOMETRIES

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core import fp16
from anelab.core.errors import AnelabInputError
from anelab.core.masks import causal
from anelab.sidecar.checks import comparison as compare
from anelab.sidecar.checks import verify_cases as verify_module
from anelab.sidecar.checks.comparison import (
    REFERENCE_ERROR_BOUND,
    random_function_inputs,
    reference_error,
    relative_error,
    run_reference,
)
from anelab.sidecar.checks.verify import verify_package
from anelab.sidecar.export import export_sidecars

VARIANT = "qwen3_next"
CHUNK, HISTORY = 16, 16


@pytest.fixture(scope="module")
def case(tiny_checkpoint):
    ckpt = load_checkpoint(tiny_checkpoint(VARIANT))
    g = TINY_GEOMETRIES[VARIANT]
    weights = ckpt.layer(g.full_attention_layers[0])
    inputs = random_function_inputs(f"h{HISTORY}", CHUNK, weights, g, np.random.default_rng(3))
    return inputs, weights, g


def test_first_rows_run_equals_the_full_runs_first_rows(case):
    inputs, weights, g = case
    mask = causal(CHUNK, HISTORY)
    full = run_reference(inputs, weights, g, mask)
    first = run_reference(inputs, weights, g, mask, rows=5)
    assert first.attn_out.shape == (5, g.hidden_size) and first.k_chunk.shape[1] == 5
    assert relative_error(first.attn_out, full.attn_out[:5]) < 1e-13
    assert relative_error(first.k_chunk, full.k_chunk[:, :5]) < 1e-13
    # negative control: the same rows with the RoPE start moved differ
    moved = run_reference(inputs, weights, g, mask, rows=5, start=HISTORY + 1)
    assert relative_error(moved.k_chunk, full.k_chunk[:, :5]) > 1e-2


def test_first_rows_run_is_refused_when_a_row_sees_a_later_row(case):
    inputs, weights, g = case
    mask = np.zeros((CHUNK, HISTORY + CHUNK), np.float16)  # every row sees every key
    with pytest.raises(AnelabInputError, match="later row"):
        run_reference(inputs, weights, g, mask, rows=5)


def test_fp32_reference_error_is_tiny_and_an_fp16_reference_would_not_be(case):
    inputs, weights, g = case
    mask = causal(CHUNK, HISTORY)
    rows, errors = reference_error(inputs, weights, g, mask, run_reference(inputs, weights, g, mask, precision="fp32"))
    assert rows == CHUNK
    assert 0 < max(errors.values()) < REFERENCE_ERROR_BOUND / 10
    # negative control: a reference stored at fp16 precision fails the bound
    exact = run_reference(inputs, weights, g, mask)
    rounded = type(exact)(
        *(fp16.to_fp16_precision(a.astype(np.float32)) for a in (exact.attn_out, exact.k_chunk, exact.v_chunk))
    )
    assert max(reference_error(inputs, weights, g, mask, rounded)[1].values()) > REFERENCE_ERROR_BOUND


def test_partial_chunk_reference_is_the_full_chunks_first_rows(case):
    """What verify uses for a partial chunk equals a reference run on the padded rows."""
    inputs, weights, g = case
    n = verify_module.partial_rows(CHUNK)
    padded = inputs.hidden.copy()
    padded[n:] = 0
    mask, pmask = causal(CHUNK, HISTORY), causal(CHUNK, HISTORY, valid_rows=n)
    full = run_reference(inputs, weights, g, mask)
    taken = verify_module._partial_reference(inputs, weights, g, mask, pmask, full, padded, n, "fp64")
    padded_run = run_reference(inputs, weights, g, pmask, hidden=padded)
    assert relative_error(taken.attn_out, padded_run.attn_out[:n]) < 1e-13
    assert relative_error(taken.v_chunk, padded_run.v_chunk[:, :n]) < 1e-13
    # a mask under which real rows see the padding is not taken from the full run
    seeing = pmask.copy()
    seeing[:n, HISTORY + n :] = 0
    other = verify_module._partial_reference(inputs, weights, g, mask, seeing, full, padded, n, "fp64")
    assert relative_error(other.attn_out, taken.attn_out) > 1e-3


def test_rounding_in_blocks_is_bit_exact_across_block_edges(monkeypatch):
    monkeypatch.setattr(fp16, "ROUNDING_BLOCK", 1000)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(10_500) * np.exp(rng.uniform(-20, 12, 10_500))).astype(np.float32)
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16).astype(np.float32)
    got = fp16.clip_overflow(fp16.round_to_fp16(x.copy(), np.empty(1000, np.int32)))
    nonzero = expected != 0
    assert np.array_equal(got[nonzero].view(np.int32), expected[nonzero].view(np.int32))
    assert not np.array_equal(x, got)  # negative control: rounding changed values


@pytest.fixture(scope="module")
def package(tiny_checkpoint, tmp_path_factory):
    ckpt = load_checkpoint(tiny_checkpoint(VARIANT))  # opened once: every test here verifies against it
    layer = TINY_GEOMETRIES[VARIANT].full_attention_layers[0]
    [result] = export_sidecars(ckpt, tmp_path_factory.mktemp("verify-ref"), 8, [0, 8], [layer])
    return ckpt, result.package


def test_verify_reports_reference_precision_its_own_error_and_timings(package):
    ckpt, pkg = package
    report = verify_package(pkg, ckpt)
    assert report.passed, report.table()
    assert report.reference_precision == "fp32"
    assert [r["function"] for r in report.reference_checks] == ["h0", "h8"]
    assert all(max(r["errors"].values()) < REFERENCE_ERROR_BOUND for r in report.reference_checks)
    d = report.to_dict()
    assert {"package", "reference", "inputs", "total"} <= set(d["seconds"])
    assert d["seconds"]["total"] >= d["seconds"]["package"] > 0
    assert "reference fp32 vs fp64" in report.table()
    # against the fp64 reference: the same verdicts, and every error moves by at most the reference's own
    # error (triangle inequality), which is what lets the fp32 reference stand in for fp64
    own = max(max(r["errors"].values()) for r in report.reference_checks)
    exact = verify_package(pkg, ckpt, precision="fp64")
    assert exact.passed and not exact.reference_checks
    for a, b in zip(report.comparisons, exact.comparisons):
        assert (a.case, a.rows, a.passed) == (b.case, b.rows, b.passed)
        assert all(abs(a.errors[k] - b.errors[k]) <= 2 * own for k in a.errors)


def test_a_reference_whose_own_error_is_too_large_fails_verification(package, monkeypatch):
    ckpt, pkg = package
    monkeypatch.setattr(
        verify_module, "reference_error", lambda *a, **k: (8, {"attn_out": 1e-3, "k_chunk": 0.0, "v_chunk": 0.0})
    )
    report = verify_package(pkg, ckpt)
    assert not report.passed
    assert all(c.passed for c in report.comparisons)  # only the reference check failed


def test_attention_tiles_score_only_visible_keys_with_the_same_bits(package, monkeypatch):
    """Skipping the keys a tile's mask drops gives bit-identical outputs; cutting a visible key does not."""
    from anelab.sidecar.mil import evaluate as evaluate_module

    _, pkg = package
    saved = evaluate_module.SavedPackage(pkg)
    rng = np.random.default_rng(5)
    g = TINY_GEOMETRIES[VARIANT]
    inputs = {
        "hidden": rng.standard_normal((8, g.hidden_size)).astype(np.float16),
        "k_history": rng.standard_normal((8, g.num_kv_heads, g.head_dim)).astype(np.float16),
        "v_history": rng.standard_normal((8, g.num_kv_heads, g.head_dim)).astype(np.float16),
        "mask": causal(8, 8),
    }
    monkeypatch.setattr(evaluate_module, "QUERY_TILE_ELEMENTS", 32)  # 2 rows per tile: widths 10, 12, 14, 16
    monkeypatch.setattr(evaluate_module, "KEY_BLOCK", 4)  # scored as 12, 12, 16, 16 keys: the first tiles skip a block
    widths = []
    real = evaluate_module._visible_widths
    monkeypatch.setattr(evaluate_module, "_visible_widths", lambda *a: widths.append(real(*a)) or widths[-1])
    skipped = evaluate_module.evaluate(saved, "h8", inputs)
    assert widths == [[10, 12, 14, 16]]
    monkeypatch.setattr(evaluate_module, "_visible_widths", lambda q, k, m, tile: [m.shape[1]] * -(-m.shape[0] // tile))
    full = evaluate_module.evaluate(saved, "h8", inputs)
    for name in full:
        assert np.array_equal(skipped[name].view(np.uint16), full[name].view(np.uint16)), name
    # negative control: widths a block short of what the rows see (8, 8, 12, 12 keys scored) change attn_out
    monkeypatch.setattr(evaluate_module, "_visible_widths", lambda q, k, m, tile: [7, 7, 11, 11])
    cut = evaluate_module.evaluate(saved, "h8", inputs)
    assert not np.array_equal(cut["attn_out"], full["attn_out"])


# ---- the blocked reference, the fp64 slice, the shared cache and the cheaper control inputs ------------


def test_blocked_reference_equals_one_call(case):
    """Blocks of 4 rows, each scoring only the keys its rows see, give the one-call reference's numbers."""
    inputs, weights, g = case
    for mask in (causal(CHUNK, HISTORY), causal(CHUNK, HISTORY, window=6)):
        one = run_reference(inputs, weights, g, mask, block_rows=CHUNK)
        assert compare.key_spans(mask, HISTORY, CHUNK) is None  # one block: the plain call
        blocked = run_reference(inputs, weights, g, mask, block_rows=4)
        for name in ("attn_out", "k_chunk", "v_chunk"):
            assert relative_error(getattr(blocked, name), getattr(one, name)) < 1e-13
        fp32 = run_reference(inputs, weights, g, mask, block_rows=4, precision="fp32")
        assert relative_error(fp32.attn_out, one.attn_out) < 1e-6
    # the windowed mask lets later blocks skip the keys before their window
    assert [j0 for _, _, j0 in compare.key_spans(causal(CHUNK, HISTORY, window=6), HISTORY, 4)] == [11, 15, 19, 23]


def test_a_block_that_cut_a_visible_key_would_differ(case, monkeypatch):
    """Negative control of the blocked reference: spans that leave out one visible key change the output."""
    inputs, weights, g = case
    mask = causal(CHUNK, HISTORY)
    one = run_reference(inputs, weights, g, mask, block_rows=CHUNK)
    spans = compare.key_spans(mask, HISTORY, 4)
    monkeypatch.setattr(compare, "key_spans", lambda *a, **k: [(r0, r1, j0 + 1) for r0, r1, j0 in spans])
    cut = run_reference(inputs, weights, g, mask, block_rows=4)
    assert relative_error(cut.attn_out, one.attn_out) > 1e-3


def test_blocks_are_not_used_when_a_row_sees_a_later_row(case):
    inputs, weights, g = case
    every_key = np.zeros((CHUNK, HISTORY + CHUNK), np.float16)  # each row sees the whole chunk
    assert compare.key_spans(every_key, HISTORY, 4) is None
    one = run_reference(inputs, weights, g, every_key, block_rows=CHUNK)
    assert relative_error(run_reference(inputs, weights, g, every_key, block_rows=4).attn_out, one.attn_out) < 1e-13
    assert relative_error(one.attn_out, run_reference(inputs, weights, g, causal(CHUNK, HISTORY)).attn_out) > 1e-3


def test_a_row_range_run_equals_those_rows_of_the_full_run(case):
    inputs, weights, g = case
    mask = causal(CHUNK, HISTORY)
    full = run_reference(inputs, weights, g, mask, block_rows=CHUNK)
    part = run_reference(inputs, weights, g, mask, rows=4, first_row=8, block_rows=4)
    assert part.attn_out.shape == (4, g.hidden_size) and part.k_chunk.shape[1] == 4
    assert relative_error(part.attn_out, full.attn_out[8:12]) < 1e-13
    assert relative_error(part.k_chunk, full.k_chunk[:, 8:12]) < 1e-13
    assert relative_error(part.attn_out, full.attn_out[4:8]) > 1e-2  # negative control: other rows differ
    with pytest.raises(AnelabInputError, match="must lie in the chunk"):
        run_reference(inputs, weights, g, mask, rows=4, first_row=14)


def test_the_fp64_slice_lies_in_the_second_block(case, monkeypatch):
    """reference_error checks rows from REFERENCE_BLOCK_ROWS on: an error there is caught, one before is not."""
    inputs, weights, g = case
    monkeypatch.setattr(compare, "REFERENCE_BLOCK_ROWS", 4)
    mask = causal(CHUNK, HISTORY)
    ref = run_reference(inputs, weights, g, mask, block_rows=4, precision="fp32")
    rows, errors = reference_error(inputs, weights, g, mask, ref, rows=4)
    assert rows == 4 and max(errors.values()) < REFERENCE_ERROR_BOUND
    for wrong_rows, caught in ((slice(4, 8), True), (slice(0, 4), False)):
        wrong = type(ref)(ref.attn_out.copy(), ref.k_chunk, ref.v_chunk)
        wrong.attn_out[wrong_rows] *= 1.01
        assert (max(reference_error(inputs, weights, g, mask, wrong, rows=4)[1].values()) > 1e-3) is caught


def test_one_history_projection_serves_every_function(package, monkeypatch):
    """verify projects the longest history once; a function's cache is its first H positions."""
    from anelab.core import reference

    ckpt, pkg = package
    g = TINY_GEOMETRIES[VARIANT]
    weights = ckpt.layer(g.full_attention_layers[0])
    options = dict(geometry=g, seed=0, rope_coverage=None, precision="fp32")
    long, short = (
        verify_module.verify_history(16, weights, **options),
        verify_module.verify_history(8, weights, **options),
    )
    # the same rows projected (bit-equality would test the BLAS: 8- and 16-row GEMMs may round differently)
    for a, b in ((long[0][:8], short[0]), (long[1][:8], short[1])):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=2e-3, atol=2e-3)
    other = verify_module.verify_history(8, weights, **{**options, "seed": 1})
    assert not np.allclose(other[0], short[0], rtol=2e-3, atol=2e-3)  # negative control: another seed, another cache
    calls = []
    original = reference.history_kv
    monkeypatch.setattr(reference, "history_kv", lambda *a, **k: calls.append(len(a[0])) or original(*a, **k))
    assert verify_package(pkg, ckpt).passed
    assert calls == [8]  # h0 and h8: one projection of the 8 history rows


def test_drop_half_mask_drops_about_half_of_the_visible_keys_and_keeps_one_per_row():
    from anelab.core.masks import MASKED

    mask = causal(64, 64)
    dropped = verify_module.drop_half_mask(mask, np.random.default_rng(0))
    visible, kept = mask > MASKED / 2, dropped > MASKED / 2
    assert not np.any(kept & ~visible)  # nothing hidden becomes visible
    assert np.all(kept.sum(axis=1) >= 1)
    assert 0.45 < 1 - kept.sum() / visible.sum() < 0.55
    again = verify_module.drop_half_mask(mask, np.random.default_rng(1))
    assert not np.array_equal(again, dropped)  # negative control: another stream drops other keys


@pytest.mark.parametrize("shape", [(7,), (5, 3), (3, 700, 5), (2100, 600)])
def test_relative_error_in_slabs_equals_the_float64_formula(shape, monkeypatch):
    monkeypatch.setattr(compare, "ERROR_SLAB_ELEMENTS", 1000)
    rng = np.random.default_rng(2)
    expected = rng.standard_normal(shape).astype(np.float32)
    actual = (expected + 1e-3 * rng.standard_normal(shape)).astype(np.float16)
    a64, e64 = actual.astype(np.float64), expected.astype(np.float64)
    exact = np.linalg.norm(a64 - e64) / np.linalg.norm(e64)
    assert relative_error(actual, expected) == pytest.approx(exact, rel=1e-12)
    assert relative_error(expected, expected) == 0.0
    assert relative_error(actual, np.zeros(shape)) == float("inf")
    assert relative_error(np.full(shape, np.inf), expected) == float("inf")
