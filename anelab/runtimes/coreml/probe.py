"""``anelab doctor --probe``: every Core ML behaviour anelab relies on, exercised where the code runs.

Tiny packages are exported here by anelab's own exporter (``build_probe_packages``): a stateful sidecar with
decode (``c2`` and ``c1`` over one 4-slot K/V state), its 4-bit palettized twin, and a dense package ``h0`` +
``h2`` beside its single-function variant ``h0``. Each row of ``anelab.runtimes.coreml.assumptions`` runs in a CHILD
process per compute-units setting of its row (``cpu_and_ne`` for everything that runs on the Neural Engine,
as the gate does; a first Neural Engine predict can kill its process, apple/coremltools#2758), and each row
is real: outputs are compared with the saved program evaluated in NumPy (fp16 noise allowed, a negative
control must differ), ``c1``'s output on the state ``c2`` filled is the state-sharing verdict, log lines are
counted, and a failed or crashed check fails its row. The ANE child loads and plans before it predicts, so a
child that dies there fails ``ungated_load_and_plan_survive``. After the ANE child exits, the unified log of its
PID is read for the marker it logged and for Core ML's own lines.

The verdicts, stamped with the chip, macOS and coremltools versions, replace the machine's previous ones
(``CoreMLRuntime.probe_file``); code relying on a failed one refuses naming it, and an unprobed or stale one
runs this probe first (``CoreMLRuntime.require_assumptions``).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from anelab.checkpoints.checkpoint import load_checkpoint, write_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.records import make_record, write_record
from anelab.core.weights import random_attention_weights
from anelab.runtimes.child import ChildRun, run_child
from anelab.runtimes.coreml import assumptions as a
from anelab.runtimes.coreml.block_ab import block_inputs
from anelab.runtimes.interface import (
    CORE_ML_HELPERS,
    CoreMLRuntime,
    RuntimeLoadError,
    RuntimePredictError,
    UnifiedLogUnavailable,
    describe_child_exit,
    prepare_inputs,
    runtime_from_spec,
    spec_for_child,
    zero_inputs,
)
from anelab.sidecar.checks.comparison import relative_error
from anelab.sidecar.designs import STATEFUL
from anelab.sidecar.export import export_layer
from anelab.sidecar.format import read_sidecar_metadata
from anelab.sidecar.mil.evaluate import SavedPackage, evaluate_with_state, new_state
from anelab.sidecar.prompt import stateful_mask

PROBE_CHUNK, PROBE_CAPACITY, PROBE_HIDDEN = 2, 4, 32
STABLE_PREDICTS = 200  # apple/coremltools#2716: a crash after ~100-200 sequential stateful predicts
COLD_OVER_WARM = 1.5  # a fresh copy's load must take at least this many times a reload's to count as cold
MATCH = 1e-2  # relative error allowed between Core ML and the saved program in NumPy (fp16 noise; verify's threshold)
CONTROL = 10 * MATCH  # a negative control must differ by at least this much, or the comparison proves nothing
PROBE_CHILD_TIMEOUT_S = 900.0
LOG_MARKER = "anelab-probe: unified-log marker of pid"
CORE_ML_LOG_WORDS = ("coreml", "espresso", "e5rt", "ane", "anec", "aned", "anecompilerservice")  # Core ML's lines
CORE_ML_LOG_WORD = re.compile(r"\b(?:" + "|".join(CORE_ML_LOG_WORDS) + r")\b", re.IGNORECASE)  # words, not substrings


@dataclass(frozen=True)
class ProbePackages:
    """The probe's tiny packages (paths)."""

    stateful: str  # c2 [2, 32] and c1 [1, 32] sharing k_cache / v_cache [1, 4, 16]
    palettized: str  # the same, weights palettize4
    merged: str  # dense h0 + h2 (chunk 2)
    variant: str  # dense h0 alone: the single-function variant the gate would have checked


