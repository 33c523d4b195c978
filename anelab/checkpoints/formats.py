"""The checkpoint formats anelab reads — Hugging Face safetensors directory, GGUF file, MLX-quantized directory — one table.

Each :class:`CheckpointFormat` knows how to recognise a path as its own, how to open it into a
``CheckpointSource`` (config, tensors dequantized to float32 in anelab's layout, digests, tokenizer) and
what it refuses. ``load_checkpoint`` (and through it export, verify, plan, decide, the arms and the
notebooks) asks this table and nothing else, so a command never has a code path of its own per format.
The first entry whose ``detect`` accepts a path opens it (an MLX directory is also a safetensors
directory, so it comes first).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from anelab.checkpoints import gguf_file, mlx_quantized
from anelab.checkpoints.hf_directory import is_directory_checkpoint, open_directory
from anelab.checkpoints.source import CheckpointSource
from anelab.core.errors import AnelabInputError


@dataclass(frozen=True)
class CheckpointFormat:
    """One checkpoint format: ``name`` (the package metadata's ``sourceFormat``), ``summary`` (what it is),
    ``detect`` (is this path one), ``open`` (path -> ``CheckpointSource``), ``refuses`` (what it will not read)."""

    name: str
    summary: str
    detect: Callable[[Path], bool]
    open: Callable[[Path], CheckpointSource]
    refuses: tuple[str, ...] = ()


FORMATS: dict[str, CheckpointFormat] = {
    "gguf": CheckpointFormat(
        "gguf",
        "a GGUF file (llama.cpp, Ollama, LM Studio), read with llama.cpp's gguf package: config from its metadata, "
        "tensors dequantized (F32, F16, BF16, Q4_0 ... Q8_0, K-quants, IQ), llama.cpp's conventions per architecture "
        "undone (gguf_architectures: Q/K row order, Gemma's shifted norms, windows, scalars), "
        "tokenizer and chat template from the metadata",
        gguf_file.is_gguf_file,
        gguf_file.open_gguf,
        gguf_file.REFUSED,
    ),
    "mlx": CheckpointFormat(
        "mlx",
        "a directory written by mlx_lm.convert -q: affine 2-8-bit weights packed in uint32 with per-group scales "
        "and biases (config.json 'quantization', per-layer overrides too), dequantized as mx.dequantize does",
        mlx_quantized.is_mlx_quantized,
        mlx_quantized.open_mlx,
        mlx_quantized.REFUSED,
    ),
    "safetensors": CheckpointFormat(
        "safetensors",
        "a Hugging Face directory: config.json + *.safetensors (F32 / F16 / BF16, optionally sharded behind "
        "model.safetensors.index.json)",
        is_directory_checkpoint,
        open_directory,
        ("quantization_config (GPTQ, AWQ, bitsandbytes, fp8, ...): dequantize first",),
    ),
}


def format_of(path: str | os.PathLike) -> CheckpointFormat:
    """The format of the checkpoint at ``path``; refused (one line) when no format recognises it."""
    path = Path(path)
    for fmt in FORMATS.values():
        if fmt.detect(path):
            return fmt
    if not path.exists():
        raise AnelabInputError(
            f"checkpoint directory {path} does not exist; pass a model directory with config.json or a .gguf file"
        )
    if path.is_dir():
        raise AnelabInputError(f"{path} has no config.json; pass a Hugging Face model directory (or a .gguf file)")
    raise AnelabInputError(
        f"{path} is neither a GGUF file nor a model directory; pass a .gguf file or a directory with config.json"
    )


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether some format recognises ``path`` (nothing is read beyond what detection needs)."""
    return any(fmt.detect(Path(path)) for fmt in FORMATS.values())


def open_source(path: str | os.PathLike) -> CheckpointSource:
    """Open the checkpoint at ``path`` with its format (config and headers only; tensors are read on demand)."""
    return format_of(path).open(Path(path))


def supported_formats() -> list[dict]:
    """One row per format for ``export --list-formats``: its name, what it is, what it refuses."""
    return [{"format": f.name, "summary": f.summary, "refuses": list(f.refuses)} for f in FORMATS.values()]
