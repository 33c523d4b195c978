"""``anelab decide``: should this checkpoint's prefill attention go to the ANE — one answer, its evidence, what would change it.

Steps (each shown on a progress bar):

1. **plan** every design (``planner.design``) for the checkpoint's full-attention layers at the
   user's prompt; each design gets a three-way verdict (``planner.verdict``) with its thresholds;
2. **export** the candidate design's sidecar for every attention layer (``--design auto``: the
   design with the best predicted ratio) into ``DIR/sidecars/<design>/``;
3. **verify** each saved package against the reference (``sidecar.verify.verify_package``);
4. **arms**: the whole model with every attention layer on its sidecar vs the reference
   (``studies.arms.compare_arms``: logits, greedy text, per-layer differences) at the chosen chunk —
   on the candidate's packages when the arms serve its design, else on per-history packages of the
   same layers and chunk (said in the report);
5. **measure** (a Mac, ``--measure``): cold and warm loads of every function of one layer's package,
   predictions per compute units (per-history functions), through ``anelab.runtimes``; the measured
   numbers replace the predicted ones and the verdict is planned again;
6. **report**: ``DIR/decision.json``, ``DIR/report.md``, ``DIR/report.html`` (``studies.decide_report``).

Resumable: ``DIR/evidence.json`` keeps each package's content hash and its verification; a package
already exported and verified with the same hash (and the same export request) is reused.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm.auto import tqdm

from anelab.core.errors import AnelabInputError
from anelab.core.geometry import chunk_starts
from anelab.core.records import atomic_write_text
from anelab.planner.envelope import MEASURED, YOURS, Cost
from anelab.planner.verdict import ArmCosts, Verdict, decide_arms, plan_arm_costs
from anelab.sidecar.designs import DESIGNS, PRICED, get_design

ARMS_DECODE = 8  # greedy tokens decoded after the prefill in the arms
SWEEP_POINTS = 16  # prompt lengths on the figure


@dataclass
class DecideConfig:
    """One ``anelab decide`` run (see the module docstring)."""

    checkpoint: Path
    prompt_tokens: int
    out: Path
    design: str = "auto"
    chunk: int | None = None
    family: str | None = None
    gpu_prefill_seconds: float | None = None
    gpu_tokens_per_second: float | None = None
    measure: bool = False
    runtime: object | None = None  # a CoreMLRuntime; default this machine's (needed only with measure)
    repeats: int = 3
    decode: int = ARMS_DECODE
    clock: object | None = None  # injectable clock for the timing (tests: the fake's)

    @property
    def user_gpu(self) -> dict:
        flags = {"gpu_prefill_seconds": self.gpu_prefill_seconds, "gpu_tokens_per_second": self.gpu_tokens_per_second}
        return {k: v for k, v in flags.items() if v is not None}


@dataclass
class Decision:
    """Everything the report shows (``to_dict`` is ``decision.json``)."""

    config: dict
    checkpoint: dict
    candidate: str
    verdicts: dict  # design -> Verdict.to_dict() (as planned, before any measurement)
    verdict: dict  # the candidate's final verdict (after measurement when measured)
    designs: list  # DesignPlan dicts
    plan: dict  # the per-history PrefillPlan of the full-attention layers
    evidence: dict = field(default_factory=dict)  # verify per layer, arms, measured
    sweep: list = field(default_factory=list)  # figure rows
    measured: bool = False
    yours: list = field(default_factory=list)  # which numbers are the user's / measured here

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


# ---- planning -------------------------------------------------------------------------------------------
def settle_commands(config: DecideConfig) -> dict:
    """For each deciding cost: the measurement that settles it and the exact command."""
    base = f"anelab decide {config.checkpoint} --prompt-tokens {config.prompt_tokens} --out {config.out}"
    for flag, value in (("--chunk", config.chunk), ("--family", config.family)):
        base += f" {flag} {value}" if value is not None else ""
    base += f" --design {config.design}" if config.design != "auto" else ""
    mac = ("time this model's own loads and ANE predictions on a Mac (Core ML, cold and warm)", base + " --measure")
    return {
        "load_per_layer": mac,
        "ane_attention": mac,
        "gpu_prefill": (
            f"time your GPU runtime's prefill of a {config.prompt_tokens:,}-token prompt (seconds, S)",
            base + " --gpu-prefill-seconds S",
        ),
    }


def plan_designs(config: DecideConfig, prompt_tokens: int | None = None) -> tuple[dict, list, dict]:
    """(per-history plan of the full-attention layers, design plans, design -> ArmCosts) at ``prompt_tokens``."""
    from anelab.planner.from_checkpoint import checkpoint_designs

    checkpoint_plan, by_kind = checkpoint_designs(
        config.checkpoint, prompt_tokens or config.prompt_tokens, None, family=config.family, chunk=config.chunk,
        **config.user_gpu,
    )  # fmt: skip
    if "full" not in by_kind:
        raise AnelabInputError(
            f"{config.checkpoint}: every attention layer slides over a window; decide compares designs for "
            "full-attention layers only"
        )
    designs = by_kind["full"]
    full = checkpoint_plan.parts["full"]
    arms = {d.design: plan_arm_costs(full, d.to_dict()) for d in designs}
    return {**full, "cost_family": checkpoint_plan.cost_family}, [d.to_dict() for d in designs], arms


def choose_design(config: DecideConfig, designs: list) -> str:
    names = [d["design"] for d in designs]
    if config.design != "auto":
        if config.design not in names:
            raise AnelabInputError(f"unknown --design {config.design!r}; use auto or one of: {', '.join(names)}")
        return config.design
    return max(designs, key=lambda d: d["predicted_ratio"])["design"]


# ---- preconditions ---------------------------------------------------------------------------------------
def check_request(config: DecideConfig):
    """Refuse (one line) what decide cannot do; returns the opened checkpoint and the runtime (or None)."""
    from anelab.checkpoints.checkpoint import load_checkpoint
    from anelab.checkpoints.model import load_model

    if config.design != "auto" and config.design not in PRICED:
        get_design(config.design, "--design")  # a renamed design is refused with its new name
        raise AnelabInputError(f"unknown --design {config.design!r}; use auto or one of: {', '.join(PRICED)}")
    if not Path(config.checkpoint).exists():
        raise AnelabInputError(f"checkpoint {config.checkpoint} does not exist; pass a model directory (config.json)")
    checkpoint = load_checkpoint(config.checkpoint)
    g = checkpoint.geometry
    if g.sliding_layers:
        raise AnelabInputError(
            f"{config.checkpoint} has sliding-window layers {list(g.sliding_layers)}; decide covers full-attention "
            "layers only: plan it with 'anelab plan --checkpoint'"
        )
    load_model(config.checkpoint)  # the whole-model arms need the whole model: refused here, not after the export
    runtime = None
    if config.measure:
        from anelab.runtimes.coreml import default_runtime

        runtime = config.runtime if config.runtime is not None else default_runtime()
        if not runtime.available():
            raise AnelabInputError(
                f"--measure times the packages through Core ML, which is not available here "
                f"({runtime.unavailable_reason()}); drop --measure or run on a Mac"
            )
    return checkpoint, runtime


# ---- evidence: export, verify (resumable) ----------------------------------------------------------------------
def _export_request(design: dict, chunk: int, prompt_tokens: int) -> dict:
    """What to export: the functions the prompt visits, or a state of the planned capacity — at least two
    chunks, which verification of a stateful package needs (the report names a larger capacity)."""
    request = {"graph": design["design"], "chunk": chunk}
    if design["capacity"] is None:
        request["histories"] = chunk_starts(prompt_tokens, chunk)
    else:
        unit = math.lcm(chunk, design["key_tile"] or chunk)
        capacity = -(-max(design["capacity"], 2 * chunk) // unit) * unit
        request.update(capacity=capacity, key_tile=design["key_tile"], query_tile=design["query_tile"])
    return request


def _read_evidence(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (json.JSONDecodeError, OSError):
        raise AnelabInputError(f"{path} is not readable JSON; remove it to start the evidence afresh") from None


def export_and_verify(config: DecideConfig, design: dict, layers: list, bar) -> tuple[Path, dict]:
    """Each layer's package of ``design`` exported and verified, reusing what ``evidence.json`` holds
    for the same request and content hash; the others in worker processes (``anelab.core.parallel``), the
    evidence written as each layer finishes. Returns (directory, layer -> verification summary)."""
    from anelab.core.parallel import default_jobs, process_map
    from anelab.runtimes.interface import package_content_hash

    directory = config.out / "sidecars" / design["design"]
    evidence_path = config.out / "evidence.json"
    evidence = _read_evidence(evidence_path)
    request = _export_request(design, design["chunk"], config.prompt_tokens)
    kept = evidence.get(design["design"], {})
    if kept.get("request") != request:
        kept = {"request": request, "layers": {}}
    reused = {}
    for layer in layers:
        pkg = directory / f"layer_{layer}.mlpackage"
        known = kept["layers"].get(str(layer))
        reused[layer] = known is not None and pkg.exists() and package_content_hash(pkg) == known["sha256"]
        if not reused[layer] and pkg.exists():
            _set_aside(pkg)
    todo = [layer for layer in layers if not reused[layer]]
    bar.update(len(layers) - len(todo))

    def record(job, known) -> None:
        kept["layers"][str(job[2])] = known
        evidence[design["design"]] = kept
        atomic_write_text(evidence_path, json.dumps(evidence, indent=2, sort_keys=True))
        bar.set_postfix_str(f"exported and verified layer {job[2]}")
        bar.update(1)

    if todo:
        bar.set_postfix_str(f"export and verify {len(todo)} layers")
        jobs = [(str(config.checkpoint), str(directory), layer, request) for layer in todo]
        process_map(_export_and_verify_layer, jobs, jobs=default_jobs(len(todo)), on_result=record)
    summaries = {}
    for layer in layers:
        known = kept["layers"][str(layer)]
        pkg = directory / f"layer_{layer}.mlpackage"
        summaries[layer] = {**known["verify"], "reused": reused[layer], "package": str(pkg), "sha256": known["sha256"]}
        summaries[layer]["capacity"] = request.get("capacity")
    return directory, summaries


def _export_and_verify_layer(job: tuple[str, str, int, dict]) -> dict:
    """One layer exported as ``request`` asks and verified (in a worker process): its evidence entry.
    ``job`` = (checkpoint, output directory, layer, request)."""
    from anelab.runtimes.interface import package_content_hash
    from anelab.sidecar.export import export_sidecars
    from anelab.sidecar.verify import verify_package

    checkpoint, directory, layer, request = job
    options = {k: v for k, v in request.items() if k not in ("chunk", "histories")}
    export_sidecars(checkpoint, directory, request["chunk"], request.get("histories"), [layer], jobs=1, **options)
    pkg = Path(directory) / f"layer_{layer}.mlpackage"
    report = verify_package(pkg, checkpoint, progress=False)
    return {"sha256": package_content_hash(pkg), "verify": _verify_summary(report)}


def _set_aside(pkg: Path) -> None:
    """A package whose hash no longer matches its evidence is renamed aside, never overwritten."""
    n = 1
    while pkg.with_name(f"{pkg.name}.stale-{n}").exists():
        n += 1
    os.replace(pkg, pkg.with_name(f"{pkg.name}.stale-{n}"))


def _verify_summary(report) -> dict:
    """Per package: passed, vacuous, cases and controls, and the worst relative error of a non-control case."""
    d = report.to_dict()
    cases = [c for c in d["comparisons"] if not c["control"]]
    return {
        "passed": bool(d["passed"]),
        "vacuous": bool(d["vacuous"]),
        "cases": len(cases),
        "controls": len(d["comparisons"]) - len(cases),
        "max_relative_error": max((c["worst"] for c in cases), default=None),
        "threshold": d["threshold"],
    }


def run_arms(config: DecideConfig, candidate: dict, directory: Path, bar) -> dict:
    """The whole-model arms at the candidate's chunk (on per-history packages when the arms do not
    serve the candidate's design). Returns the arms' summary."""
    from anelab.arms.compare import compare_arms

    served_by = candidate["design"]
    if not get_design(served_by).served_by_arms:
        served_by = next(name for name in PRICED if DESIGNS[name].served_by_arms and not DESIGNS[name].stateful)
        per_history = {**candidate, "design": served_by, "capacity": None, "key_tile": None, "query_tile": None}
        directory, _ = export_and_verify(config, per_history, _layers_of(config), bar)
    bar.set_postfix_str("whole-model arms")
    report = compare_arms(config.checkpoint, directory, config.prompt_tokens, decode=config.decode)
    pair = report.pairs[0]
    bar.update(1)
    return {
        "served_by": served_by,
        "note": ""
        if served_by == candidate["design"]
        else f"the arms served every layer from {served_by} packages of the same chunk ({candidate['chunk']}): "
        f"compare_arms does not serve {candidate['design']} packages",
        "prompt_tokens": int(report.prompt.size),
        "chunk": report.chunk,
        "decode": report.decode,
        "logits_relative_difference": pair.prompt_logits_diff,
        "max_step_logits_difference": max(pair.step_logits_diffs) if pair.step_logits_diffs else None,
        "greedy_agreement": pair.greedy_agreement,
        "identical_text": pair.identical_text,
        "first_divergent_layer": pair.first_divergent_layer,
        "layer_differences": [float(x) for x in pair.layer_diffs],
        "noise": pair.noise,
    }


def _layers_of(config: DecideConfig) -> list[int]:
    from anelab.checkpoints.checkpoint import load_checkpoint

    return list(load_checkpoint(config.checkpoint).geometry.full_attention_layers)


# ---- measured on this Mac ----------------------------------------------------------------------------------
def measure_packages(config: DecideConfig, runtime, package: Path, candidate: dict) -> dict:
    """Cold and warm loads of every function of one layer's package (the layers share one geometry) and,
    for per-history functions, one prediction per compute units; each result a record in ``DIR/measured``."""
    import time

    from anelab.checkpoints.checkpoint import load_checkpoint
    from anelab.runtimes.ab import time_attention_ab
    from anelab.runtimes.interface import package_functions
    from anelab.runtimes.timing import time_load

    clock = config.clock or time.perf_counter
    out = config.out / "measured"
    loads = {}
    for function in package_functions(package):
        cold, warm = (
            time_load(
                runtime, package, function, "cpu_and_ne", cold=c, repeats=config.repeats, clock=clock, out_dir=out
            )
            for c in (True, False)
        )
        loads[function] = {"cold": _stats(cold), "warm": _stats(warm)}
    predicts = {}
    if not get_design(candidate["design"]).stateful:  # functions h<s>: the A/B inputs of dense_offload
        geometry = load_checkpoint(config.checkpoint).geometry
        histories = chunk_starts(config.prompt_tokens, candidate["chunk"])
        for record in time_attention_ab(
            runtime, package, geometry, chunk=candidate["chunk"], histories=histories,
            compute_units=("cpu_and_ne", "cpu_and_gpu"), repeats=config.repeats, clock=clock, out_dir=out,
        ):  # fmt: skip
            results = record["results"]
            predicts[record["parameters"]["function"]] = {u: _stats({"results": r}) for u, r in results.items()}
    return {"package": str(package), "runtime": runtime.name, "loads": loads, "predicts": predicts}


def _stats(record: dict) -> dict | None:
    """Median / min / max seconds of one timing as ``anelab.runtimes.ab.timing_stats`` reads it — the one reading
    notebook 01's A/B and its headline use: Core ML's own predict duration where recorded, else the wall time
    of ``predict``; ``timed`` says which."""
    from anelab.runtimes.ab import timing_stats

    return timing_stats(record["results"])


def with_measured(costs: ArmCosts, measured: dict | None, design: dict, prompt_tokens: int) -> ArmCosts:
    """The deciding costs with this Mac's records in place of the predicted ones, where every function
    the prompt visits was measured (loads: cold; ANE attention: ``cpu_and_ne`` predictions)."""
    if not measured or not costs.runs_on_ane:
        return costs
    chunk, registered = design["chunk"], get_design(design["design"])
    functions = list(dict.fromkeys(registered.function_for(chunk, s) for s in chunk_starts(prompt_tokens, chunk)))
    loads = [measured["loads"].get(f, {}).get("cold") for f in functions]
    basis = f"measured on this Mac ({measured['runtime']} runtime): cold loads of {', '.join(functions)}"
    if all(loads):
        costs = replace(costs, load_per_layer=_summed(loads, MEASURED, basis))
    calls = len(chunk_starts(prompt_tokens, chunk))
    predicts = [measured["predicts"].get(f, {}).get("cpu_and_ne") for f in functions]
    if not registered.stateful and all(predicts):
        ane = _summed(predicts, MEASURED, f"measured on this Mac: cpu_and_ne predictions of {', '.join(functions)}")
        costs = replace(costs, ane_attention=ane.scaled(costs.layers))
    elif registered.stateful and all(predicts):
        costs = replace(
            costs, ane_attention=_summed(predicts * calls, MEASURED, "measured on this Mac").scaled(costs.layers)
        )
    return costs


def _summed(stats: list, kind: str, basis: str) -> Cost:
    return Cost(
        sum(s["median_s"] for s in stats), sum(s["min_s"] for s in stats), sum(s["max_s"] for s in stats), kind, basis
    )


def with_user_gpu(costs: ArmCosts, factor: float, basis: str) -> ArmCosts:
    """The user's GPU prefill (at their prompt) carried along the model's curve by one factor."""
    gpu = Cost.point(costs.gpu_prefill.value * factor, YOURS, basis)
    return replace(costs, gpu_prefill=gpu)


# ---- the run ---------------------------------------------------------------------------------------------------
def sweep(config: DecideConfig, candidate: str, measured: dict | None, user_factor: float | None) -> list[dict]:
    """The candidate's two arms over prompt lengths (the figure): value, interval and kinds per prompt."""
    from anelab.planner.verdict import decide_arms as decide_one

    chunk = next(d for d in plan_designs(config)[1] if d["design"] == candidate)["chunk"]
    top = max(2 * config.prompt_tokens, 4 * chunk)
    grid = sorted({int(round(chunk * (top / chunk) ** (i / (SWEEP_POINTS - 1)))) for i in range(SWEEP_POINTS)})
    rows, modelled = [], replace(config, gpu_prefill_seconds=None, gpu_tokens_per_second=None)
    for tokens in tqdm(sorted(set(grid) | {config.prompt_tokens}), desc="sweep", unit="prompt", leave=False):
        _, designs, arms = plan_designs(modelled, tokens)
        design = next(d for d in designs if d["design"] == candidate)
        costs = with_measured(arms[candidate], measured, design, tokens)
        if user_factor is not None:
            costs = with_user_gpu(costs, user_factor, "yours, carried along the model's curve")
        v = decide_one(costs)
        rows.append({"prompt_tokens": tokens, "gpu": v.gpu_prefill, "ane": v.ane_prefill, "decision": v.decision})
    return rows