def build_probe_packages(work: Path) -> ProbePackages:
    """Export the probe's packages into ``work`` (about 8 s here; no Core ML needed)."""

    geometry = AttentionGeometry(
        variant="llama", hidden_size=PROBE_HIDDEN, num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=10000.0,
        num_layers=1, full_attention_layers=(0,),
    )  # fmt: skip
    weights = {0: random_attention_weights(geometry, 0, 7)}
    ckpt = load_checkpoint(write_checkpoint(work / "checkpoint", geometry, weights, dtype="F32", shards=1,
                                            model_type="llama"))  # fmt: skip
    stateful = dict(graph=STATEFUL, capacity=PROBE_CAPACITY, decode=True)
    return ProbePackages(
        stateful=str(export_layer(ckpt, 0, PROBE_CHUNK, None, work / "with-state", **stateful).package),
        palettized=str(
            export_layer(ckpt, 0, PROBE_CHUNK, None, work / "palettized", weights_mode="palettize4", **stateful).package
        ),  # fmt: skip
        merged=str(export_layer(ckpt, 0, PROBE_CHUNK, [0, PROBE_CHUNK], work / "merged").package),
        variant=str(export_layer(ckpt, 0, PROBE_CHUNK, [0], work / "variant").package),
    )


def build_probe_package(work: Path) -> Path:
    """The stateful probe package alone (what earlier callers built)."""
    return Path(build_probe_packages(work).stateful)


def _relative(actual, expected) -> float:

    return relative_error(np.asarray(actual, np.float64), np.asarray(expected, np.float64))


class _Probe:
    """One child's context: the runtime, the packages, the setting, and what earlier checks produced."""

    def __init__(self, runtime: CoreMLRuntime, packages: ProbePackages, units: str, work: Path):

        self.runtime, self.packages, self.units, self.work = runtime, packages, units, work
        self.saved = SavedPackage(packages.stateful)
        self.compiled: Path | None = None
        self.handles: dict = {}
        self.state = None
        self.numpy_state: dict | None = None
        self.outputs: dict = {}

    def inputs(self, function: str, start: int, seed: int) -> dict:
        """fp16 hidden / mask and the int32 start of ``function`` at ``start`` (as the sidecar declares them)."""

        sig = self.runtime.signature(self.packages.stateful, function)
        given = zero_inputs(sig)
        rows = sig.inputs["hidden"][0][0]
        given["hidden"] = (np.random.default_rng(seed).standard_normal(given["hidden"].shape) * 0.5).astype(np.float16)
        given["start"] = np.array([start], np.int32)
        given["mask"] = stateful_mask(rows, start, PROBE_CAPACITY).astype(np.float16)
        return given

    def numpy(self, function: str, inputs: dict, state: dict) -> dict:
        """The saved program's outputs in NumPy (``state`` updated in place, as an MLState is)."""

        return evaluate_with_state(self.saved, function, {k: np.asarray(v) for k, v in inputs.items()}, state)

    def fresh_numpy_state(self) -> dict:

        return new_state(self.saved, f"c{PROBE_CHUNK}")


# ---- the checks (each returns what it saw; raises when the assumption does not hold) -------------------
def _compile(p: _Probe) -> str:
    dest = p.work / f"copy-{p.units}" / "probe.mlmodelc"
    dest.parent.mkdir(parents=True, exist_ok=True)
    p.compiled = Path(p.runtime.compile_to(Path(p.packages.stateful), dest))
    if p.compiled.suffix != ".mlmodelc" or not p.compiled.is_dir():
        raise AssertionError(f"compile_model returned {p.compiled}, not a .mlmodelc directory")
    return f"compiled {Path(p.packages.stateful).name} -> {p.compiled.name}"


def _load_by_name(p: _Probe) -> str:
    for function in (f"c{PROBE_CHUNK}", "c1"):
        p.handles[function] = p.runtime.load_path(p.compiled, function, p.units)
    try:  # negative control: a name the package lacks must be refused, not served by the default function
        p.runtime.load_path(p.compiled, "no_such_function", p.units)
    except RuntimeLoadError:
        return f"loaded c{PROBE_CHUNK} and c1 by name from one compiled copy; an unknown name was refused"
    raise AssertionError("a function name the package lacks loaded anyway (the default function served it?)")


def _compute_plan(p: _Probe) -> str:
    counts = p.runtime.plan_path(p.compiled, p.units)
    if int(counts["total"]) <= 0:
        raise AssertionError("the compute plan of the compiled copy lists no operation on any device")
    return f"{counts['total']} operations planned ({counts['neural_engine']} prefer the Neural Engine)"


