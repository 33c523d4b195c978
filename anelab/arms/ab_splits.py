"""Which offload splits ``anelab ab`` times: the planner's split names (``planner.offload_split``) read into what the
ANE arm serves, and ``planned``: the splits the plan proposes for this chip.

A split name is the planner's: its parts joined by ``+`` (``attention``, ``mlp``, ``projections``; ``mlp[:k]``: the
first k layers of the MLP, the layers one ANE program's window holds). Each part is served from its packages:
``attention`` from ``--sidecars``, ``mlp`` from ``--mlp-sidecars``, ``projections`` from ``--gdn-sidecars``. A name
the plan does not list for this checkpoint, ``none`` (the GPU arm itself) and a part whose packages were not given
are refused in one line. ``planned``: at each prompt length, the best split the plan proposes on the chip and its
runner-up (``none`` left out: the GPU arm times it), each timed at every prompt length of the run.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.planner.chips import resolve_chip
from anelab.planner.from_checkpoint import plan_from_checkpoint
from anelab.planner.offload_split import ATTENTION, MLP, PROJECTIONS, checkpoint_splits

PLANNED = "planned"
PART_FLAGS = {ATTENTION: "--sidecars", MLP: "--mlp-sidecars", PROJECTIONS: "--gdn-sidecars"}
_PART = re.compile(r"^(attention|mlp|projections)(?:\[:(\d+)\])?$")


@dataclass(frozen=True)
class PlannedSplit:
    """One split to time: its planner name, its parts (part -> the first k layers, None: all), and the plan's
    prediction for it on ``chip`` per prompt length (``{prompt_tokens: {ratio, ratio_low, ratio_high, rank}}``)."""

    name: str
    parts: dict
    chip: str
    chip_choice: str
    predicted: dict

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def normalised(name: str) -> str:
    """A split name as the planner writes it: parts joined by `` + `` (``attention+mlp`` -> ``attention + mlp``)."""
    return " + ".join(part.strip() for part in str(name).split("+"))


def split_parts(name: str) -> dict:
    """The parts of a planner split name -> {part: first k layers or None}; refused (one line) when not one."""
    parts = {}
    for token in normalised(name).split(" + "):
        found = _PART.match(token)
        if not found or found.group(1) in parts:
            raise AnelabInputError(f"split {name!r} is not a planner split (parts attention, mlp, projections, a part's "
                                   "first layers as mlp[:k], joined by +); 'anelab plan --checkpoint' lists them")  # fmt: skip
        parts[found.group(1)] = int(found.group(2)) if found.group(2) else None
    return parts


def planned_splits(checkpoint_path, prompt_lengths, chosen: list[str], chip: str | None = None) -> list[PlannedSplit]:
    """The splits ``chosen`` names (planner names, or ``planned``) on the checkpoint at ``prompt_lengths``, each with
    the plan's prediction on ``chip`` (default: this Mac's, else the seed's M3 — ``planner.chips.resolve_chip``)."""
    the_chip, how = resolve_chip(chip)
    checkpoint = load_checkpoint(checkpoint_path)
    ranked = {}
    for n in prompt_lengths:
        table = checkpoint_splits(checkpoint, n, [the_chip.name],
                                  lambda c, n=n: plan_from_checkpoint(checkpoint, n, chip=c))  # fmt: skip
        [on_chip] = table["chips"]
        if on_chip["refused"]:
            raise AnelabInputError(f"the plan cannot price {the_chip.name} for this checkpoint: {on_chip['refused']}")
        ranked[n] = on_chip["splits"]
    names = _chosen_names(chosen, ranked)
    out = []
    for name in names:
        predicted = {
            n: {"rank": i + 1, **{k: s[k] for k in ("ratio", "ratio_low", "ratio_high", "seconds", "decided_by")}}
            for n, splits in ranked.items()
            for i, s in enumerate(splits)
            if s["name"] == name
        }
        out.append(PlannedSplit(name, split_parts(name), the_chip.name, how, predicted))
    return out


def _chosen_names(chosen: list[str], ranked: dict) -> list[str]:
    known = [s["name"] for s in next(iter(ranked.values()))]
    names = []
    for given in chosen:
        if given == PLANNED:
            for splits in ranked.values():
                names += [s["name"] for s in splits[:2] if s["name"] != "none"]
            continue
        name = normalised(given)
        if name == "none":
            raise AnelabInputError("split 'none' is the GPU arm itself, timed beside every split; name a split to move")
        split_parts(name)
        if name not in known:
            raise AnelabInputError(f"split {given!r} is not one the plan lists for this checkpoint; it lists: "
                                   f"{', '.join(k for k in known if k != 'none')}")  # fmt: skip
        names.append(name)
    return list(dict.fromkeys(names))


def require_packages(split: PlannedSplit, directories: dict) -> None:
    """Refuse (one line) a split a part of which has no packages given (``directories``: part -> a directory or
    None)."""
    missing = [part for part in split.parts if directories.get(part) is None]
    if missing:
        flags = ", ".join(f"{PART_FLAGS[p]} DIR ({p})" for p in missing)
        raise AnelabInputError(f"split {split.name!r} serves {', '.join(missing)} from sidecars: give {flags}")
