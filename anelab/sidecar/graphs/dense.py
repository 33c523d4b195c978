"""The dense sidecar graph: one function per history, scoring all H + C keys at once."""

from __future__ import annotations

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
        rotate = static_rotation(mb, g, C, H, weights.layer, shape.rope_coverage)
        q, gate, k_chunk, v_chunk = project_chunk(mb, g, weights, hidden, C, rotate)
        if H > 0:
            keys = mb.concat(values=[mb.transpose(x=k_history, perm=[1, 0, 2]), k_chunk], axis=1)  # [Hkv, T, d]
            values = mb.concat(values=[mb.transpose(x=v_history, perm=[1, 0, 2]), v_chunk], axis=1)
        else:
            keys, values = k_chunk, v_chunk
        scores = mb.matmul(x=q, y=keys, transpose_y=True)  # [Hkv, group*C, T]
        scores = softcap(mb, mb.reshape(x=scores, shape=[Hkv, g.group_size, C, H + C]), g)
        probs = mb.softmax(x=mb.add(x=scores, y=mask), axis=-1)
        context = mb.matmul(x=probs, y=mb.expand_dims(x=values, axes=[1]))  # [Hkv, group, C, d]
        return attention_output(mb, g, weights, context, gate, C), k_chunk, v_chunk

    return per_history_program(ct, mb, per_history_specs(mb, types, g, C, H), body, H)
