"""Study 7's back-end: folded vs causal-only arms over indexer budgets, notebook 02's one-layer proxy beside
the whole-model check, and the study's record."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from anelab.arms.arm_comparison import NOISE, PairComparison, compare_runs
from anelab.arms.arm_runs import Arm, Indexer, run_arms
from anelab.arms.real_text import run_pair
from anelab.arms.sidecars import SidecarSet
from anelab.checkpoints.checkpoint import Checkpoint, load_checkpoint
from anelab.checkpoints.whole_model import ModelCheckpoint, write_random_model
from anelab.core.errors import AnelabInputError
from anelab.core.masks import dense_exact_window
from anelab.core.progress import tqdm
from anelab.core.records import make_record
from anelab.sidecar.checks.foldcheck import make_case, selection_for
from anelab.sidecar.checks.verify_cases import verify_per_history_package
from anelab.sidecar.export import export_sidecars
from anelab.studies.mask_fold import greedy_comparison


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
    package: str | os.PathLike, checkpoint: Checkpoint, kept_blocks: int, compress_ratio: int, seed: int = 0
):
    """Notebook 02's stand-in for the text check on one layer (``anelab.studies.mask_fold.greedy_comparison``):
    the package's longest function under the folded vs the causal-only mask, argmax over a random projection."""

    case = make_case(package, checkpoint, seed=seed)
    return greedy_comparison(case, selection_for(case, kept_blocks, compress_ratio))


def arms_record(
    parameters: dict,
    pairs: dict[str, PairComparison],
    sweep: list[WindowPoint],
    proxy: list[dict],
    real: dict | None = None,
) -> dict:
    """A measured record (kind ``whole_model_arms``) of the per-layer differences, the sweep and the proxy (and
    ``real``: the default-real sections' results — the sidecar arm on real text, the verify margins)."""

    return make_record(
        "whole_model_arms",
        {**parameters, "noise": NOISE, "evaluator": "saved packages evaluated with NumPy (fp16 storage emulated)"},
        {
            "pairs": {k: p.to_dict() for k, p in pairs.items()},
            "sweep": [p.to_dict() for p in sweep],
            "proxy": proxy,
            **({"real_text": real} if real else {}),
        },
        unknown=["Core ML / ANE numerics (this run evaluates the saved programs with NumPy)"],
    )


# ---- real text (default-real): the sidecar arm against the reference, and the verify margin -------------------
def real_sidecar_comparison(
    model: ModelCheckpoint, prompt: np.ndarray, sidecars: SidecarSet, tokenizer, *, decode: int
):
    """The reference arm and the sidecar arm (every attention layer from its saved package) on ``prompt`` (int
    [P], real text), both decoded greedily -> ``real_text.TextPair`` (sidecar against reference)."""

    arms = (Arm("reference"), Arm("sidecar", "sidecar"))
    return run_pair(model, prompt, arms, tokenizer, decode=decode, sidecars=sidecars)


@dataclass
class MarginRow:
    """One package's verification, summarised: ``error`` the worst relative error of the comparisons held to the
    fp16 threshold (package vs the reference with the weights the graph holds; full and partial chunk, every
    function), ``compression`` the worst against the checkpoint's uncompressed weights (reported, not judged;
    None for fp16), ``control_margin`` the weakest negative control over its bound (> 1: every control failed)."""

    checkpoint: str
    mode: str
    inputs: str  # "random rows" or "prompt activations"
    layer: int
    error: float
    threshold: float
    compression: float | None
    control_margin: float
    passed: bool

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def margin_row(report, checkpoint: str, mode: str, inputs: str) -> MarginRow:
    """A ``MarginRow`` from one ``sidecar.checks.verify_cases.VerifyReport``."""
    checked = [c for c in report.comparisons if not c.control and not c.cost and c.bound is None]
    compressed = [c for c in report.comparisons if c.cost]
    controls = [c.worst / (report.threshold if c.bound is None else c.bound) for c in report.comparisons if c.control]
    if not checked or not controls:
        raise AnelabInputError(f"{report.package}: the report holds no checked comparison or no control")
    return MarginRow(
        checkpoint, mode, inputs, report.layer, max(c.worst for c in checked), report.threshold,
        max((c.worst for c in compressed), default=None), min(controls), report.passed,
    )  # fmt: skip