def decide(config: DecideConfig) -> Decision:
    """Plan, export, verify, run the arms, optionally measure, and write the report (module docstring)."""
    from anelab.decide.report import write_report

    checkpoint, runtime = check_request(config)
    config.out = Path(config.out)
    config.out.mkdir(parents=True, exist_ok=True)
    layers = list(checkpoint.geometry.full_attention_layers)
    commands = settle_commands(config)
    with tqdm(total=3 + len(layers) + bool(runtime), desc="decide", unit="step") as bar:
        bar.set_postfix_str("plan every design")
        plan, designs, arms = plan_designs(config)
        verdicts = {name: decide_arms(c, commands) for name, c in arms.items()}
        name = choose_design(config, designs)
        candidate = next(d for d in designs if d["design"] == name)
        bar.update(1)
        directory, verified = export_and_verify(config, candidate, layers, bar)
        if not get_design(name).served_by_arms:
            bar.total += len(layers)
        arms_summary = run_arms(config, candidate, directory, bar)
        measured, final = None, verdicts[name]
        if runtime is not None:
            bar.set_postfix_str("measure on this Mac")
            measured = measure_packages(config, runtime, directory / f"layer_{layers[0]}.mlpackage", candidate)
            final = decide_arms(with_measured(arms[name], measured, candidate, config.prompt_tokens), commands)
            bar.update(1)
        bar.set_postfix_str("sweep prompt lengths")
        factor = _user_factor(config, plan)
        rows = sweep(config, name, measured, factor)
        bar.update(1)
    decision = Decision(
        config=_config_dict(config),
        checkpoint=_checkpoint_dict(checkpoint),
        candidate=name,
        verdicts={k: v.to_dict() for k, v in verdicts.items()},
        verdict=final.to_dict(),
        designs=designs,
        plan=plan,
        evidence={"verify": {str(k): v for k, v in verified.items()}, "arms": arms_summary, "measured": measured},
        sweep=rows,
        measured=measured is not None,
        yours=_yours(config, final),
    )
    write_report(decision, config.out)
    return decision


