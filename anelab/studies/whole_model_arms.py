"""Study 7's back-end: folded vs causal-only arms over indexer budgets, notebook 02's one-layer proxy beside
the whole-model check, and the study's record."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from anelab.arms.compare import NOISE, PairComparison, compare_runs
from anelab.arms.run import Arm, Indexer, run_arms
from anelab.arms.sidecars import SidecarSet
from anelab.checkpoints.model import ModelCheckpoint


@dataclass
class WindowPoint:
    """Folded vs causal-only arms at one indexer budget (``window`` = its dense-exact window in keys)."""

    kept_blocks: int
    window: int
    comparison: PairComparison

    def to_dict(self) -> dict:
        return {"kept_blocks": self.kept_blocks, "window": self.window, **self.comparison.to_dict()}


def window_sweep(
    model: ModelCheckpoint,
    prompt: np.ndarray,
    kept_blocks: list[int],
    compress_ratio: int,
    *,
    decode: int,
    sidecars: SidecarSet | None = None,
    chunk: int | None = None,
) -> list[WindowPoint]:
    """For each kept-blocks value: the folded arm against the causal-only arm (on the sidecars when given)."""
    from anelab.core.masks import dense_exact_window
    from anelab.core.progress import tqdm

    served = "sidecar" if sidecars is not None else "reference"
    points = []
    for kb in tqdm(list(kept_blocks), desc="indexer budgets", unit="budget"):
        indexer = Indexer(int(kb), int(compress_ratio))
        arms = [Arm(name, served, indexer, fold=fold) for name, fold in (("folded", True), ("causal-only", False))]
        runs = run_arms(model, prompt, arms, decode=decode, chunk=chunk, sidecars=sidecars, keep_hidden=False,
                        layer_pairs=(("folded", "causal-only"),))  # fmt: skip
        points.append(WindowPoint(int(kb), dense_exact_window(kb, compress_ratio), compare_runs(*runs.values())))
    return points


def greedy_proxy(
    package: str | os.PathLike, checkpoint: str | os.PathLike, kept_blocks: int, compress_ratio: int, seed: int = 0
):
    """Notebook 02's stand-in for the text check on one layer (``anelab.studies.mask_fold.greedy_comparison``):
    the package's longest function under the folded vs the causal-only mask, argmax over a random projection."""
    from anelab.sidecar.foldcheck import make_case, selection_for
    from anelab.studies.mask_fold import greedy_comparison

    case = make_case(package, checkpoint, seed=seed)
    return greedy_comparison(case, selection_for(case, kept_blocks, compress_ratio))


def arms_record(
    parameters: dict, pairs: dict[str, PairComparison], sweep: list[WindowPoint], proxy: list[dict]
) -> dict:
    """A measured record (kind ``whole_model_arms``) of the per-layer differences, the sweep and the proxy."""
    from anelab.core.records import make_record

    return make_record(
        "whole_model_arms",
        {**parameters, "noise": NOISE, "evaluator": "saved packages evaluated with NumPy (fp16 storage emulated)"},
        {"pairs": {k: p.to_dict() for k, p in pairs.items()}, "sweep": [p.to_dict() for p in sweep], "proxy": proxy},
        unknown=["Core ML / ANE numerics (this run evaluates the saved programs with NumPy)"],
    )
