"""Sidecar export: checkpoint layer -> ``layer_<L>.mlpackage`` (multifunction, one ``h<H>`` per history).

Graph forms (``--graph``): ``dense`` and ``tiled`` export one function ``h<H>`` per history;
``stateful`` exports one function ``c<C>`` per chunk width (plus ``c1`` with ``--decode``) whose K/V
cache is Core ML state. ``--weights`` compresses each function's package (``anelab.quantize``)
before the merge.

Each history is converted on its own (fp16 mlprogram, macOS 15 / iOS 18), then the variants are
merged with ``save_multifunction`` (which stores shared weights once) and the package metadata is
written back (the merge drops ``user_defined_metadata``). Everything happens in a temporary
directory next to the destination; the finished package is renamed into place, so an interrupted
export never leaves a half package at the final path.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from anelab import __version__
from anelab.checkpoint import load_checkpoint
from anelab.errors import AnelabInputError
from anelab.geometry import coverage, validate_chunk_and_histories
from anelab.graph import (SidecarShape, build_dense_program, build_stateful_program, build_tiled_program, coremltools_modules,
                           quiet_coremltools, stateful_function_name, validate_key_tile)
from anelab.quantize import compress_package, validate_weights_mode

FORMAT_VERSION = 1
WEIGHTS_RELATIVE = Path("Data/com.apple.CoreML/weights/weight.bin")
OFF_MAC_REASON = "not verified: the Core ML runtime is unavailable on this machine (needs macOS 15+); run the export on a Mac"

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
                return json.dumps(v, sort_keys=True) if not isinstance(v, list) or not all(isinstance(x, int) for x in v) else ",".join(map(str, v))
            return str(v)

        return {
            META["format"]: str(self.format_version), META["source"]: self.source, META["layer"]: str(self.layer),
            META["geometry"]: json.dumps(self.geometry, sort_keys=True), META["chunk"]: str(self.chunk),
            META["histories"]: ",".join(map(str, self.histories)), META["coverage"]: str(self.coverage),
            META["graph"]: self.graph, META["weights"]: self.weights,
            META["single_function_weight_bytes"]: str(self.single_function_weight_bytes),
            META["selection_folded"]: enc(self.selection_folded),
            META["selection_indexer"]: json.dumps(self.selection_indexer, sort_keys=True),
            META["ane_verified"]: enc(self.ane_verified), META["ane_reason"]: self.ane_reason,
            META["ane_evidence"]: json.dumps(self.ane_evidence, sort_keys=True),
            META["coremltools"]: self.coremltools, META["anelab"]: self.anelab, META["exported_at"]: self.exported_at,
        }

    @classmethod
    def from_strings(cls, meta: dict[str, str], where: str) -> "SidecarMetadata":
        def get(key, parse=str, required=True, default=None):
            raw = meta.get(META[key])
            if raw is None or raw == "":
                if required:
                    raise AnelabInputError(f"{where}: sidecar metadata lacks '{META[key]}'; re-export it with 'anelab export'")
                return default
            try:
                return parse(raw)
            except (ValueError, json.JSONDecodeError):
                raise AnelabInputError(f"{where}: sidecar metadata '{META[key]}' is malformed ({raw[:60]!r}); re-export it") from None

        def boolean(s):
            if s not in ("true", "false"):
                raise ValueError(s)
            return s == "true"

        return cls(
            format_version=get("format", int), source=get("source"), layer=get("layer", int),
            geometry=get("geometry", json.loads), chunk=get("chunk", int),
            histories=get("histories", lambda s: [int(x) for x in s.split(",")]), coverage=get("coverage", int),
            graph=get("graph", required=False, default="dense"), weights=get("weights", required=False, default="fp16"),
            single_function_weight_bytes=get("single_function_weight_bytes", int, required=False, default=0),
            selection_folded=get("selection_folded", boolean), selection_indexer=get("selection_indexer", json.loads, required=False),
            ane_verified=get("ane_verified", boolean), ane_reason=get("ane_reason", required=False, default=""),
            ane_evidence=get("ane_evidence", json.loads, required=False, default={}) or {},
            coremltools=get("coremltools", required=False, default=""), anelab=get("anelab", required=False, default=""),
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
        raise AnelabInputError(f"{pkg}: cannot read the package's model spec ({type(e).__name__}); re-export it") from None
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


def convert_program(prog, dest: Path) -> Path:
    """Convert a MIL program to an fp16 mlprogram for macOS 15 / iOS 18 and save it (no load)."""
    ct, _, _ = coremltools_modules()
    with quiet_coremltools():
        model = ct.convert(
            prog, convert_to="mlprogram", minimum_deployment_target=ct.target.macOS15,
            compute_precision=ct.precision.FLOAT16, skip_model_load=True,
        )
        model.save(str(dest))
    return dest


def merge_functions(variants: dict[str, Path], dest: Path, default: str) -> Path:
    """Merge single-function packages into one multifunction package (weights stored once)."""
    ct, _, _ = coremltools_modules()
    desc = ct.utils.MultiFunctionDescriptor()
    for name, path in variants.items():
        desc.add_function(str(path), src_function_name="main", target_function_name=name)
    desc.default_function_name = default
    with quiet_coremltools():
        ct.utils.save_multifunction(desc, str(dest))
    return dest


def _replace_dir(src: Path, dest: Path) -> None:
    """Move a finished package into place; an existing package is swapped out, then removed."""
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.replace(dest, old)
        os.replace(src, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dest)


def validate_graph_options(graph: str, key_tile: int | None, weights_mode: str, chunk: int, geometry, *,
                           capacity: int | None = None, decode: bool = False) -> int | None:
    """Check --graph / --tile / --capacity / --decode / --weights together; return the key tile
    (tiled graph) or None."""
    if chunk <= 0:
        raise AnelabInputError(f"--chunk must be a positive integer, got {chunk}")
    if graph not in GRAPHS:
        raise AnelabInputError(f"unknown --graph {graph!r}; supported: {', '.join(GRAPHS)}")
    if graph == "tiled":
        key_tile = validate_key_tile(chunk if key_tile is None else key_tile, chunk)
    elif key_tile is not None:
        raise AnelabInputError("--tile applies to --graph tiled only; drop --tile or add --graph tiled")
    if graph != "stateful" and (capacity is not None or decode):
        raise AnelabInputError("--capacity / --decode apply to --graph stateful only; drop them or add --graph stateful")
    validate_weights_mode(weights_mode, geometry)
    return key_tile


def validate_state_capacity(capacity: int | None, chunk: int, histories: list[int] | None) -> int:
    """The stateful graph's cache slots: given, or the coverage of ``histories``; never smaller than
    that coverage, a multiple of the chunk, at most MAX_STATE_CAPACITY."""
    if chunk <= 0:
        raise AnelabInputError(f"--chunk must be a positive integer, got {chunk}")
    cover = coverage(validate_chunk_and_histories(chunk, list(histories)), chunk) if histories else None
    if capacity is None:
        if cover is None:
            raise AnelabInputError("--graph stateful needs --capacity N (cache slots per state) or --histories to derive it")
        capacity = cover
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise AnelabInputError(f"--capacity must be a positive integer, got {capacity!r}")
    if cover is not None and capacity < cover:
        raise AnelabInputError(f"state capacity {capacity} is smaller than the coverage {cover}; use --capacity {cover} or more")
    if capacity % chunk:
        raise AnelabInputError(f"state capacity {capacity} is not a multiple of the chunk {chunk}; use --capacity {-(-capacity // chunk) * chunk}")
    if capacity > MAX_STATE_CAPACITY:
        raise AnelabInputError(f"state capacity {capacity} exceeds {MAX_STATE_CAPACITY} (Core ML casts RoPE positions to int16); use a smaller --capacity")
    return capacity


def selection_indexer_metadata(selection: dict, graph: str) -> dict:
    """Validate a sparse indexer's parameters and return what the package records about it."""
    from anelab.masks import dense_exact_window

    try:
        kept, ratio = int(selection["kept_blocks"]), int(selection["compress_ratio"])
    except (KeyError, TypeError, ValueError):
        raise AnelabInputError("a sparse indexer needs both --selection-kept-blocks and --selection-compress-ratio") from None
    if kept <= 0 or ratio <= 0:
        raise AnelabInputError(f"--selection-kept-blocks and --selection-compress-ratio must be positive, got {kept} and {ratio}")
    if graph == "stateful":
        raise AnelabInputError("the selection contract is supported for --graph dense or tiled; drop --graph stateful")
    return {"kept_blocks": kept, "compress_ratio": ratio, "dense_exact_window": dense_exact_window(kept, ratio),
            "masked_value": -30000.0}


