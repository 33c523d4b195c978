"""verify's cheaper reference: fp32 with its own fp64 error measured, first-rows runs, the partial chunk
taken from the full chunk's reference, timings and the progress-independent report."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY_GEOMETRIES

from anelab import fp16
from anelab.errors import AnelabInputError
from anelab.hf.checkpoint import load_checkpoint
from anelab.masks import causal
from anelab.sidecar import verify as verify_module
from anelab.sidecar.compare import (
    REFERENCE_ERROR_BOUND,
    random_function_inputs,
    reference_error,
    relative_error,
    run_reference,
)
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.verify import verify_package

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
    ckpt = tiny_checkpoint(VARIANT)
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
    from anelab.sidecar import evaluate as evaluate_module

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
    widths = []
    real = evaluate_module._visible_widths
    monkeypatch.setattr(evaluate_module, "_visible_widths", lambda *a: widths.append(real(*a)) or widths[-1])
    skipped = evaluate_module.evaluate(saved, "h8", inputs)
    assert widths == [[10, 12, 14, 16]]
    monkeypatch.setattr(evaluate_module, "_visible_widths", lambda q, k, m, tile: [m.shape[1]] * -(-m.shape[0] // tile))
    full = evaluate_module.evaluate(saved, "h8", inputs)
    for name in full:
        assert np.array_equal(skipped[name].view(np.uint16), full[name].view(np.uint16)), name
    # negative control: a width one key short of what the rows see changes attn_out
    monkeypatch.setattr(evaluate_module, "_visible_widths", lambda q, k, m, tile: [9, 11, 13, 15])
    cut = evaluate_module.evaluate(saved, "h8", inputs)
    assert not np.array_equal(cut["attn_out"], full["attn_out"])
