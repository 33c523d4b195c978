"""A GGUF file (llama.cpp, Ollama, LM Studio) as a checkpoint: config from its metadata, tensors dequantized, conventions undone.

Read with the ``gguf`` package (llama.cpp's own Python reader; its ``quants`` dequantize every type it
knows in NumPy). What each ``general.architecture`` means — its transformers model, the conventions llama.cpp's
converter and loader apply to it — is one table, ``anelab.checkpoints.gguf_architectures.GGUF_ARCHITECTURES``
(docs/conventions.md §10 cites llama.cpp and transformers). Undone here, on read:

- tensor names: llama.cpp's (``blk.{L}.attn_q.weight``, ``token_embd.weight``, ...) back to transformers'
  through gguf's own ``TensorNameMap`` (the table llama.cpp's converter writes with);
- Q/K rows permuted for llama.cpp's interleaved RoPE (``llama``, ``granite``: ``LlamaModel.permute``), put back
  per head (``undo_rope_permutation``);
- norms stored shifted (Gemma 2/3: ``w + 1``), read back as ``w``;
- stacked routed experts (``blk.{L}.ffn_*_exps.weight`` [E, ...], qwen3moe) served per expert under
  transformers' ``mlp.experts.{e}.*`` names.

Refused in one line (``REFUSED``): other architectures, metadata keys of the architecture that are not
modelled (naming the key), sizes past ``anelab.core.limits`` (naming the key), tensors with no transformers
name, RoPE scaling other than linear, split or big-endian files.
"""

from __future__ import annotations

import functools
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from anelab.checkpoints.gguf_architectures import (
    GGUF_ARCHITECTURES,
    REFUSED,
    GgufArchitecture,
    architecture_of,
    config_from_metadata,
    metadata,
    transformers_names,
)
from anelab.checkpoints.source import CheckpointSource, RowTensor, content_digest
from anelab.checkpoints.tokenizer import tokenizer_from_gguf
from anelab.core.errors import AnelabInputError

__all__ = ["GGUF_ARCHITECTURES", "REFUSED", "GgufArchitecture", "is_gguf_file", "open_gguf", "read_gguf"]

GGUF_MAGIC = b"GGUF"
UNQUANTIZED = ("F32", "F16", "BF16")  # storage types that hold the values themselves
DEQUANTIZE_BLOCK_BYTES = 32 << 20  # float32 bytes of one block of rows dequantized at a time


def is_gguf_file(path: Path) -> bool:
    """A regular file starting with the GGUF magic."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


@functools.lru_cache(maxsize=4)
def _reader(path: str, mtime_ns: int, size: int):
    """gguf's reader of ``path``, its metadata arrays read lazily (``_lazy_array_reader``), kept per process while
    the file is unchanged."""
    try:
        return _lazy_array_reader()(path)
    except (ValueError, OSError, IndexError) as e:
        raise AnelabInputError(f"{path}: not a readable GGUF file ({e}); re-download it") from None


class LazyArrayField:
    """One metadata array of a GGUF file (``tokenizer.ggml.tokens``: 49k strings) as gguf's ``ReaderField`` serves it,
    built only when its elements are first asked for; ``count`` (its length) is known without them.

    gguf's reader makes two NumPy views per string of such an array at open: ~0.5 M objects for a 49k vocabulary,
    ~2 s to build, then walked by every full garbage collection of the process (coremltools' ``convert`` ends with
    one: 0.14 s per converted function) and by each worker forked from it. The config and the tensors need none
    of it; the tokenizer reads it once."""

    def __init__(self, reader, offset: int, name: str, value_offset: int, count: int, types: list):
        self.reader, self.offset, self.name, self.types = reader, offset, name, types
        self.value_offset, self.count = value_offset, count
        self._field = None

    def values(self) -> list:
        """Every element, as ``contents()`` gives them (str, or Python numbers), read straight from the bytes."""
        start, data = self.value_offset + 12, self.reader.data
        if self.count and self.types[-1] == 8:  # GGUFValueType.STRING: u64 length, then UTF-8 bytes
            view, out, pos = memoryview(data), [], start
            for _ in range(self.count):
                length = int.from_bytes(view[pos : pos + 8], "little")
                out.append(str(view[pos + 8 : pos + 8 + length], encoding="utf-8"))
                pos += 8 + length
            return out
        scalar = self.reader.gguf_scalar_to_np.get(self.types[-1]) if self.count else np.uint8
        return np.frombuffer(data, np.dtype(scalar).newbyteorder("<"), self.count, start).tolist()

    def field(self):
        """gguf's own ``ReaderField`` of these bytes, as its reader builds it (``GGUFReader._build_fields``)."""
        if self._field is None:
            import gguf

            r = self.reader
            head = list(r._get_str(self.offset)) + [r._get(self.value_offset - 4, np.uint32)]
            _, parts, indices, types = r._get_field_parts(self.value_offset, gguf.GGUFValueType.ARRAY)
            self._field = gguf.ReaderField(
                self.offset, self.name, head + parts, [i + len(head) for i in indices], types
            )
        return self._field

    @property
    def parts(self) -> list:
        return self.field().parts

    @property
    def data(self) -> list:
        return self.field().data

    def contents(self, index_or_slice: int | slice = slice(None)):
        return self.values()[index_or_slice]