def _probe_on_ane(p: _Probe) -> str:
    """The ANE child's verdicts are the Neural Engine's only if its tiny graphs run there: the plan of the stateful
    probe package must put operations, and its matmuls and softmax, on the Neural Engine."""
    counts = p.runtime.plan_path(p.compiled, p.units, function=f"c{PROBE_CHUNK}")
    if int(counts["neural_engine"]) <= 0 or int(counts.get("compute_ops_on_neural_engine", 0)) <= 0:
        raise AssertionError(
            f"the probe's c{PROBE_CHUNK} has {counts['neural_engine']} of {counts['total']} operations and "
            f"{counts.get('compute_ops_on_neural_engine', 0)} of {counts.get('compute_ops', 0)} compute operations on "
            "the Neural Engine: every cpu_and_ne verdict here would be the CPU's"
        )
    return (
        f"{counts['neural_engine']} of {counts['total']} operations, {counts['compute_ops_on_neural_engine']} of "
        f"{counts['compute_ops']} compute operations on the Neural Engine"
    )


def _ungated_survive(p: _Probe) -> str:
    return "this child loaded and planned an ungated package under cpu_and_ne before any predict, and lives"


def _load_duration(p: _Probe) -> str:
    value = p.runtime.load_duration_s(p.handles[f"c{PROBE_CHUNK}"])
    if value is None or not value > 0:
        raise AssertionError(f"the load duration is {value!r}")
    return f"Core ML load duration {value * 1e3:.1f} ms"


def _state_by_name(p: _Probe) -> str:
    p.state = p.runtime.make_state(p.handles[f"c{PROBE_CHUNK}"])
    before = np.asarray(p.state.read_state("k_cache"))
    if before.shape != (1, PROBE_CAPACITY, 16):
        raise AssertionError(f"read_state('k_cache') has shape {before.shape}, expected (1, {PROBE_CAPACITY}, 16)")
    try:
        p.state.read_state("no_such_state")
    except Exception:  # noqa: BLE001 - any refusal is the documented behaviour (RuntimeError)
        return "make_state() gave a state; read_state('k_cache') read it; an unknown name was refused"
    raise AssertionError("read_state of an unknown name returned instead of raising")


def _fresh_state_zeroed(p: _Probe) -> str:
    nonzero = {name: int(np.count_nonzero(p.state.read_state(name))) for name in ("k_cache", "v_cache")}
    if any(nonzero.values()):
        raise AssertionError(f"a fresh state holds non-zero values: {nonzero}")
    return "a fresh state read back as zeros (k_cache, v_cache)"


def _predict_fp32_for_fp16(p: _Probe) -> str:
    function = f"c{PROBE_CHUNK}"
    given = p.inputs(function, 0, seed=1)
    p.outputs = p.runtime.predict(p.handles[function], prepare_inputs(given), state=p.state)
    p.numpy_state = p.fresh_numpy_state()
    expected = p.numpy(function, given, p.numpy_state)["attn_out"]
    other = p.numpy(function, p.inputs(function, 0, seed=9), p.fresh_numpy_state())["attn_out"]  # control
    error, control = _relative(p.outputs["attn_out"], expected), _relative(other, expected)
    if np.shape(p.outputs["attn_out"]) != (PROBE_CHUNK, PROBE_HIDDEN) or not error < MATCH or not control > CONTROL:
        raise AssertionError(
            f"{function} from fp32 arrays: attn_out {list(np.shape(p.outputs['attn_out']))} off the saved program "
            f"by {error:.2e} (allowed {MATCH:.0e}); control {control:.2e} (needs > {CONTROL:.0e})"
        )
    return f"{function} from fp32 arrays matches the saved program within {error:.1e} (control {control:.1e})"


def _fp16_outputs_as_fp32(p: _Probe) -> str:
    dtype = np.asarray(p.outputs["attn_out"]).dtype
    if dtype != np.float32:
        raise AssertionError(f"attn_out (fp16 in the program) came back as {dtype}, not float32")
    return "attn_out (fp16 in the program) came back as float32"


