"""The whole-model prefill A/B on the user's own Mac (``anelab ab``): mlx-lm's own prefill on the GPU against the
hybrid — every full-attention layer on its sidecar through Core ML (``cpu_and_ne``), the rest on mlx-lm; or an offload
split: every MLP and / or a hybrid's GDN input projections on their block sidecars (through Core ML too), with or
without attention; ``splits`` times each split named (the planner's names, ``planned``: ``arms.ab_splits``) alone.

Per prompt length N (the seed's protocol: a warm-up, then two measured runs of each arm):

- GPU arm: ``mlx_lm.generate.generate_step``'s own prefill of the prompt (its ``prefill_step_size`` chunks, then
  the last token's logits), nothing else;
- ANE arm: every function the prompt visits is loaded first, layer by layer, as a runtime pays it (the first use
  in this process; timed apart, ``loads``), then the hybrid prefills the prompt in chunks of the sidecars' width.
  Each run is split into ``mlx_eval_s`` (evaluating mlx-lm's graph), ``core_ml_predict_s`` (Core ML's own
  prediction), ``marshalling_s`` (rows, history and outputs between MLX and NumPy; Core ML's input and output
  conversions; a stateful layer's K/V read back) and ``mlx_graph_s`` (the rest of the run's wall time: mlx-lm
  building its graph, Python);
- correctness: the hybrid's logits at the last prompt position against mlx-lm's own chunked forward's, and — when
  the checkpoint runs in bf16 or fp16 — against the same forward in fp32, within a bound that knows its reference's
  precision (``correctness_bound``: the sidecars' fp16 threshold plus twice the reference's own error against fp32
  on that prompt, so a bf16 model's own noise can never reject its A/B).

Each prompt length is one record (``core.records``, never overwritten) with the machine, MLX, mlx-lm and
coremltools versions. On a Mac the verdict prices both arms as measured (``planner.verdict``: the ANE arm is the
hybrid's whole prefill, so the offloaded share is 1; its loads are the functions' first-use loads). Off a Mac the
same command runs mlx-cpu with the sidecars evaluated by NumPy, for correctness: its timings are labelled as not
a Mac's and never priced.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from anelab.arms.ab_splits import PlannedSplit, planned_splits, require_packages
from anelab.arms.arm_comparison import random_prompt, with_block_sidecars
from anelab.arms.sidecars import CoreMLRunner, SidecarSet, numpy_runner, open_block_sidecars, open_sidecars
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import chunk_starts
from anelab.core.limits import require_prompt_lengths
from anelab.core.output_paths import require_output_dir
from anelab.core.progress import tqdm
from anelab.core.records import machine_kind, make_record, provenance, write_record
from anelab.planner.envelope import MEASURED, Cost
from anelab.planner.offload_split import ATTENTION, MLP, PROJECTIONS
from anelab.planner.verdict import ArmCosts, Verdict, verdict_for
from anelab.runtimes.coreml.ane_placement import require_ane_placement
from anelab.runtimes.coreml.coreml_runtime import default_runtime
from anelab.runtimes.coreml.timing import COLD_LOAD_CAVEAT
from anelab.runtimes.interface import NEURAL_ENGINE_UNITS, RuntimeLoadError, RuntimePredictError, check_compute_units
from anelab.runtimes.mlx.hybrid import Hybrid, HybridTiming, prefill
from anelab.runtimes.mlx.mlx_model import mlx_versions, open_mlx_model, require_mlx_readable, to_numpy
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD, relative_error
from anelab.sidecar.designs import GDN_PROJ, get_design
from anelab.sidecar.designs import MLP as MLP_DESIGN

REFERENCE_NOISE_FACTOR = 2.0  # the hybrid's own bf16 layers stray from fp32 about as far as the reference does
AB_WARMUP, AB_REPEATS = 1, 2  # the seed's protocol: one warm-up, two measured runs per arm
GPU_PREFILL_STEP = 2048  # mlx-lm's default prefill_step_size (mlx_lm.generate.generate_step)
OFF_MAC_DTYPE = "float32"  # off a Mac the run checks correctness: fp32 on mlx-cpu
NOT_A_MAC = "measured here ({machine}: mlx-cpu, sidecars evaluated by NumPy) — not a Mac's timings, never priced"
COMPONENTS = {
    "mlx_eval_s": "mx.eval of mlx-lm's graph: the layers between sidecar calls, the chunk's end, the logits",
    "mlx_graph_s": "the rest of the run's wall time: mlx-lm building its lazy graph, Python",
    "core_ml_predict_s": "Core ML's own predict durations (the wall time of a call where it is not reported)",
    "numpy_sidecar_s": "off a Mac: the sidecars' saved programs evaluated by NumPy",
    "marshalling_s": "MLX <-> NumPy rows, K/V history and outputs; Core ML's input / output conversions; state reads",
    "loads": "each function's first load in this process (layer:function -> s), paid once before the warm-up",
    "placements": "per package: Core ML's compute plan under the compute units, and the compile (cached) before it",
}


@dataclass
class AbRequest:
    """One ``anelab ab`` run. runtime: a ``CoreMLRuntime`` (default this machine's; unavailable off a Mac);
    clock: the timings' clock (tests: a fake Mac's); dtype: mlx-lm's parameters (default: the checkpoint's own
    on a Mac, float32 off it)."""

    checkpoint: Path
    sidecars: Path | None  # the attention sidecars (None: only block sidecars are served)
    prompt_tokens: tuple[int, ...]
    compute_units: str = "cpu_and_ne"
    warmup: int = AB_WARMUP
    repeats: int = AB_REPEATS
    dtype: str | None = None
    runtime: object | None = None
    clock: Callable[[], float] = time.perf_counter
    out_dir: Path | None = None
    seed: int = 0
    mlx_checkpoint: Path | None = None  # the directory mlx-lm reads (default: checkpoint; a GGUF file's fp16 copy)
    mlp_sidecars: Path | None = None  # --graph mlp packages: every MLP on its sidecar too
    gdn_sidecars: Path | None = None  # --graph gdn-proj packages: a hybrid's GDN projections too
    splits: tuple[str, ...] = ()  # planner split names or "planned" (arms.ab_splits); (): the sidecars given, together
    chip: str | None = None  # whose plan ``planned`` reads (default: this Mac's, else the seed's M3)
    planned: PlannedSplit | None = None  # the one split this run serves (set per split by ``run_ab``)


@dataclass
class PromptAb:
    """Both arms at one prompt length: the record, and (on a Mac) the verdict priced from it."""

    prompt_tokens: int
    record: dict
    verdict: Verdict | None

    @property
    def results(self) -> dict:
        return self.record["results"]


@dataclass
class AbReport:
    checkpoint: Path
    on_mac: bool
    label: str
    prompts: list[PromptAb] = field(default_factory=list)

    def table(self) -> str:
        lines = [f"checkpoint {self.checkpoint}: whole-model prefill A/B, {self.label}"]
        for p in self.prompts:
            r, gpu, ane = p.results, p.results["gpu_arm"], p.results["ane_arm"]
            parts = ", ".join(f"{k.removesuffix('_s')} {v:.3g}" for k, v in ane["components_median_s"].items())
            device = p.record["provenance"].get("mlx_device", "?")
            split = p.record["parameters"].get("split", ATTENTION)
            arm = "hybrid" if split == ATTENTION else f"hybrid: {split} on sidecars"
            lines.append(
                f"{p.prompt_tokens:>7} tokens: GPU arm (mlx-lm prefill, {device}) {gpu['median_s']:.4g} s "
                f"[{gpu['min_s']:.4g} .. {gpu['max_s']:.4g}]; ANE arm ({arm}) {ane['median_s']:.4g} s "
                f"[{ane['min_s']:.4g} .. {ane['max_s']:.4g}] = {parts} s; loads {ane['load_total_s']:.4g} s "
                f"({len(ane['loads'])} functions, apart); logits vs mlx-lm {r['correctness']['logits_relative_difference']:.2e}"
            )
            lines += _split_lines(p, self.on_mac)
            if p.verdict is not None:
                lines.append(f"         verdict: {p.verdict.decision} ({p.verdict.reason})")
        if not self.on_mac:
            lines.append("no verdict: these timings are not a Mac's (run 'anelab ab' on the Mac to price both arms)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "checkpoint": str(self.checkpoint),
            "on_mac": self.on_mac,
            "label": self.label,
            "prompts": [
                {
                    "prompt_tokens": p.prompt_tokens,
                    "record": p.record,
                    "verdict": p.verdict.to_dict() if p.verdict else None,
                }  # fmt: skip
                for p in self.prompts
            ],
        }


def _split_lines(p: PromptAb, on_mac: bool) -> list[str]:
    """A named split's measured ratio (GPU arm / ANE arm medians; off a Mac: not measured) beside the plan's."""
    planned = p.record["parameters"].get("planned")
    if not planned:
        return []
    gpu, ane = p.results["gpu_arm"]["median_s"], p.results["ane_arm"]["median_s"]
    measured = f"measured {gpu / ane:.2f}x on this Mac" if on_mac else "not measured (not a Mac: correctness only)"
    at = planned["prediction"]
    said = (f"predicted {at['ratio']:.2f}x [{at['ratio_low']:.2f} .. {at['ratio_high']:.2f}] on {planned['chip']} "
            f"(rank {at['rank']})") if at else f"the plan on {planned['chip']} does not list it at this length"  # fmt: skip
    return [f"         split {p.record['parameters']['split']}: {measured}; {said}"]


def _stats(samples: list[float]) -> dict:
    return {"min_s": min(samples), "median_s": statistics.median(samples), "max_s": max(samples),
            "samples_s": list(samples)}  # fmt: skip


def mlx_device() -> tuple[str, bool]:
    """(MLX's default device type, whether Metal is available here)."""
    import mlx.core as mx

    return str(mx.default_device().type).rsplit(".", 1)[-1], bool(mx.metal.is_available())


def require_gpu_arm_device(on_mac: bool) -> str:
    """The device the GPU arm runs on, said in the record; refused (one line) on a Mac whose Metal is there but whose
    MLX default device is not the GPU (a GPU arm timed on the CPU would make any ANE arm look fast)."""
    device, metal = mlx_device()
    if on_mac and metal and device != "gpu":
        raise AnelabInputError(
            f"MLX's default device is the {device}, not the GPU: the GPU arm would be timed on the {device}; "
            "unset whatever sets mx.set_default_device (or MLX_DEVICE) and run again"
        )
    return device if metal else f"{device} (no Metal here: not a GPU's timings)"


def _time_gpu_arm(mlx_model, prompt: np.ndarray, request: AbRequest) -> dict:
    """mlx-lm's own prefill (``generate_step`` with max_tokens=0: the prompt and its first token's logits), inside
    mlx-lm's ``wired_limit`` as its ``stream_generate`` runs it (a model near the limit is kept wired, not paged)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step, generation_stream, wired_limit

    samples = []
    with wired_limit(mlx_model.model, [generation_stream]):  # entered before the clocks, as mlx-lm does
        for i in range(request.warmup + request.repeats):
            cache = mlx_model.make_cache()
            t0 = request.clock()
            for _ in generate_step(mx.array(prompt.astype(np.int32)), mlx_model.model, max_tokens=0,
                                   prompt_cache=cache, prefill_step_size=GPU_PREFILL_STEP):  # fmt: skip
                pass
            if i >= request.warmup:
                samples.append(request.clock() - t0)
    return _stats(samples)


def _reference_logits(mlx_model, prompt: np.ndarray, chunk: int) -> np.ndarray:
    """mlx-lm's own forward in chunks of ``chunk``: the logits at the last prompt position [V] (untimed)."""

    return to_numpy(prefill(mlx_model, prompt, chunk, mlx_model.make_cache()))


def correctness_bound(reference_noise: float) -> float:
    """The largest relative difference of the hybrid's logits from the fp32 reference that is still correct: the
    sidecars' fp16 threshold (``RELATIVE_ERROR_THRESHOLD``) plus ``REFERENCE_NOISE_FACTOR`` times the checkpoint
    dtype's own error against fp32 on the same prompt (0 for an fp32 run)."""
    return RELATIVE_ERROR_THRESHOLD + REFERENCE_NOISE_FACTOR * float(reference_noise)


def judge_correctness(got: np.ndarray, want: np.ndarray, want_fp32: np.ndarray | None, chunk: int) -> dict:
    """The A/B's correctness entry from the last-position logits [V]: the hybrid's (``got``), mlx-lm's forward in the
    run's dtype (``want``) and in fp32 (``want_fp32``; None when the run is fp32 already)."""
    reference = want if want_fp32 is None else want_fp32
    noise = 0.0 if want_fp32 is None else relative_error(want, want_fp32)
    off = relative_error(got, reference)
    bound = correctness_bound(noise)
    return {
        "logits_relative_difference": relative_error(got, want),
        "same_greedy_token": int(np.argmax(got)) == int(np.argmax(want)),
        "reference": f"mlx-lm's own forward in chunks of {chunk} (untimed)",
        "against_fp32": off,
        "reference_precision_noise": noise,
        "bound": bound,
        "within_bound": bool(off <= bound),  # NaN is never within
        "bound_reason": f"{RELATIVE_ERROR_THRESHOLD:.0e} (fp16 sidecars) + {REFERENCE_NOISE_FACTOR:g} x the run "
        f"dtype's own error against fp32 on this prompt ({noise:.2e})",
    }


def _fp32_reference_logits(opened, prompt: np.ndarray) -> np.ndarray | None:
    """mlx-lm's forward in fp32 (untimed, its own copy of the weights, released after) when the run is not fp32."""

    if opened.mlx_model.dtype == "float32":
        return None
    reference = open_mlx_model(opened.mlx_model.path, dtype="float32")
    try:
        return _reference_logits(reference, prompt, opened.sidecars.chunk)
    finally:
        del reference


def _time_ane_arm(mlx_model, sidecars: SidecarSet, hybrid, prompt: np.ndarray, request: AbRequest, runner):
    """Loads first (on a Mac), then warm-up and measured hybrid prefills -> (results, last logits [V])."""

    on_mac = isinstance(runner, CoreMLRunner)
    if on_mac:
        _or_refuse(lambda: runner.load_all(prompt.size))
    visited = {
        (layer, sidecars.function_for(layer, s)) for layer in sidecars.packages for s in _starts(prompt, sidecars)
    }
    if on_mac:  # each block layer's one function, keyed by its kind (``CoreMLRunner._to_load``)
        visited |= {(layer, f"{r.label}:{s.function_for(0)}") for r in runner.blocks for layer, s in r.opened.items()}
    loads = {f"{layer}:{name}": runner.timing.loads[(layer, name)] for layer, name in sorted(visited)} if on_mac else {}
    runs, logits = [], None
    for i in range(request.warmup + request.repeats):
        hybrid.timing = HybridTiming()
        if on_mac:
            runner.timing.reset_calls()
        t0 = request.clock()
        logits = _or_refuse(lambda: prefill(mlx_model, prompt, sidecars.chunk, mlx_model.make_cache(), hybrid))
        total = request.clock() - t0
        if i >= request.warmup:
            runs.append(_components(total, hybrid.timing, runner.timing if on_mac else None))
    totals = [r["total_s"] for r in runs]
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k not in ("total_s", "calls")}
    results = {**_stats(totals), "runs": runs, "components_median_s": median, "loads": loads,
               "load_total_s": sum(loads.values())}  # fmt: skip
    return results, to_numpy(logits)


