"""Verification of a saved non-attention block's package (the MLP, a Gated DeltaNet layer's input projections)
against the independent NumPy reference, with the negative controls that make it able to fail.

The package's one function ``c<C>`` is fed random fp16 rows [C, D] (the seed's stream for the layer) and read
back from disk (``sidecar.mil.evaluate``); the reference computes the same rows in float64 from the checkpoint's
float32 weights: ``core.decoder.swiglu`` for the MLP, ``core.gated_deltanet.gdn_input_projections`` for the
projections — written apart from the MIL graphs (``sidecar.graphs.mlp`` / ``gdn_projections``). Each output's
relative error ||package - reference|| / ||reference|| must stay under ``RELATIVE_ERROR_THRESHOLD`` (1e-2).

The MLP is run a second time on the same rows scaled so that its gate's pre-activations have RMS 1
(``BlockCases.scaled``), where SiLU and GELU-tanh differ most, and the controls compare that run.

Negative controls (``BlockCases.controls``): the reference recomputed with a mistake a graph could make — the
MLP's activation swapped (SiLU <-> GELU-tanh), its gate and up projections swapped, another layer's weights
(the projections: b and a swapped, another layer's weights) — must land *above* the threshold, or the report is
vacuous and fails. A control needing another layer is declared only where the model has one.

Compressed weights (``--weights int8|palettize4|int4-block``): as for attention, the reference uses the package's
own dequantized projections (``quantize.dequantized_linears``; only this is judged), and one more comparison
reports what the compression costs against the checkpoint's weights (``verify_cases.compression_row``: reported,
never judged by a bound measured elsewhere).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from anelab.checkpoints.checkpoint import Checkpoint
from anelab.core.decoder import MlpWeights, swiglu
from anelab.core.errors import AnelabInputError
from anelab.core.gated_deltanet import GDN_OUTPUTS, GdnProjectionWeights, gdn_input_projections
from anelab.core.geometry import AttentionGeometry
from anelab.sidecar import quantize
from anelab.sidecar.backends import open_saved, read_metadata
from anelab.sidecar.checks.comparison import (
    RELATIVE_ERROR_THRESHOLD,
    Comparison,
    load_matching_checkpoint,
    relative_error,
)
from anelab.sidecar.checks.verify_cases import VerifyReport, compression_row
from anelab.sidecar.format import SidecarMetadata

ANOTHER_LAYER = "control: another layer"  # the reference with another layer's weights
# the activation a "wrong activation" control swaps in: SiLU for the GELU-tanh family and the reverse
_OTHER_ACTIVATION = {"silu": "gelu_pytorch_tanh", "swish": "gelu_pytorch_tanh"}


@dataclass(frozen=True)
class BlockCases:
    """How one kind of block is verified: ``reference(x float64 [C, D], weights) -> {output: [C, n]}``;
    ``controls``: case label -> the weights a mistaken graph would have used (each must fail); ``layers_in(geometry)``:
    the model's layers that have the block (for the another-layer control)."""

    reference: Callable[[np.ndarray, object], dict[str, np.ndarray]]
    controls: dict[str, Callable[[object], object]]
    layers_in: Callable[[AttentionGeometry], list[int]]
    # (rows float64 [C, D], weights) -> (label, the factor on the rows) of a second case the controls run on
    scaled: Callable[[np.ndarray, object], tuple[str, float]] | None = None

    def declared(self, meta: SidecarMetadata, geometry: AttentionGeometry) -> list[tuple[str, str]]:
        """The controls a package's verification must run: (function, case)."""
        function = meta.functions[0]
        labels = list(self.controls)
        if any(layer != meta.layer for layer in self.layers_in(geometry)):
            labels.append(ANOTHER_LAYER)
        return [(function, label) for label in labels]


def _mlp_reference(x: np.ndarray, mlp: MlpWeights) -> dict[str, np.ndarray]:
    return {"mlp_out": swiglu(x, mlp)}


GATE_RMS = 1.0  # the MLP's second case: rows scaled so that the gate's pre-activations have this RMS


def _unit_gate_rms(x: np.ndarray, mlp: MlpWeights) -> tuple[str, float]:
    """Where SiLU and GELU-tanh differ most: gate pre-activations of RMS ~1. A real model's gate weights can make
    unit rows' pre-activations large (SmolLM2-135M: RMS ~4.4), where both activations are nearly x or 0 and a
    wrong activation moved the output by 1.1-3.7 % only (measured on its 30 layers), so the controls run here."""
    gate = x @ np.asarray(mlp.gate_proj, np.float64).T
    return f"chunk, gate RMS {GATE_RMS:g}", GATE_RMS / max(float(np.sqrt(np.mean(gate * gate))), 1e-30)


def _wrong_activation(mlp: MlpWeights) -> MlpWeights:
    return dataclasses.replace(mlp, activation=_OTHER_ACTIVATION.get(mlp.activation, "silu"))


def _gate_up_swapped(mlp: MlpWeights) -> MlpWeights:
    return dataclasses.replace(mlp, gate_proj=mlp.up_proj, up_proj=mlp.gate_proj, gate_bias=mlp.up_bias,
                               up_bias=mlp.gate_bias)  # fmt: skip


