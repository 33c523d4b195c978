"""The mask-fold study (anelab.sidecar.checks.foldcheck): each check passes on the right mask and fails on a wrong
one, a wrong window, or a selection too close to the causal mask (vacuous).

Packages are exported once per module from the tiny qwen3_next checkpoint at two chunk widths.
The independent truth for the folded package is computed here row by row: gather each row's kept
keys, softmax, weight values, gate, o_proj — no mask, no reference.attention_block.
"""

from __future__ import annotations

import numpy as np
import pytest

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core import reference
from anelab.core.errors import AnelabInputError
from anelab.core.masks import causal
from anelab.core.records import validate_record
from anelab.core.selection import Selection
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD, relative_error
from anelab.sidecar.checks.foldcheck import (
    MIN_MOVE_OVER_THRESHOLD,
    FoldCase,
    VacuousFoldCheck,
    fold_check,
    make_case,
    run_package,
    selection_for,
)
from anelab.studies.mask_fold import (
    budget_sweep,
    edge_kept_blocks,
    export_fold_sidecar,
    greedy_agreement,
    greedy_comparison,
    greedy_tokens,
    study_record,
    study_width,
    sweep_kept_blocks,
    widest_kept_blocks,
)

WIDTHS = (8, 16)
LONG = 15  # the long-history function: h<15 x chunk>
KEPT_BLOCKS, RATIO = 2, 4  # dense-exact window 11 keys; rows of h<C> see C+1 .. 2C keys


@pytest.fixture(scope="module")
def cases(tiny_checkpoint, tmp_path_factory):
    ckpt = tiny_checkpoint("qwen3_next")
    out = tmp_path_factory.mktemp("fold")
    result = {}
    for chunk in WIDTHS:
        # h<15 chunks> as well: a long history, where one dropped key barely moves the output
        pkg = export_fold_sidecar(ckpt, out / f"c{chunk}", chunk, histories=[0, chunk, LONG * chunk])
        result[chunk] = make_case(pkg, load_checkpoint(ckpt), history=chunk, seed=3)
        result["long", chunk] = make_case(pkg, load_checkpoint(ckpt), history=LONG * chunk, seed=3)
    return result


def selected_attention_by_rows(case: FoldCase, selection: Selection) -> np.ndarray:
    """attn_out [C, D] of the selected attention, one row and one head at a time (float64)."""
    g, w = case.geometry, case.weights
    rows = np.concatenate([np.zeros((case.history, g.hidden_size)), case.hidden.astype(np.float64)])
    # the history's K/V are what the package gets (fp16-rounded); recompute the chunk's own
    proj = reference.project(rows, np.arange(case.total), w, g, "fp64")
    k = np.concatenate([case.k_history.astype(np.float64), proj.k[case.history :]])
    v = np.concatenate([case.v_history.astype(np.float64), proj.v[case.history :]])
    q, gate = proj.q[case.history :], proj.gate[case.history :]
    out = np.zeros((case.chunk, g.num_heads, g.head_dim))
    for i in range(case.chunk):
        kept = selection.keep_indices[i, : selection.keep_counts[i]]
        for h in range(g.num_heads):
            kv = h // (g.num_heads // g.num_kv_heads)
            s = k[kept, kv] @ q[i, h] / np.sqrt(g.head_dim)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[kept, kv]
    out *= 1.0 / (1.0 + np.exp(-gate))
    return out.reshape(case.chunk, -1) @ w.o_proj.astype(np.float64).T


@pytest.mark.parametrize("chunk", WIDTHS)
def test_fold_check_passes_at_both_widths(cases, chunk):
    case = cases[chunk]
    sel = selection_for(case, KEPT_BLOCKS, RATIO)
    visible = case.history + np.arange(case.chunk) + 1
    assert np.mean(sel.keep_counts < visible) >= 0.5  # most rows drop keys: the check is about a real selection
    check = fold_check(case, sel)
    assert check.passed and not check.vacuous
    assert check.fold_error < RELATIVE_ERROR_THRESHOLD
    assert check.causal_off > 10 * RELATIVE_ERROR_THRESHOLD
    assert check.noise_ratio > 100  # the causal-only package is far beyond the fp16 noise floor