@functools.cache
def _lazy_array_reader():
    """``gguf.GGUFReader`` whose metadata arrays of scalars or strings are ``LazyArrayField``s: at open only their
    extent is read (a string array's lengths, walked), so the reader holds a few hundred objects, not ~0.5 M.
    Every other field, the tensor infos and a byte-swapped file are read by gguf's own code."""
    import gguf

    ARRAY, STRING = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING

    class Reader(gguf.GGUFReader):
        def _build_fields(self, offs: int, count: int) -> int:
            for _ in range(count):
                key_length, key = self._get_str(offs)
                value_offset = offs + int(key_length.nbytes + key.nbytes) + 4
                raw_type = int(self._get(value_offset - 4, np.uint32)[0])
                if self.byte_order != "I" or raw_type != ARRAY:
                    offs = super()._build_fields(offs, 1)  # one field, as gguf reads it
                    continue
                item = int(self._get(value_offset, np.uint32)[0])
                n = int(self._get(value_offset + 4, np.uint64)[0])
                size = self._array_bytes(value_offset + 12, item, n)
                if size is None:  # an array of arrays: as gguf reads it
                    offs = super()._build_fields(offs, 1)
                    continue
                types = [ARRAY] + ([gguf.GGUFValueType(item)] if n else [])  # gguf's: the item type from item 0
                field = LazyArrayField(self, offs, str(bytes(key), encoding="utf-8"), value_offset, n, types)
                self._push_field(field, skip_sum=True)
                offs = value_offset + 12 + size
            return offs

        def _array_bytes(self, start: int, item: int, n: int) -> int | None:
            """Bytes of ``n`` items of type ``item`` from ``start`` (None: an array of arrays); refuses an array that
            runs past the end of the file."""
            end = len(self.data)
            if item == STRING:
                view, pos = memoryview(self.data), start
                for _ in range(n):
                    if pos + 8 > end:
                        raise ValueError(f"a metadata string array runs past the end of the file at {pos}")
                    pos += 8 + int.from_bytes(view[pos : pos + 8], "little")
                size = pos - start
            else:
                scalar = self.gguf_scalar_to_np.get(gguf.GGUFValueType(item))
                if scalar is None:
                    return None
                size = n * np.dtype(scalar).itemsize
            if start + size > end:
                raise ValueError(f"a metadata array runs past the end of the file at {start}")
            return size

    return Reader


def read_gguf(path: Path):
    """The gguf package's ``GGUFReader`` of ``path`` (cached while the file is unchanged); refuses big-endian
    and split files in one line."""
    stat = os.stat(path)
    reader = _reader(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)
    if reader.byte_order != "I":
        raise AnelabInputError(f"{path}: a big-endian GGUF file; convert it to little-endian (gguf-convert-endian)")
    if int(metadata(reader, "split.count", 1)) > 1:
        raise AnelabInputError(f"{path}: one part of a split GGUF file; merge it first (llama-gguf-split --merge)")
    return reader


