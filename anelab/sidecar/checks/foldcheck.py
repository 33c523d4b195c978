"""The mask-fold study: a saved sidecar fed a sparse indexer's folded selection, and the checks that
show the fold is honoured — and that a wrong mask would be caught.

One ``FoldCase`` is one function h<H> of a saved sidecar with fixed inputs: random fp16 hidden rows
for the chunk and for the history (the history's K/V made by ``anelab.core.reference.history_kv``), and
the real projections q [C, Hq, d] and k [T, Hkv, d] the indexer scores (``reference.project``).
A ``Selection`` (``anelab.core.selection.select``) folded into the mask then drives two computations:

- the *package*: the saved program evaluated from disk (``anelab.sidecar.mil.evaluate``, fp16 storage emulated);
- the *reference*: ``anelab.core.reference.attention_block`` in float64 with the same mask.

The checks (``fold_check``), on the raw attention output ``attn_out`` [C, D]:

- ``fold_error``  ||package(selection) - reference(selection)|| / ||reference(selection)||: must be
  below ``RELATIVE_ERROR_THRESHOLD``. It is also the fp16 noise floor of this comparison.
- ``causal_off``  ||package(causal) - reference(selection)||: a sidecar fed only the causal mask, as
  before the fold. Must be far above the threshold; reported as a multiple of the noise floor.
- ``moved``       ||reference(causal) - reference(selection)||: how far the selection moves the truth.
  If it is below ``MIN_MOVE_OVER_THRESHOLD`` x the threshold, a graph that ignored the selection
  could pass, so the check is *vacuous* and fails (``VacuousFoldCheck``).

``budget_sweep`` shrinks the kept blocks (all visible keys -> a few) and reports how far the raw
output moves; ``greedy_comparison`` puts a text-like check (argmax over a fixed random "vocab"
projection of the residual stream) beside the raw difference, reproducing the seed's lesson that a
greedy comparison can agree under the wrong mask while the outputs differ.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import numpy as np

from anelab.checkpoints.checkpoint import Checkpoint
from anelab.core import reference
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.masks import causal, require_visible_key
from anelab.core.selection import Selection, select
from anelab.core.weights import AttentionWeights
from anelab.sidecar.backends import open_saved, read_metadata
from anelab.sidecar.checks import comparison as compare
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD, load_matching_checkpoint, relative_error
from anelab.sidecar.drivers import run_stateful_tiled, stateful_mask
from anelab.sidecar.format import function_name, history_of
from anelab.sidecar.mil.evaluate import SavedPackage

# The selection must move the reference by at least this multiple of the pass threshold; below it a
# package computing the causal-only answer could pass the fold check.
MIN_MOVE_OVER_THRESHOLD = 2.0


class VacuousFoldCheck(AnelabInputError):
    """The selection barely moves the reference, so the fold check could not fail."""


@dataclass(eq=False)
class FoldCase:
    """Fixed inputs of one sidecar function, and the projections the indexer scores.

    hidden     [C, D]        fp16 chunk rows (absolute positions H .. H+C-1)
    k_history  [H, Hkv, d]   fp16 cached keys, v_history likewise
    q          [C, Hq, d]    float64 queries of the chunk (normed, rotated)
    k          [T, Hkv, d]   float64 keys of positions 0 .. T-1 (T = H + C)
    """

    saved: SavedPackage
    function: str
    weights: AttentionWeights
    geometry: AttentionGeometry
    hidden: np.ndarray
    k_history: np.ndarray
    v_history: np.ndarray
    q: np.ndarray
    k: np.ndarray
    seed: int
    window: int | None = None  # the package's sliding window (tokens); the fold composes with it
    rope_coverage: int | None = None  # the package coverage (dynamic / longrope RoPE table)

    @property
    def inputs(self) -> compare.FunctionInputs:
        """The function's inputs as the shared runners take them."""
        return compare.FunctionInputs(self.function, self.history, self.hidden, self.k_history, self.v_history)

    @property
    def history(self) -> int:
        return history_of(self.function)

    @property
    def chunk(self) -> int:
        return int(self.hidden.shape[0])

    @property
    def total(self) -> int:
        return self.history + self.chunk


