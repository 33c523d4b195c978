"""Checkpoint loading: a Hugging Face-style model directory (config.json + safetensors) -> one
full-attention layer's geometry and weights.

The path through the study starts here: ``load_checkpoint(path)`` reads ``config.json`` (or its
nested ``text_config``), decides the attention variant and which layers are full attention, and
hands out one layer's projections with ``Checkpoint.layer(index)``. Tensors are read lazily from
the safetensors files (F32, F16 or BF16), possibly sharded behind
``model.safetensors.index.json``; only the requested layer's bytes are read.

The writer (``write_checkpoint``) produces the same layout, so tests and notebooks can work on a
small synthetic model: ``make_default_checkpoint`` builds a deterministic qwen3_next-style hybrid
(BF16, 8 layers, full attention at layers 3 and 7).

Every convention used here is checked against the transformers modeling code and written up in
``docs/conventions.md``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from anelab.errors import AnelabInputError
from anelab.geometry import AttentionGeometry

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_CHECKPOINT = "anelab-tiny-hybrid"

# safetensors dtype names this loader reads, and their little-endian numpy storage types.
STORAGE_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
TORCH_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit on the JSON header

# transformers' legacy layer-type names (configuration_utils._LEGACY_LAYER_TYPE_REMAP).
_LEGACY_LAYER_TYPES = {"attention": "full_attention", "mamba": "linear_attention"}
# RoPE types whose inverse frequencies equal the plain formula (mrope with text-only positions).
_PLAIN_ROPE_TYPES = (None, "default", "mrope")


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


# ---- model families ----------------------------------------------------------------------------

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
    "qwen3_5_moe": ModelFamily(architecture="Qwen3_5MoeForConditionalGeneration", nested_text_config=True, **_QWEN3_NEXT),
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
    types = [_LEGACY_LAYER_TYPES.get(t, t) for t in (text.get("layer_types") or [])]
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
        types = [_LEGACY_LAYER_TYPES.get(t, t) for t in layer_types]
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
        raise AnelabInputError(f"config.json hidden_size and num_attention_heads must be positive, got {hidden}, {heads}")
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


# ---- safetensors files -------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place in a safetensors file (offsets relative to the data after the header)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class SafetensorsFile:
    """A safetensors file's header, parsed once; tensor bytes are read on demand.

    Format: 8-byte little-endian header length N, N bytes of JSON
    ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then data.
    """

    path: Path
    data_start: int
    entries: dict[str, TensorEntry]

    @classmethod
    def open(cls, path: Path) -> "SafetensorsFile":
        path = Path(path)
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise AnelabInputError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
                n = int.from_bytes(head, "little")
                if n > MAX_HEADER_BYTES or 8 + n > size:
                    raise AnelabInputError(f"{path} is not a safetensors file (header length {n} does not fit the file)")
                header = json.loads(f.read(n).decode("utf-8"))
        except FileNotFoundError:
            raise AnelabInputError(f"safetensors file {path} is missing; restore it or fix {INDEX_FILE}") from None
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise AnelabInputError(f"{path} is not a safetensors file (its header is not JSON)") from None
        if not isinstance(header, dict):
            raise AnelabInputError(f"{path} is not a safetensors file (its header is not a JSON object)")
        entries = {}
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            try:
                begin, end = (int(x) for x in spec["data_offsets"])
                entry = TensorEntry(name, str(spec["dtype"]), tuple(int(x) for x in spec["shape"]), begin, end)
            except (KeyError, TypeError, ValueError):
                raise AnelabInputError(f"{path}: malformed header entry for tensor {name}") from None
            if not 0 <= begin <= end <= size - 8 - n:
                raise AnelabInputError(f"{path}: tensor {name} lies outside the file (truncated download?)")
            entries[name] = entry
        return cls(path, 8 + n, entries)

    def read(self, name: str) -> np.ndarray:
        """The tensor ``name`` in its storage dtype (F32 / F16 / BF16), shaped as stored."""
        entry = self.entries[name]
        storage = STORAGE_DTYPES.get(entry.dtype)
        if storage is None:
            raise AnelabInputError(
                f"tensor {name} in {self.path.name} has dtype {entry.dtype}; supported: "
                f"{', '.join(STORAGE_DTYPES)} (dequantize the checkpoint first)"
            )
        count = int(np.prod(entry.shape, dtype=np.int64))
        if entry.end - entry.begin != count * storage.itemsize:
            raise AnelabInputError(
                f"tensor {name} in {self.path.name}: {entry.end - entry.begin} bytes do not hold "
                f"{entry.dtype} {list(entry.shape)}; the file is corrupt"
            )
        with open(self.path, "rb") as f:
            f.seek(self.data_start + entry.begin)
            raw = f.read(entry.end - entry.begin)
        return np.frombuffer(raw, dtype=storage).reshape(entry.shape)


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> int:
    """Write ``tensors`` (cast to ``dtype``) as one safetensors file; return the data bytes.

    Byte-deterministic: tensors in name order, compact sorted JSON, header padded with spaces to
    a multiple of 8 (as the safetensors library does).
    """
    storage = STORAGE_DTYPES[dtype]
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        blob = np.ascontiguousarray(np.asarray(tensors[name], dtype=np.float32).astype(storage)).tobytes()
        header[name] = {"dtype": dtype, "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    return offset


# ---- the checkpoint ----------------------------------------------------------------------------

_LAYER_KEY = re.compile(r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.self_attn\.q_proj\.weight$")
# Prefixes tried in this order when several decoder stacks carry attention (e.g. Qwen3-Next's
# multi-token-prediction head ``mtp.layers.0…`` next to ``model.layers.…``).
_PREFERRED_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "")


@dataclass
class Checkpoint:
    """A Hugging Face-style model directory, opened for its full-attention layers.

    ``config`` is config.json as read; ``text`` is its language-model part; ``geometry`` the
    attention block's shapes; ``prefix`` the tensor-name prefix before ``layers.{L}.self_attn.``.
    """

    path: Path
    config: dict
    geometry: AttentionGeometry
    model_type: str
    family: ModelFamily
    prefix: str
    weight_map: dict[str, Path]
    _files: dict[Path, SafetensorsFile] = field(default_factory=dict, repr=False)

    @property
    def text(self) -> dict:
        return text_config(self.config)

    def tensor_name(self, layer: int, param: str) -> str:
        """Full tensor name, e.g. ``model.layers.3.self_attn.q_norm.weight`` for ("q_norm.weight")."""
        return f"{self.prefix}layers.{layer}.self_attn.{param}"

    def _entry(self, name: str) -> tuple[SafetensorsFile, TensorEntry] | None:
        path = self.weight_map.get(name)
        if path is None:
            return None
        if path not in self._files:
            self._files[path] = SafetensorsFile.open(path)
        entry = self._files[path].entries.get(name)
        if entry is None:
            raise AnelabInputError(f"{INDEX_FILE} maps tensor {name} to {path.name}, which does not contain it")
        return self._files[path], entry

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
            kind = f"a {_LEGACY_LAYER_TYPES.get(kinds[index], kinds[index])} layer" if kinds else "not a full-attention layer"
            raise AnelabInputError(f"layer {index} is {kind}, not full attention; full-attention layers: {full}")

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of each parameter (name after ``self_attn.``) this geometry needs."""
        g = self.geometry
        shapes = {
            "q_proj.weight": (g.q_out_features, g.hidden_size),
            "k_proj.weight": (g.kv_out_features, g.hidden_size),
            "v_proj.weight": (g.kv_out_features, g.hidden_size),
            "o_proj.weight": (g.hidden_size, g.attn_features),
        }
        if g.has_qkv_bias:
            shapes.update({"q_proj.bias": (g.q_out_features,), "k_proj.bias": (g.kv_out_features,),
                           "v_proj.bias": (g.kv_out_features,)})
        if g.has_o_bias:
            shapes["o_proj.bias"] = (g.hidden_size,)
        if g.has_qk_norm:
            shapes.update({"q_norm.weight": (g.head_dim,), "k_norm.weight": (g.head_dim,)})
        return shapes

    def layer(self, index: int) -> AttentionWeights:
        """One full-attention layer's weights (float32; q/k norms as the effective multiplier).

        Refuses a layer that is out of range or not full attention, a missing tensor, a bias the
        config does not declare, a shape that disagrees with config.json, or an unsupported dtype.
        """
        self._check_layer(index)
        index = int(index)
        expected = self.expected_shapes()
        for param in ("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias"):
            name = self.tensor_name(index, param)
            if param not in expected and name in self.weight_map:
                raise AnelabInputError(
                    f"tensor {name} exists but config.json declares no such bias (attention_bias); "
                    "fix config.json so the bias is not dropped"
                )
        values: dict[str, np.ndarray] = {}
        for param, shape in expected.items():
            name = self.tensor_name(index, param)
            found = self._entry(name)
            if found is None:
                raise AnelabInputError(f"tensor {name} is missing from the checkpoint at {self.path}")
            file, entry = found
            if entry.shape != shape:
                raise AnelabInputError(
                    f"tensor {name} has shape {list(entry.shape)}, expected {list(shape)} from config.json"
                )
            values[param] = file.read(name).astype(np.float32)
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

    def tensor_dtype(self, layer: int | None = None) -> str:
        """Storage dtype of a full-attention layer's q_proj (the first such layer by default)."""
        layer = self.geometry.full_attention_layers[0] if layer is None else layer
        found = self._entry(self.tensor_name(layer, "q_proj.weight"))
        return found[1].dtype if found else "missing"

    def describe(self) -> str:
        """A few lines saying what this checkpoint is, for humans and notebooks."""
        g = self.geometry
        files = sorted({p.name for p in self.weight_map.values()})
        traits = {
            "llama": "plain attention, no q/k norm",
            "qwen3": "per-head q/k RMSNorm",
            "qwen3_next": "gated attention, zero-centred q/k RMSNorm (1 + w), partial RoPE",
        }[g.variant]
        bias = ", ".join(n for n, on in (("q/k/v bias", g.has_qkv_bias), ("o bias", g.has_o_bias)) if on) or "no biases"
        return "\n".join([
            f"checkpoint {self.path}",
            f"  model_type {self.model_type} -> variant {g.variant} ({traits}; {bias})",
            f"  hidden {g.hidden_size}, heads {g.num_heads} query / {g.num_kv_heads} KV, head_dim {g.head_dim}, "
            f"rotary_dim {g.rotary_dim} (factor {g.partial_rotary_factor:g}), rope_theta {g.rope_theta:g}, "
            f"eps {g.rms_norm_eps:g}",
            f"  {g.num_layers} layers, full attention at {', '.join(str(i) for i in g.full_attention_layers)}",
            f"  tensors {self.prefix}layers.{{L}}.self_attn.*, {self.tensor_dtype()}, "
            f"{len(files)} file{'s' if len(files) != 1 else ''}",
        ])