def _or_refuse(call):
    """``call()``, a failed Core ML load or predict refused in one line: the ANE arm does not run on this Mac,
    and nothing of the failed run (its loads included) is kept as measured."""

    try:
        return call()
    except (RuntimeLoadError, RuntimePredictError) as e:
        raise AnelabInputError(
            f"the ANE arm does not run on this Mac ({' '.join(str(e).split())}); nothing is priced: the GPU arm alone "
            "is no A/B"
        ) from None


def _starts(prompt: np.ndarray, sidecars: SidecarSet) -> list[int]:

    return chunk_starts(prompt.size, sidecars.chunk)


def _components(total: float, hybrid_timing, core_ml) -> dict:
    """One measured run split into its components (``COMPONENTS``); the graph-building rest must not be negative."""
    parts = {"mlx_eval_s": hybrid_timing.mlx_s, "marshalling_s": hybrid_timing.marshalling_s}
    if core_ml is not None:
        parts["core_ml_predict_s"] = core_ml.predict_s
        parts["marshalling_s"] += core_ml.marshalling_s
        inside = hybrid_timing.sidecar_s - core_ml.predict_s - core_ml.marshalling_s  # the runner's own Python
        parts["marshalling_s"] += max(inside, 0.0)
    else:
        parts["numpy_sidecar_s"] = hybrid_timing.sidecar_s
    parts["mlx_graph_s"] = total - sum(parts.values())
    if parts["mlx_graph_s"] < -1e-9:
        raise AssertionError(f"the run's components exceed its wall time: {parts} > {total}")
    return {"total_s": total, **parts, "calls": hybrid_timing.calls}


