"""What each GGUF ``general.architecture`` means: llama.cpp's conventions per architecture, undone into transformers' config.

One row per architecture (``GGUF_ARCHITECTURES``), beside the Hugging Face family table
(``anelab.checkpoints.config.MODEL_FAMILIES``): the transformers ``model_type`` it is read as, how llama.cpp's
converter stored its tensors (Q/K rows permuted for interleaved RoPE; Gemma's norms stored shifted by +1), the
tensor slots of its layers, and the settings llama.cpp's loader fixes per architecture rather than writing
them into the file (Gemma 3's sliding-window pattern and local RoPE base, Gemma's query scale, Granite's
defaults). ``config_from_metadata`` turns a file's metadata into the config.json the HF path reads; every size it
declares is bounded (``anelab.core.limits``) before anything proportional to it is built. Sources, file and
function: docs/conventions.md §10.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.limits import MAX_EXPERTS, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_WIDTH, require_at_most

# the tensor slots (after ``model.layers.{L}.``) of a Llama layer
LLAMA_PARTS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
    "self_attn.k_norm", "input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip
_ATTENTION = LLAMA_PARTS[:6]
_GATED_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GEMMA_PARTS = _ATTENTION + (
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
) + _GATED_MLP  # fmt: skip
OLMO2_PARTS = _ATTENTION + ("post_attention_layernorm", "post_feedforward_layernorm") + _GATED_MLP
STARCODER2_PARTS = _ATTENTION + ("input_layernorm", "post_attention_layernorm", "mlp.c_fc", "mlp.c_proj")
PHI3_PARTS = ("self_attn.qkv_proj", "self_attn.o_proj", "input_layernorm", "post_attention_layernorm",
              "mlp.gate_up_proj", "mlp.down_proj")  # fmt: skip
QWEN3MOE_PARTS = _ATTENTION + ("input_layernorm", "post_attention_layernorm", "mlp.gate")
# routed experts: one stacked tensor [E, ...] per projection in the file, ``mlp.experts.{e}.*`` in transformers
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")

# {arch}.<key> -> transformers config key, for every architecture (transformers integrations/ggml.py)
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "vocab_size": "vocab_size",
}
# every size a file declares, bounded before anything proportional to it is built (issue 44 item 1)
_BOUNDS = {
    "block_count": MAX_LAYERS,
    "embedding_length": MAX_WIDTH,
    "feed_forward_length": MAX_WIDTH,
    "expert_feed_forward_length": MAX_WIDTH,
    "vocab_size": MAX_WIDTH,
    "attention.head_count": MAX_HEADS,
    "attention.head_count_kv": MAX_HEADS,
    "attention.key_length": MAX_HEAD_DIM,
    "attention.value_length": MAX_HEAD_DIM,
    "rope.dimension_count": MAX_HEAD_DIM,
    "expert_count": MAX_EXPERTS,
    "expert_used_count": MAX_EXPERTS,
}
# {arch}.<key> read and checked in ``config_from_metadata`` (head size, rotary dims, RoPE scaling, experts)
_CHECKED_KEYS = (
    "attention.key_length",
    "attention.value_length",
    "rope.dimension_count",
    "rope.freq_base",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scale_linear",
    "expert_count",
    "expert_used_count",
)
_REQUIRED = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
LLAMA_CPP_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base when the file names none


@dataclass(frozen=True)
class GgufArchitecture:
    """One GGUF ``general.architecture``: its transformers ``model_type`` / ``architecture`` class, the gguf package's
    ``MODEL_ARCH`` name (its tensor-name table) and llama.cpp's conventions for it.

    ``permuted_qk``: the converter permuted the Q/K rows (weights and biases) for llama.cpp's interleaved RoPE.
    ``qk_norm``: the file carries ``attn_q_norm`` / ``attn_k_norm``.
    ``norm_shift``: the converter stored every ``*norm.weight`` as ``w + shift`` (Gemma: llama.cpp multiplies by
    the stored weight, transformers by ``1 + w``); read back as ``stored - shift``.
    ``parts``: the tensor slots of a layer (after ``model.layers.{L}.``).
    ``eps_key`` / ``eps_config``: the metadata key of the norms' epsilon and the config key it becomes.
    ``keys``: ``{arch}.<key>`` -> config key copied as they are (soft-caps, window, multipliers).
    ``fixed``: config keys llama.cpp's loader fixes for the architecture whatever the file says.
    ``swa_pattern``: llama.cpp's ``set_swa_pattern(n)``: layer ``il`` slides unless ``il % n == n - 1``, when the
        file sets a window (0: no window modelled; the key is refused).
    ``gemma_query_scale``: llama.cpp's ``f_attention_scale`` for Gemma 2/3: 1/sqrt(n_embd / n_head) for the 27B
        (``gemma_27b_layers`` layers), else 1/sqrt(key_length), as transformers' ``query_pre_attn_scalar``.
    ``defaults``: config keys set when the file omits the metadata key that would set them (llama.cpp's
        defaults where transformers' differ).
    ``experts``: the file may hold routed experts (stacked ``ffn_*_exps``).
    ``ignored``: ``{arch}.<key>`` llama.cpp's loader reads and then disables (Phi-3's sliding window): accepted and
        not applied, as llama.cpp runs the file.
    """

    model_type: str
    architecture: str
    gguf_arch: str
    permuted_qk: bool = False
    qk_norm: bool = False
    norm_shift: float = 0.0
    parts: tuple[str, ...] = LLAMA_PARTS
    eps_key: str = "attention.layer_norm_rms_epsilon"
    eps_config: str = "rms_norm_eps"
    keys: dict = field(default_factory=dict)
    fixed: dict = field(default_factory=dict)
    swa_pattern: int = 0
    gemma_query_scale: bool = False
    gemma_27b_layers: int = 0
    defaults: dict = field(default_factory=dict)
    experts: bool = False
    ignored: tuple[str, ...] = ()


_GEMMA_FIXED = {"hidden_activation": "gelu_pytorch_tanh"}  # llama.cpp's Gemma graphs: LLM_FFN_GELU (tanh form)

GGUF_ARCHITECTURES: dict[str, GgufArchitecture] = {
    "llama": GgufArchitecture("llama", "LlamaForCausalLM", "LLAMA", permuted_qk=True),
    "qwen2": GgufArchitecture("qwen2", "Qwen2ForCausalLM", "QWEN2"),
    "qwen3": GgufArchitecture("qwen3", "Qwen3ForCausalLM", "QWEN3", qk_norm=True),
    "gemma2": GgufArchitecture(
        "gemma2", "Gemma2ForCausalLM", "GEMMA2", norm_shift=1.0, parts=GEMMA_PARTS,
        keys={"attn_logit_softcapping": "attn_logit_softcapping", "final_logit_softcapping": "final_logit_softcapping",
              "attention.sliding_window": "sliding_window"},
        fixed=_GEMMA_FIXED, swa_pattern=2, gemma_query_scale=True, gemma_27b_layers=46,
        defaults={"sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    ),
    "gemma3": GgufArchitecture(
        "gemma3_text", "Gemma3ForCausalLM", "GEMMA3", qk_norm=True, norm_shift=1.0, parts=GEMMA_PARTS,
        keys={"attention.sliding_window": "sliding_window", "final_logit_softcapping": "final_logit_softcapping"},
        fixed={**_GEMMA_FIXED, "rope_local_base_freq": 10000.0, "attn_logit_softcapping": None},
        swa_pattern=6, gemma_query_scale=True, gemma_27b_layers=62,
        defaults={"final_logit_softcapping": None},
    ),
    "granite": GgufArchitecture(
        "granite", "GraniteForCausalLM", "GRANITE", permuted_qk=True,
        keys={"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
              "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"},
    ),
    "olmo2": GgufArchitecture("olmo2", "Olmo2ForCausalLM", "OLMO2", parts=OLMO2_PARTS),
    "starcoder2": GgufArchitecture(
        "starcoder2", "Starcoder2ForCausalLM", "STARCODER2", parts=STARCODER2_PARTS,
        eps_key="attention.layer_norm_epsilon", eps_config="norm_epsilon", fixed={"hidden_act": "gelu_pytorch_tanh"},
    ),
    "phi3": GgufArchitecture(
        "phi3", "Phi3ForCausalLM", "PHI3", parts=PHI3_PARTS, fixed={"sliding_window": None},
        ignored=("attention.sliding_window", "rope.scaling.original_context_length"),
    ),
    "qwen3moe": GgufArchitecture(
        "qwen3_moe", "Qwen3MoeForCausalLM", "QWEN3MOE", qk_norm=True, parts=QWEN3MOE_PARTS, experts=True,
        keys={"expert_feed_forward_length": "moe_intermediate_size"}, fixed={"norm_topk_prob": True},
    ),
}  # fmt: skip

REFUSED = (
    f"architectures other than {', '.join(GGUF_ARCHITECTURES)} (their llama.cpp conventions are not modelled)",
    "metadata keys of the architecture anelab does not model (a window where llama.cpp fixes none, per-layer "
    "head counts, a local RoPE base, ...), named in the refusal",
    "tensors with no transformers name (rope_freqs.weight: Llama 3's RoPE frequency factors; Phi-3's long/short "
    "RoPE factors)",
    "routed experts outside qwen3moe; RoPE scaling other than linear; partial rotary dimensions outside phi3",
    "split (llama-gguf-split) or big-endian files",
)


def metadata(reader, key: str, default=None):
    """The value of metadata ``key`` (a Python scalar, string or list), or ``default``."""
    found = reader.fields.get(key)
    return default if found is None else found.contents()


def metadata_length(reader, key: str) -> int:
    """The length of metadata ``key``'s value (0 when absent), without decoding a lazily read array."""
    found = reader.fields.get(key)
    if found is None:
        return 0
    count = getattr(found, "count", None)  # a LazyArrayField knows its length without its elements
    return int(count) if count is not None else len(found.contents())