def _predict_duration(p: _Probe) -> str:
    value = p.runtime.predict_duration_s(p.handles[f"c{PROBE_CHUNK}"])
    if value is None or not value > 0:
        raise AssertionError(f"the last predict duration is {value!r}")
    return f"Core ML predict duration {value * 1e3:.2f} ms"


def _int32_reaches_graph(p: _Probe) -> str:
    """start = 2 (int32) on a fresh state must write slots 2..3 and leave 0..1 empty (start 0 wrote 0..1)."""
    function = f"c{PROBE_CHUNK}"
    state = p.runtime.make_state(p.handles[function])
    p.runtime.predict(p.handles[function], prepare_inputs(p.inputs(function, PROBE_CHUNK, seed=3)), state=state)
    written = np.abs(np.asarray(state.read_state("k_cache"))[0]).sum(axis=-1) > 0
    first = np.abs(np.asarray(p.state.read_state("k_cache"))[0]).sum(axis=-1) > 0
    if list(written) != [False, False, True, True] or list(first[:PROBE_CHUNK]) != [True, True]:
        raise AssertionError(f"an int32 start of {PROBE_CHUNK} wrote slots {np.flatnonzero(written).tolist()}")
    return f"an int32 start of {PROBE_CHUNK} wrote slots 2..3 (start 0 wrote 0..1)"


def _int64_refused(p: _Probe) -> str:
    function = f"c{PROBE_CHUNK}"
    ready = prepare_inputs(p.inputs(function, 0, seed=1))
    ready["start"] = ready["start"].astype(np.int64)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # coremltools prints the refused value first
            p.runtime.predict(p.handles[function], ready, state=p.runtime.make_state(p.handles[function]))
    except RuntimePredictError as e:
        return f"an int64 start was refused ({' '.join(str(e).split())[:80]})"
    raise AssertionError("an int64 array was accepted (the fake runtime's dtype rule is stricter than this Mac)")


def _read_only_refused(p: _Probe) -> str:
    function = f"c{PROBE_CHUNK}"
    refused = []
    for name in ("hidden", "start"):  # fp32 and int32
        ready = prepare_inputs(p.inputs(function, 0, seed=1))
        ready[name].flags.writeable = False
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                p.runtime.predict(p.handles[function], ready, state=p.runtime.make_state(p.handles[function]))
        except RuntimePredictError:
            refused.append(f"{name} ({ready[name].dtype})")
    if len(refused) != 2:
        raise AssertionError(f"read-only arrays refused: {refused or 'none'}; fp32 hidden and int32 start expected")
    return f"read-only arrays refused: {', '.join(refused)}"


def _state_shared(p: _Probe) -> str:
    """c1's output on the state c2 filled must match the saved program after the same prefill (and differ from
    c1 on an empty cache: the control that the prefill's K/V matter)."""
    given = p.inputs("c1", PROBE_CHUNK, seed=2)
    out = p.runtime.predict(p.handles["c1"], prepare_inputs(given), state=p.state)["attn_out"]
    expected = p.numpy("c1", given, p.numpy_state)["attn_out"]
    empty = p.numpy("c1", given, p.fresh_numpy_state())["attn_out"]
    error, control = _relative(out, expected), _relative(empty, expected)
    if not error < MATCH or not control > CONTROL:
        raise AssertionError(
            f"c1 on the state c{PROBE_CHUNK} filled is off the saved program by {error:.2e} (allowed {MATCH:.0e}); "
            f"control (c1 on an empty cache) {control:.2e}"
        )
    return (
        f"c1 on c{PROBE_CHUNK}'s state matches the saved program within {error:.1e} (empty-cache control {control:.1e})"
    )


def _fresh_copy_cold(p: _Probe) -> str:
    function = f"c{PROBE_CHUNK}"
    again = p.runtime.load_path(p.compiled, function, p.units)  # the copy this child loaded before: warm
    warm = p.runtime.load_duration_s(again)
    dest = p.work / f"fresh-{p.units}" / "probe.mlmodelc"
    dest.parent.mkdir(parents=True)
    cold = p.runtime.load_duration_s(p.runtime.load_path(p.runtime.compile_to(Path(p.packages.stateful), dest),
                                                         function, p.units))  # fmt: skip
    if warm is None or cold is None or not cold >= COLD_OVER_WARM * warm:
        raise AssertionError(f"a fresh copy loaded in {cold!r} s, a reload in {warm!r} s: the fresh copy was not cold")
    return f"a fresh copy loaded in {cold * 1e3:.1f} ms, a reload in {warm * 1e3:.1f} ms"


