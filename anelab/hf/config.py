"""Hugging Face config.json -> AttentionGeometry: model families, layer types, RoPE options."""

from __future__ import annotations

from dataclasses import dataclass

from anelab.errors import AnelabInputError
from anelab.geometry import AttentionGeometry
from anelab.hf.safetensors_io import TORCH_DTYPE_NAMES

CONFIG_FILE = "config.json"


# transformers' legacy layer-type names (configuration_utils._LEGACY_LAYER_TYPE_REMAP).
LEGACY_LAYER_TYPES = {"attention": "full_attention", "mamba": "linear_attention"}


# RoPE types whose inverse frequencies equal the plain formula (mrope with text-only positions).
_PLAIN_ROPE_TYPES = (None, "default", "mrope")


@dataclass(frozen=True)
class ModelFamily:
    """What a config ``model_type`` means for the attention block.

    ``head_dim`` / ``partial_rotary_factor`` are transformers' defaults when config.json omits
    them (None: hidden_size // num_attention_heads). ``qkv_bias`` / ``o_bias`` fixed by the
    architecture (Qwen2 always has q/k/v biases and no o bias); None means "config attention_bias".
    """

    variant: str
    architecture: str
    hybrid: bool = False
    head_dim: int | None = None
    partial_rotary_factor: float = 1.0
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    zero_centred_norm: bool = False
    nested_text_config: bool = False


_QWEN3_NEXT = dict(variant="qwen3_next", hybrid=True, head_dim=256, partial_rotary_factor=0.25, zero_centred_norm=True)


MODEL_FAMILIES: dict[str, ModelFamily] = {
    "llama": ModelFamily("llama", "LlamaForCausalLM"),
    "mistral": ModelFamily("llama", "MistralForCausalLM"),
    "qwen2": ModelFamily("llama", "Qwen2ForCausalLM", qkv_bias=True, o_bias=False),
    "qwen3": ModelFamily("qwen3", "Qwen3ForCausalLM", head_dim=128),
    "qwen3_moe": ModelFamily("qwen3", "Qwen3MoeForCausalLM", head_dim=128),
    "qwen3_next": ModelFamily(architecture="Qwen3NextForCausalLM", **_QWEN3_NEXT),
    "qwen3_5": ModelFamily(architecture="Qwen3_5ForConditionalGeneration", nested_text_config=True, **_QWEN3_NEXT),
    "qwen3_5_text": ModelFamily(architecture="Qwen3_5ForCausalLM", **_QWEN3_NEXT),
    "qwen3_5_moe": ModelFamily(
        architecture="Qwen3_5MoeForConditionalGeneration", nested_text_config=True, **_QWEN3_NEXT
    ),
    "qwen3_5_moe_text": ModelFamily(architecture="Qwen3_5MoeForCausalLM", **_QWEN3_NEXT),
}


# The model_type write_checkpoint uses for each variant unless told otherwise.
DEFAULT_MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "qwen3_next": "qwen3_next"}


