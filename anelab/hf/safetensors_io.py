"""safetensors files: lazy per-tensor reads (F32/F16/BF16) and an atomic writer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from anelab.errors import AnelabInputError

# safetensors dtype names this loader reads, and their little-endian numpy storage types.
STORAGE_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}


INDEX_FILE = "model.safetensors.index.json"
TORCH_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit on the JSON header


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
    _mapped: np.memmap | None = field(default=None, repr=False)

    @classmethod
    def open(cls, path: Path) -> SafetensorsFile:
        path = Path(path)
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise AnelabInputError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
                n = int.from_bytes(head, "little")
                if n > MAX_HEADER_BYTES or 8 + n > size:
                    raise AnelabInputError(
                        f"{path} is not a safetensors file (header length {n} does not fit the file)"
                    )
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

    def view(self, name: str) -> np.ndarray:
        """The tensor ``name`` memory-mapped read-only in its storage dtype, shaped as stored (no bytes read
        until used: the page cache serves them, and they do not count as this process's own memory)."""
        entry = self.entries[name]
        storage = self._storage(entry)
        if self._mapped is None:
            self._mapped = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._mapped[self.data_start + entry.begin : self.data_start + entry.end]
        return raw.view(storage).reshape(entry.shape)

    def _storage(self, entry: TensorEntry) -> np.dtype:
        storage = STORAGE_DTYPES.get(entry.dtype)
        if storage is None:
            raise AnelabInputError(
                f"tensor {entry.name} in {self.path.name} has dtype {entry.dtype}; supported: "
                f"{', '.join(STORAGE_DTYPES)} (dequantize the checkpoint first)"
            )
        count = int(np.prod(entry.shape, dtype=np.int64))
        if entry.end - entry.begin != count * storage.itemsize:
            raise AnelabInputError(
                f"tensor {entry.name} in {self.path.name}: {entry.end - entry.begin} bytes do not hold "
                f"{entry.dtype} {list(entry.shape)}; the file is corrupt"
            )
        return storage

    def read(self, name: str) -> np.ndarray:
        """The tensor ``name`` in its storage dtype (F32 / F16 / BF16), shaped as stored (read into memory)."""
        entry = self.entries[name]
        storage = self._storage(entry)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + entry.begin)
            raw = f.read(entry.end - entry.begin)
        return np.frombuffer(raw, dtype=storage).reshape(entry.shape)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> int:
    """Write ``tensors`` (cast to ``dtype``) as one safetensors file; return the data bytes.

    Byte-deterministic: tensors in name order, compact sorted JSON, header padded with spaces to
    a multiple of 8 (as the safetensors library does).
    """
    storage = STORAGE_DTYPES[dtype]
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        blob = np.ascontiguousarray(np.asarray(tensors[name], dtype=np.float32).astype(storage)).tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + len(blob)],
        }
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
