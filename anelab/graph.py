"""MIL graph builders for one full-attention layer's sidecar function.

Every builder returns a MIL ``Program`` whose single function ``main`` serves one chunk of width C
that starts at absolute position H (the history length):

Inputs (fp16):
  hidden     [C, D]        post-input-norm hidden rows of the chunk
  k_history  [H, Hkv, d]   token-major K cache (normed and rotated), absent when H == 0
  v_history  [H, Hkv, d]   token-major V cache, absent when H == 0
  mask       [C, H + C]    additive mask (0 = attend, -30000 = drop); arbitrary, not causal by contract
Outputs (fp16):
  attn_out   [C, D]        attention branch output after o_proj
  k_chunk    [Hkv, C, d]   the chunk's K in cache layout (normed and rotated)
  v_chunk    [Hkv, C, d]   the chunk's V in cache layout

The graph is written independently of ``anelab.reference`` (which is the NumPy check on it).
Builders: ``build_dense_program`` (scores all H + C keys at once), ``build_tiled_program`` (same
contract; online softmax over key tiles) and ``build_stateful_program`` (a different contract: K/V
live in Core ML state, see its docstring).

RoPE for positions H..H+C-1 is two rotations: by i*theta from tables shared by every history
(cos/sin of i*theta for i < C), then by H*theta (a per-history vector of a few bytes), so the
weights of a multifunction package stay shared across its functions.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

import numpy as np

from anelab.checkpoint import AttentionWeights
from anelab.geometry import AttentionGeometry

INPUT_NAMES = ("hidden", "k_history", "v_history", "mask")
OUTPUT_NAMES = ("attn_out", "k_chunk", "v_chunk")
# RMSNorm in fp16: x is divided by its per-row max |x| (floored) before squaring, so x*x cannot
# overflow fp16's 65504 whatever the activation scale.
RMS_SCALE_FLOOR = 2.0**-10


@contextlib.contextmanager
def quiet_coremltools():
    """Silence coremltools' import warnings and pass progress bars (they go to stderr)."""
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def coremltools_modules():
    """(ct, mb, types) imported quietly."""
    with quiet_coremltools():
        import coremltools as ct
        from coremltools.converters.mil import Builder as mb
        from coremltools.converters.mil.mil import types
    return ct, mb, types


@dataclass(frozen=True)
class SidecarShape:
    """Static shape of one sidecar function: chunk width C and history H (= chunk start)."""

    chunk: int
    history: int

    @property
    def total(self) -> int:
        return self.history + self.chunk