def _merged_like_variant(p: _Probe) -> str:

    compiled = {}
    for kind in ("variant", "merged"):
        dest = p.work / f"{kind}-{p.units}" / f"{kind}.mlmodelc"
        dest.parent.mkdir(parents=True)
        compiled[kind] = p.runtime.compile_to(Path(getattr(p.packages, kind)), dest)
    # h0's own operations: a plan of the merged package may list h2's too (counted apart, as the gate's variant is)
    plans = {kind: p.runtime.plan_path(path, p.units, function="h0" if kind == "merged" else None)
             for kind, path in compiled.items()}  # fmt: skip
    geometry = AttentionGeometry.from_dict(read_sidecar_metadata(p.packages.variant).geometry)
    given = prepare_inputs(block_inputs(geometry, PROBE_CHUNK, 0, seed=5))
    outs = {kind: p.runtime.predict(p.runtime.load_path(path, "h0", p.units), dict(given))["attn_out"]
            for kind, path in compiled.items()}  # fmt: skip
    error = _relative(outs["merged"], outs["variant"])
    if plans["merged"]["neural_engine"] != plans["variant"]["neural_engine"] or not error < MATCH:
        raise AssertionError(
            f"h0 of the merged package: {plans['merged']['neural_engine']} ops on the Neural Engine vs "
            f"{plans['variant']['neural_engine']} for its variant; outputs differ by {error:.2e}"
        )
    return f"h0 merged and alone: {plans['merged']['neural_engine']} ANE ops each, outputs within {error:.1e}"


def _stateful_stable(p: _Probe) -> str:
    function = f"c{PROBE_CHUNK}"
    compiled = p.runtime.compile_to(Path(p.packages.palettized), p.work / f"palettized-{p.units}" / "p.mlmodelc")
    handle = p.runtime.load_path(compiled, function, p.units)
    state = p.runtime.make_state(handle)
    given = prepare_inputs(p.inputs(function, 0, seed=1))
    first = None
    for i in range(STABLE_PREDICTS):  # the same prefill chunk again and again: slots 0..1 rewritten with the same K/V
        out = np.asarray(p.runtime.predict(handle, dict(given), state=state)["attn_out"])
        first = out if first is None else first
        if not np.all(np.isfinite(out)) or _relative(out, first) > MATCH:
            raise AssertionError(f"predict {i + 1} of {STABLE_PREDICTS} gave a different output than the first")
    return f"{STABLE_PREDICTS} sequential stateful predicts of the palettize4 {function}: no crash, the same output"


def _native_output(p: _Probe) -> str:
    with p.runtime.capture_native_output() as out:
        os.write(1, b"anelab-probe fd 1\n")
        os.write(2, b"anelab-probe fd 2\n")
        with contextlib.suppress(Exception):  # C stdio, flushed by the capture
            ctypes.CDLL(None).printf(b"anelab-probe stdio\n")
    missing = [
        what
        for what, text, seen in (
            ("fd 1", "anelab-probe fd 1", out.stdout),
            ("fd 2", "anelab-probe fd 2", out.stderr),
            ("C stdio", "anelab-probe stdio", out.stdout),
        )
        if text not in seen
    ]
    if missing:
        raise AssertionError(f"not captured: {', '.join(missing)}")
    return "writes to fd 1, fd 2 and C stdio were captured"


