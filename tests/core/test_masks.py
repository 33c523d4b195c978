"""Masks: the causal mask, and folding a compacted selection into an additive fp16 mask.

The fold is checked the way it is used: a dense softmax under the folded mask must equal attention
computed over only the gathered keys (an independent implementation below), and a fold that is off
by one key must fail that same check.
"""

import numpy as np
import pytest

from anelab.core.errors import AnelabInputError
from anelab.core.masks import MASKED, causal, dense_exact_window, fold, fold_with_causal

SEED_KEPT_BLOCKS, SEED_COMPRESS_RATIO, SEED_WINDOW = 512, 4, 2051  # ANE prefill research seed, Qwen 3.8
FP32_ATOL = 1e-6
WRONG_FOLD_MIN_DIFF = 1e-2  # an off-by-one fold must move the output by far more than FP32_ATOL


def softmax_rows(x: np.ndarray) -> np.ndarray:
    """Row softmax in x's own dtype (fp16 stays fp16)."""
    z = x - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def gathered_attention(scores, values, keep_indices, keep_counts):
    """Attention over only each row's kept keys: scores [C, T], values [T, d] -> [C, d]."""
    out = np.zeros((scores.shape[0], values.shape[1]), dtype=np.float64)
    for i in range(scores.shape[0]):
        idx = keep_indices[i, : keep_counts[i]]
        s = scores[i, idx].astype(np.float64)
        w = np.exp(s - s.max())
        out[i] = (w / w.sum()) @ values[idx].astype(np.float64)
    return out


def random_selection(rng, rows, total, budget):
    """A valid compacted selection, independent of anelab.core.selection."""
    idx = np.zeros((rows, budget), dtype=np.int32)
    counts = rng.integers(1, budget + 1, size=rows).astype(np.int32)
    for i in range(rows):
        idx[i, : counts[i]] = np.sort(rng.choice(total, size=counts[i], replace=False))
    return idx, counts


# ---- causal ---------------------------------------------------------------------------------------
def test_causal_by_hand():
    m = causal(2, 3)
    expected = np.array([[0, 0, 0, 0, MASKED], [0, 0, 0, 0, 0]], dtype=np.float16)
    assert m.dtype == np.float16 and m.shape == (2, 5)
    np.testing.assert_array_equal(m, expected)


# ---- dense-exact window ---------------------------------------------------------------------------
def test_dense_exact_window_matches_seed():
    assert dense_exact_window(SEED_KEPT_BLOCKS, SEED_COMPRESS_RATIO) == SEED_WINDOW


@pytest.mark.parametrize("kept_blocks,ratio,expected", [(1, 1, 1), (3, 2, 7), (2, 4, 11)])
def test_dense_exact_window_by_hand(kept_blocks, ratio, expected):
    # by hand: a row seeing n keys keeps them all while n // ratio <= kept_blocks
    assert dense_exact_window(kept_blocks, ratio) == expected
    assert max(n for n in range(1, 100) if n // ratio <= kept_blocks) == expected


@pytest.mark.parametrize("kept_blocks,ratio", [(0, 4), (4, 0), (-1, 4)])
def test_dense_exact_window_refuses_nonpositive(kept_blocks, ratio):
    with pytest.raises(AnelabInputError):
        dense_exact_window(kept_blocks, ratio)


# ---- fold -----------------------------------------------------------------------------------------
def test_fold_by_hand():
    idx = np.array([[0, 2, 0], [1, 3, 4]], dtype=np.int32)  # row 0 uses 2 entries; its third is unused
    counts = np.array([2, 3], dtype=np.int32)
    m = fold(idx, counts, 5)
    z, x = 0.0, float(MASKED)
    expected = np.array([[z, x, z, x, x], [x, z, x, z, z]], dtype=np.float16)
    assert m.dtype == np.float16
    np.testing.assert_array_equal(m, expected)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_masked_keys_get_exactly_zero_weight(dtype):
    rng = np.random.default_rng(0)
    rows, total, budget = 16, 40, 9
    idx, counts = random_selection(rng, rows, total, budget)
    scores = (rng.standard_normal((rows, total)) * 4).astype(dtype)
    probs = softmax_rows(scores + fold(idx, counts, total).astype(dtype))
    assert probs.dtype == dtype
    kept = np.zeros((rows, total), bool)
    for i in range(rows):
        kept[i, idx[i, : counts[i]]] = True
    assert np.all(probs[~kept] == 0.0)  # exactly zero, not small
    assert np.all(probs[kept] > 0.0)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_row_with_one_kept_key_returns_that_value(dtype):
    rng = np.random.default_rng(1)
    total, d, key = 12, 5, 7
    idx = np.array([[key, 0]], dtype=np.int32)
    counts = np.array([1], dtype=np.int32)
    scores = (rng.standard_normal((1, total)) * 8).astype(dtype)
    scores[0, key] = -20  # the kept key need not be the largest score
    values = rng.standard_normal((total, d)).astype(dtype)
    out = softmax_rows(scores + fold(idx, counts, total).astype(dtype)) @ values
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[0], values[key])


