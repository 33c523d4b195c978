"""``anelab decide``: should this checkpoint's prefill attention go to the ANE — one answer, its evidence, what would change it.

The run reads like ``sidecar.export.export_design``: open the checkpoint once -> plan every design at the
prompt -> export and verify the candidate's packages (resumable) -> the whole-model arms -> (a Mac,
``--measure``) time the packages and plan again -> sweep prompt lengths -> report. Typed objects pass from
stage to stage (``Checkpoint``, ``ModelCheckpoint``, :class:`PromptPlan`, ``DesignPlan``, ``SidecarRequest``,
``Verdict``); they become dicts only where JSON is written (``evidence.json``, ``decision.json``, the report
in ``decide.decision_report``). Each prompt length is planned once.

Resumable: ``DIR/evidence.json`` keeps each package's content hash, its verification (sealed by the run that
verified it: ``decide.evidence``) and the arms' summary. A package with the same hash, request, checkpoint
(``checkpoint_identity``) and code (``core.code_identity``) is reused (verified again if its arms diverge), and so are the arms
when the checkpoint, the served packages' hashes, the prompt, chunk, decode length, engine and code
are all the same (``arms_key``): a rerun with the same inputs repeats none of it, a changed input what depends on it.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from anelab.arms import (  # their functions read at call time (tests stand in for them)
    arm_comparison,
    prefill_ab,
    real_text,
)
from anelab.arms.arm_comparison import open_engine_model
from anelab.arms.arm_runs import REFERENCE_CHUNK
from anelab.arms.compression_cost import stored_attention, stored_weights_costs
from anelab.arms.prefill_ab import measured_arm_costs
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core import parallel  # parallel.default_jobs read at call time (tests run decide inline)
from anelab.core.code_identity import code_identity
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import chunk_starts
from anelab.core.output_paths import no_empty_dirs_left, require_output_dir
from anelab.core.parallel import background_map, process_map
from anelab.core.records import machine_kind
from anelab.decide.decide_request import (
    SWEEP_POINTS,
    ArmsSummary,
    CheckpointSummary,
    CompressionEvidence,
    DecideConfig,
    Decision,
    DecisionEvidence,
    LayerVerification,
    MeasuredPackage,
    Opened,
    SweepPoint,
)
from anelab.decide.decision_report import write_report
from anelab.decide.evidence import EvidenceFile, reverify_when_the_arms_disagree, verify_summary
from anelab.planner import from_checkpoint  # from_checkpoint.plan_from_checkpoint read at call time (tests spy)
from anelab.planner.chip_map import verdict_map
from anelab.planner.chips import CHIPS
from anelab.planner.design_plans import DesignPlan
from anelab.planner.envelope import MEASURED, YOURS, Cost
from anelab.planner.from_checkpoint import CheckpointPlan, checkpoint_designs
from anelab.planner.offload_split import checkpoint_splits
from anelab.planner.plan import PrefillPlan
from anelab.planner.settle import MAC_MEASUREMENT_DECIDE, settle_commands
from anelab.planner.verdict import ArmCosts, Verdict, plan_arm_costs, verdict_for
from anelab.runtimes.coreml.ane_placement import require_ane_placement, require_neural_engine
from anelab.runtimes.coreml.block_ab import time_attention_ab, timing_stats
from anelab.runtimes.coreml.coreml_runtime import default_runtime
from anelab.runtimes.coreml.gate import AneGate, AneGateError
from anelab.runtimes.coreml.timing import time_load
from anelab.runtimes.interface import RuntimeLoadError, package_content_hash, package_functions
from anelab.runtimes.mlx.from_gguf import mlx_readable_path
from anelab.sidecar.checks.verify import verify_package
from anelab.sidecar.coremltools_import import coremltools_modules
from anelab.sidecar.designs import DESIGNS, PRICED, SidecarRequest, get_design
from anelab.sidecar.export import export_request, worker_checkpoint
from anelab.sidecar.out_dir import remove_abandoned_staging
from anelab.sidecar.quantize import validate_weights_mode


# ---- planning ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PromptPlan:
    """Every design planned for the checkpoint's full-attention layers at one prompt length."""

    checkpoint_plan: CheckpointPlan
    full: PrefillPlan  # the per-history plan of the full-attention layers, the designs' reference
    designs: tuple[DesignPlan, ...]
    arm_costs: dict[str, ArmCosts]  # design name -> its deciding costs

    def design(self, name: str) -> DesignPlan:
        return next(d for d in self.designs if d.design == name)


