"""Comparing a package's outputs with the reference: relative error, the threshold, one comparison."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from anelab import reference
from anelab.errors import AnelabInputError
from anelab.geometry import AttentionGeometry
from anelab.hf.checkpoint import Checkpoint, load_checkpoint
from anelab.hf.config import CONFIG_FILE
from anelab.masks import MASKED
from anelab.sidecar.evaluate import SavedPackage, evaluate
from anelab.sidecar.format import SidecarMetadata, history_of
from anelab.weights import AttentionWeights

# fp16 storage gives ~1e-3 relative error on this block (measured: see the closing note of issue 2);
# 1 % leaves room for long rows while every negative control lands well above it.
RELATIVE_ERROR_THRESHOLD = 1e-2


OUTPUTS = ("attn_out", "k_chunk", "v_chunk")


# The reference verify compares against. fp32 is enough: against a threshold of 1e-2 what matters is the
# reference's own error, which verify measures every run against an fp64 run on the first
# REFERENCE_CHECK_ROWS rows of each function (measured: ~1e-7 at hidden 2048 / head_dim 128 / 12k keys)
# and refuses above REFERENCE_ERROR_BOUND. By the triangle inequality an error measured against the fp32
# reference differs from the one against fp64 by at most that own error, so it cannot hide a real error.
REFERENCE_PRECISION = "fp32"
REFERENCE_CHECK_ROWS = 64
REFERENCE_ERROR_BOUND = RELATIVE_ERROR_THRESHOLD / 100


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """||actual - expected|| / ||expected|| in float64 (inf when expected is all zero and actual is not)."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    num, den = np.linalg.norm(a - e), np.linalg.norm(e)
    if not np.isfinite(num):
        return float("inf")
    return float(num / den) if den > 0 else (0.0 if num == 0 else float("inf"))


@dataclass
class Comparison:
    """One package-vs-reference comparison over the chunk's first ``rows`` rows."""

    function: str
    case: str
    rows: int
    errors: dict[str, float]
    control: bool = False
    bound: float | None = None  # this comparison's own threshold (compressed weights vs fp16 weights)

    @property
    def worst(self) -> float:
        return max(self.errors.values())

    @property
    def passed(self) -> bool:
        """A comparison passes when under the threshold; a control when clearly above it."""
        if self.control:
            return self.worst > (RELATIVE_ERROR_THRESHOLD if self.bound is None else self.bound)
        return self.worst <= (RELATIVE_ERROR_THRESHOLD if self.bound is None else self.bound)


# ---- the checkpoint a package came from, and one function's inputs run both ways -----------------


def load_matching_checkpoint(meta: SidecarMetadata, checkpoint_dir: str | os.PathLike | None = None) -> Checkpoint:
    """The checkpoint a package was exported from: ``checkpoint_dir``, else the path the package
    records; refused (one line) when it is missing or its geometry differs from the package's."""
    source = Path(checkpoint_dir) if checkpoint_dir is not None else Path(meta.source)
    if not (source / CONFIG_FILE).is_file():
        raise AnelabInputError(
            f"checkpoint {source} (recorded in the package) has no {CONFIG_FILE}; pass --checkpoint DIR"
        )
    checkpoint = load_checkpoint(source)
    require_same_geometry(meta, checkpoint.geometry, source)
    return checkpoint


def require_same_geometry(meta: SidecarMetadata, geometry: AttentionGeometry, source: str | os.PathLike) -> None:
    """Refuse (one line) a checkpoint whose block geometry differs from the one the package records."""
    if geometry.to_dict() != meta.geometry:
        raise AnelabInputError(
            f"checkpoint {source} has a different geometry than the package records; pass the checkpoint it was exported from"
        )


@dataclass
class FunctionInputs:
    """Inputs of one per-history function ``h<H>`` (C = chunk, D = hidden, Hkv = KV heads, d = head_dim).

    hidden     [C, D]        fp16 chunk rows (absolute positions H .. H+C-1)
    k_history  [H, Hkv, d]   fp16 cached keys (normed and rotated), v_history likewise
    """

    function: str
    history: int
    hidden: np.ndarray
    k_history: np.ndarray
    v_history: np.ndarray


def random_function_inputs(
    function: str,
    chunk: int,
    weights: AttentionWeights,
    geometry: AttentionGeometry,
    rng: np.random.Generator,
    *,
    rope_coverage: int | None = None,
    precision: str = "fp64",
) -> FunctionInputs:
    """Random history rows projected by the reference (``precision``) into the cache, then random chunk
    rows. The cache is stored as fp16, so the precision only picks which fp16 inputs the check uses;
    ``rope_coverage``: the package coverage, for a dynamic / longrope RoPE table."""
    history = history_of(function)
    hidden_history = rng.standard_normal((history, geometry.hidden_size)).astype(np.float16)
    k_hist, v_hist = reference.history_kv(hidden_history, weights, geometry, precision, rope_coverage=rope_coverage)
    hidden = rng.standard_normal((chunk, geometry.hidden_size)).astype(np.float16)
    return FunctionInputs(function, history, hidden, k_hist.astype(np.float16), v_hist.astype(np.float16))