def verify_margins(
    checkpoint,
    out_dir,
    modes: list[str],
    layers: list[int],
    *,
    chunk: int,
    activations: dict[int, np.ndarray] | None = None,
    label: str | None = None,
) -> list[MarginRow]:
    """Export ``layers`` of ``checkpoint`` in each weight mode (functions h0, h<chunk>) and verify every package
    (``verify_cases.verify_per_history_package``) on random rows and, when ``activations`` (layer -> post-norm
    rows [P >= 2 chunk, D], ``real_text.attention_inputs``) is given, on those real rows too."""
    from pathlib import Path

    label, opened = label or Path(checkpoint).name, load_checkpoint(checkpoint)
    rows = []
    for mode in tqdm(list(modes), desc="weight modes", unit="mode"):
        results = export_sidecars(opened, Path(out_dir) / mode, int(chunk), [0, int(chunk)], list(layers),
                                  weights_mode=mode)  # fmt: skip
        for result in results:
            layer = int(result.metadata.layer)
            report = verify_per_history_package(result.package, opened, progress=False)
            rows.append(margin_row(report, label, mode, "random rows"))
            if activations is not None:
                report = verify_per_history_package(result.package, opened, progress=False,
                                                    activations=activations[layer])  # fmt: skip
                rows.append(margin_row(report, label, mode, "prompt activations"))
    return rows


def margin_summary(rows: list[MarginRow]) -> dict[tuple[str, str, str], dict]:
    """(checkpoint, mode, inputs) -> min / median / max of the per-layer error (and of the compression error)."""
    groups: dict[tuple[str, str, str], list[MarginRow]] = {}
    for r in rows:
        groups.setdefault((r.checkpoint, r.mode, r.inputs), []).append(r)
    out = {}
    for key, group in groups.items():
        errors = np.array([r.error for r in group])
        entry = {"layers": len(group), "min": float(errors.min()), "median": float(np.median(errors)),
                 "max": float(errors.max()), "headroom": float(group[0].threshold / errors.max()),
                 "passed": all(r.passed for r in group)}  # fmt: skip
        comp = [r.compression for r in group if r.compression is not None]
        if comp:
            entry.update(compression_max=float(max(comp)), compression_median=float(np.median(comp)))
        out[key] = entry
    return out


def random_twin(model: ModelCheckpoint, directory, layers: int, *, vocab: int = 2048, seed: int = 0):
    """A random-weight checkpoint of ``model``'s attention geometry with ``layers`` layers (``vocab`` words,
    the same MLP width): what the verify margin is beside, weights aside."""
    import dataclasses
    from pathlib import Path

    g = dataclasses.replace(model.geometry, num_layers=int(layers), full_attention_layers=tuple(range(int(layers))))
    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    return write_random_model(directory, g, vocab=vocab, intermediate=model.intermediate, seed=seed, tied=model.tied)


def layer_kind_summary(geometry, layer_diffs) -> dict[str, dict]:
    """The per-layer differences (``PairComparison.layer_diffs``, one float per decoder layer [L]) split by the
    layer's attention kind in ``geometry`` (``core.geometry.AttentionGeometry``): "sliding" (its
    ``sliding_layers``, window ``sliding_window``) and "global" (every other attention layer) -> per kind its
    layers, the largest and the median difference; a kind with no layer is left out."""
    diffs = [float(d) for d in layer_diffs]
    if len(diffs) != geometry.num_layers:
        raise AnelabInputError(f"{len(diffs)} layer differences for a model of {geometry.num_layers} layers")
    sliding = set(geometry.sliding_layers)
    kinds = {"sliding": sorted(sliding), "global": sorted(set(geometry.full_attention_layers) - sliding)}
    return {
        kind: {"layers": layers, "max": max(diffs[i] for i in layers),
               "median": float(np.median([diffs[i] for i in layers]))}
        for kind, layers in kinds.items() if layers
    }  # fmt: skip