class Plans:
    """Each prompt length planned once, with the user's GPU number (``yours``) or the model's alone."""

    def __init__(self, config: DecideConfig, opened: Opened):
        self.config, self.opened, self._plans = config, opened, {}

    def at(self, prompt_tokens: int, *, yours: bool = True) -> PromptPlan:
        yours = yours and bool(self.config.user_gpu)
        key = (int(prompt_tokens), yours)
        if key not in self._plans:
            self._plans[key] = self._plan(int(prompt_tokens), self.config.user_gpu if yours else {})
        return self._plans[key]

    def _plan(self, prompt_tokens: int, user_gpu: dict) -> PromptPlan:

        config = self.config
        checkpoint_plan, by_kind = checkpoint_designs(
            self.opened.checkpoint, prompt_tokens, None, family=config.family, chunk=config.chunk,
            gpu_runtime=config.gpu_runtime, chip=config.chip, objective=config.objective, **user_gpu,
        )  # fmt: skip
        if "full" not in by_kind:
            raise AnelabInputError(
                f"{config.checkpoint}: every attention layer slides over a window; decide compares designs for "
                "full-attention layers only"
            )
        full = checkpoint_plan.parts["full"]
        designs = tuple(by_kind["full"])
        return PromptPlan(checkpoint_plan, full, designs, {d.design: plan_arm_costs(full, d) for d in designs})

    def user_factor(self) -> float | None:
        """The user's GPU prefill over the modelled one at their prompt (None without a user GPU number)."""
        if not self.config.user_gpu:
            return None
        n = self.config.prompt_tokens
        return self.at(n).full.gpu_prefill_seconds / self.at(n, yours=False).full.gpu_prefill_seconds


def what_settles_it(config: DecideConfig) -> dict:
    """For each deciding cost: the measurement that settles it and the exact command (``planner.settle``), this
    run's ``anelab decide`` command with ``--measure`` or the user's ``--gpu-prefill-seconds S``."""
    base = f"anelab decide {config.checkpoint} --prompt-tokens {config.prompt_tokens} --out {config.out}"
    for flag, value in (("--chunk", config.chunk), ("--family", config.family)):
        base += f" {flag} {value}" if value is not None else ""
    base += f" --design {config.design}" if config.design != "auto" else ""
    return settle_commands(
        config.prompt_tokens, gpu_command=base, mac_command=base, mac_measurement=MAC_MEASUREMENT_DECIDE
    )


def choose_design(config: DecideConfig, plan: PromptPlan) -> DesignPlan:
    """The design decide exports: ``--design``, or (auto) the one with the best predicted ratio."""
    if config.design == "auto":
        return max(plan.designs, key=lambda d: d.predicted_ratio)
    names = [d.design for d in plan.designs]
    if config.design not in names:
        raise AnelabInputError(f"unknown --design {config.design!r}; use auto or one of: {', '.join(names)}")
    return plan.design(config.design)


# ---- preconditions ---------------------------------------------------------------------------------------------
def open_request(config: DecideConfig) -> Opened:
    """Refuse (one line) what decide cannot do; open the checkpoint and the whole model once, and the runtime."""

    if config.design != "auto" and config.design not in PRICED:
        get_design(config.design, "--design")  # a renamed design is refused with its new name
        raise AnelabInputError(f"unknown --design {config.design!r}; use auto or one of: {', '.join(PRICED)}")
    if not Path(config.checkpoint).exists():
        raise AnelabInputError(f"checkpoint {config.checkpoint} does not exist; pass a model directory (config.json)")
    checkpoint = load_checkpoint(config.checkpoint)
    validate_weights_mode(config.weights, checkpoint.geometry)  # an unknown or unfit --weights refused before any work

    engine, model = open_engine_model(checkpoint)  # the whole-model arms need the whole model: refused here
    runtime = None
    if config.measure:
        runtime = config.runtime if config.runtime is not None else default_runtime()
        if not runtime.available():
            raise AnelabInputError(
                f"--measure times the packages through Core ML, which is not available here "
                f"({runtime.unavailable_reason()}); drop --measure or run on a Mac"
            )
        require_neural_engine(runtime, "--measure the ANE arm")
    return Opened(checkpoint, model, runtime, engine, checkpoint_identity(checkpoint))


