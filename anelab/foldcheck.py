"""The mask-fold study: a saved sidecar fed a sparse indexer's folded selection, and the checks that
show the fold is honoured — and that a wrong mask would be caught.

One ``FoldCase`` is one function h<H> of a saved sidecar with fixed inputs: random fp16 hidden rows
for the chunk and for the history (the history's K/V made by ``anelab.reference.history_kv``), and
the real projections q [C, Hq, d] and k [T, Hkv, d] the indexer scores (``reference.project``).
A ``Selection`` (``anelab.selection.select``) folded into the mask then drives two computations:

- the *package*: the saved program evaluated from disk (``anelab.mil_eval``, fp16 storage emulated);
- the *reference*: ``anelab.reference.attention_block`` in float64 with the same mask.

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
from pathlib import Path

import numpy as np

from anelab import reference
from anelab.checkpoint import AttentionWeights, load_checkpoint
from anelab.errors import AnelabInputError
from anelab.export import export_layer, function_name, history_of, read_sidecar_metadata
from anelab.geometry import AttentionGeometry
from anelab.masks import causal, dense_exact_window
from anelab.mil_eval import SavedPackage, evaluate
from anelab.selection import Selection, select
from anelab.verify import RELATIVE_ERROR_THRESHOLD, relative_error

# The selection must move the reference by at least this multiple of the pass threshold; below it a
# package computing the causal-only answer could pass the fold check.
MIN_MOVE_OVER_THRESHOLD = 2.0
DEFAULT_VOCAB = 4096


class VacuousFoldCheck(AnelabInputError):
    """The selection barely moves the reference, so the fold check could not fail."""


# ---- the sidecar and its inputs ------------------------------------------------------------------

def export_fold_sidecar(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, chunk: int,
                        histories: list[int] | None = None, layer: int | None = None) -> Path:
    """Export one full-attention layer (default: the first) with functions h0, h<chunk> (default).

    Returns the path of ``out_dir/layer_<L>.mlpackage``.
    """
    checkpoint = load_checkpoint(checkpoint_dir)
    layer = checkpoint.geometry.full_attention_layers[0] if layer is None else int(layer)
    histories = [0, int(chunk)] if histories is None else list(histories)
    return export_layer(checkpoint, layer, int(chunk), histories, out_dir).package


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

    @property
    def history(self) -> int:
        return history_of(self.function)

    @property
    def chunk(self) -> int:
        return int(self.hidden.shape[0])

    @property
    def total(self) -> int:
        return self.history + self.chunk


def make_case(package: str | os.PathLike | SavedPackage, checkpoint_dir: str | os.PathLike,
              history: int | None = None, *, seed: int = 0) -> FoldCase:
    """Inputs for function h<history> of a saved sidecar (default: its longest history)."""
    saved = package if isinstance(package, SavedPackage) else SavedPackage(package)
    meta = read_sidecar_metadata(saved.path)
    history = max(meta.histories) if history is None else int(history)
    if history not in meta.histories:
        raise AnelabInputError(f"{saved.path.name} has no function h{history}; it has {', '.join(meta.functions)}")
    checkpoint = load_checkpoint(checkpoint_dir)
    if checkpoint.geometry.to_dict() != meta.geometry:
        raise AnelabInputError(f"checkpoint {checkpoint_dir} is not the one {saved.path.name} was exported from; pass that checkpoint")
    weights, geometry = checkpoint.layer(meta.layer), checkpoint.geometry
    rng = np.random.default_rng([int(seed), history, meta.chunk])
    rows = rng.standard_normal((history + meta.chunk, geometry.hidden_size)).astype(np.float16)
    hidden_history, hidden = rows[:history], rows[history:]
    k_hist, v_hist = reference.history_kv(hidden_history.astype(np.float64), weights, geometry, "fp64")
    proj = reference.project(rows.astype(np.float64), np.arange(history + meta.chunk), weights, geometry, "fp64")
    return FoldCase(saved, function_name(history), weights, geometry, hidden, k_hist.astype(np.float16),
                    v_hist.astype(np.float16), proj.q[history:], proj.k, int(seed))


def selection_for(case: FoldCase, kept_blocks: int, compress_ratio: int, score: str = "qk", seed: int = 0) -> Selection:
    """The QSA-shaped selection of the case's chunk (``anelab.selection.select`` on its q/k)."""
    return select(case.q, case.k, case.history, kept_blocks, compress_ratio, score=score, seed=seed)


