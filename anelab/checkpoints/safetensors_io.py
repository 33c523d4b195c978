"""safetensors files: headers validated as the safetensors library validates them, lazy per-tensor reads
(F32/F16/BF16) and an atomic writer."""

from __future__ import annotations

import errno
import json
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.files import open_regular
from anelab.core.limits import human_bytes, memory_limit

# safetensors dtype names this loader reads, and their little-endian numpy storage types.
STORAGE_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}


INDEX_FILE = "model.safetensors.index.json"
TORCH_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


MAX_HEADER_BYTES = 100_000_000  # the safetensors library's limit on the JSON header (MAX_HEADER_SIZE)
MAX_JSON_DEPTH = 127  # serde_json's recursion limit, as the library parses the header: 127 nested containers
USIZE = 2**64  # offsets, dimensions and sizes are the library's usize: at most 2**64 - 1, overflow refused

# every dtype the safetensors format defines and its width in bits (the library's Dtype::bitsize)
FORMAT_DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}  # fmt: skip


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place in a safetensors file (offsets relative to the data after the header)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class _Object(dict):
    """A JSON object as parsed (last value wins, as the library's maps), remembering keys given twice."""

    duplicates: tuple[str, ...] = ()


def _pairs(pairs: list[tuple[str, object]]) -> _Object:
    obj = _Object(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        obj.duplicates = tuple(k for k, _ in pairs if k in seen or seen.add(k))
    return obj


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _short(name: str) -> str:
    """A tensor name for an error line (a hostile header can hold a megabyte-long one)."""
    return repr(name) if len(name) <= 80 else repr(name[:77] + "...")


def _depth(value) -> int:
    """Nesting depth of a parsed JSON value (containers only; a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _usize(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < USIZE


def parse_header(raw: bytes) -> tuple[dict | None, str | None]:
    """(header, None) for JSON header bytes the library would parse, else (None, why not): UTF-8, JSON without
    NaN/Infinity (serde_json has none), nested at most ``MAX_JSON_DEPTH`` deep, an object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"its header is not UTF-8 (bad byte at offset {e.start})"
    try:
        header = json.loads(text, object_pairs_hook=_pairs, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, ValueError, RecursionError):
        return None, "its header is not JSON"
    if _depth(header) > MAX_JSON_DEPTH:
        return None, f"its header nests JSON deeper than {MAX_JSON_DEPTH} levels"
    if not isinstance(header, dict):
        return None, "its header is not a JSON object"
    return header, None


def _entry_problem(name: str, spec) -> str | None:
    if not isinstance(spec, dict):
        return f"tensor {_short(name)} is not a JSON object of dtype, shape and data_offsets"
    if getattr(spec, "duplicates", ()):
        return f"tensor {_short(name)} gives {spec.duplicates[0]!r} twice"
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in spec]
    if missing:
        return f"tensor {_short(name)} has no {missing[0]!r}"
    if not isinstance(spec["dtype"], str) or spec["dtype"] not in FORMAT_DTYPE_BITS:
        return f"tensor {_short(name)} has a dtype the safetensors format does not define"
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not isinstance(shape, list) or not all(_usize(d) for d in shape):
        return f"tensor {_short(name)} has a shape that is not a list of non-negative integers"
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_usize(o) for o in offsets):
        return f"tensor {_short(name)} has data_offsets that are not two non-negative integers"
    return None


def _byte_size(dtype: str, shape: list[int]) -> int | None:
    """Bytes of ``dtype`` x ``shape`` as the library computes them (None: overflow, or a sub-byte dtype
    whose bits do not end on a byte boundary)."""
    elements = 1
    for d in shape:
        elements *= d
        if elements >= USIZE:
            return None
    bits = elements * FORMAT_DTYPE_BITS[dtype]
    if bits >= USIZE or bits % 8:
        return None
    return bits // 8


