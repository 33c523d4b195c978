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
from anelab.planner.ane_chips import carry_ane
from anelab.planner.catalogue import (
    EXTRAPOLATED,
    REFERENCE_CHUNK,
    Chunk,
    Family,
    PlanGeometry,
    chunk_schedule,
    get_family,
    require_positive,
)
from anelab.planner.chips import SEED_CHIP, resolve_chip
from anelab.planner.cold_start import cold_start
from anelab.planner.coreai_loads import priced_fit
from anelab.planner.energy import DEFAULT_OBJECTIVE, energy_decision, plan_energy, require_objective
from anelab.planner.envelope import YOURS, ane_kind, gpu_kind, kind_of, worst_kind
from anelab.planner.fit import cached_fit, fit_costs, predicted_ane_seconds, timed_ab_rows
from anelab.planner.gpu_model import BYTES_PER_WEIGHT, FAMILY_WEIGHTS
from anelab.planner.gpu_runtimes import TINYTITAN, GpuRuntime, plan_runtime
from anelab.planner.loads import (
    DEFAULT_PROTOCOL,
    DEFAULT_RELOAD_POLICY,
    pays_specialization,
    require_protocol,
    require_reload_policy,
)
from anelab.planner.plan_costs import (
    PlanCosts,
    costs_from_flags,
    family_costs,
    scaled_gpu_costs,
    user_gpu_seconds,
)
from anelab.planner.plan_costs import check_user_gpu as check_user_gpu  # re-exported: the CLI checks the flags
from anelab.planner.plan_terms import load_split, prefill_terms, reason_for, visited_arena


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
    gpu_runtime: str = TINYTITAN  # whose GPU prefill the GPU arm describes (gpu_runtimes.GPU_RUNTIMES)
    gpu_chip: str = SEED_CHIP  # the chip the GPU arm's numbers describe
    gpu_runtime_band: float | None = None  # x/÷ for carrying a runtime's rates to this model (None: the fit's own)
    chip: str = SEED_CHIP  # the chip both arms are priced on
    chip_choice: str = ""  # how the chip was chosen (--chip, detected on this Mac, or the seed's M3 off a Mac)
    ane_chip: dict | None = None  # ane_chips.AneCarry: the seed's ANE attention carried to ``chip``
    objective: str = DEFAULT_OBJECTIVE  # what ``decision`` optimises: time or energy (planner.energy)
    time_decision: str = ""  # the decision on seconds (= decision when the objective is time)
    energy: dict | None = None  # joules of both arms (planner.energy.plan_energy) and the energy decision
    cold_start: dict | None = None  # one-time cost and the prompts that repay it (planner.cold_start)

    def to_dict(self) -> dict:
        return asdict(self)


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
    gpu_runtime: str | None = None,
    chip: str | None = None,
    objective: str = DEFAULT_OBJECTIVE,
) -> PrefillPlan:
    """Plan the prefill of one prompt and decide ANE offload vs GPU.

    ``family``: geometry and fitted costs (:data:`FAMILIES`); geometry or cost arguments override it (without
    a family all are needed): ``load_seconds`` (one, or one per history); ``gpu_attention_seconds`` /
    ``ane_attention_seconds`` (one layer, full chunk at history 0, scaled by score entries);
    ``non_attention_seconds``; the user's ``gpu_prefill_seconds`` / ``gpu_tokens_per_second`` replace the GPU
    arm. ``histories``: default the chunk starts the prompt needs; past coverage is refused unless
    ``allow_past_coverage`` (then on the GPU). ``backend``: whose loads (coreai_loads); ``protocol`` /
    ``reload_policy``: ``planner.loads``; ``own_non_attention``: (s, basis), ``planner.gpu_model``; ``gpu_runtime``,
    ``chip``, ``objective``: ``gpu_runtimes`` (None: a family's default), ``chips.resolve_chip``, ``energy``."""
    require_protocol(protocol), require_reload_policy(reload_policy), require_objective(objective)
    fam, chunk = _family_and_chunk(family, chunk)
    require_positive("--prompt-tokens", prompt_tokens), require_positive("--chunk", chunk)
    geometry = plan_geometry(fam, num_layers, full_attention_layers, num_heads, num_kv_heads, head_dim, sparse_budget)
    schedule, needed, hs, hs_source, fits = _schedule(prompt_tokens, chunk, histories, max_history, fam,
                                                      allow_past_coverage)  # fmt: skip
    fit = priced_fit(fit_costs(data_dir), backend, data_dir) if fam is not None else None
    flags = (load_seconds, gpu_attention_seconds, ane_attention_seconds, non_attention_seconds)
    user, coverage = (gpu_prefill_seconds, gpu_tokens_per_second), _coverage(hs, chunk)
    pays, protocol_reason = pays_specialization(protocol, visited_arena(geometry, chunk, schedule))
    the_chip, chip_choice = resolve_chip(chip)
    runtime = plan_runtime(gpu_runtime, the_chip.name, _weights(fam, weights), own_non_attention)
    costs, terms, ane = _costs_and_terms(fam, fit, geometry, prompt_tokens, chunk, hs, schedule, flags, user,
                                         loads_in_arm, pays, runtime)  # fmt: skip
    split = load_split(fit or fit_costs(data_dir), geometry, chunk, schedule, costs, terms, reload_policy)
    split.update(protocol=protocol, protocol_reason=protocol_reason, pays_specialization=pays,
                 reload_policy=reload_policy, weights=runtime.weights, **runtime.fields(fam))  # fmt: skip
    coverage_needed = (max(needed) + chunk) if needed else 0
    reason = reason_for(terms, prompt_tokens, chunk, fits, coverage_needed, coverage, geometry)
    chip_fields = _chip_fields(the_chip.name, chip_choice, ane, terms, split, objective, backend, geometry)
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
        reason=f"energy: {chip_fields['energy']['reason']}" if objective == "energy" else reason,
        **{**_term_fields(terms), "decision": chip_fields.pop("decision")},
        cost_sources={**costs.sources, "histories": hs_source},
        provenance=_provenance(fam, geometry, prompt_tokens, chunk, costs, terms, fit, runtime),
        loads_in_arm=loads_in_arm,
        **split,
        **chip_fields,
    )


