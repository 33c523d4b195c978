"""One attention layer's parameters in anelab's own layout, and deterministic random ones.

The block (reference, graph) never knows which checkpoint format fed it: ``anelab.hf`` adapts
Hugging Face tensors into ``AttentionWeights``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from anelab.geometry import AttentionGeometry


@dataclass
class AttentionWeights:
    """One full-attention layer's parameters, float32, in the checkpoint's own layout.

    Shapes (D = hidden_size, Hq = num_heads, Hkv = num_kv_heads, d = head_dim):
      q_proj  [Hq*d*(2 if gated else 1), D]  — gated: per head, d query rows then d gate rows
      k_proj  [Hkv*d, D]
      v_proj  [Hkv*d, D]
      o_proj  [D, Hq*d]
      q_bias, k_bias, v_bias  [out_features] or None
      o_bias  [D] or None
      q_norm, k_norm  [d] or None — the *effective* RMSNorm multiplier (zero-centred checkpoints
                      are already converted to 1 + w by the loader)
    """

    layer: int
    q_proj: np.ndarray
    k_proj: np.ndarray
    v_proj: np.ndarray
    o_proj: np.ndarray
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    q_bias: np.ndarray | None = None
    k_bias: np.ndarray | None = None
    v_bias: np.ndarray | None = None
    o_bias: np.ndarray | None = None


def random_attention_weights(geometry: AttentionGeometry, layer: int, seed: int) -> AttentionWeights:
    """Deterministic random weights for one layer (stream keyed by (seed, layer)).

    Projections ~ N(0, 1/fan_in), so a unit-variance input gives unit-variance outputs; biases
    ~ N(0, 0.1^2); q/k norm multipliers ~ 1 + N(0, 0.1^2).
    """
    g = geometry
    rng = np.random.default_rng([int(seed), int(layer)])

    def normal(shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = AttentionWeights(
        layer=layer,
        q_proj=normal((g.q_out_features, g.hidden_size), g.hidden_size**-0.5),
        k_proj=normal((g.kv_out_features, g.hidden_size), g.hidden_size**-0.5),
        v_proj=normal((g.kv_out_features, g.hidden_size), g.hidden_size**-0.5),
        o_proj=normal((g.hidden_size, g.attn_features), g.attn_features**-0.5),
    )
    if g.has_qk_norm:
        w.q_norm = np.float32(1.0) + normal((g.head_dim,), 0.1)
        w.k_norm = np.float32(1.0) + normal((g.head_dim,), 0.1)
    if g.has_qkv_bias:
        w.q_bias = normal((g.q_out_features,), 0.1)
        w.k_bias = normal((g.kv_out_features,), 0.1)
        w.v_bias = normal((g.kv_out_features,), 0.1)
    if g.has_o_bias:
        w.o_bias = normal((g.hidden_size,), 0.1)
    return w