def test_package_under_fold_matches_row_by_row_selected_attention(cases):
    case = cases[16]
    sel = selection_for(case, KEPT_BLOCKS, RATIO)
    package = run_package(case, sel.mask())
    assert relative_error(package, selected_attention_by_rows(case, sel)) < RELATIVE_ERROR_THRESHOLD
    # negative control: the row-by-row truth of a different selection does not match
    other = selection_for(case, KEPT_BLOCKS, RATIO, score="random", seed=5)
    assert not np.array_equal(other.keep_indices, sel.keep_indices)
    assert relative_error(package, selected_attention_by_rows(case, other)) > RELATIVE_ERROR_THRESHOLD


@pytest.mark.parametrize("wrong", ["causal", "random selection", "window one block narrower"])
def test_fold_check_fails_when_the_package_gets_a_wrong_mask(cases, wrong):
    case = cases[16]
    sel = selection_for(case, KEPT_BLOCKS + 1, RATIO)
    masks = {
        "causal": causal(case.chunk, case.history),
        "random selection": selection_for(case, KEPT_BLOCKS + 1, RATIO, score="random", seed=9).mask(),
        "window one block narrower": selection_for(case, KEPT_BLOCKS, RATIO).mask(),
    }
    check = fold_check(case, sel, package_mask=masks[wrong], strict=False)
    assert not check.passed
    assert check.fold_error > RELATIVE_ERROR_THRESHOLD


def test_selection_keeping_every_key_is_vacuous(cases):
    case = cases[8]
    everything = selection_for(case, widest_kept_blocks(case, RATIO), RATIO)
    assert np.array_equal(everything.mask(), causal(case.chunk, case.history))
    with pytest.raises(VacuousFoldCheck, match="vacuous"):
        fold_check(case, everything)
    check = fold_check(case, everything, strict=False)
    assert check.vacuous and not check.passed and check.moved == 0.0