def _b_a_swapped(weights: GdnProjectionWeights) -> GdnProjectionWeights:
    return dataclasses.replace(weights, b=weights.a, a=weights.b)


MLP_CASES = BlockCases(
    _mlp_reference,
    {"control: wrong activation": _wrong_activation, "control: gate and up swapped": _gate_up_swapped},
    lambda g: list(range(g.num_layers)),
    _unit_gate_rms,
)
GDN_CASES = BlockCases(
    gdn_input_projections,
    {"control: b and a swapped": _b_a_swapped},
    lambda g: [i for i in range(g.num_layers) if i not in g.full_attention_layers],
)


def block_rows(meta: SidecarMetadata, hidden_size: int, seed: int) -> np.ndarray:
    """The rows verify feeds a block's function: fp16 [C, D] ~ N(0, 1), from the stream (seed, layer)."""
    rng = np.random.default_rng([int(seed), int(meta.layer)])
    return rng.standard_normal((meta.chunk, hidden_size), dtype=np.float32).astype(np.float16)


def _errors(out: dict, ref: dict, outputs: tuple[str, ...]) -> dict[str, float]:
    return {name: relative_error(np.asarray(out[name], np.float64).reshape(ref[name].shape), ref[name])
            for name in outputs}  # fmt: skip


def verify_block_package(
    package: str | os.PathLike,
    checkpoint: Checkpoint | None = None,
    *,
    reader,
    cases: BlockCases,
    seed: int = 0,
    fp16: bool = True,
    functions: list[str] | None = None,
    precision: str = "fp64",
    evaluator=None,
    progress: bool = True,
    activations: np.ndarray | None = None,
) -> VerifyReport:
    """Verify a block package (module docstring). ``reader``: its design's ``designs.BlockReader`` (weights,
    digests, outputs, projections); ``cases``: how its kind is verified. The reference is always float64
    (``precision`` is accepted for the registry's signature). ``evaluator`` and ``activations`` are refused."""
    if evaluator is not None or activations is not None:
        raise AnelabInputError(
            f"{package}: a block package is verified with NumPy on random rows; drop --compute-units / --real-text"
        )
    start = time.perf_counter()
    meta = read_metadata(package)
    checkpoint = load_matching_checkpoint(meta, checkpoint, reader.digests)
    saved = open_saved(package)
    function = meta.functions[0]
    if functions is not None and list(functions) != [function]:
        raise AnelabInputError(f"{package} has one function, {function}; drop the function list")
    report = VerifyReport(str(package), str(checkpoint.path), meta.layer, RELATIVE_ERROR_THRESHOLD,
                          saved.description(fp16), reference_precision="fp64",
                          declared_controls=cases.declared(meta, checkpoint.geometry), outputs=reader.outputs)  # fmt: skip
    weights = reader.weights(checkpoint, meta.layer)
    graph_weights = weights
    if meta.weights != "fp16":  # the graph is held to the fp16 threshold with the weights it stores
        stored = quantize.dequantized_linears(saved, function, reader.projections, meta.weights)
        graph_weights = dataclasses.replace(weights, **stored)
    x = block_rows(meta, checkpoint.geometry.hidden_size, seed)
    run = lambda rows: saved.evaluate(function, {"hidden": rows}, fp16=fp16)  # noqa: E731
    runs = [("chunk", x, run(x))]
    if cases.scaled is not None:  # the controls run on the second case (BlockCases.scaled)
        label, factor = cases.scaled(x.astype(np.float64), graph_weights)
        scaled = (x.astype(np.float64) * factor).astype(np.float16)
        runs.append((label, scaled, run(scaled)))
    rows = meta.chunk
    for label, rows_in, out in runs:
        errors = _errors(out, cases.reference(rows_in.astype(np.float64), graph_weights), reader.outputs)
        report.comparisons.append(Comparison(function, label, rows, errors))
    _, x, out = runs[-1]
    x64 = x.astype(np.float64)
    if meta.weights != "fp16":
        errors = _errors(out, cases.reference(x64, weights), reader.outputs)
        report.comparisons.append(compression_row(function, meta.weights, rows, errors))
    for label, mistake in cases.controls.items():
        ref = cases.reference(x64, mistake(graph_weights))
        report.comparisons.append(Comparison(function, label, rows, _errors(out, ref, reader.outputs), control=True))
    if (function, ANOTHER_LAYER) in report.declared_controls:
        other = next(layer for layer in cases.layers_in(checkpoint.geometry) if layer != meta.layer)
        ref = cases.reference(x64, reader.weights(checkpoint, other))
        report.comparisons.append(Comparison(function, ANOTHER_LAYER, rows, _errors(out, ref, reader.outputs), control=True))  # fmt: skip
    saved.close()
    report.seconds["total"] = time.perf_counter() - start
    return report


__all__ = ["GDN_CASES", "GDN_OUTPUTS", "MLP_CASES", "BlockCases", "block_rows", "verify_block_package"]
