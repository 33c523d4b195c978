"""Hugging Face config.json -> AttentionGeometry: the family table, layer types, windows, RoPE options."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.limits import MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_WIDTH, require_at_most
from anelab.core.rope import ROPE_TYPES, RopeScaling

CONFIG_FILE = "config.json"


# transformers' legacy layer-type names (configuration_utils._LEGACY_LAYER_TYPE_REMAP).
LEGACY_LAYER_TYPES = {"attention": "full_attention", "mamba": "linear_attention"}


@dataclass(frozen=True)
class ModelFamily:
    """What a config ``model_type`` means for the attention block: one row of the family table.

    ``head_dim`` / ``partial_rotary_factor`` / ``default_theta`` are transformers' defaults when
    config.json omits them (head_dim None: hidden_size // num_attention_heads). ``qkv_bias`` /
    ``o_bias`` fixed by the architecture (None: the config's ``bias_key``, default ``bias_default``).
    ``window``: how layers slide (see ``sliding_layers``); ``window_default``: transformers' default
    ``sliding_window`` when the key is absent. ``scale``: which config key replaces head_dim ** -0.5.
    ``partial_rotary``: the model slices ``rotary_dim`` (else a factor != 1 is refused).
    ``after_o_proj`` / ``input_rows``: what the caller applies around the sidecar (never inside it).
    ``eps_key`` / ``eps_default``: the config key of every norm's epsilon (q/k norms and the decoder's) and
    transformers' default when it is absent.
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
    window: str = "none"
    window_default: int | None = None
    scale: str = "head_dim"
    softcap: bool = False
    qk_norm: str | None = None
    rope_layout: str = "half"
    partial_rotary: bool = False
    local_rope_theta: float | None = None
    no_rope_interval: bool = False
    fused_qkv: bool = False
    bias_key: str = "attention_bias"
    bias_default: bool = False
    default_theta: float = 10000.0
    eps_key: str = "rms_norm_eps"
    eps_default: float = 1e-6
    input_rows: str = "post_input_norm"
    after_o_proj: str = ""


_QWEN3_NEXT = dict(
    variant="qwen3_next",
    hybrid=True,
    head_dim=256,
    partial_rotary_factor=0.25,
    zero_centred_norm=True,
    partial_rotary=True,
)
_GEMMA2_AFTER = "post_attention_layernorm (RMSNorm x*(1+w)) on attn_out, then the residual add"


# GLM and GLM-4 share one attention block (GLM-4 adds a norm after o_proj, outside the sidecar)
_GLM = ModelFamily(
    "llama",
    "GlmForCausalLM",
    head_dim=128,
    o_bias=False,
    bias_default=True,
    partial_rotary_factor=0.5,
    partial_rotary=True,
    rope_layout="interleaved",
    eps_default=1.5625e-7,
)

MODEL_FAMILIES: dict[str, ModelFamily] = {
    "llama": ModelFamily("llama", "LlamaForCausalLM"),
    "mistral": ModelFamily(
        "llama", "MistralForCausalLM", qkv_bias=False, o_bias=False, window="global", window_default=4096
    ),
    "ministral": ModelFamily(
        "llama", "MinistralForCausalLM", qkv_bias=False, o_bias=False, window="layer_types", window_default=4096
    ),
    "qwen2": ModelFamily("llama", "Qwen2ForCausalLM", qkv_bias=True, o_bias=False, window="qwen", window_default=4096),
    "qwen3": ModelFamily("qwen3", "Qwen3ForCausalLM", head_dim=128, window="qwen", window_default=4096),
    "qwen3_moe": ModelFamily("qwen3", "Qwen3MoeForCausalLM", window="qwen_all", window_default=4096),
    "qwen3_next": ModelFamily(architecture="Qwen3NextForCausalLM", **_QWEN3_NEXT),
    "qwen3_5": ModelFamily(architecture="Qwen3_5ForConditionalGeneration", nested_text_config=True, **_QWEN3_NEXT),
    "qwen3_5_text": ModelFamily(architecture="Qwen3_5ForCausalLM", **_QWEN3_NEXT),
    "qwen3_5_moe": ModelFamily(
        architecture="Qwen3_5MoeForConditionalGeneration", nested_text_config=True, **_QWEN3_NEXT
    ),
    "qwen3_5_moe_text": ModelFamily(architecture="Qwen3_5MoeForCausalLM", **_QWEN3_NEXT),
    "gemma": ModelFamily("llama", "GemmaForCausalLM", head_dim=256),
    "gemma2": ModelFamily(
        "llama",
        "Gemma2ForCausalLM",
        head_dim=256,
        window="gemma2",
        window_default=4096,
        scale="query_pre_attn_scalar",
        softcap=True,
        after_o_proj=_GEMMA2_AFTER,
    ),
    "gemma3_text": ModelFamily(
        "qwen3",
        "Gemma3ForCausalLM",
        head_dim=256,
        zero_centred_norm=True,
        window="gemma3",
        window_default=4096,
        scale="query_pre_attn_scalar",
        local_rope_theta=10000.0,
        default_theta=1000000.0,
        after_o_proj=_GEMMA2_AFTER,
    ),
    "phi3": ModelFamily(
        "llama",
        "Phi3ForCausalLM",
        qkv_bias=False,
        o_bias=False,
        window="global",
        partial_rotary=True,
        fused_qkv=True,
        eps_default=1e-5,
    ),
    "olmo2": ModelFamily(
        "llama",
        "Olmo2ForCausalLM",
        qk_norm="projection",
        input_rows="residual",
        eps_default=1e-5,
        after_o_proj="post_attention_layernorm (RMSNorm, weight multiplied in fp32) on attn_out, then the residual add",
    ),
    "granite": ModelFamily("llama", "GraniteForCausalLM", scale="attention_multiplier"),
    "glm": _GLM,
    "glm4": replace(
        _GLM,
        architecture="Glm4ForCausalLM",
        after_o_proj="post_self_attn_layernorm (RMSNorm) on attn_out, then the residual add",
    ),
    "smollm3": ModelFamily(
        "llama", "SmolLM3ForCausalLM", window="smollm3", no_rope_interval=True, default_theta=2000000.0
    ),
    "starcoder2": ModelFamily(
        "llama",
        "Starcoder2ForCausalLM",
        window="global",
        bias_key="use_bias",
        bias_default=True,
        eps_key="norm_epsilon",
        eps_default=1e-5,
    ),
}
MODEL_FAMILIES["gemma3"] = replace(
    MODEL_FAMILIES["gemma3_text"], architecture="Gemma3ForConditionalGeneration", nested_text_config=True
)


# Config keys that change a block's numerics in some transformers model but that no family here models:
# refused wherever they appear with a non-default value (one line naming the key).
_UNMODELLED_KEYS = {
    "attention_chunk_size": None,  # llama4 chunked mask
    "llama_4_scaling_beta": None,  # ministral3 position-dependent q scale
    "attn_temperature_tuning": False,  # llama4 NoPE q scaling
    "use_qk_norm": False,
    "use_bidirectional_attention": (None, False),  # gemma / gemma3: not causal
    "sinks": None,
}


_WINDOW_RULES = {
    "none": "no sliding window",
    "global": "every layer slides when sliding_window is set",
    "layer_types": "layer_types (default: every layer slides when sliding_window is set)",
    "qwen": "use_sliding_window: layer_types, else layers >= max_window_layers (28)",
    "qwen_all": "use_sliding_window: every layer slides",
    "gemma2": "layer_types, else even layers 0, 2, 4, ... slide",
    "gemma3": "layer_types, else all but every sliding_window_pattern-th (6) layer slide",
    "smollm3": "use_sliding_window and sliding_window: the no-RoPE layers slide",
}


def supported_families() -> list[dict]:
    """One row per model_type: variant, options, RoPE types, window rule (for ``--list-families``)."""

    rows = []
    for model_type, f in MODEL_FAMILIES.items():
        options = [
            text
            for on, text in (
                (f.hybrid, "hybrid: linear-attention layers refused, gated attention"),
                (f.scale != "head_dim", f"scale from {f.scale}"),
                (f.softcap, "attn_logit_softcapping"),
                (f.qk_norm == "projection", "q/k RMSNorm over the whole projection"),
                (f.variant in ("qwen3", "qwen3_next") and f.qk_norm is None, "per-head q/k RMSNorm"),
                (f.zero_centred_norm, "norms stored zero-centred (1 + w)"),
                (f.rope_layout == "interleaved", "interleaved RoPE (weights reordered at export)"),
                (f.partial_rotary, f"partial RoPE (default factor {f.partial_rotary_factor:g})"),
                (f.local_rope_theta is not None, "sliding layers' own RoPE base (rope_local_base_freq)"),
                (f.no_rope_interval, "no-RoPE layers (no_rope_layers)"),
                (f.fused_qkv, "fused qkv_proj split Q|K|V at load"),
                (f.input_rows == "residual", "input: raw residual rows (no input norm)"),
                (bool(f.after_o_proj) or f.scale == "attention_multiplier", "caller applies a post-branch step"),
            )
            if on
        ]
        rows.append(
            {
                "model_type": model_type,
                "architecture": f.architecture,
                "variant": f.variant,
                "rope_types": ["default", "longrope"] if f.fused_qkv else list(ROPE_TYPES),
                "windows": _WINDOW_RULES["none" if f.hybrid else f.window],
                "options": options,
            }
        )
    return rows


# What is refused whatever the family (one line each), for ``--list-families``.
REFUSED = (
    "any model_type not listed",
    "RoPE types other than default/linear/dynamic/llama3/yarn/longrope (proportional, mrope sections, su outside Phi-3)",
    "partial_rotary_factor != 1 outside Phi-3, GLM, GLM-4 and the Qwen3-Next family",
    "layer types other than full / sliding / linear attention (chunked attention, ...)",
    "attn_logit_softcapping outside Gemma 2 (Gemma 3 stores it but never applies it)",
    "use_bidirectional_attention, attention_chunk_size, llama_4_scaling_beta, attn_temperature_tuning, use_qk_norm, sinks",
    "linear-attention layers of hybrids (--layers)",
)


# transformers' ``attribute_map`` of each supported family's text config: the name anelab reads -> the key
# ``save_pretrained`` writes (``__setattr__`` stores the attribute under the mapped key, configuration_utils.py:653-656).
# transformers 5.24.0: models/qwen3_moe/configuration_qwen3_moe.py:50-52. No other supported family's text config
# has one (gemma3's maps image-token ids of the outer config; qwen3_5's maps its vision config's keys).
ATTRIBUTE_MAPS: dict[str, dict[str, str]] = {"qwen3_moe": {"num_experts": "num_local_experts"}}


def text_config(config: dict) -> dict:
    """The language-model part of a config (``config["text_config"]`` when nested, else ``config``), with
    every ``ATTRIBUTE_MAPS`` spelling read under anelab's name; refuses both spellings with different values."""
    nested = config.get("text_config")
    text = nested if isinstance(nested, dict) else config
    model_type = text.get("model_type") or config.get("model_type")
    aliases = ATTRIBUTE_MAPS.get(model_type, {}) if isinstance(model_type, str) else {}
    if not any(stored in text for stored in aliases.values()):
        return text
    text = dict(text)
    for name, stored in aliases.items():
        if stored not in text:
            continue
        if name in text and text[name] != text[stored]:
            raise AnelabInputError(
                f"config.json sets {name}={text[name]!r} and {stored}={text[stored]!r}, one setting in transformers "
                f"(attribute_map); keep only {stored}"
            )
        text[name] = text.pop(stored)
    return text


def detect_family(config: dict) -> tuple[str, ModelFamily]:
    """(model_type, family) of a config dict; refuse an unknown model_type.

    The nested text config's model_type wins over the outer one (``qwen3_5_text`` inside
    ``qwen3_5``). An unlisted ``qwen3*`` model_type whose layers are hybrid (``layer_types`` with
    linear_attention, or ``full_attention_interval``) is read as qwen3_next-style gated attention.
    """
    text = text_config(config)
    candidates = [text.get("model_type"), config.get("model_type")]
    if any(m is not None and not isinstance(m, str) for m in candidates):
        shown = next(_shown(m) for m in candidates if m is not None and not isinstance(m, str))
        raise AnelabInputError(f"config.json model_type must be a string, got {shown}; fix config.json")
    for model_type in candidates:
        if model_type in MODEL_FAMILIES:
            return model_type, MODEL_FAMILIES[model_type]
    for model_type in candidates:
        if isinstance(model_type, str) and model_type.startswith("qwen3") and _is_hybrid_config(text):
            return model_type, MODEL_FAMILIES["qwen3_next"]
    shown = next((m for m in candidates if m), None)
    raise AnelabInputError(
        f"unknown model_type {shown!r} in config.json (no supported attention variant); "
        f"supported model_type: {', '.join(MODEL_FAMILIES)} (see 'anelab export --list-families')"
    )


def _is_hybrid_config(text: dict) -> bool:
    listed = text.get("layer_types")
    types = [LEGACY_LAYER_TYPES.get(t, t) for t in listed if isinstance(t, str)] if isinstance(listed, list) else []
    return "linear_attention" in types or "full_attention_interval" in text


def config_int(
    text: dict, key: str, default: int | None = None, *, maximum: int | None = None, minimum: int | None = None
) -> int:
    """config.json ``key`` as an integer (a float holding a whole number counts, as JSON writers emit ``4.0``);
    NaN, infinity, a string, a bool, a fraction or a value past ``maximum`` is refused in one line."""
    value = text.get(key, default)
    if value is None:
        raise AnelabInputError(f"config.json has no {key!r}; add it (a Hugging Face text config needs it)")
    whole = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value == int(value))
    if isinstance(value, bool) or not whole:
        raise AnelabInputError(f"config.json {key!r} must be an integer, got {_shown(value)}")
    if maximum is not None:
        require_at_most(f"config.json {key!r}", int(value), maximum, "no model anelab can serve is that large")
    if minimum is not None and value < minimum:
        raise AnelabInputError(f"config.json {key!r} must be at least {minimum}, got {int(value)}")
    return int(value)


