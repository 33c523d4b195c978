"""A checkpoint's non-attention blocks as their sidecars read them: each layer's MLP and each linear-attention
layer's Gated DeltaNet input projections — which layers have one, their float32 weights, their tensors' digests.

The blocks: the MLP (``{prefix}layers.{L}.mlp.*``: gate / up / down, through ``checkpoints.whole_model``'s
family table, a hybrid's dense MLPs included) and the Gated DeltaNet projections
(``{prefix}layers.{L}.linear_attn.in_proj*``: Qwen 3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` /
``in_proj_a``, or Qwen3-Next's fused
``in_proj_qkvz`` / ``in_proj_ba`` reordered per key head as mlx-lm's ``fix_query_key_value_ordering`` splits them,
models/qwen3_next.py). The attention block stays ``Checkpoint.layer`` / ``Checkpoint.attention_digests``.
"""

from __future__ import annotations

import numpy as np

from anelab.checkpoints.checkpoint import Checkpoint
from anelab.checkpoints.config import config_int
from anelab.checkpoints.whole_model import mlp_model
from anelab.core.decoder import MlpWeights
from anelab.core.errors import AnelabInputError
from anelab.core.gated_deltanet import GdnGeometry, GdnProjectionWeights

MLP_STEM, GDN_STEM = "mlp.", "linear_attn.in_proj"  # a block's tensors, after ``{prefix}layers.{L}.``


def linear_attention_layers(checkpoint: Checkpoint) -> list[int]:
    """The layers that are neither full nor sliding-window attention (a hybrid's Gated DeltaNet layers); [] otherwise."""
    g = checkpoint.geometry
    return [] if not checkpoint.family.hybrid else [i for i in range(g.num_layers) if i not in g.full_attention_layers]


def mlp_layers(checkpoint: Checkpoint) -> list[int]:
    """The layers holding an MLP: every layer."""
    return list(range(checkpoint.geometry.num_layers))


def tensor_digests(checkpoint: Checkpoint, layer: int, stem: str) -> dict[str, str]:
    """Tensor name -> digest (``TensorSource.digest``) of every tensor named ``{prefix}layers.{L}.{stem}*``: what a
    block's package records to recognise its checkpoint (``Checkpoint.attention_digests`` for the attention's)."""
    start = f"{checkpoint.prefix}layers.{int(layer)}.{stem}"
    return {
        n: checkpoint.tensors.digest(n) for n in sorted(n for n in checkpoint.tensors.names() if n.startswith(start))
    }


def mlp_source_record(checkpoint: Checkpoint, layer: int, weights_mode: str) -> dict:
    """``Checkpoint.source_record`` of ``layer``'s MLP tensors."""
    return checkpoint.source_record(layer, weights_mode, "MLP", MLP_STEM)


def gdn_source_record(checkpoint: Checkpoint, layer: int, weights_mode: str) -> dict:
    """``Checkpoint.source_record`` of ``layer``'s Gated DeltaNet input projections."""
    return checkpoint.source_record(layer, weights_mode, "Gated DeltaNet input", GDN_STEM)


def mlp_digests(checkpoint: Checkpoint, layer: int) -> dict[str, str]:
    return tensor_digests(checkpoint, layer, MLP_STEM)


def gdn_digests(checkpoint: Checkpoint, layer: int) -> dict[str, str]:
    return tensor_digests(checkpoint, layer, GDN_STEM)


def _require_layer(checkpoint: Checkpoint, layers: list[int], layer: int, what: str) -> None:
    if layer not in layers:
        shown = ",".join(map(str, layers)) or "none"
        raise AnelabInputError(f"layer {layer} is not a {what} of {checkpoint.path}; {what}s: {shown}")


def _require_finite(name: str, value: np.ndarray) -> np.ndarray:
    if not np.isfinite(value).all():
        raise AnelabInputError(f"tensor {name} holds NaN or infinite values; a sidecar of it would compute NaN")
    return value


