"""A Gated DeltaNet layer's input projections in NumPy: the reference the ``gdn-proj`` sidecar is verified against.

A linear-attention layer of Qwen 3.5 / Qwen3-Next (mlx-lm ``models/qwen3_5.py`` ``GatedDeltaNet.__call__``,
``models/qwen3_next.py``; transformers ``modeling_qwen3_next.py``) starts with four projections of the
layer's post-input-norm rows x [T, D], before its causal conv1d and the delta-rule recurrence:

    qkv = x @ W_qkv.T   [T, 2 * Hk * dk + Hv * dv]   (q | k | v, each head-major; the conv1d's input)
    z   = x @ W_z.T     [T, Hv * dv]                  (the gate of the output's RMSNormGated)
    b   = x @ W_b.T     [T, Hv]                       (beta = sigmoid(b))
    a   = x @ W_a.T     [T, Hv]                       (g = exp(-exp(A_log) * softplus(a + dt_bias)))

They hold most of the layer's weights and have no history (each row's outputs depend on that row only), which
is why they can go to the Neural Engine in chunks while the recurrence stays on the GPU. Qwen3-Next stores
q/k/v/z fused per key head (``in_proj_qkvz``) and b/a likewise (``in_proj_ba``); ``anelab.checkpoints.blocks``
reorders those rows into the layout above when it reads them, so one reference serves both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.matmul import matmul

GDN_OUTPUTS = ("qkv", "z", "b", "a")


@dataclass(frozen=True)
class GdnGeometry:
    """The projections' sizes: key heads Hk of dk dims, value heads Hv of dv dims (Hv a multiple of Hk)."""

    hidden_size: int
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int

    def __post_init__(self):
        sizes = (self.hidden_size, self.key_heads, self.value_heads, self.key_head_dim, self.value_head_dim)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise AnelabInputError(f"Gated DeltaNet sizes must be positive integers, got {sizes}")
        if self.value_heads % self.key_heads:
            raise AnelabInputError(
                f"linear_num_value_heads ({self.value_heads}) must be a multiple of linear_num_key_heads "
                f"({self.key_heads}) (mlx-lm qwen3_5.py GatedDeltaNet refuses it too)"
            )

    @property
    def key_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Width of ``qkv``: q and k (key_dim each) and v (value_dim)."""
        return 2 * self.key_dim + self.value_dim

    def output_widths(self) -> dict[str, int]:
        return {"qkv": self.conv_dim, "z": self.value_dim, "b": self.value_heads, "a": self.value_heads}


@dataclass
class GdnProjectionWeights:
    """One layer's input projections (float32, rows in the module docstring's layout): qkv [conv_dim, D],
    z [value_dim, D], b [Hv, D], a [Hv, D]."""

    layer: int
    qkv: np.ndarray
    z: np.ndarray
    b: np.ndarray
    a: np.ndarray

    def matrices(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in GDN_OUTPUTS}


def gdn_input_projections(x: np.ndarray, weights: GdnProjectionWeights) -> dict[str, np.ndarray]:
    """x [T, D] -> {qkv [T, conv_dim], z [T, value_dim], b [T, Hv], a [T, Hv]} in x's float dtype (float64 in, float64
    out: the weights are widened to it)."""
    x = np.asarray(x)
    dtype = x.dtype if x.dtype.kind == "f" and x.dtype.itemsize >= 4 else np.float32
    x = x.astype(dtype, copy=False)
    return {name: matmul(x, np.asarray(w, dtype).T) for name, w in weights.matrices().items()}
