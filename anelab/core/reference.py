"""Independent NumPy reference of one full-attention block for a prefill chunk: the truth every graph is checked against.

It follows transformers' conventions (RoPE, q/k norms, the gated query of qwen3_next, scaling, soft-cap, GQA,
the declared options of ``anelab.core.geometry``; listed in docs/derivations.md). Shapes: D = hidden_size,
Hq = num_heads, Hkv = num_kv_heads, d = head_dim, C = chunk rows, H = history keys, T = H + C. Two sibling forms
compute the same block: ``attention_block`` (dense, scores ``[Hq, query_block, T]`` at a time) and
``attention_block_tiled`` (online softmax over query and key tiles, one ``[Hq, query_tile, key_tile]`` tile in
memory). RoPE angles are computed in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.masks import MASKED
from anelab.core.matmul import matmul
from anelab.core.rope import interleaved_to_half
from anelab.core.weights import WEIGHT_FIELDS, AttentionWeights

PRECISIONS = {"fp32": np.float32, "fp64": np.float64}
DEFAULT_QUERY_TILE = 256
DEFAULT_KEY_TILE = 1024
DENSE_QUERY_BLOCK = 128  # chunk rows per dense score buffer [Hq, rows, T]
# A mask value at or below this drops the key (masks.MASKED = -30000: exp underflows to exactly 0).
_DROPPED = float(MASKED)


@dataclass
class Projection:
    """Per-head projections of T tokens.

    q     [T, Hq, d]   normed (qwen3*) and rotated, not scaled
    k     [T, Hkv, d]  normed (qwen3*) and rotated
    v     [T, Hkv, d]
    gate  [T, Hq, d] pre-sigmoid (qwen3_next) or None
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    gate: np.ndarray | None


@dataclass
class BlockOutput:
    """What one chunk's block returns (dtype of the precision).

    attn_out  [C, D]        o_proj output (the residual is added by the caller)
    k_chunk   [Hkv, C, d]   the chunk's keys, normed and rotated: what the cache appends
    v_chunk   [Hkv, C, d]
    """

    attn_out: np.ndarray
    k_chunk: np.ndarray
    v_chunk: np.ndarray


# -- validation ----------------------------------------------------------------------------------


def _dtype(precision: str) -> type:
    if precision not in PRECISIONS:
        raise AnelabInputError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[precision]


def _expect_shape(name: str, array: np.ndarray, expected: tuple[int, ...]) -> None:
    actual = tuple(np.shape(array))
    if actual != tuple(expected):
        raise AnelabInputError(f"{name} must have shape {list(expected)}, got {list(actual)}")


def _check_weights(weights: AttentionWeights, geometry: AttentionGeometry) -> None:
    """Every parameter the geometry needs is present with its shape (``geometry.parameter_shapes``)."""
    for hf_name, shape in geometry.parameter_shapes().items():
        name = WEIGHT_FIELDS[hf_name]
        value = getattr(weights, name)
        if value is None:
            raise AnelabInputError(
                f"{geometry.variant} block needs weights.{name} {list(shape)}; load it from the checkpoint"
            )
        _expect_shape(f"weights.{name}", value, shape)


def _check_hidden(name: str, hidden: np.ndarray, geometry: AttentionGeometry) -> int:
    if np.ndim(hidden) != 2 or np.shape(hidden)[1] != geometry.hidden_size:
        raise AnelabInputError(f"{name} must have shape [tokens, {geometry.hidden_size}], got {list(np.shape(hidden))}")
    return int(np.shape(hidden)[0])


# -- building blocks -----------------------------------------------------------------------------


