"""Sidecar export: checkpoint layer -> ``layer_<L>.mlpackage`` (multifunction), written atomically.

Each function is converted on its own (fp16 mlprogram, macOS 15 / iOS 18), optionally compressed,
then the variants are merged with ``save_multifunction`` (shared weights stored once) and the
metadata is written back (the merge drops it). The ANE gate is injected by the caller (a
``runtime`` layer object), never imported here.
"""

from __future__ import annotations

import datetime as _dt
import functools
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from anelab import __version__
from anelab.checkpoints.checkpoint import Checkpoint, load_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.core.fp16 import FP16_MAX
from anelab.core.geometry import AttentionGeometry
from anelab.core.parallel import default_jobs, process_map, threads_per_run
from anelab.core.progress import tqdm
from anelab.core.termination import raise_if_terminated
from anelab.core.weights import AttentionWeights
from anelab.sidecar.backends import DEFAULT_BACKEND, get_backend
from anelab.sidecar.coremltools_import import (
    coremltools_modules,
    fast_conversions,
    quiet_coremltools,
    save_model,
)
from anelab.sidecar.designs import (
    DEFAULT_DESIGN,
    Design,
    SidecarOptions,
    SidecarRequest,
    get_design,
)
from anelab.sidecar.format import FORMAT_VERSION, SidecarMetadata, weight_bytes
from anelab.sidecar.function_cache import converted_function
from anelab.sidecar.out_dir import exporting, replace_directory
from anelab.sidecar.quantize import compress_package

OFF_MAC_REASON = (
    "not verified: the Core ML runtime is unavailable on this machine (needs macOS 15+); run the export on a Mac"
)
UNGATED_ON_MAC_REASON = (
    "not verified: exported without the ANE gate (this caller ran none); export it with 'anelab export', which "
    "gates it where the Core ML runtime is available ('anelab doctor' says whether it is)"
)


def ungated_reason() -> str:
    """Why a package exported without a gate is not verified: off a Mac the runtime is missing; on a Mac the caller
    simply ran no gate (saying "unavailable on this machine" there would be false)."""
    return UNGATED_ON_MAC_REASON if sys.platform == "darwin" else OFF_MAC_REASON


class VariantGate(Protocol):
    """What the exporter asks of an ANE gate (implemented by ``anelab.runtimes.coreml.gate.AneGate``)."""

    verified_reason: str

    def check_variants(self, variants: dict[str, Path]) -> dict[str, dict]:
        """Per single-function variant, before the merge: evidence, or raise naming the variant."""

    def check_merged_loads(self, merged: Path, functions: list[str]) -> None:
        """Every function of the merged package loads under its name, or raise."""


def convert_program(prog, dest: Path) -> Path:
    """Convert a MIL program to an fp16 mlprogram for macOS 15 / iOS 18 and save it (no load).

    coremltools' whole default pass pipeline runs: a pipeline cut to the passes that changed the sidecars
    tried here (10 of 95, 1.4x faster) missed ``merge_consecutive_reshapes``, which only a stateful-tiled
    graph with query tiles narrower than its chunk needs. The pipeline shapes the graph the ANE gets,
    so it is not trimmed on evidence from the shapes tried; the program is validated after its cleanups
    rather than after every pass (``fast_conversions``: the same package, a third less CPU)."""
    ct, _, _ = coremltools_modules()
    with quiet_coremltools(), fast_conversions():
        model = ct.convert(
            prog,
            convert_to="mlprogram",
            minimum_deployment_target=ct.target.macOS15,
            compute_precision=ct.precision.FLOAT16,
            skip_model_load=True,
        )
        save_model(model, dest)
    return dest


