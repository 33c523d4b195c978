"""Weight compression of a sidecar's projections: ``fp16`` (none), ``int8``, ``palettize4``, ``int4-block``.

Each single-function package is compressed with ``coremltools.optimize.coreml`` before the
multifunction merge (coremltools refuses to compress a multifunction package). Only the weights
of the four ``linear`` ops (q/k/v/o projections, [out_features, in_features]) are compressed —
RoPE tables, norm weights and biases stay fp16.

Modes (all valid for the exporter's target, macOS 15 / iOS 18):

- ``int8``: linear symmetric int8, one scale per output channel -> ``constexpr_blockwise_shift_scale``.
- ``palettize4``: a 16-entry fp16 lookup table per group of ``PALETTE_GROUP_SIZE`` output channels,
  fitted by ``kmeans_lut`` (1-D k-means in NumPy, passed as coremltools' ``custom`` LUT function:
  its own ``kmeans`` mode needs scikit-learn) -> ``constexpr_lut_to_dense``. Grouped LUTs need iOS 18.
- ``int4-block``: linear symmetric int4, one scale per ``INT4_BLOCK_SIZE`` input columns of each
  output row -> ``constexpr_blockwise_shift_scale``. Block-wise int4 needs iOS 18.

``anelab.sidecar.checks.verify`` holds a compressed package to the fp16 threshold against the reference built from
its own stored weights (``dequantized_weights``), and reports — never bounds — its error against the
uncompressed weights; what a mode costs a real model is measured on the whole model
(``anelab.arms.compression_cost``: logits, greedy agreement, perplexity on real text), never inferred from
random weights.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.weights import AttentionWeights
from anelab.sidecar.coremltools_import import (
    coremltools_modules,
    fast_conversions,
    quiet_coremltools,
    save_model,
)
from anelab.sidecar.mil.evaluate import Interpreter
from anelab.sidecar.mil.kernels import KERNELS

WEIGHT_MODES = ("fp16", "int8", "palettize4", "int4-block")


INT4_BLOCK_SIZE = 32  # input columns sharing one int4 scale


PALETTE_GROUP_SIZE = 16  # output channels sharing one 4-bit lookup table


PALETTE_ENTRIES = 16  # 4 bits


KMEANS_ITERATIONS = 25


# the iOS opset each mode first appears in (macOS 15 == iOS 18)
MINIMUM_IOS = {"fp16": 16, "int8": 16, "palettize4": 18, "int4-block": 18}


DEPLOYMENT_TARGETS = {"iOS16": 16, "iOS17": 17, "iOS18": 18, "macOS13": 16, "macOS14": 17, "macOS15": 18}


# the decompression op each mode stores its projections behind (what dequantized_weights requires of a package)
DECOMPRESSION_OPS = {
    "int8": "constexpr_blockwise_shift_scale",
    "int4-block": "constexpr_blockwise_shift_scale",
    "palettize4": "constexpr_lut_to_dense",
}


# the linear ops of the sidecar graph (output names) and the AttentionWeights field each holds
PROJECTIONS = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "attn_out": "o_proj"}


def validate_weights_mode(mode: str, geometry: AttentionGeometry | None, target: str = "macOS15") -> str:
    """Refuse an unknown mode, one the deployment target lacks, or an attention projection of ``geometry`` the
    mode would silently skip (coremltools leaves a weight uncompressed when its block/group does not divide it)."""
    if mode not in WEIGHT_MODES:
        raise AnelabInputError(f"unknown --weights {mode!r}; supported: {'|'.join(WEIGHT_MODES)}")
    if target not in DEPLOYMENT_TARGETS:
        raise AnelabInputError(f"unknown deployment target {target!r}; supported: {', '.join(DEPLOYMENT_TARGETS)}")
    if DEPLOYMENT_TARGETS[target] < MINIMUM_IOS[mode]:
        raise AnelabInputError(
            f"--weights {mode} needs iOS {MINIMUM_IOS[mode]} / macOS {MINIMUM_IOS[mode] - 3}+, not {target}; use int8 or fp16"
        )
    if geometry is None:  # a block design checks its own projections (require_compressible) when it reads them
        return mode
    g = geometry
    q_rows = g.num_heads * g.head_dim * (2 if g.is_gated else 1)
    shapes = {
        "q_proj": (q_rows, g.hidden_size),
        "k_proj": (g.num_kv_heads * g.head_dim, g.hidden_size),
        "v_proj": (g.num_kv_heads * g.head_dim, g.hidden_size),
        "o_proj": (g.hidden_size, g.num_heads * g.head_dim),
    }
    require_compressible(mode, shapes)
    return mode


def require_compressible(mode: str, shapes: dict[str, tuple[int, int]]) -> None:
    """Refuse a projection (name -> [rows, input columns]) that ``mode`` would silently leave uncompressed."""
    for name, (rows, cols) in shapes.items():
        if mode == "int4-block" and cols % INT4_BLOCK_SIZE:
            raise AnelabInputError(
                f"--weights int4-block: {name} has {cols} input columns, not a multiple of the block "
                f"{INT4_BLOCK_SIZE}; use int8 or palettize4"
            )
        if mode == "palettize4" and rows % PALETTE_GROUP_SIZE:
            raise AnelabInputError(
                f"--weights palettize4: {name} has {rows} output channels, not a multiple of the group {PALETTE_GROUP_SIZE}; use int8"
            )


def _optimization(mode: str):
    """(compress function, OptimizationConfig) applying ``mode`` to linear weights only."""
    with quiet_coremltools():
        import coremltools.optimize.coreml as cto
    if mode == "int8":
        op = cto.OpLinearQuantizerConfig(
            mode="linear_symmetric", dtype="int8", granularity="per_channel", weight_threshold=0
        )
        fn = cto.linear_quantize_weights
    elif mode == "int4-block":
        op = cto.OpLinearQuantizerConfig(
            mode="linear_symmetric",
            dtype="int4",
            granularity="per_block",
            block_size=INT4_BLOCK_SIZE,
            weight_threshold=0,
        )
        fn = cto.linear_quantize_weights
    elif mode == "palettize4":
        op = cto.OpPalettizerConfig(
            mode="custom",
            lut_function=kmeans_lut,
            granularity="per_grouped_channel",
            group_size=PALETTE_GROUP_SIZE,
            weight_threshold=0,
        )
        fn = cto.palettize_weights
    else:
        raise AnelabInputError(f"--weights {mode} is not a compression mode; supported: int8|palettize4|int4-block")
    # global_config None: consts feeding any other op type (RoPE tables, norms) stay fp16
    return fn, cto.OptimizationConfig(op_type_configs={"linear": op})


def kmeans_lut(values: np.ndarray, entries: int = PALETTE_ENTRIES, iterations: int = KMEANS_ITERATIONS):
    """1-D k-means (Lloyd) of ``values`` (any shape) into ``entries`` centroids.

    Starts from the values' quantiles at (i + 0.5) / entries, then alternates nearest-centroid
    assignment (binary search on the midpoints of the sorted centroids) and centroid = mean of its
    values; an empty cluster keeps its centroid. Deterministic. Returns (lut [entries] in the
    values' dtype, indices [values.size] uint8 of the nearest entry of the *stored* lut).
    """
    flat = np.asarray(values, dtype=np.float64).ravel()
    centroids = np.quantile(flat, (np.arange(entries) + 0.5) / entries)
    for _ in range(iterations):
        centroids = np.sort(centroids)
        assign = np.searchsorted((centroids[1:] + centroids[:-1]) / 2, flat)
        sums = np.bincount(assign, weights=flat, minlength=entries)
        counts = np.bincount(assign, minlength=entries)
        centroids = np.where(counts > 0, sums / np.maximum(counts, 1), centroids)
    lut = np.sort(centroids).astype(np.asarray(values).dtype)
    stored = lut.astype(np.float64)
    indices = np.searchsorted((stored[1:] + stored[:-1]) / 2, flat).astype(np.uint8)
    return lut, indices


def compress_package(src: str | os.PathLike, dest: str | os.PathLike, mode: str) -> Path:
    """Compress the projection weights of a single-function package ``src`` into ``dest``.

    coremltools converts the compressed program back through its pass pipeline; that pipeline runs validated after
    its cleanups (``fast_conversions``: the same package as coremltools' own, a third less CPU on
    each of the ~120 compressions of a real model's weight-mode evidence)."""
    ct, _, _ = coremltools_modules()
    fn, config = _optimization(mode)
    with quiet_coremltools(), fast_conversions():
        model = ct.models.MLModel(str(src), skip_model_load=True)
        compressed = fn(model, config)
        save_model(compressed, dest)
    return Path(dest)


def dequantized_weights(saved, function: str, weights: AttentionWeights, mode: str | None = None) -> AttentionWeights:
    """``weights`` with its four projection matrices replaced by the ones the saved package
    holds for ``function`` (``dequantized_linears``, ``mode`` as there); refused when a shape differs from the
    checkpoint's."""
    found = dequantized_linears(saved, function, PROJECTIONS, mode)
    for name, value in found.items():
        if value.shape != getattr(weights, name).shape:
            raise AnelabInputError(
                f"{saved.path.name}:{function} holds {name} of shape {list(value.shape)}, "
                f"the checkpoint {list(getattr(weights, name).shape)}; pass the checkpoint it was exported from"
            )
    return dataclasses.replace(weights, **found)


def dequantized_linears(
    saved, function: str, projections: dict[str, str], mode: str | None = None
) -> dict[str, np.ndarray]:
    """The weight matrices the saved package holds for ``function``'s linear ops, decompressed from their constexpr
    ops by ``anelab.sidecar.mil.kernels`` -> {field: float32 [out, in]}.

    ``saved``: an ``anelab.sidecar.mil.evaluate.SavedPackage``; ``projections``: linear op output name -> field name.
    A projection stored uncompressed is read as is, unless ``mode`` (the package's recorded weight mode) is a
    compression: then every projection must come from that mode's ``DECOMPRESSION_OPS`` op, or the package is
    refused — its metadata would claim a compression the graph does not hold. Refuses a package whose linear ops
    do not carry every one of the projections.
    """

    fn = saved.mil_function(function)
    it = Interpreter(saved, fn, fp16=True)
    found = {}
    for op in fn.operations:
        if op.op_type != "linear" or op.outputs[0].name not in projections:
            continue
        var = op.inputs["weight"]
        producer = var.op
        stored = producer.op_type if producer is not None and producer.op_type.startswith("constexpr_") else "plain"
        if mode in DECOMPRESSION_OPS and stored != DECOMPRESSION_OPS[mode]:
            raise AnelabInputError(
                f"{saved.path.name}:{function} records --weights {mode} but stores {projections[op.outputs[0].name]} "
                f"as {stored} ({DECOMPRESSION_OPS[mode]} expected); re-export it with 'anelab export --weights {mode}'"
            )
        if producer is not None and producer.op_type.startswith("constexpr_"):
            kernel = KERNELS.get(producer.op_type)
            if kernel is None:
                raise AnelabInputError(
                    f"{saved.path.name}: weight op {producer.op_type!r} is not supported by anelab's evaluator"
                )
            value = kernel(it, producer)
        else:
            value = saved.const_value(var)
        found[projections[op.outputs[0].name]] = np.asarray(value, dtype=np.float32)
    missing = sorted(set(projections.values()) - set(found))
    if missing:
        raise AnelabInputError(
            f"{saved.path.name}:{function} lacks the projections {missing}; re-export it with 'anelab export'"
        )
    return found
