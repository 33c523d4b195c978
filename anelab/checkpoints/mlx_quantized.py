"""An MLX-quantized directory (``mlx_lm.convert -q``) as a checkpoint: packed affine weights dequantized as mx.dequantize does.

mlx-lm replaces each quantized ``Linear`` / ``Embedding`` weight ``X.weight`` [N, K] by three tensors
(``mlx.core.quantize``, mode ``affine``): ``X.weight`` uint32 [N, K * bits / 32] — the K codes of a row packed
as one little-endian bit stream, ``bits`` per code — and ``X.scales``, ``X.biases`` [N, K / group_size] in the
model's dtype, so that ``w = scales * q + biases`` per group. config.json records the default
``quantization: {group_size, bits, mode}`` and per-module overrides keyed by the module's path (a dict, or
``false``: not quantized). This module serves ``X.weight`` as the dequantized float32 [N, K], computed in the
scales' dtype and rounded after the product and after the sum, exactly as ``mx.dequantize`` does on the CPU
(tests/checkpoints/test_mlx_quantized.py compares them bit for bit); every other tensor is read as safetensors.

Refused in one line (``REFUSED``): modes other than ``affine`` (mxfp4, nvfp4, mxfp8), global scales, model
types whose mlx-lm layout is not checked against transformers' here, and stored shapes that do not match the
recorded bits and group size.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from anelab.checkpoints.config import text_config
from anelab.checkpoints.hf_directory import SafetensorsSource, directory_tokenizer, read_config, weight_map
from anelab.checkpoints.source import CheckpointSource, RowTensor, content_digest
from anelab.core.errors import AnelabInputError

# model types whose mlx-lm layout is transformers' own (mlx_lm/models/{llama,qwen2,qwen3}.py ``sanitize`` only drops
# rotary_emb.inv_freq and a tied lm_head; mlx-lm runs mistral as llama)
MLX_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MLX_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs in affine mode

REFUSED = (
    "quantization modes other than affine (mxfp4, nvfp4, mxfp8) and global scales",
    f"model types other than {', '.join(MLX_MODEL_TYPES)} (mlx-lm's layout for them is not checked against transformers')",
    "stored shapes that disagree with the recorded bits and group size",
)


@dataclass(frozen=True)
class Quantization:
    """One module's affine quantization: ``bits`` per code, ``group_size`` codes per scale and bias."""

    bits: int
    group_size: int


def quantization_config(config: dict) -> dict | None:
    """config.json's mlx-lm ``quantization`` dict (the model's, or its text part's), or None."""
    for part in (config, text_config(config)):
        quant = part.get("quantization")
        if isinstance(quant, dict) and "bits" in quant and "group_size" in quant:
            return quant
    return None


def is_mlx_quantized(path: Path) -> bool:
    """A model directory whose config.json carries mlx-lm's ``quantization`` (bits and group_size)."""
    if not (path.is_dir() and (path / "config.json").is_file()):
        return False
    try:
        return quantization_config(read_config(path)) is not None
    except AnelabInputError:
        return False


