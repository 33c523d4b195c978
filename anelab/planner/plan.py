"""Plan a prefill: which chunks the ANE runs, which sidecar variants load, and whether it pays.

A prompt of ``prompt_tokens`` is cut into chunks of width ``chunk`` starting at 0, C, 2C, ...
A chunk runs on the ANE only if it is a full chunk or a continuation of a long prompt: a prompt
shorter than one chunk is a single partial chunk and stays on the GPU (seed, "When it runs").
Each ANE chunk at start ``s`` calls function ``h<s>`` of every full-attention layer's sidecar,
so it visits one ``(layer, history=s)`` variant per full-attention layer; the functions on hand
(``histories``) give ``coverage = max(histories) + chunk``.

Cost model (seconds; all terms additive)::

    GPU arm = non_attention + sum over chunks, full-attention layers of gpu_attention(chunk)
    ANE arm = non_attention + sum over ANE chunks, layers of ane_attention(chunk)
                            + sum over GPU chunks, layers of gpu_attention(chunk)
                            + setup,   setup = sum over visited variants of load(history)

Attention time is a rate (seconds per score entry) times the score entries of one layer-chunk,
``heads x query rows x keys``:

- ANE (dense graph, padded to the sidecar's width): ``heads x chunk x (history + chunk)`` — the
  score arena (``score_arena_bytes / 2``); a short continuation still costs a full chunk.
- GPU, dense families: ``heads x rows x (history + rows)`` with ``rows`` the chunk's real tokens.
- GPU, sparse-indexed families (``sparse_budget`` B, e.g. Qwen 3.8's QSA indexer, B = 2,051):
  ``heads x rows x min(B, history + rows)`` — the GPU gathers at most B keys per query while the
  ANE scores all of them and masks the rest (seed, "The GPU path is already sparse").

The linear (projection) part of the block is folded into the rate, so a rate fitted at one
workload is an approximation at another. ``non_attention`` scales linearly with prompt tokens from
the family's reference workload (4,333 tokens). ``predicted_ratio = GPU arm / ANE arm`` — the
seed's "Ratio": above 1 the ANE arm is faster, and the decision is ``"ane"``.

Where costs come from (:func:`fit_costs`, reading the records in ``data/``):

- ANE rate: one measured h0 prediction of Qwen 3.8 (0.43 s for 24 x 4,096 x 4,096 entries),
  assumed to hold for every family (all are head_dim 256 here).
- Dense GPU rate: one weighted least-squares fit over every dense A/B row (Qwen 3.5 and the 35B,
  both widths); each row contributes ``gpu - ane = gpu_attention - ane_attention - loads``
  (non-attention cancels; the loads are the row's reloads, see below).
- Sparse GPU rate: the two Qwen 3.8 rows, the same way.
- Loads — one load model for every family and design, a function of the score arena only
  (``planner.loads``, ``LoadModel.at_arena``): a reload per prompt in proportion to the arena
  (TinyTitan's ~0.5 s per layer-chunk at the 35B's arenas), plus the function's specialization when
  the protocol pays it (a power law fitted on every cold load on record: Qwen 3.8's variant and
  package-composition loads and the 35B's ~130 s total; Qwen 3.8's recorded loads where they apply).
  The default protocol ("machine") pays specialization once per machine, so a plan holds reloads
  only — unless the visited arenas exceed the machine's memory (Qwen 3.8: 29 GB on the 24 GB M3),
  when the cache cannot hold them and every prompt pays them. ``planner.envelope`` gives each cost
  its interval and ``planner.verdict`` the three-way verdict.
- Non-attention: per family, the mean residual of its rows at the reference workload; a checkpoint's
  own from its weights per token (``planner.gpu_model``).

:func:`predicted_vs_recorded` reports how well that recovers each recorded ratio, in-sample and
leave-one-out; ``planner.backtest`` with each family held out.

What the fit says that the seed does not (read these before trusting a decomposition):

- A flat reload per layer-chunk (the note's 0.5 s taken per function) puts the chunk-1,024 2B row
  (18 layer-chunks of 17-50 MB arenas) on the GPU side; a reload in proportion to the arena keeps
  every row on its recorded side. A per-variant constant fitted beside the rate comes out negative.
- Qwen 3.8's recorded ANE arm (273.5 s) is 76 s slower than its GPU arm: with reloads only (~18 s)
  and its ANE attention (~15 s) that is impossible, so its arm holds its ~245 s of cold loads — the
  only record whose specializations were not cached. The fit then puts ~186 s of its GPU prefill into
  sparse attention (a gather rate ~3x the dense GPU rate per score entry); the seed does not say
  whether the GPU's gather path is that slow.
- Weight precision moves only non-attention: 4-bit and 8-bit of one model share attention rates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.geometry import chunk_starts, validate_chunk_and_histories
from anelab.core.geometry import coverage as _coverage
from anelab.core.limits import require_finite_positive
from anelab.planner.catalogue import (
    EXTRAPOLATED,
    FLAG,
    REFERENCE_CHUNK,
    REFERENCE_TOKENS,
    Chunk,
    Family,
    PlanGeometry,
    ane_score_entries,
    chunk_schedule,
    get_family,
    gpu_score_entries,
    positive_seconds,
    require_positive,
)
from anelab.planner.chips import get_chip
from anelab.planner.coreai_loads import price_loads, priced_fit
from anelab.planner.envelope import YOURS, ane_kind, gpu_kind, kind_of, worst_kind
from anelab.planner.fit import CostFit, LoadModel, cached_fit, fit_costs, predicted_ane_seconds, timed_ab_rows
from anelab.planner.gpu_model import MLX_LM, RUNTIME, RUNTIME_BAND, TINYTITAN, require_gpu_runtime
from anelab.planner.loads import (
    DEFAULT_PROTOCOL,
    DEFAULT_RELOAD_POLICY,
    hidden_reload,
    pays_specialization,
    require_protocol,
    require_reload_policy,
)


# ---- costs of one plan ------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanCosts:
    """Costs the planner applies: rates per score entry, loads, non-attention seconds for the prompt."""

    gpu_seconds_per_entry: float
    ane_seconds_per_entry: float
    load: LoadModel
    non_attention_seconds: float
    sources: dict


def _family_costs(family: Family, prompt_tokens: int, fit: CostFit, specialize: bool = False) -> PlanCosts:
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


# ---- the plan ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillPlan:
    """The planner's answer for one prompt (see :func:`plan`). ``predicted_ratio`` = GPU / ANE arm."""

    family: str | None
    geometry: dict
    prompt_tokens: int
    chunk: int
    histories: list
    coverage: int
    coverage_needed: int
    fits: bool
    chunks: list
    variants: list
    variants_visited: int
    load_seconds: dict
    setup_seconds: float
    non_attention_seconds: float
    gpu_attention_seconds: float
    ane_attention_seconds: float
    attention_saved_seconds: float
    gpu_prefill_seconds: float
    ane_prefill_seconds: float
    predicted_ratio: float
    decision: str
    reason: str
    keys_per_query: dict
    cost_sources: dict

    provenance: dict  # cost -> kind (envelope.KINDS): load, gpu_prefill, ane_attention
    loads_in_arm: bool  # False: no load at all in the ANE arm (a what-if; every record holds its reloads)
    protocol: str = DEFAULT_PROTOCOL  # when specialization is paid (planner.loads.PROTOCOLS)
    protocol_reason: str = ""
    pays_specialization: bool = False
    specialization_seconds: float = 0.0  # every visited function's specialization (one-time unless paid here)
    reload_seconds: float = 0.0  # every visited function's reload (per prompt)
    reload_policy: str = DEFAULT_RELOAD_POLICY
    hidden_reload_seconds: float = 0.0  # reload the GPU hides under the preloaded policy
    preloaded_ane_prefill_seconds: float | None = None  # what the preloaded policy would give
    weights: dict | None = None  # {"active": weights one token multiplies through, "bytes": their bytes}
    gpu_runtime: str = TINYTITAN  # whose GPU prefill the GPU arm describes (gpu_model.GPU_RUNTIMES)
    gpu_chip: str = "M3"  # the chip the GPU arm's numbers describe
    gpu_runtime_band: float | None = None  # x/÷ for carrying a runtime's rates to this model (None: the fit's own)

    def to_dict(self) -> dict:
        return asdict(self)