def _rope_tables(geometry: AttentionGeometry, chunk: int, history: int):
    """cos/sin of i*theta_j for i < chunk ([chunk, 1, rot/2]) and of history*theta_j ([1, 1, rot/2]),
    computed in float64 and stored as fp16."""
    rot = geometry.rotary_dim
    inv_freq = 1.0 / (geometry.rope_theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
    offsets = np.arange(chunk, dtype=np.float64)[:, None] * inv_freq[None, :]
    start = float(history) * inv_freq
    as16 = lambda a: a.astype(np.float16)  # noqa: E731
    return (
        as16(np.cos(offsets))[:, None, :], as16(np.sin(offsets))[:, None, :],
        as16(np.cos(start))[None, None, :], as16(np.sin(start))[None, None, :],
    )


def _rms_norm(mb, x, weight: np.ndarray, eps: float, name: str):
    """Per-head RMSNorm over the last axis of x [..., d], overflow-safe in fp16."""
    peak = mb.reduce_max(x=mb.abs(x=x), axes=[-1], keep_dims=True)
    peak = mb.maximum(x=peak, y=np.float16(RMS_SCALE_FLOOR))
    scaled = mb.real_div(x=x, y=peak)
    mean_sq = mb.reduce_mean(x=mb.mul(x=scaled, y=scaled), axes=[-1], keep_dims=True)
    # x / sqrt(mean(x^2) + eps) == scaled / sqrt(mean(scaled^2) + eps / peak^2)
    eps_scaled = mb.real_div(x=np.float16(eps) if eps >= 6e-8 else np.float16(6e-8), y=mb.mul(x=peak, y=peak))
    inv_rms = mb.rsqrt(x=mb.add(x=mean_sq, y=eps_scaled), epsilon=np.float16(1e-7))
    return mb.mul(x=mb.mul(x=scaled, y=inv_rms), y=weight.astype(np.float16), name=name)


def _rope(mb, x, cos, sin, geometry: AttentionGeometry, name: str):
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


def _linear(mb, x, weight: np.ndarray, bias: np.ndarray | None, name: str):
    kw = {"bias": bias.astype(np.float16)} if bias is not None else {}
    return mb.linear(x=x, weight=weight.astype(np.float16), name=name, **kw)


def _per_history_specs(mb, types, g: AttentionGeometry, C: int, H: int):
    """Input specs of a per-history function: hidden [C, D], (k_history, v_history [H, Hkv, d]), mask [C, H + C]."""
    specs = [mb.TensorSpec(shape=(C, g.hidden_size), dtype=types.fp16)]
    if H > 0:
        specs += [mb.TensorSpec(shape=(H, g.num_kv_heads, g.head_dim), dtype=types.fp16) for _ in range(2)]
    specs.append(mb.TensorSpec(shape=(C, H + C), dtype=types.fp16))
    return specs


def _per_history_program(ct, mb, specs, body, H: int):
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


def _attention_output(mb, g: AttentionGeometry, weights: AttentionWeights, context, gate, C: int):
    """context [Hkv, group, C, d] -> (gated) [C, Hq*d] -> o_proj -> attn_out [C, D]."""
    Hq, d = g.num_heads, g.head_dim
    context = mb.transpose(x=mb.reshape(x=context, shape=[Hq, C, d]), perm=[1, 0, 2])  # [C, Hq, d]
    if gate is not None:
        context = mb.mul(x=context, y=mb.sigmoid(x=gate))
    context = mb.reshape(x=context, shape=[C, Hq * d])
    return _linear(mb, context, weights.o_proj, weights.o_bias, "attn_out")


def build_dense_program(geometry: AttentionGeometry, weights: AttentionWeights, shape: SidecarShape):
    """The dense per-history sidecar function: scores all H + C keys, masks by the input mask.

    Returns a MIL Program (opset iOS18) with inputs/outputs as in the module docstring.
    """
    ct, mb, types = coremltools_modules()
    g = geometry
    C, H = shape.chunk, shape.history
    Hkv = g.num_kv_heads

    def body(hidden, k_history, v_history, mask):
        # q [Hkv, group*C, d]: GQA without repeating K/V — query heads of one KV head stacked by row
        q, gate, k_chunk, v_chunk = _project_chunk(mb, g, weights, hidden, C, _static_rotation(mb, g, C, H))
        if H > 0:
            keys = mb.concat(values=[mb.transpose(x=k_history, perm=[1, 0, 2]), k_chunk], axis=1)  # [Hkv, T, d]
            values = mb.concat(values=[mb.transpose(x=v_history, perm=[1, 0, 2]), v_chunk], axis=1)
        else:
            keys, values = k_chunk, v_chunk
        scores = mb.matmul(x=q, y=keys, transpose_y=True)  # [Hkv, group*C, T]
        scores = mb.reshape(x=scores, shape=[Hkv, g.group_size, C, H + C])
        probs = mb.softmax(x=mb.add(x=scores, y=mask), axis=-1)
        context = mb.matmul(x=probs, y=mb.expand_dims(x=values, axes=[1]))  # [Hkv, group, C, d]
        return _attention_output(mb, g, weights, context, gate, C), k_chunk, v_chunk

    return _per_history_program(ct, mb, _per_history_specs(mb, types, g, C, H), body, H)


def validate_key_tile(key_tile: int, chunk: int) -> int:
    """A key tile must be a positive divisor of the chunk (so no tile straddles history and chunk)."""
    from anelab.errors import AnelabInputError

    if isinstance(key_tile, bool) or not isinstance(key_tile, (int, np.integer)) or key_tile <= 0:
        raise AnelabInputError(f"--tile must be a positive integer, got {key_tile!r}")
    if chunk % key_tile:
        divisors = [t for t in range(1, chunk + 1) if chunk % t == 0]
        raise AnelabInputError(f"--tile {key_tile} does not divide the chunk {chunk}; use a divisor such as {divisors[-2] if len(divisors) > 1 else 1}")
    return int(key_tile)


def _static_rotation(mb, g: AttentionGeometry, C: int, H: int):
    """RoPE for positions H..H+C-1 known at export time: by i*theta, then by H*theta (as the dense graph)."""
    cos_i, sin_i, cos_h, sin_h = _rope_tables(g, C, H)

    def rotate(x, name):
        x = _rope(mb, x, cos_i, sin_i, g, name if H == 0 else f"{name}_i")
        return _rope(mb, x, cos_h, sin_h, g, name) if H > 0 else x
    return rotate


def _project_chunk(mb, g: AttentionGeometry, weights: AttentionWeights, hidden, C: int, rotate):
    """Projections, QK-norm and RoPE (``rotate(x [C, heads, d], name)``) of one chunk, as the dense graph.

    Returns (q [Hkv, group*C, d] scaled by 1/sqrt(d), gate [C, Hq, d] or None,
    k_chunk [Hkv, C, d], v_chunk [Hkv, C, d]).
    """
    Hq, Hkv, d = g.num_heads, g.num_kv_heads, g.head_dim
    q = _linear(mb, hidden, weights.q_proj, weights.q_bias, "q_proj")
    gate = None
    if g.is_gated:  # per head: d query rows, then d gate rows
        q, gate = mb.split(x=mb.reshape(x=q, shape=[C, Hq, 2 * d]), num_splits=2, axis=-1)
    else:
        q = mb.reshape(x=q, shape=[C, Hq, d])
    k = mb.reshape(x=_linear(mb, hidden, weights.k_proj, weights.k_bias, "k_proj"), shape=[C, Hkv, d])
    v = mb.reshape(x=_linear(mb, hidden, weights.v_proj, weights.v_bias, "v_proj"), shape=[C, Hkv, d])
    if g.has_qk_norm:
        q = _rms_norm(mb, q, weights.q_norm, g.rms_norm_eps, "q_normed")
        k = _rms_norm(mb, k, weights.k_norm, g.rms_norm_eps, "k_normed")
    q, k = rotate(q, "q_rotated"), rotate(k, "k_rotated")
    k_chunk = mb.transpose(x=k, perm=[1, 0, 2], name="k_chunk")
    v_chunk = mb.transpose(x=v, perm=[1, 0, 2], name="v_chunk")
    q = mb.mul(x=q, y=np.float16(1.0 / np.sqrt(d)))
    q = mb.reshape(x=mb.transpose(x=q, perm=[1, 0, 2]), shape=[Hkv, g.group_size * C, d])
    return q, gate, k_chunk, v_chunk


def _key_tile(mb, history, chunk_kv, H: int, k0: int, k1: int, d: int):
    """Keys (or values) at positions k0..k1-1 as [Hkv, k1 - k0, d]: sliced from the token-major
    history [H, Hkv, d] then transposed (the whole history is never transposed), or from the
    chunk's [Hkv, C, d]."""
    if k1 <= H:
        rows = mb.slice_by_index(x=history, begin=[k0, 0, 0], end=[k1, 0, d], end_mask=[False, True, True])
        return mb.transpose(x=rows, perm=[1, 0, 2])
    return mb.slice_by_index(x=chunk_kv, begin=[0, k0 - H, 0], end=[0, k1 - H, d], end_mask=[True, False, True])


def build_tiled_program(geometry: AttentionGeometry, weights: AttentionWeights, shape: SidecarShape, key_tile: int):
    """The tiled (flash-attention) sidecar function: same inputs and outputs as the dense graph.

    Keys are visited in tiles of ``key_tile`` positions (a divisor of the chunk). Per tile, the
    scores s [Hkv, group, C, key_tile] (+ the mask's columns) update a running row max
    m [Hkv, group, C, 1], a running sum l (same shape) and an accumulator acc [Hkv, group, C, d]
    rescaled by exp(m_old - m_new) (online softmax, Dao et al. 2022); acc / l is the context.
    No op holds a [heads, C, H + C] score tensor: the largest score op is [Hq, C, key_tile].
    """
    ct, mb, types = coremltools_modules()
    g = geometry
    C, H = shape.chunk, shape.history
    key_tile = validate_key_tile(key_tile, C)
    Hkv, d, G = g.num_kv_heads, g.head_dim, g.group_size
    T = H + C

    def body(hidden, k_history, v_history, mask):
        q, gate, k_chunk, v_chunk = _project_chunk(mb, g, weights, hidden, C, _static_rotation(mb, g, C, H))
        m = l = acc = None
        for j, k0 in enumerate(range(0, T, key_tile)):
            k1 = k0 + key_tile
            keys = _key_tile(mb, k_history, k_chunk, H, k0, k1, d)            # [Hkv, tile, d]
            values = _key_tile(mb, v_history, v_chunk, H, k0, k1, d)
            s = mb.matmul(x=q, y=keys, transpose_y=True)                       # [Hkv, G*C, tile]
            s = mb.reshape(x=s, shape=[Hkv, G, C, key_tile])
            mask_cols = mb.slice_by_index(x=mask, begin=[0, k0], end=[C, k1], end_mask=[True, False])
            s = mb.add(x=s, y=mask_cols, name=f"scores_tile{j}")
            tile_max = mb.reduce_max(x=s, axes=[-1], keep_dims=True)          # [Hkv, G, C, 1]
            m_new = tile_max if m is None else mb.maximum(x=m, y=tile_max)
            p = mb.exp(x=mb.sub(x=s, y=m_new))                                 # exp(s - m_new) <= 1
            p_sum = mb.reduce_sum(x=p, axes=[-1], keep_dims=True)
            pv = mb.matmul(x=p, y=mb.expand_dims(x=values, axes=[1]))         # [Hkv, G, C, d]
            if m is None:
                l, acc = p_sum, pv
            else:  # what was accumulated under the old max is rescaled to the new one
                alpha = mb.exp(x=mb.sub(x=m, y=m_new))
                l = mb.add(x=mb.mul(x=l, y=alpha), y=p_sum)
                acc = mb.add(x=mb.mul(x=acc, y=alpha), y=pv)
            m = m_new
        context = mb.real_div(x=acc, y=l)                                       # [Hkv, G, C, d]
        return _attention_output(mb, g, weights, context, gate, C), k_chunk, v_chunk

    return _per_history_program(ct, mb, _per_history_specs(mb, types, g, C, H), body, H)


# ---- stateful (KV cache as Core ML state) ------------------------------------------------------------

STATE_NAMES = ("k_cache", "v_cache")


def stateful_function_name(chunk: int) -> str:
    return f"c{chunk}"


def _rope_position_tables(geometry: AttentionGeometry, capacity: int):
    """cos/sin of p*theta_j for every cache position p < capacity, [capacity, rot/2], float64 -> fp16."""
    rot = geometry.rotary_dim
    inv_freq = 1.0 / (geometry.rope_theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
    angles = np.arange(capacity, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float16), np.sin(angles).astype(np.float16)


def _cache_for_attention(mb, state, updated):
    """The cache the attention reads after this chunk's update: the ``slice_update`` result itself.

    Not a second ``read_state``: coremltools' ``common::remove_redundant_ops`` merges a second
    ``read_state`` of the same state with the first, so it would silently read the cache as it was
    *before* the update (tests/test_stateful.py swaps this function to show verification catches it).
    """
    return updated


def build_stateful_program(geometry: AttentionGeometry, weights: AttentionWeights, chunk: int, capacity: int):
    """The stateful sidecar function for chunks of width ``chunk`` (1 = decode).

    States (fp16): k_cache, v_cache [Hkv, capacity, d] — cache layout, normed and rotated K.
    Inputs: hidden [C, D] fp16; start [1] int32 (the chunk's first absolute position; the caller
    guarantees start + C <= capacity); mask [C, capacity] fp16 additive (0 = attend, -30000 = drop:
    slots not yet filled must be dropped by the caller).
    Output: attn_out [C, D] fp16.

    The chunk's K/V are written at [start, start + C) with ``slice_update`` and the state updated;
    attention then scores every cache slot ([Hq, C, capacity]) and relies on the mask for the
    filled prefix. RoPE uses position tables [capacity, rot/2] gathered at start + i.
    """
    ct, mb, types = coremltools_modules()
    g = geometry
    C, N = chunk, capacity
    Hq, Hkv, d, D, G = g.num_heads, g.num_kv_heads, g.head_dim, g.hidden_size, g.group_size
    cos_table, sin_table = _rope_position_tables(g, N)
    specs = [mb.StateTensorSpec(shape=(Hkv, N, d), dtype=types.fp16) for _ in STATE_NAMES]
    specs += [mb.TensorSpec(shape=(C, D), dtype=types.fp16), mb.TensorSpec(shape=(1,), dtype=types.int32),
              mb.TensorSpec(shape=(C, N), dtype=types.fp16)]

    @mb.program(input_specs=specs, opset_version=ct.target.iOS18)
    def prog(k_cache, v_cache, hidden, start, mask):
        positions = mb.add(x=start, y=np.arange(C, dtype=np.int32))                 # [C]
        cos = mb.expand_dims(x=mb.gather(x=cos_table, indices=positions, axis=0), axes=[1])  # [C, 1, rot/2]
        sin = mb.expand_dims(x=mb.gather(x=sin_table, indices=positions, axis=0), axes=[1])
        q, gate, k_chunk, v_chunk = _project_chunk(mb, g, weights, hidden, C, lambda x, name: _rope(mb, x, cos, sin, g, name))
        zero = np.zeros(1, np.int32)
        begin = mb.concat(values=[zero, start, zero], axis=0)
        end = mb.concat(values=[np.array([Hkv], np.int32), mb.add(x=start, y=np.int32(C)), np.array([d], np.int32)], axis=0)
        caches = []
        for state, new in ((k_cache, k_chunk), (v_cache, v_chunk)):
            updated = mb.slice_update(x=mb.read_state(input=state), update=new, begin=begin, end=end)  # [Hkv, N, d]
            mb.coreml_update_state(state=state, value=updated)
            caches.append(_cache_for_attention(mb, state, updated))
        keys, values = caches
        scores = mb.matmul(x=q, y=keys, transpose_y=True)                              # [Hkv, G*C, N]
        scores = mb.reshape(x=scores, shape=[Hkv, G, C, N])
        probs = mb.softmax(x=mb.add(x=scores, y=mask), axis=-1)
        context = mb.matmul(x=probs, y=mb.expand_dims(x=values, axes=[1]))             # [Hkv, G, C, d]
        context = mb.transpose(x=mb.reshape(x=context, shape=[Hq, C, d]), perm=[1, 0, 2])  # [C, Hq, d]
        if gate is not None:
            context = mb.mul(x=context, y=mb.sigmoid(x=gate))
        context = mb.reshape(x=context, shape=[C, Hq * d])
        return _linear(mb, context, weights.o_proj, weights.o_bias, "attn_out")

    return prog
