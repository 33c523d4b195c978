"""A GGUF checkpoint as a directory mlx-lm reads: its tensors under transformers' names (anelab's own GGUF reader
and llama.cpp's dequantizers), written once as fp16 safetensors beside its config, so the whole-model A/B can run
mlx-lm on the model a GGUF file holds (mlx-lm's loader refuses a GGUF file).

fp16 is what a Mac's GPU would run such a model in (a quantized GGUF has no mlx-lm equivalent: the copy holds its
dequantized values); the A/B says which directory mlx-lm read. The sidecars are still checked against the GGUF
checkpoint itself (their recorded tensor digests are the GGUF's).
"""

from __future__ import annotations

from pathlib import Path

from anelab.checkpoints.checkpoint import Checkpoint, write_checkpoint_directory
from anelab.checkpoints.safetensors_io import LazyTensor
from anelab.core.paths import BUILD_DIR

MLX_COPY_DIR = BUILD_DIR / "mlx-from-gguf"
MLX_COPY_DTYPE = "F16"


def mlx_readable_path(checkpoint: Checkpoint, copies: Path | None = None) -> Path:
    """The directory mlx-lm reads for ``checkpoint``: its own path, or for a GGUF file its fp16 copy (written the
    first time, under ``copies`` — default ``build/mlx-from-gguf/`` — keyed by the file's name, size and mtime)."""
    if checkpoint.format != "gguf":
        return Path(checkpoint.path)
    source = Path(checkpoint.path)
    stat = source.stat()
    dest = Path(copies or MLX_COPY_DIR) / f"{source.stem}-{stat.st_size}-{stat.st_mtime_ns}-{MLX_COPY_DTYPE.lower()}"
    if (dest / "config.json").is_file():
        return dest
    tensors = checkpoint.tensors
    lazy = {
        name: LazyTensor(tuple(tensors.shape(name)), lambda name=name: tensors.read_float32(name))
        for name in tensors.names()
    }
    config = {**checkpoint.config, "torch_dtype": "float16", "anelab_source": source.name}
    try:
        write_checkpoint_directory(dest, config, lazy, dtype=MLX_COPY_DTYPE)
    except Exception:
        if not (dest / "config.json").is_file():  # another process wrote it first: use theirs
            raise
    return dest
