"""Comparing a package's outputs with the reference: relative error, the threshold, one comparison."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from threadpoolctl import threadpool_limits

from anelab.checkpoints.checkpoint import Checkpoint, load_checkpoint
from anelab.checkpoints.config import CONFIG_FILE
from anelab.checkpoints.formats import is_checkpoint
from anelab.core import reference
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.masks import MASKED
from anelab.core.weights import AttentionWeights
from anelab.sidecar.format import SidecarMetadata, history_of
from anelab.sidecar.mil.evaluate import SavedPackage
from anelab.sidecar.mil.kernels import worker_count

# fp16 storage gives ~1e-3 relative error on this block (measured: see the closing note of issue 2);
# 1 % leaves room for long rows while every negative control lands well above it.
RELATIVE_ERROR_THRESHOLD = 1e-2


OUTPUTS = ("attn_out", "k_chunk", "v_chunk")


# The reference verify compares against. fp32 is enough: against a threshold of 1e-2 what matters is the
# reference's own error, which verify measures every run against an fp64 run on REFERENCE_CHECK_ROWS
# rows of each function (from the second reference block on: see reference_error; measured: ~1e-7 at hidden 2048 / head_dim 128 / 12k keys)
# and refuses above REFERENCE_ERROR_BOUND. By the triangle inequality an error measured against the fp32
# reference differs from the one against fp64 by at most that own error, so it cannot hide a real error.
REFERENCE_PRECISION = "fp32"
REFERENCE_CHECK_ROWS = 64
REFERENCE_ERROR_BOUND = RELATIVE_ERROR_THRESHOLD / 100
# run_reference computes this many chunk rows per reference call, each against only the keys its rows can see
REFERENCE_BLOCK_ROWS = 512


# The RoPE negative control moves the chunk's positions by rope_control_offset: enough positions that the layer's
# median rotary pair turns by a radian. Pair i turns base^(-2i/d) radians per position, so one position turns the
# median pair base^(-1/2) radians: 1e-3 on Gemma 3's global layers (base 1e6, head 256), where a +1 control on real
# text moved the outputs 7.9e-3 (measured here), under the threshold it must clear; real q/k weigh the slow pairs.
ROPE_CONTROL_TURN = 1.0  # radians the median rotary pair turns under the control's offset


def rope_control_offset(geometry: AttentionGeometry, layer: int, coverage: int | None = None) -> int:
    """Positions the RoPE control shifts the chunk by on ``layer``: the fewest at which the median pair of the
    layer's own table (its base, rotary size, scaling; ``coverage`` as ``rope_frequencies``) turns by at least
    ``ROPE_CONTROL_TURN`` radians (1 on a table whose median pair already turns that far)."""
    inv_freq, _ = geometry.rope_frequencies(layer, coverage)
    return max(1, int(np.ceil(ROPE_CONTROL_TURN / float(np.median(inv_freq)))))


def rope_control_case(offset: int) -> str:
    """The RoPE control's case label (the offset in positions)."""
    return f"control: rope offset +{offset}"