def merge_functions(
    variants: dict[str, Path], dest: Path, default: str, metadata: dict[str, str] | None = None
) -> Path:
    """Merge single-function packages into one multifunction package at ``dest`` (weights stored once),
    with ``metadata`` as its user-defined metadata.

    What ``ct.utils.save_multifunction`` does (a test compares the packages byte for byte), minus its
    cost: it reloads each function, matches constants across functions with ``np.allclose`` and converts
    the merged program through the whole default pipeline with every pass skipped — yet validated after
    each of the 95. Here constants are matched by exact value and the merged program goes through no
    main pipeline; the metadata is written in the same save (``save_multifunction`` drops it).
    """
    ct, _, _ = coremltools_modules()
    from coremltools import _SPECIFICATION_VERSION_IOS_18, proto
    from coremltools.converters.mil.converter import mil_convert
    from coremltools.converters.mil.frontend.milproto import load as milproto_load
    from coremltools.converters.mil.mil import Program

    merged, functions, version = Program(), [], _SPECIFICATION_VERSION_IOS_18
    with quiet_coremltools(), fast_conversions():
        for name, path in variants.items():
            spec = ct.utils.load_spec(str(path))
            version = max(version, spec.specificationVersion)
            weights_dir = str(path / "Data" / "com.apple.CoreML" / "weights")
            merged.add_function(name, milproto_load.load(spec, version, weights_dir).functions["main"])
            d = spec.description
            functions.append(
                proto.Model_pb2.FunctionDescription(name=name, input=d.input, output=d.output, state=d.state)
            )
        share_identical_constants(merged)
        merged.default_function_name = default
        merged.skip_all_passes = merged.export_as_multifunction = True
        model = mil_convert(
            merged,
            convert_from="milinternal",
            convert_to="mlprogram",
            compute_units=ct.ComputeUnit.CPU_ONLY,
            specification_version=version,
            model_description=proto.Model_pb2.ModelDescription(functions=functions, defaultFunctionName=default),
            skip_model_load=True,
            main_pipeline=ct.PassPipeline.EMPTY,
        )
        model.user_defined_metadata.update(metadata or {})
        save_model(model, dest)
    return dest


def share_identical_constants(program) -> None:
    """Give every group of equal constants across the functions of ``program`` one weight id, so that the
    saved package stores their value once (coremltools' cross-function const deduplication, with equal
    meaning bit-equal rather than ``np.allclose``)."""
    import hashlib

    groups: dict[tuple, list[list]] = {}
    for function in program.functions.values():
        for op in function.operations:
            value = op.outputs[0].val if op.op_type == "const" else None
            if not isinstance(value, np.ndarray) or value.size < 1:
                continue
            head = hashlib.sha1(np.ascontiguousarray(value.reshape(-1)[:100])).hexdigest()
            candidates = groups.setdefault((op.outputs[0].dtype, value.shape, head), [])
            same = next((group for group in candidates if np.array_equal(group[0].outputs[0].val, value)), None)
            if same is None:
                candidates.append([op])
            else:
                same.append(op)
    shared = [group for candidates in groups.values() for group in candidates if len(group) > 1]
    for index, group in enumerate(shared):
        for op in group:
            op.weight_id = str(index)


def sidecar_options(
    graph: str | None,
    geometry: AttentionGeometry,
    chunk: int,
    histories: list[int] | None,
    *,
    weights_mode: str = "fp16",
    **options,
) -> tuple[Design, SidecarOptions]:
    """The design called ``graph`` (None: the default, dense) and one export's options validated against
    it (one-line refusals): ``SidecarRequest.options_for`` with the options as keywords (key_tile,
    query_tile, capacity, decode, mask_mode, selection)."""
    request = SidecarRequest(chunk, histories, graph or DEFAULT_DESIGN, weights=weights_mode, **options)
    return request.options_for(geometry)


def selection_from_flags(kept_blocks: int | None, compress_ratio: int | None) -> dict | None:
    """A sparse indexer's parameters from ``--selection-kept-blocks`` / ``--selection-compress-ratio``:
    None when neither is given (a dense model); both are then required (checked on export)."""
    if kept_blocks is None and compress_ratio is None:
        return None
    return {"kept_blocks": kept_blocks, "compress_ratio": compress_ratio}


@dataclass
class ExportResult:
    package: Path
    metadata: SidecarMetadata
    weight_bytes: int
    functions: list[str] = field(default_factory=list)  # the package's function names (h<H>, or c<C> when stateful)

    @property
    def window_note(self) -> str | None:
        """For a sliding-window layer: what its functions cost and why (None for full attention)."""
        return window_note(self.metadata)


