"""Cold start of the ANE arm: what it pays once before its first prompt, and how many prompts repay it.

One-time cost = the visited functions' specialization (``planner.loads``: cached once per machine under the
default protocol, so it is not in a prompt's ANE arm) and, for ``--backend coreai``, the per-model floor reported
on macOS 27 (``chip_figures.CORE_AI_MODEL_FLOOR_S``: ~10 s per Neural Engine model) times the assets loaded — one
asset per full-attention layer as anelab writes them. The ANE arm repays it after
``ceil(one-time / (GPU arm - ANE arm))`` prompts; never when the ANE arm saves nothing. Packing every layer's
entrypoints into one asset would pay the floor once: the saving and the prompts it takes off are reported.
"""

from __future__ import annotations

import math

from anelab.planner.chip_figures import CORE_AI_MODEL_FLOOR_S

COREAI = "coreai"


def _prompts(one_time: float, saved_per_prompt: float) -> int | None:
    if one_time <= 0:
        return 0
    return math.ceil(one_time / saved_per_prompt) if saved_per_prompt > 0 else None


def cold_start(specialization_seconds: float, gpu_seconds: float, ane_seconds: float, *, backend: str | None,
               assets: int, runs_on_ane: bool) -> dict:  # fmt: skip
    """One-time seconds (with their parts and sources), the per-prompt saving and the prompts that repay it."""
    if not runs_on_ane:
        return {"one_time_seconds": 0.0, "parts": {}, "saved_per_prompt_seconds": 0.0, "prompts_to_repay": None,
                "sentence": "no cold start: the ANE does not run this prompt"}  # fmt: skip
    parts = {"specialization": {"seconds": specialization_seconds, "source": "fitted: every cold load on record "
                                "(planner.loads), one-time per machine under the default protocol"}}  # fmt: skip
    floor = CORE_AI_MODEL_FLOOR_S
    if backend == COREAI:
        parts["coreai_model_floor"] = {"seconds": floor.value * assets, "source": f"{floor.source}: {floor.note}",
                                       "assets": assets}  # fmt: skip
    one_time = sum(p["seconds"] for p in parts.values())
    saved = gpu_seconds - ane_seconds
    prompts = _prompts(one_time, saved)
    out = {"one_time_seconds": one_time, "parts": parts, "saved_per_prompt_seconds": saved, "prompts_to_repay": prompts}
    repay = f"repaid after {prompts:,} prompts" if prompts is not None else "never repaid (the ANE arm saves nothing)"
    listed = ", ".join(f"{k} {v['seconds']:.3g} s" for k, v in parts.items())
    text = f"cold start {one_time:.3g} s once ({listed}); {repay}"
    if backend == COREAI and assets > 1:
        packed = one_time - floor.value * (assets - 1)
        out["packed"] = {"assets": 1, "one_time_seconds": packed, "prompts_to_repay": _prompts(packed, saved)}
        pays = "pays" if out["packed"]["prompts_to_repay"] != prompts else "does not change the prompts to repay"
        text += (f"; packing the {assets} layers' entrypoints into one asset saves {floor.value * (assets - 1):.3g} s "
                 f"once and {pays} ({out['packed']['prompts_to_repay']} prompts)")  # fmt: skip
    out["sentence"] = text
    return out