def run_package(case: FoldCase, mask: np.ndarray) -> np.ndarray:
    """attn_out [C, D] float16 of the saved function under ``mask`` [C, T] (evaluated from disk)."""
    inputs = {"hidden": case.hidden, "mask": np.asarray(mask, dtype=np.float16)}
    if case.history > 0:
        inputs.update(k_history=case.k_history, v_history=case.v_history)
    return evaluate(case.saved, case.function, inputs)["attn_out"]


def run_reference(case: FoldCase, mask: np.ndarray) -> np.ndarray:
    """attn_out [C, D] float64 of the reference block under ``mask`` [C, T]."""
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    return reference.attention_block(f64(case.hidden), f64(case.k_history), f64(case.v_history), f64(mask),
                                     case.weights, case.geometry, precision="fp64").attn_out


# ---- the fold check --------------------------------------------------------------------------------

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


def fold_check(case: FoldCase, selection: Selection, *, package_mask: np.ndarray | None = None,
               strict: bool = True, threshold: float = RELATIVE_ERROR_THRESHOLD) -> FoldCheck:
    """Check the saved package under ``selection`` folded into its mask against the reference.

    package_mask: what the *package* is fed instead of the folded selection (a negative control:
    a wrong mask must fail the check); the reference always uses the selection.
    strict: raise ``VacuousFoldCheck`` when the selection moves the reference too little.
    """
    if selection.start != case.history or selection.chunk != case.chunk:
        raise AnelabInputError(
            f"the selection is for start {selection.start}, chunk {selection.chunk}; the case is h{case.history}, chunk {case.chunk}"
        )
    folded = selection.mask()
    truth = run_reference(case, folded)
    moved = relative_error(run_reference(case, causal(case.chunk, case.history)), truth)
    visible = case.history + np.arange(case.chunk) + 1
    result = FoldCheck(
        chunk=case.chunk, history=case.history, kept_blocks=selection.kept_blocks, compress_ratio=selection.compress_ratio,
        budget=selection.budget, mean_kept_keys=float(selection.keep_counts.mean()), mean_visible_keys=float(visible.mean()),
        fold_error=relative_error(run_package(case, folded if package_mask is None else package_mask), truth),
        causal_off=relative_error(run_package(case, causal(case.chunk, case.history)), truth),
        moved=moved, threshold=float(threshold),
    )
    if strict and result.vacuous:
        raise VacuousFoldCheck(
            f"vacuous fold check: the selection moves the reference by {moved:.2e}, below "
            f"{MIN_MOVE_OVER_THRESHOLD:g} x the {threshold:.0e} threshold, so a graph ignoring the mask would pass; "
            f"use fewer kept blocks or a longer history"
        )
    return result


# ---- the budget sweep -------------------------------------------------------------------------------

@dataclass
class BudgetPoint:
    """How far one budget moves the raw output from the widest budget's (relative, attn_out)."""

    kept_blocks: int
    compress_ratio: int
    budget: int
    mean_kept_keys: float
    reference_moved: float
    package_moved: float
    fold_error: float
    greedy_agreement: float

    def to_dict(self) -> dict:
        return asdict(self)


