"""One ``anelab plan`` request: its options, the mode they pick and that mode run to a result to print.

The modes: a replay of the records (``backtest``, ``fit_report``, ``list_families``), the GPU runtimes a plan
can price (``gpu_runtimes``), a family's or a checkpoint's plan with its three-way verdicts, or a comparison
of sidecar designs (``design``) for the families or a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.default import resolve_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.planner.backtest import backtest, format_backtest
from anelab.planner.catalogue import FAMILIES, REFERENCE_CHUNK, family_table
from anelab.planner.chip_validation import format_validation, validate_chips
from anelab.planner.chips import CHIPS, bound_sentence, plan_bounds, resolve_chip
from anelab.planner.coreai_loads import MISSING
from anelab.planner.design_plans import DESIGNS, compare_designs
from anelab.planner.fit import fit_costs, load_fit_report
from anelab.planner.from_checkpoint import checkpoint_designs, plan_from_checkpoint
from anelab.planner.gpu_runtimes import gpu_runtime_phrase, runtime_descriptions
from anelab.planner.load_flip import flip_sentence
from anelab.planner.loads import DEFAULT_PROTOCOL, DEFAULT_RELOAD_POLICY
from anelab.planner.mlx_lm_rates import fit_mlx_lm, format_mlx_lm_fit
from anelab.planner.offload_split import checkpoint_splits
from anelab.planner.plan import PrefillPlan, plan, predicted_vs_recorded
from anelab.planner.plan_text import (
    format_checkpoint_plan,
    format_designs,
    format_family_table,
    format_fit_report,
    format_plan,
    format_verdict,
    offload_split_lines,
)
from anelab.planner.published_splits import format_published, published_vs_predicted
from anelab.planner.settle import MAC_MEASUREMENT_PLAN, settle_commands
from anelab.planner.verdict import plan_arm_costs, verdict_for

GEOMETRY_OPTIONS = ("layers", "full_attention_layers", "heads", "kv_heads", "head_dim", "sparse_budget")


@dataclass(frozen=True)
class PlanOptions:
    """Every option of a plan request, named as ``anelab plan``'s flags (``--kv-heads``: ``kv_heads``).

    ``checkpoint``: a path or a named checkpoint as given (resolved when a checkpoint mode runs); seconds are
    per layer, full chunk at history 0, except ``gpu_prefill_seconds`` (the whole prompt); ``design``: design
    names or ``["all"]``."""

    prompt_tokens: int | None = None
    family: str | None = None
    checkpoint: str | None = None
    chunk: int | None = None
    histories: Sequence[int] | None = None
    max_history: int | None = None
    layers: int | None = None
    full_attention_layers: Sequence[int] | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    sparse_budget: int | None = None
    load_seconds: Sequence[float] | None = None
    gpu_attention_seconds: float | None = None
    ane_attention_seconds: float | None = None
    non_attention_seconds: float | None = None
    gpu_prefill_seconds: float | None = None
    gpu_tokens_per_second: float | None = None
    protocol: str = DEFAULT_PROTOCOL
    reload_policy: str = DEFAULT_RELOAD_POLICY
    gpu_runtime: str | None = None
    chip: str | None = None
    objective: str = "time"
    design: Sequence[str] | None = None
    tile: int | None = None
    query_tile: int | None = None
    backend: str | None = None
    list_families: bool = False
    fit_report: bool = False
    backtest: bool = False
    gpu_runtimes: bool = False
    validate_chips: bool = False
    published_splits: bool = False

    def cost_keywords(self) -> dict:
        """The keywords ``planner.plan`` and ``plan_from_checkpoint`` share: costs, loads, the user's GPU, chip,
        objective."""
        names = ("family", "chunk", "histories", "max_history", "load_seconds", "gpu_attention_seconds",
                 "ane_attention_seconds", "non_attention_seconds", "gpu_prefill_seconds", "gpu_tokens_per_second",
                 "protocol", "reload_policy", "chip", "objective")  # fmt: skip
        return {name: getattr(self, name) for name in names}


@dataclass(frozen=True)
class PlanResult:
    """What a plan request prints: ``payload`` as JSON, or ``text()`` (built only when asked for)."""

    payload: object
    text: Callable[[], str]


def plan_request(options: PlanOptions) -> PlanResult:
    """The mode ``options`` pick, run (module docstring); bad or conflicting options are refused in one line."""
    replays = [f for f, on in (("--backtest", options.backtest), ("--fit-report", options.fit_report),
                                ("--list-families", options.list_families)) if on]  # fmt: skip
    if replays and options.gpu_runtime is not None:
        raise AnelabInputError(f"plan {replays[0]} replays TinyTitan's recorded rows; drop --gpu-runtime")
    if options.backtest:
        rows = backtest()
        return PlanResult(rows, lambda: format_backtest(rows))
    if options.gpu_runtimes:
        fit, described = fit_mlx_lm(), runtime_descriptions()
        runtimes = "\n".join(f"{k}: {v}" for k, v in described.items())
        return PlanResult(
            {"runtimes": described, "mlx_lm": fit.to_dict()}, lambda: runtimes + "\n" + format_mlx_lm_fit(fit)
        )
    if options.published_splits:
        rows = published_vs_predicted()
        return PlanResult(rows, lambda: format_published(rows))
    if options.validate_chips:
        rows = validate_chips()
        return PlanResult(rows, lambda: format_validation(rows))
    if options.list_families:
        rows = family_table()
        return PlanResult(rows, lambda: format_family_table(rows))
    if options.fit_report:
        rows, fit, loads = predicted_vs_recorded(), fit_costs().to_dict(), load_fit_report()
        payload = {"rows": rows, "fit": {k: v for k, v in fit.items() if k != "rows"}, "loads": loads}
        return PlanResult(payload, lambda: format_fit_report(rows, fit, loads))
    if options.prompt_tokens is None:
        raise AnelabInputError("plan: pass --prompt-tokens N (or --list-families / --fit-report)")
    if options.backend is not None and (options.design or options.checkpoint):
        raise AnelabInputError("plan: --backend prices a --family plan's loads; drop --design / --checkpoint")
    if options.checkpoint is not None:
        return checkpoint_design_plans(options) if options.design else checkpoint_plan(options)
    return family_design_plans(options) if options.design else family_plan(options)


def family_plan(options: PlanOptions) -> PlanResult:
    """A recorded family's (or the options' own geometry and costs') plan with its three-way verdict; with a
    ``backend`` its loads are that backend's and the text says which per-variant load would flip it."""
    prefill_plan = plan_with_loads(options, options.backend)
    result = prefill_plan.to_dict()
    text = format_plan(result)
    if options.backend is not None:
        text += f"\nloads priced for --backend {options.backend}; " + flip_sentence(plan_with_loads(options, None))
    return with_verdicts(options, result, text, [prefill_plan])