def _parameters(entry, where: str) -> Quantization:
    if not isinstance(entry, dict):
        raise AnelabInputError(f"{where}: quantization entry {entry!r} is not a dict; re-convert with mlx_lm.convert")
    mode = entry.get("mode", "affine")
    if mode != "affine" or entry.get("global_scale"):
        raise AnelabInputError(f"{where}: MLX quantization mode {mode!r} (global scale {bool(entry.get('global_scale'))})"
                               " is not modelled; anelab reads affine mode")  # fmt: skip
    bits, group = entry.get("bits"), entry.get("group_size")
    if bits not in MLX_BITS or not isinstance(group, int) or group <= 0:
        raise AnelabInputError(f"{where}: MLX bits {bits!r} / group_size {group!r} are not mx.quantize's affine ones")
    return Quantization(int(bits), int(group))


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint32 [..., K * bits / 32] -> the K codes of each row, uint8/uint16 [..., K] (little-endian bit stream)."""
    if 32 % bits == 0:  # whole codes per word: shift them out, lowest first
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        codes = (packed[..., None] >> shifts) & np.uint32((1 << bits) - 1)
        return codes.reshape(*packed.shape[:-1], -1).astype(np.uint8)
    stream = np.unpackbits(np.ascontiguousarray(packed).view(np.uint8), axis=-1, bitorder="little")
    stream = stream.reshape(*packed.shape[:-1], -1, bits).astype(np.uint16)
    return (stream << np.arange(bits, dtype=np.uint16)).sum(-1, dtype=np.uint16)


def dequantize(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, q: Quantization) -> np.ndarray:
    """uint32 [N, K * bits / 32] with scales, biases [N, K / group] (their stored dtype) -> float32 [N, K].

    ``scales * codes + biases`` per group in the scales' dtype, rounded to it after the product and again after
    the sum — what ``mx.dequantize`` computes (two roundings, not one fused multiply-add).
    """
    codes = unpack_codes(packed, q.bits)
    n, k = codes.shape[:-1], codes.shape[-1]
    if scales.shape != (*n, k // q.group_size) or biases.shape != scales.shape or k % q.group_size:
        raise AnelabInputError(
            f"MLX weight of {k} codes per row has scales {list(scales.shape)}, biases {list(biases.shape)}: "
            f"not {q.bits}-bit groups of {q.group_size}"
        )
    stored = scales.dtype
    grouped = codes.reshape(*n, k // q.group_size, q.group_size).astype(np.float32)
    product = (grouped * scales.astype(np.float32)[..., None]).astype(stored).astype(np.float32)
    values = (product + biases.astype(np.float32)[..., None]).astype(stored)
    return values.astype(np.float32).reshape(*n, k)


@dataclass
class MlxSource:
    """The tensors of an MLX-quantized directory under transformers' names: a quantized ``X.weight`` is served
    dequantized (its ``X.scales`` / ``X.biases`` folded in, and hidden from ``names``); the rest as safetensors."""

    path: Path
    plain: SafetensorsSource
    default: dict
    overrides: dict
    _maps: dict = field(default_factory=dict, repr=False)

    def _quantization(self, name: str) -> Quantization | None:
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or self.plain.entry(f"{module}.scales") is None:
            return None
        entry = self.overrides.get(module, self.default)
        if entry is False:
            raise AnelabInputError(
                f"{self.path}: {module}.scales exists but config.json says {module} is not quantized"
            )
        return _parameters(entry, f"{self.path}/config.json")

    def names(self):
        hidden = {n for n in self.plain.names() if n.endswith((".scales", ".biases"))}
        return [n for n in self.plain.names() if n not in hidden]

    def shape(self, name: str) -> tuple[int, ...] | None:
        found = self.plain.shape(name)
        q = None if found is None else self._quantization(name)
        return found if q is None else (*found[:-1], found[-1] * 32 // q.bits)

    def storage(self, name: str) -> str:
        q = self._quantization(name)
        if q is None:
            return self.plain.storage(name)
        return f"MLX affine {q.bits}-bit g{q.group_size} ({self.plain.storage(name.removesuffix('weight') + 'scales')} scales)"

    def _packed(self, name: str, rows=slice(None)) -> np.ndarray:
        """The stored uint32 codes of ``name`` (the rows asked for), copied out of a memory map released after."""
        file, entry = self.plain.entry(name)
        if entry.dtype != "U32":
            raise AnelabInputError(f"{self.path}: quantized {name} is stored {entry.dtype}, not U32; re-convert it")
        count = (entry.end - entry.begin) // 4
        with open(file.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            flat = np.frombuffer(mapped, np.uint32, count=count, offset=file.data_start + entry.begin)
            out = np.array(flat.reshape(entry.shape)[rows])
            del flat  # the map closes only when no array views it
        return out

    def _parts(self, name: str, rows=slice(None)) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        stem = name.removesuffix("weight")
        side = []
        for part in ("scales", "biases"):
            file, _ = self.plain.entry(stem + part)
            side.append(np.array(file.view(stem + part)[rows]))
            file.release(stem + part)
        return self._packed(name, rows), side[0], side[1]

    def read_float32(self, name: str) -> np.ndarray:
        q = self._quantization(name)
        return self.plain.read_float32(name) if q is None else dequantize(*self._parts(name), q)

    def mapped(self, name: str):
        q = self._quantization(name)
        if q is None:
            return self.plain.mapped(name)
        return RowTensor(self.shape(name), lambda rows: dequantize(*self._parts(name, rows), q))

    def digest(self, name: str) -> str:
        """A quantized weight's digest covers its codes, scales and biases (and the recorded bits / group)."""
        if self._quantization(name) is None:
            return self.plain.digest(name)
        return content_digest(name, self.storage(name), self.shape(name), self._parts(name))

    def files(self) -> list[str]:
        return self.plain.files()


def open_mlx(directory: Path) -> CheckpointSource:
    """An ``mlx_lm.convert -q`` directory: config.json (with ``quantization``) and its safetensors headers."""
    config = read_config(directory)
    quant = quantization_config(config)
    model_type = text_config(config).get("model_type", config.get("model_type"))
    if model_type not in MLX_MODEL_TYPES:
        raise AnelabInputError(
            f"{directory}: MLX-quantized model_type {model_type!r}: mlx-lm's layout for it is not checked against "
            f"transformers' (checked: {', '.join(MLX_MODEL_TYPES)}); convert the Hugging Face checkpoint instead"
        )
    default = {k: quant[k] for k in ("bits", "group_size", "mode", "global_scale") if k in quant}
    _parameters(default, f"{directory}/config.json")  # the default mode and sizes, refused now if unmodelled
    overrides = {k: v for k, v in quant.items() if k not in ("bits", "group_size", "mode", "global_scale")}
    source = MlxSource(directory, SafetensorsSource(directory, weight_map(directory)), default, overrides)
    return CheckpointSource(
        config=config, tensors=source, format="mlx", quantized=True, tokenizer=directory_tokenizer(directory)
    )
