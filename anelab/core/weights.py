"""One attention layer's parameters in anelab's own layout, and deterministic random ones.

The block (reference, graph) never knows which checkpoint format fed it: ``anelab.checkpoints`` adapts
Hugging Face tensors into ``AttentionWeights``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from anelab.core.geometry import AttentionGeometry


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


# AttentionWeights field of each Hugging Face parameter name (after ``self_attn.``)
WEIGHT_FIELDS = {
    "q_proj.weight": "q_proj",
    "k_proj.weight": "k_proj",
    "v_proj.weight": "v_proj",
    "o_proj.weight": "o_proj",
    "q_norm.weight": "q_norm",
    "k_norm.weight": "k_norm",
    "q_proj.bias": "q_bias",
    "k_proj.bias": "k_bias",
    "v_proj.bias": "v_bias",
    "o_proj.bias": "o_bias",
}


def random_attention_weights(geometry: AttentionGeometry, layer: int, seed: int) -> AttentionWeights:
    """Deterministic random weights for one layer (stream keyed by (seed, layer)).

    Projections ~ N(0, 1/fan_in), so a unit-variance input gives unit-variance outputs; biases
    ~ N(0, 0.1^2); q/k norm multipliers ~ 1 + N(0, 0.1^2). Shapes from ``geometry.parameter_shapes``;
    parameters are drawn in the order of ``WEIGHT_FIELDS`` (the stream, and so the default
    checkpoint's bytes, depend on it).
    """
    rng = np.random.default_rng([int(seed), int(layer)])
    shapes = geometry.parameter_shapes()
    values = {}
    for hf_name, name in WEIGHT_FIELDS.items():
        if hf_name not in shapes:
            continue
        shape = shapes[hf_name]
        if hf_name.endswith("proj.weight"):
            values[name] = (rng.standard_normal(shape) * shape[1] ** -0.5).astype(np.float32)
        elif hf_name.endswith("norm.weight"):
            values[name] = np.float32(1.0) + (rng.standard_normal(shape) * 0.1).astype(np.float32)
        else:
            values[name] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    return AttentionWeights(layer=layer, **values)