def checkpoint_identity(checkpoint) -> dict:
    """What decide's evidence recognises a checkpoint by: its resolved path, format, and the size and modification
    time (ns) of its config and of every file holding its tensors — a file rewritten in place (another model saved
    over it) changes its time; hashing the bytes would cost a rerun seconds per GB (an 8B model: ~16 GB)."""
    path = Path(checkpoint.path).resolve()
    root = path if path.is_dir() else path.parent
    names = sorted(set(checkpoint.tensors.files()) | ({"config.json"} if (root / "config.json").is_file() else set()))
    files = {}
    for name in names:
        stat = (root / name).stat()
        files[name] = [stat.st_size, stat.st_mtime_ns]
    return {"path": str(path), "format": checkpoint.format, "files": files}


# ---- evidence: export, verify (resumable) ----------------------------------------------------------------------
VERIFIED_BESIDE_THE_ARMS = 1 / 6  # of the layers exported in worker processes: verified while the arms run


def export_and_verify(
    config: DecideConfig, opened: Opened, request: SidecarRequest, bar, *, gated: bool = True, beside: bool = False
) -> tuple[Path, dict, str | None]:
    """Each layer's package of ``request`` exported and verified, reusing what ``evidence.json`` holds for the
    same request and content hash; the others in worker processes (``anelab.core.parallel``), the evidence
    written as each layer finishes. With ``--measure`` (a runtime) every package goes through the ANE gate, one
    layer at a time in this process (the gate runs its children), so the whole-model A/B may serve it; when the
    gate refuses, the packages are exported again without it (their numbers are still the evidence) and the
    refusal is returned: the ANE arm does not run on this Mac. Returns (directory, layer -> verification summary,
    the gate's refusal or None).

    ``beside``: the last ``VERIFIED_BESIDE_THE_ARMS`` of the layers exported in worker processes are exported
    only; their summaries say ``pending`` (with their content hash) until ``verified_beside`` verifies them while
    the arms run (on the core the arms leave idle: the sidecar arm's chain of layers outlasts the reference arm)."""

    directory = config.out / "sidecars" / request.graph
    gate = AneGate.for_runtime(opened.runtime) if gated else None
    evidence = EvidenceFile(config.out / "evidence.json", opened.identity)
    kept = evidence.layers(request.graph, request, gated=gate is not None)
    reused = {}
    for layer in opened.layers:
        pkg = directory / f"layer_{layer}.mlpackage"
        known = kept.get(str(layer))
        reused[layer] = (evidence.trusted(request.graph, request, gate is not None, layer, known) and pkg.exists()
                         and package_content_hash(pkg) == known.get("sha256"))  # fmt: skip
        if not reused[layer] and pkg.exists():
            _set_aside(pkg)
    todo = [layer for layer in opened.layers if not reused[layer]]
    bar.update(len(opened.layers) - len(todo))

    pending: dict[int, str] = {}  # layer -> content hash: exported, verified beside the arms

    def record(job, known) -> None:
        if "verify" not in known:
            pending[job[2]] = known["sha256"]
            bar.set_postfix_str(f"exported layer {job[2]}")
            return
        kept[str(job[2])] = evidence.sealed(request.graph, request, gate is not None, job[2], known)
        evidence.write()
        bar.set_postfix_str(f"exported and verified layer {job[2]}")
        bar.update(1)

    if todo:
        bar.set_postfix_str(f"export and verify {len(todo)} layers")
        jobs = 1 if gate is not None else parallel.default_jobs(len(todo))
        source = opened.checkpoint if jobs == 1 else str(opened.checkpoint.path)  # workers open their own
        coremltools_modules()  # imported before the workers fork, so they inherit it (~1.5 s each otherwise)
        directory.mkdir(parents=True, exist_ok=True)  # here: no worker's export made it (nor removes it if empty)
        held = set(todo[len(todo) - int(len(todo) * VERIFIED_BESIDE_THE_ARMS) :]) if beside and jobs > 1 else set()
        work = [(source, str(directory), layer, request, gate, layer not in held) for layer in todo]
        try:
            process_map(_export_and_verify_layer, work, jobs=jobs, on_result=record)
        except AneGateError as e:
            refusal = " ".join(str(e).split())
            bar.set_postfix_str("the ANE gate refused: export without it")
            return (*export_and_verify(config, opened, request, bar, gated=False)[:2], refusal)
        except BaseException:  # workers stopped mid-export (a sibling failed, a full disk, SIGTERM) leave staging
            remove_abandoned_staging(directory)
            raise
    summaries = {}
    for layer in opened.layers:
        pkg = directory / f"layer_{layer}.mlpackage"
        if layer in pending:
            summaries[layer] = {"pending": True, "reused": False, "package": str(pkg), "sha256": pending[layer]}
        else:
            known = kept[str(layer)]
            summaries[layer] = {**known["verify"], "reused": reused[layer], "package": str(pkg),
                                "sha256": known["sha256"]}  # fmt: skip
        summaries[layer]["capacity"] = request.capacity
    return directory, summaries, None