def window_note(meta: SidecarMetadata) -> str | None:
    """Per windowed layer, why its package has the functions it has (None for a full-attention layer)."""
    w, layer = meta.sliding_window, meta.layer
    if w is None:
        return None
    if meta.ring_slots is not None:
        return f"layer {layer} slides over {w} tokens: one function per chunk width over a ring of {meta.ring_slots} cache slots"
    if meta.state_functions:
        return (
            f"layer {layer} slides over {w} tokens, but its state and mask span all {meta.state_capacity} positions "
            "(the window is only in the mask); --graph stateful-tiled keeps a ring of about W + C slots"
        )
    return (
        f"layer {layer} slides over {w} tokens, but needs one function per history ({len(meta.histories)}) as a full "
        "layer does: each h<H> has its RoPE positions built in (no position input); --graph stateful-tiled serves "
        "it with one function"
    )


def export_layer(
    checkpoint,
    layer: int,
    chunk: int,
    histories: list[int] | None,
    out_dir: str | os.PathLike,
    *,
    graph: str | None = DEFAULT_DESIGN,
    gate: VariantGate | None = None,
    progress=None,
    backend: str = DEFAULT_BACKEND,
    **options,
) -> ExportResult:
    """Export one attention layer as ``out_dir/layer_<L>.mlpackage``.

    ``graph``: the design (``anelab.sidecar.designs``: dense, tiled, stateful, stateful-tiled);
    ``options``: its options as ``sidecar_options`` takes them (key_tile, query_tile, capacity, decode,
    mask_mode, weights_mode, selection), validated by the design before anything is built. With
    ``selection`` = ``{"kept_blocks": K, "compress_ratio": R}`` (a sparse-indexed model) the package
    records the contract ``selectionFolded: true``: the runtime folds the selection into the mask.
    ``weights_mode`` (``anelab.sidecar.quantize``): each function's package is compressed before the merge.

    ``gate``: the ANE gate (``anelab.runtimes.coreml.gate.AneGate`` on a Mac); ``None`` records
    ``aneCompileVerified: false`` with the reason.
    """
    design, opts = sidecar_options(graph, checkpoint.geometry, chunk, histories, **options)
    get_backend(backend).check_options(opts.weights, opts.chunk, opts.capacity)
    return export_design(checkpoint, layer, design, opts, out_dir, gate=gate, progress=progress, backend=backend)