def make_case(
    package: str | os.PathLike | SavedPackage,
    checkpoint: Checkpoint | None,
    history: int | None = None,
    *,
    seed: int = 0,
) -> FoldCase:
    """Inputs for function h<history> of a saved sidecar (default: its longest history)."""
    saved = package if hasattr(package, "evaluate") else open_saved(package)
    meta = read_metadata(saved.path)
    history = max(meta.histories) if history is None else int(history)
    if history not in meta.histories:
        raise AnelabInputError(f"{saved.path.name} has no function h{history}; it has {', '.join(meta.functions)}")
    checkpoint = load_matching_checkpoint(meta, checkpoint)
    weights, geometry = checkpoint.layer(meta.layer), checkpoint.geometry
    rng = np.random.default_rng([int(seed), history, meta.chunk])
    rows = rng.standard_normal((history + meta.chunk, geometry.hidden_size)).astype(np.float16)
    hidden_history, hidden = rows[:history], rows[history:]
    cover = meta.coverage
    k_hist, v_hist = reference.history_kv(
        hidden_history.astype(np.float64), weights, geometry, "fp64", rope_coverage=cover
    )
    proj = reference.project(
        rows.astype(np.float64), np.arange(history + meta.chunk), weights, geometry, "fp64", rope_coverage=cover
    )
    return FoldCase(
        saved,
        function_name(history),
        weights,
        geometry,
        hidden,
        k_hist.astype(np.float16),
        v_hist.astype(np.float16),
        proj.q[history:],
        proj.k,
        int(seed),
        meta.sliding_window,
        cover,
    )


def selection_for(case: FoldCase, kept_blocks: int, compress_ratio: int, score: str = "qk", seed: int = 0) -> Selection:
    """The QSA-shaped selection of the case's chunk (``anelab.core.selection.select`` on its q/k)."""
    return select(case.q, case.k, case.history, kept_blocks, compress_ratio, score=score, seed=seed)


def run_package(case: FoldCase, mask: np.ndarray, evaluator: compare.Evaluator | None = None) -> np.ndarray:
    """attn_out [C, D] float16 of the saved function under ``mask`` [C, T] (evaluated from disk with
    NumPy, or by ``evaluator``: Core ML on a Mac)."""
    return np.asarray(compare.run_package(case.saved, case.inputs, mask, evaluator=evaluator)["attn_out"])


def run_reference(case: FoldCase, mask: np.ndarray) -> np.ndarray:
    """attn_out [C, D] float64 of the reference block under ``mask`` [C, T]."""
    return compare.run_reference(
        case.inputs, case.weights, case.geometry, mask, rope_coverage=case.rope_coverage
    ).attn_out


def windowed(case: FoldCase, mask: np.ndarray | None = None) -> np.ndarray:
    """The case's causal mask with its sliding window, or ``mask`` [C, T] composed with it
    (a key dropped by either is dropped)."""
    base = causal(case.chunk, case.history, window=case.window)
    if mask is None:
        return base
    composed = np.minimum(mask, base)
    require_visible_key(composed, case.history)
    return composed


@dataclass
class FoldCheck:
    """Numbers of one fold check (relative errors of attn_out; see the module docstring)."""

    chunk: int
    history: int
    kept_blocks: int
    compress_ratio: int
    budget: int
    mean_kept_keys: float
    mean_visible_keys: float
    fold_error: float
    causal_off: float
    moved: float
    threshold: float

    @property
    def noise_ratio(self) -> float:
        """causal_off as a multiple of the fp16 noise floor (fold_error)."""
        return self.causal_off / self.fold_error if self.fold_error > 0 else float("inf")

    @property
    def vacuous(self) -> bool:
        return self.moved < MIN_MOVE_OVER_THRESHOLD * self.threshold

    @property
    def passed(self) -> bool:
        return (not self.vacuous) and self.fold_error < self.threshold and self.causal_off > self.threshold

    def to_dict(self) -> dict:
        return {**asdict(self), "noise_ratio": self.noise_ratio, "vacuous": self.vacuous, "passed": self.passed}