@contextlib.contextmanager
def verified_beside(config: DecideConfig, opened: Opened, request: SidecarRequest, verified: dict, bar):
    """Context: the layers ``export_and_verify(beside=True)`` left ``pending`` verified in low-priority worker
    processes (``core.parallel.background_map``) while the block runs (the arms); on leaving it, their evidence is
    recorded (a package whose bytes changed meanwhile is not: the next run exports it again) and ``verified``
    completed in place. Nothing pending: the block alone."""

    pending = sorted(layer for layer, summary in verified.items() if summary.get("pending"))
    if not pending:
        yield
        return
    work = [(str(opened.checkpoint.path), verified[layer]["package"]) for layer in pending]
    with background_map(_verify_layer, work, jobs=parallel.default_jobs(len(work))) as collect:
        yield
        bar.set_postfix_str(f"verify {len(pending)} layers")
        reports = collect()

    evidence = EvidenceFile(config.out / "evidence.json", opened.identity)
    kept = evidence.layers(request.graph, request, gated=False)
    for layer, summary in zip(pending, reports, strict=True):
        held = verified[layer]
        if package_content_hash(held["package"]) == held["sha256"]:
            kept[str(layer)] = evidence.sealed(request.graph, request, False, layer,
                                               {"sha256": held["sha256"], "verify": summary})  # fmt: skip
        verified[layer] = {**summary, "reused": False, "package": held["package"], "sha256": held["sha256"],
                           "capacity": held["capacity"]}  # fmt: skip
        bar.update(1)
    evidence.write()


def _verify_layer(job: tuple[str, str]) -> dict:
    """One exported package verified (in a worker process): its verification summary. ``job`` = (checkpoint path,
    package path)."""

    checkpoint, package = job
    return verify_summary(verify_package(package, worker_checkpoint(checkpoint), progress=False))


def _export_and_verify_layer(job: tuple) -> dict:
    """One layer exported as the request asks and verified (in a worker process or inline): its evidence
    entry. ``job`` = (checkpoint or its directory, output directory, layer, SidecarRequest, ANE gate or None,
    verify it here: False leaves it to ``verified_beside``, the entry then without ``verify``)."""

    checkpoint, directory, layer, request, gate, verify = job
    if isinstance(checkpoint, str):  # a worker: its jobs share one opening, export and verify alike
        checkpoint = worker_checkpoint(checkpoint)
    [result] = export_request(checkpoint, directory, request, [layer], gate=gate, jobs=1)
    if not verify:  # verified beside the arms (``verified_beside``)
        return {"sha256": package_content_hash(result.package)}
    report = verify_package(result.package, checkpoint, progress=False)
    return {"sha256": package_content_hash(result.package), "verify": verify_summary(report)}


def _set_aside(pkg: Path) -> None:
    """A package whose hash no longer matches its evidence is renamed aside, never overwritten."""
    n = 1
    while pkg.with_name(f"{pkg.name}.stale-{n}").exists():
        n += 1
    os.replace(pkg, pkg.with_name(f"{pkg.name}.stale-{n}"))