def export_design(
    checkpoint,
    layer: int,
    design: Design,
    options: SidecarOptions,
    out_dir: str | os.PathLike,
    *,
    gate: VariantGate | None = None,
    progress=None,
    backend: str = DEFAULT_BACKEND,
    function_cache: str | os.PathLike | None = None,
) -> ExportResult:
    """Build, convert, gate, merge and write one layer's package for validated ``options``; a back-end other
    than Core ML (``sidecar.backends``) derives its sidecar from the merged package (no Core ML gate).
    ``function_cache``: a directory of converted fp16 functions (``sidecar.function_cache``) read and filled."""
    target = get_backend(backend)
    gate = gate if target.gated else None
    builds = design.builds(checkpoint.geometry, layer_weights(checkpoint, design, layer), options)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dest = target.package_path(out_dir, layer)
    work = Path(tempfile.mkdtemp(prefix=f".layer_{layer}.", dir=out_dir))
    try:
        variants = convert_variants(builds, work, options.weights, progress, function_cache=function_cache)
        evidence = gate.check_variants(variants) if gate is not None else {}  # per variant, before the merge
        meta = package_metadata(checkpoint, layer, design, options, variants, gate, evidence)
        final = merge_functions(variants, work / "merged.mlpackage", next(iter(variants)), meta.to_strings())
        if gate is not None:  # ... then every function of the merged package must load under its name
            gate.check_merged_loads(final, list(variants))
        if target.derive is None:  # the Core ML package is the sidecar
            replace_directory(final, dest)
        else:
            dest, _ = target.derive(final, dest, meta)
            meta = target.read_metadata(dest)
        return ExportResult(
            package=dest, metadata=meta, weight_bytes=target.stored_bytes(dest), functions=list(variants)
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def layer_weights(checkpoint, design: Design, layer: int):
    """The weights ``design`` builds ``layer``'s functions from: its block's (``Design.block``), else the attention's
    (``AttentionWeights``), refused in one line when a value is not finite."""
    if design.block is not None:
        return design.block.weights(checkpoint, layer)
    return require_finite_weights(checkpoint, checkpoint.layer(layer))


def package_metadata(
    checkpoint,
    layer: int,
    design: Design,
    options: SidecarOptions,
    variants: dict[str, Path],
    gate: VariantGate | None,
    evidence: dict,
) -> SidecarMetadata:
    """What the finished package records about itself (``variants``: the converted functions)."""
    window = checkpoint.geometry.window_of(layer) if design.block is None else None  # a block has no window
    return SidecarMetadata(
        format_version=FORMAT_VERSION,
        source=str(Path(checkpoint.path).resolve()),
        source_tensors=checkpoint.attention_digests(layer)
        if design.block is None
        else design.block.digests(checkpoint, layer),
        source_format=checkpoint.source_record(layer, options.weights)
        if design.block is None
        else design.block.source_record(checkpoint, layer, options.weights),
        layer=layer,
        geometry=checkpoint.geometry.to_dict(),
        chunk=options.chunk,
        histories=list(options.histories),
        coverage=options.coverage,
        graph=design.name,
        weights=options.weights,
        single_function_weight_bytes=weight_bytes(next(iter(variants.values()))),
        selection_folded=options.selection is not None,
        selection_indexer=options.selection,
        ane_verified=gate is not None,
        ane_reason=gate.verified_reason if gate is not None else ungated_reason(),
        ane_evidence=evidence,
        coremltools=coremltools_modules()[0].__version__,
        anelab=__version__,
        exported_at=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        sliding_window=window,
        **design.metadata_fields(options, list(variants), window),
    )


def function_builds(
    geometry: AttentionGeometry, weights: AttentionWeights, graph: str, chunk: int, histories, **options
) -> dict[str, Callable[[], object]]:
    """Function name -> a builder of its MIL program for the design ``graph`` (options as ``sidecar_options``)."""
    design, opts = sidecar_options(graph, geometry, chunk, histories, **options)
    return design.builds(geometry, weights, opts)


def convert_variants(
    builds: dict[str, Callable[[], object]],
    work: Path,
    weights_mode: str,
    progress=None,
    *,
    function_cache: str | os.PathLike | None = None,
) -> dict[str, Path]:
    """Convert (and compress) each function on its own into ``work/<name>.mlpackage``; with a ``function_cache``
    the fp16 conversion of a program converted before is read from there (``sidecar.function_cache``)."""
    variants: dict[str, Path] = {}
    for name, build_program in builds.items():
        raise_if_terminated()  # between functions: a SIGTERM that coremltools' code swallowed ends the export here
        path = converted_function(build_program(), work / f"{name}.mlpackage", function_cache, convert_program)
        if weights_mode != "fp16":  # before the merge: coremltools cannot compress a multifunction package
            path = compress_package(path, work / f"{name}.{weights_mode}.mlpackage", weights_mode)
        variants[name] = path
        if progress is not None:
            progress.update(1)
    return variants


def export_sidecars(
    checkpoint: Checkpoint,
    out_dir: str | os.PathLike,
    chunk: int,
    histories: list[int] | None,
    layers: list[int] | None = None,
    *,
    graph: str | None = DEFAULT_DESIGN,
    gate: VariantGate | None = None,
    jobs: int | None = None,
    weights_mode: str = "fp16",
    function_cache: str | os.PathLike | None = None,
    **options,
) -> list[ExportResult]:
    """``export_request`` with the request spelt as arguments: ``graph`` and ``options`` as
    :class:`SidecarRequest`'s fields (key_tile, query_tile, capacity, decode, mask_mode, selection)."""
    request = SidecarRequest(chunk, histories, graph or DEFAULT_DESIGN, weights=weights_mode, **options)
    return export_request(checkpoint, out_dir, request, layers, gate=gate, jobs=jobs, function_cache=function_cache)


def export_request(
    checkpoint: Checkpoint,
    out_dir: str | os.PathLike,
    request: SidecarRequest,
    layers: list[int] | None = None,
    *,
    gate: VariantGate | None = None,
    jobs: int | None = None,
    function_cache: str | os.PathLike | None = None,
) -> list[ExportResult]:
    """Export ``layer_<L>.mlpackage`` for each requested attention layer (default: all full and
    sliding-window ones) as ``request`` asks; every option is validated before the checkpoint's weights are
    read. ``checkpoint``: the opened checkpoint (worker processes open its path again, once each).

    ``jobs``: layers exported at once in worker processes (default ``anelab.core.parallel.default_jobs``);
    with an ANE ``gate`` one at a time (the gate loads every variant on the device), so a ``jobs`` above 1
    is refused there. The packages do not depend on ``jobs`` (a test compares them byte for byte).
    ``request.backend``: the sidecar format (``sidecar.backends``: coreml, the default, or coreai).
    ``function_cache``: converted fp16 functions shared with other exports (``sidecar.function_cache``).
    """
    target = get_backend(request.backend)
    gate = gate if target.gated else None
    design, opts = request.options_for(checkpoint.geometry)
    if design.block is not None and target.name != DEFAULT_BACKEND:
        raise AnelabInputError(
            f"--graph {design.name} is exported as a Core ML package only; drop --backend {target.name}"
        )
    target.check_options(opts.weights, opts.chunk, opts.capacity)
    layers = _export_layers(checkpoint, design, opts, layers)
    jobs = _export_jobs(jobs, gate, len(layers))
    per_layer = len(design.function_names(opts))
    with exporting(out_dir, layers) as staging, tqdm(total=len(layers) * per_layer, desc="export functions",
                                                    unit="fn") as bar:  # fmt: skip
        if jobs == 1:
            results = []
            for layer in layers:
                bar.set_postfix_str(f"layer {layer}")
                results.append(export_design(checkpoint, layer, design, opts, staging.folder, gate=gate, progress=bar,
                                             backend=target.name, function_cache=function_cache))  # fmt: skip
        else:
            cache = None if function_cache is None else str(function_cache)
            work = [(str(checkpoint.path), layer, design.name, opts, str(staging.folder), str(staging.tmp), target.name,
                     cache) for layer in layers]  # fmt: skip
            coremltools_modules()  # imported before the workers fork, so they inherit it (~1.5 s each otherwise)
            results = process_map(_export_in_worker, work, jobs=jobs, on_result=lambda job, _: bar.update(per_layer))
        for result, dest in zip(results, staging.commit(layers, target.suffix), strict=True):
            result.package = dest
        return results


def _export_layers(checkpoint, design: Design, opts: SidecarOptions, layers: list[int] | None) -> list[int]:
    """The layers to export (default: every full and sliding-window attention layer), each checked before
    any is exported: an attention layer the options can serve, named once, whose attention tensors the
    checkpoint holds in a dtype anelab reads (a bad tensor in the last layer refuses the export up front). A block
    design's layers are those its block reader names (``Design.block``: every layer's MLP, the linear-attention
    layers' projections), read when exported."""
    if design.block is not None:
        return _block_layers(checkpoint, design, layers)
    full = list(checkpoint.geometry.full_attention_layers)  # full and sliding-window attention layers
    layers = full if layers is None else list(layers)
    repeated = sorted({layer for layer in layers if layers.count(layer) > 1})
    if repeated:
        raise AnelabInputError(f"--layers names layer {repeated[0]} twice; name each layer once")
    for layer in layers:
        if layer not in full:
            raise AnelabInputError(
                f"layer {layer} is not a full-attention layer nor a sliding-window one (linear attention is not exported); "
                f"attention layers: {','.join(map(str, full))}"
            )
        design.layer_fields(opts, checkpoint.geometry.window_of(layer))  # a layer the options cannot serve: refused now
    _require_readable_tensors(checkpoint, layers)
    return layers


def _block_layers(checkpoint, design: Design, layers: list[int] | None) -> list[int]:
    """A block design's layers to export (default: every layer that has its block), each named once and having one."""
    have = list(design.block.layers(checkpoint))
    layers = have if layers is None else list(layers)
    repeated = sorted({layer for layer in layers if layers.count(layer) > 1})
    if repeated:
        raise AnelabInputError(f"--layers names layer {repeated[0]} twice; name each layer once")
    if not have:
        raise AnelabInputError(f"{checkpoint.path} has no layer with a --graph {design.name} block")
    for layer in layers:
        if layer not in have:
            raise AnelabInputError(
                f"layer {layer} has no --graph {design.name} block; its layers: {','.join(map(str, have))}"
            )
    return layers


def _require_readable_tensors(checkpoint, layers: list[int]) -> None:
    """Every attention tensor of ``layers`` stored in a way anelab reads (its format's ``storage`` refuses what it
    does not: a dtype, bytes that do not hold the shape), from headers only; the first that is not is refused."""
    names = list(checkpoint.tensors.names())
    for layer in layers:
        prefix = checkpoint.tensor_name(layer, "")
        for name in sorted(n for n in names if n.startswith(prefix)):
            checkpoint.tensors.storage(name)


def require_finite_weights(checkpoint, weights: AttentionWeights) -> AttentionWeights:
    """``weights`` when every value is finite in fp16, the sidecar's storage; a NaN or infinity is refused naming its
    tensor (a package built from it would compute NaN, and the reference with it, so verification could not tell),
    and so is a finite value past fp16's range (1e30 in BF16: the package would hold infinity)."""
    params = {"q_proj": "q_proj.weight", "k_proj": "k_proj.weight", "v_proj": "v_proj.weight",
              "o_proj": "o_proj.weight", "q_norm": "q_norm.weight", "k_norm": "k_norm.weight",
              "q_bias": "q_proj.bias", "k_bias": "k_proj.bias", "v_bias": "v_proj.bias", "o_bias": "o_proj.bias"}  # fmt: skip
    for attr, param in params.items():
        value = getattr(weights, attr)
        if value is None:
            continue
        fused = getattr(checkpoint, "family", None) is not None and checkpoint.family.fused_qkv and attr[0] in "qkv"
        name = checkpoint.tensor_name(weights.layer, "qkv_proj.weight" if fused and "proj" in attr else param)
        if not np.isfinite(value).all():
            bad = int(np.size(value) - np.isfinite(value).sum())
            raise AnelabInputError(
                f"tensor {name} holds {bad:,} NaN or infinite values; a sidecar of it would compute NaN — "
                "fix or re-download the checkpoint"
            )
        with np.errstate(over="ignore"):  # the overflow is what is counted
            overflow = int(np.isinf(value.astype(np.float16)).sum())
        if overflow:
            raise AnelabInputError(
                f"tensor {name} holds {overflow:,} values beyond fp16's range (largest |x| {np.abs(value).max():.3g}; fp16 "
                f"holds up to {FP16_MAX:g}); a sidecar stores its weights in fp16, where they become infinite — "
                "rescale or fix the checkpoint"
            )
    return weights


def _export_jobs(jobs: int | None, gate: VariantGate | None, layers: int) -> int:
    if gate is not None:
        if jobs is not None and jobs > 1:
            raise AnelabInputError(
                f"--jobs {jobs}: with the ANE gate every variant is loaded on the device one at a time; drop --jobs"
            )
        return 1
    if jobs is None:
        return default_jobs(layers)
    threads_per_run(jobs)  # 1..cores, else refused in one line
    return jobs


def _export_in_worker(job: tuple[str, int, str, SidecarOptions, str, str, str, str | None]) -> ExportResult:
    """One layer's package in a worker process (no gate): ``job`` = (checkpoint directory, layer, design name,
    options, staging directory, the staging's temporary directory (where coremltools' temporaries go), back-end,
    function cache or None)."""
    checkpoint_dir, layer, design_name, options, out_dir, tmp, backend, function_cache = job
    tempfile.tempdir = tmp
    checkpoint = worker_checkpoint(checkpoint_dir)
    return export_design(
        checkpoint, layer, get_design(design_name), options, out_dir, backend=backend, function_cache=function_cache
    )


@functools.lru_cache(maxsize=1)
def worker_checkpoint(checkpoint_dir: str):
    """The checkpoint at ``checkpoint_dir`` opened once per worker process: every job the worker runs shares it."""
    return load_checkpoint(checkpoint_dir)