def undo_rope_permutation(rows: np.ndarray, heads: int) -> np.ndarray:
    """Q or K rows (weight [heads * d, D] or bias [heads * d]) back from llama.cpp's order to transformers'.

    llama.cpp's converter wrote ``w.reshape(heads, 2, d/2, ...).swapaxes(1, 2)`` (``LlamaModel.permute``:
    each head's two rotate-half halves interleaved, as its RoPE kernel pairs neighbours); this is its inverse.
    """
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def dequantize(stored: np.ndarray, qtype) -> np.ndarray:
    """gguf.quants' dequantization of ``stored`` (uint8 [..., bytes per row]) -> float32 [..., K], every block at
    once (``gguf.quants.dequantize`` walks small groups of rows: the same values, 2x slower on a 135M model)."""
    import gguf

    kind = getattr(gguf.quants, qtype.name, None)
    if kind is None or qtype.name in ("F32", "F16"):
        return np.array(gguf.quants.dequantize(stored, qtype), np.float32)
    kind.init_grid()  # the IQ types' lookup grids, built once
    return kind.dequantize_rows(stored)


@dataclass
class GgufSource:
    """The tensors of a GGUF file under transformers' names: each dequantized by gguf.quants on read, with
    llama.cpp's conventions undone (Q/K rows put back in transformers' order, shifted norms unshifted, one expert
    of a stacked tensor served alone); bytes read through one memory map whose pages are released after each tensor.
    """

    path: Path
    spec: GgufArchitecture
    heads: int
    kv_heads: int
    entries: dict  # transformers name -> gguf ReaderTensor
    experts: dict = field(default_factory=dict)  # transformers name of one expert -> its index in a stacked tensor
    _mapped: mmap.mmap | None = field(default=None, repr=False)

    def names(self):
        return self.entries.keys()

    def _file_shape(self, name: str) -> tuple[int, ...]:
        """The stored tensor's shape, outermost first ([E, N, K] for a stacked expert tensor)."""
        return tuple(int(n) for n in reversed(self.entries[name].shape))

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name not in self.entries:
            return None
        shape = self._file_shape(name)
        return shape[1:] if name in self.experts else shape

    def storage(self, name: str) -> str:
        return self.entries[name].tensor_type.name

    def _stored(self, name: str, rows=slice(None)) -> np.ndarray:
        """The stored bytes of ``name`` as uint8 [*shape[:-1], bytes per row] (the rows asked for; one expert's
        block of a stacked tensor), copied out of the map; the pages touched are released."""
        import gguf

        entry = self.entries[name]
        if self._mapped is None:
            with open(self.path, "rb") as f:
                self._mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if entry.data_offset + entry.n_bytes > len(self._mapped):
            raise AnelabInputError(f"{self.path}: tensor {entry.name} lies outside the file (truncated download?)")
        shape = gguf.quant_shape_to_byte_shape(self._file_shape(name), entry.tensor_type)
        stored = np.frombuffer(self._mapped, np.uint8, count=entry.n_bytes, offset=entry.data_offset).reshape(shape)
        if name in self.experts:
            return np.array(stored[self.experts[name]][rows])
        out = np.array(stored[rows])
        if isinstance(rows, slice):  # a block of rows (or all): drop its pages; a few gathered rows stay mapped
            first, last, _ = rows.indices(shape[0])
            row_bytes = entry.n_bytes // max(shape[0], 1) if len(shape) > 1 else entry.n_bytes
            begin = (entry.data_offset + first * row_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
            end = entry.data_offset + (last * row_bytes if len(shape) > 1 else entry.n_bytes)
            if end > begin:
                self._mapped.madvise(mmap.MADV_DONTNEED, begin, end - begin)
        return out

    def _permuted_heads(self, name: str) -> int | None:
        """The head count whose rows llama.cpp permuted in ``name`` (None: not a permuted tensor)."""
        if self.spec.permuted_qk and ".self_attn.q_proj." in name:
            return self.heads
        if self.spec.permuted_qk and ".self_attn.k_proj." in name:
            return self.kv_heads
        return None

    def _shifted(self, name: str) -> bool:
        """Whether llama.cpp's converter stored ``name`` as ``w + norm_shift`` (every ``*norm.weight`` of Gemma)."""
        return bool(self.spec.norm_shift) and self.entries[name].name.endswith("norm.weight")

    def _dequantized(self, name: str, rows=slice(None)) -> np.ndarray:
        """``name``'s rows (a slice, or all; an index array is gathered) as float32, a slice dequantized in blocks of
        ~``DEQUANTIZE_BLOCK_BYTES`` into one array: gguf's dequantizers make float32 temporaries the size of their
        input (Q8_0: two), so Gemma 3's 262,144-row embedding (671 MB as float32) would peak at three copies if
        dequantized at once."""
        qtype, shape = self.entries[name].tensor_type, self.shape(name)
        if not isinstance(rows, slice) or len(shape) != 2:
            return dequantize(self._stored(name, rows), qtype)
        first, last, step = rows.indices(shape[0])
        count = len(range(first, last, step))
        if step != 1 or 4 * count * shape[1] <= DEQUANTIZE_BLOCK_BYTES:
            return dequantize(self._stored(name, rows), qtype)
        out = np.empty((count, shape[1]), np.float32)
        block = max(1, DEQUANTIZE_BLOCK_BYTES // (4 * shape[1]))
        for r0 in range(first, last, block):
            r1 = min(r0 + block, last)
            out[r0 - first : r1 - first] = dequantize(self._stored(name, slice(r0, r1)), qtype)
        return out

    def read_float32(self, name: str) -> np.ndarray:
        values = self._dequantized(name)
        if self._shifted(name):
            # exact for stored values >= 0.5 (Sterbenz; a multiple of the stored value's ulp stays one)
            values -= np.float32(self.spec.norm_shift)
        heads = self._permuted_heads(name)
        return values if heads is None else np.ascontiguousarray(undo_rope_permutation(values, heads))

    def mapped(self, name: str) -> RowTensor:
        if self._permuted_heads(name) is not None or self._shifted(name):
            raise AnelabInputError(f"{name}: a permuted Q/K projection or a shifted norm is read whole, not by rows")
        return RowTensor(self.shape(name), lambda rows: self._dequantized(name, rows))

    def digest(self, name: str) -> str:
        storage = f"gguf {self.storage(name)} {self.spec.model_type}"
        return content_digest(name, storage, self.shape(name), [self._stored(name)])

    def files(self) -> list[str]:
        return [self.path.name]


def _per_expert(names: dict[str, str], by_gguf_name: dict, path: Path) -> tuple[dict, dict]:
    """transformers name -> ReaderTensor, with each stacked expert tensor (``...mlp.experts.gate_proj.weight``
    [E, N, K]) named once per expert (``...mlp.experts.{e}.gate_proj.weight``) -> (entries, expert index)."""
    entries, experts = {}, {}
    for hf, gg in names.items():
        tensor = by_gguf_name[gg]
        stem, dot, part = hf.rpartition(".mlp.experts.")
        if not dot:
            entries[hf] = tensor
            continue
        if len(tensor.shape) != 3:
            raise AnelabInputError(f"{path}: GGUF expert tensor {gg} must be 3-D [E, N, K], got {list(tensor.shape)}")
        for e in range(int(tensor.shape[-1])):  # ggml's ne order: the expert axis is outermost, last
            name = f"{stem}.mlp.experts.{e}.{part}"
            entries[name], experts[name] = tensor, e
    return entries, experts


def open_gguf(path: Path) -> CheckpointSource:
    """A GGUF file: its metadata as transformers' config, its tensors under transformers' names (nothing read yet)."""
    reader = read_gguf(path)
    by_gguf_name = {t.name: t for t in reader.tensors}
    config = config_from_metadata(reader, path, set(by_gguf_name))  # every declared size bounded here
    _, spec = architecture_of(reader, path)
    names = transformers_names(spec, config, set(by_gguf_name), path)
    entries, experts = _per_expert(names, by_gguf_name, path)
    if experts and len({n.rsplit(".experts.", 1)[1].split(".")[0] for n in experts}) != config.get("num_experts"):
        raise AnelabInputError(f"{path}: its stacked expert tensors do not hold expert_count experts; refusing")
    source = GgufSource(
        path=path,
        spec=spec,
        heads=config["num_attention_heads"],
        kv_heads=config["num_key_value_heads"],
        entries=entries,
        experts=experts,
    )
    quantized = any(t.tensor_type.name not in UNQUANTIZED for t in reader.tensors)

    def tokenizer():

        return tokenizer_from_gguf(reader, path)

    return CheckpointSource(config=config, tensors=source, format="gguf", quantized=quantized, tokenizer=tokenizer)