def architecture_of(reader, path: Path) -> tuple[str, GgufArchitecture]:
    arch = metadata(reader, "general.architecture")
    spec = GGUF_ARCHITECTURES.get(arch)
    if spec is None:
        raise AnelabInputError(
            f"{path}: GGUF architecture {arch!r} is not modelled (its llama.cpp conventions are not undone here); "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch, spec


def int_key(reader, arch: str, key: str, default=None) -> int:
    """``{arch}.{key}`` as a non-negative integer, at most its bound (``_BOUNDS``); refused in one line naming the key."""
    value = metadata(reader, f"{arch}.{key}", default)
    if isinstance(value, list):
        raise AnelabInputError(f"GGUF {arch}.{key} varies per layer ({value[:4]}...); not modelled")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise AnelabInputError(f"GGUF {arch}.{key} must be a non-negative integer, got {value!r}")
    if key in _BOUNDS:
        require_at_most(f"GGUF {arch}.{key}", int(value), _BOUNDS[key], "no model anelab can serve is that large")
    return int(value)


def _float32(value) -> float:
    """A GGUF float32 as the shortest decimal that is the same float32 (1e-05, not 9.999999747378752e-06)."""
    if isinstance(value, (list, str, bool)) or not np.isfinite(value):
        raise AnelabInputError(f"a GGUF number must be a finite float, got {value!r}")
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _refuse_unmodelled_keys(reader, arch: str, spec: GgufArchitecture) -> None:
    known = set(_CONFIG_KEYS) | set(_CHECKED_KEYS) | set(spec.keys) | set(spec.ignored) | {spec.eps_key}
    for key in reader.fields:
        if key.startswith(f"{arch}.") and key.removeprefix(f"{arch}.") not in known:
            raise AnelabInputError(
                f"GGUF metadata {key} = {metadata(reader, key)!r} is not modelled by anelab for {arch}; refusing"
            )
    for key in ("expert_count", "expert_used_count"):
        if int_key(reader, arch, key, 0) and not spec.experts:
            raise AnelabInputError(f"GGUF {arch}.{key} > 0: routed experts are modelled for qwen3moe only; refusing")


def _rope_scaling(reader, arch: str) -> dict | None:
    kind = metadata(reader, f"{arch}.rope.scaling.type", "none")
    linear = metadata(reader, f"{arch}.rope.scale_linear")
    if kind == "linear" or (kind == "none" and linear is not None):
        factor = metadata(reader, f"{arch}.rope.scaling.factor", linear)
        return None if factor in (None, 1.0) else {"rope_type": "linear", "factor": _float32(factor)}
    if kind != "none":
        raise AnelabInputError(f"GGUF {arch}.rope.scaling.type {kind!r} is not modelled (none or linear); refusing")
    return None


def _head_dim(reader, arch: str, spec: GgufArchitecture, config: dict, path: Path) -> int:
    """``key_length`` (else D / Hq); a value length that differs, or partial rotary outside Phi-3, refused."""
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = int_key(reader, arch, "attention.key_length", hidden // heads if heads else 0)
    if int_key(reader, arch, "attention.value_length", head_dim) != head_dim:
        raise AnelabInputError(f"{path}: GGUF {arch}.attention.value_length differs from key_length; not modelled")
    rotary = int_key(reader, arch, "rope.dimension_count", head_dim)
    if rotary != head_dim and spec.model_type != "phi3":
        raise AnelabInputError(
            f"{path}: GGUF {arch}.rope.dimension_count {rotary} < head size {head_dim} (partial rotary) is not "
            f"modelled for {arch}"
        )
    if rotary != head_dim:
        config["partial_rotary_factor"] = rotary / head_dim  # Phi-3: rotary_dim = head_dim * factor
    return head_dim


def _sliding_window(reader, arch: str, spec: GgufArchitecture, config: dict) -> None:
    """Gemma's windows where llama.cpp's loader puts them: ``set_swa_pattern(n)`` makes layer ``il`` slide unless
    ``il % n == n - 1`` (llama-hparams.cpp); Gemma 3 slides only when the file sets a window > 0."""
    window = config.get("sliding_window")
    layers = config["num_hidden_layers"]
    if window is not None:
        window = require_at_most(f"GGUF {arch}.attention.sliding_window", int(window), 1 << 21, "not a window")
    if window:
        n = spec.swa_pattern
        config["layer_types"] = ["full_attention" if i % n == n - 1 else "sliding_attention" for i in range(layers)]
    else:
        config["sliding_window"] = None
        config["layer_types"] = ["full_attention"] * layers


def config_from_metadata(reader, path: Path, tensor_names: set[str]) -> dict:
    """transformers' config.json for the file: geometry, RoPE, norm and per-architecture settings from ``{arch}.*``
    metadata and llama.cpp's conventions for the architecture; every size bounded before use."""
    arch, spec = architecture_of(reader, path)
    _refuse_unmodelled_keys(reader, arch, spec)
    for key in (*_REQUIRED, spec.eps_key):
        if f"{arch}.{key}" not in reader.fields:
            raise AnelabInputError(f"{path}: GGUF metadata {arch}.{key} is missing; the file is incomplete")
    config = {"model_type": spec.model_type, "architectures": [spec.architecture], "hidden_act": "silu"}
    for key, name in _CONFIG_KEYS.items():
        if f"{arch}.{key}" in reader.fields:
            config[name] = int_key(reader, arch, key)
    config[spec.eps_config] = _float32(metadata(reader, f"{arch}.{spec.eps_key}"))
    config["rope_theta"] = _float32(metadata(reader, f"{arch}.rope.freq_base", LLAMA_CPP_ROPE_BASE))
    config.setdefault("num_key_value_heads", config["num_attention_heads"])  # llama.cpp: n_head_kv = n_head
    if "vocab_size" not in config:
        config["vocab_size"] = (
            require_at_most(
                "GGUF tokenizer.ggml.tokens",
                metadata_length(reader, "tokenizer.ggml.tokens"),
                MAX_WIDTH,
                "not a vocabulary",
            )
            or None
        )
    config["head_dim"] = _head_dim(reader, arch, spec, config, path)
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    bias = "blk.0.attn_q.bias" in tensor_names
    config["use_bias" if spec.model_type == "starcoder2" else "attention_bias"] = bias
    if (scaling := _rope_scaling(reader, arch)) is not None:
        config["rope_scaling"] = scaling
    config.update(spec.defaults)
    for key, name in spec.keys.items():
        if f"{arch}.{key}" in reader.fields:
            value = metadata(reader, f"{arch}.{key}")
            config[name] = int_key(reader, arch, key) if isinstance(value, (int, np.integer)) else _float32(value)
    config.update(spec.fixed)
    _architecture_settings(reader, arch, spec, config)
    for key in ("bos_token_id", "eos_token_id"):
        if (value := metadata(reader, f"tokenizer.ggml.{key}")) is not None:
            config[key] = int(value)
    return config


def _architecture_settings(reader, arch: str, spec: GgufArchitecture, config: dict) -> None:
    """The settings llama.cpp's loader (``llama_model::load_hparams``) derives rather than reads."""
    if spec.swa_pattern:
        _sliding_window(reader, arch, spec, config)
    if spec.gemma_query_scale:
        per_head = config["hidden_size"] // config["num_attention_heads"]
        big = config["num_hidden_layers"] == spec.gemma_27b_layers  # llama.cpp's LLM_TYPE_27B
        config["query_pre_attn_scalar"] = per_head if big else config["head_dim"]
    if spec.model_type == "granite" and "attention_multiplier" not in config:
        # llama.cpp's granite graph: f_attention_scale 0 (absent) means 1/sqrt(head size); transformers' default is 1
        config["attention_multiplier"] = float(np.float32(config["head_dim"] ** -0.5))
    if spec.experts:
        experts = int_key(reader, arch, "expert_count", 0)
        config.update(num_experts=experts, num_experts_per_tok=int_key(reader, arch, "expert_used_count", 0))
        config.setdefault("moe_intermediate_size", config.get("intermediate_size", 0))


def transformers_names(spec: GgufArchitecture, config: dict, gguf_names: set[str], path: Path) -> dict[str, str]:
    """transformers name -> GGUF name of every tensor in the file, through gguf's ``TensorNameMap``; a stacked expert
    tensor ``blk.{L}.ffn_*_exps.weight`` is named ``model.layers.{L}.mlp.experts.*`` (split per expert on read).
    Refuses a GGUF tensor that has no transformers name (it would be dropped silently). ``config`` is the one
    ``config_from_metadata`` bounded: the name map is built for its layer count only."""
    import gguf

    num_layers = config["num_hidden_layers"]
    table = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, spec.gguf_arch), num_layers)
    bases = ["model.embed_tokens", "model.norm", "lm_head"]
    bases += [f"model.layers.{layer}.{part}" for layer in range(num_layers) for part in spec.parts]
    if spec.experts:
        bases += [f"model.layers.{layer}.mlp.experts.{p}" for layer in range(num_layers) for p in EXPERT_PARTS]
    names = {}
    for base in bases:
        stem = table.get_name(base)
        for suffix in (".weight", ".bias"):
            if stem is not None and stem + suffix in gguf_names:
                names[base + suffix] = stem + suffix
    unplaced = sorted(gguf_names - set(names.values()))
    if unplaced:
        raise AnelabInputError(
            f"{path}: GGUF tensor {unplaced[0]} has no place in anelab's model of {spec.model_type} "
            f"({len(unplaced)} such tensor{'s' if len(unplaced) > 1 else ''}); refusing rather than dropping it"
        )
    return names
