"""A Hugging Face safetensors directory: config.json and its tensor files (sharded behind the index or not), read lazily.

Tensors are read from the safetensors files (F32 / F16 / BF16) through memory maps, only the requested
ones; a directory of quantized Hugging Face weights (``quantization_config``: GPTQ, AWQ, bitsandbytes, fp8,
...) is refused in one line (GGUF files and MLX-quantized directories are formats of their own).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from anelab.checkpoints.config import CONFIG_FILE, text_config
from anelab.checkpoints.safetensors_io import INDEX_FILE, MappedTensor, SafetensorsFile, TensorEntry
from anelab.checkpoints.source import CheckpointSource, content_digest
from anelab.core.errors import AnelabInputError

TOKENIZER_FILE = "tokenizer.json"


def read_config(directory: Path) -> dict:
    """``directory/config.json`` as a dict; refused (one line) when missing, not JSON or not an object."""
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise AnelabInputError(f"{directory} has no config.json; pass a Hugging Face model directory")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise AnelabInputError(f"{config_path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(config, dict):
        raise AnelabInputError(f"{config_path} must hold a JSON object")
    return config


def weight_map(directory: Path) -> dict[str, Path]:
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


@dataclass
class SafetensorsSource:
    """The tensors of a safetensors directory: ``weight_map`` (name -> file), each file's header parsed once."""

    path: Path
    weight_map: dict[str, Path]
    _files: dict[Path, SafetensorsFile] = field(default_factory=dict, repr=False)

    def entry(self, name: str) -> tuple[SafetensorsFile, TensorEntry] | None:
        """The file holding ``name`` and its header entry (None: the checkpoint maps no such tensor)."""
        path = self.weight_map.get(name)
        if path is None:
            return None
        if path not in self._files:
            self._files[path] = SafetensorsFile.open(path)
        entry = self._files[path].entries.get(name)
        if entry is None:
            raise AnelabInputError(f"{INDEX_FILE} maps tensor {name} to {path.name}, which does not contain it")
        return self._files[path], entry

    def names(self):
        return self.weight_map.keys()

    def shape(self, name: str) -> tuple[int, ...] | None:
        found = self.entry(name)
        return None if found is None else found[1].shape

    def storage(self, name: str) -> str:
        found = self.entry(name)
        return "missing" if found is None else found[1].dtype

    def read_float32(self, name: str) -> np.ndarray:
        file, _ = self.entry(name)
        return file.read_float32(name)

    def mapped(self, name: str) -> MappedTensor:
        file, _ = self.entry(name)
        file.view(name)  # refuses an unsupported dtype or a truncated tensor now
        return MappedTensor(file, name)

    def digest(self, name: str) -> str:
        """Through a memory map whose pages are released after the tensor (matching an 8B model's 32 layers
        read 2.7 GB otherwise)."""
        file, entry = self.entry(name)
        digest = content_digest(name, entry.dtype, entry.shape, [file.view(name)])
        file.release(name)  # the pages read stay in the page cache, not in this process's resident memory
        return digest

    def files(self) -> list[str]:
        return sorted({p.name for p in self.weight_map.values()})


def refuse_quantized_config(config: dict, where: Path) -> None:
    """Refuse (one line) a Hugging Face directory whose weights are quantized by a method anelab does not read."""
    for part in (config, text_config(config)):
        quant = part.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "unnamed") if isinstance(quant, dict) else quant
            raise AnelabInputError(
                f"{where}/config.json declares quantization_config (quant_method {method}): quantized Hugging Face "
                "weights are not modelled (GGUF files and mlx_lm.convert -q directories are); dequantize it first"
            )


def is_directory_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def open_directory(directory: Path) -> CheckpointSource:
    """A Hugging Face directory: config.json and the safetensors headers (or the shard index) only."""
    config = read_config(directory)
    refuse_quantized_config(config, directory)
    return CheckpointSource(
        config=config,
        tensors=SafetensorsSource(directory, weight_map(directory)),
        format="safetensors",
        tokenizer=directory_tokenizer(directory),
    )


def directory_tokenizer(directory: Path):
    """A builder of the directory's tokenizer (``tokenizer.json`` and tokenizer_config.json's chat template),
    or None when it has no tokenizer.json."""
    if not (directory / TOKENIZER_FILE).is_file():
        return None

    def build():
        from anelab.checkpoints.tokenizer import tokenizer_from_directory

        return tokenizer_from_directory(directory)

    return build