def _placement_phrase(placements: list[dict]) -> str:
    """The plan's Neural Engine share of the least-placed package, for the ANE arm's cost source."""
    if not placements:
        return "compute plan: not read"
    least = min(placements, key=lambda p: (p.get("compute_share") or 0.0, p["neural_engine_share"]))
    compute = "unknown" if least.get("compute_share") is None else f"{least['compute_share']:.0%}"
    return (f"least-placed package: {least['neural_engine']} of {least['total']} operations and {compute} of its "
            "compute operations on the Neural Engine")  # fmt: skip


def measured_arm_costs(results: dict, design: str, layers: int, machine: str, placements=()) -> ArmCosts:
    """Both arms as measured on this Mac (kind ``measured``): S the GPU arm; the ANE arm the hybrid's whole
    prefill (offloaded share 1), A its runs without loads, L one layer's first-use loads (mean, min .. max)."""
    gpu, ane = results["gpu_arm"], results["ane_arm"]
    per_layer: dict[str, float] = {}
    for key, seconds in ane["loads"].items():
        layer = key.split(":")[0]
        per_layer[layer] = per_layer.get(layer, 0.0) + seconds
    loads = list(per_layer.values()) or [0.0]
    layers = max(len(per_layer), layers)  # every layer that loads a function (its attention's and MLP's summed)
    comp = ", ".join(f"{k} {v:.3g} s" for k, v in ane["components_median_s"].items())
    where = f"measured on this Mac ({machine})"
    return ArmCosts(
        design=design,
        layers=layers,
        loads_per_layer=len(ane["loads"]) // max(layers, 1),
        runs_on_ane=True,
        gpu_prefill=Cost(
            gpu["median_s"], gpu["min_s"], gpu["max_s"], MEASURED, f"{where}: mlx-lm's prefill on the GPU"
        ),
        offloaded_share=1.0,
        ane_attention=Cost(
            ane["median_s"],
            ane["min_s"],
            ane["max_s"],
            MEASURED,
            f"{where}: the hybrid's prefill without loads ({comp}); {_placement_phrase(list(placements))}",
        ),  # fmt: skip
        load_per_layer=Cost(
            statistics.mean(loads),
            min(loads),
            max(loads),
            MEASURED,
            f"{where}: first-use loads of each layer's functions",
        ),  # fmt: skip
    )


