"""The stateful sidecar graph: K/V cache held as Core ML state, one function per chunk width."""

from __future__ import annotations

import numpy as np

from anelab.core.geometry import AttentionGeometry
from anelab.core.weights import AttentionWeights
from anelab.sidecar.coremltools_import import coremltools_modules
from anelab.sidecar.format import STATE_NAMES
from anelab.sidecar.graphs.common import (
    linear,
    no_rotation,
    project_chunk,
    rope,
    rope_position_tables,
    softcap,
    update_kv_cache,
)


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
    cos_table, sin_table = rope_position_tables(g, weights.layer, N)
    specs = [mb.StateTensorSpec(shape=(Hkv, N, d), dtype=types.fp16) for _ in STATE_NAMES]
    specs += [
        mb.TensorSpec(shape=(C, D), dtype=types.fp16),
        mb.TensorSpec(shape=(1,), dtype=types.int32),
        mb.TensorSpec(shape=(C, N), dtype=types.fp16),
    ]

    @mb.program(input_specs=specs, opset_version=ct.target.iOS18)
    def prog(k_cache, v_cache, hidden, start, mask):
        positions = mb.add(x=start, y=np.arange(C, dtype=np.int32))  # [C]
        cos = mb.expand_dims(x=mb.gather(x=cos_table, indices=positions, axis=0), axes=[1])  # [C, 1, rot/2]
        sin = mb.expand_dims(x=mb.gather(x=sin_table, indices=positions, axis=0), axes=[1])
        rotate = (lambda x, name: rope(mb, x, cos, sin, g, name)) if g.uses_rope(weights.layer) else no_rotation
        q, gate, k_chunk, v_chunk = project_chunk(mb, g, weights, hidden, C, rotate)
        keys, values = update_kv_cache(mb, g, (k_cache, v_cache), (k_chunk, v_chunk), start, C)  # [Hkv, N, d]
        scores = mb.matmul(x=q, y=keys, transpose_y=True)  # [Hkv, G*C, N]
        scores = softcap(mb, mb.reshape(x=scores, shape=[Hkv, G, C, N]), g)
        probs = mb.softmax(x=mb.add(x=scores, y=mask), axis=-1)
        context = mb.matmul(x=probs, y=mb.expand_dims(x=values, axes=[1]))  # [Hkv, G, C, d]
        context = mb.transpose(x=mb.reshape(x=context, shape=[Hq, C, d]), perm=[1, 0, 2])  # [C, Hq, d]
        if gate is not None:
            context = mb.mul(x=context, y=mb.sigmoid(x=gate))
        context = mb.reshape(x=context, shape=[C, Hq * d])
        return linear(mb, context, weights.o_proj, weights.o_bias, "attn_out")

    return prog
