"""A plan's costs: rates per score entry, loads and non-attention, from a family's fit, the flags or the user's GPU.

``family_costs`` reads a recorded family's fitted costs (``planner.fit``); ``own_geometry`` carries them to a
model's own head_dim (a rate per matmul FLOP) and non-attention; ``costs_from_flags`` lets each cost flag
override them (or supply all of them without a family); ``scaled_gpu_costs`` puts the user's own GPU prefill
in place of the modelled GPU arm. What each cost means is in ``planner.plan``'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

from anelab.core.errors import AnelabInputError
from anelab.core.limits import require_finite_positive
from anelab.planner.catalogue import (
    FLAG,
    REFERENCE_TOKENS,
    Family,
    PlanGeometry,
    ane_score_entries,
    gpu_score_entries,
    positive_seconds,
)
from anelab.planner.coreai_loads import price_loads
from anelab.planner.envelope import YOURS
from anelab.planner.fit import CostFit, LoadModel
from anelab.planner.gpu_model import RUNTIME


@dataclass(frozen=True)
class PlanCosts:
    """Costs the planner applies: rates per score entry, loads, non-attention seconds for the prompt."""

    gpu_seconds_per_entry: float
    ane_seconds_per_entry: float
    load: LoadModel
    non_attention_seconds: float
    sources: dict


def family_costs(family: Family, prompt_tokens: int, fit: CostFit, specialize: bool = False) -> PlanCosts:
    # the one load model, arena only, every family: reload per prompt (+ specialization when paid)
    load = fit.recorded_load_model(specialize=specialize)
    load_source = f"reload {fit.reload_seconds_per_gb:.3g} s/GB of score arena ({fit.reload_basis})" + (
        f"; + specialization {fit.load_power_coef:.3g} s x (arena/GB)^{fit.load_power_exp:.3g} (every cold load on "
        "record; Qwen 3.8's recorded loads where they apply)"
        if specialize
        else "; specialization cached (paid once per machine, not in this prompt)"
    )
    load, load_source = price_loads(fit, load, load_source)  # a Core AI sidecar's: from its records
    return PlanCosts(
        gpu_seconds_per_entry=fit.gpu_sparse_seconds_per_entry if family.sparse else fit.gpu_dense_seconds_per_entry,
        ane_seconds_per_entry=fit.ane_seconds_per_entry,
        load=load,
        non_attention_seconds=fit.non_attention_seconds[family.name] * prompt_tokens / REFERENCE_TOKENS,
        sources={
            "gpu_attention": (
                "fitted sparse rate (Qwen 3.8 A/B rows)" if family.sparse else "fitted dense rate (A/B rows)"
            ),
            "ane_attention": "recorded h0 prediction of Qwen 3.8 (0.43 s), per score entry",
            "load": load_source,
            "non_attention": f"fitted at {REFERENCE_TOKENS:,} tokens, scaled linearly to the prompt"
            + ("; the fit was negative and is clamped to 0" if family.name in fit.non_attention_clamped else ""),
        },
    )


def costs_from_flags(
    geometry: PlanGeometry,
    chunk: int,
    histories: list[int],
    load_seconds,
    gpu_attention_seconds,
    ane_attention_seconds,
    non_attention_seconds,
    base: PlanCosts | None,
) -> PlanCosts:
    """Override a family's costs (or supply all of them) from flags; flags are documented in :func:`plan`."""
    given = {
        "--load-seconds": load_seconds,
        "--gpu-attention-seconds": gpu_attention_seconds,
        "--ane-attention-seconds": ane_attention_seconds,
        "--non-attention-seconds": non_attention_seconds,
    }
    if base is None:
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise AnelabInputError(
                f"without --family, pass {', '.join(missing)} (or choose a --family; see --list-families)"
            )
    sources = dict(base.sources) if base else {}
    gpu_rate = base.gpu_seconds_per_entry if base else 0.0
    ane_rate = base.ane_seconds_per_entry if base else 0.0
    if gpu_attention_seconds is not None:
        gpu_rate = positive_seconds("--gpu-attention-seconds", gpu_attention_seconds) / gpu_score_entries(
            geometry, chunk, 0
        )
        sources["gpu_attention"] = "flag (one layer, full chunk at history 0; scaled by score entries)"
    if ane_attention_seconds is not None:
        ane_rate = positive_seconds("--ane-attention-seconds", ane_attention_seconds) / ane_score_entries(
            geometry, chunk, 0
        )
        sources["ane_attention"] = "flag (one layer, full chunk at history 0; scaled by score entries)"
    load = base.load if base else None
    if load_seconds is not None:
        values = [load_seconds] if isinstance(load_seconds, (int, float)) else list(load_seconds)
        values = [positive_seconds("--load-seconds", v) for v in values]
        if min(values) <= 0:
            raise AnelabInputError("--load-seconds must be above 0: no function loads in no time")
        if len(values) == 1:
            load = LoadModel(flat=values[0], source=FLAG)
        elif len(values) == len(histories):
            load = LoadModel(dict(zip(histories, values)), chunk, geometry.num_heads, source=FLAG)
        else:
            raise AnelabInputError(
                f"--load-seconds gives {len(values)} values for {len(histories)} histories; give one value, or one per history"
            )
        sources["load"] = "flag"
    non_attention = base.non_attention_seconds if base else 0.0
    if non_attention_seconds is not None:
        non_attention = positive_seconds("--non-attention-seconds", non_attention_seconds)
        sources["non_attention"] = "flag (seconds for this prompt)"
    return PlanCosts(gpu_rate, ane_rate, load, non_attention, sources)


