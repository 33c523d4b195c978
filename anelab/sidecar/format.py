"""The sidecar package format: function names, the complete metadata record, reading it back.

Core ML user-defined metadata is str -> str; structured values are JSON.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from anelab.errors import AnelabInputError
from anelab.sidecar.coremltools_import import coremltools_modules, quiet_coremltools

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
}


KEY_TILE_META = "anelab.keyTile"  # tiled graph only: key positions per tile


# stateful graph only: cache slots per state, and the function names (c<width>); its ``histories``
# are the chunk starts 0, C, ... of a C-chunked prefill that fills the cache, and coverage = capacity
STATE_CAPACITY_META = "anelab.stateCapacity"


STATE_FUNCTIONS_META = "anelab.stateFunctions"


GRAPHS = ("dense", "tiled", "stateful")


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
    """What a sidecar package records about itself (parsed from its user-defined metadata)."""

    format_version: int
    source: str
    layer: int
    geometry: dict
    chunk: int
    histories: list[int]
    coverage: int
    graph: str = "dense"
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

    @property
    def functions(self) -> list[str]:
        return [function_name(h) for h in self.histories]

    def to_strings(self) -> dict[str, str]:
        def enc(v):
            if isinstance(v, bool):
                return "true" if v else "false"
            if isinstance(v, (dict, list)) or v is None:
                return (
                    json.dumps(v, sort_keys=True)
                    if not isinstance(v, list) or not all(isinstance(x, int) for x in v)
                    else ",".join(map(str, v))
                )
            return str(v)

        return {
            META["format"]: str(self.format_version),
            META["source"]: self.source,
            META["layer"]: str(self.layer),
            META["geometry"]: json.dumps(self.geometry, sort_keys=True),
            META["chunk"]: str(self.chunk),
            META["histories"]: ",".join(map(str, self.histories)),
            META["coverage"]: str(self.coverage),
            META["graph"]: self.graph,
            META["weights"]: self.weights,
            META["single_function_weight_bytes"]: str(self.single_function_weight_bytes),
            META["selection_folded"]: enc(self.selection_folded),
            META["selection_indexer"]: json.dumps(self.selection_indexer, sort_keys=True),
            META["ane_verified"]: enc(self.ane_verified),
            META["ane_reason"]: self.ane_reason,
            META["ane_evidence"]: json.dumps(self.ane_evidence, sort_keys=True),
            META["coremltools"]: self.coremltools,
            META["anelab"]: self.anelab,
            META["exported_at"]: self.exported_at,
        }

    @classmethod
    def from_strings(cls, meta: dict[str, str], where: str) -> SidecarMetadata:
        def get(key, parse=str, required=True, default=None):
            raw = meta.get(META[key])
            if raw is None or raw == "":
                if required:
                    raise AnelabInputError(
                        f"{where}: sidecar metadata lacks '{META[key]}'; re-export it with 'anelab export'"
                    )
                return default
            try:
                return parse(raw)
            except (ValueError, json.JSONDecodeError):
                raise AnelabInputError(
                    f"{where}: sidecar metadata '{META[key]}' is malformed ({raw[:60]!r}); re-export it"
                ) from None

        def boolean(s):
            if s not in ("true", "false"):
                raise ValueError(s)
            return s == "true"

        return cls(
            format_version=get("format", int),
            source=get("source"),
            layer=get("layer", int),
            geometry=get("geometry", json.loads),
            chunk=get("chunk", int),
            histories=get("histories", lambda s: [int(x) for x in s.split(",")]),
            coverage=get("coverage", int),
            graph=get("graph", required=False, default="dense"),
            weights=get("weights", required=False, default="fp16"),
            single_function_weight_bytes=get("single_function_weight_bytes", int, required=False, default=0),
            selection_folded=get("selection_folded", boolean),
            selection_indexer=get("selection_indexer", json.loads, required=False),
            ane_verified=get("ane_verified", boolean),
            ane_reason=get("ane_reason", required=False, default=""),
            ane_evidence=get("ane_evidence", json.loads, required=False, default={}) or {},
            coremltools=get("coremltools", required=False, default=""),
            anelab=get("anelab", required=False, default=""),
            exported_at=get("exported_at", required=False, default=""),
        )


def require_package(path: str | os.PathLike) -> Path:
    """Refuse a path that is not a saved .mlpackage directory."""
    path = Path(path)
    if not path.exists():
        raise AnelabInputError(f"{path}: no such package; give the path of a .mlpackage written by 'anelab export'")
    if not path.is_dir() or not (path / "Manifest.json").is_file():
        raise AnelabInputError(f"{path}: not an .mlpackage (no Manifest.json); give the path of a .mlpackage directory")
    return path


def read_raw_metadata(pkg: str | os.PathLike) -> dict[str, str]:
    ct, _, _ = coremltools_modules()
    pkg = require_package(pkg)
    try:
        spec = ct.utils.load_spec(str(pkg))
    except Exception as e:  # corrupt protobuf etc.
        raise AnelabInputError(
            f"{pkg}: cannot read the package's model spec ({type(e).__name__}); re-export it"
        ) from None
    return dict(spec.description.metadata.userDefined)


def read_sidecar_metadata(pkg: str | os.PathLike) -> SidecarMetadata:
    """Parse a sidecar package's metadata; refuse a missing or malformed one (one line)."""
    return SidecarMetadata.from_strings(read_raw_metadata(pkg), str(pkg))


def write_package_metadata(pkg: Path, dest: Path, meta: dict[str, str]) -> None:
    """Re-open ``pkg`` without loading it, set its user-defined metadata, save it at ``dest``."""
    ct, _, _ = coremltools_modules()
    with quiet_coremltools():
        model = ct.models.MLModel(str(pkg), skip_model_load=True)
        model.user_defined_metadata.update(meta)
        model.save(str(dest))


def weight_bytes(pkg: str | os.PathLike) -> int:
    path = Path(pkg) / WEIGHTS_RELATIVE
    return path.stat().st_size if path.exists() else 0