def _costs_from_flags(
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


def _histories(chunk: int, needed: list[int], histories, max_history, family: Family | None) -> tuple[list[int], str]:
    """The histories on hand and where they came from."""
    if histories is not None and max_history is not None:
        raise AnelabInputError("pass --histories or --max-history, not both")
    cap = family.max_history if family else None
    if max_history is not None:
        if (
            isinstance(max_history, bool)
            or not isinstance(max_history, (int, np.integer))
            or max_history < 0
            or max_history % chunk
        ):
            raise AnelabInputError(
                f"--max-history must be a non-negative multiple of the chunk {chunk}, got {max_history}"
            )
        if cap is not None and max_history > cap:
            raise AnelabInputError(
                f"--max-history {max_history} exceeds {family.name}'s recorded cap {cap} (coverage {cap + chunk:,}): "
                f"larger variants are refused at export; use --max-history {cap}"
            )
        return chunk_starts(max_history + 1, chunk), "max-history"
    if histories is not None:
        hs = validate_chunk_and_histories(chunk, list(histories))
        if cap is not None and max(hs) > cap:
            raise AnelabInputError(
                f"history {max(hs)} exceeds {family.name}'s recorded cap {cap}; drop it from --histories"
            )
        return hs, "histories"
    top = max(needed) if needed else 0
    if cap is not None and top > cap:
        return chunk_starts(cap + 1, chunk), "family cap"
    return chunk_starts(top + 1, chunk), "default"


def plan(
    prompt_tokens: int,
    *,
    family: str | None = None,
    chunk: int | None = None,
    histories: Sequence[int] | None = None,
    max_history: int | None = None,
    num_layers: int | None = None,
    full_attention_layers: Sequence[int] | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    sparse_budget: int | None = None,
    load_seconds: float | Sequence[float] | None = None,
    gpu_attention_seconds: float | None = None,
    ane_attention_seconds: float | None = None,
    non_attention_seconds: float | None = None,
    allow_past_coverage: bool = False,
    data_dir: str | Path | None = None,
    gpu_prefill_seconds: float | None = None,
    gpu_tokens_per_second: float | None = None,
    loads_in_arm: bool = True,
    backend: str | None = None,
    protocol: str = DEFAULT_PROTOCOL,
    reload_policy: str = DEFAULT_RELOAD_POLICY,
    own_non_attention: tuple[float, str] | None = None,
    weights: tuple[float, float] | None = None,
    gpu_runtime: str = TINYTITAN,
    chip: str | None = None,
) -> PrefillPlan:
    """Plan the prefill of one prompt and decide ANE offload vs GPU.

    ``family``: geometry and fitted costs (:data:`FAMILIES`); geometry or cost arguments override it (without
    a family all are needed): ``load_seconds`` (one, or one per history); ``gpu_attention_seconds`` /
    ``ane_attention_seconds`` (one layer, full chunk at history 0, scaled by score entries);
    ``non_attention_seconds``; the user's ``gpu_prefill_seconds`` / ``gpu_tokens_per_second`` replace the GPU
    arm. ``histories``: default the chunk starts the prompt needs; past coverage is refused unless
    ``allow_past_coverage`` (then on the GPU). ``backend``: whose loads (coreai_loads); ``protocol`` /
    ``reload_policy``: ``planner.loads``; ``own_non_attention``: (s, basis), ``planner.gpu_model``; ``gpu_runtime``:
    ``tinytitan`` (the recorded rows' rates, an M3) or ``mlx-lm`` (on ``chip``, default M3)."""
    require_protocol(protocol), require_reload_policy(reload_policy), require_gpu_runtime(gpu_runtime)
    fam, chunk = _family_and_chunk(family, chunk)
    require_positive("--prompt-tokens", prompt_tokens), require_positive("--chunk", chunk)
    geometry = plan_geometry(fam, num_layers, full_attention_layers, num_heads, num_kv_heads, head_dim, sparse_budget)
    schedule, needed, hs, hs_source, fits = _schedule(
        prompt_tokens, chunk, histories, max_history, fam, allow_past_coverage
    )
    fit = priced_fit(fit_costs(data_dir), backend, data_dir) if fam is not None else None
    flags = (load_seconds, gpu_attention_seconds, ane_attention_seconds, non_attention_seconds)
    user, coverage = (gpu_prefill_seconds, gpu_tokens_per_second), _coverage(hs, chunk)
    pays, protocol_reason = pays_specialization(protocol, _visited_arena(geometry, chunk, schedule))
    runtime = GpuRuntime(gpu_runtime, get_chip(chip or "M3").name, _weights(fam, weights), own_non_attention)
    costs, terms = _costs_and_terms(
        fam, fit, geometry, prompt_tokens, chunk, hs, schedule, flags, user, loads_in_arm, pays, runtime
    )
    split = _load_split(fit or fit_costs(data_dir), geometry, chunk, schedule, costs, terms, reload_policy)
    split.update(protocol=protocol, protocol_reason=protocol_reason, pays_specialization=pays,
                 reload_policy=reload_policy, weights=runtime.weights, **runtime.fields(fam))  # fmt: skip
    coverage_needed = (max(needed) + chunk) if needed else 0
    reason = _reason(terms, prompt_tokens, chunk, fits, coverage_needed, coverage, geometry)
    return PrefillPlan(
        family=fam.name if fam else None,
        geometry=geometry.to_dict(),
        prompt_tokens=prompt_tokens,
        chunk=chunk,
        histories=hs,
        coverage=coverage,
        coverage_needed=coverage_needed,
        fits=fits,
        chunks=[{**asdict(c), "history": c.history} for c in schedule],
        non_attention_seconds=costs.non_attention_seconds,
        reason=reason,
        **_term_fields(terms),
        cost_sources={**costs.sources, "histories": hs_source},
        provenance=_provenance(fam, geometry, prompt_tokens, chunk, costs, terms, fit, runtime.name),
        loads_in_arm=loads_in_arm,
        **split,
    )


def _family_and_chunk(family: str | None, chunk: int | None) -> tuple[Family | None, int]:
    """The family (or None) and the chunk: given, else the family's reference chunk; neither is refused."""
    fam = get_family(family) if family is not None else None
    chunk = REFERENCE_CHUNK if chunk is None and fam is not None else chunk
    if chunk is None:
        raise AnelabInputError("pass --chunk (the sidecar's width) or a --family")
    return fam, chunk


def _term_fields(terms) -> dict:
    """The plan's fields that are a ``PrefillTerms``' numbers."""
    return {
        "variants": terms.variants,
        "variants_visited": len(terms.variants),
        "load_seconds": terms.load_by_history,
        "setup_seconds": terms.setup,
        "gpu_attention_seconds": terms.gpu_attention,
        "ane_attention_seconds": terms.ane_attention,
        "attention_saved_seconds": terms.saved,
        "gpu_prefill_seconds": terms.gpu_total,
        "ane_prefill_seconds": terms.ane_total,
        "predicted_ratio": terms.ratio,
        "decision": terms.decision,
        "keys_per_query": terms.keys,
    }


def _schedule(prompt_tokens, chunk, histories, max_history, fam, allow_past_coverage):
    """(schedule, histories the ANE chunks need, histories on hand, their source, fits): a prompt past
    coverage is refused, or (``allow_past_coverage``) planned on the GPU."""
    schedule = chunk_schedule(prompt_tokens, chunk)
    needed = [c.history for c in schedule if c.device == "ane"]
    hs, hs_source = _histories(chunk, needed, histories, max_history, fam)
    fits = _check_coverage(prompt_tokens, chunk, needed, hs, fam, allow_past_coverage)
    schedule = schedule if fits else [Chunk(c.index, c.start, c.tokens, "gpu") for c in schedule]
    return schedule, needed, hs, hs_source, fits


def _weights(fam: Family | None, weights) -> dict | None:
    """(active weights, bytes) of the model: given (a checkpoint's), else the family's assumed ones."""
    if weights is None and fam is not None:
        from anelab.planner.gpu_model import BYTES_PER_WEIGHT, FAMILY_WEIGHTS

        params, storage = FAMILY_WEIGHTS[fam.name]
        weights = (params, params * BYTES_PER_WEIGHT[storage])
    return None if weights is None else {"active": float(weights[0]), "bytes": float(weights[1])}


def _visited_arena(geometry: PlanGeometry, chunk: int, schedule: list[Chunk]) -> int:
    """Score-arena bytes of every (layer, history) function a schedule's ANE chunks visit."""
    n_fa = len(geometry.full_attention_layers)
    return n_fa * sum(geometry.score_arena_bytes(chunk, c.history) for c in schedule if c.device == "ane")


def _load_split(fit: CostFit, geometry, chunk, schedule, costs: PlanCosts, terms, policy: str) -> dict:
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


def _own_geometry(costs: PlanCosts, fam: Family, geometry: PlanGeometry, own) -> PlanCosts:
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


@dataclass(frozen=True)
class GpuRuntime:
    """Whose GPU prefill a plan prices (``gpu_model.GPU_RUNTIMES``), on which chip, for which weights
    (``{"active", "bytes"}``), and the model's own non-attention on TinyTitan's path (s, basis) when given."""

    name: str
    chip: str
    weights: dict | None
    own_non_attention: tuple[float, str] | None = None

    def fields(self, fam: Family | None) -> dict:
        """The plan's runtime fields; the band: mlx-lm's record spread, or x/÷ RUNTIME_BAND when TinyTitan's
        rates are carried to another model than a recorded family."""
        if self.name == MLX_LM:
            from anelab.planner.mlx_lm_rates import fit_mlx_lm

            band = fit_mlx_lm().band
        else:
            band = RUNTIME_BAND if self.own_non_attention is not None else None
        chip = self.chip if self.name == MLX_LM else "M3"
        return {"gpu_runtime": self.name, "gpu_chip": chip, "gpu_runtime_band": band if fam is not None else None}


def _mlx_lm_costs(costs: PlanCosts, fam: Family, geometry: PlanGeometry, prompt_tokens: int, schedule, runtime):
    """The GPU arm as mlx-lm would run it on ``runtime.chip``: its linear FLOPs and its causal attention FLOPs at
    the fitted fraction of the chip's peak (``planner.mlx_lm_rates``). The attention seconds are spread over the
    plan's chunks per score entry, so the offloaded chunks' share is what the ANE saves."""
    from anelab.planner.mlx_lm_rates import fit_mlx_lm, peak_flops, prefill_flops

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


def _costs_and_terms(
    fam, fit, geometry, prompt_tokens, chunk, hs, schedule, flags, user, loads_in_arm, pays=False, runtime=None
):
    """(PlanCosts, PrefillTerms): the family's costs with the flags over them; the user's GPU prefill
    ``user`` = (seconds, tokens per second) replaces the GPU arm, split into attention and the rest in
    the modelled proportion. ``loads_in_arm=False``: the ANE arm leaves the loads out (the warm
    protocol of the recorded dense A/B rows); ``setup_seconds`` still prices them."""
    runtime = runtime or GpuRuntime(TINYTITAN, "M3", None)
    base_costs = _family_costs(fam, prompt_tokens, fit, pays) if fam is not None else None
    if base_costs is not None and runtime.name == MLX_LM:
        base_costs = _mlx_lm_costs(_own_geometry(base_costs, fam, geometry, None), fam, geometry, prompt_tokens,
                                   schedule, runtime)  # fmt: skip
    elif base_costs is not None:
        base_costs = _own_geometry(base_costs, fam, geometry, runtime.own_non_attention)
    costs = _costs_from_flags(geometry, chunk, hs, *flags, base_costs)
    terms = _prefill_terms(geometry, chunk, schedule, costs, loads_in_arm)
    user_gpu = _user_gpu_seconds(prompt_tokens, *user)
    if user_gpu is not None:
        costs = _scaled_gpu_costs(costs, user_gpu / terms.gpu_total, user_gpu, user[0] is not None)
        terms = _prefill_terms(geometry, chunk, schedule, costs, loads_in_arm)
    return costs, terms


def _user_gpu_seconds(prompt_tokens: int, seconds: float | None, tokens_per_second: float | None) -> float | None:
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


def _scaled_gpu_costs(costs: PlanCosts, factor: float, user_seconds: float, as_seconds: bool) -> PlanCosts:
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


def _provenance(fam, geometry, prompt_tokens, chunk, costs: PlanCosts, terms, fit, runtime: str = TINYTITAN) -> dict:
    """Kind of each deciding cost (``envelope.KINDS``): the loads, the GPU prefill, the ANE attention."""
    loads = [kind_of(v["source"]) for v in terms.load_by_history.values()]
    gpu_source = costs.sources.get("gpu_prefill") or costs.sources.get("gpu_attention", "")
    if gpu_source.startswith(YOURS):
        gpu = YOURS
    elif gpu_source.startswith("flag"):
        gpu = YOURS if costs.sources.get("non_attention", "").startswith("flag") else EXTRAPOLATED
    elif runtime == MLX_LM:
        gpu = EXTRAPOLATED  # public records of other models on other chips
    else:
        gpu = gpu_kind(fam.name if fam else None, geometry, prompt_tokens, chunk, fit)
    ane_source = costs.sources.get("ane_attention", "")
    ane = YOURS if ane_source.startswith("flag") else ane_kind(geometry, chunk, fit)
    return {"load": worst_kind(loads) if loads else None, "gpu_prefill": gpu, "ane_attention": ane}


def plan_geometry(
    fam: Family | None,
    num_layers: int | None,
    full_attention_layers: Sequence[int] | None,
    num_heads: int | None,
    num_kv_heads: int | None,
    head_dim: int | None,
    sparse_budget: int | None,
) -> PlanGeometry:
    """The family's geometry with each given value overriding it; without a family every one of
    layers, full-attention layers and heads is needed."""
    base_g = fam.geometry if fam else None
    if base_g is None:
        flags = (("--layers", num_layers), ("--full-attention-layers", full_attention_layers), ("--heads", num_heads))
        missing = [f for f, v in flags if v is None]
        if missing:
            raise AnelabInputError(
                f"without --family, pass {', '.join(missing)} (or choose a --family; see --list-families)"
            )
    return PlanGeometry(
        num_layers if num_layers is not None else base_g.num_layers,
        tuple(full_attention_layers) if full_attention_layers is not None else base_g.full_attention_layers,
        num_heads if num_heads is not None else base_g.num_heads,
        num_kv_heads if num_kv_heads is not None else (base_g.num_kv_heads if base_g and num_heads is None else None),
        head_dim if head_dim is not None else (base_g.head_dim if base_g else None),
        sparse_budget if sparse_budget is not None else (base_g.sparse_budget if base_g else None),
    )


def _check_coverage(
    prompt_tokens: int, chunk: int, needed: list[int], hs: list[int], fam: Family | None, allow_past_coverage: bool
) -> bool:
    """True when the histories serve every ANE chunk; a prompt past coverage is refused (naming the
    coverage it needs) unless ``allow_past_coverage``, when it is planned on the GPU."""
    missing_h = sorted(set(needed) - set(hs))
    if not missing_h:
        return True
    if not allow_past_coverage:
        where = (
            f"; {fam.name}'s recorded cap is --max-history {fam.max_history} (coverage {fam.max_history + chunk:,}), "
            f"so this prompt must stay on the GPU"
            if fam and fam.max_history is not None and max(needed) > fam.max_history
            else f"; use --max-history {max(needed)}"
        )
        raise AnelabInputError(
            f"prompt of {prompt_tokens:,} tokens is past coverage {_coverage(hs, chunk):,}: it needs coverage "
            f"{max(needed) + chunk:,} (histories {', '.join(str(h) for h in missing_h)} missing){where}"
        )
    return False


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


def _prefill_terms(
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


def _reason(
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
        text = f"attention time saved {saved:.0f} s exceeds setup {setup:.0f} s ({n_variants} variant loads)"
        return text + (f"; {sparse_note}" if sparse_note else "")
    if saved <= 0:
        head = f"ANE attention {ane_attn:.0f} s is no faster than the GPU's {gpu_attn:.0f} s"
        return f"{sparse_note}: {head}" if sparse_note else head
    text = f"setup {setup:.0f} s ({n_variants} variant loads) exceeds attention time saved {saved:.0f} s"
    if setup > gpu_total:
        text += f" and the whole GPU prefill {gpu_total:.0f} s"
    return text + (f"; {sparse_note}" if sparse_note else "")


def predicted_vs_recorded(data_dir: str | Path | None = None) -> list[dict]:
    """Each recorded ratio against the model's prediction, three ways.

    - ``in_sample``: the fit uses every row (this one included); the prediction takes the row's
      measured GPU seconds as given and predicts its ANE seconds.
    - ``leave_one_out``: the same, with the row's ANE time held out of the fit.
    - ``plan``: what :func:`plan` says for the family at the row's prompt and chunk (non-attention
      from the family fit, scaled by tokens) — no measured time of the row as input, under the default
      protocol (``planner.loads``). The held-out-family backtest is ``planner.backtest``.
    Errors are (predicted - recorded) / recorded.
    """
    directory, fit, rows = timed_ab_rows(data_dir)
    out = []
    for row in rows:
        pred_in, clamped_in = predicted_ane_seconds(row, fit)
        pred_loo, clamped_loo = predicted_ane_seconds(row, cached_fit(directory, (row.record, row.family)))
        planned = plan(row.prompt_tokens, family=row.family, chunk=row.chunk, data_dir=directory).predicted_ratio
        r_in, r_loo = row.gpu_seconds / pred_in, row.gpu_seconds / pred_loo
        out.append(
            {
                "family": row.family,
                "record": row.record,
                "prompt_tokens": row.prompt_tokens,
                "chunk": row.chunk,
                "recorded_ratio": row.ratio,
                "in_sample_ratio": r_in,
                "in_sample_error": (r_in - row.ratio) / row.ratio,
                "leave_one_out_ratio": r_loo,
                "leave_one_out_error": (r_loo - row.ratio) / row.ratio,
                "plan_ratio": planned,
                "plan_error": (planned - row.ratio) / row.ratio,
                "non_attention_clamped": clamped_in or clamped_loo,
            }
        )
    return out