def test_selection_dropping_one_key_is_vacuous(cases):
    """Causal except that the last row drops one of its 128 keys: the reference barely moves."""
    case = cases["long", 8]
    C, H = case.chunk, case.history
    budget = H + C
    keep = np.zeros((C, budget), np.int32)
    counts = np.zeros(C, np.int32)
    for i in range(C):
        visible = np.arange(H + i + 1)
        if i == C - 1:
            visible = visible[visible != H // 2]
        keep[i, : visible.size] = visible
        counts[i] = visible.size
    barely = Selection(keep, counts, kept_blocks=budget, compress_ratio=1, start=H)
    check = fold_check(case, barely, strict=False)
    assert 0 < check.moved < MIN_MOVE_OVER_THRESHOLD * RELATIVE_ERROR_THRESHOLD
    assert check.vacuous and not check.passed
    with pytest.raises(VacuousFoldCheck):
        fold_check(case, barely)


def test_budget_sweep_moves_the_raw_output(cases):
    case = cases[16]
    widest = widest_kept_blocks(case, RATIO)
    points = budget_sweep(case, [widest, widest // 2, 2, 1], RATIO, progress=False)
    assert points[0].package_moved == 0.0 and points[0].reference_moved == 0.0
    moved = [p.package_moved for p in points]
    assert moved == sorted(moved)  # fewer kept keys, further from the every-key output
    assert moved[-1] > 30 * RELATIVE_ERROR_THRESHOLD
    for p in points:
        assert p.fold_error < RELATIVE_ERROR_THRESHOLD  # the package follows the mask at every budget
        assert abs(p.package_moved - p.reference_moved) < RELATIVE_ERROR_THRESHOLD


def test_greedy_tokens_and_agreement_hand_computed():
    projection = np.eye(3)
    attn_out = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    assert greedy_tokens(np.zeros((2, 3)), attn_out, projection).tolist() == [0, 2]
    residual = np.array([[0.0, 5.0, 0.0], [0.0, 0.0, 0.0]])
    assert greedy_tokens(residual, attn_out, projection).tolist() == [1, 2]
    assert greedy_agreement(np.array([0, 1, 2]), np.array([0, 1, 1])) == pytest.approx(2 / 3)
    with pytest.raises(AnelabInputError):
        greedy_agreement(np.array([0, 1]), np.array([0, 1, 2]))


def test_greedy_check_agrees_with_the_wrong_mask_while_the_raw_output_differs(cases):
    """The seed's lesson: near the dense-exact window every greedy token agrees, yet attn_out is off."""
    case = cases[16]
    edge = selection_for(case, edge_kept_blocks(case.total, RATIO), RATIO)
    check = fold_check(case, edge)
    greedy = greedy_comparison(case, edge)
    assert greedy.identical_tokens and greedy.greedy_agreement == 1.0
    assert greedy.attn_out_diff > RELATIVE_ERROR_THRESHOLD
    assert greedy.attn_out_diff > 10 * check.fold_error
    # and the comparison can tell arms apart when the difference is large (it is not constant 1.0)
    far = greedy_comparison(case, selection_for(case, 1, RATIO))
    assert far.greedy_agreement < 1.0


def test_sweep_points_hand_computed():
    # 64 keys / 4 = 16 blocks: 16, 15, 14, 16 - 16//4 = 12, then halving to 8 kept keys: 8, 4, 2
    assert sweep_kept_blocks(64, 4) == [16, 15, 14, 12, 8, 4, 2]
    assert edge_kept_blocks(64, 4, 0.875) == 14
    with pytest.raises(AnelabInputError):
        edge_kept_blocks(64, 4, 1.5)


def test_study_width_and_record(tiny_checkpoint, tmp_path):
    study = study_width(tiny_checkpoint("qwen3_next"), tmp_path, 8, kept_blocks=KEPT_BLOCKS, compress_ratio=RATIO)
    assert study.check.passed and not study.control.passed
    assert "vacuous" in study.vacuous_message
    record = study_record([study], {"widths": [8]})
    validate_record(record, "test")
    assert record["kind"] == "mask_fold" and record["origin"] == "measured"
    assert record["results"]["widths"]["8"]["check"]["passed"] is True


def test_mismatched_selection_is_refused(cases):
    case = cases[8]
    other_start = selection_for(cases[16], KEPT_BLOCKS, RATIO)
    with pytest.raises(AnelabInputError, match="selection is for start"):
        fold_check(case, other_start)
    with pytest.raises(AnelabInputError, match="no function h3"):
        make_case(case.saved, None, history=3)


class _MaskIgnoringPackage:
    """An evaluator standing in for a graph that ignores its mask input: every call is evaluated from disk
    under one fixed mask (the selection), whatever mask it is fed — the failure the causal-only control exists
    to catch (a fold error alone cannot: the folded output is then exactly right)."""

    name = "a package that ignores its mask"

    def __init__(self, case: FoldCase, fixed_mask: np.ndarray):
        from anelab.sidecar.mil.evaluate import evaluate

        self.case, self.fixed, self.evaluate = case, fixed_mask, evaluate

    def __call__(self, function, inputs, state=None):
        return self.evaluate(self.case.saved, function, {**inputs, "mask": self.fixed.astype(np.float16)})


def test_a_package_that_ignores_its_mask_fails_on_the_causal_only_control_alone(cases):
    """Issue 31: the fold check passes only when the causal-only mask moves the package's output
    (``causal_off > threshold``). A package deaf to its mask input computes the folded output exactly, so its
    fold error and the vacuity guard both pass; the causal-only control is what fails it."""
    case = cases[16]
    sel = selection_for(case, KEPT_BLOCKS + 1, RATIO)
    honest = fold_check(case, sel)
    assert honest.passed and honest.causal_off > RELATIVE_ERROR_THRESHOLD  # the negative control's control
    deaf = fold_check(case, sel, evaluator=_MaskIgnoringPackage(case, sel.mask()))
    assert deaf.fold_error < RELATIVE_ERROR_THRESHOLD and not deaf.vacuous  # every other condition holds ...
    assert deaf.causal_off < RELATIVE_ERROR_THRESHOLD  # ... the causal-only mask does not move the output ...
    assert not deaf.passed  # ... and that alone fails the check