def mlp_weights(checkpoint: Checkpoint, layer: int) -> MlpWeights:
    """One layer's gated MLP (gate [I, D], up [I, D], down [D, I], its activation and biases), float32 and finite;
    an ungated MLP (Starcoder2's c_fc / c_proj) or routed experts are refused in one line."""
    model = mlp_model(checkpoint)
    _require_layer(model.checkpoint, mlp_layers(model.checkpoint), int(layer), "layer")
    mlp = model.mlp(int(layer))
    if not isinstance(mlp, MlpWeights):
        kind = "routed experts" if hasattr(mlp, "experts") else "an ungated c_fc / c_proj MLP"
        raise AnelabInputError(
            f"layer {layer} of {model.path} has {kind}; the MLP sidecar is a gated gate / up / down block"
        )
    for name in ("gate_proj", "up_proj", "down_proj", "gate_bias", "up_bias", "down_bias"):
        if getattr(mlp, name) is not None:
            _require_finite(f"layers.{layer}.mlp.{name}", getattr(mlp, name))
    return mlp


def gdn_geometry(checkpoint: Checkpoint) -> GdnGeometry:
    """The projections' sizes from config.json (``linear_num_key_heads``, ``linear_num_value_heads``,
    ``linear_key_head_dim``, ``linear_value_head_dim``: required, no default is assumed)."""
    text = checkpoint.text
    return GdnGeometry(
        checkpoint.geometry.hidden_size,
        config_int(text, "linear_num_key_heads", minimum=1),
        config_int(text, "linear_num_value_heads", minimum=1),
        config_int(text, "linear_key_head_dim", minimum=1),
        config_int(text, "linear_value_head_dim", minimum=1),
    )


def gdn_projection_weights(checkpoint: Checkpoint, layer: int) -> GdnProjectionWeights:
    """One linear-attention layer's input projections in the layout of ``core.gated_deltanet`` (float32, finite)."""
    layer = int(layer)
    _require_layer(checkpoint, linear_attention_layers(checkpoint), layer, "linear-attention (Gated DeltaNet) layer")
    g, d = gdn_geometry(checkpoint), checkpoint.geometry.hidden_size
    name = lambda param: f"{checkpoint.prefix}layers.{layer}.linear_attn.{param}.weight"  # noqa: E731
    if checkpoint.has_tensor(name("in_proj_qkvz")):
        qkvz = checkpoint.read_tensor(name("in_proj_qkvz"), (2 * g.key_dim + 2 * g.value_dim, d))
        ba = checkpoint.read_tensor(name("in_proj_ba"), (2 * g.value_heads, d))
        parts = split_fused_qkvz(qkvz, ba, g)
    else:
        widths = g.output_widths()
        parts = {p: checkpoint.read_tensor(name(f"in_proj_{p}"), (widths[p], d)) for p in widths}
    for part, value in parts.items():
        _require_finite(name(f"in_proj_{part}"), value)
    return GdnProjectionWeights(layer, **parts)


def split_fused_qkvz(qkvz: np.ndarray, ba: np.ndarray, g: GdnGeometry) -> dict[str, np.ndarray]:
    """Qwen3-Next's fused rows -> {qkv, z, b, a}: ``in_proj_qkvz`` [Hk * (2 dk + 2 r dv), D] holds per key head
    q (dk rows), k (dk), v (r dv) and z (r dv) with r = Hv / Hk; ``in_proj_ba`` [Hk * 2r, D] holds per key head
    b (r rows) then a (r) (mlx-lm models/qwen3_next.py ``fix_query_key_value_ordering``)."""
    hk, dk, dv, r = g.key_heads, g.key_head_dim, g.value_head_dim, g.value_heads // g.key_heads
    d = qkvz.shape[1]
    per_head = qkvz.reshape(hk, 2 * dk + 2 * r * dv, d)
    q, k = per_head[:, :dk], per_head[:, dk : 2 * dk]
    v, z = per_head[:, 2 * dk : 2 * dk + r * dv], per_head[:, 2 * dk + r * dv :]
    flat = lambda a: np.ascontiguousarray(a.reshape(-1, d))  # noqa: E731
    ba_heads = ba.reshape(hk, 2 * r, d)
    return {
        "qkv": np.concatenate([flat(q), flat(k), flat(v)]),
        "z": flat(z),
        "b": flat(ba_heads[:, :r]),
        "a": flat(ba_heads[:, r:]),
    }