def text_config(config: dict) -> dict:
    """The language-model part of a config: ``config["text_config"]`` when nested, else ``config``."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def detect_family(config: dict) -> tuple[str, ModelFamily]:
    """(model_type, family) of a config dict; refuse an unknown model_type.

    The nested text config's model_type wins over the outer one (``qwen3_5_text`` inside
    ``qwen3_5``). An unlisted ``qwen3*`` model_type whose layers are hybrid (``layer_types`` with
    linear_attention, or ``full_attention_interval``) is read as qwen3_next-style gated attention.
    """
    text = text_config(config)
    candidates = [text.get("model_type"), config.get("model_type")]
    for model_type in candidates:
        if model_type in MODEL_FAMILIES:
            return model_type, MODEL_FAMILIES[model_type]
    for model_type in candidates:
        if isinstance(model_type, str) and model_type.startswith("qwen3") and _is_hybrid_config(text):
            return model_type, MODEL_FAMILIES["qwen3_next"]
    shown = next((m for m in candidates if m), None)
    raise AnelabInputError(
        f"unknown model_type {shown!r} in config.json (no supported attention variant); "
        f"supported model_type: {', '.join(MODEL_FAMILIES)}"
    )


def _is_hybrid_config(text: dict) -> bool:
    types = [LEGACY_LAYER_TYPES.get(t, t) for t in (text.get("layer_types") or [])]
    return "linear_attention" in types or "full_attention_interval" in text


def _config_int(text: dict, key: str, default: int | None = None) -> int:
    value = text.get(key, default)
    if value is None:
        raise AnelabInputError(f"config.json has no {key!r}; add it (a Hugging Face text config needs it)")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise AnelabInputError(f"config.json {key!r} must be an integer, got {value!r}")
    return int(value)


def _rope_parameters(text: dict) -> dict:
    """The RoPE dict: ``rope_parameters`` (transformers >= 5; maybe keyed by layer type) or
    ``rope_scaling`` (older), else empty."""
    for key in ("rope_parameters", "rope_scaling"):
        params = text.get(key)
        if isinstance(params, dict):
            if isinstance(params.get("full_attention"), dict):
                return params["full_attention"]
            return params
    return {}


def full_attention_layers(config: dict) -> tuple[int, ...]:
    """Indices of the full-attention layers, by transformers' rules.

    ``layer_types[i] == "full_attention"`` when the list is given; otherwise hybrids put full
    attention where ``(i + 1) % full_attention_interval == 0`` (default interval 4,
    configuration_qwen3_next.py); otherwise Qwen2/3 sliding-window layers (``use_sliding_window``,
    ``i >= max_window_layers``) are excluded; otherwise every layer is full attention.
    """
    _, family = detect_family(config)
    text = text_config(config)
    num_layers = _config_int(text, "num_hidden_layers")
    layer_types = text.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise AnelabInputError(
                f"config.json layer_types must list one type per layer ({num_layers}), got {layer_types!r}"
            )
        types = [LEGACY_LAYER_TYPES.get(t, t) for t in layer_types]
        layers = tuple(i for i, t in enumerate(types) if t == "full_attention")
    elif family.hybrid:
        interval = _config_int(text, "full_attention_interval", 4)
        if interval <= 0:
            raise AnelabInputError(f"config.json full_attention_interval must be positive, got {interval}")
        layers = tuple(i for i in range(num_layers) if (i + 1) % interval == 0)
    elif text.get("use_sliding_window") and text.get("sliding_window") is not None:
        first_sliding = _config_int(text, "max_window_layers", num_layers)
        layers = tuple(range(min(first_sliding, num_layers)))
    else:
        layers = tuple(range(num_layers))
    if not layers:
        raise AnelabInputError("config.json describes no full-attention layer; nothing to export")
    return layers


def geometry_from_config(config: dict) -> AttentionGeometry:
    """The AttentionGeometry a config.json dict describes (defaults as in transformers)."""
    model_type, family = detect_family(config)
    text = text_config(config)
    hidden = _config_int(text, "hidden_size")
    heads = _config_int(text, "num_attention_heads")
    kv_heads = _config_int(text, "num_key_value_heads", heads)
    if heads <= 0 or hidden <= 0:
        raise AnelabInputError(
            f"config.json hidden_size and num_attention_heads must be positive, got {hidden}, {heads}"
        )
    head_dim = text.get("head_dim") or family.head_dim or hidden // heads
    head_dim = _config_int({"head_dim": head_dim}, "head_dim")

    rope = _rope_parameters(text)
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type not in _PLAIN_ROPE_TYPES:
        raise AnelabInputError(
            f"config.json RoPE type {rope_type!r} rescales the frequencies, which anelab does not model; "
            "only default RoPE is supported"
        )
    rope_theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", family.partial_rotary_factor))
    eps = text.get("rms_norm_eps", 1e-6)

    attention_bias = bool(text.get("attention_bias", False))
    qkv_bias = attention_bias if family.qkv_bias is None else family.qkv_bias
    o_bias = attention_bias if family.o_bias is None else family.o_bias
    num_layers = _config_int(text, "num_hidden_layers")
    return AttentionGeometry(
        variant=family.variant,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(rope_theta),
        partial_rotary_factor=float(factor),
        rms_norm_eps=float(eps),
        num_layers=num_layers,
        full_attention_layers=full_attention_layers(config),
        has_qkv_bias=qkv_bias,
        has_o_bias=o_bias,
    )


def _interval_of(layers: tuple[int, ...], num_layers: int) -> int | None:
    """N with full attention exactly where (i + 1) % N == 0, if the layers follow that rule."""
    for n in range(1, num_layers + 1):
        if tuple(i for i in range(num_layers) if (i + 1) % n == 0) == tuple(layers):
            return n
    return None


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
    if family.nested_text_config:
        # transformers >= 5 style: RoPE settings live in rope_parameters.
        text["rope_parameters"] = rope
        return {
            "architectures": [family.architecture],
            "model_type": model_type,
            "text_config": text,
            "torch_dtype": TORCH_DTYPE_NAMES[dtype],
        }
    text.update({k: v for k, v in rope.items() if k != "rope_type"})
    return {"architectures": [family.architecture], **text}
