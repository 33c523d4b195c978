"""Checkpoint loading: a Hugging Face-style model directory (config.json + safetensors) -> one
full-attention layer's geometry and weights.

(Skeleton: the loader is being written; ``AttentionWeights`` is the contract other modules use.)
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
