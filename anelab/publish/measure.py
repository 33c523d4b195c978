"""``anelab measure``: on a Mac, every Core ML measurement taken fresh in one run, each result a record.

Steps (``STEPS``), in order: doctor -> probe (every Core ML assumption, recorded by name; later steps
that rely on a failed one refuse naming it) -> export with the ANE gate -> verify on the device -> load
timings (cold/warm per function, package compositions, memory vs functions) -> Core AI's specialization and
predictions of the same layer on macOS 27 (``publish.measure_coreai``; elsewhere one line says why not) -> the attention
block's A/B per compute units over the histories -> each offload split the plan proposes for the real model(s),
timed against mlx-lm's GPU prefill (``publish.measure_splits``) -> gather probe timing. Every result is written to
``data/measured/`` as a record whose provenance names the chip, the OS and coremltools, and whose
``parameters.measure`` names the step and the SHA-256 of the package measured. A step already
recorded for the same package on the same machine is skipped unless ``again``. ``plan_text``
lists the steps anywhere (``--dry-run``); everything else needs the Core ML runtime and a Neural Engine.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from anelab.checkpoints.checkpoint import Checkpoint, load_checkpoint
from anelab.checkpoints.default import default_checkpoint_dir
from anelab.core.errors import AnelabInputError
from anelab.core.paths import BUILD_DIR, MEASURED_DIR
from anelab.core.progress import tqdm
from anelab.core.records import machine_description, make_record, read_records, write_record
from anelab.publish import measure_coreai  # measure_coreai.coreai_records: read at call time (tests stand in)
from anelab.publish.measure_coreai import STEP as COREAI_STEP
from anelab.publish.measure_splits import STEP as SPLIT_STEP
from anelab.publish.measure_splits import models_key, split_records
from anelab.runtimes.coreai.coreai_runtime import default_coreai_runtime
from anelab.runtimes.coreml.block_ab import time_attention_ab
from anelab.runtimes.coreml.coreml_runtime import default_runtime
from anelab.runtimes.coreml.device_verify import verify_on_device
from anelab.runtimes.coreml.gate import AneGate
from anelab.runtimes.coreml.gather_probe import measure_probes_on_runtime, probe, probe_inputs
from anelab.runtimes.coreml.probe import probe_core_ml
from anelab.runtimes.coreml.timing import time_compositions, time_load
from anelab.runtimes.interface import CoreAIRuntime, CoreMLRuntime, package_content_hash, package_functions
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.format import read_sidecar_metadata
from anelab.studies.setup_cost import measure_load_memory, memory_vs_functions

STEPS: tuple[tuple[str, str], ...] = (
    ("doctor", "check the Core ML runtime (macOS 15+, coremltools' native module) and a Neural Engine (arm64)"),
    (
        "probe",
        "probe every Core ML behaviour the code relies on, on a tiny package (what 'anelab doctor --probe' does)",
    ),
    ("export", "export the layer with the ANE gate (each variant in its own process: load, predict, compute plan)"),
    ("verify", "verify on the device: Core ML predict vs reference, vs NumPy, NumPy vs reference, per compute units"),
    ("load", "load timings: cold and warm per function, compositions (alone / beside h<C>), memory vs functions"),
    COREAI_STEP,
    ("block_ab", "the attention block's predict per compute units over the histories (A/B)"),
    SPLIT_STEP,
    (
        "gather_probe",
        "gather probe: ANE operation counts, load and predict timing of the full-scores and gather probes",
    ),
)


@dataclass
class MeasureConfig:
    """What ``anelab measure`` measures (defaults: the embedded default checkpoint, its first full-attention layer)."""

    checkpoint: Path | None = None
    layer: int | None = None
    chunk: int = 64
    histories: list[int] | None = None  # default: 0, chunk, 2 * chunk
    build: Path = BUILD_DIR / "measure"
    records: Path = MEASURED_DIR
    verify_units: tuple[str, ...] = ("cpu_and_ne", "cpu_and_gpu", "cpu_only")
    ab_units: tuple[str, ...] = ("cpu_only", "cpu_and_gpu", "cpu_and_ne")
    repeats: int = 3
    probe_chunk: int = 32
    again: bool = False
    split_models: tuple[str, ...] = ("default-real",)  # the real model(s) whose planned splits are timed
    split_prompt_tokens: tuple[int, ...] = (256,)

    def resolved_histories(self) -> list[int]:
        return list(self.histories) if self.histories else [0, self.chunk, 2 * self.chunk]


def plan_text(config: MeasureConfig) -> str:
    """The steps ``measure`` would run, with their parameters (what ``--dry-run`` prints; runs anywhere)."""
    ckpt = config.checkpoint or "the embedded default checkpoint (generated under build/checkpoints)"
    lines = [
        f"anelab measure: checkpoint {ckpt}, layer {config.layer if config.layer is not None else '(first full-attention)'}, "
        f"chunk {config.chunk}, histories {','.join(map(str, config.resolved_histories()))}, repeats {config.repeats}",
        f"records -> {config.records} (one file per result; a step already recorded for this package and "
        f"machine is skipped{' — --again: measured again' if config.again else ' unless --again'})",
    ]
    lines += [f"  {i}. {name:<12} {what}" for i, (name, what) in enumerate(STEPS, 1)]
    lines.append(f"     verify units: {', '.join(config.verify_units)}; A/B units: {', '.join(config.ab_units)}")
    lines.append(f"     split_ab: models {', '.join(config.split_models) or 'none'}, prompt tokens "
                 f"{','.join(map(str, config.split_prompt_tokens))}, chunk {config.chunk}; the best split and the "
                 "runner-up the plan proposes on this Mac's chip")  # fmt: skip
    return "\n".join(lines)


@dataclass
class MeasureRun:
    """One measure run: the runtime, where things go, what was written and skipped."""

    config: MeasureConfig
    runtime: CoreMLRuntime
    clock: Callable[[], float]
    memory: Callable | None
    machine: dict = field(default_factory=machine_description)
    written: list[Path] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)  # step -> why this machine cannot run it

    def recorded(self, step: str, key: str) -> bool:
        """Whether ``step`` is already recorded for the package ``key`` on this machine."""
        if self.config.again or not Path(self.config.records).is_dir():
            return False
        for rec in read_records(self.config.records):
            tag = rec.get("parameters", {}).get("measure", {})
            same_machine = all(rec["provenance"].get(k) == v for k, v in self.machine.items())
            if tag.get("step") == step and tag.get("package_sha256") == key and same_machine:
                return True
        return False

    def keep(self, step: str, key: str, records: list[dict]) -> None:
        """Tag each record with the step and package hash, and write it to the records directory."""
        for rec in records:
            rec = {k: v for k, v in rec.items() if k != "_file"}
            rec["parameters"] = {**rec["parameters"], "measure": {"step": step, "package_sha256": key}}
            self.written.append(write_record(self.config.records, rec))

    def staged(self, name: str) -> Path:
        path = Path(self.config.build) / "staging" / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path


def _doctor(run: MeasureRun) -> None:
    """Refuse (one line naming what is missing) unless the Core ML runtime and a Neural Engine are here."""
    reason = run.runtime.unavailable_reason() or run.runtime.neural_engine_reason()
    if reason:
        raise AnelabInputError(
            f"anelab measure needs a Mac with the Core ML runtime and a Neural Engine: {reason}; "
            f"'anelab measure --dry-run' lists the steps anywhere"
        )


def _probe(run: MeasureRun, echo) -> None:
    """First contact: every Core ML assumption checked on a tiny package and recorded (never skipped)."""

    record = probe_core_ml(run.runtime)
    verdicts = json.dumps(record["results"]["assumptions"], sort_keys=True).encode()
    run.keep("probe", hashlib.sha256(verdicts).hexdigest(), [record])
    failed = record["results"]["failed"]
    if failed:
        echo(f"probe: {', '.join(failed)} failed on this Mac; the steps relying on them refuse naming them")


def _export(run: MeasureRun, checkpoint: Checkpoint, layer: int, histories: list[int], out: Path):
    """The layer's sidecar, exported with the gate (reused when already verified here, unless again)."""

    pkg = out / f"layer_{layer}.mlpackage"
    if pkg.is_dir() and not run.config.again and read_sidecar_metadata(pkg).ane_verified:
        return pkg
    gate = AneGate(run.runtime)
    [result] = export_sidecars(checkpoint, out, run.config.chunk, histories, [layer], gate=gate)
    return result.package