# (assumption, check, assumptions it needs to have passed first in the same child), in the order a child runs them:
# loads and the compute plan before the first predict (ungated_load_and_plan_survive is judged there)
CHECKS: tuple[tuple[str, Callable[[_Probe], str], tuple[str, ...]], ...] = (
    (a.COMPILE_TO_MLMODELC, _compile, ()),
    (a.NATIVE_OUTPUT_ON_FDS, _native_output, ()),
    (a.LOAD_FUNCTION_BY_NAME, _load_by_name, (a.COMPILE_TO_MLMODELC,)),
    (a.COMPUTE_PLAN_OF_COMPILED, _compute_plan, (a.COMPILE_TO_MLMODELC,)),
    (a.PROBE_ON_ANE, _probe_on_ane, (a.COMPUTE_PLAN_OF_COMPILED,)),
    (a.UNGATED_LOAD_AND_PLAN_SURVIVE, _ungated_survive, (a.LOAD_FUNCTION_BY_NAME,)),
    (a.CORE_ML_LOAD_DURATION, _load_duration, (a.LOAD_FUNCTION_BY_NAME,)),
    (a.STATE_BY_NAME, _state_by_name, (a.LOAD_FUNCTION_BY_NAME,)),
    (a.FRESH_STATE_ZEROED, _fresh_state_zeroed, (a.STATE_BY_NAME,)),
    (a.FP32_FEEDS_FP16_INPUTS, _predict_fp32_for_fp16, (a.STATE_BY_NAME,)),
    (a.FP16_OUTPUTS_AS_FP32, _fp16_outputs_as_fp32, (a.FP32_FEEDS_FP16_INPUTS,)),
    (a.CORE_ML_PREDICT_DURATION, _predict_duration, (a.FP32_FEEDS_FP16_INPUTS,)),
    (a.INT32_INPUTS_ACCEPTED, _int32_reaches_graph, (a.FP32_FEEDS_FP16_INPUTS,)),
    (a.UNSUPPORTED_DTYPE_REFUSED, _int64_refused, (a.STATE_BY_NAME,)),
    (a.READ_ONLY_REFUSED, _read_only_refused, (a.STATE_BY_NAME,)),
    (a.STATE_SHARED_BY_FUNCTIONS, _state_shared, (a.FP32_FEEDS_FP16_INPUTS,)),
    (a.FRESH_COPY_COMPILES_COLD, _fresh_copy_cold, (a.CORE_ML_LOAD_DURATION,)),
    (a.MERGED_LIKE_VARIANT, _merged_like_variant, (a.COMPUTE_PLAN_OF_COMPILED, a.FP32_FEEDS_FP16_INPUTS)),
    (a.STATEFUL_PREDICTS_STABLE, _stateful_stable, (a.FP32_FEEDS_FP16_INPUTS,)),
)
PARENT_ROWS = (a.UNIFIED_LOG_READABLE, a.CORE_ML_LOGS_FOR_CLIENT)  # judged from the exited ANE child's log
ANE_CHILD = "cpu_and_ne"  # the child that also runs the rows taking no compute units


def _runs_in(name: str, units: str) -> bool:
    declared = a.assumption(name).compute_units
    return units == ANE_CHILD if a.ANY_UNITS in declared else units in declared


def _setting_key(name: str, units: str) -> str:
    return a.ANY_UNITS if a.ANY_UNITS in a.assumption(name).compute_units else units


# ---- the child process -----------------------------------------------------------------------------
def probe_child_main() -> None:
    """Entry point of a probe child: JSON request on stdin; one JSON line per event appended to its result file."""
    request = json.loads(sys.stdin.read())
    runtime = runtime_from_spec(request["runtime"])
    units, result = request["compute_units"], Path(request["result"])

    def record(name, what, value=None):
        with open(result, "a") as f:
            f.write(json.dumps({"name": name, "what": what, "value": value}) + "\n")

    if units == ANE_CHILD:
        runtime.write_log_marker(f"{LOG_MARKER} {os.getpid()}")
    probe = _Probe(runtime, ProbePackages(**request["packages"]), units, Path(request["work"]))
    passed: set[str] = set()
    if units != ANE_CHILD:  # the compile row is judged in the ANE child; here it is only this child's setup
        with contextlib.suppress(Exception):
            _compile(probe)
            passed.add(a.COMPILE_TO_MLMODELC)
    on_ane_first = False  # in the ANE child, every check after the placement row needs it (else it judged the CPU)
    for name, check, needs in CHECKS:
        if not _runs_in(name, units):
            continue
        needs = (*needs, a.PROBE_ON_ANE) if on_ane_first else needs
        on_ane_first = on_ane_first or name == a.PROBE_ON_ANE
        missing = [n for n in needs if n not in passed]
        if missing:
            record(name, "verdict", {"passed": False, "detail": f"not run: it needs {', '.join(missing)}"})
            continue
        record(name, "started")
        try:
            verdict = {"passed": True, "detail": check(probe)}
            passed.add(name)
        except Exception as e:  # noqa: BLE001 - every failure is this assumption's verdict
            verdict = {"passed": False, "detail": f"{type(e).__name__}: {' '.join(str(e).split())[:240]}"}
        record(name, "verdict", verdict)


