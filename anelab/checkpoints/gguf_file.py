"""A GGUF file (llama.cpp, Ollama, LM Studio) as a checkpoint: config from its metadata, tensors dequantized, conventions undone.

Read with the ``gguf`` package (llama.cpp's own Python reader; its ``quants`` dequantize every type it
knows in NumPy). ``GGUF_ARCHITECTURES`` says, per ``general.architecture``, which transformers model it is
and which of llama.cpp's conventions are undone (docs/conventions.md §10 cites llama.cpp and transformers):

- tensor names: llama.cpp's (``blk.{L}.attn_q.weight``, ``token_embd.weight``, ...) back to transformers'
  through gguf's own ``TensorNameMap`` (the table llama.cpp's converter writes with);
- ``llama``: the converter permutes the rows of every Q and K projection (weights and biases) for
  llama.cpp's interleaved RoPE (``LlamaModel.permute``); undone per head here (``undo_rope_permutation``).
  ``qwen2`` / ``qwen3`` are written unpermuted (llama.cpp runs them with NeoX RoPE);
- the config: ``{arch}.block_count``, ``embedding_length``, ``attention.head_count(_kv)``,
  ``attention.key_length``, ``rope.freq_base``, ``attention.layer_norm_rms_epsilon``, ... under
  transformers' names (as its GGUF integration maps them), tied embeddings when ``output.weight`` is absent.

Refused in one line (``REFUSED``): other architectures, metadata keys of the architecture that are not
modelled (naming the key), tensors with no transformers name (``rope_freqs.weight``: Llama 3's frequency
factors), routed experts, RoPE scaling other than linear, split or big-endian files.
"""

from __future__ import annotations

import functools
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from anelab.checkpoints.source import CheckpointSource, RowTensor, content_digest
from anelab.core.errors import AnelabInputError

GGUF_MAGIC = b"GGUF"
UNQUANTIZED = ("F32", "F16", "BF16")  # storage types that hold the values themselves


@dataclass(frozen=True)
class GgufArchitecture:
    """What one GGUF ``general.architecture`` is: its transformers ``model_type`` and ``architecture`` class, the
    gguf package's ``MODEL_ARCH`` name (its tensor-name table), and the conventions undone when reading it.

    ``permuted_qk``: llama.cpp's converter permuted the Q/K rows (weights and biases) for its interleaved RoPE;
    ``qk_norm``: the file carries per-head ``attn_q_norm`` / ``attn_k_norm`` (Qwen3).
    """

    model_type: str
    architecture: str
    gguf_arch: str
    permuted_qk: bool = False
    qk_norm: bool = False


GGUF_ARCHITECTURES: dict[str, GgufArchitecture] = {
    "llama": GgufArchitecture("llama", "LlamaForCausalLM", "LLAMA", permuted_qk=True),
    "qwen2": GgufArchitecture("qwen2", "Qwen2ForCausalLM", "QWEN2"),
    "qwen3": GgufArchitecture("qwen3", "Qwen3ForCausalLM", "QWEN3", qk_norm=True),
}

# {arch}.<key> -> transformers config key (transformers integrations/ggml.py GGUF_CONFIG_MAPPING, llama rows)
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# {arch}.<key> read and checked below (head size, rotary dims, scaling), or harmless when zero
_CHECKED_KEYS = (
    "attention.key_length",
    "attention.value_length",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scale_linear",
    "expert_count",
    "expert_used_count",
)
_REQUIRED = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
             "attention.layer_norm_rms_epsilon")  # fmt: skip
LLAMA_CPP_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base when the file names none

REFUSED = (
    f"architectures other than {', '.join(GGUF_ARCHITECTURES)} (their llama.cpp conventions are not modelled)",
    "metadata keys of the architecture anelab does not model (sliding window, soft-caps, ...), named in the refusal",
    "tensors with no transformers name (rope_freqs.weight: Llama 3's RoPE frequency factors)",
    "routed experts (expert_count > 0); RoPE scaling other than linear; partial rotary dimensions",
    "split (llama-gguf-split) or big-endian files",
)


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


def metadata(reader, key: str, default=None):
    """The value of metadata ``key`` (a Python scalar, string or list), or ``default``."""
    found = reader.fields.get(key)
    return default if found is None else found.contents()


def _length(reader, key: str) -> int:
    """The length of metadata ``key``'s value (0 when absent), without decoding a lazily read array."""
    found = reader.fields.get(key)
    if found is None:
        return 0
    return found.count if isinstance(found, LazyArrayField) else len(found.contents())


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


