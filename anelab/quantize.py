"""Weight compression of a sidecar's projections: ``fp16`` (none), ``int8``, ``palettize4``, ``int4-block``.

Each single-function package is compressed with ``coremltools.optimize.coreml`` before the
multifunction merge (coremltools refuses to compress a multifunction package). Only the weights
of the four ``linear`` ops (q/k/v/o projections, [out_features, in_features]) are compressed —
RoPE tables, norm weights and biases stay fp16.

Modes (all valid for the exporter's target, macOS 15 / iOS 18):

- ``int8``: linear symmetric int8, one scale per output channel -> ``constexpr_blockwise_shift_scale``.
- ``palettize4``: a 16-entry fp16 lookup table per group of ``PALETTE_GROUP_SIZE`` output channels,
  entries spaced uniformly over the group's range (``mode="uniform"``; k-means needs scikit-learn,
  which the environment lacks) -> ``constexpr_lut_to_dense``. Grouped LUTs need iOS 18.
- ``int4-block``: linear symmetric int4, one scale per ``INT4_BLOCK_SIZE`` input columns of each
  output row -> ``constexpr_blockwise_shift_scale``. Block-wise int4 needs iOS 18.

``ERROR_BOUNDS`` documents how far each mode may move ``attn_out`` away from the fp16-weight
reference (relative error, ||out - ref|| / ||ref||); ``anelab.verify`` checks it per function.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from anelab.checkpoint import AttentionWeights
from anelab.errors import AnelabInputError
from anelab.geometry import AttentionGeometry
from anelab.graph import coremltools_modules, quiet_coremltools

WEIGHT_MODES = ("fp16", "int8", "palettize4", "int4-block")
INT4_BLOCK_SIZE = 32          # input columns sharing one int4 scale
PALETTE_GROUP_SIZE = 16       # output channels sharing one 4-bit lookup table
# the iOS opset each mode first appears in (macOS 15 == iOS 18)
MINIMUM_IOS = {"fp16": 16, "int8": 16, "palettize4": 18, "int4-block": 18}
DEPLOYMENT_TARGETS = {"iOS16": 16, "iOS17": 17, "iOS18": 18, "macOS13": 16, "macOS14": 17, "macOS15": 18}
# Documented bounds on attn_out's relative error vs the fp16-weight reference (random Gaussian
# weights, tiny geometries, chunk 8; measured: int8 ~1e-2, int4-block ~0.13-0.17, palettize4 ~0.16-0.23).
# They are loose by design: this is a Gaussian-weight sanity bound, not a quality claim for real weights.
ERROR_BOUNDS = {"fp16": 1e-2, "int8": 3e-2, "palettize4": 0.35, "int4-block": 0.3}
# the linear ops of the sidecar graph (output names) and the AttentionWeights field each holds
PROJECTIONS = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "attn_out": "o_proj"}


def validate_weights_mode(mode: str, geometry: AttentionGeometry, target: str = "macOS15") -> str:
    """Refuse an unknown mode, one the deployment target lacks, or a projection the mode would
    silently skip (coremltools leaves a weight uncompressed when its block/group does not divide it)."""
    if mode not in WEIGHT_MODES:
        raise AnelabInputError(f"unknown --weights {mode!r}; supported: {'|'.join(WEIGHT_MODES)}")
    if target not in DEPLOYMENT_TARGETS:
        raise AnelabInputError(f"unknown deployment target {target!r}; supported: {', '.join(DEPLOYMENT_TARGETS)}")
    if DEPLOYMENT_TARGETS[target] < MINIMUM_IOS[mode]:
        raise AnelabInputError(f"--weights {mode} needs iOS {MINIMUM_IOS[mode]} / macOS {MINIMUM_IOS[mode] - 3}+, not {target}; use int8 or fp16")
    g = geometry
    q_rows = g.num_heads * g.head_dim * (2 if g.is_gated else 1)
    shapes = {"q_proj": (q_rows, g.hidden_size), "k_proj": (g.num_kv_heads * g.head_dim, g.hidden_size),
              "v_proj": (g.num_kv_heads * g.head_dim, g.hidden_size), "o_proj": (g.hidden_size, g.num_heads * g.head_dim)}
    for name, (rows, cols) in shapes.items():
        if mode == "int4-block" and cols % INT4_BLOCK_SIZE:
            raise AnelabInputError(f"--weights int4-block: {name} has {cols} input columns, not a multiple of the block {INT4_BLOCK_SIZE}; use int8 or palettize4")
        if mode == "palettize4" and rows % PALETTE_GROUP_SIZE:
            raise AnelabInputError(f"--weights palettize4: {name} has {rows} output channels, not a multiple of the group {PALETTE_GROUP_SIZE}; use int8")
    return mode


def _optimization(mode: str):
    """(compress function, OptimizationConfig) applying ``mode`` to linear weights only."""
    with quiet_coremltools():
        import coremltools.optimize.coreml as cto
    if mode == "int8":
        op = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", granularity="per_channel", weight_threshold=0)
        fn = cto.linear_quantize_weights
    elif mode == "int4-block":
        op = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int4", granularity="per_block",
                                         block_size=INT4_BLOCK_SIZE, weight_threshold=0)
        fn = cto.linear_quantize_weights
    elif mode == "palettize4":
        op = cto.OpPalettizerConfig(nbits=4, mode="uniform", granularity="per_grouped_channel",
                                    group_size=PALETTE_GROUP_SIZE, weight_threshold=0)
        fn = cto.palettize_weights
    else:
        raise AnelabInputError(f"--weights {mode} is not a compression mode; supported: int8|palettize4|int4-block")
    # global_config None: consts feeding any other op type (RoPE tables, norms) stay fp16
    return fn, cto.OptimizationConfig(op_type_configs={"linear": op})


def compress_package(src: str | os.PathLike, dest: str | os.PathLike, mode: str) -> Path:
    """Compress the projection weights of a single-function package ``src`` into ``dest``."""
    ct, _, _ = coremltools_modules()
    fn, config = _optimization(mode)
    with quiet_coremltools():
        model = ct.models.MLModel(str(src), skip_model_load=True)
        compressed = fn(model, config)
        compressed.save(str(dest))
    return Path(dest)


def dequantized_weights(saved, function: str, weights: AttentionWeights) -> AttentionWeights:
    """``weights`` with its four projection matrices replaced by the ones the saved package
    holds for ``function`` (decompressed from its constexpr ops by ``anelab.mil_eval``'s kernels).

    ``saved``: an ``anelab.mil_eval.SavedPackage``. A projection stored uncompressed is read as is.
    Refuses a package whose linear ops do not carry the four projections.
    """
    from anelab.mil_eval import _KERNELS, _Interpreter

    fn = saved.mil_function(function)
    it = _Interpreter(saved, fn, fp16=True)
    found = {}
    for op in fn.operations:
        if op.op_type != "linear" or op.outputs[0].name not in PROJECTIONS:
            continue
        var = op.inputs["weight"]
        producer = var.op
        if producer is not None and producer.op_type.startswith("constexpr_"):
            kernel = _KERNELS.get(producer.op_type)
            if kernel is None:
                raise AnelabInputError(f"{saved.path.name}: weight op {producer.op_type!r} is not supported by anelab's evaluator")
            value = kernel(it, producer)
        else:
            value = saved.const_value(var)
        found[PROJECTIONS[op.outputs[0].name]] = np.asarray(value, dtype=np.float32)
    missing = sorted(set(PROJECTIONS.values()) - set(found))
    if missing:
        raise AnelabInputError(f"{saved.path.name}:{function} lacks the projections {missing}; re-export it with 'anelab export'")
    for name, value in found.items():
        if value.shape != getattr(weights, name).shape:
            raise AnelabInputError(f"{saved.path.name}:{function} holds {name} of shape {list(value.shape)}, "
                                   f"the checkpoint {list(getattr(weights, name).shape)}; pass the checkpoint it was exported from")
    return dataclasses.replace(weights, **found)