def _run_probe_child(runtime: CoreMLRuntime, packages: ProbePackages, units: str, work: Path) -> ChildRun:
    result = work / f"probe-{units}.jsonl"
    request = {"runtime": spec_for_child(runtime, cache_dir=work / f"compiled-{units}", judging=True),
               "packages": asdict(packages), "compute_units": units, "result": str(result), "work": str(work)}  # fmt: skip
    run = run_child("anelab.runtimes.coreml.probe:probe_child_main", request, PROBE_CHILD_TIMEOUT_S)
    run.events = [json.loads(line) for line in result.read_text().splitlines()] if result.is_file() else []
    return run


def _verdicts_of(run: ChildRun, units: str) -> dict[str, dict]:
    """Each row's verdict from one child's events; a row it was running or never reached when it died fails."""
    out: dict[str, dict] = {}
    running = None
    for e in run.events:
        if e["what"] == "started":
            running = e["name"]
        elif e["what"] == "verdict":
            out[e["name"]] = e["value"]
            running = None if running == e["name"] else running
    ended = describe_child_exit(run.returncode, "did not finish in time")
    for name, _, _ in CHECKS:
        if not _runs_in(name, units) or name in out:
            continue
        if name == running:
            out[name] = {
                "passed": False,
                "detail": f"the probe child {ended} during this check ({run.stderr_tail()!r})",
            }
        else:
            out[name] = {
                "passed": False,
                "detail": f"not run: the probe child {ended} before it ({running or 'start'})",
            }
    return out


def core_ml_log_lines(text: str) -> tuple[list[str], list[str]]:
    """(Core ML's lines, the redacted ones among them) in unified-log text: lines naming one of
    ``CORE_ML_LOG_WORDS`` as a word ("plane" is not "ane"), the probe's own marker left out."""
    lines = [line for line in text.splitlines() if LOG_MARKER not in line and CORE_ML_LOG_WORD.search(line)]
    return lines, [line for line in lines if "<private>" in line]


def _log_rows(runtime: CoreMLRuntime, run: ChildRun) -> dict[str, dict]:
    """The unified log of the exited ANE child and of the Neural Engine's helper processes over its lifetime: its own
    marker (unredacted) and Core ML's lines, counted. One clear Core ML line is enough: Apple's frameworks log their
    arguments as <private> by default and info lines are often not persisted."""
    try:
        text = runtime.read_unified_log(run.pid, run.start, run.end, helpers=CORE_ML_HELPERS)
    except UnifiedLogUnavailable as e:
        failed = {"passed": False, "detail": f"'log show' failed after the child exited: {e}"}
        return {a.UNIFIED_LOG_READABLE: failed, a.CORE_ML_LOGS_FOR_CLIENT: {**failed, "detail": "not run: no log"}}
    lines = text.splitlines()
    marker = [line for line in lines if f"{LOG_MARKER} {run.pid}" in line]
    core_ml, redacted = core_ml_log_lines(text)
    readable = {"passed": bool(marker),
                "detail": f"{len(marker)} marker line(s) of the exited child read back for pid {run.pid} "
                          f"({len(lines)} lines, {sum('<private>' in line for line in lines)} redacted)"}  # fmt: skip
    clear = len(core_ml) - len(redacted)
    client = {"passed": clear > 0,
              "detail": f"{len(core_ml)} Core ML line(s) for the child's pid and {', '.join(CORE_ML_HELPERS)} during its "
                        f"cpu_and_ne loads and predicts, {len(redacted)} redacted"
                        + ("" if clear else " (none readable: the gate records a caveat instead of reading them)")}  # fmt: skip
    return {a.UNIFIED_LOG_READABLE: readable, a.CORE_ML_LOGS_FOR_CLIENT: client}