def architecture_of(reader, path: Path) -> tuple[str, GgufArchitecture]:
    arch = metadata(reader, "general.architecture")
    spec = GGUF_ARCHITECTURES.get(arch)
    if spec is None:
        raise AnelabInputError(
            f"{path}: GGUF architecture {arch!r} is not modelled (its llama.cpp conventions are not undone here); "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch, spec


def _int_key(reader, arch: str, key: str, default=None) -> int:
    value = metadata(reader, f"{arch}.{key}", default)
    if isinstance(value, list):
        raise AnelabInputError(f"GGUF {arch}.{key} varies per layer ({value[:4]}...); not modelled")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise AnelabInputError(f"GGUF {arch}.{key} must be a non-negative integer, got {value!r}")
    return int(value)


def _refuse_unmodelled_keys(reader, arch: str) -> None:
    known = set(_CONFIG_KEYS) | set(_CHECKED_KEYS)
    for key in reader.fields:
        if key.startswith(f"{arch}.") and key.removeprefix(f"{arch}.") not in known:
            raise AnelabInputError(
                f"GGUF metadata {key} = {metadata(reader, key)!r} is not modelled by anelab; refusing"
            )
    for key in ("expert_count", "expert_used_count"):
        if _int_key(reader, arch, key, 0):
            raise AnelabInputError(f"GGUF {arch}.{key} > 0: routed experts in a GGUF file are not modelled")


def _float32(value) -> float:
    """A GGUF float32 as the shortest decimal that is the same float32 (1e-05, not 9.999999747378752e-06)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _rope_scaling(reader, arch: str) -> dict | None:
    kind = metadata(reader, f"{arch}.rope.scaling.type", "none")
    linear = metadata(reader, f"{arch}.rope.scale_linear")
    if kind == "linear" or (kind == "none" and linear is not None):
        factor = metadata(reader, f"{arch}.rope.scaling.factor", linear)
        return None if factor in (None, 1.0) else {"rope_type": "linear", "factor": _float32(factor)}
    if kind != "none":
        raise AnelabInputError(f"GGUF {arch}.rope.scaling.type {kind!r} is not modelled (none or linear); refusing")
    return None


def config_from_metadata(reader, path: Path, tensor_names: set[str]) -> dict:
    """transformers' config.json for the file: geometry, RoPE and norm settings from ``{arch}.*`` metadata."""
    arch, spec = architecture_of(reader, path)
    _refuse_unmodelled_keys(reader, arch)
    for key in _REQUIRED:
        if f"{arch}.{key}" not in reader.fields:
            raise AnelabInputError(f"{path}: GGUF metadata {arch}.{key} is missing; the file is incomplete")
    config = {"model_type": spec.model_type, "architectures": [spec.architecture], "hidden_act": "silu"}
    for key, name in _CONFIG_KEYS.items():
        if f"{arch}.{key}" in reader.fields:
            value = metadata(reader, f"{arch}.{key}")
            config[name] = _float32(value) if name in ("rope_theta", "rms_norm_eps") else _int_key(reader, arch, key)
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    config.setdefault("num_key_value_heads", heads)  # llama.cpp: n_head_kv defaults to n_head
    config.setdefault("rope_theta", LLAMA_CPP_ROPE_BASE)
    if "vocab_size" not in config:
        config["vocab_size"] = _length(reader, "tokenizer.ggml.tokens") or None
    head_dim = _int_key(reader, arch, "attention.key_length", hidden // heads if heads else 0)
    if _int_key(reader, arch, "attention.value_length", head_dim) != head_dim:
        raise AnelabInputError(f"{path}: GGUF value_length differs from key_length; not modelled")
    if _int_key(reader, arch, "rope.dimension_count", head_dim) != head_dim:
        raise AnelabInputError(
            f"{path}: GGUF rope.dimension_count < head size (partial rotary) is not modelled for {arch}"
        )
    config["head_dim"] = head_dim
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if (scaling := _rope_scaling(reader, arch)) is not None:
        config["rope_scaling"] = scaling
    for key in ("bos_token_id", "eos_token_id"):
        if (value := metadata(reader, f"tokenizer.ggml.{key}")) is not None:
            config[key] = int(value)
    return config


_LAYER_PARTS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
    "self_attn.k_norm", "input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip


def transformers_names(spec: GgufArchitecture, num_layers: int, gguf_names: set[str], path: Path) -> dict[str, str]:
    """transformers name -> GGUF name of every tensor in the file, through gguf's ``TensorNameMap``; refuses a
    GGUF tensor that has no transformers name (it would be dropped silently)."""
    import gguf

    table = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, spec.gguf_arch), num_layers)
    bases = ["model.embed_tokens", "model.norm", "lm_head"]
    bases += [f"model.layers.{layer}.{part}" for layer in range(num_layers) for part in _LAYER_PARTS]
    names = {}
    for base in bases:
        stem = table.get_name(base)
        for suffix in (".weight", ".bias"):
            if stem is not None and stem + suffix in gguf_names:
                names[base + suffix] = stem + suffix
    unplaced = sorted(gguf_names - set(names.values()))
    if unplaced:
        raise AnelabInputError(
            f"{path}: GGUF tensor {unplaced[0]} has no place in anelab's model of {spec.model_type} "
            f"({len(unplaced)} such tensor{'s' if len(unplaced) > 1 else ''}); refusing rather than dropping it"
        )
    return names