def _weight_map(directory: Path) -> dict[str, Path]:
    """Tensor name -> file: from the shard index when present, else from every file's header."""
    index = directory / INDEX_FILE
    if index.exists():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise AnelabInputError(f"{index} has no readable 'weight_map'; regenerate the shard index") from None
        return {name: directory / file for name, file in mapping.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise AnelabInputError(f"no *.safetensors files in {directory}; download the model weights into it")
    mapping: dict[str, Path] = {}
    for path in files:
        for name in SafetensorsFile.open(path).entries:
            mapping[name] = path
    return mapping


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
    raise AnelabInputError(f"several decoder stacks carry attention ({', '.join(main)}); cannot tell which is the model")


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a Hugging Face-style checkpoint directory (config.json + *.safetensors).

    Reads config.json and the safetensors headers (or the shard index) only; ``layer(i)`` reads
    that layer's tensors.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise AnelabInputError(f"checkpoint directory {directory} does not exist; pass a model directory with config.json")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise AnelabInputError(f"{directory} has no config.json; pass a Hugging Face model directory")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise AnelabInputError(f"{config_path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(config, dict):
        raise AnelabInputError(f"{config_path} must hold a JSON object")
    model_type, family = detect_family(config)
    geometry = geometry_from_config(config)
    weight_map = _weight_map(directory)
    return Checkpoint(
        path=directory,
        config=config,
        geometry=geometry,
        model_type=model_type,
        family=family,
        prefix=_layers_prefix(weight_map),
        weight_map=weight_map,
    )


# ---- writing -----------------------------------------------------------------------------------

def _interval_of(layers: tuple[int, ...], num_layers: int) -> int | None:
    """N with full attention exactly where (i + 1) % N == 0, if the layers follow that rule."""
    for n in range(1, num_layers + 1):
        if tuple(i for i in range(num_layers) if (i + 1) % n == 0) == tuple(layers):
            return n
    return None


def _config_for(geometry: AttentionGeometry, model_type: str, family: ModelFamily, dtype: str) -> dict:
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
        return {"architectures": [family.architecture], "model_type": model_type, "text_config": text,
                "torch_dtype": TORCH_DTYPE_NAMES[dtype]}
    text.update({k: v for k, v in rope.items() if k != "rope_type"})
    return {"architectures": [family.architecture], **text}


def _layer_tensors(geometry: AttentionGeometry, w: AttentionWeights, prefix: str, zero_centred: bool) -> dict[str, np.ndarray]:
    g = geometry
    expected = {
        "q_proj": (g.q_out_features, g.hidden_size), "k_proj": (g.kv_out_features, g.hidden_size),
        "v_proj": (g.kv_out_features, g.hidden_size), "o_proj": (g.hidden_size, g.attn_features),
        "q_bias": (g.q_out_features,) if g.has_qkv_bias else None,
        "k_bias": (g.kv_out_features,) if g.has_qkv_bias else None,
        "v_bias": (g.kv_out_features,) if g.has_qkv_bias else None,
        "o_bias": (g.hidden_size,) if g.has_o_bias else None,
        "q_norm": (g.head_dim,) if g.has_qk_norm else None,
        "k_norm": (g.head_dim,) if g.has_qk_norm else None,
    }
    names = {
        "q_proj": "q_proj.weight", "k_proj": "k_proj.weight", "v_proj": "v_proj.weight", "o_proj": "o_proj.weight",
        "q_bias": "q_proj.bias", "k_bias": "k_proj.bias", "v_bias": "v_proj.bias", "o_bias": "o_proj.bias",
        "q_norm": "q_norm.weight", "k_norm": "k_norm.weight",
    }
    tensors = {}
    for attr, shape in expected.items():
        value = getattr(w, attr)
        if shape is None:
            if value is not None:
                raise AnelabInputError(f"layer {w.layer}: {attr} is set but the geometry has none; drop it or change the geometry")
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


def write_checkpoint(directory: str | os.PathLike, geometry: AttentionGeometry, weights: dict[int, AttentionWeights],
                     *, dtype: str = "F32", shards: int = 1, model_type: str | None = None) -> Path:
    """Write a Hugging Face-style checkpoint holding the full-attention layers' weights.

    ``weights`` maps every full-attention layer index to its AttentionWeights (effective norms;
    zero-centred families store ``w - 1``). Only attention tensors are written (no embeddings,
    MLPs or linear-attention layers). ``shards > 1`` splits the tensors over
    ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``. The directory is
    built under a temporary name and renamed into place; an existing directory is refused.
    """
    directory = Path(directory)
    if dtype not in STORAGE_DTYPES:
        raise AnelabInputError(f"dtype {dtype!r} is not supported; use one of {', '.join(STORAGE_DTYPES)}")
    model_type = model_type or DEFAULT_MODEL_TYPES[geometry.variant]
    if model_type not in MODEL_FAMILIES:
        raise AnelabInputError(f"unknown model_type {model_type!r}; supported: {', '.join(MODEL_FAMILIES)}")
    family = MODEL_FAMILIES[model_type]
    if family.variant != geometry.variant:
        raise AnelabInputError(
            f"model_type {model_type} is the {family.variant} variant but the geometry is {geometry.variant}"
        )
    if directory.exists():
        raise AnelabInputError(f"{directory} already exists; checkpoints are never overwritten — choose a new directory")
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
    if not isinstance(shards, int) or not 1 <= shards <= len(tensors):
        raise AnelabInputError(f"shards must be between 1 and the tensor count {len(tensors)}, got {shards}")
    config = _config_for(geometry, model_type, family, dtype)

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.tmp-"))
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        names = sorted(tensors)
        if shards == 1:
            _write_safetensors(tmp / "model.safetensors", tensors, dtype)
        else:
            weight_map, total = {}, 0
            for i, group in enumerate(np.array_split(np.arange(len(names)), shards), start=1):
                file = f"model-{i:05d}-of-{shards:05d}.safetensors"
                total += _write_safetensors(tmp / file, {names[j]: tensors[names[j]] for j in group}, dtype)
                weight_map.update({names[j]: file for j in group})
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


# ---- synthetic weights and the embedded default checkpoint ------------------------------------

def random_attention_weights(geometry: AttentionGeometry, layer: int, seed: int) -> AttentionWeights:
    """Deterministic random weights for one layer (stream keyed by (seed, layer)).

    Projections ~ N(0, 1/fan_in), so a unit-variance input gives unit-variance outputs; biases
    ~ N(0, 0.1^2); q/k norm multipliers ~ 1 + N(0, 0.1^2).
    """
    g = geometry
    rng = np.random.default_rng([int(seed), int(layer)])

    def normal(shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = AttentionWeights(
        layer=layer,
        q_proj=normal((g.q_out_features, g.hidden_size), g.hidden_size ** -0.5),
        k_proj=normal((g.kv_out_features, g.hidden_size), g.hidden_size ** -0.5),
        v_proj=normal((g.kv_out_features, g.hidden_size), g.hidden_size ** -0.5),
        o_proj=normal((g.hidden_size, g.attn_features), g.attn_features ** -0.5),
    )
    if g.has_qk_norm:
        w.q_norm = np.float32(1.0) + normal((g.head_dim,), 0.1)
        w.k_norm = np.float32(1.0) + normal((g.head_dim,), 0.1)
    if g.has_qkv_bias:
        w.q_bias = normal((g.q_out_features,), 0.1)
        w.k_bias = normal((g.kv_out_features,), 0.1)
        w.v_bias = normal((g.kv_out_features,), 0.1)
    if g.has_o_bias:
        w.o_bias = normal((g.hidden_size,), 0.1)
    return w


def default_geometry() -> AttentionGeometry:
    """The embedded default model: a small qwen3_next-style hybrid (full attention at 3 and 7)."""
    return AttentionGeometry(
        variant="qwen3_next", hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
        rope_theta=10_000_000.0, partial_rotary_factor=0.25, rms_norm_eps=1e-6,
        num_layers=8, full_attention_layers=(3, 7),
    )


def make_default_checkpoint(directory: str | os.PathLike, seed: int = 0) -> Path:
    """Write the default checkpoint (BF16, full_attention_interval 4); same bytes for a seed."""
    g = default_geometry()
    weights = {layer: random_attention_weights(g, layer, seed) for layer in g.full_attention_layers}
    return write_checkpoint(directory, g, weights, dtype="BF16", shards=1, model_type="qwen3_next")


def default_checkpoint_dir(root: str | os.PathLike = "build/checkpoints") -> Path:
    """``root/anelab-tiny-hybrid``, generated on first use (a relative root is relative to the cwd)."""
    directory = Path(root) / DEFAULT_CHECKPOINT
    if (directory / CONFIG_FILE).is_file():
        return directory
    try:
        return make_default_checkpoint(directory)
    except (AnelabInputError, OSError):
        if (directory / CONFIG_FILE).is_file():  # another process generated it meanwhile
            return directory
        raise