def config_number(text: dict, key: str, default: float | None) -> float | None:
    value = text.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value > 0:
        raise AnelabInputError(f"config.json {key!r} must be a finite positive number, got {_shown(value)}")
    return float(value)


def config_flag(text: dict, key: str, default: bool) -> bool:
    """config.json ``key`` as true/false (absent or null: ``default``); a string, number or list is refused
    rather than read by truthiness (``"false"`` would be true)."""
    value = text.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise AnelabInputError(f"config.json {key!r} must be true or false, got {_shown(value)}")
    return value


def _shown(value) -> str:
    """A config value for an error line: its repr, cut short (a value can be a 100,000-deep list)."""
    text = (
        repr(value)
        if not isinstance(value, list | dict)
        else f"a JSON {'list' if isinstance(value, list) else 'object'}"
    )
    return text if len(text) <= 60 else text[:57] + "..."


def _rope_dicts(text: dict) -> tuple[dict, dict | None]:
    """(the RoPE dict of full-attention layers, the sliding layers' own dict or None):
    ``rope_parameters`` (transformers >= 5; maybe keyed by layer type) or ``rope_scaling``, else {}."""
    for key in ("rope_parameters", "rope_scaling"):
        params = text.get(key)
        if params is not None and not isinstance(params, dict):
            raise AnelabInputError(f"config.json {key} must be a JSON object or null, got {_shown(params)}; fix it")
        if isinstance(params, dict):
            if isinstance(params.get("full_attention"), dict):
                return params["full_attention"], params.get("sliding_attention")
            return params, None
    return {}, None