def _gate_record(pkg: Path) -> dict:

    meta = read_sidecar_metadata(pkg)
    return make_record(
        "ane_gate",
        {"package": pkg.name, "chunk": meta.chunk, "histories": meta.histories, "layer": meta.layer},
        {"verified": meta.ane_verified, "reason": meta.ane_reason, "evidence": meta.ane_evidence},
        unknown=["operations the compute plan prefers for the Neural Engine are not proof of where they ran"],
    )


def _verify(run: MeasureRun, pkg: Path, checkpoint: Checkpoint) -> list[dict]:

    records = []
    for units in run.config.verify_units:
        report = verify_on_device(pkg, checkpoint, compute_units=units, runtime=run.runtime)
        records.append(make_record("device_verify", {"package": pkg.name, "compute_units": units}, report.to_dict()))
    return records


def _load_timings(run: MeasureRun, pkg: Path, compositions: dict[str, Path]) -> list[dict]:

    cfg, rt = run.config, run.runtime
    records = []
    for function in package_functions(pkg):
        for cold in (True, False):
            records.append(
                time_load(
                    rt, pkg, function, "cpu_and_ne", cold=cold, repeats=cfg.repeats, clock=run.clock, fresh_process=cold
                )
            )  # cold: the first load of a fresh compiled copy, in a fresh process
    records.append(time_compositions(rt, compositions, "h0", repeats=cfg.repeats, clock=run.clock))
    by_count = {1: compositions["alone"], 2: next(iter(v for k, v in compositions.items() if k != "alone"))}
    by_count[len(package_functions(pkg))] = pkg
    memory = run.memory
    if memory is None and rt.name != "coreml":  # a fake runtime measures in this process
        memory = lambda p, fns, compute_units: measure_load_memory(rt, p, fns, compute_units=compute_units)  # noqa: E731
    records.append(memory_vs_functions(by_count, measure=memory))
    return records


