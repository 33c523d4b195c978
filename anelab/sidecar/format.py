"""The sidecar package format: function names, the complete metadata record, reading it back.

Core ML user-defined metadata is str -> str; structured values are JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from anelab.core.errors import AnelabInputError
from anelab.core.files import confined, read_bytes, read_json
from anelab.sidecar.coremltools_import import coremltools_modules, quiet_coremltools, save_model

INPUT_NAMES = ("hidden", "k_history", "v_history", "mask")


OUTPUT_NAMES = ("attn_out", "k_chunk", "v_chunk")


STATE_NAMES = ("k_cache", "v_cache")


def stateful_function_name(chunk: int) -> str:
    return f"c{chunk}"


FORMAT_VERSION = 1


WEIGHTS_RELATIVE = Path("Data/com.apple.CoreML/weights/weight.bin")


# metadata keys (Core ML user-defined metadata is str -> str; structured values are JSON)
META = {
    "format": "anelab.format",
    "source": "anelab.source",
    "layer": "anelab.layer",
    "geometry": "anelab.geometry",
    "chunk": "anelab.chunk",
    "histories": "anelab.histories",
    "coverage": "anelab.coverage",
    "graph": "anelab.graph",
    "weights": "anelab.weights",
    "single_function_weight_bytes": "anelab.singleFunctionWeightBytes",
    "selection_folded": "selectionFolded",
    "selection_indexer": "selectionIndexer",
    "ane_verified": "aneCompileVerified",
    "ane_reason": "aneCompileVerifiedReason",
    "ane_evidence": "aneEvidence",
    "coremltools": "anelab.coremltoolsVersion",
    "anelab": "anelab.version",
    "exported_at": "anelab.exportedAt",
    "source_tensors": "anelab.sourceTensors",
    "source_format": "anelab.sourceFormat",
}


KEY_TILE_META = "anelab.keyTile"  # tiled graph only: key positions per tile


# stateful graph only: cache slots per state, and the function names (c<width>); its ``histories``
# are the chunk starts 0, C, ... of a C-chunked prefill that fills the cache, and coverage = capacity
STATE_CAPACITY_META = "anelab.stateCapacity"


STATE_FUNCTIONS_META = "anelab.stateFunctions"


# the layer's sliding window in tokens (null: full attention). The caller must feed
# masks.causal(C, H, window=W): key j visible from row position p iff 0 <= p - j < W.
SLIDING_WINDOW_META = "slidingWindow"


# stateful-tiled graph only: query rows per tile, and how a mask reaches the function
# ("causal": computed in-graph from the start input; "additive": plus a mask input [C, capacity])
QUERY_TILE_META = "anelab.queryTile"


MASK_MODE_META = "anelab.maskMode"


# stateful-tiled graph, sliding-window layer only: the K/V state is a ring of this many slots
# (position p in slot p mod ringSlots; anelab.sidecar.graphs.stateful_tiled), not one slot per position
RING_SLOTS_META = "anelab.ringSlots"


# a non-attention block's package only (the mlp and gdn-proj designs): the block kind it computes
# (anelab.checkpoints.blocks: mlp, gdn); one chunk-shaped function c<C>, no history. Absent: an attention block.
BLOCK_META = "anelab.block"


# Core AI assets only (sidecar.coreai.asset): a JSON record of the Neural Engine rules the lowering
# followed or not, the mask's drop value and the weights-once bytes
COREAI_META = "anelab.coreai"


# coremltools' int16 pass casts the stateful graph's RoPE gather positions to int16: positions must stay < 2**15
MAX_STATE_CAPACITY = 2**15


def function_name(history: int) -> str:
    return f"h{history}"


def history_of(function: str) -> int:
    if not (function.startswith("h") and function[1:].isdigit()):
        raise AnelabInputError(f"function name {function!r} is not of the form h<history>")
    return int(function[1:])


@dataclass
class SidecarMetadata:
    """Everything a sidecar package records about itself (its user-defined metadata, parsed).

    ``histories`` are the chunk starts its functions serve: one ``h<H>`` function each for the dense
    and tiled graphs; for the stateful graph the starts 0, C, ... of a prefill that fills the cache,
    whose functions are ``state_functions`` (``c<C>``, and ``c1`` for decode) over ``state_capacity``
    cache slots. ``key_tile``: key positions per tile of the tiled graph, or cache slots per tile of
    the stateful-tiled graph (whose ``query_tile`` and ``mask_mode`` are recorded too, and for a
    sliding-window layer the ``ring_slots`` its state holds; ``state_capacity`` is then the positions
    the package serves, not its cache slots).
    ``sliding_window``: the layer's window W in tokens (None: full attention) — the mask a caller
    feeds must be ``masks.causal(..., window=W)``. ``geometry`` carries the block's options, including
    what the caller applies to attn_out before the residual add (``after_o_proj``) and which rows it
    feeds (``input_rows``: post-input-norm rows, or the raw residual stream for OLMo 2).
    ``source``: the checkpoint's absolute path at export; ``source_tensors``: tensor name -> digest of
    every attention tensor of the layer (``Checkpoint.attention_digests``), which identifies the
    checkpoint by content (None: exported before digests were recorded). ``source_format``: the checkpoint's
    format and storage (``Checkpoint.source_record``: safetensors / gguf / mlx, the layer's attention storage
    and, from a quantized source, that the sidecar holds the dequantized projections; None: not recorded).
    """

    format_version: int
    source: str
    layer: int
    geometry: dict
    chunk: int
    histories: list[int]
    coverage: int
    graph: str | None = None  # the design (anelab.sidecar.designs); None: recorded before the key existed
    weights: str = "fp16"
    single_function_weight_bytes: int = 0
    selection_folded: bool = False
    selection_indexer: dict | None = None
    ane_verified: bool = False
    ane_reason: str = ""
    ane_evidence: dict = field(default_factory=dict)
    coremltools: str = ""
    anelab: str = ""
    exported_at: str = ""
    key_tile: int | None = None
    state_capacity: int | None = None
    state_functions: list[str] | None = None
    sliding_window: int | None = None
    query_tile: int | None = None
    mask_mode: str | None = None
    ring_slots: int | None = None
    source_tensors: dict[str, str] | None = None
    source_format: dict | None = None
    block: str | None = None  # a non-attention block's kind (BLOCK_META); None: attention

    @property
    def functions(self) -> list[str]:
        """The package's function names, in the order they were merged: a stateful design's recorded
        ``state_functions``, a block's one ``c<C>``, else one ``h<H>`` per history."""
        if self.state_functions:
            return list(self.state_functions)
        if self.block is not None:
            return [stateful_function_name(self.chunk)]
        return [function_name(h) for h in self.histories]

    def to_strings(self) -> dict[str, str]:
        out = {}
        for name, (key, kind, _required) in _FIELDS.items():
            value = getattr(self, name)
            if value is None and kind not in ("json",):
                continue
            out[key] = _ENCODE[kind](value)
        return out

    @classmethod
    def from_strings(cls, meta: dict[str, str], where: str) -> SidecarMetadata:
        values = {}
        for name, (key, kind, required) in _FIELDS.items():
            raw = meta.get(key)
            if raw is None or raw == "":
                if required:
                    raise AnelabInputError(
                        f"{where}: sidecar metadata lacks '{key}'; re-export it with 'anelab export'"
                    )
                continue
            try:
                values[name] = _DECODE[kind](raw)
            except (ValueError, json.JSONDecodeError, RecursionError):
                raise AnelabInputError(
                    f"{where}: sidecar metadata '{key}' is malformed ({raw[:60]!r}); re-export it"
                ) from None
        meta_obj = cls(**values)
        if meta_obj.ane_evidence is None:
            meta_obj.ane_evidence = {}
        meta_obj.check(where)
        return meta_obj

    def check(self, where: str) -> None:
        """Refuse (one line) recorded values this anelab cannot read or that no export writes: another
        format version, a non-positive chunk or coverage, a negative history or layer, structured values of
        the wrong shape (the metadata of a tampered or foreign package)."""
        if self.format_version != FORMAT_VERSION:
            raise AnelabInputError(
                f"{where}: sidecar format {self.format_version}; this anelab reads format {FORMAT_VERSION} — "
                "re-export the package with this anelab"
            )
        for name in ("chunk", "coverage"):
            if getattr(self, name) < 1:
                raise AnelabInputError(
                    f"{where}: sidecar metadata '{META[name]}' is {getattr(self, name)}; re-export it"
                )
        if self.layer < 0 or any(h < 0 for h in self.histories) or not self.histories:
            raise AnelabInputError(f"{where}: sidecar metadata records a negative layer or history; re-export it")
        for name in ("key_tile", "state_capacity", "query_tile", "ring_slots", "sliding_window"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise AnelabInputError(f"{where}: sidecar metadata {name} is {str(value)[:40]!r}; re-export it")
        shapes = {"geometry": dict, "selection_indexer": (dict, type(None)), "ane_evidence": dict,
                  "source_tensors": (dict, type(None))}  # fmt: skip
        for name, kind in shapes.items():
            if not isinstance(getattr(self, name), kind):
                raise AnelabInputError(f"{where}: sidecar metadata {name} is not a JSON object; re-export it")
        if self.source_tensors and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.source_tensors.items()
        ):
            raise AnelabInputError(f"{where}: sidecar metadata '{META['source_tensors']}' is not tensor name -> digest")