def rope_cos_sin(
    positions: np.ndarray,
    geometry: AttentionGeometry,
    dtype=np.float32,
    *,
    layer: int | None = None,
    coverage: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables for absolute ``positions`` [T] -> (cos [T, rotary_dim], sin [T, rotary_dim]).

    ``cat(freqs, freqs)`` layout: columns j and j + rotary_dim/2 share ``inv_freq[j]`` of the layer's
    table (``geometry.rope_frequencies(layer, coverage)``; default: the first attention layer), both
    multiplied by the RoPE type's attention factor.
    """
    positions = np.asarray(positions)
    if positions.ndim != 1:
        raise AnelabInputError(f"positions must be 1-D [T], got shape {list(positions.shape)}")
    if positions.size and (not np.issubdtype(positions.dtype, np.integer) or positions.min() < 0):
        raise AnelabInputError("positions must be non-negative integers (absolute token positions)")
    layer = geometry.full_attention_layers[0] if layer is None else layer
    inv_freq, factor = geometry.rope_frequencies(layer, coverage)
    freqs = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, rot/2]
    emb = np.concatenate([freqs, freqs], axis=-1)  # [T, rot]
    if factor == 1.0:
        return np.cos(emb).astype(dtype), np.sin(emb).astype(dtype)
    return (np.cos(emb) * factor).astype(dtype), (np.sin(emb) * factor).astype(dtype)


def apply_rope_interleaved(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """GLM-style RoPE: rotate adjacent pairs (2i, 2i+1) of the first rotary_dim dims by frequency i.

    x [T, heads, d]; cos, sin [T, rotary_dim] in the ``cat(freqs, freqs)`` layout (only the first
    half is read) -> new array [T, heads, d]:
    ``y[2i] = x[2i] cos_i - x[2i+1] sin_i``, ``y[2i+1] = x[2i+1] cos_i + x[2i] sin_i``
    (transformers models/glm4 rotate_half + repeat_interleave).
    """
    rot = cos.shape[-1]
    half = rot // 2
    out = x.copy()
    c = cos[:, None, :half]
    s = sin[:, None, :half]
    even = x[..., 0:rot:2]
    odd = x[..., 1:rot:2]
    out[..., 0:rot:2] = even * c - odd * s
    out[..., 1:rot:2] = odd * c + even * s
    return out


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate the first rotary_dim dims of every head; the remaining dims pass through.

    x [T, heads, d]; cos, sin [T, rotary_dim] -> new array [T, heads, d].
    ``x_rot * cos + rotate_half(x_rot) * sin`` with ``rotate_half(x) = cat(-x2, x1)``.
    """
    rot = cos.shape[-1]
    half = rot // 2
    out = x.copy()
    c = cos[:, None, :]
    s = sin[:, None, :]
    x1 = x[..., :half]
    x2 = x[..., half:rot]
    out[..., :half] = x1 * c[..., :half] - x2 * s[..., :half]
    out[..., half:rot] = x2 * c[..., half:] + x1 * s[..., half:]
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * weight``. x [..., d], weight [d]."""
    mean_sq = np.einsum("...i,...i->...", x, x) / x.shape[-1]  # no [.., d] temporary for x**2
    inv = 1.0 / np.sqrt(mean_sq + eps)
    out = x * inv[..., None].astype(x.dtype, copy=False)
    out *= weight
    return out


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # 0.5 * (1 + tanh(x / 2)) == 1 / (1 + exp(-x)), without overflow for large negative x.
    out = np.tanh(x * 0.5)
    out += 1.0
    out *= 0.5
    return out


def _linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, dtype) -> np.ndarray:
    """x [T, in] @ w[out, in].T (+ b) -> [T, out] in dtype."""
    y = matmul(x, w.astype(dtype, copy=False).T)
    if b is not None:
        y += b.astype(dtype, copy=False)
    return y


def _rotate(x, positions, geometry, layer, coverage, dtype):
    """x [T, heads, d] -> rotated at ``positions`` in the layer's RoPE (none on a NoPE layer), in the
    cache layout: an interleaved layer is rotated GLM-style, then its rotary channels are reordered
    to the half-rotated order the sidecar's cache holds (``rope.interleaved_to_half``; q.k unchanged)."""
    g = geometry
    if not g.uses_rope(layer):
        return x
    cos, sin = rope_cos_sin(positions, g, dtype, layer=layer, coverage=coverage)
    if g.rope_layout == "interleaved":
        return np.ascontiguousarray(interleaved_to_half(apply_rope_interleaved(x, cos, sin), g.rotary_dim))
    return apply_rope(x, cos, sin)


def _norm_heads(x: np.ndarray, weight: np.ndarray, geometry: AttentionGeometry) -> np.ndarray:
    """q or k [T, heads, d] -> RMS-normed per head ([d] weight) or over the whole projection
    ([heads * d] weight, OLMo 2), or unchanged."""
    kind = geometry.qk_norm_kind
    if kind == "per_head":
        return rms_norm(x, weight, geometry.rms_norm_eps)
    if kind == "projection":
        t, heads, d = x.shape
        return rms_norm(x.reshape(t, heads * d), weight, geometry.rms_norm_eps).reshape(t, heads, d)
    return x


def _project_q(hidden, positions, weights, geometry, dtype, coverage=None):
    """-> q [T, Hq, d] normed+rotated, gate [T, Hq, d] contiguous or None."""
    g = geometry
    t = hidden.shape[0]
    raw = _linear(hidden, weights.q_proj, weights.q_bias, dtype)
    gate = None
    if g.is_gated:
        per_head = raw.reshape(t, g.num_heads, 2 * g.head_dim)  # query first, then gate, per head
        q = per_head[..., : g.head_dim]
        gate = np.ascontiguousarray(per_head[..., g.head_dim :])
    else:
        q = raw.reshape(t, g.num_heads, g.head_dim)
    if g.has_qk_norm:
        q = _norm_heads(q, weights.q_norm.astype(dtype, copy=False), g)
    return _rotate(q, positions, g, weights.layer, coverage, dtype), gate


def _project_kv(hidden, positions, weights, geometry, dtype, coverage=None):
    """-> k [T, Hkv, d] normed+rotated (cache layout), v [T, Hkv, d]."""
    g = geometry
    t = hidden.shape[0]
    k = _linear(hidden, weights.k_proj, weights.k_bias, dtype).reshape(t, g.num_kv_heads, g.head_dim)
    v = _linear(hidden, weights.v_proj, weights.v_bias, dtype).reshape(t, g.num_kv_heads, g.head_dim)
    if g.has_qk_norm:
        k = _norm_heads(k, weights.k_norm.astype(dtype, copy=False), g)
    return _rotate(k, positions, g, weights.layer, coverage, dtype), v


def project(
    hidden: np.ndarray,
    positions: np.ndarray,
    weights: AttentionWeights,
    geometry: AttentionGeometry,
    precision: str = "fp32",
    *,
    rope_coverage: int | None = None,
) -> Projection:
    """Project hidden [T, D] at absolute positions [T] to per-head q, k, v (and gate).

    ``rope_coverage``: the package coverage that picks a dynamic / longrope table (see
    ``AttentionGeometry.rope_frequencies``); other RoPE types ignore it."""
    dtype = _dtype(precision)
    _check_weights(weights, geometry)
    t = _check_hidden("hidden", hidden, geometry)
    positions = np.asarray(positions)
    _expect_shape("positions", positions, (t,))
    hidden = np.asarray(hidden).astype(dtype, copy=False)
    q, gate = _project_q(hidden, positions, weights, geometry, dtype, rope_coverage)
    k, v = _project_kv(hidden, positions, weights, geometry, dtype, rope_coverage)
    return Projection(q=q, k=k, v=v, gate=gate)


def history_kv(
    hidden_history: np.ndarray,
    weights: AttentionWeights,
    geometry: AttentionGeometry,
    precision: str = "fp32",
    *,
    rope_coverage: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The cache contents for a history: hidden_history [H, D] at positions 0 .. H-1 ->
    (k_history [H, Hkv, d] normed+rotated, v_history [H, Hkv, d]), token-major."""
    dtype = _dtype(precision)
    _check_weights(weights, geometry)
    h = _check_hidden("hidden_history", hidden_history, geometry)
    hidden_history = np.asarray(hidden_history).astype(dtype, copy=False)
    return _project_kv(hidden_history, np.arange(h), weights, geometry, dtype, rope_coverage)


def _gate_and_output(attn: np.ndarray, gate: np.ndarray | None, weights: AttentionWeights, dtype) -> np.ndarray:
    """attn [T, Hq, d] (softmax-weighted V per head), gate [T, Hq, d] | None -> o_proj output [T, D]."""
    t = attn.shape[0]
    if gate is not None:
        attn *= _sigmoid(gate)
    return _linear(attn.reshape(t, -1), weights.o_proj, weights.o_bias, dtype)


# -- the block -----------------------------------------------------------------------------------


@dataclass
class _Prepared:
    hidden: np.ndarray  # [C, D] dtype
    positions: np.ndarray  # [C] absolute positions of the chunk rows
    k_all: np.ndarray  # [Hkv, T, d] history keys then chunk keys
    v_all: np.ndarray  # [Hkv, T, d]
    k_chunk: np.ndarray  # [Hkv, C, d] (view into k_all)
    v_chunk: np.ndarray  # [Hkv, C, d]
    mask: np.ndarray  # [C, T] additive, as given (cast per use)
    dtype: type
    coverage: int | None  # picks a dynamic / longrope RoPE table


def _prepare(hidden, k_history, v_history, mask, weights, geometry, start, precision, coverage) -> _Prepared:
    g = geometry
    dtype = _dtype(precision)
    _check_weights(weights, g)
    c = _check_hidden("hidden", hidden, g)
    if c == 0:
        raise AnelabInputError("hidden has no rows; a chunk needs at least one token")
    if np.ndim(k_history) != 3:
        raise AnelabInputError(
            f"k_history must have shape [H, {g.num_kv_heads}, {g.head_dim}], got {list(np.shape(k_history))}"
        )
    h = int(np.shape(k_history)[0])
    _expect_shape("k_history", k_history, (h, g.num_kv_heads, g.head_dim))
    _expect_shape("v_history", v_history, (h, g.num_kv_heads, g.head_dim))
    _expect_shape("mask", mask, (c, h + c))
    mask = np.asarray(mask)
    if not np.all(np.isfinite(mask)):
        raise AnelabInputError("mask must be finite; drop keys with masks.MASKED (-30000), not -inf")
    if start is None:
        start = h
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
        raise AnelabInputError(f"start must be a non-negative integer position, got {start!r}")
    hidden = np.asarray(hidden).astype(dtype, copy=False)
    positions = int(start) + np.arange(c)
    k_new, v_new = _project_kv(hidden, positions, weights, g, dtype, coverage)
    # Head-major K and V over the whole coverage, so each KV head is one contiguous [T, d] matrix.
    k_all = np.empty((g.num_kv_heads, h + c, g.head_dim), dtype)
    v_all = np.empty_like(k_all)
    k_all[:, :h] = np.asarray(k_history).transpose(1, 0, 2)
    v_all[:, :h] = np.asarray(v_history).transpose(1, 0, 2)
    k_all[:, h:] = k_new.transpose(1, 0, 2)
    v_all[:, h:] = v_new.transpose(1, 0, 2)
    return _Prepared(hidden, positions, k_all, v_all, k_all[:, h:], v_all[:, h:], mask, dtype, coverage)


def _grouped_queries(q: np.ndarray, geometry: AttentionGeometry, scale: float) -> np.ndarray:
    """q [R, Hq, d] -> scaled, contiguous [Hkv, group, R, d]: query head h = kv * group + j."""
    g = geometry
    r = q.shape[0]
    grouped = np.ascontiguousarray(q.reshape(r, g.num_kv_heads, g.group_size, g.head_dim).transpose(1, 2, 0, 3))
    grouped *= scale
    return grouped


def _ungroup(out: np.ndarray, geometry: AttentionGeometry) -> np.ndarray:
    """[Hkv, group, R, d] -> [R, Hq, d] (contiguous)."""
    g = geometry
    rows = out.shape[2]
    return np.ascontiguousarray(out.transpose(2, 0, 1, 3)).reshape(rows, g.num_heads, g.head_dim)


def _scores(q_rows: np.ndarray, k_all: np.ndarray, k0: int, k1: int, buffer: np.ndarray) -> np.ndarray:
    """Scores of query rows against keys k0..k1, written into (the front of) a reused buffer.

    q_rows [Hkv, group, R, d] -> [Hkv, group * R, k1 - k0]. Reusing one buffer avoids faulting in
    fresh pages for every block.
    """
    hkv, group, rows, d = q_rows.shape
    s = buffer[: hkv * group * rows * (k1 - k0)].reshape(hkv, group * rows, k1 - k0)
    matmul(np.ascontiguousarray(q_rows).reshape(hkv, group * rows, d), k_all[:, k0:k1].transpose(0, 2, 1), out=s)
    return s


def _softcap(s: np.ndarray, geometry: AttentionGeometry) -> None:
    """In place: ``cap * tanh(s / cap)`` on scaled scores, before the mask (Gemma 2); no-op without a cap."""
    cap = geometry.logit_softcap
    if cap is not None:
        s /= cap
        np.tanh(s, out=s)
        s *= cap


def _add_mask(s: np.ndarray, mask_tile: np.ndarray, group: int) -> None:
    """s [Hkv, group * R, K] += mask_tile [R, K], broadcast over every head."""
    hkv, _, keys = s.shape
    per_head = s.reshape(hkv, group, mask_tile.shape[0], keys)
    per_head += mask_tile.astype(s.dtype, copy=False)


def scored_widths(mask_rows: np.ndarray, score_bound: float, block: int) -> list[int]:
    """How many leading keys each block of ``block`` rows must score under an additive mask [R, T].

    A key past a block's width lies, for every row of the block, more than ``margin`` below the row's
    largest mask value, with ``margin`` = 2 x ``score_bound`` (a bound on |q . k|) + 2**-9 of the
    magnitudes involved (fp16 rounding slack) + 128: its score sits at least 128 below the row's
    maximum, so its softmax weight exp(score - max) is exactly 0 in float32 and float64 alike. A
    non-finite bound or mask keeps every key. Returns one width per block.
    """
    rows, t = mask_rows.shape
    top = mask_rows.max(axis=1).astype(np.float64)  # [R]
    margin = 2 * score_bound + 2.0**-9 * (np.abs(top).max(initial=0.0) + abs(_DROPPED) + score_bound) + 128.0
    if not (np.isfinite(margin) and np.all(np.isfinite(top))):
        return [t] * -(-rows // block)
    seen = mask_rows >= (top - margin).astype(mask_rows.dtype)[:, None]  # [R, T]
    last = t - 1 - np.argmax(seen[:, ::-1], axis=1)  # the last key each row must score
    return [int(last[r0 : r0 + block].max()) + 1 for r0 in range(0, rows, block)]


def score_bound(q: np.ndarray, k: np.ndarray) -> float:
    """A bound on |q . k| over all rows of q [..., d] and k [..., d] (Cauchy-Schwarz, with slack)."""
    qn = np.einsum("...i,...i->...", q, q, dtype=np.float64).max(initial=0.0)
    kn = np.einsum("...i,...i->...", k, k, dtype=np.float64).max(initial=0.0)
    return float(np.sqrt(qn) * np.sqrt(kn) * 1.001)


def _check_tile(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise AnelabInputError(f"{name} must be a positive integer, got {value!r}")


def attention_block(
    hidden: np.ndarray,
    k_history: np.ndarray,
    v_history: np.ndarray,
    mask: np.ndarray,
    weights: AttentionWeights,
    geometry: AttentionGeometry,
    *,
    start: int | None = None,
    precision: str = "fp32",
    query_block: int = DENSE_QUERY_BLOCK,
    rope_coverage: int | None = None,
) -> BlockOutput:
    """Dense reference of the block for one chunk: every row's softmax over all T keys at once.

    hidden     [C, D]          the chunk's (already normed) hidden states
    k_history  [H, Hkv, d]     cached keys at positions 0 .. H-1 (normed+rotated), token-major
    v_history  [H, Hkv, d]
    mask       [C, H + C]      additive: 0 attend, masks.MASKED drop (any finite values allowed)
    start      absolute position of the chunk's first row (default H; H+1 builds a wrong-RoPE control)
    rope_coverage  the package coverage that picks a dynamic / longrope RoPE table (else ignored)

    Per the geometry's options: scores are scaled by ``attention_scale``, soft-capped
    (``logit_softcap``) before the mask; q/k normed per head or over the projection; the layer
    (``weights.layer``) rotated by its own RoPE table, or not at all (NoPE); interleaved layers
    return K in the cache's half-rotated channel order.

    Scores [Hkv, group * rows, T] — GQA by grouping query heads against each KV head instead of
    repeating K — are computed ``query_block`` chunk rows at a time into one reused buffer (the
    math is the plain two-pass softmax; blocking only keeps the buffer hot and avoids faulting in
    a fresh [Hq, C, T] array). A fully masked row stays finite: the softmax subtracts the row max,
    so a constant MASKED shift cancels and the row attends as if unmasked.
    """
    _check_tile("query_block", query_block)
    p = _prepare(hidden, k_history, v_history, mask, weights, geometry, start, precision, rope_coverage)
    g = geometry
    c = p.hidden.shape[0]
    t = p.k_all.shape[1]
    q, gate = _project_q(p.hidden, p.positions, weights, g, p.dtype, p.coverage)
    qg = _grouped_queries(q, g, g.attention_scale)  # scale folded into q (C*Hq*d work, not C*T*Hq)
    del q
    out = np.empty_like(qg)  # [Hkv, group, C, d]
    buffer = np.empty(g.num_heads * min(query_block, c) * t, p.dtype)
    for c0 in range(0, c, query_block):
        c1 = min(c0 + query_block, c)
        s = _scores(qg[:, :, c0:c1], p.k_all, 0, t, buffer)  # [Hkv, group*rows, T]
        _softcap(s, g)
        _add_mask(s, p.mask[c0:c1], g.group_size)
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        row_sum = s.sum(axis=-1, keepdims=True)
        rows_out = matmul(s, p.v_all)  # [Hkv, group*rows, d]
        rows_out /= row_sum
        out[:, :, c0:c1] = rows_out.reshape(g.num_kv_heads, g.group_size, c1 - c0, g.head_dim)
    del buffer, qg
    attn_out = _gate_and_output(_ungroup(out, g), gate, weights, p.dtype)
    return BlockOutput(attn_out, np.ascontiguousarray(p.k_chunk), np.ascontiguousarray(p.v_chunk))


def attention_block_tiled(
    hidden: np.ndarray,
    k_history: np.ndarray,
    v_history: np.ndarray,
    mask: np.ndarray,
    weights: AttentionWeights,
    geometry: AttentionGeometry,
    *,
    start: int | None = None,
    precision: str = "fp32",
    query_tile: int = DEFAULT_QUERY_TILE,
    key_tile: int = DEFAULT_KEY_TILE,
    rope_coverage: int | None = None,
) -> BlockOutput:
    """Tiled reference of the block (same arguments and result as ``attention_block``).

    For each query tile (``query_tile`` chunk rows, projected on the fly) and each key tile
    (``key_tile`` positions of the coverage), one score tile [Hkv, group * q_tile, k_tile] updates
    a running row max ``m``, running sum ``l`` and a rescaled accumulator ``acc`` [Hkv, group*q_tile, d]
    (online softmax, Dao et al. 2022). Peak memory: inputs, K/V [Hkv, T, d], the output [C, D] and
    per-tile arrays — never [Hq, C, T].

    A key tile whose mask is entirely dropped (<= masks.MASKED) is skipped when every row of the
    query tile has some visible key: its weights are exp(-30000 + ...) == 0 exactly, as in the dense
    form. Rows with no visible key visit every tile, so they match the dense form (finite).
    """
    _check_tile("query_tile", query_tile)
    _check_tile("key_tile", key_tile)
    p = _prepare(hidden, k_history, v_history, mask, weights, geometry, start, precision, rope_coverage)
    g = geometry
    dtype = p.dtype
    c = p.hidden.shape[0]
    t = p.k_all.shape[1]
    scale = g.attention_scale
    attn_out = np.empty((c, g.hidden_size), dtype)
    buffer = np.empty(g.num_heads * min(query_tile, c) * min(key_tile, t), dtype)
    for q0 in range(0, c, query_tile):
        q1 = min(q0 + query_tile, c)
        rows = q1 - q0
        q, gate = _project_q(p.hidden[q0:q1], p.positions[q0:q1], weights, g, dtype, p.coverage)
        qg = _grouped_queries(q, g, scale)  # [Hkv, group, rows, d]
        del q
        mask_rows = p.mask[q0:q1]
        every_row_sees_a_key = bool(np.all(np.any(mask_rows > _DROPPED, axis=1)))
        m = np.full((g.num_kv_heads, g.group_size * rows, 1), -np.inf, dtype)  # running row max
        l = np.zeros_like(m)  # running sum of exp(score - m)
        acc = np.zeros((g.num_kv_heads, g.group_size * rows, g.head_dim), dtype)  # running sum of exp(...) V
        for k0 in range(0, t, key_tile):
            k1 = min(k0 + key_tile, t)
            mask_tile = mask_rows[:, k0:k1]
            if every_row_sees_a_key and not np.any(mask_tile > _DROPPED):
                continue
            s = _scores(qg, p.k_all, k0, k1, buffer)  # [Hkv, group*rows, k_tile]
            _softcap(s, g)
            _add_mask(s, mask_tile, g.group_size)
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            alpha = np.exp(m - m_new)  # rescales what was accumulated under the old max; exp(-inf) = 0
            s -= m_new
            np.exp(s, out=s)
            l *= alpha
            l += s.sum(axis=-1, keepdims=True)
            acc *= alpha
            acc += matmul(s, p.v_all[:, k0:k1])
            m = m_new
        acc /= l
        per_head = _ungroup(acc.reshape(g.num_kv_heads, g.group_size, rows, g.head_dim), g)
        attn_out[q0:q1] = _gate_and_output(per_head, gate, weights, dtype)
    return BlockOutput(attn_out, np.ascontiguousarray(p.k_chunk), np.ascontiguousarray(p.v_chunk))
