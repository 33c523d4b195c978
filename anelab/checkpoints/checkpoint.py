"""A checkpoint opened for its attention layers, whatever its format: load one layer's weights lazily; write one.

The path is opened by its format (``anelab.checkpoints.formats``: a Hugging Face safetensors directory, a
GGUF file, an MLX-quantized directory), which serves the config and every tensor under its transformers name,
float32 in anelab's layout; only the requested layer's bytes are read. The writer produces the Hugging Face
layout so tests and notebooks work on small synthetic models.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from anelab.checkpoints.config import (
    CONFIG_FILE,
    LEGACY_LAYER_TYPES,
    MODEL_FAMILIES,
    ModelFamily,
    detect_family,
    geometry_from_config,
    text_config,
)
from anelab.checkpoints.config_writer import DEFAULT_MODEL_TYPES, WRITABLE_MODEL_TYPES, config_for_geometry
from anelab.checkpoints.formats import open_source
from anelab.checkpoints.safetensors_io import INDEX_FILE, STORAGE_DTYPES, LazyTensor, write_safetensors
from anelab.checkpoints.source import TensorSource
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.weights import AttentionWeights

_LAYER_KEY = re.compile(r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.self_attn\.(q|qkv)_proj\.weight$")


# Prefixes tried in this order when several decoder stacks carry attention (e.g. Qwen3-Next's
# multi-token-prediction head ``mtp.layers.0…`` next to ``model.layers.…``).
_PREFERRED_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "")


@dataclass
class Checkpoint:
    """A checkpoint (a model directory or a GGUF file), opened for its full-attention layers.

    ``config`` is config.json as read (a GGUF file's built from its metadata); ``text`` is its language-model
    part; ``geometry`` the attention block's shapes; ``prefix`` the tensor-name prefix before
    ``layers.{L}.self_attn.``; ``tensors`` its tensors by transformers name (``source.TensorSource``);
    ``format`` the ``formats.FORMATS`` entry that opened it; ``quantized``: its weights are stored quantized.
    """

    path: Path
    config: dict
    geometry: AttentionGeometry
    model_type: str
    family: ModelFamily
    prefix: str
    tensors: TensorSource
    format: str = "safetensors"
    quantized: bool = False
    _tokenizer: object = field(default=None, repr=False)

    @property
    def text(self) -> dict:
        return text_config(self.config)

    def tensor_name(self, layer: int, param: str) -> str:
        """Full tensor name, e.g. ``model.layers.3.self_attn.q_norm.weight`` for ("q_norm.weight")."""
        return f"{self.prefix}layers.{layer}.self_attn.{param}"

    def has_tensor(self, name: str) -> bool:
        """Whether the checkpoint maps a tensor of this full name."""
        return self.tensors.shape(name) is not None

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        """Refuse (one line) a missing tensor or a shape other than ``shape``."""
        found = self.tensors.shape(name)
        if found is None:
            raise AnelabInputError(f"tensor {name} is missing from the checkpoint at {self.path}")
        if tuple(found) != tuple(shape):
            raise AnelabInputError(f"tensor {name} has shape {list(found)}, expected {list(shape)} from config.json")

    def read_tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor ``name`` as float32 (dequantized, anelab's layout), read lazily; refuses a missing one or a
        shape other than ``shape``."""
        self._check_shape(name, shape)
        return self.tensors.read_float32(name)

    def map_tensor(self, name: str, shape: tuple[int, ...]):
        """The tensor ``name`` [N, K] left in its file (rows read as float32 on demand); refused as ``read_tensor``."""
        self._check_shape(name, shape)
        return self.tensors.mapped(name)

    def tokenizer(self):
        """The model's tokenizer (``anelab.checkpoints.tokenizer.ModelTokenizer``: tokenizer.json, or a GGUF
        file's metadata), built once; refused (one line) when the checkpoint carries none."""
        if self._tokenizer is None:
            raise AnelabInputError(f"checkpoint {self.path} carries no tokenizer (no tokenizer.json); pass --tokens")
        if callable(self._tokenizer):
            self._tokenizer = self._tokenizer()
        return self._tokenizer

    def _check_layer(self, index: int) -> None:
        g = self.geometry
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise AnelabInputError(f"layer must be an integer, got {index!r}")
        full = ", ".join(str(i) for i in g.full_attention_layers)
        if not 0 <= index < g.num_layers:
            raise AnelabInputError(
                f"layer {index} is out of range 0..{g.num_layers - 1}; full-attention layers: {full}"
            )
        if index not in g.full_attention_layers:
            kinds = self.text.get("layer_types")
            kind = (
                f"a {LEGACY_LAYER_TYPES.get(kinds[index], kinds[index])} layer"
                if kinds
                else "not a full-attention layer"
            )
            raise AnelabInputError(f"layer {index} is {kind}, not full attention; full-attention layers: {full}")

    def layer(self, index: int) -> AttentionWeights:
        """One full-attention layer's weights (float32; q/k norms as the effective multiplier).

        Refuses a layer that is out of range or not full attention, a missing tensor, a bias the
        config does not declare, a shape that disagrees with config.json, or an unsupported dtype.
        """
        self._check_layer(index)
        index = int(index)
        expected = self.geometry.parameter_shapes()
        for param in ("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias"):
            name = self.tensor_name(index, param)
            if param not in expected and self.has_tensor(name):
                raise AnelabInputError(
                    f"tensor {name} exists but config.json declares no such bias (attention_bias); "
                    "fix config.json so the bias is not dropped"
                )
        values: dict[str, np.ndarray] = {}
        if self.family.fused_qkv:
            values.update(self._split_fused_qkv(index))
        for param, shape in expected.items():
            if param in values:
                continue
            values[param] = self.read_tensor(self.tensor_name(index, param), shape)
        for norm in ("q_norm.weight", "k_norm.weight"):
            if norm in values and self.family.zero_centred_norm:
                # Zero-centred RMSNorm stores w and multiplies by (1 + w) (Qwen3NextRMSNorm).
                values[norm] = np.float32(1.0) + values[norm]
        return AttentionWeights(
            layer=index,
            q_proj=values["q_proj.weight"],
            k_proj=values["k_proj.weight"],
            v_proj=values["v_proj.weight"],
            o_proj=values["o_proj.weight"],
            q_norm=values.get("q_norm.weight"),
            k_norm=values.get("k_norm.weight"),
            q_bias=values.get("q_proj.bias"),
            k_bias=values.get("k_proj.bias"),
            v_bias=values.get("v_proj.bias"),
            o_bias=values.get("o_proj.bias"),
        )

    def _split_fused_qkv(self, index: int) -> dict[str, np.ndarray]:
        """Phi-3's ``qkv_proj.weight`` [Hq*d + 2*Hkv*d, D] split in order Q | K | V
        (modeling_phi3.py: query_pos = Hq*d, then Hkv*d rows of K, then V)."""
        g = self.geometry
        name = self.tensor_name(index, "qkv_proj.weight")
        if not self.has_tensor(name):
            raise AnelabInputError(f"tensor {name} (Phi-3's fused q/k/v projection) is missing from {self.path}")
        q_rows, kv_rows = g.q_out_features, g.kv_out_features
        for param in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "qkv_proj.bias"):
            if self.has_tensor(self.tensor_name(index, param)):
                raise AnelabInputError(
                    f"tensor {self.tensor_name(index, param)} next to the fused qkv_proj.weight; a Phi-3 layer has only the fused one"
                )
        fused = self.read_tensor(name, (q_rows + 2 * kv_rows, g.hidden_size))
        return {
            "q_proj.weight": fused[:q_rows],
            "k_proj.weight": fused[q_rows : q_rows + kv_rows],
            "v_proj.weight": fused[q_rows + kv_rows :],
        }

    def attention_digests(self, layer: int) -> dict[str, str]:
        """Tensor name -> digest for every tensor of ``layer``'s attention (``{prefix}layers.{L}.self_attn.*``).

        The digest is SHA-256 (16 hex digits) of the name, storage, shape and stored bytes (an MLX weight's
        scales and biases too; ``source.TensorSource.digest``), read with the pages released after each tensor:
        what an exported package records to recognise its checkpoint under any path, in any format.
        """
        stem = self.tensor_name(int(layer), "")
        return {
            name: self.tensors.digest(name) for name in sorted(n for n in self.tensors.names() if n.startswith(stem))
        }

    def tensor_dtype(self, layer: int | None = None) -> str:
        """Storage of a full-attention layer's q_proj (the first such layer by default): ``BF16``, ``Q4_1``, ..."""
        layer = self.geometry.full_attention_layers[0] if layer is None else layer
        name = self.tensor_name(layer, "qkv_proj.weight" if self.family.fused_qkv else "q_proj.weight")
        return self.tensors.storage(name) if self.has_tensor(name) else "missing"

    def source_record(
        self, layer: int, weights_mode: str = "fp16", block: str = "attention", stem: str | None = None
    ) -> dict:
        """What a package of ``layer`` records about where its weights came from (``anelab.sourceFormat``): the
        format, how the layer's ``block`` tensors are stored (the attention's, or those named ``layers.{L}.{stem}*``)
        and, from a quantized source, that the sidecar holds the dequantized projections (stored ``weights_mode``:
        fp16, or re-compressed)."""
        start = self.tensor_name(int(layer), "") if stem is None else f"{self.prefix}layers.{int(layer)}.{stem}"
        storage = sorted({self.tensors.storage(n) for n in self.tensors.names() if n.startswith(start)})
        key = "attention_storage" if stem is None else "block_storage"  # a block's: "block" names it
        record = {"format": self.format, key: storage, "quantized": self.quantized}
        if stem is not None:
            record["block"] = block
        if self.quantized:
            stored = "fp16" if weights_mode == "fp16" else f"fp16, then compressed {weights_mode}"
            record["sidecar_weights"] = f"the dequantized {block} projections ({stored})"
        return record

    def describe(self) -> str:
        """A few lines saying what this checkpoint is, for humans and notebooks."""
        g = self.geometry
        files = self.tensors.files()
        traits = {
            "llama": "plain attention",
            "qwen3": "per-head q/k RMSNorm",
            "qwen3_next": "gated attention, zero-centred q/k RMSNorm (1 + w), partial RoPE",
        }[g.variant]
        bias = ", ".join(n for n, on in (("q/k/v bias", g.has_qkv_bias), ("o bias", g.has_o_bias)) if on) or "no biases"
        return "\n".join(
            [
                f"checkpoint {self.path}",
                f"  model_type {self.model_type} -> variant {g.variant} ({traits}; {bias})",
                f"  hidden {g.hidden_size}, heads {g.num_heads} query / {g.num_kv_heads} KV, head_dim {g.head_dim}, "
                f"rotary_dim {g.rotary_dim} (factor {g.partial_rotary_factor:g}), rope_theta {g.rope_theta:g}, "
                f"eps {g.rms_norm_eps:g}",
                f"  {g.num_layers} layers, full attention at "
                f"{', '.join(str(i) for i in g.full_attention_layers if i not in g.sliding_layers) or 'none'}"
                + (
                    f"; sliding window {g.sliding_window} at {', '.join(map(str, g.sliding_layers))}"
                    if g.sliding_layers
                    else ""
                ),
                f"  options: {block_options(g)}",
                f"  tensors {self.prefix}layers.{{L}}.self_attn.*, {self.tensor_dtype()}, "
                f"{len(files)} file{'s' if len(files) != 1 else ''} ({self.format})",
            ]
        )


