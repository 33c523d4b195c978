"""The tiled sidecar graph: one function per history, online softmax over key tiles."""

from __future__ import annotations

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.weights import AttentionWeights
from anelab.sidecar.coremltools_import import coremltools_modules
from anelab.sidecar.graphs.common import (
    SidecarShape,
    attention_output,
    per_history_program,
    per_history_specs,
    project_chunk,
    softcap,
    static_rotation,
)


def validate_key_tile(key_tile: int, chunk: int) -> int:
    """A key tile must be a positive divisor of the chunk (so no tile straddles history and chunk)."""

    if isinstance(key_tile, bool) or not isinstance(key_tile, (int, np.integer)) or key_tile <= 0:
        raise AnelabInputError(f"--tile must be a positive integer, got {key_tile!r}")
    if chunk % key_tile:
        divisors = [t for t in range(1, chunk + 1) if chunk % t == 0]
        raise AnelabInputError(
            f"--tile {key_tile} does not divide the chunk {chunk}; use a divisor such as {divisors[-2] if len(divisors) > 1 else 1}"
        )
    return int(key_tile)


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
        rotate = static_rotation(mb, g, C, H, weights.layer, shape.rope_coverage)
        q, gate, k_chunk, v_chunk = project_chunk(mb, g, weights, hidden, C, rotate)

        m = l = acc = None
        for j, k0 in enumerate(range(0, T, key_tile)):
            k1 = k0 + key_tile
            keys = _key_tile(mb, k_history, k_chunk, H, k0, k1, d)  # [Hkv, tile, d]
            values = _key_tile(mb, v_history, v_chunk, H, k0, k1, d)
            s = mb.matmul(x=q, y=keys, transpose_y=True)  # [Hkv, G*C, tile]
            s = softcap(mb, mb.reshape(x=s, shape=[Hkv, G, C, key_tile]), g)
            mask_cols = mb.slice_by_index(x=mask, begin=[0, k0], end=[C, k1], end_mask=[True, False])
            s = mb.add(x=s, y=mask_cols, name=f"scores_tile{j}")
            tile_max = mb.reduce_max(x=s, axes=[-1], keep_dims=True)  # [Hkv, G, C, 1]
            m_new = tile_max if m is None else mb.maximum(x=m, y=tile_max)
            p = mb.exp(x=mb.sub(x=s, y=m_new))  # exp(s - m_new) <= 1
            p_sum = mb.reduce_sum(x=p, axes=[-1], keep_dims=True)
            pv = mb.matmul(x=p, y=mb.expand_dims(x=values, axes=[1]))  # [Hkv, G, C, d]
            if m is None:
                l, acc = p_sum, pv
            else:  # what was accumulated under the old max is rescaled to the new one
                alpha = mb.exp(x=mb.sub(x=m, y=m_new))
                l = mb.add(x=mb.mul(x=l, y=alpha), y=p_sum)
                acc = mb.add(x=mb.mul(x=acc, y=alpha), y=pv)
            m = m_new
        context = mb.real_div(x=acc, y=l)  # [Hkv, G, C, d]
        return attention_output(mb, g, weights, context, gate, C), k_chunk, v_chunk

    return per_history_program(ct, mb, per_history_specs(mb, types, g, C, H), body, H)