def _check_prompts(prompt_tokens) -> list[int]:
    """The prompt lengths, each positive and at most ``MAX_POSITIONS`` (checked before anything is built for one)."""
    return require_prompt_lengths(prompt_tokens)


def _placements(runtime, sidecars: SidecarSet, compute_units: str, clock) -> list[dict]:
    """Every layer's package placed on the Neural Engine by this Mac's compute plan (else refused, one line)."""

    if compute_units not in NEURAL_ENGINE_UNITS:
        raise AnelabInputError(
            f"anelab ab's ANE arm runs the sidecars on the Neural Engine: use --compute-units cpu_and_ne or all, not {compute_units}"
        )
    placed = []
    for pkg in every_package(sidecars):
        runtime.content_hash(pkg)  # the package's hash, outside the clock (the compile cache's key)
        t0 = clock()
        runtime.compile(pkg)  # once per package content (cached): paid before the loads, recorded apart
        compile_s = clock() - t0
        placed.append({**require_ane_placement(runtime, pkg, compute_units).to_dict(), "compile_s": compile_s})
    return placed


@dataclass
class _Opened:
    """What ``run_ab`` opens once: the checkpoint, the sidecars (served by Core ML or NumPy), mlx-lm's model, the
    hybrid over it, the record's provenance and whether this is a Mac."""

    checkpoint: object
    sidecars: SidecarSet
    mlx_model: object
    hybrid: object
    provenance: dict
    on_mac: bool
    placements: list[dict]
    gpu_device: str = "gpu"


