"""AttentionGeometry -> config.json: the keys ``geometry_from_config`` reads back, for the checkpoints
anelab writes (``write_checkpoint``, the whole-model writer, the tests' families)."""

from __future__ import annotations

from dataclasses import fields

from anelab.checkpoints.config import ModelFamily
from anelab.checkpoints.safetensors_io import TORCH_DTYPE_NAMES
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry

# The model_type write_checkpoint uses for each variant unless told otherwise.
DEFAULT_MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "qwen3_next": "qwen3_next"}

# model_types write_checkpoint can write (plain llama/qwen layouts; the other families' tests write their own).
WRITABLE_MODEL_TYPES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "gemma3_text",  # sliding windows (layer_types), its own local RoPE base, query_pre_attn_scalar
)


def _interval_of(layers: tuple[int, ...], num_layers: int) -> int | None:
    """N with full attention exactly where (i + 1) % N == 0, if the layers follow that rule."""
    for n in range(1, num_layers + 1):
        if tuple(i for i in range(num_layers) if (i + 1) % n == 0) == tuple(layers):
            return n
    return None


def _gemma3_keys(g: AttentionGeometry) -> dict:
    """The config.json keys of a Gemma 3 text geometry's options (read back by ``geometry_from_config``:
    transformers' configuration_gemma3.py): the window and which layers slide, the local RoPE base,
    the query scale as query_pre_attn_scalar. Options Gemma 3 lacks (a soft-cap) are refused."""
    if g.logit_softcap is not None or g.rope_layout != "half" or g.no_rope_layers:
        raise AnelabInputError("gemma3_text has no logit soft-cap, interleaved RoPE or NoPE layers; drop them")
    scale = g.attention_scale
    return {
        "sliding_window": g.sliding_window,
        "layer_types": [
            "sliding_attention" if i in g.sliding_layers else "full_attention" for i in range(g.num_layers)
        ],
        "rope_local_base_freq": g.local_rope_theta if g.local_rope_theta is not None else g.rope_theta,
        "query_pre_attn_scalar": round(float(scale**-2), 9),  # 1 / scale**2, rounded off its float noise
        "attn_logit_softcapping": None,
    }


def config_for_geometry(geometry: AttentionGeometry, model_type: str, family: ModelFamily, dtype: str) -> dict:
    g = geometry
    if not family.hybrid and tuple(g.full_attention_layers) != tuple(range(g.num_layers)):
        raise AnelabInputError(
            f"model_type {model_type} is dense: every layer is full attention, but the geometry lists "
            f"{list(g.full_attention_layers)} of {g.num_layers}; use a hybrid model_type or list all layers"
        )
    if family.qkv_bias is not None:
        if (g.has_qkv_bias, g.has_o_bias) != (family.qkv_bias, family.o_bias):
            raise AnelabInputError(
                f"model_type {model_type} always has q/k/v bias={family.qkv_bias}, o bias={family.o_bias}; "
                "the geometry differs"
            )
    elif g.has_qkv_bias != g.has_o_bias:
        raise AnelabInputError(
            f"model_type {model_type} has one attention_bias flag for q/k/v and o; the geometry sets them differently"
        )
    text = {
        "model_type": model_type if not family.nested_text_config else f"{model_type}_text",
        "hidden_size": g.hidden_size,
        "num_attention_heads": g.num_heads,
        "num_key_value_heads": g.num_kv_heads,
        "head_dim": g.head_dim,
        "num_hidden_layers": g.num_layers,
        "rms_norm_eps": g.rms_norm_eps,
        "torch_dtype": TORCH_DTYPE_NAMES[dtype],
    }
    if family.qkv_bias is None:
        text["attention_bias"] = g.has_qkv_bias
    rope = {"rope_type": "default", "rope_theta": g.rope_theta}
    if family.hybrid or g.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = g.partial_rotary_factor
    if family.hybrid:
        interval = _interval_of(g.full_attention_layers, g.num_layers)
        if interval is not None and not family.nested_text_config:
            text["full_attention_interval"] = interval
        else:
            text["layer_types"] = [
                "full_attention" if i in g.full_attention_layers else "linear_attention" for i in range(g.num_layers)
            ]
    if family.window == "gemma3":
        text.update(_gemma3_keys(g))
    scaling = _rope_scaling_dict(g)
    if g.max_position_embeddings is not None:
        text["max_position_embeddings"] = g.max_position_embeddings
    if family.nested_text_config:
        # transformers >= 5 style: RoPE settings live in rope_parameters.
        text["rope_parameters"] = {**rope, **scaling}
        return {
            "architectures": [family.architecture],
            "model_type": model_type,
            "text_config": text,
            "torch_dtype": TORCH_DTYPE_NAMES[dtype],
        }
    text.update({k: v for k, v in rope.items() if k != "rope_type"})
    if scaling:
        text["rope_scaling"] = scaling
    return {"architectures": [family.architecture], **text}


def _rope_scaling_dict(g: AttentionGeometry) -> dict:
    """The geometry's RoPE scaling as config.json writes it (``rope_type`` and its set fields), {} for default."""
    if g.rope_scaling is None or g.rope_scaling.rope_type == "default":
        return {}
    values = {f.name: getattr(g.rope_scaling, f.name) for f in fields(g.rope_scaling)}
    skip = ("rope_theta", "partial_rotary_factor")
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if v is not None and k not in skip}