def plan_with_loads(options: PlanOptions, backend: str | None) -> PrefillPlan:
    """``planner.plan`` of the options with ``backend``'s loads (None: Core ML's, the recorded ones). Without a
    Core AI record the refusal also says which per-variant load would flip the verdict."""
    try:
        return plan_of(options, backend)
    except AnelabInputError as e:
        if backend is None or not str(e).startswith(MISSING):
            raise
        raise AnelabInputError(f"{e}; {flip_sentence(plan_of(options, None))}") from None


def plan_of(options: PlanOptions, backend: str | None) -> PrefillPlan:
    return plan(
        options.prompt_tokens,
        backend=backend,
        num_layers=options.layers,
        full_attention_layers=options.full_attention_layers,
        num_heads=options.heads,
        num_kv_heads=options.kv_heads,
        head_dim=options.head_dim,
        sparse_budget=options.sparse_budget,
        gpu_runtime=options.gpu_runtime,
        **options.cost_keywords(),
    )


def checkpoint_plan(options: PlanOptions) -> PlanResult:
    """A checkpoint's own layers and heads planned (costs from the closest family), a verdict per kind of layer."""
    given = [f"--{name.replace('_', '-')}" for name in GEOMETRY_OPTIONS if getattr(options, name) is not None]
    if given:
        raise AnelabInputError(f"--checkpoint supplies the geometry; drop {', '.join(given)}")
    checkpoint = load_checkpoint(resolve_checkpoint(options.checkpoint))
    keywords = {**options.cost_keywords(), "gpu_runtime": options.gpu_runtime}
    planned = plan_from_checkpoint(checkpoint, options.prompt_tokens, **keywords)
    result = planned.to_dict()
    splits = checkpoint_splits(checkpoint, options.prompt_tokens, list(CHIPS),
                               lambda chip: plan_from_checkpoint(checkpoint, options.prompt_tokens,
                                                                 **{**keywords, "chip": chip}))  # fmt: skip
    text = format_checkpoint_plan(result) + "\n" + "\n".join(offload_split_lines(splits))
    return with_verdicts(options, {**result, "offload_split": splits}, text, list(planned.parts.values()))