def _open(request: AbRequest) -> _Opened:

    _check_prompts(request.prompt_tokens)  # bounded before the checkpoint is opened
    if request.out_dir is not None:  # where the records go: refused before the measurement, not after it
        require_output_dir(request.out_dir)
    check_compute_units(request.compute_units)
    mlx_path = Path(request.mlx_checkpoint or request.checkpoint)
    require_mlx_readable(mlx_path)  # before the sidecars are checked against it
    if request.warmup < 0 or request.repeats < 1:
        raise AnelabInputError(f"--warmup must be >= 0 and --repeats >= 1, got {request.warmup} and {request.repeats}")
    checkpoint = load_checkpoint(request.checkpoint)
    runtime = request.runtime if request.runtime is not None else default_runtime()
    on_mac = runtime.available()
    sidecars = _served_sidecars(request, checkpoint, on_mac)
    gpu_device = require_gpu_arm_device(on_mac)
    if on_mac:  # every package opened (an ungated one refused) before any compute plan runs a child for it
        sidecars.runner = CoreMLRunner(
            sidecars, compute_units=request.compute_units, runtime=runtime, clock=request.clock
        )
    else:
        sidecars.runner = numpy_runner(sidecars, keep_open=len(sidecars.packages))
    placements = _placements(runtime, sidecars, request.compute_units, request.clock) if on_mac else []
    mlx_model = open_mlx_model(mlx_path, dtype=request.dtype or (None if on_mac else OFF_MAC_DTYPE))
    hybrid = Hybrid(mlx_model, sidecars, checkpoint.geometry, tuple(sidecars.packages), clock=request.clock,
                    mlp_layers=_block_layers(sidecars.mlp), gdn_layers=_block_layers(sidecars.gdn))  # fmt: skip
    return _Opened(checkpoint, sidecars, mlx_model, hybrid, {**provenance(), **mlx_versions()}, on_mac, placements,
                   gpu_device)  # fmt: skip