def _boolean(text: str) -> bool:
    if text not in ("true", "false"):
        raise ValueError(text)
    return text == "true"


_ENCODE = {
    "str": str,
    "int": str,
    "bool": lambda v: "true" if v else "false",
    "json": lambda v: json.dumps(v, sort_keys=True),
    "ints": lambda v: ",".join(map(str, v)),
    "names": lambda v: ",".join(v),
}
_DECODE = {
    "str": str,
    "int": int,
    "bool": _boolean,
    "json": json.loads,
    "ints": lambda s: [int(x) for x in s.split(",")],
    "names": lambda s: s.split(","),
}
# SidecarMetadata field -> (metadata key, encoding, required when reading)
_FIELDS = {
    "format_version": (META["format"], "int", True),
    "source": (META["source"], "str", True),
    "layer": (META["layer"], "int", True),
    "geometry": (META["geometry"], "json", True),
    "chunk": (META["chunk"], "int", True),
    "histories": (META["histories"], "ints", True),
    "coverage": (META["coverage"], "int", True),
    "graph": (META["graph"], "str", False),
    "weights": (META["weights"], "str", False),
    "single_function_weight_bytes": (META["single_function_weight_bytes"], "int", False),
    "selection_folded": (META["selection_folded"], "bool", True),
    "selection_indexer": (META["selection_indexer"], "json", False),
    "ane_verified": (META["ane_verified"], "bool", True),
    "ane_reason": (META["ane_reason"], "str", False),
    "ane_evidence": (META["ane_evidence"], "json", False),
    "coremltools": (META["coremltools"], "str", False),
    "anelab": (META["anelab"], "str", False),
    "exported_at": (META["exported_at"], "str", False),
    "key_tile": (KEY_TILE_META, "int", False),
    "state_capacity": (STATE_CAPACITY_META, "int", False),
    "state_functions": (STATE_FUNCTIONS_META, "names", False),
    "sliding_window": (SLIDING_WINDOW_META, "json", False),
    "query_tile": (QUERY_TILE_META, "int", False),
    "mask_mode": (MASK_MODE_META, "str", False),
    "ring_slots": (RING_SLOTS_META, "int", False),
    "source_tensors": (META["source_tensors"], "json", False),
    "source_format": (META["source_format"], "json", False),
    "block": (BLOCK_META, "str", False),
}


