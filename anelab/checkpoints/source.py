"""What every checkpoint format serves: a config, tensors under transformers' names (float32, anelab's layout), digests.

A format (``anelab.checkpoints.formats``) opens a path into a :class:`CheckpointSource`: the model's config as
transformers would read its config.json (a GGUF file's is built from its metadata), a :class:`TensorSource`
that reads each tensor by its transformers name, dequantized to float32 and with the format's own conventions
undone (llama.cpp's Q/K row order, MLX's packed groups), and what it knows of the storage. ``Checkpoint``
(``anelab.checkpoints.checkpoint``) and the whole-model reader only ever talk to these.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np


class TensorSource(Protocol):
    """A checkpoint's tensors, each under its transformers name (e.g. ``model.layers.3.self_attn.q_proj.weight``).

    ``shape``: the tensor's shape in transformers' layout (None: not in the checkpoint); ``storage``: how it is
    stored (``BF16``, ``Q4_1``, ``MLX affine 4-bit g64, F16 scales``); ``read_float32``: a new float32 array of
    ``shape``, dequantized, in anelab's layout; ``mapped``: a 2-D tensor [N, K] left in its file whose
    ``tensor[rows]`` returns float32 rows; ``digest``: 16 hex digits of the name, storage, shape and stored
    bytes (what a package records to recognise its checkpoint by content); ``files``: the file names holding
    the tensors.
    """

    path: Path

    def names(self) -> Iterable[str]: ...

    def shape(self, name: str) -> tuple[int, ...] | None: ...

    def storage(self, name: str) -> str: ...

    def read_float32(self, name: str) -> np.ndarray: ...

    def mapped(self, name: str): ...

    def digest(self, name: str) -> str: ...

    def files(self) -> list[str]: ...


@dataclass(frozen=True)
class CheckpointSource:
    """One opened checkpoint, whatever its format.

    ``config``: transformers' config.json (as read, or built from a GGUF file's metadata); ``tensors``: its
    tensors; ``format``: the name of its entry in ``anelab.checkpoints.formats.FORMATS``; ``quantized``: its
    weights are stored quantized (a sidecar's weights are then the dequantized projections); ``tokenizer``:
    builds the model's tokenizer (None: the checkpoint carries none).
    """

    config: dict
    tensors: TensorSource
    format: str
    quantized: bool = False
    tokenizer: Callable[[], object] | None = None


@dataclass(frozen=True)
class RowTensor:
    """A 2-D tensor [N, K] left in its file: ``tensor[rows]`` (a slice or an index array) returns those rows as
    float32, dequantized by ``read_rows``; ``np.asarray`` reads it whole."""

    shape: tuple[int, int]
    read_rows: Callable[[object], np.ndarray]

    ndim = 2
    dtype = np.dtype(np.float32)

    def __getitem__(self, rows) -> np.ndarray:
        return self.read_rows(rows)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self.read_rows(slice(None))
        return whole if dtype is None else whole.astype(dtype, copy=False)  # float32 asked: no second copy


def content_digest(name: str, storage: str, shape: tuple[int, ...], chunks: Iterable) -> str:
    """SHA-256 (16 hex digits) of ``name|storage|shape|`` and the stored bytes of ``chunks`` (arrays), in order."""
    h = hashlib.sha256(f"{name}|{storage}|{list(shape)}|".encode())
    for chunk in chunks:
        h.update(memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)))
    return h.hexdigest()[:16]