def _block_ab(run: MeasureRun, pkg: Path, checkpoint: Checkpoint) -> list[dict]:

    meta = read_sidecar_metadata(pkg)
    return time_attention_ab(
        run.runtime, pkg, checkpoint.geometry, chunk=meta.chunk, histories=meta.histories,
        compute_units=run.config.ab_units, repeats=run.config.repeats, clock=run.clock,
    )  # fmt: skip


def _gather_probe(run: MeasureRun) -> tuple[str, list[dict]]:

    out = Path(run.config.build) / "probes"
    results = probe(run.config.probe_chunk, repeats=1, out_dir=out)
    shape = results[0].shape
    inputs = probe_inputs(shape, 4, 4)
    # the probes are rebuilt each run: key them by their model and weights (Data/), not the Manifest's fresh UUIDs
    key = hashlib.sha256("".join(package_content_hash(Path(r.package) / "Data") for r in results).encode()).hexdigest()
    if run.recorded("gather_probe", key):
        return key, []
    staging = run.staged("gather_probe")
    rows = measure_probes_on_runtime(run.runtime, results, inputs, staging, repeats=run.config.repeats, clock=run.clock)
    counts = make_record(
        "gather_probe_assignment",
        {"shape": shape.to_dict(), "compute_units": "cpu_and_ne"},
        {"rows": [{"graph": r["graph"], "chunk": r["chunk"], "assignment": r["assignment"]} for r in rows]},
        unknown=["operations the compute plan prefers for the Neural Engine are not proof of where they ran"],
    )
    return key, [*read_records(staging), counts]