def widest_kept_blocks(case: FoldCase, compress_ratio: int) -> int:
    """Kept blocks at which every row of the case keeps every visible key (the dense end)."""
    return max(1, case.total // int(compress_ratio))


@dataclass(eq=False)
class _Baseline:
    reference: np.ndarray
    package: np.ndarray


def _baseline(case: FoldCase, compress_ratio: int) -> _Baseline:
    sel = selection_for(case, widest_kept_blocks(case, compress_ratio), compress_ratio)
    mask = sel.mask()
    return _Baseline(run_reference(case, mask), run_package(case, mask))


def budget_point(case: FoldCase, kept_blocks: int, compress_ratio: int, *, projection: np.ndarray | None = None,
                 baseline: _Baseline | None = None) -> BudgetPoint:
    """One point of the sweep (the notebook's budget slider calls this)."""
    baseline = baseline or _baseline(case, compress_ratio)
    projection = vocab_projection(case.geometry.hidden_size, seed=case.seed) if projection is None else projection
    sel = selection_for(case, kept_blocks, compress_ratio)
    mask = sel.mask()
    ref, pkg = run_reference(case, mask), run_package(case, mask)
    residual = case.hidden.astype(np.float64)
    agreement = greedy_agreement(greedy_tokens(residual, pkg, projection), greedy_tokens(residual, baseline.package, projection))
    return BudgetPoint(
        kept_blocks=int(kept_blocks), compress_ratio=int(compress_ratio), budget=dense_exact_window(kept_blocks, compress_ratio),
        mean_kept_keys=float(sel.keep_counts.mean()), reference_moved=relative_error(ref, baseline.reference),
        package_moved=relative_error(pkg, baseline.package), fold_error=relative_error(pkg, ref), greedy_agreement=agreement,
    )


def budget_sweep(case: FoldCase, kept_blocks: list[int], compress_ratio: int, *, progress: bool = True) -> list[BudgetPoint]:
    """``budget_point`` for each kept_blocks value, all against the widest budget's output.

    Progress goes to stderr as plain text (``tqdm.std``), which an executed notebook keeps readable."""
    from tqdm.std import tqdm

    baseline = _baseline(case, compress_ratio)
    projection = vocab_projection(case.geometry.hidden_size, seed=case.seed)
    return [budget_point(case, kb, compress_ratio, projection=projection, baseline=baseline)
            for kb in tqdm(list(kept_blocks), desc="budget sweep", unit="budget", disable=not progress)]


# ---- a text-like check beside the raw one ------------------------------------------------------------

def vocab_projection(hidden_size: int, vocab: int = DEFAULT_VOCAB, seed: int = 0) -> np.ndarray:
    """A fixed random "unembedding" float64 [D, vocab] ~ N(0, 1/D), standing in for the LM head."""
    if hidden_size < 1 or vocab < 2:
        raise AnelabInputError(f"vocab projection needs hidden_size >= 1 and vocab >= 2, got {hidden_size}, {vocab}")
    return np.random.default_rng([int(seed), 0x70CAB]).standard_normal((hidden_size, vocab)) / np.sqrt(hidden_size)


def greedy_tokens(residual: np.ndarray, attn_out: np.ndarray, projection: np.ndarray) -> np.ndarray:
    """Greedy "token" per row: argmax over ((residual + attn_out) @ projection), int64 [C].

    residual, attn_out: [C, D] — the block adds its attention branch to the residual stream, and a
    greedy decode reads the stream, not the branch alone; projection: [D, vocab].
    """
    residual, attn_out = np.asarray(residual, dtype=np.float64), np.asarray(attn_out, dtype=np.float64)
    if residual.shape != attn_out.shape or residual.ndim != 2 or projection.shape[0] != residual.shape[1]:
        raise AnelabInputError(
            f"greedy_tokens needs residual and attn_out [C, D] and projection [D, vocab]; got {residual.shape}, {attn_out.shape}, {projection.shape}"
        )
    return np.argmax((residual + attn_out) @ projection, axis=-1)


def greedy_agreement(tokens_a: np.ndarray, tokens_b: np.ndarray) -> float:
    """Fraction of rows whose greedy tokens agree."""
    a, b = np.asarray(tokens_a), np.asarray(tokens_b)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise AnelabInputError(f"greedy_agreement needs two equal non-empty token vectors, got {a.shape} and {b.shape}")
    return float(np.mean(a == b))


@dataclass
class GreedyComparison:
    """The folded arm against the causal-only arm, judged two ways.

    greedy_agreement: fraction of rows with the same argmax token (the "text" check);
    attn_out_diff:    relative difference of the raw attention outputs;
    logits_diff:      relative difference of the logits (residual + attn_out) @ projection.
    """

    greedy_agreement: float
    identical_tokens: bool
    attn_out_diff: float
    logits_diff: float
    threshold: float

    def to_dict(self) -> dict:
        return asdict(self)


def greedy_comparison(case: FoldCase, selection: Selection, *, vocab: int = DEFAULT_VOCAB) -> GreedyComparison:
    """Package under the folded selection vs package under the causal-only mask (the wrong one)."""
    projection = vocab_projection(case.geometry.hidden_size, vocab, case.seed)
    residual = case.hidden.astype(np.float64)
    folded = run_package(case, selection.mask())
    wrong = run_package(case, causal(case.chunk, case.history))
    ta, tb = greedy_tokens(residual, folded, projection), greedy_tokens(residual, wrong, projection)
    logits_a = (residual + folded.astype(np.float64)) @ projection
    logits_b = (residual + wrong.astype(np.float64)) @ projection
    return GreedyComparison(greedy_agreement(ta, tb), bool(np.array_equal(ta, tb)), relative_error(wrong, folded),
                            relative_error(logits_b, logits_a), RELATIVE_ERROR_THRESHOLD)


# ---- one width of the study ---------------------------------------------------------------------------

def sweep_kept_blocks(total: int, compress_ratio: int, smallest_keys: int = 8) -> list[int]:
    """Kept-blocks values for a budget sweep, widest first: every visible key (total // ratio blocks),
    a few blocks fewer (where the greedy check stops seeing a difference), then halving down to
    ``smallest_keys`` kept keys."""
    ratio = int(compress_ratio)
    if ratio < 1 or smallest_keys < 1 or total < 1:
        raise AnelabInputError(f"sweep needs total, compress_ratio and smallest_keys >= 1, got {total}, {compress_ratio}, {smallest_keys}")
    widest = max(1, int(total) // ratio)
    points = {widest, widest - 1, widest - 2, widest - widest // 8, widest - widest // 4}
    kb = widest
    while kb // 2 * ratio >= smallest_keys:
        kb //= 2
        points.add(kb)
    points.add(max(1, smallest_keys // ratio))
    return sorted((p for p in points if 1 <= p <= widest), reverse=True)


def edge_kept_blocks(total: int, compress_ratio: int, fraction: float = 0.875) -> int:
    """Kept blocks whose window covers ``fraction`` of the coverage: the indexer drops only the last
    few blocks a row sees — the regime of the seed's greedy comparison."""
    if not 0 < fraction < 1:
        raise AnelabInputError(f"edge fraction must be in (0, 1), got {fraction}")
    return max(1, int(int(total) // int(compress_ratio) * fraction))


@dataclass(eq=False)
class WidthStudy:
    """Every mask-fold check at one chunk width (function h<history> of one saved sidecar)."""

    case: FoldCase
    check: FoldCheck               # the QSA-shaped selection, package vs reference
    control: FoldCheck             # the package fed a seeded random-score selection's mask: must fail
    greedy: GreedyComparison       # at the edge selection: text-like check vs raw difference
    edge_kept_blocks: int
    edge: FoldCheck                # the fold check at the edge selection
    sweep: list[BudgetPoint]
    vacuous_message: str           # what the check says when the selection keeps every key

    @property
    def chunk(self) -> int:
        return self.case.chunk

    def to_dict(self) -> dict:
        return {
            "chunk": self.case.chunk, "history": self.case.history, "function": self.case.function,
            "package": self.case.saved.path.name, "check": self.check.to_dict(), "control": self.control.to_dict(),
            "greedy": self.greedy.to_dict(), "edge_kept_blocks": self.edge_kept_blocks, "edge": self.edge.to_dict(),
            "sweep": [p.to_dict() for p in self.sweep], "vacuous_message": self.vacuous_message,
        }


def study_width(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, chunk: int, *, kept_blocks: int,
                compress_ratio: int, seed: int = 0, edge_fraction: float = 0.875, smallest_keys: int = 8) -> WidthStudy:
    """Export the sidecar at ``chunk`` (functions h0, h<chunk>) and run every check on h<chunk>."""
    package = export_fold_sidecar(checkpoint_dir, Path(out_dir) / f"chunk{int(chunk)}", chunk)
    case = make_case(package, checkpoint_dir, seed=seed)
    selection = selection_for(case, kept_blocks, compress_ratio)
    check = fold_check(case, selection)
    random_sel = selection_for(case, kept_blocks, compress_ratio, score="random", seed=seed + 1)
    control = fold_check(case, selection, package_mask=random_sel.mask(), strict=False)
    edge_kb = edge_kept_blocks(case.total, compress_ratio, edge_fraction)
    edge_sel = selection_for(case, edge_kb, compress_ratio)
    edge = fold_check(case, edge_sel, strict=False)
    greedy = greedy_comparison(case, edge_sel)
    sweep = budget_sweep(case, sweep_kept_blocks(case.total, compress_ratio, smallest_keys), compress_ratio)
    try:
        fold_check(case, selection_for(case, widest_kept_blocks(case, compress_ratio), compress_ratio))
        message = "NOT vacuous (unexpected): a selection keeping every key moved the reference"
    except VacuousFoldCheck as e:
        message = str(e)
    return WidthStudy(case, check, control, greedy, edge_kb, edge, sweep, message)


def study_record(studies: list[WidthStudy], parameters: dict) -> dict:
    """A measured record (kind ``mask_fold``) of the study's numbers at every width."""
    from anelab.records import make_record

    if not studies:
        raise AnelabInputError("no widths studied; nothing to record")
    return make_record(
        "mask_fold",
        {**parameters, "threshold": RELATIVE_ERROR_THRESHOLD, "min_move_over_threshold": MIN_MOVE_OVER_THRESHOLD,
         "evaluator": "anelab.mil_eval (saved package, NumPy, fp16 storage emulated)", "reference": "anelab.reference fp64"},
        {"widths": {str(s.chunk): s.to_dict() for s in studies}},
        unknown=["Core ML / ANE numerics (this run evaluates the saved program with NumPy)"],
    )