def whole_model_evidence(
    config: DecideConfig, opened: Opened, candidate: DesignPlan, directory: Path, verified: dict, bar
) -> ArmsSummary:
    """The whole-model arms at the candidate's chunk on the candidate's own packages (every design the registry
    builds is served; per-history packages of the same chunk only for one the arms would not serve), on anelab's
    forward or mlx-lm's (``Opened.engine``). Returns the arms' summary, the one ``evidence.json`` holds when nothing
    it depends on changed (``arms_key``; ``reused`` says so; a kept record of other fields is run again)."""
    served_by = candidate.design
    if not get_design(served_by).served_by_arms:
        served_by = next(name for name in PRICED if DESIGNS[name].served_by_arms and not DESIGNS[name].stateful)
        per_history = replace(candidate, design=served_by, capacity=None, key_tile=None, query_tile=None)
        bar.total += len(opened.layers)
        request = replace(per_history.sidecar_request(), weights=config.weights)
        directory, verified, _ = export_and_verify(config, opened, request, bar)
    evidence = EvidenceFile(config.out / "evidence.json", opened.identity)
    key = arms_key(config, opened, served_by, candidate.chunk, verified)
    known = _arms_summary(evidence.arms(key), reused=True)
    if known is None:
        bar.set_postfix_str("whole-model arms")
        record = run_whole_model_arms(config, opened, directory, served_by, candidate)
        evidence.record_arms(key, record)
        known = ArmsSummary.from_json(record)
    bar.update(1)
    return known


def _arms_summary(record: dict | None, *, reused: bool) -> ArmsSummary | None:
    """A kept arms record as a summary, or None (none kept, or one whose fields are not this version's)."""
    try:
        return None if record is None else ArmsSummary.from_json({**record, "reused": reused})
    except (TypeError, KeyError):
        return None


def arms_key(config: DecideConfig, opened: Opened, served_by: str, chunk: int, verified: dict) -> dict:
    """What the arms' results depend on: the checkpoint, the served packages' content hashes, the prompt length
    (its seeded ids), the chunk, the decode length, the engine and the code (``core.code_identity``)."""
    return {
        "checkpoint": opened.identity,
        "served_by": served_by,
        "packages": {str(layer): v["sha256"] for layer, v in sorted(verified.items())},
        "prompt_tokens": int(config.prompt_tokens),
        "chunk": int(chunk),
        "decode": int(config.decode),
        "engine": opened.engine,
        "code": code_identity(),
    }


def run_whole_model_arms(config: DecideConfig, opened: Opened, directory: Path, served_by: str, candidate) -> dict:
    """compare-arms of the reference and the sidecar arm on the served packages: the record ``evidence.json`` keeps
    (``ArmsSummary``'s fields but ``reused``)."""

    report = arm_comparison.compare_arms(opened.model, directory, config.prompt_tokens, decode=config.decode)
    pair = report.pairs[0]
    return {
        "engine": report.engine,
        "served_by": served_by,
        "note": ""
        if served_by == candidate.design
        else f"the arms served every layer from {served_by} packages of the same chunk ({candidate.chunk}): "
        f"compare_arms does not serve {candidate.design} packages",
        "prompt_tokens": int(report.prompt.size),
        "chunk": report.chunk,
        "decode": report.decode,
        "logits_relative_difference": pair.prompt_logits_diff,
        "max_step_logits_difference": max(pair.step_logits_diffs) if pair.step_logits_diffs else None,
        "greedy_agreement": pair.greedy_agreement,
        "greedy_agreement_excluding_near_ties": pair.agreement_excluding_near_ties,
        "near_ties": pair.near_ties,
        "divergences": [d.to_dict() for d in pair.divergences],
        "greedy_summary": pair.greedy_summary(),
        "identical_text": pair.identical_text,
        "first_divergent_layer": pair.first_divergent_layer,
        "layer_differences": [float(x) for x in pair.layer_diffs],
        "noise": pair.noise,
        "weights": None if report.weights is None else report.weights.describe(),
    }


COST_TOKENS = 256  # --weights: the real text the compression is costed on (README tokens, fewer if it is shorter)