def measure(
    config: MeasureConfig,
    runtime: CoreMLRuntime | None = None,
    *,
    clock: Callable[[], float] = time.perf_counter,
    memory: Callable | None = None,
    echo: Callable[[str], None] = print,
    coreai_runtime: CoreAIRuntime | None = None,
) -> dict:
    """Run every step (see the module docstring); return {"package", "written": [paths], "skipped": [steps],
    "unavailable": {step: why}}.

    runtime: this machine's by default; memory: how memory vs functions is measured (default: a fresh
    process per package on a Mac); coreai_runtime: this machine's Core AI runtime by default (the coreai
    step runs where it is available: macOS 27).
    """

    run = MeasureRun(config, runtime if runtime is not None else default_runtime(), clock, memory)
    _doctor(run)
    steps = tqdm(total=len(STEPS), desc="anelab measure", unit="step")
    steps.update()
    _probe(run, echo)
    steps.update()
    checkpoint = load_checkpoint(
        Path(config.checkpoint) if config.checkpoint else default_checkpoint_dir(BUILD_DIR / "checkpoints")
    )
    layer = config.layer if config.layer is not None else checkpoint.geometry.full_attention_layers[0]
    build, histories = Path(config.build), config.resolved_histories()
    pkg = _export(run, checkpoint, layer, histories, build / "sidecars")
    key = package_content_hash(pkg)
    _step(run, "export", key, lambda: [_gate_record(pkg)], echo)
    steps.update()
    _step(run, "verify", key, lambda: _verify(run, pkg, checkpoint), echo)
    steps.update()

    def loads():
        compositions = {
            "alone": _export(run, checkpoint, layer, [0], build / "compositions" / "alone"),
            f"beside_h{config.chunk}": _export(
                run, checkpoint, layer, [0, config.chunk], build / "compositions" / f"beside_h{config.chunk}"
            ),
        }
        return _load_timings(run, pkg, compositions)

    _step(run, "load", key, loads, echo)
    steps.update()
    _coreai(run, coreai_runtime, checkpoint, layer, histories, key, echo, runtime is None)
    steps.update()
    _step(run, "block_ab", key, lambda: _block_ab(run, pkg, checkpoint), echo)
    steps.update()
    _splits(run, echo)
    steps.update()
    probe_key, probe_records = _gather_probe(run)
    if probe_records:
        run.keep("gather_probe", probe_key, probe_records)
    else:
        run.skipped.append("gather_probe")
        echo("gather_probe: already recorded for these probe packages on this machine (use --again)")
    steps.update()
    steps.close()
    return {"package": str(pkg), "written": [str(p) for p in run.written], "skipped": run.skipped,
            "unavailable": run.unavailable}  # fmt: skip


def _coreai(
    run: MeasureRun, runtime: CoreAIRuntime | None, checkpoint: Checkpoint, layer, histories, key, echo, own: bool
) -> None:
    """The Core AI step (``publish.measure_coreai``) where Core AI runs; elsewhere one line saying why not.
    ``own``: the Core ML runtime is this machine's, so the Core AI one defaults to this machine's too (beside a
    caller's Core ML runtime, e.g. a fake, only a Core AI runtime the caller gives is used)."""

    if runtime is None and not own:
        run.unavailable["coreai"] = "no Core AI runtime was given beside the caller's Core ML runtime"
        echo(f"coreai: not measured — {run.unavailable['coreai']}")
        return
    runtime = runtime if runtime is not None else default_coreai_runtime()
    reason = runtime.unavailable_reason()
    if reason:
        run.unavailable["coreai"] = reason
        echo(f"coreai: not measured — {reason}")
        return
    cfg = run.config
    try:  # a Core AI failure (a child that died before answering, a refused load) does not stop the Core ML steps
        _step(run, "coreai", key, lambda: measure_coreai.coreai_records(runtime, checkpoint, layer, cfg.chunk, histories,
                                                         Path(cfg.build), repeats=cfg.repeats, clock=run.clock,
                                                         coreml_key=key), echo)  # fmt: skip
    except (RuntimeError, AnelabInputError) as e:
        run.unavailable["coreai"] = f"failed: {' '.join(str(e).split())}"
        echo(f"coreai: not measured — {run.unavailable['coreai']}")


def _splits(run: MeasureRun, echo) -> None:
    """The ``split_ab`` step (``publish.measure_splits``) for ``split_models``; none given: one line says so."""
    cfg = run.config
    if not cfg.split_models:
        run.unavailable["split_ab"] = "no model given (--split-models)"
        echo(f"split_ab: not measured — {run.unavailable['split_ab']}")
        return
    key = models_key(cfg.split_models, cfg.split_prompt_tokens, cfg.chunk)
    _step(run, "split_ab", key, lambda: split_records(run.runtime, cfg.split_models, cfg.split_prompt_tokens,
          cfg.chunk, Path(cfg.build), run.staged("split_ab"), repeats=cfg.repeats, clock=run.clock,
          again=cfg.again), echo)  # fmt: skip


def _step(run: MeasureRun, name: str, key: str, work: Callable[[], list[dict]], echo) -> None:
    if run.recorded(name, key):
        run.skipped.append(name)
        echo(f"{name}: already recorded for this package on this machine (use --again)")
        return
    run.keep(name, key, work())