ERROR_SLAB_ELEMENTS = 1 << 20  # relative_error converts this many elements to float64 at a time


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """||actual - expected|| / ||expected|| in float64 (inf when expected is all zero and actual is not).

    Same-shape arrays are taken in slabs along the first axis (``ERROR_SLAB_ELEMENTS`` at a time), each
    converted to float64, so no float64 copy of a whole output is made; other shapes broadcast."""
    a, e = np.asarray(actual), np.asarray(expected)
    if a.shape != e.shape or a.ndim == 0:
        a, e = np.broadcast_arrays(a.astype(np.float64), e.astype(np.float64))
    step = max(1, ERROR_SLAB_ELEMENTS // max(1, int(np.prod(a.shape[1:], dtype=np.int64))))
    num = den = 0.0
    for i in range(0, a.shape[0], step):
        e64 = e[i : i + step].astype(np.float64).ravel()
        d = a[i : i + step].astype(np.float64).ravel()
        d -= e64
        num += float(np.einsum("i,i->", d, d))  # NumPy's own loop: no BLAS threads for a dot product
        den += float(np.einsum("i,i->", e64, e64))
    num, den = np.sqrt(num), np.sqrt(den)
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
    bound: float | None = None  # this comparison's own threshold (a control's: the fold check's minimum move)
    cost: bool = False  # what a weight compression costs (package vs the uncompressed weights): reported, never judged

    @property
    def worst(self) -> float:
        return max(self.errors.values())

    @property
    def passed(self) -> bool:
        """A comparison passes when under the threshold; a control when clearly above it; a compression's cost is
        reported, not judged (no bound measured on random weights says what real weights may lose)."""
        if self.cost:
            return True
        if self.control:
            return self.worst > (RELATIVE_ERROR_THRESHOLD if self.bound is None else self.bound)
        return self.worst <= (RELATIVE_ERROR_THRESHOLD if self.bound is None else self.bound)


# ---- the checkpoint a package came from, and one function's inputs run both ways -----------------


def load_matching_checkpoint(meta: SidecarMetadata, checkpoint: Checkpoint | None = None, digests=None) -> Checkpoint:
    """The checkpoint a package was exported from: ``checkpoint`` (opened), else the one at the path the package
    records (``open_package_checkpoint``); refused (one line) when its geometry or tensors differ from the
    package's (``digests``: as ``require_same_tensors``)."""
    if checkpoint is None:
        checkpoint = open_package_checkpoint(meta.source)
    require_same_geometry(meta, checkpoint.geometry, checkpoint.path)
    require_same_tensors(meta, checkpoint, digests)
    return checkpoint


def open_package_checkpoint(source: str | os.PathLike) -> Checkpoint:
    """The checkpoint at ``source`` (the one a package records, or the user's ``--checkpoint``) opened, refused in one
    line when it is not one anelab reads."""
    source = Path(source)
    if not is_checkpoint(source):
        raise AnelabInputError(
            f"checkpoint {source} (recorded in the package) is not a checkpoint anelab reads (a directory with "
            f"{CONFIG_FILE}, a .gguf file); pass --checkpoint PATH"
        )
    return load_checkpoint(source)


def require_same_tensors(meta: SidecarMetadata, checkpoint: Checkpoint, digests=None) -> None:
    """Refuse (one line, naming the first differing tensor) a checkpoint whose attention tensors of the
    package's layer differ from those it was built from; the path does not matter (a copy or a new
    revision with the same tensors is accepted). A package that records no digests is not judged here.
    ``digests(checkpoint, layer)``: a block design's tensors instead (``designs.BlockReader.digests``)."""
    if meta.source_tensors is None:
        return
    stem = f"{checkpoint.prefix}layers.{meta.layer}."  # any block of that layer (attention, MLP, projections)
    foreign = sorted(name for name in meta.source_tensors if not name.startswith(stem))
    if foreign:  # the metadata's layer is not the one its own tensor digests were taken from
        raise AnelabInputError(
            f"the package's metadata names layer {meta.layer}, but the tensors it was built from are another "
            f"layer's ({foreign[0]}): its metadata was changed after export; re-export it"
        )
    have = checkpoint.attention_digests(meta.layer) if digests is None else digests(checkpoint, meta.layer)
    for name in sorted(set(meta.source_tensors) | set(have)):
        if meta.source_tensors.get(name) != have.get(name):
            how = (
                "is missing"
                if name not in have
                else ("was not in the exported layer" if name not in meta.source_tensors else "differs")
            )
            raise AnelabInputError(
                f"checkpoint {checkpoint.path}: tensor {name} {how} from the checkpoint layer_{meta.layer} was "
                f"exported from ({meta.source}); pass that checkpoint or re-export"
            )


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
    history_kv: tuple[np.ndarray, np.ndarray] | None = None,
) -> FunctionInputs:
    """Random history rows projected by the reference (``precision``) into the cache, then random chunk
    rows. The cache is stored as fp16, so the precision only picks which fp16 inputs the check uses;
    ``rope_coverage``: the package coverage, for a dynamic / longrope RoPE table.

    ``history_kv``: a longer cache (k, v fp16 [>= H, Hkv, d], from ``random_history``) whose first H
    positions become this function's cache, so functions share one projection; the chunk rows are
    then the only draws from ``rng``."""
    history = history_of(function)
    if history_kv is None:
        k_hist, v_hist = random_history(
            history, weights, geometry, rng, rope_coverage=rope_coverage, precision=precision
        )
    else:
        if history_kv[0].shape[0] < history:
            raise AnelabInputError(f"a shared cache of {history_kv[0].shape[0]} positions cannot serve {function}")
        k_hist, v_hist = history_kv[0][:history], history_kv[1][:history]
    hidden = rng.standard_normal((chunk, geometry.hidden_size), dtype=np.float32).astype(np.float16)
    return FunctionInputs(function, history, hidden, k_hist, v_hist)