def compression_evidence(config: DecideConfig, opened: Opened, directory: Path) -> CompressionEvidence | None:
    """``--weights`` other than fp16: what the compression costs the whole model on real text (the first
    ``COST_TOKENS`` README tokens under the checkpoint's tokenizer), the reference decoder with the projections the
    packages in ``directory`` store against the reference (``arms.compression_cost``): logits, greedy agreement,
    perplexity change. Reported, never judged; verify judged each package against its own weights. None for fp16; a
    note instead of numbers when the checkpoint has no tokenizer or the arms run on mlx-lm."""
    if config.weights == "fp16":
        return None

    if opened.engine != "numpy":
        return CompressionEvidence(
            config.weights, note="not costed on real text: the arms run on mlx-lm (--engine numpy does)"
        )
    try:
        tokenizer = opened.model.checkpoint.tokenizer()
    except AnelabInputError:
        return CompressionEvidence(config.weights, note="not costed on real text: the checkpoint carries no tokenizer")
    tokens = min(COST_TOKENS, int(tokenizer.encode(real_text.docs_text()).size))
    prompt = real_text.docs_prompt(tokenizer, tokens)
    packages = {layer: str(directory / f"layer_{layer}.mlpackage") for layer in opened.layers}
    stored = {config.weights: stored_attention(packages, opened.model)}
    cost = stored_weights_costs(opened.model, prompt, stored, decode=config.decode, chunk=REFERENCE_CHUNK)
    return CompressionEvidence(config.weights, cost[config.weights], text=f"the first {tokens} tokens of {real_text.DOCS_SOURCE}",
                               arm="the reference decoder with the packages' stored projections, against the checkpoint's")  # fmt: skip


# ---- measured on this Mac -------------------------------------------------------------------------------------
def measure_package(config: DecideConfig, opened: Opened, package: Path, candidate: DesignPlan) -> MeasuredPackage:
    """Cold and warm loads of every function of one layer's package (the layers share one geometry) and, for
    per-history functions, one prediction per compute units; each result a record in ``DIR/measured``. First
    the compute plan must put the package's operations on the Neural Engine (else refused, one line); a load
    or ``cpu_and_ne`` predict that fails is the ANE arm not running (``ane_failure``), and nothing of it is
    priced as measured."""

    runtime, clock, out = opened.runtime, config.clock or time.perf_counter, config.out / "measured"
    placement = require_ane_placement(runtime, package, "cpu_and_ne").to_dict()
    loads, failure = {}, None
    for function in package_functions(package):
        try:
            cold, warm = (
                time_load(
                    runtime, package, function, "cpu_and_ne", cold=c, repeats=config.repeats, clock=clock, out_dir=out
                )  # fmt: skip
                for c in (True, False)
            )
        except RuntimeLoadError as e:
            failure = f"{function} does not load under cpu_and_ne ({' '.join(str(e).split())})"
            break
        loads[function] = {"cold": _stats(cold), "warm": _stats(warm)}
    predicts = {}
    if failure is None and not get_design(candidate.design).stateful:  # functions h<s>: the A/B inputs of the block
        for record in time_attention_ab(
            runtime, package, opened.checkpoint.geometry, chunk=candidate.chunk,
            histories=chunk_starts(config.prompt_tokens, candidate.chunk), compute_units=("cpu_and_ne", "cpu_and_gpu"),
            repeats=config.repeats, clock=clock, out_dir=out,
        ):  # fmt: skip
            function, results = record["parameters"]["function"], record["results"]
            predicts[function] = {u: _stats({"results": r}) for u, r in results.items()}
            error = results.get("cpu_and_ne", {}).get("error")
            if error and failure is None:
                failure = f"the cpu_and_ne predict of {function} failed ({error})"
    return MeasuredPackage(package, runtime.name, loads, predicts, failure, placement)


def whole_model_ab(config: DecideConfig, opened: Opened, directory: Path) -> dict:
    """The whole-model A/B on this Mac (``arms.prefill_ab``: mlx-lm's prefill vs the hybrid) at the prompt, or why
    it did not run (a package the ANE gate never passed, MLX missing): {"record": ...} or {"not_run": why}."""

    request = prefill_ab.ab_request(opened.checkpoint.path, directory, [config.prompt_tokens], runtime=opened.runtime,
                         clock=config.clock or time.perf_counter, out_dir=config.out / "measured",
                         mlx_checkpoint=mlx_readable_path(opened.checkpoint))  # a GGUF file: its fp16 copy  # fmt: skip
    try:
        [result] = prefill_ab.run_ab(request).prompts
    except AnelabInputError as e:
        return {"not_run": str(e)}
    correctness = result.record["results"]["correctness"]
    if not correctness["within_bound"]:  # a fast wrong answer is not an ANE arm (NaN included)
        return {
            "not_run": f"the hybrid's last-prompt logits are {correctness['against_fp32']:.2%} off mlx-lm's forward in "
            f"fp32 (bound {correctness['bound']:.2%}: {correctness['bound_reason']}): its timings are not priced",
            "rejected_record": result.record,
        }
    return {"record": result.record}