def require_package(path: str | os.PathLike) -> Path:
    """Refuse a path that is not a saved .mlpackage directory."""
    path = Path(path)
    if not path.exists():
        raise AnelabInputError(f"{path}: no such package; give the path of a .mlpackage written by 'anelab export'")
    if not path.is_dir() or not (path / "Manifest.json").is_file():
        raise AnelabInputError(f"{path}: not an .mlpackage (no Manifest.json); give the path of a .mlpackage directory")
    if not path.name.endswith(".mlpackage"):
        raise AnelabInputError(
            f"{path}: the name does not end in .mlpackage, and Core ML compiles nothing else (coremltools 9.0 "
            f"utils.py:1098-1100); rename the directory to <name>.mlpackage"
        )
    return path


MAX_MANIFEST_BYTES = 2**20  # a package's Manifest.json lists a handful of items
MAX_SPEC_BYTES = 2**31  # model.mlmodel: a program's text and its small consts (the weights are in weight.bin)


def load_package_spec(pkg: str | os.PathLike):
    """The package's model spec (``Model_pb2.Model``), read without writing anything: coremltools'
    ``load_spec`` opens a ``ModelPackage``, which rewrites Manifest.json in place; here Manifest.json is read
    as JSON, its root model item must lie inside the package's ``Data/`` folder, and the spec is parsed.
    A malformed manifest or spec is refused in one line."""
    pkg = require_package(pkg)
    manifest = read_json(pkg / "Manifest.json", "package Manifest.json", MAX_MANIFEST_BYTES)
    try:
        entry = manifest["itemInfoEntries"][manifest["rootModelIdentifier"]]
        relative = entry["path"]
    except (KeyError, TypeError):
        relative = None
    if not isinstance(relative, str) or not relative:
        raise AnelabInputError(f"{pkg}: its Manifest.json names no root model; re-export the package")
    spec_path = confined(pkg / "Data" / relative, pkg / "Data", f"{pkg}'s Manifest.json root model")
    data = read_bytes(spec_path, "package model spec", MAX_SPEC_BYTES)
    _, _, _ = coremltools_modules()
    from coremltools.proto import Model_pb2
    from google.protobuf.message import DecodeError

    spec = Model_pb2.Model()
    try:
        spec.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError):
        raise AnelabInputError(
            f"{pkg}: its model spec does not parse (a corrupt model.mlmodel); re-export it"
        ) from None
    return spec