def header_problem(header: dict, data_bytes: int) -> str | None:
    """Why a parsed header does not describe ``data_bytes`` bytes of tensor data (None: it does), by the
    rules the safetensors library applies when it opens a file: every entry an object with a known dtype, a
    shape and two integer offsets; ``__metadata__`` null or strings to strings; the tensors, ordered by
    offsets, contiguous from 0 (no gap, no overlap) and ending exactly at the end of the file; each tensor's
    bytes exactly its dtype x shape (no overflow)."""
    meta = header.get("__metadata__")
    if meta is not None and (not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())):
        return "its __metadata__ is not a JSON object of strings"
    entries = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        problem = _entry_problem(name, spec)
        if problem:
            return problem
        entries.append((tuple(spec["data_offsets"]), name, spec))
    end = 0
    for (begin, stop), name, spec in sorted(entries, key=lambda e: e[0]):
        if begin != end or stop < begin:
            return f"tensor {_short(name)}'s data_offsets leave a gap or overlap another tensor"
        size = _byte_size(spec["dtype"], spec["shape"])
        if size is None:
            return f"tensor {_short(name)}'s {spec['dtype']} x {spec['shape'][:8]} does not fit a whole number of bytes"
        if stop - begin != size:
            return f"tensor {_short(name)} holds {stop - begin} bytes, not {spec['dtype']} x {spec['shape'][:8]}"
        end = stop
    if end != data_bytes:
        return f"its tensors cover {end:,} of the {data_bytes:,} data bytes (truncated, or bytes appended)"
    return None


def _library_refusal(path: Path) -> str | None:
    """The safetensors library's own refusal of the file (None: it opens it), cut to a line."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy"):
            return None
    except SafetensorError as e:
        return " ".join(str(e).split())[:160]
    except MemoryError:  # the library maps the whole file: past an address-space limit (ulimit -v) it cannot
        raise unmappable(path) from None


def unmappable(path: Path) -> AnelabInputError:
    """One line for a file too large to memory-map in this process (its size, the limit and where it comes from)."""
    limit, source = memory_limit()
    return AnelabInputError(
        f"{path}: its {human_bytes(path.stat().st_size)} cannot be memory-mapped in this process ({source} is "
        f"{human_bytes(limit)}); raise the limit (ulimit -v) or remove the tensors anelab does not read"
    )


@dataclass
class SafetensorsFile:
    """A safetensors file's header, parsed once; tensor bytes are read on demand.

    Format: 8-byte little-endian header length N, N bytes of JSON
    ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then data. The
    header is validated as the safetensors library validates it (``header_problem``), and the library
    opens the file too: a file either refuses is refused, in one line that never echoes the file's bytes.
    """

    path: Path
    data_start: int
    entries: dict[str, TensorEntry]
    _mapped: mmap.mmap | None = field(default=None, repr=False)

    @classmethod
    def open(cls, path: Path) -> SafetensorsFile:
        path = Path(path)
        if not path.exists():
            raise AnelabInputError(f"safetensors file {path} is missing; restore it or fix {INDEX_FILE}")
        with open_regular(path, "safetensors file") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise AnelabInputError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise AnelabInputError(
                    f"{path} is not a safetensors file (its first 8 bytes give no header length that fits the file)"
                )
            header, problem = parse_header(f.read(n))
        problem = problem or header_problem(header, size - 8 - n)
        if problem is None:
            library = _library_refusal(path)
            problem = None if library is None else f"the safetensors library refuses it: {library}"
        if problem is not None:
            raise AnelabInputError(f"{path} is not a valid safetensors file: {problem}; re-download or rewrite it")
        entries = {
            name: TensorEntry(name, spec["dtype"], tuple(spec["shape"]), *spec["data_offsets"])
            for name, spec in header.items()
            if name != "__metadata__"
        }
        return cls(path, 8 + n, entries)

    def view(self, name: str) -> np.ndarray:
        """The tensor ``name`` memory-mapped read-only in its storage dtype, shaped as stored (no bytes read
        until used; ``release`` drops the pages touched from this process's resident memory)."""
        entry = self.entries[name]
        storage = self._storage(entry)
        if self._mapped is None:
            with open(self.path, "rb") as f:
                try:
                    self._mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                except (MemoryError, OSError) as e:
                    if isinstance(e, OSError) and e.errno != errno.ENOMEM:
                        raise
                    raise unmappable(self.path) from None
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

    def storage_dtype(self, name: str) -> np.dtype:
        """The numpy storage dtype of tensor ``name``; refuses a dtype anelab does not read or bytes that do
        not hold its shape (one line naming the tensor), reading no tensor bytes."""
        return self._storage(self.entries[name])

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
        return whole if dtype is None else whole.astype(dtype, copy=False)  # float32 asked: no second copy


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
