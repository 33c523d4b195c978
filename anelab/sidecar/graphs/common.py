"""MIL building blocks shared by every sidecar graph design (norms, RoPE, projections, I/O specs)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from anelab.core.geometry import AttentionGeometry
from anelab.core.rope import interleaved_to_half
from anelab.core.weights import AttentionWeights

# RMSNorm in fp16: x is divided by its per-row max |x| (floored) before squaring, so x*x cannot
# overflow fp16's 65504 whatever the activation scale.
RMS_SCALE_FLOOR = 2.0**-10


@dataclass(frozen=True)
class SidecarShape:
    """Static shape of one sidecar function: chunk width C and history H (= chunk start), and the
    package coverage that picks a dynamic / longrope RoPE table (None for other RoPE types)."""

    chunk: int
    history: int
    rope_coverage: int | None = None

    @property
    def total(self) -> int:
        return self.history + self.chunk


def rope_tables(geometry: AttentionGeometry, layer: int, chunk: int, history: int, coverage: int | None = None):
    """cos/sin of i*theta_j for i < chunk ([chunk, 1, rot/2]) and of history*theta_j ([1, 1, rot/2]),
    computed in float64 and stored as fp16. theta_j and the RoPE type's attention factor come from
    ``geometry.rope_frequencies(layer, coverage)``; the factor scales the first pair only, so the
    two rotations together scale by it once."""
    inv_freq, factor = geometry.rope_frequencies(layer, coverage)
    offsets = np.arange(chunk, dtype=np.float64)[:, None] * inv_freq[None, :]
    start = float(history) * inv_freq
    as16 = lambda a: a.astype(np.float16)  # noqa: E731
    cos_i, sin_i = np.cos(offsets), np.sin(offsets)
    if factor != 1.0:
        cos_i, sin_i = cos_i * factor, sin_i * factor
    return (
        as16(cos_i)[:, None, :],
        as16(sin_i)[:, None, :],
        as16(np.cos(start))[None, None, :],
        as16(np.sin(start))[None, None, :],
    )


def rope_position_tables(geometry: AttentionGeometry, layer: int, capacity: int):
    """cos/sin of p*theta_j (times the attention factor) for every position p < capacity,
    [capacity, rot/2], float64 -> fp16; the table is picked for coverage = capacity."""
    inv_freq, factor = geometry.rope_frequencies(layer, capacity)
    angles = np.arange(capacity, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.astype(np.float16), sin.astype(np.float16)


def half_layout_weights(geometry: AttentionGeometry, weights: AttentionWeights) -> AttentionWeights:
    """An interleaved-RoPE layer's weights with each head's q/k rows (and biases, per-head norm
    weights) reordered by ``rope.interleaved_to_half``, so the half-rotated graph computes the same
    q.k; its K outputs are then in that half-rotated channel order. Other layouts: unchanged."""
    g = geometry
    if g.rope_layout != "interleaved":
        return weights

    def per_head_rows(a, heads):
        if a is None:
            return None
        lead = a.reshape(heads, g.head_dim, *a.shape[1:])
        moved = np.moveaxis(lead, 1, -1)  # the head_dim axis last, for interleaved_to_half
        return np.moveaxis(interleaved_to_half(moved, g.rotary_dim), -1, 1).reshape(a.shape)

    def norm(a):
        if a is None:
            return None
        return (
            interleaved_to_half(a, g.rotary_dim) if a.shape == (g.head_dim,) else per_head_rows(a, a.size // g.head_dim)
        )

    Hq, Hkv = g.num_heads, g.num_kv_heads
    return replace(
        weights,
        q_proj=per_head_rows(weights.q_proj, Hq),
        k_proj=per_head_rows(weights.k_proj, Hkv),
        q_bias=per_head_rows(weights.q_bias, Hq),
        k_bias=per_head_rows(weights.k_bias, Hkv),
        q_norm=norm(weights.q_norm),
        k_norm=norm(weights.k_norm),
    )


def softcap(mb, scores, geometry: AttentionGeometry):
    """``cap * tanh(scores / cap)`` on the scaled scores, before the mask (Gemma 2); unchanged without a cap."""
    cap = geometry.logit_softcap
    if cap is None:
        return scores
    return mb.mul(x=mb.tanh(x=mb.mul(x=scores, y=np.float16(1.0 / cap))), y=np.float16(cap))


def rms_norm(mb, x, weight: np.ndarray, eps: float, name: str):
    """Per-head RMSNorm over the last axis of x [..., d], overflow-safe in fp16."""
    peak = mb.reduce_max(x=mb.abs(x=x), axes=[-1], keep_dims=True)
    peak = mb.maximum(x=peak, y=np.float16(RMS_SCALE_FLOOR))
    scaled = mb.real_div(x=x, y=peak)
    mean_sq = mb.reduce_mean(x=mb.mul(x=scaled, y=scaled), axes=[-1], keep_dims=True)
    # x / sqrt(mean(x^2) + eps) == scaled / sqrt(mean(scaled^2) + eps / peak^2)
    eps_scaled = mb.real_div(x=np.float16(eps) if eps >= 6e-8 else np.float16(6e-8), y=mb.mul(x=peak, y=peak))
    inv_rms = mb.rsqrt(x=mb.add(x=mean_sq, y=eps_scaled), epsilon=np.float16(1e-7))
    return mb.mul(x=mb.mul(x=scaled, y=inv_rms), y=weight.astype(np.float16), name=name)


def rope(mb, x, cos, sin, geometry: AttentionGeometry, name: str):
    """Rotate the first rotary_dim dims of each head of x [C, heads, d] (rotate_half pairing)."""
    d, rot = geometry.head_dim, geometry.rotary_dim
    half = rot // 2
    x1 = mb.slice_by_index(x=x, begin=[0, 0, 0], end=[0, 0, half], end_mask=[True, True, False])
    x2 = mb.slice_by_index(x=x, begin=[0, 0, half], end=[0, 0, rot], end_mask=[True, True, False])
    r1 = mb.sub(x=mb.mul(x=x1, y=cos), y=mb.mul(x=x2, y=sin))
    r2 = mb.add(x=mb.mul(x=x2, y=cos), y=mb.mul(x=x1, y=sin))
    parts = [r1, r2]
    if rot < d:
        parts.append(mb.slice_by_index(x=x, begin=[0, 0, rot], end=[0, 0, d], end_mask=[True, True, True]))
    return mb.concat(values=parts, axis=-1, name=name)


def linear(mb, x, weight: np.ndarray, bias: np.ndarray | None, name: str):
    kw = {"bias": bias.astype(np.float16)} if bias is not None else {}
    return mb.linear(x=x, weight=weight.astype(np.float16), name=name, **kw)


def per_history_specs(mb, types, g: AttentionGeometry, C: int, H: int):
    """Input specs of a per-history function: hidden [C, D], (k_history, v_history [H, Hkv, d]), mask [C, H + C]."""
    specs = [mb.TensorSpec(shape=(C, g.hidden_size), dtype=types.fp16)]
    if H > 0:
        specs += [mb.TensorSpec(shape=(H, g.num_kv_heads, g.head_dim), dtype=types.fp16) for _ in range(2)]
    specs.append(mb.TensorSpec(shape=(C, H + C), dtype=types.fp16))
    return specs


def per_history_program(ct, mb, specs, body, H: int):
    """Wrap ``body(hidden, k_history, v_history, mask)`` as a MIL program (no history inputs in h0)."""
    if H > 0:

        @mb.program(input_specs=specs, opset_version=ct.target.iOS18)
        def prog(hidden, k_history, v_history, mask):
            return body(hidden, k_history, v_history, mask)
    else:

        @mb.program(input_specs=specs, opset_version=ct.target.iOS18)
        def prog(hidden, mask):
            return body(hidden, None, None, mask)

    return prog


def attention_output(mb, g: AttentionGeometry, weights: AttentionWeights, context, gate, C: int):
    """context [Hkv, group, C, d] -> (gated) [C, Hq*d] -> o_proj -> attn_out [C, D]."""
    Hq, d = g.num_heads, g.head_dim
    context = mb.transpose(x=mb.reshape(x=context, shape=[Hq, C, d]), perm=[1, 0, 2])  # [C, Hq, d]
    if gate is not None:
        context = mb.mul(x=context, y=mb.sigmoid(x=gate))
    context = mb.reshape(x=context, shape=[C, Hq * d])
    return linear(mb, context, weights.o_proj, weights.o_bias, "attn_out")


def no_rotation(x, name):
    """The rotation of a layer without RoPE (SmolLM3's NoPE layers): x unchanged."""
    return x


def static_rotation(mb, g: AttentionGeometry, C: int, H: int, layer: int, coverage: int | None = None):
    """RoPE for positions H..H+C-1 known at export time: by i*theta, then by H*theta (as the dense graph).
    ``coverage`` picks a dynamic / longrope table; a NoPE layer gets ``no_rotation``."""
    if not g.uses_rope(layer):
        return no_rotation
    cos_i, sin_i, cos_h, sin_h = rope_tables(g, layer, C, H, coverage)

    def rotate(x, name):
        x = rope(mb, x, cos_i, sin_i, g, name if H == 0 else f"{name}_i")
        return rope(mb, x, cos_h, sin_h, g, name) if H > 0 else x

    return rotate


def project_chunk(mb, g: AttentionGeometry, weights: AttentionWeights, hidden, C: int, rotate):
    """Projections, QK-norm and RoPE (``rotate(x [C, heads, d], name)``) of one chunk, as the dense graph.

    Returns (q [Hkv, group*C, d] scaled by ``g.attention_scale``, gate [C, Hq, d] or None,
    k_chunk [Hkv, C, d], v_chunk [Hkv, C, d]). q/k norms per head ([d]) or over the whole
    projection ([Hq*d] / [Hkv*d], OLMo 2); an interleaved-RoPE layer's rows are reordered first
    (``half_layout_weights``).
    """
    Hq, Hkv, d = g.num_heads, g.num_kv_heads, g.head_dim
    weights = half_layout_weights(g, weights)
    whole_projection_norm = g.qk_norm_kind == "projection"  # before the head split: over [Hq*d] and [Hkv*d]
    q = linear(mb, hidden, weights.q_proj, weights.q_bias, "q_proj")
    if whole_projection_norm:
        q = rms_norm(mb, q, weights.q_norm, g.rms_norm_eps, "q_normed")
    gate = None
    if g.is_gated:  # per head: d query rows, then d gate rows
        q, gate = mb.split(x=mb.reshape(x=q, shape=[C, Hq, 2 * d]), num_splits=2, axis=-1)
    else:
        q = mb.reshape(x=q, shape=[C, Hq, d])
    k = linear(mb, hidden, weights.k_proj, weights.k_bias, "k_proj")
    if whole_projection_norm:
        k = rms_norm(mb, k, weights.k_norm, g.rms_norm_eps, "k_normed")
    k = mb.reshape(x=k, shape=[C, Hkv, d])
    v = mb.reshape(x=linear(mb, hidden, weights.v_proj, weights.v_bias, "v_proj"), shape=[C, Hkv, d])
    if g.qk_norm_kind == "per_head":
        q = rms_norm(mb, q, weights.q_norm, g.rms_norm_eps, "q_normed")
        k = rms_norm(mb, k, weights.k_norm, g.rms_norm_eps, "k_normed")
    q, k = rotate(q, "q_rotated"), rotate(k, "k_rotated")
    k_chunk = mb.transpose(x=k, perm=[1, 0, 2], name="k_chunk")
    v_chunk = mb.transpose(x=v, perm=[1, 0, 2], name="v_chunk")
    q = mb.mul(x=q, y=np.float16(g.attention_scale))
    q = mb.reshape(x=mb.transpose(x=q, perm=[1, 0, 2]), shape=[Hkv, g.group_size * C, d])
    return q, gate, k_chunk, v_chunk


def cache_for_attention(mb, state, updated):
    """The cache the attention reads after this chunk's update: the ``slice_update`` result itself.

    Not a second ``read_state``: coremltools' ``common::remove_redundant_ops`` merges a second
    ``read_state`` of the same state with the first, so it would silently read the cache as it was
    *before* the update (tests/sidecar/test_stateful.py and tests/sidecar/test_stateful_tiled.py swap this function to
    show verification catches it).
    """
    return updated


def update_kv_cache(mb, g: AttentionGeometry, states, chunk_kv, start, C: int) -> list:
    """Write the chunk's K and V ([Hkv, C, d] each) at slots [start, start + C) of the states ``k_cache``
    / ``v_cache`` [Hkv, capacity, d] (``slice_update``), update the states, and return the two caches the
    attention reads (``cache_for_attention``). ``start``: the int32 [1] input."""
    zero = np.zeros(1, np.int32)
    begin = mb.concat(values=[zero, start, zero], axis=0)
    size = [np.array([g.num_kv_heads], np.int32), mb.add(x=start, y=np.int32(C)), np.array([g.head_dim], np.int32)]
    end = mb.concat(values=size, axis=0)
    caches = []
    for state, new in zip(states, chunk_kv, strict=True):
        updated = mb.slice_update(x=mb.read_state(input=state), update=new, begin=begin, end=end)
        mb.coreml_update_state(state=state, value=updated)
        caches.append(cache_for_attention(mb, state, updated))
    return caches