@dataclass
class ExportResult:
    package: Path
    metadata: SidecarMetadata
    weight_bytes: int
    functions: list[str] = field(default_factory=list)  # the package's function names (h<H>, or c<C> when stateful)


def export_layer(checkpoint, layer: int, chunk: int, histories: list[int], out_dir: str | os.PathLike, *,
                 graph: str = "dense", key_tile: int | None = None, weights_mode: str = "fp16",
                 capacity: int | None = None, decode: bool = False, selection: dict | None = None,
                 runtime=None, progress=None) -> ExportResult:
    """Export one full-attention layer as ``out_dir/layer_<L>.mlpackage``.

    ``selection``: for a sparse-indexed model, ``{"kept_blocks": K, "compress_ratio": R}`` of its
    indexer. The package then records the contract ``selectionFolded: true`` and the indexer
    parameters: the runtime must fold the indexer's selection into the mask (the graph is the same).

    ``graph``: ``dense`` (scores all keys at once) or ``tiled`` (online softmax over key tiles of
    ``key_tile`` positions, a divisor of the chunk; default: the chunk). ``weights_mode``: see
    ``anelab.quantize`` — each function's package is compressed before the merge.
    ``stateful``: K/V kept as Core ML state of ``capacity`` slots (default: the coverage of
    ``histories``), one function ``c<C>`` (plus ``c1`` with ``decode``) instead of one per history.

    ``runtime``: an ``anelab.coreml_runtime`` implementation for the ANE gate; ``None`` (or an
    unavailable runtime) records ``aneCompileVerified: false`` with the reason.
    """
    key_tile = validate_graph_options(graph, key_tile, weights_mode, chunk, checkpoint.geometry, capacity=capacity, decode=decode)
    weights = checkpoint.layer(layer)
    geometry = checkpoint.geometry
    if graph == "stateful":
        capacity = validate_state_capacity(capacity, chunk, histories)
        histories = list(range(0, capacity, chunk))  # the chunk starts of a prefill that fills the cache
        widths = [chunk] + ([1] if decode and chunk != 1 else [])
        builds = {stateful_function_name(w): (lambda w=w: build_stateful_program(geometry, weights, w, capacity)) for w in widths}
    else:
        histories = validate_chunk_and_histories(chunk, list(histories))
        build = (lambda s: build_tiled_program(geometry, weights, s, key_tile)) if graph == "tiled" else \
            (lambda s: build_dense_program(geometry, weights, s))
        builds = {function_name(h): (lambda h=h: build(SidecarShape(chunk=chunk, history=h))) for h in histories}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dest = out_dir / f"layer_{layer}.mlpackage"
    work = Path(tempfile.mkdtemp(prefix=f".layer_{layer}.", dir=out_dir))
    try:
        variants: dict[str, Path] = {}
        for name, build_program in builds.items():
            path = convert_program(build_program(), work / f"{name}.mlpackage")
            if weights_mode != "fp16":  # before the merge: coremltools cannot compress a multifunction package
                path = compress_package(path, work / f"{name}.{weights_mode}.mlpackage", weights_mode)
            variants[name] = path
            if progress is not None:
                progress.update(1)
        single_bytes = weight_bytes(next(iter(variants.values())))
        evidence, verified, reason = {}, False, OFF_MAC_REASON
        gated = runtime is not None and runtime.available()
        if gated:  # the three-layer ANE gate (macOS): markers + assignment per variant, before the merge
            from anelab import gate

            evidence = gate.check_variants(runtime, variants)
        merged = merge_functions(variants, work / "merged.mlpackage", next(iter(variants)))
        if gated:  # ... then every function of the merged package must load under its name
            gate.check_merged_loads(runtime, merged, list(variants))
            verified, reason = True, gate.VERIFIED_REASON
        meta = SidecarMetadata(
            format_version=FORMAT_VERSION, source=str(checkpoint.path), layer=layer, geometry=geometry.to_dict(),
            chunk=chunk, histories=histories, coverage=coverage(histories, chunk), graph=graph, weights=weights_mode,
            single_function_weight_bytes=single_bytes, selection_folded=selection is not None,
            selection_indexer=selection_indexer_metadata(selection, graph) if selection is not None else None,
            ane_verified=verified, ane_reason=reason, ane_evidence=evidence,
            coremltools=coremltools_modules()[0].__version__, anelab=__version__,
            exported_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        )
        final = work / f"layer_{layer}.mlpackage"
        strings = meta.to_strings()
        if graph == "tiled":
            strings[KEY_TILE_META] = str(key_tile)
        if graph == "stateful":
            strings[STATE_CAPACITY_META] = str(capacity)
            strings[STATE_FUNCTIONS_META] = ",".join(variants)
        write_package_metadata(merged, final, strings)
        _replace_dir(final, dest)
        return ExportResult(package=dest, metadata=meta, weight_bytes=weight_bytes(dest), functions=list(variants))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def export_sidecars(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, chunk: int, histories: list[int],
                    layers: list[int] | None = None, *, graph: str = "dense", key_tile: int | None = None,
                    weights_mode: str = "fp16", capacity: int | None = None, decode: bool = False,
                    selection: dict | None = None, runtime=None) -> list[ExportResult]:
    """Export ``layer_<L>.mlpackage`` for each requested full-attention layer (default: all)."""
    if selection is not None:
        selection_indexer_metadata(selection, graph)
    checkpoint = load_checkpoint(checkpoint_dir)
    validate_graph_options(graph, key_tile, weights_mode, chunk, checkpoint.geometry, capacity=capacity, decode=decode)
    if graph == "stateful":
        validate_state_capacity(capacity, chunk, histories)
        functions = 1 + (1 if decode and chunk != 1 else 0)
    else:
        histories = validate_chunk_and_histories(chunk, list(histories))
        functions = len(histories)
    full = list(checkpoint.geometry.full_attention_layers)
    layers = full if layers is None else list(layers)
    for layer in layers:
        if layer not in full:
            raise AnelabInputError(f"layer {layer} is not a full-attention layer; full-attention layers: {','.join(map(str, full))}")
    results = []
    with tqdm(total=len(layers) * functions, desc="export functions", unit="fn") as bar:
        for layer in layers:
            bar.set_postfix_str(f"layer {layer}")
            results.append(export_layer(checkpoint, layer, chunk, histories, out_dir, graph=graph, key_tile=key_tile,
                                        weights_mode=weights_mode, capacity=capacity, decode=decode,
                                        selection=selection, runtime=runtime, progress=bar))
    return results