def with_verdicts(options: PlanOptions, result: dict, text: str, parts: list[PrefillPlan]) -> PlanResult:
    """The plan (``result``, its text) and each part's three-way verdict with thresholds, envelope and what
    settles it (``planner.verdict``); with a chip, the fastest each arm could run on it."""
    n = options.prompt_tokens
    where = f"--checkpoint {options.checkpoint}" if options.checkpoint else f"--family {result.get('family')}"
    commands = settle_commands(
        n,
        gpu_command=f"anelab plan {where} --prompt-tokens {n}",
        mac_command=f"anelab decide {options.checkpoint or 'CHECKPOINT'} --prompt-tokens {n}",
        mac_measurement=MAC_MEASUREMENT_PLAN,
    )
    verdicts = [verdict_for(plan_arm_costs(part), commands).to_dict() for part in parts]
    bounds = [] if options.chip is None else [plan_bounds(part.to_dict(), options.chip) for part in parts]
    if bounds:
        text += "\n" + "\n".join(bound_sentence(b) for b in bounds)

    def lines() -> str:
        out = [text]
        for part, verdict in zip(parts, verdicts):
            kind = f" ({len(part.geometry['full_attention_layers'])} layers)" if len(parts) > 1 else ""
            out += [f"--- three-way verdict{kind} ---", format_verdict(verdict)]
        return "\n".join(out)

    return PlanResult({**result, "verdicts": verdicts, **({"bounds": bounds} if bounds else {})}, lines)


def family_design_plans(options: PlanOptions) -> PlanResult:
    """Sidecar designs compared on the recorded families (every family unless ``family``)."""
    designs = list(DESIGNS) if list(options.design) == ["all"] else options.design
    families = [options.family] if options.family else list(FAMILIES)
    runtime = options.gpu_runtime
    rows = {
        f: [
            d.to_dict()
            for d in compare_designs(
                options.prompt_tokens,
                f,
                options.chunk or REFERENCE_CHUNK,
                designs,
                key_tile=options.tile,
                query_tile=options.query_tile,
                gpu_runtime=runtime,
                protocol=options.protocol,
                reload_policy=options.reload_policy,
                chip=options.chip,
            )  # fmt: skip
        ]
        for f in families
    }

    def text() -> str:
        said = {"gpu_runtime": runtime, "gpu_chip": resolve_chip(options.chip)[0].name}
        return format_designs(rows) + "\nGPU arm: " + gpu_runtime_phrase(said)

    return PlanResult(rows, text)


def checkpoint_design_plans(options: PlanOptions) -> PlanResult:
    """Every design per kind of attention layer of a checkpoint, with the full-attention layers' verdicts."""
    designs = None if list(options.design) == ["all"] else options.design
    planned, plans = checkpoint_designs(
        load_checkpoint(resolve_checkpoint(options.checkpoint)), options.prompt_tokens, designs, family=options.family,
        chunk=options.chunk, key_tile=options.tile, query_tile=options.query_tile,
        gpu_prefill_seconds=options.gpu_prefill_seconds, gpu_tokens_per_second=options.gpu_tokens_per_second,
        protocol=options.protocol, reload_policy=options.reload_policy,
        gpu_runtime=options.gpu_runtime, chip=options.chip,
    )  # fmt: skip
    name = Path(options.checkpoint).name
    rows = {f"{name} ({kind})": [d.to_dict() for d in kind_plans] for kind, kind_plans in plans.items()}

    def text() -> str:
        out = [f"costs: {planned.cost_family or 'flags'} — {planned.cost_family_reason}", format_designs(rows)]
        for design in plans.get("full", []):
            verdict = verdict_for(plan_arm_costs(planned.parts["full"], design)).to_dict()
            out += [f"--- three-way verdict ({design.design}) ---", format_verdict(verdict)]
        return "\n".join(out)

    return PlanResult(rows, text)
