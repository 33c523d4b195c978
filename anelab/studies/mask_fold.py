"""Notebook 02's back-end: budget sweep, greedy-vs-raw comparison, the per-width study."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from anelab.arms.arm_runs import Arm, Indexer
from anelab.arms.real_text import run_pair
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.core.masks import causal, dense_exact_window
from anelab.core.progress import tqdm
from anelab.core.records import make_record
from anelab.core.selection import Selection
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD, relative_error
from anelab.sidecar.checks.foldcheck import (
    MIN_MOVE_OVER_THRESHOLD,
    FoldCase,
    FoldCheck,
    VacuousFoldCheck,
    fold_check,
    make_case,
    run_package,
    run_reference,
    selection_for,
)
from anelab.sidecar.export import export_layer

DEFAULT_VOCAB = 4096


def export_fold_sidecar(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    chunk: int,
    histories: list[int] | None = None,
    layer: int | None = None,
) -> Path:
    """Export one full-attention layer (default: the first) with functions h0, h<chunk> (default).

    Returns the path of ``out_dir/layer_<L>.mlpackage``.
    """
    checkpoint = load_checkpoint(checkpoint_dir)
    layer = checkpoint.geometry.full_attention_layers[0] if layer is None else int(layer)
    histories = [0, int(chunk)] if histories is None else list(histories)
    return export_layer(checkpoint, layer, int(chunk), histories, out_dir).package


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


def budget_point(
    case: FoldCase,
    kept_blocks: int,
    compress_ratio: int,
    *,
    projection: np.ndarray | None = None,
    baseline: _Baseline | None = None,
) -> BudgetPoint:
    """One point of the sweep (the notebook's budget slider calls this)."""
    baseline = baseline or _baseline(case, compress_ratio)
    projection = vocab_projection(case.geometry.hidden_size, seed=case.seed) if projection is None else projection
    sel = selection_for(case, kept_blocks, compress_ratio)
    mask = sel.mask()
    ref, pkg = run_reference(case, mask), run_package(case, mask)
    residual = case.hidden.astype(np.float64)
    agreement = greedy_agreement(
        greedy_tokens(residual, pkg, projection), greedy_tokens(residual, baseline.package, projection)
    )
    return BudgetPoint(
        kept_blocks=int(kept_blocks),
        compress_ratio=int(compress_ratio),
        budget=dense_exact_window(kept_blocks, compress_ratio),
        mean_kept_keys=float(sel.keep_counts.mean()),
        reference_moved=relative_error(ref, baseline.reference),
        package_moved=relative_error(pkg, baseline.package),
        fold_error=relative_error(pkg, ref),
        greedy_agreement=agreement,
    )


def budget_sweep(
    case: FoldCase, kept_blocks: list[int], compress_ratio: int, *, progress: bool = True
) -> list[BudgetPoint]:
    """``budget_point`` for each kept_blocks value, all against the widest budget's output.

    Progress: a bar on a terminal or in JupyterLab, none in a headless run (``anelab.core.progress``)."""

    baseline = _baseline(case, compress_ratio)
    projection = vocab_projection(case.geometry.hidden_size, seed=case.seed)
    return [
        budget_point(case, kb, compress_ratio, projection=projection, baseline=baseline)
        for kb in tqdm(list(kept_blocks), desc="budget sweep", unit="budget", disable=not progress)
    ]


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
            "greedy_tokens needs residual and attn_out [C, D] and projection [D, vocab]; "
            f"got {residual.shape}, {attn_out.shape}, {projection.shape}"
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
    return GreedyComparison(
        greedy_agreement(ta, tb),
        bool(np.array_equal(ta, tb)),
        relative_error(wrong, folded),
        relative_error(logits_b, logits_a),
        RELATIVE_ERROR_THRESHOLD,
    )


def sweep_kept_blocks(total: int, compress_ratio: int, smallest_keys: int = 8) -> list[int]:
    """Kept-blocks values for a budget sweep, widest first: every visible key (total // ratio blocks),
    a few blocks fewer (where the greedy check stops seeing a difference), then halving down to
    ``smallest_keys`` kept keys."""
    ratio = int(compress_ratio)
    if ratio < 1 or smallest_keys < 1 or total < 1:
        raise AnelabInputError(
            f"sweep needs total, compress_ratio and smallest_keys >= 1, got {total}, {compress_ratio}, {smallest_keys}"
        )
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
    check: FoldCheck  # the QSA-shaped selection, package vs reference
    control: FoldCheck  # the package fed a seeded random-score selection's mask: must fail
    greedy: GreedyComparison  # at the edge selection: text-like check vs raw difference
    edge_kept_blocks: int
    edge: FoldCheck  # the fold check at the edge selection
    sweep: list[BudgetPoint]
    vacuous_message: str  # what the check says when the selection keeps every key

    @property
    def chunk(self) -> int:
        return self.case.chunk

    def to_dict(self) -> dict:
        return {
            "chunk": self.case.chunk,
            "history": self.case.history,
            "function": self.case.function,
            "package": self.case.saved.path.name,
            "check": self.check.to_dict(),
            "control": self.control.to_dict(),
            "greedy": self.greedy.to_dict(),
            "edge_kept_blocks": self.edge_kept_blocks,
            "edge": self.edge.to_dict(),
            "sweep": [p.to_dict() for p in self.sweep],
            "vacuous_message": self.vacuous_message,
        }


def study_width(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    chunk: int,
    *,
    kept_blocks: int,
    compress_ratio: int,
    seed: int = 0,
    edge_fraction: float = 0.875,
    smallest_keys: int = 8,
) -> WidthStudy:
    """Export the sidecar at ``chunk`` (functions h0, h<chunk>) and run every check on h<chunk>."""
    package = export_fold_sidecar(checkpoint_dir, Path(out_dir) / f"chunk{int(chunk)}", chunk)
    case = make_case(package, load_checkpoint(checkpoint_dir), seed=seed)
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


def study_record(studies: list[WidthStudy], parameters: dict, real: dict | None = None) -> dict:
    """A measured record (kind ``mask_fold``) of the study's numbers at every width (and ``real``: the
    default-real section's comparisons, budget name -> ``TextPair.to_dict()`` with its separation)."""

    if not studies:
        raise AnelabInputError("no widths studied; nothing to record")
    return make_record(
        "mask_fold",
        {
            **parameters,
            "threshold": RELATIVE_ERROR_THRESHOLD,
            "min_move_over_threshold": MIN_MOVE_OVER_THRESHOLD,
            "evaluator": "anelab.sidecar.mil.evaluate (saved package, NumPy, fp16 storage emulated)",
            "reference": "anelab.core.reference fp64",
        },
        {"widths": {str(s.chunk): s.to_dict() for s in studies}, **({"real_text": real} if real else {})},
        unknown=["Core ML / ANE numerics (this run evaluates the saved program with NumPy)"],
    )


# ---- real text (default-real): folded vs causal-only selection on the whole model's real attention ------------
def real_fold_comparison(model, prompt: np.ndarray, tokenizer, kept_blocks: int, compress_ratio: int, *,
                         decode: int, chunk: int):  # fmt: skip
    """The model read as sparse-indexed (``arms.arm_runs.Indexer``: ``kept_blocks`` blocks of ``compress_ratio`` keys,
    scored on each layer's own q/k) on ``prompt`` (int [P], real text): the folded arm (selection in the mask)
    against the causal-only arm (a sidecar without the fold), both on the reference attention, decoded greedily
    -> ``real_text.TextPair`` (causal-only against folded)."""

    indexer = Indexer(int(kept_blocks), int(compress_ratio))
    arms = (Arm("folded", "reference", indexer, fold=True), Arm("causal-only", "reference", indexer, fold=False))
    return run_pair(model, prompt, arms, tokenizer, decode=decode, chunk=chunk)


def separation(pair, threshold: float = RELATIVE_ERROR_THRESHOLD) -> dict:
    """Where two arms' logits separate while their text agrees (``pair``: a ``real_text.TextPair``): the decode
    steps before the texts differ, the logits difference there (max and at the last prompt position), how many of
    those steps exceed ``threshold``, and the first layer whose hidden state differs beyond it."""
    c = pair.comparison
    agreeing = pair.agreeing_steps
    diffs = [c.step_logits_diffs[i] for i in agreeing]
    return {
        "text_identical": c.identical_text,
        "first_divergent_step": c.first_divergent_step,
        "agreeing_steps": len(agreeing),
        "prompt_logits_diff": c.prompt_logits_diff,
        "max_logits_diff_while_agreeing": max(diffs, default=None),
        "agreeing_steps_beyond_threshold": sum(d > threshold for d in diffs),
        "first_layer_beyond_threshold": c.first_divergent_layer,
        "last_layer_diff": c.layer_diffs[-1],
        "threshold": threshold,
    }