def _served_sidecars(request: AbRequest, checkpoint, on_mac: bool) -> SidecarSet:
    """The attention sidecars and any block sidecars (``with_block_sidecars``) the ANE arm serves (a planned split's
    ``mlp[:k]``: the first k layers' packages). On a Mac every package is served through Core ML (``CoreMLRunner``);
    off a Mac the saved programs are evaluated with NumPy, for correctness, labelled as every off-Mac run is."""
    blocks = [(d, name, part) for d, name, part in ((request.mlp_sidecars, MLP_DESIGN, MLP),
              (request.gdn_sidecars, GDN_PROJ, PROJECTIONS)) if d]  # fmt: skip
    if request.sidecars is None and not blocks:
        raise AnelabInputError("anelab ab needs sidecars to serve: --sidecars (attention), --mlp-sidecars or "
                               "--gdn-sidecars")  # fmt: skip
    longest = max(_check_prompts(request.prompt_tokens))
    sidecars = open_sidecars(request.sidecars, checkpoint, longest) if request.sidecars is not None else None
    for directory, name, part in blocks:
        first = request.planned.parts.get(part) if request.planned is not None else None
        layers = get_design(name).block.layers(checkpoint)[:first] if first is not None else None
        block = open_block_sidecars(directory, checkpoint, name, layers)
        block.keep_open = len(block.packages)  # mlx-lm's order is chunk-major: keep every package open
        sidecars = with_block_sidecars(sidecars, block)
    return sidecars


