"""A whole Hugging Face decoder checkpoint for ``anelab.core.decoder``: per-family options, lazy per-layer reads, a writer.

Tensor names are transformers' on-disk names under the decoder stack's prefix (``model.``, or
``model.language_model.`` for Gemma 3's multimodal wrapper): ``embed_tokens.weight``, each layer's
norm slots (``DecoderFamily.norms``: ``input_layernorm``, ``post_attention_layernorm``,
``pre_feedforward_layernorm``, ...; ``.bias`` too for LayerNorms), its MLP (``mlp.{gate,up,down}_proj``,
Phi-3 / GLM's fused ``mlp.gate_up_proj``, Starcoder2's ``mlp.c_fc`` / ``mlp.c_proj``, Qwen3-MoE's
``mlp.gate`` [E, D] and ``mlp.experts.{e}.*``), ``norm.weight``, and ``lm_head.weight`` unless the
embeddings are tied. A layer's weights are read when ``layer(i)`` is called; the attention tensors
come through ``anelab.checkpoints.checkpoint.Checkpoint.layer``.

``DECODER_FAMILIES`` says what each supported ``model_type`` means for the layers around the
attention (one row each; transformers file:line in docs/conventions.md §9). Refused with one line:
hybrid linear-attention layers, activations other than ``decoder.ACTIVATIONS``, routed experts outside
Qwen3-MoE, a final logit soft-cap transformers stores but does not apply (Gemma 3's multimodal wrapper).
Sliding windows are the geometry's (``geometry.window_of(layer)``): the arms apply them in the mask.
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from anelab.checkpoints.checkpoint import Checkpoint, load_checkpoint, write_checkpoint, write_checkpoint_directory
from anelab.checkpoints.config import MODEL_FAMILIES, config_flag, config_int, config_number, text_config
from anelab.checkpoints.config_writer import config_for_geometry
from anelab.checkpoints.safetensors_io import STORAGE_DTYPES, TORCH_DTYPE_NAMES, LazyTensor
from anelab.core.decoder import (
    ACTIVATIONS,
    DecoderLayerWeights,
    HeadWeights,
    MlpWeights,
    MoeWeights,
    Norm,
    PlainMlpWeights,
)
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.weights import AttentionWeights


@dataclass(frozen=True)
class NormSlots:
    """The tensor name (after ``layers.{L}.``, without ``.weight``) of each norm slot of a decoder layer
    (``anelab.core.decoder``'s module docstring); None: the family has no norm there."""

    input: str | None = "input_layernorm"
    mlp: str | None = "post_attention_layernorm"
    attention_out: str | None = None
    mlp_out: str | None = None

    def named(self) -> list[tuple[str, str]]:
        return [(slot, name) for slot, name in vars(self).items() if name is not None]


_SANDWICH = NormSlots(  # Gemma 2 / 3: a norm before and after each branch
    mlp="pre_feedforward_layernorm", attention_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm"
)


@dataclass(frozen=True)
class DecoderFamily:
    """What a ``model_type`` means for the whole-model forward outside the attention (transformers 5.24).

    norms: which norm slots exist and their tensor names; norm_kind ``rms`` or ``layer`` (LayerNorm with
        bias); zero_centred: norm weights stored as w and applied as (1 + w) (folded at load).
    mlp: ``gated`` (gate/up/down_proj), ``fused`` (gate_up_proj [2I, D], gate rows first) or ``plain``
        (c_fc / c_proj); mlp_bias_key / mlp_bias_default: the config key adding biases to every MLP projection.
    activation_key / activation_default: the config key naming the MLP activation and its default;
        legacy_gelu: ``gelu`` means the tanh approximation (Gemma's config rewrites it).
    tie_default: ``tie_word_embeddings`` when config.json omits it.
    embedding_scale: ``none``, ``sqrt_hidden`` (sqrt(hidden_size) rounded to the model dtype, Gemma) or
        ``embedding_multiplier`` (Granite's key); multipliers: Granite's residual_multiplier / logits_scaling.
    final_softcap: the family applies ``final_logit_softcapping`` (default ``final_softcap_default``);
        False: a non-null value is refused (transformers would ignore it).
    moe: the family may route MLPs to experts (Qwen3-MoE's ``num_experts`` / ``decoder_sparse_step``).
    """

    norms: NormSlots = NormSlots()
    norm_kind: str = "rms"
    zero_centred: bool = False
    mlp: str = "gated"
    mlp_bias_key: str | None = None
    mlp_bias_default: bool = False
    activation_key: str = "hidden_act"
    activation_default: str = "silu"
    legacy_gelu: bool = False
    tie_default: bool = False
    embedding_scale: str = "none"
    multipliers: bool = False
    final_softcap: bool = False
    final_softcap_default: float | None = None
    moe: bool = False

    def describe(self) -> str:
        """The family's non-Llama conventions in one line (for ``--list-families``)."""
        parts = [
            text
            for on, text in (
                (self.norm_kind == "layer", "LayerNorm with bias"),
                (self.zero_centred, "(1 + w) norms"),
                (self.norms.input is None, "no input norm"),
                (self.norms.attention_out is not None, f"{self.norms.attention_out} on the attention output"),
                (self.norms.mlp_out is not None, f"{self.norms.mlp_out} on the MLP output"),
                (self.mlp == "fused", "fused gate_up_proj"),
                (self.mlp == "plain", "c_fc/c_proj MLP"),
                (self.activation_default != "silu", f"{self.activation_default} by default"),
                (self.embedding_scale == "sqrt_hidden", "embeddings x sqrt(hidden) in the model dtype"),
                (self.embedding_scale == "embedding_multiplier", "embedding_multiplier"),
                (self.multipliers, "residual_multiplier, logits_scaling"),
                (self.final_softcap, f"final_logit_softcapping (default {self.final_softcap_default})"),
                (self.tie_default, "tied embeddings unless tie_word_embeddings is false"),
                (self.moe, "routed experts"),
            )
            if on
        ]
        return "; ".join(parts) or "Llama's layer"


_GEMMA2 = DecoderFamily(
    norms=_SANDWICH,
    zero_centred=True,
    activation_key="hidden_activation",
    activation_default="gelu_pytorch_tanh",
    tie_default=True,
    embedding_scale="sqrt_hidden",
    final_softcap=True,
    final_softcap_default=30.0,
)

DECODER_FAMILIES: dict[str, DecoderFamily] = {
    "llama": DecoderFamily(mlp_bias_key="mlp_bias"),
    "mistral": DecoderFamily(),
    "ministral": DecoderFamily(),
    "qwen2": DecoderFamily(),
    "qwen3": DecoderFamily(),
    "qwen3_moe": DecoderFamily(moe=True),
    "gemma": DecoderFamily(
        zero_centred=True,
        activation_default="gelu_pytorch_tanh",
        legacy_gelu=True,
        tie_default=True,
        embedding_scale="sqrt_hidden",
    ),
    "gemma2": _GEMMA2,
    "gemma3_text": replace(_GEMMA2, final_softcap_default=None),
    "gemma3": replace(_GEMMA2, final_softcap=False, final_softcap_default=None),  # the wrapper never caps
    "phi3": DecoderFamily(mlp="fused"),
    "olmo2": DecoderFamily(
        norms=NormSlots(
            input=None, mlp=None, attention_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm"
        )
    ),
    "granite": DecoderFamily(mlp_bias_key="mlp_bias", embedding_scale="embedding_multiplier", multipliers=True),
    "glm": DecoderFamily(mlp="fused"),
    "glm4": DecoderFamily(
        mlp="fused",
        norms=NormSlots(attention_out="post_self_attn_layernorm", mlp_out="post_mlp_layernorm"),
    ),
    "smollm3": DecoderFamily(mlp_bias_key="mlp_bias", tie_default=True),
    "starcoder2": DecoderFamily(
        norm_kind="layer",
        mlp="plain",
        mlp_bias_key="use_bias",
        mlp_bias_default=True,
        activation_default="gelu_pytorch_tanh",
        tie_default=True,
    ),
}


def whole_model_support(model_type: str) -> str:
    """One line for ``--list-families``: what compare-arms models for this model_type, or why it refuses it."""
    family = DECODER_FAMILIES.get(model_type)
    if family is not None:
        return f"runs ({family.describe()})"
    attention = MODEL_FAMILIES.get(model_type)
    if attention is None or attention.hybrid:  # unlisted: detect_family read a qwen3* hybrid as qwen3_next
        return "refused: its linear-attention (Gated DeltaNet) layers are not modelled by the whole-model forward"
    return "refused: its decoder layer is not modelled by the whole-model forward"


@dataclass
class ModelCheckpoint:
    """A checkpoint opened for the whole-model forward; weights are read per layer on demand.

    vocab_size V, intermediate I (dense MLP), moe_intermediate (experts), experts E, top_k,
    norm_topk_prob, tied (``tie_word_embeddings``); the per-model values of the family's options:
    activation, mlp_bias, residual_multiplier, embedding_multiplier, logit_divisor, logit_softcap.
    """

    checkpoint: Checkpoint
    family: DecoderFamily
    vocab_size: int
    intermediate: int
    tied: bool
    activation: str = "silu"
    mlp_bias: bool = False
    residual_multiplier: float = 1.0
    embedding_multiplier: float = 1.0
    logit_divisor: float = 1.0
    logit_softcap: float | None = None
    experts: int = 0
    moe_intermediate: int = 0
    top_k: int = 0
    norm_topk_prob: bool = False
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    _head: HeadWeights | None = field(default=None, repr=False)

    @property
    def geometry(self) -> AttentionGeometry:
        return self.checkpoint.geometry

    @property
    def path(self) -> Path:
        return self.checkpoint.path

    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    @property
    def eps(self) -> float:
        """Every norm's epsilon (the config's ``rms_norm_eps``, Starcoder2's ``norm_epsilon``)."""
        return self.geometry.rms_norm_eps

    def is_moe_layer(self, layer: int) -> bool:
        """transformers' rule: not in mlp_only_layers, experts > 0 and (layer + 1) % decoder_sparse_step == 0."""
        return self.experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0

    def attention(self, layer: int) -> AttentionWeights:
        return self.checkpoint.layer(layer)

    def mlp(self, layer: int) -> MlpWeights | PlainMlpWeights | MoeWeights:
        """One layer's MLP weights (float32), read now (its norms are not read)."""
        if not 0 <= int(layer) < self.num_layers:
            raise AnelabInputError(f"layer {layer} is out of range 0..{self.num_layers - 1}")
        return self._layer_mlp(int(layer))

    def rope_coverage(self, prompt_tokens: int, decode: int) -> int | None:
        """The coverage that picks a run's RoPE table (``dynamic`` / ``longrope``; None for the other types).

        transformers picks those tables per forward from ``max(position_ids) + 1`` (modeling_rope_utils.py:47-49,
        83-89): the prompt's length at prefill, one more per decoded token, and keeps the keys it cached under
        earlier tables. The whole-model forward uses the prompt's table for the whole run, so it refuses a run
        whose decoded tokens would make transformers switch tables (a prompt and decode of ``decode`` tokens).
        """
        g = self.geometry
        if not g.rope_depends_on_coverage:
            return None
        last = int(prompt_tokens) + max(int(decode) - 1, 0)  # the last decode forward sees positions 0 .. last - 1
        for layer in g.full_attention_layers:
            (start, start_factor), (end, end_factor) = (g.rope_frequencies(layer, c) for c in (prompt_tokens, last))
            if start_factor != end_factor or not np.array_equal(start, end):
                raise AnelabInputError(
                    f"rope_type {g.rope_scaling.rope_type}: transformers switches RoPE tables between the "
                    f"{prompt_tokens}-token prompt and position {last - 1} of the decode; decode fewer tokens or "
                    "lengthen the prompt past the switch"
                )
        return int(prompt_tokens)

    def _name(self, layer: int, param: str) -> str:
        return f"{self.checkpoint.prefix}layers.{layer}.{param}"

    def layer(self, layer: int) -> DecoderLayerWeights:
        """The non-attention weights of one decoder layer (float32), read now."""
        if not 0 <= int(layer) < self.num_layers:
            raise AnelabInputError(f"layer {layer} is out of range 0..{self.num_layers - 1}")
        norms = {slot: self._norm(self._name(layer, name)) for slot, name in self.family.norms.named()}
        return DecoderLayerWeights(
            layer=int(layer),
            input_norm=norms.get("input"),
            mlp_norm=norms.get("mlp"),
            mlp=self._layer_mlp(layer),
            attention_out_norm=norms.get("attention_out"),
            mlp_out_norm=norms.get("mlp_out"),
            residual_multiplier=self.residual_multiplier,
        )

    def head(self) -> HeadWeights:
        """Embeddings, final norm and LM head: the final norm read now, the embedding and LM head left in their
        files (``MappedTensor``: rows on demand); the LM head is the embedding matrix when tied."""
        if self._head is None:
            d, v, p = self.geometry.hidden_size, self.vocab_size, self.checkpoint.prefix
            embed = self.checkpoint.map_tensor(f"{p}embed_tokens.weight", (v, d))
            if self.tied:
                lm_head = embed
            elif not self.checkpoint.has_tensor("lm_head.weight"):
                raise AnelabInputError(
                    f"{self.path}: lm_head.weight is missing and tie_word_embeddings is false; "
                    "set tie_word_embeddings: true if the model ties its embeddings"
                )
            else:
                lm_head = self.checkpoint.map_tensor("lm_head.weight", (v, d))
            self._head = HeadWeights(
                embed,
                self._norm(f"{p}norm"),
                lm_head,
                self.tied,
                embedding_multiplier=self.embedding_multiplier,
                logit_divisor=self.logit_divisor,
                logit_softcap=self.logit_softcap,
            )
        return self._head

    # ---- per-family tensor-name mapping --------------------------------------------------------------------
    def _norm(self, name: str) -> Norm:
        """The norm stored as ``name.weight`` (and ``name.bias`` for a LayerNorm); zero-centred weights -> 1 + w."""
        d = self.geometry.hidden_size
        weight = self.checkpoint.read_tensor(f"{name}.weight", (d,))
        if self.family.zero_centred:
            weight = np.float32(1.0) + weight  # GemmaRMSNorm: x * (1 + w), computed in fp32
        if self.family.norm_kind == "layer":
            return Norm(weight, self.checkpoint.read_tensor(f"{name}.bias", (d,)), "layer")
        return Norm(weight)

    def _layer_mlp(self, layer: int) -> MlpWeights | PlainMlpWeights | MoeWeights:
        if self.is_moe_layer(layer):
            d = self.geometry.hidden_size
            return MoeWeights(
                router=self.checkpoint.read_tensor(self._name(layer, "mlp.gate.weight"), (self.experts, d)),
                experts=[
                    self._gated_mlp(layer, f"mlp.experts.{e}.", self.moe_intermediate) for e in range(self.experts)
                ],
                top_k=self.top_k,
                norm_topk_prob=self.norm_topk_prob,
            )
        if self.family.mlp == "fused":
            return self._fused_mlp(layer)
        if self.family.mlp == "plain":
            return self._plain_mlp(layer)
        return self._gated_mlp(layer, "mlp.", self.intermediate)

    def _gated_mlp(self, layer: int, prefix: str, width: int) -> MlpWeights:
        """``{prefix}{gate,up,down}_proj.weight`` (and ``.bias`` when ``mlp_bias``)."""
        d = self.geometry.hidden_size
        read = self.checkpoint.read_tensor
        bias = (lambda name, n: read(self._name(layer, name), (n,))) if self.mlp_bias else (lambda name, n: None)
        return MlpWeights(
            gate_proj=read(self._name(layer, f"{prefix}gate_proj.weight"), (width, d)),
            up_proj=read(self._name(layer, f"{prefix}up_proj.weight"), (width, d)),
            down_proj=read(self._name(layer, f"{prefix}down_proj.weight"), (d, width)),
            activation=self.activation,
            gate_bias=bias(f"{prefix}gate_proj.bias", width),
            up_bias=bias(f"{prefix}up_proj.bias", width),
            down_bias=bias(f"{prefix}down_proj.bias", d),
        )

    def _fused_mlp(self, layer: int) -> MlpWeights:
        """Phi-3 / GLM: ``mlp.gate_up_proj.weight`` [2I, D] is ``chunk(2)``-ed after the projection: gate rows first."""
        d, width = self.geometry.hidden_size, self.intermediate
        fused = self.checkpoint.read_tensor(self._name(layer, "mlp.gate_up_proj.weight"), (2 * width, d))
        down = self.checkpoint.read_tensor(self._name(layer, "mlp.down_proj.weight"), (d, width))
        return MlpWeights(fused[:width], fused[width:], down, self.activation)

    def _plain_mlp(self, layer: int) -> PlainMlpWeights:
        """Starcoder2: ``mlp.c_fc`` [I, D] and ``mlp.c_proj`` [D, I], with biases when ``use_bias``."""
        d, width, read = self.geometry.hidden_size, self.intermediate, self.checkpoint.read_tensor
        bias = (lambda name, n: read(self._name(layer, name), (n,))) if self.mlp_bias else (lambda name, n: None)
        return PlainMlpWeights(
            fc=read(self._name(layer, "mlp.c_fc.weight"), (width, d)),
            fc_bias=bias("mlp.c_fc.bias", width),
            proj=read(self._name(layer, "mlp.c_proj.weight"), (d, width)),
            proj_bias=bias("mlp.c_proj.bias", d),
            activation=self.activation,
        )


def _moe_options(text: dict, family: DecoderFamily) -> dict:
    """Qwen3-MoE's routing keys with transformers' defaults (``num_experts`` 128 when absent,
    configuration_qwen3_moe.py:100; ``text_config`` has already read ``num_local_experts`` as it)."""
    if not family.moe and text.get("num_experts"):
        raise AnelabInputError("config.json num_experts: routed experts are modelled for qwen3_moe only; refusing")
    experts = config_int(text, "num_experts", 128 if family.moe else 0, minimum=0)
    if not experts:
        return {}
    top_k = config_int(text, "num_experts_per_tok", 8, minimum=0)
    if not 1 <= top_k <= experts:
        raise AnelabInputError(f"config.json num_experts_per_tok ({top_k}) must be in 1..num_experts ({experts})")
    mlp_only = text.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
        raise AnelabInputError(f"config.json mlp_only_layers must be a list of layer indices, got {mlp_only!r}")
    step = config_int(text, "decoder_sparse_step", 1, minimum=0)
    if step < 1:
        raise AnelabInputError("config.json decoder_sparse_step must be >= 1")
    return {
        "experts": experts,
        "moe_intermediate": config_int(text, "moe_intermediate_size", 768, minimum=0),
        "top_k": top_k,
        "norm_topk_prob": config_flag(text, "norm_topk_prob", False),
        "sparse_step": step,
        "mlp_only_layers": tuple(mlp_only),
    }


def _activation(text: dict, family: DecoderFamily, model_type: str) -> str:
    act = text.get(family.activation_key) or family.activation_default
    if not isinstance(act, str):
        raise AnelabInputError(f"config.json {family.activation_key} must be an activation name, got {act!r}")
    if family.legacy_gelu and act == "gelu":
        act = "gelu_pytorch_tanh"  # GemmaConfig.__post_init__ rewrites the legacy value
    if act not in ACTIVATIONS:
        raise AnelabInputError(
            f"config.json {family.activation_key} {act!r} is not modelled for {model_type}; "
            f"the whole-model forward runs {', '.join(ACTIVATIONS)}"
        )
    return act


def _model_dtype(checkpoint: Checkpoint) -> np.dtype:
    """The dtype transformers runs the model in: config.json ``dtype`` / ``torch_dtype``, else the weights' storage."""
    names = {torch: storage for storage, torch in TORCH_DTYPE_NAMES.items()}
    for config in (checkpoint.text, checkpoint.config):
        for key in ("dtype", "torch_dtype"):
            value = config.get(key)
            if value is not None and not isinstance(value, str):
                raise AnelabInputError(f'config.json {key!r} must be a dtype name such as "bfloat16", got {value!r}')
            if value in names:
                return STORAGE_DTYPES[names[value]]
    return STORAGE_DTYPES.get(checkpoint.tensor_dtype(), STORAGE_DTYPES["F32"])


def _scalars(checkpoint: Checkpoint, family: DecoderFamily, model_type: str) -> dict:
    """The per-model values of the family's embedding / residual / logit options."""
    text, d = checkpoint.text, checkpoint.geometry.hidden_size
    out = {}
    if family.embedding_scale == "sqrt_hidden":
        # Gemma: a float32 buffer sqrt(hidden) cast to the weights' dtype (bf16: sqrt(3072) = 55.4256 -> 55.5)
        out["embedding_multiplier"] = float(np.float32(math.sqrt(d)).astype(_model_dtype(checkpoint)))
    elif family.embedding_scale == "embedding_multiplier":
        out["embedding_multiplier"] = config_number(text, "embedding_multiplier", 1.0)
    if family.multipliers:
        out["residual_multiplier"] = config_number(text, "residual_multiplier", 1.0)
        out["logit_divisor"] = config_number(text, "logits_scaling", 1.0)
    cap = text.get("final_logit_softcapping", family.final_softcap_default)
    if cap is not None and not family.final_softcap:
        raise AnelabInputError(
            f"config.json final_logit_softcapping={cap!r}: {model_type} does not apply it in transformers; "
            "set it to null (anelab refuses the ambiguity)"
        )
    if cap is not None:
        out["logit_softcap"] = config_number({"final_logit_softcapping": cap}, "final_logit_softcapping", cap)
    return out


# Hybrids whose MLPs (not their linear-attention layers) anelab reads: a dense gated MLP, ``hidden_act`` (SiLU by
# default), no biases (transformers modeling_qwen3_5.py Qwen3_5MLP; mlx-lm models/qwen3_5.py MLP). Routed experts
# (qwen3_next, qwen3_5_moe) are refused by ``_moe_options``.
HYBRID_MLP_FAMILIES: dict[str, DecoderFamily] = {
    name: DecoderFamily(zero_centred=True) for name in ("qwen3_5", "qwen3_5_text", "qwen3_next", "qwen3_5_moe",
                                                        "qwen3_5_moe_text")
}  # fmt: skip


def mlp_model(checkpoint: Checkpoint) -> ModelCheckpoint:
    """An opened checkpoint read for its MLPs only (``ModelCheckpoint.mlp``): ``whole_model``, or for a hybrid in
    ``HYBRID_MLP_FAMILIES`` (whose whole-model forward anelab does not run) its dense MLPs; routed experts refused."""
    family = HYBRID_MLP_FAMILIES.get(checkpoint.model_type)
    if family is None:
        return whole_model(checkpoint)
    text = text_config(checkpoint.config)
    if text.get("num_experts"):
        raise AnelabInputError(
            f"model_type {checkpoint.model_type}: its MLPs are routed experts (num_experts), which anelab does not "
            "export as MLP sidecars; export --design gdn-proj or attention instead"
        )
    return ModelCheckpoint(
        checkpoint=checkpoint,
        family=family,
        vocab_size=config_int(text, "vocab_size", minimum=0),
        intermediate=config_int(text, "intermediate_size", minimum=0),
        tied=config_flag(text, "tie_word_embeddings", family.tie_default),
        activation=_activation(text, family, checkpoint.model_type),
    )


def load_model(path: str | os.PathLike) -> ModelCheckpoint:
    """Open the checkpoint at ``path`` for the whole-model forward (``whole_model`` of ``load_checkpoint``)."""
    return whole_model(load_checkpoint(path))


def whole_model(checkpoint: Checkpoint) -> ModelCheckpoint:
    """An opened checkpoint read for the whole-model forward (config.json and headers only; nothing read again).

    Refuses (one line) a model_type outside ``DECODER_FAMILIES`` (with the reason ``--list-families``
    prints), an unmodelled activation, an ignored final soft-cap, and missing
    vocab/intermediate sizes.
    """
    text = text_config(checkpoint.config)
    # a multimodal wrapper (Gemma 3) is its own row: its lm_head, tying and logits belong to the outer class
    nested, outer = text is not checkpoint.config, checkpoint.config.get("model_type")
    model_type = outer if nested and outer in DECODER_FAMILIES else checkpoint.model_type
    family = DECODER_FAMILIES.get(model_type)
    if family is None:
        raise AnelabInputError(
            f"model_type {model_type} cannot run whole-model arms: {whole_model_support(model_type).removeprefix('refused: ')}; "
            f"supported: {', '.join(DECODER_FAMILIES)}"
        )
    tie_source = checkpoint.config if nested else text  # tie_word_embeddings of the class that owns lm_head
    return ModelCheckpoint(
        checkpoint=checkpoint,
        family=family,
        vocab_size=config_int(text, "vocab_size", minimum=0),
        intermediate=config_int(text, "intermediate_size", minimum=0),
        tied=config_flag(tie_source, "tie_word_embeddings", family.tie_default),
        activation=_activation(text, family, model_type),
        mlp_bias=config_flag(text, family.mlp_bias_key, family.mlp_bias_default) if family.mlp_bias_key else False,
        **_scalars(checkpoint, family, model_type),
        **_moe_options(text, family),
    )


# ---- writing a whole model in the real layout ----------------------------------------------------------------
def _mlp_tensors(prefix: str, mlp: MlpWeights) -> dict[str, np.ndarray]:
    return {
        f"{prefix}gate_proj.weight": mlp.gate_proj,
        f"{prefix}up_proj.weight": mlp.up_proj,
        f"{prefix}down_proj.weight": mlp.down_proj,
    }


def model_tensors(layers: dict[int, DecoderLayerWeights], head: HeadWeights, prefix: str = "model.") -> dict:
    """Every non-attention tensor of a Llama-style model under its transformers name (``lm_head.weight`` only when untied)."""
    tensors = {f"{prefix}embed_tokens.weight": head.embed_tokens, f"{prefix}norm.weight": head.final_norm.weight}
    if not head.tied:
        tensors["lm_head.weight"] = head.lm_head
    for index, w in layers.items():
        base = f"{prefix}layers.{index}."
        if (w.attention_out_norm, w.mlp_out_norm, w.residual_multiplier) != (None, None, 1.0) or any(
            n is None or n.kind != "rms" for n in (w.input_norm, w.mlp_norm)
        ):
            raise AnelabInputError(f"layer {index}: the writer writes Llama-style layers (two RMSNorms) only")
        tensors[f"{base}input_layernorm.weight"] = w.input_norm.weight
        tensors[f"{base}post_attention_layernorm.weight"] = w.mlp_norm.weight
        if isinstance(w.mlp, MoeWeights):
            tensors[f"{base}mlp.gate.weight"] = w.mlp.router
            for e, expert in enumerate(w.mlp.experts):
                tensors.update(_mlp_tensors(f"{base}mlp.experts.{e}.", expert))
        else:
            tensors.update(_mlp_tensors(f"{base}mlp.", w.mlp))
    return tensors


def write_model_checkpoint(
    directory: str | os.PathLike,
    geometry: AttentionGeometry,
    attention: dict[int, AttentionWeights],
    layers: dict[int, DecoderLayerWeights],
    head: HeadWeights,
    *,
    model_type: str,
    dtype: str = "F32",
    shards: int = 1,
) -> Path:
    """Write a whole dense (or Qwen3-MoE) model: attention via ``write_checkpoint``, everything else beside it.

    ``layers`` holds every layer's norms and MLP (all MoE layers must share top_k / norm_topk_prob /
    expert count and width; dense layers one intermediate size). config.json records vocab_size,
    intermediate_size, tie_word_embeddings, hidden_act and the MoE keys.
    """
    if model_type not in DECODER_FAMILIES:
        raise AnelabInputError(
            f"model_type {model_type} has no whole-model writer; use one of {', '.join(DECODER_FAMILIES)}"
        )
    if sorted(layers) != list(range(geometry.num_layers)):
        raise AnelabInputError(f"layers must hold every layer 0..{geometry.num_layers - 1}, got {sorted(layers)}")
    dense = [w.mlp for w in layers.values() if isinstance(w.mlp, MlpWeights)]
    routed = [w.mlp for w in layers.values() if isinstance(w.mlp, MoeWeights)]
    extra = {
        "vocab_size": head.vocab_size,
        "tie_word_embeddings": bool(head.tied),
        "hidden_act": "silu",
        "intermediate_size": int(dense[0].gate_proj.shape[0]) if dense else 0,
    }
    if DECODER_FAMILIES[model_type].moe:
        extra["num_experts"] = 0  # transformers' default is 128 routed experts: a dense model says 0
    if routed:
        if not DECODER_FAMILIES[model_type].moe:
            raise AnelabInputError(f"model_type {model_type} has no routed experts; write it as qwen3_moe")
        first = routed[0]
        extra.update(
            num_experts=len(first.experts),
            num_experts_per_tok=first.top_k,
            norm_topk_prob=first.norm_topk_prob,
            moe_intermediate_size=int(first.experts[0].gate_proj.shape[0]),
            decoder_sparse_step=1,
            mlp_only_layers=sorted(i for i, w in layers.items() if isinstance(w.mlp, MlpWeights)),
        )
    return write_checkpoint(
        directory,
        geometry,
        attention,
        dtype=dtype,
        shards=shards,
        model_type=model_type,
        extra_tensors=model_tensors(layers, head),
        extra_config=extra,
    )


def random_model_tensors(
    geometry: AttentionGeometry,
    vocab: int,
    intermediate: int,
    seed: int,
    *,
    tied: bool,
    prefix: str = "model.",
    tile: int | None = None,
) -> dict[str, LazyTensor]:
    """Every tensor of a dense Llama-layout model under its transformers name, each made when written.

    Projections ~ N(0, 1/fan_in), norms 1 + N(0, 0.1^2), embeddings ~ N(0, 1); each tensor seeded by
    (seed, its name), so a model larger than memory is written one tensor at a time, deterministically.
    ``tile``: each tensor repeats one seeded block of ``tile`` values (fast for shapes of billions of
    parameters; the values are not independent beyond the block).
    """
    g, d = geometry, geometry.hidden_size

    def normal(name: str, shape: tuple[int, ...], scale: float, shift: float = 0.0) -> LazyTensor:
        def make() -> np.ndarray:
            rng = np.random.default_rng([int(seed), zlib.crc32(name.encode())])
            size = int(np.prod(shape))
            count = size if tile is None else min(size, int(tile))
            values = rng.standard_normal(count, dtype=np.float32)
            values *= np.float32(scale)
            if shift:
                values += np.float32(shift)
            if count == size:
                return values.reshape(shape)
            return np.resize(values.astype(STORAGE_DTYPES["BF16"]), shape)  # written as stored: no cast per value

        return LazyTensor(shape, make)

    shapes = {f"{prefix}embed_tokens.weight": ((vocab, d), 1.0, 0.0), f"{prefix}norm.weight": ((d,), 0.1, 1.0)}
    if not tied:
        shapes["lm_head.weight"] = ((vocab, d), d**-0.5, 0.0)
    for layer in range(g.num_layers):
        base = f"{prefix}layers.{layer}."
        for param, shape in g.parameter_shapes().items():
            shapes[f"{base}self_attn.{param}"] = (shape, 0.1, 1.0) if "norm" in param else (shape, shape[-1] ** -0.5, 0)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[f"{base}{norm}.weight"] = ((d,), 0.1, 1.0)
        for proj, shape in (("gate", (intermediate, d)), ("up", (intermediate, d)), ("down", (d, intermediate))):
            shapes[f"{base}mlp.{proj}_proj.weight"] = (shape, shape[1] ** -0.5, 0.0)
    return {name: normal(name, shape, scale, shift) for name, (shape, scale, shift) in shapes.items()}


def write_random_model(
    directory: str | os.PathLike,
    geometry: AttentionGeometry,
    *,
    vocab: int,
    intermediate: int,
    seed: int = 0,
    tied: bool = False,
    model_type: str = "llama",
    dtype: str = "BF16",
    shards: int = 1,
    tile: int | None = None,
) -> Path:
    """Write a dense model of ``geometry`` with random weights (``random_model_tensors``) one tensor at a time:
    the benchmarks' 1B- and 8B-shaped checkpoints without holding them in memory."""

    if model_type not in ("llama", "mistral", "qwen2", "qwen3"):
        raise AnelabInputError(f"write_random_model writes dense Llama-layout models, not {model_type!r}")
    config = config_for_geometry(geometry, model_type, MODEL_FAMILIES[model_type], dtype)
    config.update(vocab_size=vocab, intermediate_size=intermediate, tie_word_embeddings=tied, hidden_act="silu")
    tensors = random_model_tensors(geometry, vocab, intermediate, seed, tied=tied, tile=tile)
    return write_checkpoint_directory(directory, config, tensors, dtype=dtype, shards=shards)