def _layer_types(text: dict, num_layers: int) -> list[str] | None:
    layer_types = text.get("layer_types")
    if layer_types is None:
        return None
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise AnelabInputError(
            f"config.json layer_types must list one type per layer ({num_layers}), got {layer_types!r}"
        )
    if not all(isinstance(t, str) for t in layer_types):
        raise AnelabInputError("config.json layer_types must list one layer-type name (a string) per layer")
    types = [LEGACY_LAYER_TYPES.get(t, t) for t in layer_types]
    unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention", "linear_attention")})
    if unknown:
        raise AnelabInputError(f"config.json layer_types holds {unknown}, which anelab does not model; refused")
    return types


def _window_size(text: dict, family: ModelFamily) -> int | None:
    value = text.get("sliding_window", family.window_default)
    if value is None:
        return None
    return config_int({"sliding_window": value}, "sliding_window", maximum=MAX_POSITIONS)


def _sliding_rule(text: dict, family: ModelFamily, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(W, the layers that slide) by the family's transformers rule; (None, ()) when none slides."""
    rule = family.window
    types = _layer_types(text, num_layers)
    if rule in ("none", "hybrid") or family.hybrid:
        if types and "sliding_attention" in types:
            raise AnelabInputError(
                f"config.json layer_types lists sliding_attention, which {family.architecture} does not use; refused"
            )
        return None, ()
    if rule in ("global", "qwen_all") and types is not None:
        raise AnelabInputError(
            f"config.json has layer_types, which {family.architecture} ignores (every layer slides when sliding_window is set); remove it"
        )
    if rule in ("qwen", "qwen_all") and not text.get("use_sliding_window", False):
        return None, ()  # transformers: sliding_window = sliding_window if use_sliding_window else None
    if rule == "smollm3" and not (text.get("use_sliding_window", False) and text.get("sliding_window") is not None):
        return None, ()
    window = _window_size(text, family)
    if window is None:
        if types and "sliding_attention" in types:
            raise AnelabInputError("config.json layer_types lists sliding_attention but sliding_window is null; set it")
        return None, ()
    if types is not None:
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif rule in ("global", "qwen_all", "layer_types"):
        sliding = tuple(range(num_layers))
    elif rule == "qwen":
        first = config_int(text, "max_window_layers", 28)  # transformers' default
        sliding = tuple(range(first, num_layers))
    elif rule == "gemma2":
        sliding = tuple(i for i in range(num_layers) if (i + 1) % 2)
    elif rule == "gemma3":
        pattern = config_int(text, "sliding_window_pattern", 6, minimum=1)
        sliding = tuple(i for i in range(num_layers) if (i + 1) % pattern)
    elif rule == "smollm3":
        sliding = _no_rope_layers(text, num_layers)
    else:
        raise AssertionError(f"unhandled window rule {rule!r}")
    return (window, sliding) if sliding else (None, ())


def _no_rope_layers(text: dict, num_layers: int) -> tuple[int, ...]:
    """SmolLM3: ``no_rope_layers[i] == 0`` means layer i applies no RoPE; default: every
    ``no_rope_layer_interval``-th layer ((i + 1) % interval == 0)."""
    flags = text.get("no_rope_layers")
    if flags is None:
        interval = config_int(text, "no_rope_layer_interval", 4, minimum=1)
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not isinstance(flags, list) or len(flags) != num_layers or any(f not in (0, 1) for f in flags):
        raise AnelabInputError(f"config.json no_rope_layers must list 0/1 per layer ({num_layers}), got {flags!r}")
    return tuple(i for i, f in enumerate(flags) if f == 0)


def full_attention_layers(config: dict) -> tuple[int, ...]:
    """Indices of the softmax-attention layers (full or sliding window), by transformers' rules.

    Hybrids: ``layer_types[i] == "full_attention"`` when the list is given, else full attention where
    ``(i + 1) % full_attention_interval == 0`` (default interval 4, configuration_qwen3_next.py);
    linear-attention layers are not attention. Other families: every layer (``sliding_layers`` of
    the geometry says which slide).
    """
    _, family = detect_family(config)
    text = text_config(config)
    num_layers = config_int(text, "num_hidden_layers", maximum=MAX_LAYERS)
    types = _layer_types(text, num_layers)
    if types is not None:
        layers = tuple(i for i, t in enumerate(types) if t != "linear_attention")
    elif family.hybrid:
        interval = config_int(text, "full_attention_interval", 4)
        if interval <= 0:
            raise AnelabInputError(f"config.json full_attention_interval must be positive, got {interval}")
        layers = tuple(i for i in range(num_layers) if (i + 1) % interval == 0)
    else:
        layers = tuple(range(num_layers))
    if not layers:
        raise AnelabInputError("config.json describes no full-attention layer; nothing to export")
    return layers


def _refuse_unmodelled(text: dict, family: ModelFamily, model_type: str) -> None:
    """One line for the first config option that changes this block's numerics and is not modelled."""
    for key, default in _UNMODELLED_KEYS.items():
        value = text.get(key)
        allowed = default if isinstance(default, tuple) else (default,)
        if key in text and value not in allowed:
            raise AnelabInputError(f"config.json {key}={value!r} changes the attention and is not modelled; refused")
    softcap = text.get("attn_logit_softcapping")
    if softcap is not None and not family.softcap:
        raise AnelabInputError(
            f"config.json attn_logit_softcapping={softcap!r}: {model_type} does not apply it in transformers; "
            "set it to null (anelab refuses the ambiguity)"
        )


def _scale(text: dict, family: ModelFamily) -> float | None:
    if family.scale == "query_pre_attn_scalar":
        return config_number(text, "query_pre_attn_scalar", 256) ** -0.5
    if family.scale == "attention_multiplier":
        return config_number(text, "attention_multiplier", 1.0)
    return None


def _rope_options(text: dict, family: ModelFamily, model_type: str, head_dim: int) -> dict:
    """rope_theta, partial_rotary_factor, rope_scaling, max_position_embeddings, local theta."""
    full, sliding = _rope_dicts(text)
    full = dict(full)
    if family.fused_qkv and full.get("type", full.get("rope_type")) in ("su", "yarn"):
        full.pop("type", None)  # Phi-3 renames its legacy types to longrope (configuration_phi3.py)
        full["rope_type"] = "longrope"
    if full.get("rope_type", full.get("type")) in (None, "default", "mrope"):  # text-only positions: the plain table
        full = {k: v for k, v in full.items() if k not in ("mrope_section", "mrope_interleaved")}
        if full.get("rope_type", full.get("type")) == "mrope":
            full = {k: v for k, v in full.items() if k not in ("rope_type", "type")}
    mpe = text.get("max_position_embeddings")
    if mpe is not None:
        config_int(text, "max_position_embeddings", minimum=1)
    scaling = RopeScaling.from_config(
        full, max_position_embeddings=mpe, original_max_position_embeddings=text.get("original_max_position_embeddings")
    )
    theta = _rope_number(full.get("rope_theta", text.get("rope_theta", family.default_theta)), "rope_theta")
    factor = full.get("partial_rotary_factor", text.get("partial_rotary_factor", family.partial_rotary_factor))
    factor = _rope_number(factor, "partial_rotary_factor")
    if factor > 1.0:
        raise AnelabInputError(f"config.json partial_rotary_factor must be in (0, 1], got {factor}")
    if float(factor) != 1.0 and not family.partial_rotary:
        raise AnelabInputError(
            f"config.json partial_rotary_factor={factor} is not applied by {model_type} in transformers; remove it (refused)"
        )
    local = None
    if family.local_rope_theta is not None:
        local_dict = dict(sliding or {})
        if local_dict.get("rope_type", local_dict.get("type", "default")) != "default":
            raise AnelabInputError(
                "config.json sliding_attention RoPE is not default; anelab models only default there"
            )
        local = local_dict.get("rope_theta", text.get("rope_local_base_freq", family.local_rope_theta))
        local = _rope_number(local, "rope_local_base_freq")
    elif sliding is not None:
        raise AnelabInputError(f"config.json RoPE per layer type is not used by {model_type}; refused")
    return {
        "rope_theta": float(theta),
        "partial_rotary_factor": float(factor),
        "rope_scaling": None
        if scaling.rope_type == "default"
        else replace(scaling, rope_theta=None, partial_rotary_factor=None),
        "max_position_embeddings": None if scaling.rope_type == "default" else (None if mpe is None else int(mpe)),
        "local_rope_theta": None if local is None else float(local),
    }


def _after_o_proj(text: dict, family: ModelFamily) -> str:
    if family.scale == "attention_multiplier":
        multiplier = config_number(text, "residual_multiplier", 1.0)
        return (
            ""
            if multiplier == 1.0
            else f"multiply attn_out by residual_multiplier {multiplier:g}, then the residual add"
        )
    return family.after_o_proj


def geometry_from_config(config: dict) -> AttentionGeometry:
    """The AttentionGeometry a config.json dict describes (defaults as in transformers)."""
    model_type, family = detect_family(config)
    text = text_config(config)
    _refuse_unmodelled(text, family, model_type)
    hidden = config_int(text, "hidden_size", maximum=MAX_WIDTH)
    heads = config_int(text, "num_attention_heads", maximum=MAX_HEADS)
    kv_heads = config_int(text, "num_key_value_heads", heads, maximum=MAX_HEADS)
    if heads <= 0 or hidden <= 0:
        raise AnelabInputError(
            f"config.json hidden_size and num_attention_heads must be positive, got {hidden}, {heads}"
        )
    head_dim = _head_dim(text, family, hidden, heads)
    eps = config_number(text, family.eps_key, family.eps_default)

    attention_bias = config_flag(text, family.bias_key, family.bias_default)
    qkv_bias = attention_bias if family.qkv_bias is None else family.qkv_bias
    o_bias = attention_bias if family.o_bias is None else family.o_bias
    num_layers = config_int(text, "num_hidden_layers", maximum=MAX_LAYERS)
    window, sliding = _sliding_rule(text, family, num_layers)
    return AttentionGeometry(
        variant=family.variant,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(eps),
        num_layers=num_layers,
        full_attention_layers=full_attention_layers(config),
        has_qkv_bias=qkv_bias,
        has_o_bias=o_bias,
        rope_layout=family.rope_layout,
        query_scale=_scale(text, family),
        logit_softcap=config_number(text, "attn_logit_softcapping", 50.0) if family.softcap else None,
        qk_norm=family.qk_norm,
        sliding_window=window,
        sliding_layers=sliding,
        no_rope_layers=_no_rope_layers(text, num_layers) if family.no_rope_interval else (),
        input_rows=family.input_rows,
        after_o_proj=_after_o_proj(text, family),
        **_rope_options(text, family, model_type, head_dim),
    )


def _head_dim(text: dict, family: ModelFamily, hidden: int, heads: int) -> int:
    """config.json ``head_dim``; absent or null: the family's default, else hidden_size // heads (transformers).
    A head_dim of 0 or less is no head width and is refused, not replaced by the default."""
    if text.get("head_dim") is None:
        return family.head_dim or hidden // heads
    head_dim = config_int(text, "head_dim", maximum=MAX_HEAD_DIM)
    if head_dim <= 0:
        raise AnelabInputError(f"config.json head_dim must be a positive integer, got {head_dim}; fix or remove it")
    return head_dim


def _rope_number(value, key: str) -> float:
    """A RoPE setting (rope_theta, partial_rotary_factor, rope_local_base_freq) as a finite positive float."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise AnelabInputError(f"config.json {key} must be a finite positive number, got {_shown(value)}")
    return float(value)
