"""Tests of the NumPy reference block (anelab.core.reference).

Expected values come from a naive per-head, per-row implementation written here from the
transformers conventions (loops, explicit row layout of q_proj), from hand-computed RoPE
rotations, and from properties (relative-position invariance, softmax shift invariance, chunked
prefill == one pass). Every check has a negative control.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.masks import MASKED, causal
from anelab.core.reference import (
    PRECISIONS,
    BlockOutput,
    apply_rope,
    attention_block,
    attention_block_tiled,
    history_kv,
    project,
    rope_cos_sin,
)
from anelab.core.weights import AttentionWeights

FP64_TOL = 1e-10
FP32_TOL = 1e-5
FP32_VS_FP64_TOL = 1e-4
NEGATIVE_CONTROL_MIN = 1e-2
TILE_SIZES = [(1, 1), (2, 3), (3, 5), (4, 7), (5, 16), (64, 64)]

# Small geometries, one per variant (hidden 24, 4 query heads over 2 KV heads).
GEOMETRIES = {
    "llama": AttentionGeometry("llama", hidden_size=24, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=500.0),
    "llama_bias": AttentionGeometry(
        "llama",
        hidden_size=24,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=500.0,
        has_qkv_bias=True,
        has_o_bias=True,
    ),
    "qwen3": AttentionGeometry("qwen3", hidden_size=24, num_heads=4, num_kv_heads=1, head_dim=8, rope_theta=500.0),
    "qwen3_next": AttentionGeometry(
        "qwen3_next",
        hidden_size=24,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=500.0,
        partial_rotary_factor=0.25,
        has_qkv_bias=True,
        has_o_bias=True,
    ),
}


def make_weights(g: AttentionGeometry, seed: int = 0) -> AttentionWeights:
    rng = np.random.default_rng(seed)

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) / math.sqrt(cols)).astype(np.float32)

    def vec(n, scale=0.1):
        return (scale * rng.standard_normal(n)).astype(np.float32)

    return AttentionWeights(
        layer=0,
        q_proj=mat(g.q_out_features, g.hidden_size),
        k_proj=mat(g.kv_out_features, g.hidden_size),
        v_proj=mat(g.kv_out_features, g.hidden_size),
        o_proj=mat(g.hidden_size, g.attn_features),
        q_norm=(1.0 + vec(g.head_dim)) if g.has_qk_norm else None,
        k_norm=(1.0 + vec(g.head_dim)) if g.has_qk_norm else None,
        q_bias=vec(g.q_out_features) if g.has_qkv_bias else None,
        k_bias=vec(g.kv_out_features) if g.has_qkv_bias else None,
        v_bias=vec(g.kv_out_features) if g.has_qkv_bias else None,
        o_bias=vec(g.hidden_size) if g.has_o_bias else None,
    )


def hidden_states(n: int, g: AttentionGeometry, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, g.hidden_size)).astype(np.float32)


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# -- naive implementation (independent of anelab.core.reference) --------------------------------------


def naive_rope(vec: np.ndarray, pos: int, g: AttentionGeometry) -> np.ndarray:
    """Rotate one head vector [d]: pair (i, i + rot/2) turns by pos * theta^(-2i/rot)."""
    rot = int(g.head_dim * g.partial_rotary_factor)
    half = rot // 2
    out = vec.astype(np.float64).copy()
    for i in range(half):
        angle = pos * g.rope_theta ** (-2.0 * i / rot)
        a, b = vec[i], vec[i + half]
        out[i] = a * math.cos(angle) - b * math.sin(angle)
        out[i + half] = b * math.cos(angle) + a * math.sin(angle)
    return out


def naive_rms(vec: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return vec / math.sqrt(float(np.mean(vec * vec)) + eps) * w


def naive_heads(x_row: np.ndarray, w: np.ndarray, b, heads: int, d: int, stride: int, offset: int) -> list:
    """Head h of a projection = rows [h*stride + offset, h*stride + offset + d) of the weight."""
    out = []
    for h in range(heads):
        r0 = h * stride + offset
        y = w[r0 : r0 + d].astype(np.float64) @ x_row
        if b is not None:
            y = y + b[r0 : r0 + d]
        out.append(y)
    return out


def naive_kv(hidden: np.ndarray, positions, w: AttentionWeights, g: AttentionGeometry):
    """-> k, v [T, Hkv, d] float64."""
    d = g.head_dim
    k = np.zeros((len(hidden), g.num_kv_heads, d))
    v = np.zeros_like(k)
    for t, pos in enumerate(positions):
        x = hidden[t].astype(np.float64)
        ks = naive_heads(x, w.k_proj, w.k_bias, g.num_kv_heads, d, d, 0)
        vs = naive_heads(x, w.v_proj, w.v_bias, g.num_kv_heads, d, d, 0)
        for h in range(g.num_kv_heads):
            kh = naive_rms(ks[h], w.k_norm, g.rms_norm_eps) if g.has_qk_norm else ks[h]
            k[t, h] = naive_rope(kh, pos, g)
            v[t, h] = vs[h]
    return k, v


def naive_block(hidden, k_history, v_history, mask, w: AttentionWeights, g: AttentionGeometry, start=None):
    """Loop over rows and query heads; gated q_proj rows are [query d | gate d] per head."""
    c, d = len(hidden), g.head_dim
    h_len = len(k_history)
    start = h_len if start is None else start
    k_new, v_new = naive_kv(hidden, range(start, start + c), w, g)
    keys = np.concatenate([np.asarray(k_history, np.float64), k_new])
    values = np.concatenate([np.asarray(v_history, np.float64), v_new])
    stride = 2 * d if g.is_gated else d
    attn = np.zeros((c, g.num_heads * d))
    for i in range(c):
        x = hidden[i].astype(np.float64)
        qs = naive_heads(x, w.q_proj, w.q_bias, g.num_heads, d, stride, 0)
        gates = naive_heads(x, w.q_proj, w.q_bias, g.num_heads, d, stride, d) if g.is_gated else None
        for h in range(g.num_heads):
            q = naive_rms(qs[h], w.q_norm, g.rms_norm_eps) if g.has_qk_norm else qs[h]
            q = naive_rope(q, start + i, g)
            kv = h // (g.num_heads // g.num_kv_heads)
            scores = np.array([q @ keys[j, kv] / math.sqrt(d) + float(mask[i, j]) for j in range(len(keys))])
            weights = np.exp(scores - scores.max())
            weights /= weights.sum()
            o = sum(weights[j] * values[j, kv] for j in range(len(keys)))
            if g.is_gated:
                o = o / (1.0 + np.exp(-gates[h]))
            attn[i, h * d : (h + 1) * d] = o
    out = attn @ w.o_proj.astype(np.float64).T
    if w.o_bias is not None:
        out = out + w.o_bias
    return out, k_new, v_new


def random_mask(c: int, h: int, seed: int, fully_masked_rows=()) -> np.ndarray:
    """Causal mask with some extra dropped keys, and chosen rows with every key dropped."""
    rng = np.random.default_rng(seed)
    m = causal(c, h).copy()
    m[rng.random(m.shape) < 0.3] = MASKED
    m[np.arange(c), h + np.arange(c)] = 0  # each row still sees itself
    for r in fully_masked_rows:
        m[r] = MASKED
    return m


# -- RoPE ----------------------------------------------------------------------------------------


def test_rope_hand_computed_rotate_half_pairing():
    g = AttentionGeometry("llama", hidden_size=4, num_heads=1, num_kv_heads=1, head_dim=4, rope_theta=100.0)
    cos, sin = rope_cos_sin(np.array([3]), g, np.float64)
    # inv_freq = [1, 100^-0.5] = [1, 0.1]; at position 3 the angles are [3, 0.3]; pairs (0,2) and (1,3).
    np.testing.assert_allclose(cos[0], [math.cos(3), math.cos(0.3), math.cos(3), math.cos(0.3)], atol=1e-15)
    eye = np.eye(4)[:, None, :]  # 4 tokens-worth of basis vectors, all at position 3
    cos4, sin4 = np.repeat(cos, 4, 0), np.repeat(sin, 4, 0)
    out = apply_rope(eye, cos4, sin4)[:, 0]
    expected = np.array(
        [
            [math.cos(3), 0, math.sin(3), 0],
            [0, math.cos(0.3), 0, math.sin(0.3)],
            [-math.sin(3), 0, math.cos(3), 0],
            [0, -math.sin(0.3), 0, math.cos(0.3)],
        ]
    )
    np.testing.assert_allclose(out, expected, atol=1e-15)
    # Negative control: interleaved pairing (0,1),(2,3) would put e0's sine on dim 1, not dim 2.
    assert abs(out[0, 1]) < 1e-15 and abs(out[0, 2] - math.sin(3)) < 1e-15


def test_partial_rope_passes_trailing_dims_through():
    g = GEOMETRIES["qwen3_next"]  # head_dim 16, rotary 4
    x = np.random.default_rng(0).standard_normal((3, 2, g.head_dim))
    cos, sin = rope_cos_sin(np.array([5, 6, 7]), g, np.float64)
    assert cos.shape == (3, 4)
    out = apply_rope(x, cos, sin)
    np.testing.assert_array_equal(out[..., 4:], x[..., 4:])
    assert np.max(np.abs(out[..., :4] - x[..., :4])) > 0.1  # negative control: the rotary part moves


def test_rope_score_depends_only_on_position_difference():
    g = AttentionGeometry("llama", hidden_size=32, num_heads=1, num_kv_heads=1, head_dim=32, rope_theta=10000.0)
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((1, 1, 32)), rng.standard_normal((1, 1, 32))

    def score(pq, pk):
        cq, sq = rope_cos_sin(np.array([pq]), g, np.float64)
        ck, sk = rope_cos_sin(np.array([pk]), g, np.float64)
        return float(apply_rope(q, cq, sq).ravel() @ apply_rope(k, ck, sk).ravel())

    base = score(10, 3)
    for shift in (1, 100, 5000):
        assert abs(score(10 + shift, 3 + shift) - base) < 1e-9 * max(1.0, abs(base))
    assert abs(score(11, 3) - base) > 1e-3  # negative control: a different distance changes the score


# -- the block against the naive implementation ----------------------------------------------------


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_block_matches_naive_fp64(name):
    g = GEOMETRIES[name]
    w = make_weights(g)
    c, h = 5, 7
    hist = hidden_states(h, g, seed=2)
    chunk = hidden_states(c, g, seed=3)
    k_hist, v_hist = history_kv(hist, w, g, precision="fp64")
    k_naive, v_naive = naive_kv(hist, range(h), w, g)
    assert rel_err(k_hist, k_naive) < FP64_TOL and rel_err(v_hist, v_naive) < FP64_TOL
    mask = random_mask(c, h, seed=4)
    got = attention_block(chunk, k_hist, v_hist, mask, w, g, precision="fp64")
    assert isinstance(got, BlockOutput)
    assert got.attn_out.dtype == np.float64 and got.attn_out.shape == (c, g.hidden_size)
    assert got.k_chunk.shape == (g.num_kv_heads, c, g.head_dim)
    expected, k_new, v_new = naive_block(chunk, k_hist, v_hist, mask, w, g)
    assert rel_err(got.attn_out, expected) < FP64_TOL
    for query_block in (1, 2, 3):  # dense score buffer reused over row blocks, incl. a ragged last block
        blocked = attention_block(chunk, k_hist, v_hist, mask, w, g, precision="fp64", query_block=query_block)
        assert rel_err(blocked.attn_out, expected) < FP64_TOL
    assert rel_err(got.k_chunk, k_new.transpose(1, 0, 2)) < FP64_TOL
    assert rel_err(got.v_chunk, v_new.transpose(1, 0, 2)) < FP64_TOL
    # Negative control: the naive block under a different mask is far from the reference output.
    other, _, _ = naive_block(chunk, k_hist, v_hist, causal(c, h), w, g)
    assert rel_err(got.attn_out, other) > NEGATIVE_CONTROL_MIN


def test_project_matches_naive_and_splits_gate():
    g = GEOMETRIES["qwen3_next"]
    w = make_weights(g)
    x = hidden_states(3, g)
    proj = project(x, np.array([4, 9, 2]), w, g, precision="fp64")
    assert proj.q.shape == (3, 4, 16) and proj.gate.shape == (3, 4, 16)
    # Gate of head 1, token 0 = q_proj rows [1*32 + 16, 1*32 + 32) (query first, then gate).
    expected_gate = w.q_proj[48:64].astype(np.float64) @ x[0].astype(np.float64) + w.q_bias[48:64]
    np.testing.assert_allclose(proj.gate[0, 1], expected_gate, rtol=1e-12, atol=1e-12)
    k_naive, _ = naive_kv(x, [4, 9, 2], w, g)
    assert rel_err(proj.k, k_naive) < FP64_TOL
    # Negative control: taking the gate from the first half of each head's rows is different.
    wrong = w.q_proj[32:48].astype(np.float64) @ x[0].astype(np.float64) + w.q_bias[32:48]
    assert np.max(np.abs(proj.gate[0, 1] - wrong)) > 0.1


# -- dense vs tiled ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
@pytest.mark.parametrize("precision,tol", [("fp64", FP64_TOL), ("fp32", FP32_TOL)])
def test_tiled_matches_dense(name, precision, tol):
    g = GEOMETRIES[name]
    w = make_weights(g)
    c, h = 9, 13
    k_hist, v_hist = history_kv(hidden_states(h, g, seed=5), w, g, precision=precision)
    chunk = hidden_states(c, g, seed=6)
    for mask in (causal(c, h), random_mask(c, h, seed=7, fully_masked_rows=(2,))):
        dense = attention_block(chunk, k_hist, v_hist, mask, w, g, precision=precision)
        dense_blocked = attention_block(chunk, k_hist, v_hist, mask, w, g, precision=precision, query_block=4)
        assert rel_err(dense_blocked.attn_out, dense.attn_out) < tol
        for qt, kt in TILE_SIZES:
            tiled = attention_block_tiled(
                chunk, k_hist, v_hist, mask, w, g, precision=precision, query_tile=qt, key_tile=kt
            )
            assert tiled.attn_out.dtype == PRECISIONS[precision]
            assert rel_err(tiled.attn_out, dense.attn_out) < tol, (qt, kt)
            np.testing.assert_array_equal(tiled.k_chunk, dense.k_chunk)
    # Negative control: the tiled form with a wrong start differs from the dense output.
    wrong = attention_block_tiled(
        chunk, k_hist, v_hist, causal(c, h), w, g, precision=precision, start=h + 1, query_tile=4, key_tile=5
    )
    right = attention_block(chunk, k_hist, v_hist, causal(c, h), w, g, precision=precision)
    assert rel_err(wrong.attn_out, right.attn_out) > NEGATIVE_CONTROL_MIN


def test_tiled_without_history():
    g = GEOMETRIES["qwen3"]
    w = make_weights(g)
    empty = np.zeros((0, g.num_kv_heads, g.head_dim), np.float32)
    chunk = hidden_states(6, g)
    dense = attention_block(chunk, empty, empty, causal(6, 0), w, g, precision="fp64")
    tiled = attention_block_tiled(chunk, empty, empty, causal(6, 0), w, g, precision="fp64", query_tile=4, key_tile=4)
    expected, _, _ = naive_block(chunk, empty, empty, causal(6, 0), w, g)
    assert rel_err(dense.attn_out, expected) < FP64_TOL and rel_err(tiled.attn_out, expected) < FP64_TOL


# -- masks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["dense", "tiled"])
@pytest.mark.parametrize("precision", ["fp32", "fp64"])
def test_fully_masked_row_is_finite_and_shift_invariant(form, precision):
    g = GEOMETRIES["qwen3_next"]
    w = make_weights(g)
    c, h = 6, 8
    k_hist, v_hist = history_kv(hidden_states(h, g, seed=8), w, g, precision=precision)
    chunk = hidden_states(c, g, seed=9)
    mask = causal(c, h).copy()
    mask[3] = MASKED
    run = (
        attention_block
        if form == "dense"
        else (lambda *a, **k: attention_block_tiled(*a, query_tile=2, key_tile=3, **k))
    )
    out = run(chunk, k_hist, v_hist, mask, w, g, precision=precision).attn_out
    assert np.all(np.isfinite(out))
    # A constant -30000 on every key of a row cancels in the softmax: row 3 equals that row with no
    # mask at all (up to the rounding of s - 30000, ~2e-3 absolute in fp32).
    unmasked = mask.copy()
    unmasked[3] = 0
    ref = run(chunk, k_hist, v_hist, unmasked, w, g, precision=precision).attn_out
    tol = 1e-9 if precision == "fp64" else 5e-2
    assert rel_err(out[3], ref[3]) < tol
    # Negative control: with the causal pattern, row 3 is a different row.
    causal_out = run(chunk, k_hist, v_hist, causal(c, h), w, g, precision=precision).attn_out
    assert rel_err(out[3], causal_out[3]) > NEGATIVE_CONTROL_MIN


@pytest.mark.parametrize("form", ["dense", "tiled"])
def test_masked_key_gets_zero_weight(form):
    g = GEOMETRIES["llama"]
    w = make_weights(g)
    c, h = 5, 9
    k_hist, v_hist = history_kv(hidden_states(h, g, seed=10), w, g, precision="fp64")
    chunk = hidden_states(c, g, seed=11)
    mask = causal(c, h).copy()
    mask[:, 4] = MASKED  # history key 4 dropped for every row
    run = (
        attention_block
        if form == "dense"
        else (lambda *a, **k: attention_block_tiled(*a, query_tile=2, key_tile=4, **k))
    )
    base = run(chunk, k_hist, v_hist, mask, w, g, precision="fp64").attn_out
    poked = v_hist.copy()
    poked[4] += 100.0
    same = run(chunk, k_hist, poked, mask, w, g, precision="fp64").attn_out
    np.testing.assert_allclose(same, base, rtol=0, atol=1e-12)
    # Negative control: the same change on a visible key (5) moves the output.
    poked = v_hist.copy()
    poked[5] += 100.0
    moved = run(chunk, k_hist, poked, mask, w, g, precision="fp64").attn_out
    assert rel_err(moved, base) > NEGATIVE_CONTROL_MIN


# -- positions and chunked prefill -------------------------------------------------------------------


def test_wrong_start_changes_output():
    g = GEOMETRIES["qwen3"]
    w = make_weights(g)
    c, h = 6, 10
    k_hist, v_hist = history_kv(hidden_states(h, g, seed=12), w, g)
    chunk = hidden_states(c, g, seed=13)
    right = attention_block(chunk, k_hist, v_hist, causal(c, h), w, g)
    same = attention_block(chunk, k_hist, v_hist, causal(c, h), w, g, start=h)
    wrong = attention_block(chunk, k_hist, v_hist, causal(c, h), w, g, start=h + 1)
    np.testing.assert_array_equal(same.attn_out, right.attn_out)
    assert rel_err(wrong.attn_out, right.attn_out) > NEGATIVE_CONTROL_MIN


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_chunked_prefill_equals_one_pass(name):
    g = GEOMETRIES[name]
    w = make_weights(g)
    chunk, n_chunks = 4, 3
    n = chunk * n_chunks
    x = hidden_states(n, g, seed=14)
    empty = np.zeros((0, g.num_kv_heads, g.head_dim))
    whole = attention_block(x, empty, empty, causal(n, 0), w, g, precision="fp64")
    k_all, v_all = history_kv(x, w, g, precision="fp64")
    np.testing.assert_allclose(whole.k_chunk, k_all.transpose(1, 0, 2), rtol=0, atol=1e-12)
    for i in range(n_chunks):
        h = i * chunk
        k_hist, v_hist = history_kv(x[:h], w, g, precision="fp64")
        part = attention_block(x[h : h + chunk], k_hist, v_hist, causal(chunk, h), w, g, precision="fp64")
        assert rel_err(part.attn_out, whole.attn_out[h : h + chunk]) < FP64_TOL
        np.testing.assert_allclose(part.k_chunk, whole.k_chunk[:, h : h + chunk], rtol=0, atol=1e-12)
    # Negative control: the last chunk against a history built from the wrong tokens.
    h = (n_chunks - 1) * chunk
    k_bad, v_bad = history_kv(x[1 : h + 1], w, g, precision="fp64")
    bad = attention_block(x[h:], k_bad, v_bad, causal(chunk, h), w, g, precision="fp64")
    assert rel_err(bad.attn_out, whole.attn_out[h:]) > NEGATIVE_CONTROL_MIN


def test_fp32_close_to_fp64():
    g = GEOMETRIES["qwen3_next"]
    w = make_weights(g)
    c, h = 7, 9
    x_hist, chunk = hidden_states(h, g, seed=15), hidden_states(c, g, seed=16)
    out = {}
    for precision in ("fp32", "fp64"):
        k_hist, v_hist = history_kv(x_hist, w, g, precision=precision)
        assert k_hist.dtype == PRECISIONS[precision]
        out[precision] = attention_block(chunk, k_hist, v_hist, causal(c, h), w, g, precision=precision).attn_out
    assert out["fp32"].dtype == np.float32
    assert rel_err(out["fp32"], out["fp64"]) < FP32_VS_FP64_TOL
    assert rel_err(out["fp32"], out["fp64"]) > 0  # really computed in two precisions


# -- input validation ---------------------------------------------------------------------------------


def test_bad_inputs_raise_with_expected_and_actual():
    g = GEOMETRIES["qwen3_next"]
    w = make_weights(g)
    c, h = 4, 4
    k_hist, v_hist = history_kv(hidden_states(h, g), w, g)
    chunk = hidden_states(c, g)
    with pytest.raises(AnelabInputError, match=r"mask must have shape \[4, 8\], got \[4, 7\]"):
        attention_block(chunk, k_hist, v_hist, causal(c, h)[:, :7], w, g)
    with pytest.raises(AnelabInputError, match=r"v_history must have shape \[4, 2, 16\], got \[3, 2, 16\]"):
        attention_block_tiled(chunk, k_hist, v_hist[:3], causal(c, h), w, g)
    with pytest.raises(AnelabInputError, match=r"hidden must have shape \[tokens, 24\]"):
        attention_block(chunk[:, :20], k_hist, v_hist, causal(c, h), w, g)
    with pytest.raises(AnelabInputError, match="precision"):
        attention_block(chunk, k_hist, v_hist, causal(c, h), w, g, precision="fp16")
    bad_mask = causal(c, h).astype(np.float32)
    bad_mask[0, -1] = -np.inf
    with pytest.raises(AnelabInputError, match="finite"):
        attention_block(chunk, k_hist, v_hist, bad_mask, w, g)
    with pytest.raises(AnelabInputError, match="query_tile"):
        attention_block_tiled(chunk, k_hist, v_hist, causal(c, h), w, g, query_tile=0)
    with pytest.raises(AnelabInputError, match="query_block"):
        attention_block(chunk, k_hist, v_hist, causal(c, h), w, g, query_block=1.5)
    no_norm = make_weights(g)
    no_norm.q_norm = None
    with pytest.raises(AnelabInputError, match="q_norm"):
        attention_block(chunk, k_hist, v_hist, causal(c, h), no_norm, g)
    llama_w = make_weights(GEOMETRIES["llama"])  # q_proj half the rows the gated variant needs
    with pytest.raises(AnelabInputError, match=r"weights.q_proj must have shape \[128, 24\], got \[32, 24\]"):
        history_kv(hidden_states(h, g), llama_w, g)
    # Negative control: the same call with valid inputs runs.
    assert attention_block(chunk, k_hist, v_hist, causal(c, h), w, g).attn_out.shape == (c, 24)
