"""safetensors files: lazy per-tensor reads (F32/F16/BF16) and an atomic writer."""

from __future__ import annotations

import json
import mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from anelab.core.errors import AnelabInputError

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
    _mapped: mmap.mmap | None = field(default=None, repr=False)

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
        until used; ``release`` drops the pages touched from this process's resident memory)."""
        entry = self.entries[name]
        storage = self._storage(entry)
        if self._mapped is None:
            with open(self.path, "rb") as f:
                self._mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        count = (entry.end - entry.begin) // storage.itemsize
        flat = np.frombuffer(self._mapped, dtype=storage, count=count, offset=self.data_start + entry.begin)
        return flat.reshape(entry.shape)

    def release(self, name: str | None = None) -> None:
        """Drop the mapped pages of tensor ``name`` (None: of the whole file) from resident memory; the page
        cache keeps them, so a later read is served from memory without counting as this process's."""
        if self._mapped is None:
            return
        begin, end = 0, len(self._mapped)
        if name is not None:
            entry = self.entries[name]
            begin = (self.data_start + entry.begin) // mmap.PAGESIZE * mmap.PAGESIZE
            end = min(end, self.data_start + entry.end)
        if end > begin:
            self._mapped.madvise(mmap.MADV_DONTNEED, begin, end - begin)

    def read_float32(self, name: str) -> np.ndarray:
        """The tensor ``name`` converted to a new float32 array through the memory map (pages released after)."""
        out = to_float32(self.view(name))
        self.release(name)
        return out

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


def to_float32(stored: np.ndarray) -> np.ndarray:
    """A new float32 array of F32 / F16 / BF16 values [...]: bf16 is the upper half of a float32, so its bits
    are copied into the upper halves of a zeroed float32 array (several times faster than a dtype cast)."""
    if stored.dtype != STORAGE_DTYPES["BF16"]:
        return np.array(stored, dtype=np.float32)
    out = np.zeros(stored.shape, np.float32)
    out.view(np.uint16).reshape(*stored.shape, 2)[..., 1] = stored.view(np.uint16)  # little-endian: high half second
    return out


@dataclass(frozen=True)
class MappedTensor:
    """A 2-D tensor [N, K] left in its safetensors file: ``tensor[rows]`` (a slice or an index array) returns
    those rows as float32, read through the memory map and released after. ``np.asarray`` reads it whole."""

    file: SafetensorsFile
    name: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.file.entries[self.name].shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    dtype = np.dtype(np.float32)

    def __getitem__(self, rows) -> np.ndarray:
        out = to_float32(np.asarray(self.file.view(self.name)[rows]))
        self.file.release(self.name)
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self.file.read_float32(self.name)
        return whole if dtype is None else whole.astype(dtype)


@dataclass(frozen=True)
class LazyTensor:
    """A tensor made when the writer reaches it (``make()`` -> array of ``shape``): a writer holds one at a time."""

    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]


def write_safetensors(path: Path, tensors: dict[str, np.ndarray | LazyTensor], dtype: str) -> int:
    """Write ``tensors`` (cast to ``dtype``; a ``LazyTensor`` made in its turn) as one safetensors file;
    return the data bytes.

    Byte-deterministic: tensors in name order, compact sorted JSON, header padded with spaces to
    a multiple of 8 (as the safetensors library does).
    """
    storage = STORAGE_DTYPES[dtype]
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(tensors):
        shape = [int(n) for n in tensors[name].shape]
        size = int(np.prod(shape, dtype=np.int64)) * storage.itemsize
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name in sorted(tensors):
            value = tensors[name]
            array = value.make() if isinstance(value, LazyTensor) else value
            if list(np.shape(array)) != header[name]["shape"]:
                raise AnelabInputError(f"tensor {name} was made with shape {list(np.shape(array))}, not {value.shape}")
            stored = array if array.dtype == storage else np.asarray(array, dtype=np.float32).astype(storage)
            f.write(np.ascontiguousarray(stored).tobytes())
    return offset