def run_package(
    saved: SavedPackage,
    inputs: FunctionInputs,
    mask: np.ndarray,
    *,
    hidden: np.ndarray | None = None,
    fp16: bool = True,
    evaluator: Evaluator | None = None,
) -> dict[str, np.ndarray]:
    """The saved function's outputs (attn_out [C, D], k_chunk/v_chunk [Hkv, C, d]) under ``mask``
    [C, H + C], evaluated from disk with NumPy (or by ``evaluator``, e.g. Core ML on a Mac);
    ``hidden`` [C, D] replaces the inputs' chunk rows."""
    feed = {"hidden": inputs.hidden if hidden is None else hidden, "mask": np.asarray(mask, dtype=np.float16)}
    if inputs.history > 0:
        feed.update(k_history=inputs.k_history, v_history=inputs.v_history)
    if evaluator is not None:
        return evaluator(inputs.function, feed)
    return evaluate(saved, inputs.function, feed, fp16=fp16)


class Evaluator(Protocol):
    """Runs one function of the package being verified in place of the NumPy evaluation (the seam for
    Core ML on a Mac: ``anelab.runtime.device.CoreMLEvaluator``): ``evaluator(function, inputs,
    state=None) -> outputs``, names and shapes as in the package's signature; ``make_state(function)``
    gives a fresh state for a stateful function and ``state_arrays(state)`` reads it back; ``name``
    labels the report."""

    name: str

    def __call__(self, function: str, inputs: dict, state=None) -> dict: ...

    def make_state(self, function: str): ...

    def state_arrays(self, state) -> dict[str, np.ndarray]:
        """The caches a state holds after the calls (state name -> array [Hkv, capacity, d])."""


def run_reference(
    inputs: FunctionInputs,
    weights: AttentionWeights,
    geometry: AttentionGeometry,
    mask: np.ndarray,
    *,
    hidden: np.ndarray | None = None,
    start: int | None = None,
    rope_coverage: int | None = None,
    precision: str = "fp64",
    rows: int | None = None,
) -> reference.BlockOutput:
    """The reference block on the same inputs (``precision`` "fp64" or "fp32"); ``start`` moves the
    chunk's RoPE positions (a negative control), ``hidden`` [C, D] replaces the chunk rows,
    ``rope_coverage`` picks a dynamic / longrope table.

    ``rows``: compute only the chunk's first ``rows`` rows (attn_out [rows, D], k/v_chunk [Hkv, rows, d]).
    A row's outputs depend only on the keys it sees, so these equal the first rows of the full run,
    provided no such row sees a key past its own chunk rows (refused otherwise).
    """
    hidden = inputs.hidden if hidden is None else hidden
    mask = np.asarray(mask)
    if rows is not None:
        end = inputs.history + rows
        if not 0 < rows <= hidden.shape[0]:
            raise AnelabInputError(f"rows must be in 1..{hidden.shape[0]}, got {rows}")
        if np.any(mask[:rows, end:] > MASKED / 2):
            raise AnelabInputError(f"the mask lets one of the first {rows} rows see a later row; use all rows")
        hidden, mask = hidden[:rows], mask[:rows, :end]
    dtype = reference.PRECISIONS.get(precision, np.float64)  # an unknown precision is refused by the reference
    cast = lambda a: np.asarray(a, dtype=dtype)
    return reference.attention_block(
        cast(hidden),
        cast(inputs.k_history),
        cast(inputs.v_history),
        cast(mask),
        weights,
        geometry,
        start=start,
        precision=precision,
        rope_coverage=rope_coverage,
    )


def reference_error(
    inputs: FunctionInputs,
    weights: AttentionWeights,
    geometry: AttentionGeometry,
    mask: np.ndarray,
    ref: reference.BlockOutput,
    rows: int = REFERENCE_CHECK_ROWS,
    *,
    rope_coverage: int | None = None,
) -> tuple[int, dict[str, float]]:
    """The reference ``ref``'s own error: its first ``rows`` rows against an fp64 run of those rows.
    Returns (rows used, relative error per output)."""
    rows = min(rows, inputs.hidden.shape[0])
    exact = run_reference(inputs, weights, geometry, mask, precision="fp64", rows=rows, rope_coverage=rope_coverage)
    return rows, output_errors(_first_rows(ref, rows), exact, rows)


def _first_rows(ref: reference.BlockOutput, rows: int) -> dict[str, np.ndarray]:
    return {"attn_out": ref.attn_out[:rows], "k_chunk": ref.k_chunk[:, :rows], "v_chunk": ref.v_chunk[:, :rows]}


def output_errors(out: dict, ref: reference.BlockOutput, rows: int, names=OUTPUTS) -> dict[str, float]:
    """Relative error of each named output over the first ``rows`` chunk rows."""
    errors = {}
    for name in names:
        actual, expected = np.asarray(out[name]), getattr(ref, name)
        if name == "attn_out":
            errors[name] = relative_error(actual[:rows], expected[:rows])
        else:  # [Hkv, C, d]
            errors[name] = relative_error(actual[:, :rows], expected[:, :rows])
    return errors
