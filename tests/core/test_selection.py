"""The QSA-shaped block indexer: invariants, the dense-exact window, the tail, top-k, scoring.

Expected selections come from a per-row loop written here (``reference_selection``), not from
anelab.core.selection's vectorised code.
"""

import numpy as np
import pytest

from anelab.core.errors import AnelabInputError
from anelab.core.masks import MASKED, causal, dense_exact_window, fold_with_causal
from anelab.core.selection import Selection, block_scores_qk, block_scores_random, select, select_blocks

# (start, chunk, kept_blocks, compress_ratio): small geometries straddling the dense-exact window
GEOMETRIES = [(0, 20, 2, 4), (10, 12, 3, 4), (5, 9, 1, 1), (16, 16, 2, 3), (0, 7, 5, 4)]


def make_qk(rng, start, chunk, heads=4, kv_heads=2, head_dim=8):
    q = rng.standard_normal((chunk, heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((start + chunk, kv_heads, head_dim)).astype(np.float32)
    return q, k


def reference_block_scores(q, k, ratio, kv_of=None):
    """Loop version: per row, per complete block, mean over keys of sum over heads of q_h . k_kv(h).

    kv_of(h) maps a query head to its KV head; default grouped, h // (heads // kv_heads).
    """
    chunk, heads, _ = q.shape
    keys, kv_heads, _ = k.shape
    group = heads // kv_heads
    kv_of = kv_of or (lambda h: h // group)
    out = np.zeros((chunk, keys // ratio))
    for i in range(chunk):
        for b in range(keys // ratio):
            per_key = [
                sum(float(q[i, h] @ k[t, kv_of(h)]) for h in range(heads)) for t in range(b * ratio, (b + 1) * ratio)
            ]
            out[i, b] = np.mean(per_key)
    return out


def reference_selection(scores, start, kept_blocks, ratio):
    """Per-row top-k of visible complete blocks (ties -> earlier block) plus the incomplete tail."""
    rows = []
    for i in range(scores.shape[0]):
        visible = start + i + 1
        complete = visible // ratio
        ranked = sorted(range(complete), key=lambda b: (-scores[i, b], b))[:kept_blocks]
        keys = [b * ratio + j for b in sorted(ranked) for j in range(ratio)]
        keys += list(range(complete * ratio, visible))
        rows.append(keys)
    return rows


def selected_rows(sel):
    return [list(sel.keep_indices[i, : sel.keep_counts[i]]) for i in range(sel.chunk)]


# ---- invariants -----------------------------------------------------------------------------------
@pytest.mark.parametrize("score", ["qk", "random"])
@pytest.mark.parametrize("start,chunk,kept_blocks,ratio", GEOMETRIES)
def test_selection_invariants(start, chunk, kept_blocks, ratio, score):
    q, k = make_qk(np.random.default_rng(0), start, chunk)
    sel = select(q, k, start, kept_blocks, ratio, score=score, seed=3)
    budget = kept_blocks * ratio + ratio - 1
    assert sel.budget == budget
    assert sel.keep_indices.shape == (chunk, budget) and sel.keep_indices.dtype == np.int32
    assert sel.keep_counts.shape == (chunk,) and sel.keep_counts.dtype == np.int32
    for i in range(chunk):
        n = int(sel.keep_counts[i])
        assert 1 <= n <= budget
        row = sel.keep_indices[i, :n]
        assert np.all(np.diff(row) > 0), "sorted and unique"
        assert row.min() >= 0 and row.max() <= start + i, "causal"
        assert np.all(sel.keep_indices[i, n:] == 0), "unused entries are 0"


# ---- dense-exact window ---------------------------------------------------------------------------
@pytest.mark.parametrize("start,chunk,kept_blocks,ratio", GEOMETRIES)
def test_inside_window_selection_is_every_visible_key_and_outside_it_is_not(start, chunk, kept_blocks, ratio):
    q, k = make_qk(np.random.default_rng(1), start, chunk)
    sel = select(q, k, start, kept_blocks, ratio)
    window = dense_exact_window(kept_blocks, ratio)
    for i, row in enumerate(selected_rows(sel)):
        visible = start + i + 1
        if visible <= window:
            assert row == list(range(visible))
        else:
            assert len(row) < visible  # the causal mask would attend to keys this row drops


def test_seed_geometry_window_edge():
    # 512 blocks x 4: rows seeing <= 2,051 keys keep everything, the row seeing 2,052 does not
    start, chunk = 2040, 16
    q, k = make_qk(np.random.default_rng(2), start, chunk, heads=2, kv_heads=1, head_dim=4)
    sel = select(q, k, start, 512, 4)
    visible = start + np.arange(chunk) + 1
    assert sel.budget == 2051
    np.testing.assert_array_equal(sel.keep_counts[visible <= 2051], visible[visible <= 2051])
    assert np.all(sel.keep_counts[visible > 2051] < visible[visible > 2051])
    # the folded mask equals the causal mask exactly for the in-window rows, and differs after
    m, c = sel.mask(), causal(chunk, start)
    inside = visible <= 2051
    np.testing.assert_array_equal(m[inside], c[inside])
    assert np.any(m[~inside] != c[~inside])


# ---- tail and top-k -------------------------------------------------------------------------------
@pytest.mark.parametrize("score", ["qk", "random"])
def test_tail_block_always_kept(score):
    start, chunk, kept_blocks, ratio = 30, 20, 2, 4
    q, k = make_qk(np.random.default_rng(3), start, chunk)
    sel = select(q, k, start, kept_blocks, ratio, score=score, seed=9)
    tails_seen = 0
    for i, row in enumerate(selected_rows(sel)):
        visible = start + i + 1
        tail = list(range(visible // ratio * ratio, visible))
        tails_seen += bool(tail)
        assert row[len(row) - len(tail) :] == tail
        assert len(row) == kept_blocks * ratio + len(tail)  # past the window: exactly kept_blocks blocks
    assert tails_seen > 0


def test_top_k_keeps_highest_mean_pooled_blocks():
    # 1 KV head, head_dim 2; both query heads look along dim 0, so a block's score is
    # 2 * mean of its keys' dim-0 values. Block means chosen by hand.
    ratio = 4
    block_values = {
        0: [1, 1, 1, 1],  # mean 1
        1: [10, -10, 0, 0],  # mean 0, max 10: max-pooling would rank it first
        2: [3, 3, 3, 3],  # mean 3
        3: [2, 2, 2, 2],  # mean 2
        4: [-1, -1, -1, -1],  # mean -1
        5: [0.5, 0.5, 0.5, 0.5],  # mean 0.5
    }
    k = np.zeros((24, 1, 2), np.float32)
    for b, vals in block_values.items():
        k[b * ratio : (b + 1) * ratio, 0, 0] = vals
    start, chunk = 22, 2  # rows at positions 22 (5 complete blocks + 3 tail) and 23 (6 complete blocks)
    q = np.zeros((chunk, 2, 2), np.float32)
    q[:, :, 0] = 1.0
    sel = select(q, k, start, kept_blocks=2, compress_ratio=ratio)
    rows = selected_rows(sel)
    # row 0 sees blocks 0..4: top-2 by mean = blocks 2 (3) and 3 (2); then tail 20, 21, 22
    assert rows[0] == list(range(8, 16)) + [20, 21, 22]
    # row 1 sees blocks 0..5, no tail: still blocks 2 and 3 (block 5's mean is 0.5)
    assert rows[1] == list(range(8, 16))
    # control: with kept_blocks=3 block 0 (mean 1) enters, block 1 (max 10, mean 0) still does not
    rows3 = selected_rows(select(q, k, start, kept_blocks=3, compress_ratio=ratio))
    assert rows3[1] == list(range(0, 4)) + list(range(8, 16))


def test_block_scores_match_loop_reference_with_gqa():
    rng = np.random.default_rng(4)
    q, k = make_qk(rng, 9, 5, heads=6, kv_heads=2, head_dim=3)
    got = block_scores_qk(q, k, 3)
    np.testing.assert_allclose(got, reference_block_scores(q, k, 3), rtol=1e-5, atol=1e-5)
    # negative control: pairing query heads with KV heads round-robin (h % kv_heads) instead of
    # grouped (h // group, the transformers repeat_kv layout) gives a different score
    round_robin = reference_block_scores(q, k, 3, kv_of=lambda h: h % 2)
    assert np.abs(round_robin - got).max() > 1e-2


@pytest.mark.parametrize("start,chunk,kept_blocks,ratio", GEOMETRIES)
def test_vectorised_selection_matches_per_row_loop(start, chunk, kept_blocks, ratio):
    rng = np.random.default_rng(5)
    scores = rng.standard_normal((chunk, (start + chunk) // ratio))
    scores[:, ::3] = 0.25  # ties, to pin the earlier-block tie-break
    idx, counts = select_blocks(scores, start, kept_blocks, ratio)
    got = [list(idx[i, : counts[i]]) for i in range(chunk)]
    assert got == reference_selection(scores, start, kept_blocks, ratio)


def test_loop_comparison_is_sensitive():
    # negative control for the comparison above: reversing the scores changes some row's selection
    start, chunk, kept_blocks, ratio = 10, 12, 3, 4
    scores = np.random.default_rng(6).standard_normal((chunk, (start + chunk) // ratio))
    idx, counts = select_blocks(-scores, start, kept_blocks, ratio)
    got = [list(idx[i, : counts[i]]) for i in range(chunk)]
    assert got != reference_selection(scores, start, kept_blocks, ratio)


# ---- random control -------------------------------------------------------------------------------
def test_random_mode_is_seeded():
    start, chunk = 40, 24
    q, k = make_qk(np.random.default_rng(7), start, chunk)
    a = select(q, k, start, 2, 4, score="random", seed=11)
    b = select(q * 0 + 1, k * 0 - 1, start, 2, 4, score="random", seed=11)  # values ignored
    c = select(q, k, start, 2, 4, score="random", seed=12)
    np.testing.assert_array_equal(a.keep_indices, b.keep_indices)
    assert not np.array_equal(a.keep_indices, c.keep_indices)
    assert not np.array_equal(a.keep_indices, select(q, k, start, 2, 4).keep_indices)
    np.testing.assert_array_equal(block_scores_random(3, 5, 1), block_scores_random(3, 5, 1))


# ---- Selection object -----------------------------------------------------------------------------
def test_selection_mask_and_metadata():
    start, chunk = 12, 8
    q, k = make_qk(np.random.default_rng(8), start, chunk)
    sel = select(q, k, start, 2, 4)
    assert isinstance(sel, Selection) and sel.total == start + chunk
    np.testing.assert_array_equal(sel.mask(), fold_with_causal(sel.keep_indices, sel.keep_counts, start))
    padded = sel.mask(chunk=chunk + 4)
    assert padded.shape == (chunk + 4, start + chunk + 4)
    assert np.all(padded[:chunk, start + chunk :] == MASKED)
    d = sel.to_dict()
    assert d["kept_blocks"] == 2 and d["compress_ratio"] == 4 and d["budget"] == 11 and d["score"] == "qk"
    assert "seed" not in d
    assert select(q, k, start, 2, 4, score="random", seed=5).to_dict()["seed"] == 5


# ---- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(start=3), "start \\+ chunk"),  # k has start + chunk keys for start=4
        (dict(kept_blocks=0), "kept_blocks"),
        (dict(compress_ratio=0), "compress_ratio"),
        (dict(score="mean"), "unknown score"),
        (dict(start=-1), "start"),
    ],
)
def test_select_refuses_bad_parameters(kwargs, fragment):
    q, k = make_qk(np.random.default_rng(9), 4, 6)
    args = dict(start=4, kept_blocks=1, compress_ratio=2) | kwargs
    with pytest.raises(AnelabInputError, match=fragment):
        select(q, k, **args)


def test_select_blocks_refuses_nan_and_short_scores():
    with pytest.raises(AnelabInputError, match="NaN"):
        select_blocks(np.array([[np.nan, 1.0]]), 3, 1, 2)
    with pytest.raises(AnelabInputError, match="blocks"):
        select_blocks(np.zeros((4, 1)), 4, 1, 2)  # last row sees 4 complete blocks
