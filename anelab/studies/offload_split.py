"""Notebook 08's back-end: which blocks of prefill belong on the ANE — every split's predicted ratio against prompt
length and chip, each part's share of the GPU prefill (the seed's offload-share argument), the published splits.

The sweeps call the planner (``planner.offload_split``) once per (model, chip, prompt length); a model is either a
checkpoint on disk (its own config and plan, ``plan_from_checkpoint``) or a published configuration
(``offload_split.ModelSizes``, e.g. ``published_splits.QWEN38_27B``).
"""

from __future__ import annotations

from dataclasses import dataclass

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.default import resolve_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.planner.from_checkpoint import plan_from_checkpoint
from anelab.planner.offload_split import (
    ATTENTION,
    MLP,
    PROJECTIONS,
    ModelSizes,
    SplitInputs,
    checkpoint_parts,
    checkpoint_split_inputs,
    offload_splits,
    part_costs,
    sizes_split_inputs,
)
from anelab.planner.published_splits import ANE_SHAPE, published_vs_predicted

# the splits a figure draws (every other candidate is a union of these or a window's layers)
DRAWN = (ATTENTION, MLP, PROJECTIONS, f"{MLP} + {PROJECTIONS}", f"{ATTENTION} + {MLP} + {PROJECTIONS}")


@dataclass(frozen=True)
class SweepPoint:
    """One (model, chip, prompt length): every split's ratio with its interval, and each part's GPU time share."""

    model: str
    chip: str
    prompt_tokens: int
    ratios: dict  # split name -> (ratio, low, high)
    shares: dict  # part -> its GPU seconds / the all-GPU arm
    layer_shares: dict  # part -> layers holding it / all layers
    best: str


def model_inputs(model, prompt_tokens: int, chip: str, chunk: int = ANE_SHAPE) -> SplitInputs:
    """The split inputs of ``model`` (a ``ModelSizes`` or an opened ``Checkpoint``) at one prompt on one chip."""
    if isinstance(model, ModelSizes):
        return sizes_split_inputs(model, prompt_tokens, chunk, chip)
    planned = plan_from_checkpoint(model, prompt_tokens, chunk=chunk, chip=chip)
    return checkpoint_split_inputs(model, planned, checkpoint_parts(model)[0])


def model_name(model) -> str:
    return model.name if isinstance(model, ModelSizes) else model.path.name


def layer_shares(model) -> dict:
    """Each part's layers over all layers (the seed's 'offload share' counted in layers)."""
    if isinstance(model, ModelSizes):
        return {ATTENTION: len(model.full_attention_layers) / model.layers, MLP: 1.0,
                PROJECTIONS: model.gdn_layers / model.layers}  # fmt: skip
    g = model.geometry
    parts = {p.name: p.layers / g.num_layers for p in checkpoint_parts(model)[0]}
    return {ATTENTION: len(g.full_attention_layers) / g.num_layers, **parts}


def sweep_point(model, prompt_tokens: int, chip: str) -> SweepPoint:
    inputs = model_inputs(model, prompt_tokens, chip)
    splits = offload_splits(inputs)
    costs = part_costs(inputs)
    return SweepPoint(
        model=model_name(model),
        chip=chip,
        prompt_tokens=prompt_tokens,
        ratios={s.name: (s.ratio, s.ratio_low, s.ratio_high) for s in splits},
        shares={name: c.gpu_seconds / inputs.gpu_seconds for name, c in costs.items() if "[" not in name},
        layer_shares=layer_shares(model),
        best=splits[0].name,
    )


def sweep(model, chips, prompt_lengths) -> list[SweepPoint]:
    """``sweep_point`` over chips and prompt lengths (chips the planner can price: ``priced_chips``)."""
    out = []
    for chip in chips:
        for n in prompt_lengths:
            out.append(sweep_point(model, n, chip))
    return out


def priced_chips(model, chips, prompt_tokens: int) -> tuple[list[str], dict]:
    """(the chips whose figures price ``model``, chip -> the one-line refusal of the others)."""
    ok, refused = [], {}
    for chip in chips:
        try:
            part_costs(model_inputs(model, prompt_tokens, chip))
            ok.append(chip)
        except AnelabInputError as e:
            refused[chip] = str(e)
    return ok, refused


def open_model(path_or_name):
    """A checkpoint on disk opened for the sweeps (a named checkpoint through ``resolve_checkpoint``)."""
    return load_checkpoint(resolve_checkpoint(path_or_name))


def published() -> list[dict]:
    """The published oMLX and mlx-serve splits beside the planner's prediction (``planner.published_splits``)."""
    return published_vs_predicted()