def block_options(g: AttentionGeometry) -> str:
    """The geometry's non-default block options in one line (RoPE type, scale, softcap, norms, ...)."""
    parts = [f"RoPE {g.rope_scaling.rope_type if g.rope_scaling else 'default'} ({g.rope_layout})"]
    if g.query_scale is not None:
        parts.append(f"scale {g.query_scale:g}")
    if g.logit_softcap is not None:
        parts.append(f"logit softcap {g.logit_softcap:g}")
    if g.qk_norm_kind != "none":
        parts.append(f"q/k norm {g.qk_norm_kind}")
    if g.no_rope_layers:
        parts.append(f"no RoPE at {', '.join(map(str, g.no_rope_layers))}")
    if g.local_rope_theta is not None:
        parts.append(f"sliding layers' RoPE base {g.local_rope_theta:g}")
    if g.input_rows != "post_input_norm":
        parts.append("input rows: raw residual stream")
    if g.after_o_proj:
        parts.append(f"after attn_out: {g.after_o_proj}")
    return "; ".join(parts)


def _layers_prefix(names) -> str:
    """The prefix before ``layers.{L}.self_attn.q_proj.weight`` of the model's decoder stack."""
    prefixes = sorted({m["prefix"] for m in map(_LAYER_KEY.match, names) if m})
    main = [p for p in prefixes if not p.startswith("mtp")]
    if len(main) == 1:
        return main[0]
    for p in _PREFERRED_PREFIXES:
        if p in main:
            return p
    if not main:
        raise AnelabInputError(
            "the checkpoint has no tensor named '…layers.{L}.self_attn.q_proj.weight'; "
            "is this a Hugging Face transformer checkpoint?"
        )
    raise AnelabInputError(
        f"several decoder stacks carry attention ({', '.join(main)}); cannot tell which is the model"
    )


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint in any format of ``anelab.checkpoints.formats.FORMATS``: a Hugging Face directory
    (config.json + *.safetensors), a GGUF file or an MLX-quantized directory. The edge opens it once (a command,
    a study's back-end, a notebook) and passes the ``Checkpoint`` on: the functions that read it take it opened.

    Reads the config and the tensor headers (or the shard index) only; ``layer(i)`` reads that layer's tensors.
    """
    source = open_source(path)
    model_type, family = detect_family(source.config)
    geometry = geometry_from_config(source.config)
    return Checkpoint(
        path=Path(path),
        config=source.config,
        geometry=geometry,
        model_type=model_type,
        family=family,
        prefix=_layers_prefix(source.tensors.names()),
        tensors=source.tensors,
        format=source.format,
        quantized=source.quantized,
        _tokenizer=source.tokenizer,
    )


def _layer_tensors(
    geometry: AttentionGeometry, w: AttentionWeights, prefix: str, zero_centred: bool
) -> dict[str, np.ndarray]:
    g = geometry
    expected = {
        "q_proj": (g.q_out_features, g.hidden_size),
        "k_proj": (g.kv_out_features, g.hidden_size),
        "v_proj": (g.kv_out_features, g.hidden_size),
        "o_proj": (g.hidden_size, g.attn_features),
        "q_bias": (g.q_out_features,) if g.has_qkv_bias else None,
        "k_bias": (g.kv_out_features,) if g.has_qkv_bias else None,
        "v_bias": (g.kv_out_features,) if g.has_qkv_bias else None,
        "o_bias": (g.hidden_size,) if g.has_o_bias else None,
        "q_norm": (g.head_dim,) if g.has_qk_norm else None,
        "k_norm": (g.head_dim,) if g.has_qk_norm else None,
    }
    names = {
        "q_proj": "q_proj.weight",
        "k_proj": "k_proj.weight",
        "v_proj": "v_proj.weight",
        "o_proj": "o_proj.weight",
        "q_bias": "q_proj.bias",
        "k_bias": "k_proj.bias",
        "v_bias": "v_proj.bias",
        "o_bias": "o_proj.bias",
        "q_norm": "q_norm.weight",
        "k_norm": "k_norm.weight",
    }
    tensors = {}
    for attr, shape in expected.items():
        value = getattr(w, attr)
        if shape is None:
            if value is not None:
                raise AnelabInputError(
                    f"layer {w.layer}: {attr} is set but the geometry has none; drop it or change the geometry"
                )
            continue
        if value is None:
            raise AnelabInputError(f"layer {w.layer}: {attr} is missing; the geometry needs shape {list(shape)}")
        value = np.asarray(value, dtype=np.float32)
        if value.shape != shape:
            raise AnelabInputError(f"layer {w.layer}: {attr} has shape {list(value.shape)}, expected {list(shape)}")
        if attr in ("q_norm", "k_norm") and zero_centred:
            value = value - np.float32(1.0)  # stored zero-centred: the model multiplies by 1 + w
        tensors[f"{prefix}layers.{w.layer}.self_attn.{names[attr]}"] = value
    return tensors


def _writable_family(model_type: str, geometry: AttentionGeometry):
    """The family table's entry for ``model_type``, refused (one line) when anelab cannot write its layout
    or it is not the geometry's variant."""
    if model_type not in MODEL_FAMILIES:
        raise AnelabInputError(f"unknown model_type {model_type!r}; supported: {', '.join(MODEL_FAMILIES)}")
    if model_type not in WRITABLE_MODEL_TYPES:
        raise AnelabInputError(
            f"write_checkpoint writes {', '.join(WRITABLE_MODEL_TYPES)} layouts, not {model_type!r}; "
            "write its config.json and tensors directly"
        )
    family = MODEL_FAMILIES[model_type]
    if family.variant != geometry.variant:
        raise AnelabInputError(
            f"model_type {model_type} is the {family.variant} variant but the geometry is {geometry.variant}"
        )
    return family


def _write_tensor_files(directory: Path, tensors: dict[str, np.ndarray], dtype: str, shards: int) -> None:
    """``model.safetensors``, or ``shards`` files ``model-0000i-of-0000n.safetensors`` and their index."""
    names = sorted(tensors)
    if shards == 1:
        write_safetensors(directory / "model.safetensors", tensors, dtype)
        return
    weight_map, total = {}, 0
    for i, group in enumerate(np.array_split(np.arange(len(names)), shards), start=1):
        file = f"model-{i:05d}-of-{shards:05d}.safetensors"
        total += write_safetensors(directory / file, {names[j]: tensors[names[j]] for j in group}, dtype)
        weight_map.update({names[j]: file for j in group})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_checkpoint(
    directory: str | os.PathLike,
    geometry: AttentionGeometry,
    weights: dict[int, AttentionWeights],
    *,
    dtype: str = "F32",
    shards: int = 1,
    model_type: str | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    extra_config: dict | None = None,
) -> Path:
    """Write a Hugging Face-style checkpoint holding the full-attention layers' weights.

    ``weights`` maps every full-attention layer index to its AttentionWeights (effective norms;
    zero-centred families store ``w - 1``). Only attention tensors are written (no embeddings,
    MLPs or linear-attention layers). ``shards > 1`` splits the tensors over
    ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``. The directory is
    built under a temporary name and renamed into place; an existing directory is refused.

    ``extra_tensors`` (full tensor name -> array) are written beside the attention tensors (the
    whole-model writer ``anelab.checkpoints.whole_model.write_model_checkpoint`` passes embeddings, norms, MLPs and
    the LM head this way); ``extra_config`` keys are added to config.json's text part.
    """
    directory = Path(directory)
    if dtype not in STORAGE_DTYPES:
        raise AnelabInputError(f"dtype {dtype!r} is not supported; use one of {', '.join(STORAGE_DTYPES)}")
    model_type = model_type or DEFAULT_MODEL_TYPES[geometry.variant]
    family = _writable_family(model_type, geometry)
    if directory.exists():
        raise AnelabInputError(
            f"{directory} already exists; checkpoints are never overwritten — choose a new directory"
        )
    layers = sorted(weights)
    if layers != sorted(geometry.full_attention_layers):
        raise AnelabInputError(
            f"weights are given for layers {layers} but the full-attention layers are "
            f"{list(geometry.full_attention_layers)}; give exactly one AttentionWeights per full-attention layer"
        )
    prefix = "model.language_model." if family.nested_text_config else "model."
    tensors: dict[str, np.ndarray] = {}
    for layer in layers:
        if weights[layer].layer != layer:
            raise AnelabInputError(f"weights[{layer}] holds layer {weights[layer].layer}; key it by its own layer")
        tensors.update(_layer_tensors(geometry, weights[layer], prefix, family.zero_centred_norm))
    clash = sorted(set(tensors) & set(extra_tensors or {}))
    if clash:
        raise AnelabInputError(f"extra tensor {clash[0]} is an attention tensor; pass attention weights in weights")
    tensors.update(extra_tensors or {})
    config = config_for_geometry(geometry, model_type, family, dtype)
    if extra_config:
        (config["text_config"] if family.nested_text_config else config).update(extra_config)
    return write_checkpoint_directory(directory, config, tensors, dtype=dtype, shards=shards)


def write_checkpoint_directory(
    directory: str | os.PathLike,
    config: dict,
    tensors: dict[str, np.ndarray | LazyTensor],
    *,
    dtype: str = "F32",
    shards: int = 1,
) -> Path:
    """Write config.json and ``tensors`` (full name -> array, or a ``LazyTensor`` made when written: a model
    larger than memory is written one tensor at a time) as a checkpoint directory, atomically.

    ``shards > 1``: ``model-0000i-of-0000n.safetensors`` (tensors in name order) with the shard index.
    An existing directory is refused.
    """
    directory = Path(directory)
    if dtype not in STORAGE_DTYPES:
        raise AnelabInputError(f"dtype {dtype!r} is not supported; use one of {', '.join(STORAGE_DTYPES)}")
    if directory.exists():
        raise AnelabInputError(
            f"{directory} already exists; checkpoints are never overwritten — choose a new directory"
        )
    if not isinstance(shards, int) or not 1 <= shards <= len(tensors):
        raise AnelabInputError(f"shards must be between 1 and the tensor count {len(tensors)}, got {shards}")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.tmp-"))
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _write_tensor_files(tmp, tensors, dtype, shards)
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory
