"""``anelab doctor --probe``: exercise, on a tiny package, every Core ML behaviour anelab relies on.

The package is a tiny stateful sidecar with decode (functions ``c2`` and ``c1`` over one 4-slot K/V
state), exported here by anelab's own exporter. Each assumption of ``anelab.runtimes.assumptions``
is checked by name and recorded passed / failed with what was seen; the verdicts are written beside
the compiled-copy cache (``CoreMLRuntime.probe_file``) so that code relying on a failed assumption
refuses naming it. Predicts run under ``cpu_only`` (the probe package never passed the ANE gate, so
nothing is predicted on the Neural Engine in this process); the compute plan asks for ``cpu_and_ne``.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.records import make_record, write_record
from anelab.runtimes import assumptions as a
from anelab.runtimes.interface import CoreMLRuntime, RuntimePredictError, prepare_inputs, zero_inputs

PROBE_UNITS = "cpu_only"  # predicts of the ungated probe package stay off the Neural Engine in this process
PROBE_PLAN_UNITS = "cpu_and_ne"
PROBE_CHUNK, PROBE_CAPACITY = 2, 4


def build_probe_package(work: Path) -> Path:
    """A tiny stateful sidecar with decode: c2 [2, 32] and c1 [1, 32] sharing k_cache / v_cache [1, 4, 16]."""
    from anelab.checkpoints.checkpoint import load_checkpoint, write_checkpoint
    from anelab.core.geometry import AttentionGeometry
    from anelab.core.weights import random_attention_weights
    from anelab.sidecar.designs import STATEFUL
    from anelab.sidecar.export import export_layer

    geometry = AttentionGeometry(
        variant="llama", hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=10000.0,
        num_layers=1, full_attention_layers=(0,),
    )  # fmt: skip
    weights = {0: random_attention_weights(geometry, 0, 7)}
    checkpoint = write_checkpoint(work / "checkpoint", geometry, weights, dtype="F32", shards=1, model_type="llama")
    result = export_layer(
        load_checkpoint(checkpoint), 0, PROBE_CHUNK, None, work / "sidecar", graph=STATEFUL,
        capacity=PROBE_CAPACITY, decode=True,
    )  # fmt: skip
    return Path(result.package)


class _Probe:
    """The probe's shared context: the runtime, the package, and what earlier checks produced."""

    def __init__(self, runtime: CoreMLRuntime, package: Path, work: Path):
        self.runtime, self.package, self.work = runtime, package, work
        self.compiled: Path | None = None
        self.handles: dict = {}
        self.state = None
        self.outputs: dict = {}
        self.k_after_prefill: np.ndarray | None = None

    def inputs(self, function: str, start: int, seed: int) -> dict:
        from anelab.sidecar.prompt import stateful_mask

        sig = self.runtime.signature(self.package, function)
        given = zero_inputs(sig)  # fp16 hidden / mask, int32 start, as the sidecar declares them
        rows = sig.inputs["hidden"][0][0]
        given["hidden"] = (np.random.default_rng(seed).standard_normal(given["hidden"].shape) * 0.5).astype(np.float16)
        given["start"] = np.array([start], np.int32)
        given["mask"] = stateful_mask(rows, start, PROBE_CAPACITY).astype(np.float16)
        return given


# ---- the checks (each returns what it saw; raises when the assumption does not hold) -------------------
def _compile(p: _Probe) -> str:
    dest = p.work / "copy" / "probe.mlmodelc"
    dest.parent.mkdir(parents=True, exist_ok=True)
    p.compiled = Path(p.runtime.compile_to(p.package, dest))
    if p.compiled.suffix != ".mlmodelc" or not p.compiled.is_dir():
        raise AssertionError(f"compile_model returned {p.compiled}, not a .mlmodelc directory")
    return f"compiled {p.package.name} -> {p.compiled.name}"


def _load_by_name(p: _Probe) -> str:
    for function in (f"c{PROBE_CHUNK}", "c1"):
        p.handles[function] = p.runtime.load_path(p.compiled, function, PROBE_UNITS)
    return f"loaded c{PROBE_CHUNK} and c1 by name from one compiled copy ({PROBE_UNITS})"


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


def _predict_fp32_for_fp16(p: _Probe) -> str:
    function = f"c{PROBE_CHUNK}"
    ready = prepare_inputs(p.inputs(function, 0, seed=1))  # fp16 -> fp32, int32 start kept
    p.outputs = p.runtime.predict(p.handles[function], ready, state=p.state)
    p.k_after_prefill = np.asarray(p.state.read_state("k_cache")).copy()
    shape = tuple(np.shape(p.outputs["attn_out"]))
    if shape != (PROBE_CHUNK, 32):
        raise AssertionError(f"attn_out has shape {shape}, expected ({PROBE_CHUNK}, 32)")
    return f"{function} predicted from fp32 arrays for its fp16 inputs (attn_out {list(shape)})"


def _int32_accepted(p: _Probe) -> str:
    return "the int32 start [1] of that predict was accepted"


def _fp16_outputs_as_fp32(p: _Probe) -> str:
    dtype = np.asarray(p.outputs["attn_out"]).dtype
    if dtype != np.float32:
        raise AssertionError(f"attn_out (fp16 in the program) came back as {dtype}, not float32")
    return "attn_out (fp16 in the program) came back as float32"


def _int64_refused(p: _Probe) -> str:
    function = f"c{PROBE_CHUNK}"
    ready = prepare_inputs(p.inputs(function, 0, seed=1))
    ready["start"] = ready["start"].astype(np.int64)
    state = p.runtime.make_state(p.handles[function])
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # coremltools prints the refused value first
            p.runtime.predict(p.handles[function], ready, state=state)
    except RuntimePredictError as e:
        return f"an int64 start was refused ({' '.join(str(e).split())[:80]})"
    raise AssertionError("an int64 array was accepted (the fake runtime's dtype rule is stricter than this Mac)")


def _state_shared(p: _Probe) -> str:
    p.runtime.predict(p.handles["c1"], prepare_inputs(p.inputs("c1", PROBE_CHUNK, seed=2)), state=p.state)
    after = np.asarray(p.state.read_state("k_cache"))
    kept = np.array_equal(after[:, :PROBE_CHUNK], p.k_after_prefill[:, :PROBE_CHUNK])
    wrote = np.any(after[:, PROBE_CHUNK] != 0) and not np.any(p.k_after_prefill[:, PROBE_CHUNK] != 0)
    if not (kept and wrote and np.any(p.k_after_prefill[:, :PROBE_CHUNK] != 0)):
        raise AssertionError(
            f"after c{PROBE_CHUNK} then c1 on one state: prefill rows kept {bool(kept)}, decode row written {bool(wrote)}"
        )
    return f"c1's handle read c{PROBE_CHUNK}'s K/V from the shared state and wrote slot {PROBE_CHUNK}"


def _compute_plan(p: _Probe) -> str:
    counts = p.runtime.plan_path(p.compiled, PROBE_PLAN_UNITS)
    if int(counts["total"]) <= 0:
        raise AssertionError("the compute plan of the compiled copy lists no operation on any device")
    return f"{counts['total']} operations planned ({counts['neural_engine']} prefer the Neural Engine)"


def _load_duration(p: _Probe) -> str:
    value = p.runtime.load_duration_s(p.handles[f"c{PROBE_CHUNK}"])
    if value is None or not value > 0:
        raise AssertionError(f"the load duration is {value!r}")
    return f"Core ML load duration {value * 1e3:.1f} ms"


def _predict_duration(p: _Probe) -> str:
    value = p.runtime.predict_duration_s(p.handles[f"c{PROBE_CHUNK}"])
    if value is None or not value > 0:
        raise AssertionError(f"the last predict duration is {value!r}")
    return f"Core ML predict duration {value * 1e3:.2f} ms"


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


def _unified_log(p: _Probe) -> str:
    now = time.time()
    text = p.runtime.read_unified_log(os.getpid(), now - 5, now)
    return f"'log show' answered ({len(text.splitlines())} lines for this process)"


# (assumption, check, assumptions it needs to have passed first), in the order they run
CHECKS: tuple[tuple[str, Callable[[_Probe], str], tuple[str, ...]], ...] = (
    (a.COMPILE_TO_MLMODELC, _compile, ()),
    (a.LOAD_FUNCTION_BY_NAME, _load_by_name, (a.COMPILE_TO_MLMODELC,)),
    (a.STATE_BY_NAME, _state_by_name, (a.LOAD_FUNCTION_BY_NAME,)),
    (a.FP32_FEEDS_FP16_INPUTS, _predict_fp32_for_fp16, (a.STATE_BY_NAME,)),
    (a.INT32_INPUTS_ACCEPTED, _int32_accepted, (a.FP32_FEEDS_FP16_INPUTS,)),
    (a.FP16_OUTPUTS_AS_FP32, _fp16_outputs_as_fp32, (a.FP32_FEEDS_FP16_INPUTS,)),
    (a.UNSUPPORTED_DTYPE_REFUSED, _int64_refused, (a.STATE_BY_NAME,)),
    (a.STATE_SHARED_BY_FUNCTIONS, _state_shared, (a.FP32_FEEDS_FP16_INPUTS,)),
    (a.COMPUTE_PLAN_OF_COMPILED, _compute_plan, (a.COMPILE_TO_MLMODELC,)),
    (a.CORE_ML_LOAD_DURATION, _load_duration, (a.LOAD_FUNCTION_BY_NAME,)),
    (a.CORE_ML_PREDICT_DURATION, _predict_duration, (a.FP32_FEEDS_FP16_INPUTS,)),
    (a.NATIVE_OUTPUT_ON_FDS, _native_output, ()),
    (a.UNIFIED_LOG_READABLE, _unified_log, ()),
)


def _run_checks(probe: _Probe) -> dict[str, dict]:
    verdicts: dict[str, dict] = {}
    for name, check, needs in CHECKS:
        missing = [n for n in needs if not verdicts[n]["passed"]]
        if missing:
            verdicts[name] = {"passed": False, "detail": f"not run: it needs {', '.join(missing)}"}
            continue
        try:
            verdicts[name] = {"passed": True, "detail": check(probe)}
        except Exception as e:  # noqa: BLE001 - every failure is this assumption's verdict
            verdicts[name] = {"passed": False, "detail": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"}
    return verdicts


def probe_core_ml(
    runtime: CoreMLRuntime, out_dir: str | os.PathLike | None = None, *, package: str | os.PathLike | None = None
) -> dict:
    """Run every check on a tiny package; record and return the verdicts (kind ``core_ml_probe``).

    Refuses (one line) where the Core ML runtime is not available. The verdicts replace the machine's
    previous ones (``runtime.probe_file``, written atomically); the record is also written to ``out_dir``.
    ``package``: an already built ``build_probe_package`` (default: built afresh here, about 5 s).
    """
    if not runtime.available():
        raise AnelabInputError(f"anelab doctor --probe needs a Mac: {runtime.unavailable_reason()}")
    runtime.prepare_process()
    runtime.ignore_probe_file = True  # a probe judges afresh: earlier verdicts refuse nothing here
    try:
        with tempfile.TemporaryDirectory(prefix="anelab-probe-") as work:
            built = Path(package) if package is not None else build_probe_package(Path(work))
            verdicts = _run_checks(_Probe(runtime, built, Path(work)))
    finally:
        runtime.ignore_probe_file = False
    table = {
        name: {**verdicts[name], "behaviour": a.assumption(name).behaviour, "source": a.assumption(name).source}
        for name in a.ASSUMPTION_NAMES
    }
    record = make_record(
        "core_ml_probe",
        {
            "runtime": runtime.name,
            "compute_units": PROBE_UNITS,
            "plan_compute_units": PROBE_PLAN_UNITS,
            "package": f"tiny stateful sidecar c{PROBE_CHUNK} + c1, capacity {PROBE_CAPACITY}",
        },  # fmt: skip
        {"assumptions": table, "failed": [name for name, v in table.items() if not v["passed"]]},
        origin="measured",
    )
    _write_atomically(runtime.probe_file, {"assumptions": table, "date": record["provenance"]["date"]})
    if out_dir is not None:
        record = {**record, "_file": write_record(out_dir, record).name}
    return record


def _write_atomically(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)


def format_probe(record: dict) -> str:
    """The assumption table ``anelab doctor --probe`` prints: one row per assumption, then its source."""
    table = record["results"]["assumptions"]
    width = max(len(name) for name in table)
    lines = [f"Core ML assumptions probed on a tiny package ({record['parameters']['package']}):"]
    for name, verdict in table.items():
        lines.append(f"  {'passed' if verdict['passed'] else 'FAILED'}  {name:<{width}}  {verdict['detail']}")
        lines.append(f"          {'':<{width}}  coremltools 9.0: {verdict['source']}")
    failed = record["results"]["failed"]
    lines.append(
        f"{len(table) - len(failed)} of {len(table)} passed"
        + (f"; code relying on {', '.join(failed)} refuses naming it" if failed else "")
    )
    return "\n".join(lines)