def _block_layers(block) -> tuple[int, ...]:
    return tuple(sorted(block.packages)) if block is not None else ()


def served_split(sidecars: SidecarSet, planned: PlannedSplit | None = None) -> str:
    """The split the ANE arm serves, in the planner's words (``planner.offload_split``'s part names)."""
    if planned is not None:
        return planned.name
    parts = [name for name, on in ((ATTENTION, sidecars.packages), (MLP, sidecars.mlp), (PROJECTIONS,
             sidecars.gdn)) if on]  # fmt: skip
    return " + ".join(parts)


def every_package(sidecars: SidecarSet) -> list[Path]:
    """The attention packages, then the block sidecars' (MLP, GDN projections): what the ANE arm places and loads."""
    blocks = [b for b in (sidecars.mlp, sidecars.gdn) if b is not None]
    return [*sidecars.packages.values(), *(pkg for b in blocks for pkg in b.packages.values())]


def _parameters(request: AbRequest, opened: _Opened, n: int) -> dict:
    sidecars = opened.sidecars
    return {
        "checkpoint": str(opened.checkpoint.path),
        "mlx_checkpoint": str(opened.mlx_model.path),
        "model_type": opened.checkpoint.model_type,
        "prompt_tokens": n,
        "chunk": sidecars.chunk,
        "design": sidecars.design(next(iter(sidecars.packages))).name if sidecars.packages else None,
        "split": served_split(sidecars, request.planned),
        "planned": _planned_at(request.planned, n),
        "sidecars": str(sidecars.directory),
        "layers_on_sidecars": sorted(sidecars.packages),
        "mlp_layers_on_sidecars": list(_block_layers(sidecars.mlp)),
        "gdn_layers_on_sidecars": list(_block_layers(sidecars.gdn)),
        "compute_units": request.compute_units if opened.on_mac else "none (NumPy evaluation of the saved programs)",
        "mlx_dtype": opened.mlx_model.dtype,
        "gpu_prefill_step": GPU_PREFILL_STEP,
        "gpu_arm_device": opened.gpu_device,
        "warmup": request.warmup,
        "repeats": request.repeats,
        "seed": request.seed,
        "timings_are_a_macs": opened.on_mac,
        "placements": opened.placements,
        "components": COMPONENTS,
        "protocol": "per arm one warm-up then the measured runs; the ANE arm's loads paid first, timed apart",
    }