def _table(per_units: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """One row per assumption: its verdict per setting, passed only when every setting passed."""
    table = {}
    for entry in a.ASSUMPTIONS:
        units = per_units.get(entry.name, {})
        failed = [f"{u}: {v['detail']}" for u, v in units.items() if not v["passed"]]
        detail = "; ".join(failed) if failed else "; ".join(f"{u}: {v['detail']}" for u, v in units.items())
        table[entry.name] = {
            "passed": bool(units) and not failed, "detail": detail or "not run", "units": units,
            "behaviour": entry.behaviour, "source": entry.source, "compute_units": list(entry.compute_units),
        }  # fmt: skip
    return table


def probe_core_ml(
    runtime: CoreMLRuntime,
    out_dir: str | os.PathLike | None = None,
    *,
    package: ProbePackages | str | os.PathLike | None = None,
    reason: str = "",
) -> dict:
    """Run every row in children (one per setting of ``PROBE_UNITS``); record and return the verdicts (kind
    ``core_ml_probe``, stamped with ``runtime.versions()``) and make them this Mac's (``runtime.probe_file``).

    Refuses (one line) where the Core ML runtime is not available. ``package``: already built
    ``build_probe_packages`` (default: built afresh here, about 8 s). ``reason``: why it ran (first contact).
    """
    if not runtime.available():
        raise AnelabInputError(f"anelab doctor --probe needs a Mac: {runtime.unavailable_reason()}")
    per_units: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="anelab-probe-") as work:
        work = Path(work)
        packages = package if isinstance(package, ProbePackages) else build_probe_packages(work / "packages")
        for units in a.PROBE_UNITS:
            run = _run_probe_child(runtime, packages, units, work)
            rows = _verdicts_of(run, units)
            if units == ANE_CHILD:
                rows.update(_log_rows(runtime, run))
            for name, verdict in rows.items():
                per_units.setdefault(name, {})[_setting_key(name, units)] = verdict
    table = _table(per_units)
    parameters = {"runtime": runtime.name, "compute_units": list(a.PROBE_UNITS), "in": "one child process per setting",
                  "packages": "tiny stateful c2 + c1 (fp16 and palettize4, capacity 4); dense h0 + h2 and its h0 variant",
                  "reason": reason or "asked for"}  # fmt: skip
    failed = [name for name, v in table.items() if not v["passed"]]
    record = make_record("core_ml_probe", parameters, {"assumptions": table, "failed": failed,
                                                       "versions": runtime.versions()}, origin="measured")  # fmt: skip
    write_verdicts(runtime, table, record["provenance"]["date"])
    if out_dir is not None:
        record = {**record, "_file": write_record(out_dir, record).name}
    return record


def write_verdicts(runtime: CoreMLRuntime, table: dict, date: str) -> None:
    """Make ``table`` this Mac's verdicts (``runtime.probe_file``, atomically), stamped with its versions."""
    path = runtime.probe_file
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump({"assumptions": table, "versions": runtime.versions(), "date": date}, f, indent=1)
    os.replace(tmp, path)
    runtime.forget_verdicts()


def format_probe(record: dict) -> str:
    """The assumption table ``anelab doctor --probe`` prints: one row per assumption and setting, then its source."""
    table = record["results"]["assumptions"]
    width = max(len(name) for name in table)
    versions = record["results"].get("versions", {})
    lines = [f"Core ML assumptions probed in child processes ({', '.join(f'{k} {v}' for k, v in versions.items())}):"]
    for name, verdict in table.items():
        for units, v in verdict["units"].items() or [("-", verdict)]:
            lines.append(f"  {'passed' if v['passed'] else 'FAILED'}  {name:<{width}}  {units:<11}  {v['detail']}")
        lines.append(f"          {'':<{width}}  {'':<11}  source: {verdict['source']}")
    failed = record["results"]["failed"]
    lines.append(
        f"{len(table) - len(failed)} of {len(table)} passed"
        + (f"; code relying on {', '.join(failed)} refuses naming it" if failed else "")
    )
    return "\n".join(lines)
