"""A whole Hugging Face decoder checkpoint for ``anelab.decoder``: per-family options, lazy per-layer reads, a writer.

Tensor names are transformers' on-disk names (``model.embed_tokens.weight``,
``model.layers.{L}.input_layernorm.weight``, ``.post_attention_layernorm.weight``,
``.mlp.{gate,up,down}_proj.weight``; Qwen3-MoE: ``.mlp.gate.weight`` [E, D] and
``.mlp.experts.{e}.{gate,up,down}_proj.weight``; ``model.norm.weight``; ``lm_head.weight`` unless
``tie_word_embeddings``). A layer's weights are read when ``layer(i)`` is called; the attention
tensors come through ``anelab.hf.checkpoint.Checkpoint.layer``.

``DECODER_FAMILIES`` says what each supported ``model_type`` means for the layers around the
attention; a family added later adds a row (and, if its layer differs, options the decoder honours).
Anything not modelled is refused with one line: hybrid linear-attention layers, a sliding window
the run would reach, a non-SiLU activation, MLP biases.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from anelab.decoder import DecoderLayerWeights, HeadWeights, MlpWeights, MoeWeights
from anelab.errors import AnelabInputError
from anelab.geometry import AttentionGeometry
from anelab.hf.checkpoint import Checkpoint, load_checkpoint, write_checkpoint, write_checkpoint_directory
from anelab.hf.config import text_config
from anelab.hf.safetensors_io import LazyTensor
from anelab.weights import AttentionWeights


@dataclass(frozen=True)
class DecoderFamily:
    """What a ``model_type`` means for the whole-model forward (transformers 5.24 defaults).

    sliding: how config.json turns on a sliding window — ``"none"`` (never), ``"sliding_window"``
        (every layer slides when ``sliding_window`` is not null: Mistral), ``"use_sliding_window"``
        (Qwen2/3: only when ``use_sliding_window`` is true). A window the run stays inside equals the
        causal mask exactly; a run that would reach it is refused.
    moe: the family may route MLPs to experts (Qwen3-MoE's ``num_experts`` / ``decoder_sparse_step``).
    mlp_bias_key: config key that adds biases to gate/up/down (refused when true).
    """

    sliding: str = "none"
    moe: bool = False
    mlp_bias_key: str | None = None


DECODER_FAMILIES: dict[str, DecoderFamily] = {
    "llama": DecoderFamily(mlp_bias_key="mlp_bias"),
    "mistral": DecoderFamily(sliding="sliding_window"),
    "qwen2": DecoderFamily(sliding="use_sliding_window"),
    "qwen3": DecoderFamily(sliding="use_sliding_window"),
    "qwen3_moe": DecoderFamily(sliding="use_sliding_window", moe=True),
}


@dataclass
class ModelCheckpoint:
    """A checkpoint opened for the whole-model forward; weights are read per layer on demand.

    vocab_size V, intermediate I (dense MLP), moe_intermediate (experts), experts E, top_k,
    norm_topk_prob, tied (``tie_word_embeddings``), window (sliding window in tokens, or None).
    """

    checkpoint: Checkpoint
    family: DecoderFamily
    vocab_size: int
    intermediate: int
    tied: bool
    window: int | None = None
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
        return self.geometry.rms_norm_eps

    def is_moe_layer(self, layer: int) -> bool:
        """transformers' rule: not in mlp_only_layers, experts > 0 and (layer + 1) % decoder_sparse_step == 0."""
        return self.experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0

    def check_run_length(self, tokens: int) -> None:
        """Refuse a run (prompt + decoded tokens) that reaches the sliding window (not modelled)."""
        if self.window is not None and tokens > self.window:
            raise AnelabInputError(
                f"a run of {tokens} tokens reaches the sliding window of {self.window}, which the whole-model "
                f"forward does not model; use at most {self.window} tokens (prompt + decode)"
            )

    def attention(self, layer: int) -> AttentionWeights:
        return self.checkpoint.layer(layer)

    def _name(self, layer: int, param: str) -> str:
        return f"{self.checkpoint.prefix}layers.{layer}.{param}"

    def _mlp(self, layer: int, prefix: str, width: int) -> MlpWeights:
        d = self.geometry.hidden_size
        read = self.checkpoint.read_tensor
        return MlpWeights(
            gate_proj=read(self._name(layer, f"{prefix}gate_proj.weight"), (width, d)),
            up_proj=read(self._name(layer, f"{prefix}up_proj.weight"), (width, d)),
            down_proj=read(self._name(layer, f"{prefix}down_proj.weight"), (d, width)),
        )

    def layer(self, layer: int) -> DecoderLayerWeights:
        """The non-attention weights of one decoder layer (float32), read now."""
        if not 0 <= int(layer) < self.num_layers:
            raise AnelabInputError(f"layer {layer} is out of range 0..{self.num_layers - 1}")
        d = self.geometry.hidden_size
        read = self.checkpoint.read_tensor
        if self.is_moe_layer(layer):
            mlp = MoeWeights(
                router=read(self._name(layer, "mlp.gate.weight"), (self.experts, d)),
                experts=[self._mlp(layer, f"mlp.experts.{e}.", self.moe_intermediate) for e in range(self.experts)],
                top_k=self.top_k,
                norm_topk_prob=self.norm_topk_prob,
            )
        else:
            mlp = self._mlp(layer, "mlp.", self.intermediate)
        return DecoderLayerWeights(
            layer=int(layer),
            input_norm=read(self._name(layer, "input_layernorm.weight"), (d,)),
            post_attention_norm=read(self._name(layer, "post_attention_layernorm.weight"), (d,)),
            mlp=mlp,
        )

    def head(self) -> HeadWeights:
        """Embeddings, final norm and LM head: the final norm read now, the embedding and LM head left in their
        files (``MappedTensor``: rows on demand); the LM head is the embedding matrix when tied."""
        if self._head is None:
            d, v, p = self.geometry.hidden_size, self.vocab_size, self.checkpoint.prefix
            embed = self.checkpoint.map_tensor(f"{p}embed_tokens.weight", (v, d))
            norm = self.checkpoint.read_tensor(f"{p}norm.weight", (d,))
            if self.tied:
                lm_head = embed
            elif not self.checkpoint.has_tensor("lm_head.weight"):
                raise AnelabInputError(
                    f"{self.path}: lm_head.weight is missing and tie_word_embeddings is false; "
                    "set tie_word_embeddings: true if the model ties its embeddings"
                )
            else:
                lm_head = self.checkpoint.map_tensor("lm_head.weight", (v, d))
            self._head = HeadWeights(embed, norm, lm_head, self.tied)
        return self._head


def _int(text: dict, key: str, default=None) -> int:
    value = text.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AnelabInputError(f"config.json {key!r} must be a non-negative integer, got {value!r}")
    return value


def _window(text: dict, family: DecoderFamily) -> int | None:
    """Mistral: every layer slides over ``sliding_window`` (default 4096; null = off). Qwen2/3 with
    ``use_sliding_window``: only the layers from ``max_window_layers`` on slide, and those are not
    full-attention layers to anelab's loader, so such a config is refused."""
    if family.sliding == "use_sliding_window" and text.get("use_sliding_window"):
        raise AnelabInputError(
            "config.json use_sliding_window: true (sliding-window layers) is not modelled by the whole-model forward"
        )
    if family.sliding == "sliding_window":
        window = text.get("sliding_window", 4096)
        return None if window is None else _int({"sliding_window": window}, "sliding_window")
    return None


def _moe_options(text: dict, family: DecoderFamily) -> dict:
    """Qwen3-MoE's routing keys with transformers' defaults (``num_experts`` 128 when absent,
    configuration_qwen3_moe.py:100; ``text_config`` has already read ``num_local_experts`` as it)."""
    experts = _int(text, "num_experts", 128 if family.moe else 0)
    if not experts:
        return {}
    top_k = _int(text, "num_experts_per_tok", 8)
    if not 1 <= top_k <= experts:
        raise AnelabInputError(f"config.json num_experts_per_tok ({top_k}) must be in 1..num_experts ({experts})")
    mlp_only = text.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
        raise AnelabInputError(f"config.json mlp_only_layers must be a list of layer indices, got {mlp_only!r}")
    step = _int(text, "decoder_sparse_step", 1)
    if step < 1:
        raise AnelabInputError("config.json decoder_sparse_step must be >= 1")
    return {
        "experts": experts,
        "moe_intermediate": _int(text, "moe_intermediate_size", 768),
        "top_k": top_k,
        "norm_topk_prob": bool(text.get("norm_topk_prob", False)),
        "sparse_step": step,
        "mlp_only_layers": tuple(mlp_only),
    }


def load_model(path: str | os.PathLike) -> ModelCheckpoint:
    """Open a checkpoint for the whole-model forward (reads config.json and headers only).

    Refuses (one line) a model_type outside ``DECODER_FAMILIES`` (hybrid linear-attention models are
    named as such), an activation other than SiLU, MLP biases, and missing vocab/intermediate sizes.
    """
    checkpoint = load_checkpoint(path)
    model_type, text = checkpoint.model_type, text_config(checkpoint.config)
    family = DECODER_FAMILIES.get(model_type)
    if family is None:
        why = (
            "its linear-attention (Gated DeltaNet) layers are not modelled by the whole-model forward"
            if checkpoint.family.hybrid
            else "its decoder layer is not modelled by the whole-model forward"
        )
        raise AnelabInputError(
            f"model_type {model_type} cannot run whole-model arms: {why}; supported: {', '.join(DECODER_FAMILIES)}"
        )
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise AnelabInputError(
            f"config.json hidden_act {act!r} is not modelled; the whole-model forward runs SiLU only"
        )
    if family.mlp_bias_key and text.get(family.mlp_bias_key):
        raise AnelabInputError(f"config.json {family.mlp_bias_key}: true (MLP biases) is not modelled; refusing")
    if not family.moe and text.get("num_experts"):
        raise AnelabInputError(f"model_type {model_type} with num_experts is not modelled; refusing")
    return ModelCheckpoint(
        checkpoint=checkpoint,
        family=family,
        vocab_size=_int(text, "vocab_size"),
        intermediate=_int(text, "intermediate_size"),
        tied=bool(text.get("tie_word_embeddings", False)),
        window=_window(text, family),
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
    """Every non-attention tensor under its transformers name (``lm_head.weight`` only when untied)."""
    tensors = {f"{prefix}embed_tokens.weight": head.embed_tokens, f"{prefix}norm.weight": head.final_norm}
    if not head.tied:
        tensors["lm_head.weight"] = head.lm_head
    for index, w in layers.items():
        base = f"{prefix}layers.{index}."
        tensors[f"{base}input_layernorm.weight"] = w.input_norm
        tensors[f"{base}post_attention_layernorm.weight"] = w.post_attention_norm
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
    geometry: AttentionGeometry, vocab: int, intermediate: int, seed: int, *, tied: bool, prefix: str = "model."
) -> dict[str, LazyTensor]:
    """Every tensor of a dense Llama-layout model under its transformers name, each made when written.

    Projections ~ N(0, 1/fan_in), norms 1 + N(0, 0.1^2), embeddings ~ N(0, 1); each tensor seeded by
    (seed, its name), so a model larger than memory is written one tensor at a time, deterministically.
    """
    g, d = geometry, geometry.hidden_size

    def normal(name: str, shape: tuple[int, ...], scale: float, shift: float = 0.0) -> LazyTensor:
        def make() -> np.ndarray:
            rng = np.random.default_rng([int(seed), zlib.crc32(name.encode())])
            values = rng.standard_normal(shape, dtype=np.float32)
            values *= np.float32(scale)
            return values + np.float32(shift) if shift else values

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
) -> Path:
    """Write a dense model of ``geometry`` with random weights (``random_model_tensors``) one tensor at a time:
    the benchmarks' 1B- and 8B-shaped checkpoints without holding them in memory."""
    from anelab.hf.config import MODEL_FAMILIES, config_for_geometry

    if model_type not in ("llama", "mistral", "qwen2", "qwen3"):
        raise AnelabInputError(f"write_random_model writes dense Llama-layout models, not {model_type!r}")
    config = config_for_geometry(geometry, model_type, MODEL_FAMILIES[model_type], dtype)
    config.update(vocab_size=vocab, intermediate_size=intermediate, tie_word_embeddings=tied, hidden_act="silu")
    tensors = random_model_tensors(geometry, vocab, intermediate, seed, tied=tied)
    return write_checkpoint_directory(directory, config, tensors, dtype=dtype, shards=shards)