def _one_prompt(request: AbRequest, opened: _Opened, n: int) -> PromptAb:
    """Both arms at one prompt length, the correctness check, the record and (on a Mac) the verdict."""

    mlx_model, sidecars = opened.mlx_model, opened.sidecars
    prompt = random_prompt(mlx_model.vocab_size, n, request.seed)
    gpu = _time_gpu_arm(mlx_model, prompt, request)
    want = _reference_logits(mlx_model, prompt, sidecars.chunk)
    if opened.on_mac:  # the first use and the pre-flight children, before any of the ANE arm's clocks
        _or_refuse(lambda: sidecars.runner.prepare(prompt.size))
    with opened.hybrid.installed():
        ane, got = _time_ane_arm(mlx_model, sidecars, opened.hybrid, prompt, request, sidecars.runner)
    correctness = judge_correctness(got, want, _fp32_reference_logits(opened, prompt), sidecars.chunk)
    unknown = [COLD_LOAD_CAVEAT] if opened.on_mac else [NOT_A_MAC.format(machine=machine_kind())]
    record = make_record("whole_model_ab", _parameters(request, opened, n),
                         {"gpu_arm": gpu, "ane_arm": ane, "correctness": correctness},
                         provenance_override=opened.provenance, unknown=unknown)  # fmt: skip
    if request.out_dir is not None:
        record = {**record, "_file": write_record(request.out_dir, record).name}
    verdict = None
    if opened.on_mac:
        design = record["parameters"]["design"] or f"split {record['parameters']['split']}"
        costs = measured_arm_costs(record["results"], design, len(sidecars.packages), machine_kind(),
                                   opened.placements)  # fmt: skip
        verdict = verdict_for(costs)
    return PromptAb(n, record, verdict)


def run_ab(request: AbRequest) -> AbReport:
    """The A/B at every prompt length of ``request`` (module docstring); with ``splits``, of each split named
    (``arms.ab_splits``: planner names, ``planned``), one after another, in one report."""

    if request.splits:
        return _run_splits(request)
    opened = _open(request)
    machine = machine_kind()
    label = f"measured on this Mac ({machine})" if opened.on_mac else NOT_A_MAC.format(machine=machine)
    report = AbReport(opened.checkpoint.path, opened.on_mac, label)
    for n in tqdm(_check_prompts(request.prompt_tokens), desc="ab", unit="prompt", leave=False):
        report.prompts.append(_one_prompt(request, opened, n))
    return report


def _run_splits(request: AbRequest) -> AbReport:
    """Each split of ``request.splits`` served alone (its parts' packages, ``arms.ab_splits``), both arms timed at
    every prompt length; every split checked against the plan and its packages before the first is run."""
    prompts = _check_prompts(request.prompt_tokens)
    splits = planned_splits(request.checkpoint, prompts, list(request.splits), request.chip)
    given = {ATTENTION: request.sidecars, MLP: request.mlp_sidecars, PROJECTIONS: request.gdn_sidecars}
    for split in splits:
        require_packages(split, given)
    report = None
    for split in splits:
        one = run_ab(replace(request, splits=(), planned=split, **{
            "sidecars": given[ATTENTION] if ATTENTION in split.parts else None,
            "mlp_sidecars": given[MLP] if MLP in split.parts else None,
            "gdn_sidecars": given[PROJECTIONS] if PROJECTIONS in split.parts else None}))  # fmt: skip
        if report is None:
            report = one
        else:
            report.prompts += one.prompts
    return report


def _planned_at(planned: PlannedSplit | None, n: int) -> dict | None:
    """The plan's prediction for the split served at ``n`` tokens (None: the split was not asked by name)."""
    if planned is None:
        return None
    at = planned.predicted.get(n)
    return {"chip": planned.chip, "chip_choice": planned.chip_choice, "parts": planned.parts,
            "prediction": at, "source": "planner.offload_split (predicted)"}  # fmt: skip


def ab_request(
    checkpoint: str | os.PathLike, sidecars: str | os.PathLike | None, prompt_tokens, **options
) -> AbRequest:
    directory = Path(sidecars) if sidecars is not None else None
    return AbRequest(Path(checkpoint), directory, tuple(int(n) for n in prompt_tokens), **options)