def test_folded_softmax_equals_gathered_attention_and_off_by_one_is_caught():
    rng = np.random.default_rng(2)
    rows, total, budget, d = 24, 64, 12, 8
    idx, counts = random_selection(rng, rows, total, budget)
    scores = rng.standard_normal((rows, total)) * 3
    values = rng.standard_normal((total, d))
    reference = gathered_attention(scores, values, idx, counts)

    folded = softmax_rows(scores + fold(idx, counts, total).astype(np.float64)) @ values
    np.testing.assert_allclose(folded, reference, atol=FP32_ATOL, rtol=0)

    # negative control: shift every kept key by one position (wrapping) — a plausible fold bug
    wrong_idx = np.zeros_like(idx)
    for i in range(rows):
        wrong_idx[i, : counts[i]] = np.sort((idx[i, : counts[i]] + 1) % total)
    wrong = softmax_rows(scores + fold(wrong_idx, counts, total).astype(np.float64)) @ values
    assert np.abs(wrong - reference).max() > WRONG_FOLD_MIN_DIFF


def test_fold_ignores_entries_past_the_count():
    idx = np.array([[1, 999, -5]], dtype=np.int32)  # 999 and -5 are unused garbage
    m = fold(idx, np.array([1], dtype=np.int32), 3)
    np.testing.assert_array_equal(m, np.array([[MASKED, 0, MASKED]], dtype=np.float16))


GOOD_IDX = np.array([[0, 2], [1, 3]], dtype=np.int32)
GOOD_COUNTS = np.array([2, 2], dtype=np.int32)


@pytest.mark.parametrize(
    "idx,counts,total,fragment",
    [
        (GOOD_IDX.astype(np.float32), GOOD_COUNTS, 4, "integer"),
        (GOOD_IDX, GOOD_COUNTS.astype(np.float64), 4, "integer"),
        (GOOD_IDX[0], GOOD_COUNTS, 4, "2-D"),
        (GOOD_IDX, GOOD_COUNTS[:1], 4, "shape"),
        (GOOD_IDX, np.array([2, 3], np.int32), 4, "outside"),  # count > budget
        (GOOD_IDX, np.array([2, -1], np.int32), 4, "outside"),
        (GOOD_IDX, np.array([2, 0], np.int32), 4, "uniform"),  # empty row refused by default
        (GOOD_IDX, GOOD_COUNTS, 3, "key range"),  # index 3 >= total
        (np.array([[0, 2], [-1, 3]], np.int32), GOOD_COUNTS, 4, "key range"),
        (np.array([[2, 0], [1, 3]], np.int32), GOOD_COUNTS, 4, "sorted"),
        (np.array([[2, 2], [1, 3]], np.int32), GOOD_COUNTS, 4, "unique"),
    ],
)
def test_fold_refuses_bad_selection(idx, counts, total, fragment):
    with pytest.raises(AnelabInputError, match=fragment):
        fold(idx, counts, total)


def test_fold_accepts_the_same_selection_when_valid():
    # positive twin of the refusals above: the unmodified selection folds
    assert fold(GOOD_IDX, GOOD_COUNTS, 4).shape == (2, 4)


def test_empty_rows_allowed_on_request_are_fully_masked():
    m = fold(GOOD_IDX, np.array([2, 0], np.int32), 4, allow_empty_rows=True)
    assert np.all(m[1] == MASKED)


# ---- fold_with_causal -----------------------------------------------------------------------------
def test_fold_with_causal_pads_partial_chunk_with_causal_rows():
    history, chunk = 3, 4
    idx = np.array([[0, 3, 0], [1, 2, 4]], dtype=np.int32)  # 2 real rows at positions 3 and 4
    counts = np.array([2, 3], dtype=np.int32)
    m = fold_with_causal(idx, counts, history, chunk)
    assert m.shape == (chunk, history + chunk) and m.dtype == np.float16
    np.testing.assert_array_equal(m[:2], fold(idx, counts, history + chunk))
    np.testing.assert_array_equal(m[2:], causal(chunk, history)[2:])
    # no real row sees a padded key (positions >= history + real rows)
    assert np.all(m[:2, history + 2 :] == MASKED)


def test_fold_with_causal_refuses_a_future_key():
    idx = np.array([[0, 4]], dtype=np.int32)  # row 0 sits at position 3; key 4 is in its future
    with pytest.raises(AnelabInputError, match="future"):
        fold_with_causal(idx, np.array([2], np.int32), history=3, chunk=2)
    # control: the same row keeping only its own position is accepted
    assert fold_with_causal(np.array([[0, 3]], np.int32), np.array([2], np.int32), history=3, chunk=2).shape == (2, 5)


def test_fold_with_causal_refuses_more_rows_than_chunk():
    with pytest.raises(AnelabInputError, match="rows"):
        fold_with_causal(GOOD_IDX, GOOD_COUNTS, history=4, chunk=1)
