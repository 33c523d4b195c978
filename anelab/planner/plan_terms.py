"""A plan's additive terms: attention on each device, the loads of the visited variants, the verdict and its reason.

``prefill_terms`` sums both arms for one schedule (``planner.plan``'s cost model); ``load_split`` splits the
visited functions' loads into specialization and reload and applies the reload policy; ``reason_for`` names
the term that decides.
"""

from __future__ import annotations

from dataclasses import dataclass

from anelab.core.errors import AnelabInputError
from anelab.planner.catalogue import Chunk, PlanGeometry, ane_score_entries, gpu_score_entries
from anelab.planner.fit import CostFit
from anelab.planner.loads import hidden_reload
from anelab.planner.plan_costs import PlanCosts


def visited_arena(geometry: PlanGeometry, chunk: int, schedule: list[Chunk]) -> int:
    """Score-arena bytes of every (layer, history) function a schedule's ANE chunks visit."""
    n_fa = len(geometry.full_attention_layers)
    return n_fa * sum(geometry.score_arena_bytes(chunk, c.history) for c in schedule if c.device == "ane")


def load_split(fit: CostFit, geometry, chunk, schedule, costs: PlanCosts, terms, policy: str) -> dict:
    """Specialization and reload of the visited functions (arena only), and what a preloaded reload hides:
    per layer-chunk up to the GPU's time between two offloaded blocks (non-attention over the blocks).
    Under the preloaded ``policy`` the hidden reloads leave ``terms`` (its setup, ANE arm, ratio)."""
    ane_chunks = [c for c in schedule if c.device == "ane"]
    n_fa = len(geometry.full_attention_layers)
    arenas = [geometry.score_arena_bytes(chunk, c.history) for c in ane_chunks] * n_fa
    spec = sum(fit.load_power_coef * (a / 1e9) ** fit.load_power_exp for a in arenas)
    reloads = [fit.reload_seconds_per_gb * a / 1e9 for a in arenas]
    gap = costs.non_attention_seconds / len(arenas) if arenas else 0.0
    hidden_if_preloaded = sum(hidden_reload(r, gap, "preloaded") for r in reloads)
    hidden = hidden_if_preloaded if policy == "preloaded" else 0.0
    if hidden > 0:  # preloaded: the hidden reloads leave the ANE arm (and its setup)
        terms.setup -= hidden
        terms.ane_total -= hidden
        terms.ratio = terms.gpu_total / terms.ane_total
        terms.decision = "ane" if terms.variants and terms.ratio > 1.0 else "gpu"
    return {
        "specialization_seconds": float(spec),
        "reload_seconds": float(sum(reloads)),
        "hidden_reload_seconds": float(hidden),
        "preloaded_ane_prefill_seconds": float(terms.ane_total + hidden - hidden_if_preloaded) if arenas else None,
    }


@dataclass
class PrefillTerms:
    """The additive terms of both arms' prefill time (seconds) for one schedule."""

    gpu_attention: float  # every chunk's full attention on the GPU
    gpu_offloaded: float  # the part of it the ANE takes over
    ane_attention: float
    load_by_history: dict
    setup: float
    variants: list
    gpu_total: float
    ane_total: float
    ratio: float
    saved: float
    keys: dict
    decision: str


def prefill_terms(
    geometry: PlanGeometry, chunk: int, schedule: list[Chunk], costs: PlanCosts, loads_in_arm: bool = True
) -> PrefillTerms:
    """Attention on each device, setup (one load per (layer, history) variant) and the verdict."""
    ane_chunks = [c for c in schedule if c.device == "ane"]
    layers = geometry.full_attention_layers
    n_fa = len(layers)
    gpu_rate, ane_rate = costs.gpu_seconds_per_entry, costs.ane_seconds_per_entry
    gpu_all = sum(gpu_rate * gpu_score_entries(geometry, c.tokens, c.history) for c in schedule) * n_fa
    gpu_offloaded = sum(gpu_rate * gpu_score_entries(geometry, c.tokens, c.history) for c in ane_chunks) * n_fa
    ane_attn = sum(ane_rate * ane_score_entries(geometry, chunk, c.history) for c in ane_chunks) * n_fa
    load_by_history = {}
    for c in ane_chunks:
        seconds, source = costs.load.seconds(geometry, chunk, c.history)
        load_by_history[str(c.history)] = {
            "seconds": seconds,
            "source": source,
            "score_arena_bytes": geometry.score_arena_bytes(chunk, c.history),
        }
    setup = n_fa * sum(v["seconds"] for v in load_by_history.values())
    n = costs.non_attention_seconds
    gpu_total = n + gpu_all
    ane_total = n + gpu_all - gpu_offloaded + ane_attn + (setup if loads_in_arm else 0.0)
    if ane_total <= 0:
        raise AnelabInputError("every cost is zero; pass non-zero --gpu-attention-seconds or --non-attention-seconds")
    ratio = gpu_total / ane_total
    keys = {"gpu": None, "ane": None}
    if ane_chunks:
        top = max(c.history for c in ane_chunks) + chunk
        keys = {"ane": top, "gpu": min(geometry.sparse_budget, top) if geometry.sparse_budget else top}
    return PrefillTerms(
        gpu_attention=gpu_all,
        gpu_offloaded=gpu_offloaded,
        ane_attention=ane_attn,
        load_by_history=load_by_history,
        setup=setup,
        variants=[[layer, c.history] for layer in layers for c in ane_chunks],
        gpu_total=gpu_total,
        ane_total=ane_total,
        ratio=ratio,
        saved=gpu_offloaded - ane_attn,
        keys=keys,
        decision="ane" if ane_chunks and ratio > 1.0 else "gpu",
    )


def reason_for(
    terms: PrefillTerms, prompt_tokens: int, chunk: int, fits: bool, needed: int, coverage: int, geometry: PlanGeometry
) -> str:
    """One line naming the dominant term of the decision."""
    decision, setup, saved, keys = terms.decision, terms.setup, terms.saved, terms.keys
    gpu_total, gpu_attn, ane_attn, n_variants = (
        terms.gpu_total,
        terms.gpu_offloaded,
        terms.ane_attention,
        len(terms.variants),
    )
    if not fits:
        return f"prompt past coverage: needs {needed:,}, the histories give {coverage:,}; it stays on the GPU"
    if n_variants == 0:
        return f"short prompt: {prompt_tokens:,} tokens is one partial chunk of {chunk:,}, which stays on the GPU"
    sparse_note = ""
    if geometry.sparse_budget is not None and keys["ane"] > keys["gpu"]:
        sparse_note = (
            f"sparse GPU path: the ANE scores {keys['ane'] / keys['gpu']:.1f}x the keys per query "
            f"({keys['ane']:,} vs {keys['gpu']:,})"
        )
    if decision == "ane":
        text = f"attention time saved {saved:.3g} s exceeds setup {setup:.3g} s ({n_variants} variant loads)"
        return text + (f"; {sparse_note}" if sparse_note else "")
    if saved <= 0:
        head = f"ANE attention {ane_attn:.3g} s is no faster than the GPU's {gpu_attn:.3g} s"
        return f"{sparse_note}: {head}" if sparse_note else head
    text = f"setup {setup:.3g} s ({n_variants} variant loads) exceeds attention time saved {saved:.3g} s"
    if setup > gpu_total:
        text += f" and the whole GPU prefill {gpu_total:.3g} s"
    return text + (f"; {sparse_note}" if sparse_note else "")
