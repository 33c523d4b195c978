"""The per-variant load that would flip a plan's verdict: what a cheaper specialization (a Core AI record) must beat.

``flip_load`` is ``planner.verdict``'s X (one layer's loads at which the ANE wins) over the variants a layer
visits, and that load as a fraction of the loads the plan priced (the family's Core ML loads).
"""

from __future__ import annotations

from anelab.planner.verdict import plan_arm_costs, verdict_for


def flip_load(plan, data_dir=None) -> dict:
    """What a Core AI record must beat for ``plan`` (a ``PrefillPlan``): one layer's loads and one
    variant's at which the verdict turns to the ANE, and that as a fraction of the plan's own loads."""

    arms = plan_arm_costs(plan, data_dir=data_dir)
    verdict = verdict_for(arms)
    x = verdict.max_load_per_layer_seconds
    per_layer = plan.setup_seconds / arms.layers if arms.layers else 0.0
    n = arms.loads_per_layer
    return {
        "decision": verdict.decision,
        "max_load_per_layer_s": x,
        "variants_per_layer": n,
        "max_load_per_variant_s": x / n if x is not None and n else None,
        "load_per_variant_s": per_layer / n if n else None,
        "max_fraction_of_loads": x / per_layer if x is not None and per_layer > 0 else None,
    }


def flip_sentence(plan, data_dir=None) -> str:
    """One line: the per-variant load at which ``plan``'s verdict turns to the ANE, and that against its loads."""
    f = flip_load(plan, data_dir)
    if f["max_load_per_variant_s"] is None:
        return "the ANE does not run this prompt: no load would change the verdict"
    if f["max_load_per_variant_s"] <= 0:
        return "no load is fast enough: the ANE's attention alone does not beat the GPU attention it replaces"
    return (
        f"at {plan.prompt_tokens:,} tokens the verdict ({f['decision']}) turns to the ANE if a variant loads in "
        f"<= {f['max_load_per_variant_s']:.3g} s ({f['variants_per_layer']} per layer), "
        f"{f['max_fraction_of_loads']:.2f}x the {f['load_per_variant_s']:.3g} s per variant priced from Core ML's loads"
    )