def read_raw_metadata(pkg: str | os.PathLike) -> dict[str, str]:
    """The package's user-defined metadata (str -> str), read without writing anything."""
    return dict(load_package_spec(pkg).description.metadata.userDefined)


def read_sidecar_metadata(pkg: str | os.PathLike) -> SidecarMetadata:
    """Parse a sidecar package's metadata; refuse a missing or malformed one (one line)."""
    return SidecarMetadata.from_strings(read_raw_metadata(pkg), str(pkg))


def write_package_metadata(pkg: Path, dest: Path, meta: dict[str, str]) -> None:
    """Re-open ``pkg`` without loading it, set its user-defined metadata, save it at ``dest``."""
    ct, _, _ = coremltools_modules()
    with quiet_coremltools():
        model = ct.models.MLModel(str(pkg), skip_model_load=True)
        model.user_defined_metadata.update(meta)
        save_model(model, dest)


def weight_bytes(pkg: str | os.PathLike) -> int:
    path = Path(pkg) / WEIGHTS_RELATIVE
    return path.stat().st_size if path.exists() else 0


def package_content_hash(pkg: str | os.PathLike) -> str:
    """SHA-256 over a package's files (relative path and bytes, in sorted order): what a compile cache, a shared
    evidence entry and a sealed verification are keyed on."""
    root = Path(pkg)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
