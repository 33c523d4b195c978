"""The GPU runtimes a plan's GPU arm can describe: one table, each entry its costs, band, provenance and defaults.

A plan's GPU arm is somebody's GPU prefill of the same prompt. ``GPU_RUNTIMES`` holds who:

- ``tinytitan``: the seed's recorded path on an Apple M3 (the A/B rows' fitted rates, weights streamed once per
  token); on another chip its non-attention is carried by the chips' memory bandwidth and its attention by their
  GPU throughput (``planner.chips``), x/÷ the farthest public mlx-lm record off its chip roofline. Default for a
  recorded ``--family`` (its rows are this path's).
- ``mlx-lm``: mlx-lm's batched prefill at the fitted fraction of the chip's GPU figure (``planner.mlx_lm_rates``).
  Default for a checkpoint (the runtime Mac users run a model with).
- ``yours``: the user's own number (``--gpu-prefill-seconds`` / ``--gpu-tokens-per-second``) in place of either;
  not a ``--gpu-runtime`` value.

Nothing outside this module compares a runtime's name: callers ask the table (``require_gpu_runtime``,
``default_gpu_runtime``, an entry's ``price`` and ``phrase``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from anelab.core.errors import AnelabInputError
from anelab.planner.catalogue import Family, PlanGeometry, gpu_score_entries
from anelab.planner.chips import SEED_CHIP, carry_recorded_gpu, get_chip
from anelab.planner.envelope import EXTRAPOLATED, FITTED, YOURS
from anelab.planner.gpu_model import RUNTIME, RUNTIME_BAND
from anelab.planner.mlx_lm_rates import fit_mlx_lm, peak_flops, prefill_flops
from anelab.planner.plan_costs import PlanCosts, own_geometry

TINYTITAN, MLX_LM, YOUR_NUMBER = "tinytitan", "mlx-lm", "yours"


@dataclass(frozen=True)
class GpuRuntime:
    """Whose GPU prefill a plan prices (a ``GPU_RUNTIMES`` name), on which chip, for which weights
    (``{"active", "bytes"}``), and the model's own non-attention on TinyTitan's path (s, basis) when given."""

    name: str
    chip: str
    weights: dict | None
    own_non_attention: tuple[float, str] | None = None

    @property
    def entry(self) -> GpuRuntimeEntry:
        return require_gpu_runtime(self.name)

    def fields(self, fam: Family | None) -> dict:
        """The plan's runtime fields; the band: the entry's (None where the fit's own envelope applies)."""
        band = self.entry.band(self) if fam is not None else None
        return {"gpu_runtime": self.name, "gpu_chip": self.chip, "gpu_runtime_band": band}


@dataclass(frozen=True)
class GpuRuntimeEntry:
    """One GPU runtime: what its numbers come from, their kind, their band, when it is the default, how it prices
    a family's GPU arm (``price``: (costs, fam, geometry, prompt_tokens, schedule, runtime) -> PlanCosts)."""

    name: str
    describes: str
    provenance: str  # kind of its GPU prefill (envelope.KINDS) for a recorded family on its own chip
    default_for_family: bool
    default_for_checkpoint: bool
    selectable: bool  # a --gpu-runtime value
    streams_weights: bool  # its non-attention is weight bytes per token at a fitted bandwidth (gpu_model)
    price: Callable | None
    band: Callable  # (GpuRuntime) -> x/÷ factor or None

    def phrase(self, d: dict) -> str:
        """Whose GPU prefill a plan's GPU arm is (``PrefillPlan.to_dict()``), in words."""
        sources = d.get("cost_sources", {})
        chip = d.get("gpu_chip", SEED_CHIP)
        if self.name == TINYTITAN and chip == SEED_CHIP:
            return RUNTIME + ("; --gpu-runtime mlx-lm prices mlx-lm's" if d.get("family") else "")
        return sources.get("gpu_runtime", f"{self.name} on an Apple {chip}")


def _tinytitan_price(costs: PlanCosts, fam: Family, geometry: PlanGeometry, prompt_tokens: int, schedule,
                     runtime: GpuRuntime) -> PlanCosts:  # fmt: skip
    """TinyTitan's fitted rates on this geometry; on another chip than the seed's, carried by the chips' figures."""
    costs = own_geometry(costs, fam, geometry, runtime.own_non_attention)
    if runtime.chip == SEED_CHIP:
        return costs
    gpu_factor, non_factor, basis = carry_recorded_gpu(get_chip(runtime.chip))
    sources = {**costs.sources, "gpu_runtime": f"{RUNTIME}, carried to an Apple {runtime.chip}: {basis}"}
    for key in ("gpu_attention", "non_attention"):
        sources[key] = f"{EXTRAPOLATED} ({runtime.chip}) from {sources[key]}"
    return PlanCosts(costs.gpu_seconds_per_entry * gpu_factor, costs.ane_seconds_per_entry, costs.load,
                     costs.non_attention_seconds * non_factor, sources)  # fmt: skip


def _tinytitan_band(runtime: GpuRuntime) -> float | None:
    if runtime.chip != SEED_CHIP:
        return max(fit_mlx_lm().band, RUNTIME_BAND if runtime.own_non_attention is not None else 1.0)
    return RUNTIME_BAND if runtime.own_non_attention is not None else None


def _mlx_lm_price(costs: PlanCosts, fam: Family, geometry: PlanGeometry, prompt_tokens: int, schedule,
                  runtime: GpuRuntime) -> PlanCosts:  # fmt: skip
    """The GPU arm as mlx-lm would run it on ``runtime.chip``: its linear FLOPs and its causal attention FLOPs at
    the fitted fraction of the chip's peak (``planner.mlx_lm_rates``). The attention seconds are spread over the
    plan's chunks per score entry, so the offloaded chunks' share is what the ANE saves."""
    costs = own_geometry(costs, fam, geometry, None)
    if fam.sparse and geometry.sparse_budget is not None:
        raise AnelabInputError(
            f"--gpu-runtime mlx-lm: {fam.name}'s GPU path is a sparse indexer mlx-lm does not run; use tinytitan"
        )
    head_dim = geometry.head_dim or fam.geometry.head_dim
    if runtime.weights is None or head_dim is None:
        raise AnelabInputError("--gpu-runtime mlx-lm needs the model's weights and head_dim; pass a --checkpoint")
    fit = fit_mlx_lm()
    rate = peak_flops(runtime.chip) * fit.efficiency
    layers = len(geometry.full_attention_layers)
    linear, attention = prefill_flops(runtime.weights["active"], head_dim, geometry.num_heads, layers, prompt_tokens,
                                      window=geometry.sparse_budget)  # fmt: skip
    entries = layers * sum(gpu_score_entries(geometry, c.tokens, c.history) for c in schedule)
    at = f"at {fit.efficiency:.2f} of the {runtime.chip}'s GPU peak (mlx-lm, {len(fit.records)} public records)"
    sources = {
        **costs.sources,
        "gpu_attention": f"mlx-lm: {attention / 1e12:.3g} TFLOP of fused causal attention in steps of 2,048 {at}",
        "non_attention": f"mlx-lm: 2 x {runtime.weights['active'] / 1e6:.0f} M active weights x "
        f"{prompt_tokens:,} tokens = {linear / 1e12:.3g} TFLOP {at}",
        "gpu_runtime": f"mlx-lm on an Apple {runtime.chip} (x/÷ {fit.band:.2f}: the farthest public record)",
    }
    per_entry = attention / rate / entries if entries else 0.0
    return PlanCosts(per_entry, costs.ane_seconds_per_entry, costs.load, linear / rate, sources)


GPU_RUNTIMES: dict[str, GpuRuntimeEntry] = {
    e.name: e
    for e in (
        GpuRuntimeEntry(
            TINYTITAN, f"{RUNTIME}: the recorded A/B rows' fitted rates (weights streamed once per token); on "
            "another chip carried by its bandwidth and GPU figures (planner.chips)", FITTED,
            default_for_family=True, default_for_checkpoint=False, selectable=True, streams_weights=True,
            price=_tinytitan_price, band=_tinytitan_band,
        ),
        GpuRuntimeEntry(
            MLX_LM, "mlx-lm's batched prefill: public prefill records' fraction of the chip's GPU peak "
            "(planner.mlx_lm_rates)", EXTRAPOLATED, default_for_family=False, default_for_checkpoint=True,
            selectable=True, streams_weights=False, price=_mlx_lm_price, band=lambda runtime: fit_mlx_lm().band,
        ),
        GpuRuntimeEntry(
            YOUR_NUMBER, "your own GPU prefill of this prompt (--gpu-prefill-seconds / --gpu-tokens-per-second), "
            "split into attention and the rest in the modelled proportion", YOURS, default_for_family=False,
            default_for_checkpoint=False, selectable=False, streams_weights=False, price=None, band=lambda r: None,
        ),
    )
}  # fmt: skip


def require_gpu_runtime(name: str) -> GpuRuntimeEntry:
    """The table's entry of a ``--gpu-runtime`` value, or a one-line refusal naming the choices."""
    entry = GPU_RUNTIMES.get(name)
    if entry is None or not entry.selectable:
        choices = " or ".join(n for n, e in GPU_RUNTIMES.items() if e.selectable)
        raise AnelabInputError(f"unknown --gpu-runtime {name!r}; choose {choices}")
    return entry


def default_gpu_runtime(*, checkpoint: bool) -> str:
    """The runtime a plan prices when ``--gpu-runtime`` is not given: for a checkpoint or for a recorded family."""
    return next(
        n for n, e in GPU_RUNTIMES.items() if (e.default_for_checkpoint if checkpoint else e.default_for_family)
    )


def modelled_runtimes() -> list[str]:
    """The runtimes the planner prices itself (every selectable one), in table order."""
    return [n for n, e in GPU_RUNTIMES.items() if e.selectable]


def runtime_descriptions() -> dict[str, str]:
    """name -> what its numbers come from (``plan --gpu-runtimes``)."""
    return {n: e.describes for n, e in GPU_RUNTIMES.items()}


def gpu_runtime_phrase(d: dict) -> str:
    """Whose GPU prefill a plan's GPU arm is (``PrefillPlan.to_dict()``), in words."""
    sources = d.get("cost_sources", {})
    if str(sources.get("gpu_prefill", "")).startswith(YOURS):
        return "your GPU runtime's number"
    if str(sources.get("gpu_attention", "")).startswith("flag") and not d.get("family"):
        return "the cost flags"
    return GPU_RUNTIMES[d.get("gpu_runtime") or default_gpu_runtime(checkpoint=False)].phrase(d)


def plan_runtime(name: str | None, chip: str, weights: dict | None, own_non_attention=None) -> GpuRuntime:
    """A plan's runtime: ``name`` checked against the table (None: a family's default) on ``chip``."""
    name = name or default_gpu_runtime(checkpoint=False)
    require_gpu_runtime(name)
    return GpuRuntime(name, get_chip(chip).name, weights, own_non_attention)
