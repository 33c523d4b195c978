"""Sidecar export: checkpoint layer -> ``layer_<L>.mlpackage`` (multifunction), written atomically.

Each function is converted on its own (fp16 mlprogram, macOS 15 / iOS 18), optionally compressed,
then the variants are merged with ``save_multifunction`` (shared weights stored once) and the
metadata is written back (the merge drops it). The ANE gate is injected by the caller (a
``runtime`` layer object), never imported here.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tqdm.auto import tqdm

from anelab import __version__
from anelab.errors import AnelabInputError
from anelab.geometry import AttentionGeometry, chunk_starts, coverage, validate_chunk_and_histories
from anelab.hf.checkpoint import load_checkpoint
from anelab.masks import MASKED
from anelab.sidecar.coremltools_import import coremltools_modules, quiet_coremltools
from anelab.sidecar.format import (
    FORMAT_VERSION,
    GRAPHS,
    MAX_STATE_CAPACITY,
    STATEFUL_GRAPHS,
    SidecarMetadata,
    function_name,
    stateful_function_name,
    weight_bytes,
    write_package_metadata,
)
from anelab.sidecar.graphs.common import SidecarShape
from anelab.sidecar.graphs.dense import build_dense_program
from anelab.sidecar.graphs.stateful import build_stateful_program
from anelab.sidecar.graphs.stateful_tiled import (
    MAX_TILED_STATE_CAPACITY,
    build_stateful_tiled_program,
    validate_mask_mode,
    validate_tiles,
)
from anelab.sidecar.graphs.tiled import build_tiled_program, validate_key_tile
from anelab.sidecar.quantize import compress_package, validate_weights_mode
from anelab.weights import AttentionWeights

OFF_MAC_REASON = (
    "not verified: the Core ML runtime is unavailable on this machine (needs macOS 15+); run the export on a Mac"
)


class VariantGate(Protocol):
    """What the exporter asks of an ANE gate (implemented by ``anelab.runtime.gate.AneGate``)."""

    verified_reason: str

    def check_variants(self, variants: dict[str, Path]) -> dict[str, dict]:
        """Per single-function variant, before the merge: evidence, or raise naming the variant."""

    def check_merged_loads(self, merged: Path, functions: list[str]) -> None:
        """Every function of the merged package loads under its name, or raise."""


def convert_program(prog, dest: Path) -> Path:
    """Convert a MIL program to an fp16 mlprogram for macOS 15 / iOS 18 and save it (no load)."""
    ct, _, _ = coremltools_modules()
    with quiet_coremltools():
        model = ct.convert(
            prog,
            convert_to="mlprogram",
            minimum_deployment_target=ct.target.macOS15,
            compute_precision=ct.precision.FLOAT16,
            skip_model_load=True,
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


def validate_graph_options(
    graph: str,
    key_tile: int | None,
    weights_mode: str,
    chunk: int,
    geometry,
    *,
    capacity: int | None = None,
    decode: bool = False,
) -> int | None:
    """Check --graph / --tile / --capacity / --decode / --weights together; return the key tile
    (tiled graph) or None."""
    if chunk <= 0:
        raise AnelabInputError(f"--chunk must be a positive integer, got {chunk}")
    if graph not in GRAPHS:
        raise AnelabInputError(f"unknown --graph {graph!r}; supported: {', '.join(GRAPHS)}")
    if graph == "tiled":
        key_tile = validate_key_tile(chunk if key_tile is None else key_tile, chunk)
    elif key_tile is not None and graph != "stateful-tiled":
        raise AnelabInputError(
            "--tile applies to --graph tiled only (or stateful-tiled); drop --tile or add --graph tiled"
        )
    if graph not in STATEFUL_GRAPHS and (capacity is not None or decode):
        raise AnelabInputError(
            "--capacity / --decode apply to --graph stateful only; drop them or add --graph stateful"
        )
    validate_weights_mode(weights_mode, geometry)
    return key_tile


def validate_state_capacity(
    capacity: int | None, chunk: int, histories: list[int] | None, *, limit: int = MAX_STATE_CAPACITY
) -> int:
    """The stateful graph's cache slots: given, or the coverage of ``histories``; never smaller than
    that coverage, a multiple of the chunk, at most ``limit`` (MAX_STATE_CAPACITY for --graph
    stateful, whose RoPE positions pass through int16; MAX_TILED_STATE_CAPACITY for stateful-tiled)."""
    if chunk <= 0:
        raise AnelabInputError(f"--chunk must be a positive integer, got {chunk}")
    cover = coverage(validate_chunk_and_histories(chunk, list(histories)), chunk) if histories else None
    if capacity is None:
        if cover is None:
            raise AnelabInputError(
                "--graph stateful needs --capacity N (cache slots per state) or --histories to derive it"
            )
        capacity = cover
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise AnelabInputError(f"--capacity must be a positive integer, got {capacity!r}")
    if cover is not None and capacity < cover:
        raise AnelabInputError(
            f"state capacity {capacity} is smaller than the coverage {cover}; use --capacity {cover} or more"
        )
    if capacity % chunk:
        raise AnelabInputError(
            f"state capacity {capacity} is not a multiple of the chunk {chunk}; use --capacity {-(-capacity // chunk) * chunk}"
        )
    if capacity > limit:
        hint = " or --graph stateful-tiled" if limit == MAX_STATE_CAPACITY else ""
        raise AnelabInputError(
            f"state capacity {capacity} exceeds {limit} (Core ML casts RoPE gather indices to int16); "
            f"use a smaller --capacity{hint}"
        )
    return capacity


def selection_from_flags(kept_blocks: int | None, compress_ratio: int | None) -> dict | None:
    """A sparse indexer's parameters from ``--selection-kept-blocks`` / ``--selection-compress-ratio``:
    None when neither is given (a dense model); both are then required (checked on export)."""
    if kept_blocks is None and compress_ratio is None:
        return None
    return {"kept_blocks": kept_blocks, "compress_ratio": compress_ratio}


def _capacity_limit(graph: str) -> int:
    return MAX_TILED_STATE_CAPACITY if graph == "stateful-tiled" else MAX_STATE_CAPACITY


def selection_indexer_metadata(selection: dict, graph: str) -> dict:
    """Validate a sparse indexer's parameters and return what the package records about it."""
    from anelab.masks import dense_exact_window

    try:
        kept, ratio = int(selection["kept_blocks"]), int(selection["compress_ratio"])
    except (KeyError, TypeError, ValueError):
        raise AnelabInputError(
            "a sparse indexer needs both --selection-kept-blocks and --selection-compress-ratio"
        ) from None
    if kept <= 0 or ratio <= 0:
        raise AnelabInputError(
            f"--selection-kept-blocks and --selection-compress-ratio must be positive, got {kept} and {ratio}"
        )
    if graph in STATEFUL_GRAPHS:
        raise AnelabInputError(f"the selection contract is supported for --graph dense or tiled; drop --graph {graph}")
    return {
        "kept_blocks": kept,
        "compress_ratio": ratio,
        "dense_exact_window": dense_exact_window(kept, ratio),
        "masked_value": float(MASKED),
    }