def _stats(record: dict) -> dict | None:
    """Median / min / max seconds of one timing as ``anelab.runtimes.coreml.block_ab.timing_stats`` reads it — the one reading
    notebook 01's A/B and its headline use: Core ML's own predict duration where recorded, else the wall time
    of ``predict``; ``timed`` says which."""

    return timing_stats(record["results"])


def with_measured(
    costs: ArmCosts, measured: MeasuredPackage | None, design: DesignPlan, prompt_tokens: int
) -> ArmCosts:
    """The deciding costs with this Mac's records in place of the predicted ones, where every function
    the prompt visits was measured (loads: cold; ANE attention: ``cpu_and_ne`` predictions)."""
    if measured is None or not costs.runs_on_ane:
        return costs
    if measured.ane_failure is not None:  # nothing of a failed ANE arm is priced, its loads included
        return replace(
            costs, runs_on_ane=False, structural_reason=f"the ANE arm does not run on this Mac: {measured.ane_failure}"
        )
    if measured.whole_model is not None and "record" in measured.whole_model:
        record = measured.whole_model["record"]
        if record["parameters"]["prompt_tokens"] == prompt_tokens:  # both arms measured at this prompt
            placements = record["parameters"].get("placements", ())
            return measured_arm_costs(record["results"], design.design, costs.layers, machine_kind(), placements)
    registered, starts = get_design(design.design), chunk_starts(prompt_tokens, design.chunk)
    functions = list(dict.fromkeys(registered.function_for(design.chunk, s) for s in starts))
    loads = [measured.load(f) for f in functions]
    basis = f"measured on this Mac ({measured.runtime} runtime): cold loads of {', '.join(functions)}"
    if all(loads):
        costs = replace(costs, load_per_layer=_summed(loads, MEASURED, basis))
    predicts = [measured.predict(f) for f in functions]
    if all(predicts):
        calls = 1 if not registered.stateful else len(starts)  # a stateful function is called once per chunk
        basis = f"measured on this Mac: cpu_and_ne predictions of {', '.join(functions)}"
        costs = replace(costs, ane_attention=_summed(predicts * calls, MEASURED, basis).scaled(costs.layers))
    return costs


def _summed(stats: list[dict], kind: str, basis: str) -> Cost:
    values = [[s[k] for s in stats] for k in ("median_s", "min_s", "max_s")]
    return Cost(sum(values[0]), sum(values[1]), sum(values[2]), kind, basis)


def with_user_gpu(costs: ArmCosts, factor: float, basis: str) -> ArmCosts:
    """The user's GPU prefill (at their prompt) carried along the model's curve by one factor."""
    return replace(costs, gpu_prefill=Cost.point(costs.gpu_prefill.value * factor, YOURS, basis))


# ---- the run ---------------------------------------------------------------------------------------------------
def sweep(
    config: DecideConfig, plans: Plans, candidate: DesignPlan, measured: MeasuredPackage | None
) -> list[SweepPoint]:
    """The candidate's two arms over prompt lengths (the figure): value, interval and kinds per prompt."""
    top = max(2 * config.prompt_tokens, 4 * candidate.chunk)
    points = range(SWEEP_POINTS)
    grid = {int(round(candidate.chunk * (top / candidate.chunk) ** (i / (SWEEP_POINTS - 1)))) for i in points}
    factor, rows = plans.user_factor(), []
    for tokens in tqdm(sorted(grid | {config.prompt_tokens}), desc="sweep", unit="prompt", leave=False):
        plan = plans.at(tokens, yours=False)
        costs = with_measured(plan.arm_costs[candidate.design], measured, plan.design(candidate.design), tokens)
        if factor is not None:
            costs = with_user_gpu(costs, factor, "yours, carried along the model's curve")
        v = verdict_for(costs)
        rows.append(SweepPoint(tokens, v.gpu_prefill, v.ane_prefill, v.decision))
    return rows


def decide(config: DecideConfig) -> Decision:
    """Plan, export, verify, run the arms, measure (a Mac), report (module docstring); a failed run leaves no empty folder."""
    config.out = require_output_dir(config.out)  # before the checkpoint is opened
    opened = open_request(config)
    with no_empty_dirs_left(config.out):
        return _decided(config, opened)


