"""A Hugging Face safetensors directory: config.json and its tensor files (sharded behind the index or not), read lazily.

Tensors are read from the safetensors files (F32 / F16 / BF16) through memory maps, only the requested
ones; a directory of quantized Hugging Face weights (``quantization_config``: GPTQ, AWQ, bitsandbytes, fp8,
...) is refused in one line (GGUF files and MLX-quantized directories are formats of their own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from anelab.checkpoints.config import CONFIG_FILE, text_config
from anelab.checkpoints.safetensors_io import INDEX_FILE, MappedTensor, SafetensorsFile, TensorEntry
from anelab.checkpoints.source import CheckpointSource, content_digest
from anelab.checkpoints.tokenizer import tokenizer_from_directory
from anelab.core.errors import AnelabInputError
from anelab.core.files import confined, read_json

TOKENIZER_FILE = "tokenizer.json"


def read_config(directory: Path) -> dict:
    """``directory/config.json`` as a dict; refused (one line) when missing, not a regular UTF-8 JSON file, too
    deep, or not an object (``anelab.core.files.read_json``)."""
    config_path = directory / CONFIG_FILE
    if not (config_path.exists() or config_path.is_symlink()):
        raise AnelabInputError(f"{directory} has no config.json; pass a Hugging Face model directory")
    config = read_json(checkpoint_file(directory, CONFIG_FILE, "the checkpoint"), CONFIG_FILE)
    if not isinstance(config, dict):
        raise AnelabInputError(f"{config_path} must hold a JSON object")
    return config


def weight_map(directory: Path) -> dict[str, Path]:
    """Tensor name -> file: from the shard index when present, else from every file's header. Every file
    must lie inside the checkpoint directory once symlinks are resolved (``checkpoint_file``)."""
    index = directory / INDEX_FILE
    if index.exists() or index.is_symlink():
        data = read_json(checkpoint_file(directory, INDEX_FILE, "the checkpoint"), INDEX_FILE)
        mapping = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(mapping, dict) or not mapping:
            raise AnelabInputError(f"{index} has no 'weight_map' object of tensor names; regenerate the shard index")
        bad = next((name for name, file in mapping.items() if not isinstance(file, str) or not file), None)
        if bad is not None:
            raise AnelabInputError(
                f"{index}: weight_map entry {bad[:80]!r} does not name a file (a string); regenerate the shard index"
            )
        files = {file: checkpoint_file(directory, file, INDEX_FILE) for file in set(mapping.values())}
        return {name: files[file] for name, file in mapping.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise AnelabInputError(f"no *.safetensors files in {directory}; download the model weights into it")
    mapping: dict[str, Path] = {}
    for path in files:
        for name in SafetensorsFile.open(checkpoint_file(directory, path.name, "the checkpoint")).entries:
            mapping[name] = path
    return mapping


def checkpoint_file(directory: Path, name: str, named_by: str) -> Path:
    """``directory/name`` when it stays inside the checkpoint directory: a relative name without ``..``,
    whose symlinks resolve inside ``directory`` — or, for a Hugging Face cache snapshot
    (``.../snapshots/<revision>``), inside that repository's ``blobs/`` folder, where the cache keeps the
    files its snapshot links to. Anything else (an absolute path, ``../other``, a link out) is refused."""
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise AnelabInputError(
            f"{named_by} names {name[:120]!r}, outside the checkpoint directory {directory}; "
            "a checkpoint's files stay inside it"
        )
    blobs = directory.resolve().parent.parent / "blobs"
    cache = (blobs,) if directory.resolve().parent.name == "snapshots" and blobs.is_dir() else ()
    confined(directory / name, directory, f"{named_by}'s file", also=cache)
    return directory / name


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
        """The tensor's safetensors dtype; a dtype anelab does not read, or bytes that do not hold the shape, are
        refused (one line naming the tensor; no tensor bytes read)."""
        found = self.entry(name)
        if found is None:
            return "missing"
        found[0].storage_dtype(name)
        return found[1].dtype

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
    config = path / CONFIG_FILE  # present in any form: reading it refuses a directory, a FIFO, a link out
    return path.is_dir() and (config.exists() or config.is_symlink())


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

        return tokenizer_from_directory(directory)

    return build