@dataclass
class ExportResult:
    package: Path
    metadata: SidecarMetadata
    weight_bytes: int
    functions: list[str] = field(default_factory=list)  # the package's function names (h<H>, or c<C> when stateful)


def export_layer(
    checkpoint,
    layer: int,
    chunk: int,
    histories: list[int],
    out_dir: str | os.PathLike,
    *,
    graph: str = "dense",
    key_tile: int | None = None,
    weights_mode: str = "fp16",
    capacity: int | None = None,
    decode: bool = False,
    selection: dict | None = None,
    gate: VariantGate | None = None,
    progress=None,
    query_tile: int | None = None,
    mask_mode: str = "causal",
) -> ExportResult:
    """Export one full-attention layer as ``out_dir/layer_<L>.mlpackage``.

    ``selection``: for a sparse-indexed model, ``{"kept_blocks": K, "compress_ratio": R}`` of its
    indexer. The package then records the contract ``selectionFolded: true`` and the indexer
    parameters: the runtime must fold the indexer's selection into the mask (the graph is the same).

    ``graph``: ``dense`` (scores all keys at once) or ``tiled`` (online softmax over key tiles of
    ``key_tile`` positions, a divisor of the chunk; default: the chunk). ``weights_mode``: see
    ``anelab.sidecar.quantize`` — each function's package is compressed before the merge.
    ``stateful``: K/V kept as Core ML state of ``capacity`` slots (default: the coverage of
    ``histories``), one function ``c<C>`` (plus ``c1`` with ``decode``) instead of one per history.
    ``stateful-tiled``: the same functions, attention in key tiles of ``key_tile`` cache slots and
    query tiles of ``query_tile`` rows (``anelab.sidecar.graphs.stateful_tiled``); ``mask_mode``
    ``causal`` (in-graph, no mask input) or ``additive`` (plus a mask input [C, capacity]).

    ``gate``: the ANE gate (``anelab.runtime.gate.AneGate`` on a Mac); ``None`` records
    ``aneCompileVerified: false`` with the reason.
    """
    key_tile = validate_graph_options(
        graph, key_tile, weights_mode, chunk, checkpoint.geometry, capacity=capacity, decode=decode
    )
    tiles = None
    if graph in STATEFUL_GRAPHS:
        capacity = validate_state_capacity(capacity, chunk, histories, limit=_capacity_limit(graph))
        histories = chunk_starts(capacity, chunk)  # the chunk starts of a prefill that fills the cache
        if graph == "stateful-tiled":
            tiles = (*validate_tiles(key_tile, query_tile, chunk, capacity), validate_mask_mode(mask_mode))
    else:
        histories = validate_chunk_and_histories(chunk, list(histories))
    builds = function_builds(
        checkpoint.geometry,
        checkpoint.layer(layer),
        graph,
        chunk,
        histories,
        key_tile=key_tile,
        capacity=capacity,
        decode=decode,
        tiles=tiles,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dest = out_dir / f"layer_{layer}.mlpackage"
    work = Path(tempfile.mkdtemp(prefix=f".layer_{layer}.", dir=out_dir))
    try:
        variants = convert_variants(builds, work, weights_mode, progress)
        evidence = gate.check_variants(variants) if gate is not None else {}  # per variant, before the merge
        merged = merge_functions(variants, work / "merged.mlpackage", next(iter(variants)))
        if gate is not None:  # ... then every function of the merged package must load under its name
            gate.check_merged_loads(merged, list(variants))
        meta = package_metadata(
            checkpoint,
            layer,
            chunk,
            histories,
            graph,
            weights_mode,
            variants,
            selection,
            gate,
            evidence,
            key_tile=key_tile,
            capacity=capacity,
            tiles=tiles,
        )
        final = work / f"layer_{layer}.mlpackage"
        write_package_metadata(merged, final, meta.to_strings())
        _replace_dir(final, dest)
        return ExportResult(package=dest, metadata=meta, weight_bytes=weight_bytes(dest), functions=list(variants))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def package_metadata(
    checkpoint,
    layer: int,
    chunk: int,
    histories: list[int],
    graph: str,
    weights_mode: str,
    variants: dict[str, Path],
    selection: dict | None,
    gate: VariantGate | None,
    evidence: dict,
    *,
    key_tile: int | None,
    capacity: int | None,
    tiles: tuple[int, int, str] | None = None,
) -> SidecarMetadata:
    """What the finished package records about itself (``variants``: the converted functions;
    ``tiles``: the stateful-tiled graph's (key tile, query tile, mask mode))."""
    return SidecarMetadata(
        format_version=FORMAT_VERSION,
        source=str(Path(checkpoint.path).resolve()),
        source_tensors=checkpoint.attention_digests(layer),
        layer=layer,
        geometry=checkpoint.geometry.to_dict(),
        chunk=chunk,
        histories=histories,
        coverage=coverage(histories, chunk),
        graph=graph,
        weights=weights_mode,
        single_function_weight_bytes=weight_bytes(next(iter(variants.values()))),
        selection_folded=selection is not None,
        selection_indexer=selection_indexer_metadata(selection, graph) if selection is not None else None,
        ane_verified=gate is not None,
        ane_reason=gate.verified_reason if gate is not None else OFF_MAC_REASON,
        ane_evidence=evidence,
        coremltools=coremltools_modules()[0].__version__,
        anelab=__version__,
        exported_at=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        key_tile=key_tile if graph == "tiled" else (tiles[0] if tiles else None),
        state_capacity=capacity if graph in STATEFUL_GRAPHS else None,
        state_functions=list(variants) if graph in STATEFUL_GRAPHS else None,
        query_tile=tiles[1] if tiles else None,
        mask_mode=tiles[2] if tiles else None,
        sliding_window=checkpoint.geometry.window_of(layer),
    )


def function_builds(
    geometry: AttentionGeometry,
    weights: AttentionWeights,
    graph: str,
    chunk: int,
    histories: list[int],
    *,
    key_tile: int | None,
    capacity: int | None,
    decode: bool,
    tiles: tuple[int, int, str] | None = None,
) -> dict[str, Callable[[], object]]:
    """Function name -> a builder of its MIL program: ``h<H>`` per history (dense, tiled), or
    ``c<C>`` (and ``c1`` with ``decode``) for the stateful graphs. ``tiles``: (key tile, query tile,
    mask mode) of the stateful-tiled graph (the decode function's query tile is 1)."""
    if graph == "stateful-tiled":
        kt, qt, mode = tiles
        widths = [chunk] + ([1] if decode and chunk != 1 else [])
        return {
            stateful_function_name(w): (
                lambda w=w: build_stateful_tiled_program(geometry, weights, w, capacity, kt, min(qt, w), mode)
            )
            for w in widths
        }
    if graph == "stateful":
        widths = [chunk] + ([1] if decode and chunk != 1 else [])
        return {
            stateful_function_name(w): (lambda w=w: build_stateful_program(geometry, weights, w, capacity))
            for w in widths
        }
    cover = coverage(histories, chunk)  # picks a dynamic / longrope RoPE table for the whole package
    if graph == "tiled":
        return {
            function_name(h): (
                lambda h=h: build_tiled_program(geometry, weights, SidecarShape(chunk, h, cover), key_tile)
            )
            for h in histories
        }
    return {
        function_name(h): (lambda h=h: build_dense_program(geometry, weights, SidecarShape(chunk, h, cover)))
        for h in histories
    }


def convert_variants(
    builds: dict[str, Callable[[], object]], work: Path, weights_mode: str, progress=None
) -> dict[str, Path]:
    """Convert (and compress) each function on its own into ``work/<name>.mlpackage``."""
    variants: dict[str, Path] = {}
    for name, build_program in builds.items():
        path = convert_program(build_program(), work / f"{name}.mlpackage")
        if weights_mode != "fp16":  # before the merge: coremltools cannot compress a multifunction package
            path = compress_package(path, work / f"{name}.{weights_mode}.mlpackage", weights_mode)
        variants[name] = path
        if progress is not None:
            progress.update(1)
    return variants


def export_sidecars(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    chunk: int,
    histories: list[int],
    layers: list[int] | None = None,
    *,
    graph: str = "dense",
    key_tile: int | None = None,
    weights_mode: str = "fp16",
    capacity: int | None = None,
    decode: bool = False,
    selection: dict | None = None,
    gate: VariantGate | None = None,
    query_tile: int | None = None,
    mask_mode: str = "causal",
) -> list[ExportResult]:
    """Export ``layer_<L>.mlpackage`` for each requested full-attention layer (default: all)."""
    if histories is None and graph not in STATEFUL_GRAPHS:
        raise AnelabInputError(
            "export: --histories is required (e.g. --histories 0,C,2C); only --graph stateful --capacity N goes without"
        )
    if selection is not None:
        selection_indexer_metadata(selection, graph)
    checkpoint = load_checkpoint(checkpoint_dir)
    validate_graph_options(graph, key_tile, weights_mode, chunk, checkpoint.geometry, capacity=capacity, decode=decode)
    if query_tile is not None and graph != "stateful-tiled":
        raise AnelabInputError(
            "--query-tile applies to --graph stateful-tiled only; drop it or add --graph stateful-tiled"
        )
    if graph in STATEFUL_GRAPHS:
        cap = validate_state_capacity(capacity, chunk, histories, limit=_capacity_limit(graph))
        if graph == "stateful-tiled":
            validate_tiles(key_tile, query_tile, chunk, cap)
            validate_mask_mode(mask_mode)
        functions = 1 + (1 if decode and chunk != 1 else 0)
    else:
        histories = validate_chunk_and_histories(chunk, list(histories))
        functions = len(histories)
    full = list(checkpoint.geometry.full_attention_layers)  # full and sliding-window attention layers
    layers = full if layers is None else list(layers)
    for layer in layers:
        if layer not in full:
            raise AnelabInputError(
                f"layer {layer} is not a full-attention layer nor a sliding-window one (linear attention is not exported); "
                f"attention layers: {','.join(map(str, full))}"
            )
    results = []
    with tqdm(total=len(layers) * functions, desc="export functions", unit="fn") as bar:
        for layer in layers:
            bar.set_postfix_str(f"layer {layer}")
            results.append(
                export_layer(
                    checkpoint,
                    layer,
                    chunk,
                    histories,
                    out_dir,
                    graph=graph,
                    key_tile=key_tile,
                    weights_mode=weights_mode,
                    capacity=capacity,
                    decode=decode,
                    selection=selection,
                    gate=gate,
                    progress=bar,
                    query_tile=query_tile,
                    mask_mode=mask_mode,
                )
            )
    return results