def _chip_fields(chip, chip_choice, ane, terms, split, objective, backend, geometry) -> dict:
    """The plan's per-chip fields: the ANE carry, both arms' joules, the cold start, and the decision the
    objective picks (time: the seconds' one; energy: the joules' central one)."""
    in_arm = terms.setup
    gpu_left = terms.ane_total - terms.ane_attention - in_arm
    energy = plan_energy(chip, terms.gpu_total, max(gpu_left, 0.0), terms.ane_attention, in_arm)
    decision, why = energy_decision(energy["gpu_joules"], energy["ane_joules"], bool(terms.variants))
    energy.update(decision=decision, reason=why)
    runs = bool(terms.variants)
    start = cold_start(split["specialization_seconds"] if not split["pays_specialization"] else 0.0,
                       terms.gpu_total, terms.ane_total, backend=backend,
                       assets=len(geometry.full_attention_layers), runs_on_ane=runs)  # fmt: skip
    central = "ane" if runs and energy["ane_joules"]["value"] < energy["gpu_joules"]["value"] else "gpu"
    return {
        "chip": chip,
        "chip_choice": chip_choice,
        "ane_chip": ane.to_dict() if ane is not None else None,
        "objective": objective,
        "time_decision": terms.decision,
        "energy": energy,
        "cold_start": start,
        "decision": central if objective == "energy" else terms.decision,
    }


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
        params, storage = FAMILY_WEIGHTS[fam.name]
        weights = (params, params * BYTES_PER_WEIGHT[storage])
    return None if weights is None else {"active": float(weights[0]), "bytes": float(weights[1])}


def _costs_and_terms(fam, fit, geometry, prompt_tokens, chunk, hs, schedule, flags, user, loads_in_arm, pays,
                     runtime: GpuRuntime):  # fmt: skip
    """(PlanCosts, PrefillTerms, AneCarry or None): the family's costs priced by the GPU runtime's table entry on its
    chip, the flags over them, the seed's ANE rate carried to the chip (``ane_chips``; not a flag's); the user's
    GPU prefill ``user`` = (seconds, tokens per second) replaces the GPU arm, split into attention and the rest in
    the modelled proportion. ``loads_in_arm=False``: the ANE arm leaves the loads out (the warm protocol of the
    recorded dense A/B rows); ``setup_seconds`` still prices them."""
    base_costs = family_costs(fam, prompt_tokens, fit, pays) if fam is not None else None
    if base_costs is not None:
        base_costs = runtime.entry.price(base_costs, fam, geometry, prompt_tokens, schedule, runtime)
    costs = costs_from_flags(geometry, chunk, hs, *flags, base_costs)
    ane = None
    if not costs.sources.get("ane_attention", "").startswith("flag"):
        ane = carry_ane(runtime.chip, geometry, chunk, [c.history for c in schedule if c.device == "ane"])
        if ane.scale != 1.0:
            sources = {**costs.sources, "ane_attention": f"{ane.basis}; from {costs.sources['ane_attention']}"}
            costs = PlanCosts(costs.gpu_seconds_per_entry, costs.ane_seconds_per_entry * ane.scale, costs.load,
                              costs.non_attention_seconds, sources)  # fmt: skip
    terms = prefill_terms(geometry, chunk, schedule, costs, loads_in_arm)
    user_gpu = user_gpu_seconds(prompt_tokens, *user)
    if user_gpu is not None:
        costs = scaled_gpu_costs(costs, user_gpu / terms.gpu_total, user_gpu, user[0] is not None)
        terms = prefill_terms(geometry, chunk, schedule, costs, loads_in_arm)
    return costs, terms, ane


def _provenance(fam, geometry, prompt_tokens, chunk, costs: PlanCosts, terms, fit, runtime: GpuRuntime) -> dict:
    """Kind of each deciding cost (``envelope.KINDS``): the loads, the GPU prefill, the ANE attention."""
    loads = [kind_of(v["source"]) for v in terms.load_by_history.values()]
    gpu_source = costs.sources.get("gpu_prefill") or costs.sources.get("gpu_attention", "")
    if gpu_source.startswith(YOURS):
        gpu = YOURS
    elif gpu_source.startswith("flag"):
        gpu = YOURS if costs.sources.get("non_attention", "").startswith("flag") else EXTRAPOLATED
    elif runtime.entry.provenance == EXTRAPOLATED or runtime.chip != SEED_CHIP:
        gpu = EXTRAPOLATED  # public records of other models on other chips, or the seed's path on another chip
    else:
        gpu = gpu_kind(fam.name if fam else None, geometry, prompt_tokens, chunk, fit)
    ane_source = costs.sources.get("ane_attention", "")
    if ane_source.startswith("flag"):
        ane = YOURS
    elif ane_source.startswith(EXTRAPOLATED):
        ane = EXTRAPOLATED
    else:
        ane = ane_kind(geometry, chunk, fit)
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
                **row.identity(),
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