def random_history(
    history: int,
    weights: AttentionWeights,
    geometry: AttentionGeometry,
    rng: np.random.Generator,
    *,
    rope_coverage: int | None = None,
    precision: str = "fp64",
) -> tuple[np.ndarray, np.ndarray]:
    """A cache of ``history`` positions: random fp16 rows [history, D] (drawn in order, so a shorter
    history from the same stream is this one's first rows) projected by the reference into
    (k_history, v_history) fp16 [history, Hkv, d]; a row's keys depend only on it and its position."""
    hidden_history = rng.standard_normal((history, geometry.hidden_size), dtype=np.float32).astype(np.float16)
    k_hist, v_hist = reference.history_kv(hidden_history, weights, geometry, precision, rope_coverage=rope_coverage)
    return k_hist.astype(np.float16), v_hist.astype(np.float16)


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
    return saved.evaluate(inputs.function, feed, fp16=fp16)


class Evaluator(Protocol):
    """Runs one function of the package being verified in place of the NumPy evaluation (the seam for
    Core ML on a Mac: ``anelab.runtimes.coreml.device_verify.CoreMLEvaluator``): ``evaluator(function, inputs,
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
    first_row: int = 0,
    block_rows: int = REFERENCE_BLOCK_ROWS,
) -> reference.BlockOutput:
    """The reference block on the same inputs (``precision`` "fp64" or "fp32"); ``start`` moves the
    chunk's RoPE positions (a negative control), ``hidden`` [C, D] replaces the chunk rows,
    ``rope_coverage`` picks a dynamic / longrope table.

    ``rows``: compute only ``rows`` chunk rows from ``first_row`` on (attn_out [rows, D], k/v_chunk
    [Hkv, rows, d]). A row's outputs depend only on the keys it sees, so these equal those rows of the
    full run, provided no such row sees a key past the last of them (refused otherwise).

    Chunks longer than ``block_rows`` are computed in blocks (``key_spans``): the chunk's keys and
    values are projected first, then every block runs — in parallel, ``kernels.worker_count`` threads
    with one BLAS thread each — against only the keys its rows can see (a causal chunk scores about
    the triangle instead of the square): the same softmax over the same visible keys as one call.
    """
    hidden = inputs.hidden if hidden is None else hidden
    mask = np.asarray(mask)
    C = hidden.shape[0]
    end_row = C if rows is None else first_row + rows
    if rows is not None:
        if not (0 < rows and 0 <= first_row and end_row <= C):
            raise AnelabInputError(f"rows {first_row}..{end_row - 1} must lie in the chunk's 0..{C - 1}")
        end = inputs.history + end_row
        if np.any(mask[first_row:end_row, end:] > MASKED / 2):
            raise AnelabInputError(
                f"the mask lets one of rows {first_row}..{end_row - 1} see a later row; use all rows"
            )
        hidden, mask = hidden[:end_row], mask[:end_row, :end]
    dtype = reference.PRECISIONS.get(precision, np.float64)  # an unknown precision is refused by the reference
    cast = lambda a: np.asarray(a, dtype=dtype)
    spans = key_spans(mask, inputs.history, block_rows, first_row=first_row)
    if spans is None:
        out = reference.attention_block(
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
        return reference.BlockOutput(out.attn_out[first_row:], out.k_chunk[:, first_row:], out.v_chunk[:, first_row:])
    first = inputs.history if start is None else int(start)
    return _reference_in_blocks(cast(hidden), inputs, mask, weights, geometry, spans, first, precision, rope_coverage)


def key_spans(
    mask: np.ndarray, history: int, block_rows: int = REFERENCE_BLOCK_ROWS, *, first_row: int = 0
) -> list[tuple[int, int, int]] | None:
    """How ``run_reference`` splits rows ``first_row`` .. C - 1 under the additive mask [C, H + C]:
    (r0, r1, j0) per block of up to ``block_rows`` rows, whose reference call scores keys j0 .. H + r1 - 1.

    The keys left out are dropped (<= masks.MASKED) for every row of the block, while each row sees
    some key: their softmax weight is exactly 0 — the rule ``reference.attention_block_tiled`` skips key
    tiles by. None (one plain call) when the rows are a single block from row 0, or when some block's
    rows see a key past its last row, or a row sees none."""
    rows = mask.shape[0]
    if first_row == 0 and block_rows >= rows:
        return None
    spans = []
    for r0 in range(first_row, rows, block_rows):
        r1 = min(r0 + block_rows, rows)
        kept = mask[r0:r1] > MASKED  # [rows, T]
        if not kept.any(axis=1).all() or kept[:, history + r1 :].any():
            return None
        spans.append((r0, r1, int(np.argmax(kept.any(axis=0)))))
    return spans


def _reference_in_blocks(hidden, inputs, mask, weights, geometry, spans, first, precision, rope_coverage):
    """The reference over ``key_spans`` blocks. hidden [R, D] in the precision's dtype; ``first``: the
    absolute position of row 0. The chunk rows before the last block are projected first
    (``reference.project``, in parallel slices) into a token-major cache [H + rows, Hkv, d] after the
    history, so the blocks are independent; each returns its own rows' outputs. Returns the rows
    ``spans`` cover."""
    g, dtype = geometry, hidden.dtype
    H, before = inputs.history, spans[-1][0]
    k_all = np.empty((H + before, g.num_kv_heads, g.head_dim), dtype)
    v_all = np.empty_like(k_all)
    k_all[:H], v_all[:H] = inputs.k_history, inputs.v_history

    def project(rows: tuple[int, int]) -> None:
        r0, r1 = rows
        p = reference.project(
            hidden[r0:r1], first + np.arange(r0, r1), weights, g, precision, rope_coverage=rope_coverage
        )
        k_all[H + r0 : H + r1], v_all[H + r0 : H + r1] = p.k, p.v

    def block(span: tuple[int, int, int]) -> reference.BlockOutput:
        r0, r1, j0 = span
        return reference.attention_block(
            hidden[r0:r1],
            k_all[j0 : H + r0],
            v_all[j0 : H + r0],
            np.asarray(mask[r0:r1, j0 : H + r1], dtype=dtype),
            weights,
            g,
            start=first + r0,
            precision=precision,
            rope_coverage=rope_coverage,
        )

    workers = worker_count(len(spans))
    step = max(1, -(-before // workers))
    with threadpool_limits(limits=1, user_api="blas"), ThreadPoolExecutor(workers) as pool:
        list(pool.map(project, [(r0, min(r0 + step, before)) for r0 in range(0, before, step)]))
        blocks = list(pool.map(block, spans[::-1]))[::-1]  # the costliest (last) blocks start first
    return reference.BlockOutput(
        np.concatenate([b.attn_out for b in blocks]),
        np.concatenate([b.k_chunk for b in blocks], axis=1),
        np.concatenate([b.v_chunk for b in blocks], axis=1),
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
    """The reference ``ref``'s own error: ``rows`` of its rows against an fp64 run of those rows.
    The rows start at ``REFERENCE_BLOCK_ROWS`` when the chunk is longer (else at 0): they see the
    history and earlier blocks' keys, so the check covers a blocked run's every path.
    Returns (rows used, relative error per output)."""
    C = inputs.hidden.shape[0]
    rows = min(rows, C)
    first = min(REFERENCE_BLOCK_ROWS, C - rows)
    exact = run_reference(
        inputs, weights, geometry, mask, precision="fp64", rows=rows, first_row=first, rope_coverage=rope_coverage
    )
    part = {"attn_out": ref.attn_out[first : first + rows]}
    part.update(k_chunk=ref.k_chunk[:, first : first + rows], v_chunk=ref.v_chunk[:, first : first + rows])
    return rows, output_errors(part, exact, rows)


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