def fold_check(
    case: FoldCase,
    selection: Selection,
    *,
    package_mask: np.ndarray | None = None,
    strict: bool = True,
    threshold: float = RELATIVE_ERROR_THRESHOLD,
    evaluator: compare.Evaluator | None = None,
) -> FoldCheck:
    """Check the saved package under ``selection`` folded into its mask against the reference.

    package_mask: what the *package* is fed instead of the folded selection (a negative control:
    a wrong mask must fail the check); the reference always uses the selection.
    strict: raise ``VacuousFoldCheck`` when the selection moves the reference too little.
    """
    if selection.start != case.history or selection.chunk != case.chunk:
        raise AnelabInputError(
            f"the selection is for start {selection.start}, chunk {selection.chunk}; the case is h{case.history}, chunk {case.chunk}"
        )
    folded = windowed(case, selection.mask())
    truth = run_reference(case, folded)
    moved = relative_error(run_reference(case, windowed(case)), truth)
    visible = case.history + np.arange(case.chunk) + 1
    result = FoldCheck(
        chunk=case.chunk,
        history=case.history,
        kept_blocks=selection.kept_blocks,
        compress_ratio=selection.compress_ratio,
        budget=selection.budget,
        mean_kept_keys=float(selection.keep_counts.mean()),
        mean_visible_keys=float(visible.mean()),
        fold_error=relative_error(
            run_package(case, folded if package_mask is None else package_mask, evaluator), truth
        ),
        causal_off=relative_error(run_package(case, windowed(case), evaluator), truth),
        moved=moved,
        threshold=float(threshold),
    )
    if strict and result.vacuous:
        raise VacuousFoldCheck(
            f"vacuous fold check: the selection moves the reference by {moved:.2e}, below "
            f"{MIN_MOVE_OVER_THRESHOLD:g} x the {threshold:.0e} threshold, so a graph ignoring the mask would pass; "
            f"use fewer kept blocks or a longer history"
        )
    return result


def stateful_tiled_fold_check(
    saved: SavedPackage, checkpoint: Checkpoint | None, *, kept_blocks: int, compress_ratio: int, seed: int = 0
) -> FoldCheck:
    """The fold check of a stateful-tiled package with an ``additive`` mask input.

    Random fp16 rows fill the cache through the package (causal mask, chunk by chunk) up to the last
    whole chunk's start H = capacity - C; that chunk is then run with the indexer's selection (scored
    from the reference's q/k of all H + C rows) folded into its [C, capacity] mask — slots past
    H + C dropped — and compared with the fp64 reference under the same mask, beside the same call
    fed the causal-only mask (must miss) and how far the selection moves the reference (must be at
    least ``MIN_MOVE_OVER_THRESHOLD`` x the threshold: else the check is reported vacuous)."""
    meta = read_metadata(saved.path)
    if not meta.state_functions or meta.mask_mode != "additive":
        raise AnelabInputError(
            f"{saved.path.name}: the stateful fold check needs a stateful-tiled package exported with --mask-mode additive"
        )
    checkpoint = load_matching_checkpoint(meta, checkpoint)
    weights, geometry, C, N = checkpoint.layer(meta.layer), checkpoint.geometry, meta.chunk, meta.state_capacity
    H = N - C
    rng = np.random.default_rng([int(seed), H, C])
    rows = rng.standard_normal((N, geometry.hidden_size)).astype(np.float16)
    proj = reference.project(rows.astype(np.float64), np.arange(N), weights, geometry, "fp64", rope_coverage=N)
    selection = select(proj.q[H:], proj.k, H, kept_blocks, compress_ratio, seed=seed)
    folded = np.minimum(selection.mask(), causal(C, H))  # [C, N]: N = H + C, nothing past the chunk
    require_visible_key(folded, H)
    _, filled = run_stateful_tiled(saved, rows[:H], C, N)

    def package(mask: np.ndarray) -> np.ndarray:
        state = {name: value.copy() for name, value in filled.items()}
        out, _ = run_stateful_tiled(saved, rows[H:], C, N, first_start=H, state=state, masks=lambda r, s: mask)
        return out

    k_hist, v_hist = reference.history_kv(rows[:H].astype(np.float64), weights, geometry, "fp64", rope_coverage=N)

    def truth(mask: np.ndarray) -> np.ndarray:
        return reference.attention_block(
            rows[H:].astype(np.float64), k_hist, v_hist, mask.astype(np.float64), weights, geometry,
            precision="fp64", rope_coverage=N,
        ).attn_out  # fmt: skip

    expected = truth(folded)
    return FoldCheck(
        chunk=C,
        history=H,
        kept_blocks=selection.kept_blocks,
        compress_ratio=selection.compress_ratio,
        budget=selection.budget,
        mean_kept_keys=float(selection.keep_counts.mean()),
        mean_visible_keys=float((H + np.arange(C) + 1).mean()),
        fold_error=relative_error(package(folded.astype(np.float16)), expected),
        causal_off=relative_error(package(stateful_mask(C, H, N)), expected),
        moved=relative_error(truth(causal(C, H)), expected),
        threshold=float(RELATIVE_ERROR_THRESHOLD),
    )
