"""Issue 20: on a Mac every recorded number is the number it claims to be, and first contact explains itself.

Each ``test_defect_N_*`` reproduces defect N of the issue on 2215929 (the stricter fake charges and
refuses what coremltools 9.0 does; the lines it copies are cited in ``anelab.runtimes.coreml.coreml_fake``) and
passes after the fix:

1. cold loads "in a fresh process" timed the import of coremltools and its first-use ``sw_vers``;
2. memory vs functions compiled inside the window it measured;
3. "predict only" held the output conversion, and Core ML's own duration was unused;
4. ``cpu_and_ne`` predicts ran in the measuring process on packages the ANE gate never passed;
5. the fake accepted what Core ML refuses (dtypes, read-only arrays, any compile path, extra names).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import as_gate_passed, seed_passed_verdicts

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.runtimes.coreml.assumptions import ASSUMPTIONS, STATE_SHARED_BY_FUNCTIONS, UNIFIED_LOG_READABLE
from anelab.runtimes.coreml.coreml_fake import FakeCrash, FakeFunction, FakeRuntime
from anelab.runtimes.coreml.device_verify import verify_on_device
from anelab.runtimes.coreml.gate import AneGateError, check_variants
from anelab.runtimes.coreml.probe import build_probe_package, format_probe, probe_core_ml
from anelab.runtimes.coreml.timing import time_load, time_predict
from anelab.runtimes.interface import (
    AssumptionFailedError,
    RuntimeLoadError,
    RuntimePredictError,
    UngatedPackageError,
    prepare_inputs,
)
from anelab.runtimes.open import open_sidecar
from anelab.sidecar.export import export_layer
from anelab.studies.setup_cost import measure_load_memory

STAND_IN_COSTS_NOTHING = 0.05  # seconds: the bound for a cold load whose stand-in costs nothing
SIG = dict(inputs={"hidden": (4, 8), "mask": (4, 4)}, output_shapes={"attn_out": (4, 8)})


def _package(tmp_path: Path, name: str = "layer_3.mlpackage") -> Path:
    pkg = tmp_path / name
    pkg.mkdir(parents=True)
    (pkg / "Manifest.json").write_text("{}")
    return pkg


@pytest.fixture(scope="module")
def dense(tiny_checkpoint, tmp_path_factory):
    """A real (tiny) dense sidecar h0/h8, exported off-Mac: aneCompileVerified false; and its gate-passed copy."""
    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    pkg = export_layer(ckpt, 0, 8, [0, 8], tmp_path_factory.mktemp("dense")).package
    return pkg, as_gate_passed(pkg), ckpt


@pytest.fixture(scope="module")
def stateful(tiny_checkpoint, tmp_path_factory):
    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    out = tmp_path_factory.mktemp("stateful")
    with_decode = export_layer(ckpt, 0, 4, None, out / "d", graph="stateful", capacity=16, decode=True).package
    without = export_layer(ckpt, 0, 4, None, out / "n", graph="stateful", capacity=16).package
    return as_gate_passed(with_decode), as_gate_passed(without)


@pytest.fixture(scope="module")
def probe_package(tmp_path_factory):
    return build_probe_package(tmp_path_factory.mktemp("probe"))


# ---- 1: a cold load is the load call ------------------------------------------------------------------
def test_defect_1_a_cold_load_in_a_fresh_process_holds_the_load_only(tmp_path):
    # the stand-in's load costs nothing; importing coremltools and sw_vers cost 1.5 s in each fresh process
    runtime = FakeRuntime(default=FakeFunction(cold_load_s=0.0), import_s=1.0, first_use_s=0.5)
    record = time_load(runtime, _package(tmp_path), "h0", "cpu_and_ne", cold=True, warmup=0, repeats=2,
                       clock=runtime.clock, fresh_process=True)  # fmt: skip
    assert max(record["results"]["samples_s"]) < STAND_IN_COSTS_NOTHING  # on 2215929: 1.5 s each
    before = record["parameters"]["before_clock"]
    assert before[0].startswith("started a new Python process") and any("import" in step for step in before)
    assert set(record["parameters"]["components"]) == {"samples_s", "core_ml_load_s", "compile"}
    # control: the same child timed from before its first-use work would record the 1.5 s
    slow = FakeRuntime(default=FakeFunction(cold_load_s=0.0), import_s=1.0, first_use_s=0.5)
    start = slow.clock()
    slow.load_path(slow.compile(_package(tmp_path, "b.mlpackage")), "h0", "cpu_and_ne")
    assert slow.clock() - start > 1.5


def test_in_process_cold_and_warm_loads_exclude_the_first_use_too(tmp_path):
    runtime = FakeRuntime(default=FakeFunction(cold_load_s=0.0, warm_load_s=0.0), import_s=1.0, first_use_s=0.5)
    for cold in (True, False):
        record = time_load(runtime, _package(tmp_path, f"{cold}.mlpackage"), "h0", "cpu_only", cold=cold,
                           warmup=0, repeats=1, clock=runtime.clock)  # fmt: skip
        assert record["results"]["samples_s"] == [0.0] and record["results"]["core_ml_load_s"] == [0.0]


# ---- 2: memory is read after compiling ----------------------------------------------------------------
def test_defect_2_memory_readings_are_taken_after_the_compile(tmp_path):
    runtime = FakeRuntime()
    readings = []

    def compiles_so_far() -> int:  # a "resident memory" that shows how many compiles happened before it
        readings.append(len(runtime.compiles))
        return readings[-1]

    result = measure_load_memory(runtime, _package(tmp_path), ["h0", "h8", "h16"], rss=compiles_so_far)
    assert readings == [1, 1, 1, 1]  # on 2215929: [0, 1, 1, 1] — the first load's row held the compile
    assert [row["delta_bytes"] for row in result["loads"]] == [0, 0, 0]
    assert "after the package was compiled" in result["read"]


# ---- 3: predict records wall time and Core ML's own ----------------------------------------------------
def test_defect_3_predict_records_core_ml_duration_and_the_conversion_share(tmp_path):
    script = FakeFunction(**SIG, predict_default_s=0.4, output_convert_s=0.1)
    runtime = FakeRuntime({"h0": script})
    inputs = {"hidden": np.ones((4, 8), np.float16), "mask": np.zeros((4, 4), np.float16)}
    record = time_predict(runtime, _package(tmp_path), "h0", inputs, ["cpu_only"], warmup=0, repeats=2,
                          clock=runtime.clock)  # fmt: skip
    result = record["results"]["cpu_only"]
    assert result["samples_s"] == pytest.approx([0.5, 0.5])  # wall: Core ML 0.4 + outputs to NumPy 0.1
    assert result["core_ml_predict_s"]["samples_s"] == pytest.approx([0.4, 0.4])
    assert result["conversion_share"] == pytest.approx(0.2)
    assert set(record["parameters"]["components"]) == {
        "samples_s", "core_ml_predict_s", "conversion_share", "input_conversion_s",
    }  # fmt: skip
    # control: a Mac whose probe found no predict duration refuses to time, naming the assumption
    runtime.probe_file.parent.mkdir(parents=True, exist_ok=True)
    runtime.probe_file.write_text('{"assumptions": {"core_ml_predict_duration": {"passed": false, "detail": "None"}}}')
    with pytest.raises(AssumptionFailedError, match="core_ml_predict_duration"):
        time_predict(runtime, _package(tmp_path, "b.mlpackage"), "h0", inputs, ["cpu_only"], clock=runtime.clock)


# ---- 4: no ungated Neural Engine predict in this process -----------------------------------------------
def test_defect_4_verify_on_the_device_refuses_an_ungated_package_before_anything_loads(dense):
    ungated, gated, ckpt = dense
    runtime = FakeRuntime(numerics=True)
    for units in ("cpu_and_ne", "all"):
        with pytest.raises(UngatedPackageError, match="aneCompileVerified: false"):
            verify_on_device(ungated, ckpt, compute_units=units, runtime=runtime)
    assert runtime.calls == []  # predicted nowhere, loaded nowhere
    assert verify_on_device(ungated, ckpt, compute_units="cpu_only", runtime=runtime).passed  # off the ANE: fine
    # control: the gate-passed copy runs under cpu_and_ne in this process
    assert verify_on_device(gated, ckpt, compute_units="cpu_and_ne", runtime=runtime).passed
    assert {c[3] for c in runtime.calls if c[0] == "predict"} == {"cpu_only", "cpu_and_ne"}


def test_defect_4_an_ungated_predict_that_kills_its_process_is_recorded_and_the_run_goes_on(dense):
    ungated, gated, _ = dense
    runtime = FakeRuntime({"h0": FakeFunction(predict_signal="SIGKILL")})
    inputs = {"hidden": np.zeros((8, 64), np.float16), "mask": np.zeros((8, 8), np.float16)}
    record = time_predict(runtime, ungated, "h0", inputs, ["cpu_and_ne"], repeats=1, clock=runtime.clock)
    assert "killed by SIGKILL" in record["results"]["cpu_and_ne"]["error"]  # on 2215929 this test process died
    assert "child process" in record["parameters"]["process"]["cpu_and_ne"]
    assert [c for c in runtime.calls if c[0] == "predict"] == []
    # a gate-passed package is pre-flighted in a child before this process predicts it: the crash lands there too
    record = time_predict(runtime, gated, "h0", inputs, ["cpu_and_ne"], repeats=1, clock=runtime.clock)
    assert "killed by SIGKILL" in record["results"]["cpu_and_ne"]["error"]
    assert [c for c in runtime.calls if c[0] == "predict"] == []
    with pytest.raises(FakeCrash, match="SIGKILL"):  # control: the raw primitive, no child first, takes the process
        runtime.predict(runtime.load_path(runtime.compile(gated), "h0", "cpu_and_ne"), prepare_inputs(inputs))


def test_the_arms_device_runner_opens_only_gated_packages(dense):
    ungated, gated, _ = dense
    runtime = FakeRuntime()
    with pytest.raises(AnelabInputError, match="not verified for the Neural Engine"):
        open_sidecar(ungated, compute_units="cpu_and_ne", chunk=8, runtime=runtime)
    assert open_sidecar(gated, compute_units="cpu_and_ne", chunk=8, runtime=runtime).loaded == []


# ---- 5: the fake refuses what Core ML refuses ------------------------------------------------------------
def test_a_read_only_fp16_array_passes_because_coremltools_copies_it_to_fp32_first(tmp_path):
    runtime = FakeRuntime({"h0": FakeFunction(inputs={"hidden": (4, 8)})})
    handle = runtime.load(_package(tmp_path), "h0", "cpu_only")
    frozen = np.zeros((4, 8), np.float16)
    frozen.flags.writeable = False
    given = {"hidden": frozen}
    runtime.predict(handle, given)  # model.py:1064-1067 casts into a new, writable fp32 array
    assert given["hidden"].dtype == np.float32 and given["hidden"].flags.writeable


@pytest.mark.parametrize("dtype", [np.int64, np.bool_, np.uint8])
def test_defect_5_only_int32_fp32_fp64_writable_arrays_pass(tmp_path, capsys, dtype):
    runtime = FakeRuntime({"h0": FakeFunction(inputs={"hidden": (4, 8)})})
    handle = runtime.load(_package(tmp_path), "h0", "cpu_only")
    given = {"hidden": np.zeros((4, 8), dtype)}
    with pytest.raises(RuntimePredictError, match="value type not convertible"):
        runtime.predict(handle, given)
    assert "Error: value type not convertible:" in capsys.readouterr().out  # printed first, as coremltools does
    for ok in (np.int32, np.float32, np.float64):  # control: the three dtypes Core ML takes
        runtime.predict(handle, {"hidden": np.zeros((4, 8), ok)})


def test_defect_5_a_read_only_fp32_array_is_refused(tmp_path):
    runtime = FakeRuntime({"h0": FakeFunction(inputs={"hidden": (4, 8)})})
    handle = runtime.load(_package(tmp_path), "h0", "cpu_only")
    frozen = np.zeros((4, 8), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(RuntimePredictError, match="not convertible"):  # mutable_data(), CoreMLPythonArray.mm:55
        runtime.predict(handle, {"hidden": frozen})
    runtime.predict(handle, {"hidden": frozen.copy()})  # control


def test_defect_5_compile_keeps_the_suffix_rules(tmp_path):
    runtime = FakeRuntime()
    odd = _package(tmp_path, "variant")  # a directory without the .mlpackage suffix
    with pytest.raises(RuntimeLoadError, match="Invalid model file path"):
        runtime.compile_to(odd, tmp_path / "odd.mlmodelc")
    with pytest.raises(AnelabInputError, match="does not end in .mlpackage"):  # refused before Core ML is asked
        runtime.compile(odd)
    with pytest.raises(RuntimeLoadError, match='must have ".mlmodelc"'):
        runtime.compile_to(_package(tmp_path), tmp_path / "out" / "copy")
    assert runtime.compile(_package(tmp_path, "h0.mlpackage")).suffix == ".mlmodelc"  # control


def test_defect_5_only_an_mlmodel_handle_checks_input_names(tmp_path):
    runtime = FakeRuntime({"h0": FakeFunction(**SIG)})
    pkg = _package(tmp_path, "h0.mlpackage")
    extra = {"hidden": np.zeros((4, 8), np.float32), "mask": np.zeros((4, 4), np.float32), "k_history": np.zeros(1)}
    compiled = runtime.load(pkg, "h0", "cpu_only")  # CompiledMLModel: no name check (_compiled_model.py:227-231)
    assert runtime.predict(compiled, dict(extra))["attn_out"].shape == (4, 8)
    from_package = runtime.load_path(pkg, "h0", "cpu_only")  # MLModel: KeyError naming the key (model.py:1055-1060)
    with pytest.raises(RuntimePredictError, match='Provided key "k_history"'):
        runtime.predict(from_package, dict(extra))


def test_defect_5_the_fake_reports_core_ml_load_and_predict_durations(tmp_path):
    runtime = FakeRuntime({"h0": FakeFunction(**SIG, cold_load_s=3.0, predict_default_s=0.2)})
    runtime.prepare_process()  # the tiny model pays Core ML's first use of the process (core_ml_first_use_s)
    handle = runtime.load(_package(tmp_path), "h0", "cpu_only")
    assert runtime.load_duration_s(handle) == 3.0 and runtime.predict_duration_s(handle) is None
    runtime.predict(handle, {"hidden": np.zeros((4, 8), np.float32), "mask": np.zeros((4, 4), np.float32)})
    assert runtime.predict_duration_s(handle) == 0.2


# ---- the gate: an unread log is an unknown verdict ----------------------------------------------------------
def test_a_log_show_failure_makes_the_gate_verdict_unknown(tmp_path):
    variants = {"h0": _package(tmp_path, "h0.mlpackage")}
    probed_fine = FakeRuntime(lacks={UNIFIED_LOG_READABLE}, probed=False)  # the probe passed; 'log show' fails now
    seed_passed_verdicts(probed_fine)
    with pytest.raises(AneGateError, match="verdict unknown.*did not finish within 120 s"):
        check_variants(probed_fine, variants)
    with pytest.raises(AssumptionFailedError, match=UNIFIED_LOG_READABLE):  # a Mac whose probe saw it: refused first
        check_variants(FakeRuntime(lacks={UNIFIED_LOG_READABLE}), variants)
    assert set(check_variants(FakeRuntime(), variants)) == {"h0"}  # control: a readable, clean log passes


def test_mac_log_show_failure_raises_instead_of_returning_text(monkeypatch):
    """On 2215929 a timed-out ``log show`` returned "(log show failed: TimeoutExpired)": no marker, so the gate passed."""
    import subprocess

    from anelab.runtimes.coreml.coreml_runtime import MacRuntime
    from anelab.runtimes.interface import UnifiedLogUnavailable

    def timed_out(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs.get("timeout"))

    def exits(code):
        return lambda cmd, **kwargs: subprocess.CompletedProcess(cmd, code, stdout="[coreml] a line", stderr="denied")

    for broken in (timed_out, exits(1)):
        monkeypatch.setattr(subprocess, "run", broken)
        with pytest.raises(UnifiedLogUnavailable):
            MacRuntime().read_unified_log(123, 0.0, 1.0)
    monkeypatch.setattr(subprocess, "run", exits(0))  # control: a log that was read is returned
    assert MacRuntime().read_unified_log(123, 0.0, 1.0) == "[coreml] a line"


# ---- first contact: doctor --probe -----------------------------------------------------------------------------
def test_the_probe_passes_every_assumption_on_a_faithful_fake(probe_package, tmp_path):
    runtime = FakeRuntime(numerics=True)
    record = probe_core_ml(runtime, tmp_path / "records", package=probe_package)
    table = record["results"]["assumptions"]
    assert list(table) == [a.name for a in ASSUMPTIONS] and record["results"]["failed"] == []
    assert all(v["source"] for v in table.values()) and (tmp_path / "records" / record["_file"]).is_file()
    text = format_probe(record)
    assert f"{len(ASSUMPTIONS)} of {len(ASSUMPTIONS)} passed" in text and "CoreMLPython.mm:543-562" in text


def test_a_failed_assumption_is_named_and_the_code_relying_on_it_refuses(probe_package, stateful):
    runtime = FakeRuntime(numerics=True, lacks={STATE_SHARED_BY_FUNCTIONS})
    record = probe_core_ml(runtime, package=probe_package)
    assert record["results"]["failed"] == [STATE_SHARED_BY_FUNCTIONS]
    with_decode, _ = stateful
    probed = len(runtime.calls)
    sidecar = open_sidecar(with_decode, compute_units="cpu_and_ne", chunk=4, runtime=runtime)
    sidecar.predict(0, {"hidden": np.zeros((4, 64), np.float16), "start": np.array([0], np.int32)})
    with pytest.raises(AssumptionFailedError, match=STATE_SHARED_BY_FUNCTIONS):
        sidecar.decode(4, {"hidden": np.zeros((1, 64), np.float16)})
    assert not [c for c in runtime.calls[probed:] if c[0] == "predict" and c[2] == "c1"]  # refused before predicting


def test_off_mac_doctor_probe_is_one_line_and_exit_2(capsys):
    assert main(["doctor", "--probe"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs a Mac" in err


# ---- decode through the opened stateful package ------------------------------------------------------------------
def test_decode_runs_c1_on_the_state_the_prefill_filled(stateful):
    with_decode, without = stateful
    runtime = FakeRuntime(numerics=True)
    sidecar = open_sidecar(with_decode, compute_units="cpu_and_ne", chunk=4, runtime=runtime)
    with pytest.raises(AnelabInputError, match="run predict \\(the prefill\\) first"):
        sidecar.decode(4, {"hidden": np.zeros((1, 64), np.float16)})
    rng = np.random.default_rng(0)
    sidecar.predict(0, {"hidden": rng.standard_normal((4, 64)).astype(np.float16), "start": np.array([0], np.int32)})
    k_prefill = sidecar.state.read_state("k_cache").copy()
    out = sidecar.decode(4, {"hidden": rng.standard_normal((1, 64)).astype(np.float16)})
    k_after = sidecar.state.read_state("k_cache")
    assert out["attn_out"].shape == (1, 64) and sidecar.decode_function() == "c1"
    assert np.array_equal(k_after[:, :4], k_prefill[:, :4]) and np.any(k_after[:, 4] != 0)  # slot 4 written
    assert [c[2] for c in runtime.calls if c[0] == "predict"] == ["c4", "c1"]
    # control: a stateful package exported without decode is refused, naming the fix
    plain = open_sidecar(without, compute_units="cpu_and_ne", chunk=4, runtime=runtime)
    with pytest.raises(AnelabInputError, match="no decode function c1.*--decode"):
        plain.decode(4, {"hidden": np.zeros((1, 64), np.float16)})