@dataclass
class GgufSource:
    """The tensors of a GGUF file under transformers' names: each dequantized by gguf.quants on read, Q/K rows
    put back in transformers' order where llama.cpp permuted them; bytes read through one memory map whose
    pages are released after each tensor."""

    path: Path
    spec: GgufArchitecture
    heads: int
    kv_heads: int
    entries: dict  # transformers name -> gguf ReaderTensor
    _mapped: mmap.mmap | None = field(default=None, repr=False)

    def names(self):
        return self.entries.keys()

    def shape(self, name: str) -> tuple[int, ...] | None:
        entry = self.entries.get(name)
        return None if entry is None else tuple(int(n) for n in reversed(entry.shape))

    def storage(self, name: str) -> str:
        return self.entries[name].tensor_type.name

    def _stored(self, name: str, rows=slice(None)) -> np.ndarray:
        """The stored bytes of ``name`` as uint8 [*shape[:-1], bytes per row] (the rows asked for), copied out of
        the map; the pages touched are released."""
        import gguf

        entry = self.entries[name]
        if self._mapped is None:
            with open(self.path, "rb") as f:
                self._mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if entry.data_offset + entry.n_bytes > len(self._mapped):
            raise AnelabInputError(f"{self.path}: tensor {entry.name} lies outside the file (truncated download?)")
        shape = gguf.quant_shape_to_byte_shape(self.shape(name), entry.tensor_type)
        stored = np.frombuffer(self._mapped, np.uint8, count=entry.n_bytes, offset=entry.data_offset).reshape(shape)
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

    def read_float32(self, name: str) -> np.ndarray:
        values = dequantize(self._stored(name), self.entries[name].tensor_type)
        heads = self._permuted_heads(name)
        return values if heads is None else np.ascontiguousarray(undo_rope_permutation(values, heads))

    def mapped(self, name: str) -> RowTensor:
        if self._permuted_heads(name) is not None:
            raise AnelabInputError(f"{name}: a permuted Q/K projection is read whole, not by rows")
        qtype = self.entries[name].tensor_type
        return RowTensor(self.shape(name), lambda rows: dequantize(self._stored(name, rows), qtype))

    def digest(self, name: str) -> str:
        storage = f"gguf {self.storage(name)} {self.spec.model_type}"
        return content_digest(name, storage, self.shape(name), [self._stored(name)])

    def files(self) -> list[str]:
        return [self.path.name]


def open_gguf(path: Path) -> CheckpointSource:
    """A GGUF file: its metadata as transformers' config, its tensors under transformers' names (nothing read yet)."""
    reader = read_gguf(path)
    by_gguf_name = {t.name: t for t in reader.tensors}
    config = config_from_metadata(reader, path, set(by_gguf_name))
    _, spec = architecture_of(reader, path)
    names = transformers_names(spec, config["num_hidden_layers"], set(by_gguf_name), path)
    source = GgufSource(
        path=path,
        spec=spec,
        heads=config["num_attention_heads"],
        kv_heads=config["num_key_value_heads"],
        entries={hf: by_gguf_name[gg] for hf, gg in names.items()},
    )
    quantized = any(t.tensor_type.name not in UNQUANTIZED for t in reader.tensors)

    def tokenizer():
        from anelab.checkpoints.tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(reader, path)

    return CheckpointSource(config=config, tensors=source, format="gguf", quantized=quantized, tokenizer=tokenizer)