def own_geometry(costs: PlanCosts, fam: Family, geometry: PlanGeometry, own) -> PlanCosts:
    """The family's rates carried to this geometry: per score entry in proportion to head_dim (a rate per
    matmul FLOP, ``planner.gpu_model``), and the model's own non-attention when given."""
    sources = dict(costs.sources)
    gpu_rate, ane_rate, n = costs.gpu_seconds_per_entry, costs.ane_seconds_per_entry, costs.non_attention_seconds
    hd, fam_hd = geometry.head_dim, fam.geometry.head_dim
    if hd is not None and fam_hd is not None and hd != fam_hd:
        gpu_rate, ane_rate = gpu_rate * hd / fam_hd, ane_rate * hd / fam_hd
        for key in ("gpu_attention", "ane_attention"):
            sources[key] += f"; per matmul FLOP, carried from head_dim {fam_hd} to {hd}"
    if own is not None:
        n, basis = own
        sources["non_attention"] = basis
        sources["gpu_runtime"] = RUNTIME
    return PlanCosts(gpu_rate, ane_rate, costs.load, n, sources)


def user_gpu_seconds(prompt_tokens: int, seconds: float | None, tokens_per_second: float | None) -> float | None:
    check_user_gpu(seconds, tokens_per_second)
    if seconds is not None:
        return float(seconds)
    if tokens_per_second is not None:
        return prompt_tokens / float(tokens_per_second)
    return None


def check_user_gpu(seconds: float | None, tokens_per_second: float | None) -> None:
    """The user's GPU prefill flags: at most one of them, each a finite number above 0 in its own unit."""
    if seconds is not None and tokens_per_second is not None:
        raise AnelabInputError("pass --gpu-prefill-seconds or --gpu-tokens-per-second, not both")
    if seconds is not None:
        require_finite_positive("--gpu-prefill-seconds", seconds, "seconds")
    if tokens_per_second is not None:
        require_finite_positive("--gpu-tokens-per-second", tokens_per_second, "tokens per second")


def scaled_gpu_costs(costs: PlanCosts, factor: float, user_seconds: float, as_seconds: bool) -> PlanCosts:
    """The user's GPU prefill replaces the modelled GPU arm: GPU attention and non-attention scale alike."""
    flag = "--gpu-prefill-seconds" if as_seconds else "--gpu-tokens-per-second"
    split = f"{YOURS} ({flag}: {user_seconds:.4g} s for this prompt, split in the modelled attention share)"
    sources = {**costs.sources, "gpu_attention": split, "non_attention": split, "gpu_prefill": split}
    return PlanCosts(
        costs.gpu_seconds_per_entry * factor,
        costs.ane_seconds_per_entry,
        costs.load,
        costs.non_attention_seconds * factor,
        sources,
    )
