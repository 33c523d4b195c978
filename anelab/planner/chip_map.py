"""A verdict map: chip (rows) x prompt length (columns) -> predicted ratio and verdict, one chip's row marked.

Each cell is a plan on that chip at that prompt length (``planner.plan`` for a recorded family,
``planner.from_checkpoint`` for a checkpoint) and its three-way verdict (``planner.verdict``). A chip the model
cannot price (a figure unknown) is a row with the one-line reason instead of cells.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from anelab.core.errors import AnelabInputError
from anelab.planner.chips import CHIPS
from anelab.planner.plan import plan
from anelab.planner.verdict import plan_arm_costs, verdict_for

DEFAULT_LENGTHS = (1024, 2048, 4333, 8192, 16384)


def _cell(part, prompt_tokens: int) -> dict:
    v = verdict_for(plan_arm_costs(part))
    return {"prompt_tokens": prompt_tokens, "ratio": part.predicted_ratio, "decision": v.decision,
            "time_decision": v.time_decision, "energy_decision": v.energy["decision"],
            "gpu_seconds": part.gpu_prefill_seconds, "ane_seconds": part.ane_prefill_seconds,
            "gpu_joules": v.energy["gpu_joules"]["value"], "ane_joules": v.energy["ane_joules"]["value"]}  # fmt: skip


def verdict_map(plan_at: Callable, prompt_lengths: Sequence[int] = DEFAULT_LENGTHS, chips: Sequence[str] | None = None,
                mark: str | None = None) -> dict:  # fmt: skip
    """``plan_at(chip, prompt_tokens)`` -> a ``PrefillPlan`` for every chip and length; ``mark``: the chip whose row
    is the user's."""
    rows = []
    for chip in chips or list(CHIPS):
        try:
            cells = [_cell(plan_at(chip, int(n)), int(n)) for n in prompt_lengths]
            rows.append({"chip": chip, "marked": chip == mark, "cells": cells, "refused": None})
        except AnelabInputError as e:
            rows.append({"chip": chip, "marked": chip == mark, "cells": [], "refused": str(e)})
    return {"prompt_lengths": [int(n) for n in prompt_lengths], "rows": rows, "marked": mark}


def family_verdict_map(family: str, prompt_lengths: Sequence[int] = DEFAULT_LENGTHS, *, gpu_runtime: str | None = None,
                       objective: str = "time", chips=None, mark: str | None = None, data_dir=None) -> dict:  # fmt: skip
    """The verdict map of a recorded family (prompts past its coverage planned on the GPU)."""

    def plan_at(chip, n):
        return plan(n, family=family, chip=chip, gpu_runtime=gpu_runtime, objective=objective,
                    allow_past_coverage=True, data_dir=data_dir)  # fmt: skip

    return {**verdict_map(plan_at, prompt_lengths, chips, mark), "family": family, "gpu_runtime": gpu_runtime,
            "objective": objective}  # fmt: skip


def format_verdict_map(m: dict) -> str:
    """The map as a text table: ratio and verdict per cell, the marked row flagged, refused rows with their reason."""
    head = f"{'chip':10s}" + "".join(f"{n:>16,d}" for n in m["prompt_lengths"])
    out = [head]
    for r in m["rows"]:
        name = ("> " if r["marked"] else "  ") + r["chip"]
        if r["refused"]:
            out.append(f"{name:10s}  {r['refused']}")
            continue
        out.append(f"{name:10s}" + "".join(f"{c['ratio']:>9.2f}x {c['decision']:>6s}" for c in r["cells"]))
    out.append("ratio = GPU arm / ANE arm (> 1: the ANE arm is faster); verdict: ane / gpu / depends"
               + (f"; > marks {m['marked']}" if m.get("marked") else ""))  # fmt: skip
    return "\n".join(out)