def _user_factor(config: DecideConfig, plan: dict) -> float | None:
    """The user's GPU prefill over the modelled one at their prompt (``plan`` already holds the user's)."""
    if not config.user_gpu:
        return None
    modelled = plan_designs(replace(config, gpu_prefill_seconds=None, gpu_tokens_per_second=None))[0]
    return plan["gpu_prefill_seconds"] / modelled["gpu_prefill_seconds"]


def _yours(config: DecideConfig, verdict: Verdict) -> list[str]:
    out = []
    for flag, value in config.user_gpu.items():
        out.append(f"GPU prefill: yours (--{flag.replace('_', '-')} {value:g})")
    for name, cost in verdict.costs.items():
        if cost["kind"] == MEASURED:
            out.append(f"{name.replace('_', ' ')}: measured on this Mac ({cost['basis']})")
    return out


def _config_dict(config: DecideConfig) -> dict:
    keys = ("checkpoint", "prompt_tokens", "out", "design", "chunk", "family", "gpu_prefill_seconds")
    keys += ("gpu_tokens_per_second", "measure", "repeats", "decode")
    return {k: str(getattr(config, k)) if isinstance(getattr(config, k), Path) else getattr(config, k) for k in keys}


def _checkpoint_dict(checkpoint) -> dict:
    g = checkpoint.geometry
    rope = g.rope_scaling.rope_type if g.rope_scaling is not None else "default"
    return {
        "path": str(checkpoint.path),
        "model_type": checkpoint.model_type,
        "layers": g.num_layers,
        "full_attention_layers": list(g.full_attention_layers),
        "hidden_size": g.hidden_size,
        "heads": g.num_heads,
        "kv_heads": g.num_kv_heads,
        "head_dim": g.head_dim,
        "rope": rope,
        "dtype": checkpoint.tensor_dtype(),
    }