def _decided(config: DecideConfig, opened: Opened) -> Decision:
    """``decide``'s stages once the checkpoint is open and ``config.out`` exists."""
    commands, plans = what_settles_it(config), Plans(config, opened)
    with tqdm(total=3 + len(opened.layers) + bool(opened.runtime), desc="decide", unit="step") as bar:
        bar.set_postfix_str("plan every design")
        plan = plans.at(config.prompt_tokens)
        verdicts = {name: verdict_for(c, commands) for name, c in plan.arm_costs.items()}
        candidate = choose_design(config, plan)
        bar.update(1)
        request = replace(candidate.sidecar_request(), weights=config.weights)
        directory, verified, refusal = export_and_verify(config, opened, request, bar, beside=True)
        with verified_beside(config, opened, request, verified, bar):
            arms = whole_model_evidence(config, opened, candidate, directory, verified, bar)
        reverify_when_the_arms_disagree(opened, verified, arms)
        compression = compression_evidence(config, opened, directory)
        measured, final = None, verdicts[candidate.design]
        if opened.runtime is not None:
            bar.set_postfix_str("measure on this Mac")
            package = directory / f"layer_{opened.layers[0]}.mlpackage"
            if refusal is not None:  # nothing of it is timed: the Neural Engine did not get the graph
                measured = MeasuredPackage(package, opened.runtime.name, {}, {}, ane_failure=refusal)
            else:
                measured = measure_package(config, opened, package, candidate)
            if measured.ane_failure is None:
                measured.whole_model = whole_model_ab(config, opened, directory)
            costs = with_measured(plan.arm_costs[candidate.design], measured, candidate, config.prompt_tokens)
            final = verdict_for(costs, commands)
            bar.update(1)
        bar.set_postfix_str("sweep prompt lengths and chips")
        plan_on = checkpoint_plan_on(config, opened)  # the chip map and the offload split share each plan
        rows, chips = sweep(config, plans, candidate, measured), checkpoint_chip_map(config, opened, plan.full.chip,
                                                                                     plan_on)  # fmt: skip
        splits = checkpoint_splits(opened.checkpoint, config.prompt_tokens, list(CHIPS),
                                   lambda chip: plan_on(chip, config.prompt_tokens))  # fmt: skip
        bar.update(1)
    evidence = DecisionEvidence({k: LayerVerification(**v) for k, v in verified.items()}, arms, compression, measured)
    decision = Decision(config=config, checkpoint=CheckpointSummary.of(opened.checkpoint), candidate=candidate.design,
                        verdicts=verdicts, verdict=final, designs=plan.designs, plan=plan.full,
                        cost_family=plan.checkpoint_plan.cost_family, evidence=evidence, sweep=tuple(rows),
                        yours=_yours(config, final), chip_map=chips, offload_split=splits)  # fmt: skip
    write_report(decision, config.out)
    return decision


def checkpoint_plan_on(config: DecideConfig, opened: Opened):
    """(chip, prompt tokens) -> the checkpoint's plan on that chip, each planned once; the user's own GPU number is
    theirs, so it is left out."""
    return from_checkpoint.plans_on_chips(opened.checkpoint, family=config.family, chunk=config.chunk,
                                          gpu_runtime=config.gpu_runtime, objective=config.objective)  # fmt: skip


def checkpoint_chip_map(config: DecideConfig, opened: Opened, chip: str, plan_on=None) -> dict:
    """The verdict map of the user's checkpoint (its full-attention layers' plan on every chip at a few prompt
    lengths around theirs), their chip's row marked (``plan_on``: :func:`checkpoint_plan_on`'s, shared)."""
    plan_on = plan_on or checkpoint_plan_on(config, opened)
    lengths = sorted({1024, 4096, 16384, config.prompt_tokens})
    return verdict_map(lambda chip_name, n: plan_on(chip_name, n).parts["full"], lengths, mark=chip)


def _yours(config: DecideConfig, verdict: Verdict) -> tuple[str, ...]:
    out = [f"GPU prefill: yours (--{flag.replace('_', '-')} {value:g})" for flag, value in config.user_gpu.items()]
    for name, cost in verdict.costs.items():
        if cost["kind"] == MEASURED:
            out.append(f"{name.replace('_', ' ')}: measured on this Mac ({cost['basis']})")
    return tuple(out)
