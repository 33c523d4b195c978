"""Timing utilities on a deterministic fake clock; results always become records."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from anelab.core.errors import AnelabInputError
from anelab.core.records import read_record, read_records
from anelab.runtimes.coreml.coreml_fake import FakeClock, FakeFunction, FakeRuntime
from anelab.runtimes.coreml.timing import (
    COLD_LOAD_CAVEAT,
    LOAD_COMPONENTS,
    TimingStats,
    measure,
    time_compositions,
    time_load,
    time_predict,
)
from anelab.runtimes.interface import RuntimeLoadError, RuntimeUnavailableError

# the seed's Qwen 3.8 geometry: h0 loads in 6.7 s cold; h0 predicts in 0.43 s on the ANE, 0.65 s on the CPU
H0 = FakeFunction(
    cold_load_s=6.7, warm_load_s=0.25, predict_s={"cpu_and_ne": 0.43, "cpu_only": 0.65}, predict_default_s=0.5
)


def _package(tmp_path: Path, name: str = "layer_3.mlpackage") -> Path:
    pkg = tmp_path / name
    pkg.mkdir(parents=True)
    (pkg / "Manifest.json").write_text("{}")
    return pkg


def _stepper(clock: FakeClock, steps: list[float]):
    steps = iter(steps)
    return lambda: clock.advance(next(steps))


# ---- measure -----------------------------------------------------------------------------------------


def test_measure_drops_the_warmup_and_reports_min_median_max():
    clock = FakeClock()
    stats = measure(_stepper(clock, [9.0, 3.0, 1.0, 2.0]), warmup=1, repeats=3, clock=clock)
    assert stats == TimingStats(min=1.0, median=2.0, max=3.0, samples=(3.0, 1.0, 2.0))


def test_measure_without_warmup_keeps_the_first_call():
    # control for the test above: the 9 s first call is what the warm-up removed
    clock = FakeClock()
    stats = measure(_stepper(clock, [9.0, 3.0, 1.0, 2.0]), warmup=0, repeats=4, clock=clock)
    assert stats.max == 9.0 and stats.median == 2.5 and stats.samples == (9.0, 3.0, 1.0, 2.0)


def test_measure_does_not_time_the_setup():
    clock = FakeClock()
    seen = []

    def setup():
        clock.advance(100.0)
        return len(seen)

    def fn(arg):
        seen.append(arg)
        clock.advance(1.5)

    stats = measure(fn, warmup=1, repeats=2, clock=clock, setup=setup)
    assert stats.samples == (1.5, 1.5) and seen == [0, 1, 2]


@pytest.mark.parametrize("warmup, repeats, match", [(0, 0, "repeats"), (-1, 3, "warmup")])
def test_measure_refuses_bad_counts(warmup, repeats, match):
    with pytest.raises(AnelabInputError, match=match):
        measure(lambda: None, warmup=warmup, repeats=repeats)


# ---- load --------------------------------------------------------------------------------------------


def test_cold_load_loads_a_fresh_copy_each_time(tmp_path):
    runtime = FakeRuntime({"h0": H0})
    pkg = _package(tmp_path)
    record = time_load(
        runtime,
        pkg,
        "h0",
        "cpu_and_ne",
        cold=True,
        warmup=1,
        repeats=3,
        clock=runtime.clock,
        out_dir=tmp_path / "records",
    )
    # each sample: the first load of a fresh compiled copy; neither the compile nor the release is timed
    assert record["results"]["samples_s"] == pytest.approx([6.7, 6.7, 6.7], rel=1e-12)
    assert record["results"]["compile"]["samples_s"] == pytest.approx([4.0] * 4, rel=1e-12)  # warm-up too
    assert runtime.compiles == [str(pkg)] * 4
    copies = {c[1] for c in runtime.calls if c[0] == "compile"}
    assert runtime.released == ["h0"] * 4  # every handle released (after its clock stopped)
    assert record["unknown"] == [COLD_LOAD_CAVEAT] and len(copies) == 1


def test_warm_load_reuses_the_path_after_the_warmup(tmp_path):
    runtime = FakeRuntime({"h0": H0})
    record = time_load(
        runtime, _package(tmp_path), "h0", "cpu_and_ne", cold=False, warmup=1, repeats=3, clock=runtime.clock
    )
    assert record["results"]["median_s"] == pytest.approx(0.25, rel=1e-12)
    assert record["results"]["max_s"] == pytest.approx(0.25, rel=1e-12)  # the 6.7 s cold load was the warm-up


def test_load_record_is_written_and_reads_back(tmp_path):
    runtime = FakeRuntime({"h0": H0})
    out = tmp_path / "records"
    record = time_load(runtime, _package(tmp_path), "h0", "cpu_and_ne", repeats=2, clock=runtime.clock, out_dir=out)
    files = sorted(out.glob("*.json"))
    assert [f.name for f in files] == [record["_file"]] and record["_file"].startswith("load_timing-")
    saved = read_record(files[0])
    assert saved["origin"] == "measured" and saved["kind"] == "load_timing"
    assert saved["parameters"] == {
        "package": "layer_3.mlpackage",
        "function": "h0",
        "compute_units": "cpu_and_ne",
        "cold": True,
        "meaning": "first load of a freshly compiled .mlmodelc",
        "warmup": 1,
        "repeats": 2,
        "runtime": "fake",
        "load": FakeRuntime.load_description,
        "components": LOAD_COMPONENTS,
        "before_clock": [
            "imported coremltools (fake: import_s)",
            "ran _macos_version() (fake: first_use_s)",
            "loaded and predicted a tiny model (anelab_first_use.mlpackage) under cpu_and_ne: Core ML's first use",
        ],  # fmt: skip
    }
    assert saved["results"]["median_s"] == pytest.approx(6.7, rel=1e-12)


def test_without_out_dir_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runtime = FakeRuntime()
    record = time_load(runtime, _package(tmp_path / "p"), "h0", "cpu_and_ne", repeats=1, clock=runtime.clock)
    assert "_file" not in record
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["Manifest.json"]  # only the package itself


def test_timing_refuses_an_unavailable_runtime(tmp_path):
    runtime = FakeRuntime(available=False, reason="the Core ML runtime is unavailable (test)")
    with pytest.raises(RuntimeUnavailableError):
        time_load(runtime, _package(tmp_path), "h0", "cpu_and_ne")
    with pytest.raises(RuntimeUnavailableError):
        time_predict(runtime, _package(tmp_path, "b.mlpackage"), "h0", {})
    assert runtime.calls == []


# ---- compositions ------------------------------------------------------------------------------------


def test_compositions_time_the_same_function_from_each_package(tmp_path):
    runtime = FakeRuntime({"h0": H0})
    packages = {
        label: _package(tmp_path, f"{label}.mlpackage") for label in ("alone", "beside_h4096", "beside_unloadable")
    }
    record = time_compositions(runtime, packages, "h0", repeats=2, clock=runtime.clock, out_dir=tmp_path / "records")
    assert list(record["results"]) == ["alone", "beside_h4096", "beside_unloadable"]
    for label, result in record["results"].items():
        assert result["package"] == f"{label}.mlpackage"
        assert result["median_s"] == pytest.approx(6.7, rel=1e-12)
    assert {c[2] for c in runtime.calls if c[0] == "load"} == {"h0"}
    assert [r["kind"] for r in read_records(tmp_path / "records")] == ["composition_load_timing"]


def test_composition_the_function_cannot_load_from_is_refused_naming_it(tmp_path):
    runtime = FakeRuntime({"h0": FakeFunction(load_error="function h0 not found")})
    with pytest.raises(AnelabInputError, match="composition 'broken'"):
        time_compositions(runtime, {"broken": _package(tmp_path)}, "h0", repeats=1, clock=runtime.clock)
    with pytest.raises(AnelabInputError, match="at least one"):
        time_compositions(runtime, {}, "h0")


# ---- predict -----------------------------------------------------------------------------------------


def test_predict_per_compute_units_setting(tmp_path):
    runtime = FakeRuntime({"h0": H0})
    inputs = {"hidden": np.zeros((4, 64), np.float16), "mask": np.zeros((4, 4), np.float16)}
    record = time_predict(
        runtime,
        _package(tmp_path),
        "h0",
        inputs,
        ["cpu_only", "cpu_and_ne", "all"],
        warmup=1,
        repeats=3,
        clock=runtime.clock,
        out_dir=tmp_path / "records",
    )
    medians = {unit: r["median_s"] for unit, r in record["results"].items()}  # + 0.02 s outputs to NumPy
    assert medians == pytest.approx({"cpu_only": 0.67, "cpu_and_ne": 0.45, "all": 0.52}, rel=1e-9)
    own = {unit: r["core_ml_predict_s"]["median_s"] for unit, r in record["results"].items()}
    assert own == pytest.approx({"cpu_only": 0.65, "cpu_and_ne": 0.43, "all": 0.5}, rel=1e-9)
    assert record["parameters"]["input_shapes"] == {"hidden": [4, 64], "mask": [4, 4]}
    predicts = [c for c in runtime.calls if c[0] == "predict"]
    assert len(predicts) == 1 + 3  # warm-up + repeats of cpu_only; loads not timed
    # the stand-in records no gate verdict: cpu_and_ne and all predicted in a child process only
    assert len([c for c in runtime.child_calls() if c[0] == "predict"]) == 2 * (1 + 3)
    assert len(read_records(tmp_path / "records", kind="predict_timing")) == 1


def test_a_setting_that_does_not_load_is_recorded_not_fatal(tmp_path):
    runtime = FakeRuntime({"h0": FakeFunction(unloadable_units=frozenset({"cpu_and_ne"}))})
    record = time_predict(
        runtime, _package(tmp_path), "h0", {}, ["cpu_and_ne", "cpu_only"], repeats=1, clock=runtime.clock
    )
    assert "does not load under cpu_and_ne" in record["results"]["cpu_and_ne"]["error"]
    assert record["results"]["cpu_only"]["median_s"] == pytest.approx(0.52, rel=1e-12)


def test_predict_refuses_unknown_compute_units(tmp_path):
    runtime = FakeRuntime()
    with pytest.raises(AnelabInputError, match="cpu_and_gpu"):
        time_predict(runtime, _package(tmp_path), "h0", {}, ["gpu"])
    assert runtime.calls == []


# ---- issue 11 defects 2, 3, 4 ----------------------------------------------------------------------------


def test_measure_stops_the_clock_while_the_result_is_alive():
    """Defect 3. At 6b7ba86 ``measure`` dropped the call's result before reading the end clock, so a
    handle whose release takes 0.2 s timed every 0.25 s load as 0.45 s."""
    clock = FakeClock()

    class Handle:
        def __del__(self):
            clock.advance(0.2)  # the native destructor: unload, delete a temporary copy

    def load():
        clock.advance(0.25)
        return Handle()

    stats = measure(load, warmup=0, repeats=3, clock=clock)
    assert stats.samples == pytest.approx((0.25, 0.25, 0.25), rel=1e-12)
    assert clock() == pytest.approx(1000 + 3 * 0.45)  # control: the teardown did happen, untimed


def test_warm_loads_are_loads_of_one_compiled_copy_not_recompiles(tmp_path):
    """Defect 2. At 6b7ba86 a "warm" load was ``MLModel(<x>.mlpackage)`` again: a whole-package compile
    into a fresh copy every time (never warm). Here the package is compiled once and the timed loads
    read that copy: 0.25 s each, with the 4 s compile and 0.2 s teardown in no sample."""
    runtime = FakeRuntime({"h0": H0})
    pkg = _package(tmp_path)
    record = time_load(runtime, pkg, "h0", "cpu_and_ne", cold=False, warmup=1, repeats=3, clock=runtime.clock)
    assert record["results"]["samples_s"] == pytest.approx([0.25] * 3, rel=1e-12)
    assert runtime.compiles == []  # compiled once, by the pre-flight child, into the shared cache
    assert [c[0] for c in runtime.child_calls()] == ["compile", "load", "predict"]
    # negative control: what loading the .mlpackage itself costs each time (compile + cold load)
    start = runtime.clock()
    handle = runtime.load_path(pkg, "h0", "cpu_and_ne")
    assert runtime.clock() - start == pytest.approx(4.0 + 6.7)
    del handle


def test_a_failed_predict_is_recorded_and_the_run_goes_on(tmp_path):
    """Defect 4. At 6b7ba86 ``time_predict`` caught load errors only: a predict that raised (Core ML's
    RuntimeError, coremltools' KeyError) ended the whole run."""
    runtime = FakeRuntime({"h0": FakeFunction(inputs={"hidden": (4, 8)}, predict_default_s=0.5)})
    wrong = {"hidden": np.zeros((4, 9), np.float16)}
    record = time_predict(runtime, _package(tmp_path), "h0", wrong, ["cpu_and_ne", "cpu_only"], clock=runtime.clock)
    for unit in ("cpu_and_ne", "cpu_only"):
        assert "not compatible with the model's feature description" in record["results"][unit]["error"]
    right = {"hidden": np.zeros((4, 8), np.float16)}  # control: the same run with the declared shape
    record = time_predict(runtime, _package(tmp_path, "b.mlpackage"), "h0", right, ["cpu_only"], clock=runtime.clock)
    assert record["results"]["cpu_only"]["median_s"] == pytest.approx(0.52, rel=1e-12)


def test_predict_timing_excludes_the_input_conversion_and_reports_it(tmp_path):
    """Defect 10: the fp16 -> fp32 conversion happened inside the timed predict, in the caller's dict."""
    runtime = FakeRuntime({"h0": FakeFunction(inputs={"hidden": (4, 8)}, convert_s=0.05, predict_default_s=0.5)})
    given = {"hidden": np.zeros((4, 8), np.float16)}
    record = time_predict(
        runtime, _package(tmp_path), "h0", given, ["cpu_only"], warmup=0, repeats=2, clock=runtime.clock
    )
    result = record["results"]["cpu_only"]
    assert result["samples_s"] == pytest.approx([0.52, 0.52], rel=1e-12)  # not 0.57 for the first call
    assert "input_conversion_s" in result and given["hidden"].dtype == np.float16


def test_a_cold_load_in_a_fresh_process(tmp_path):
    """Cold as the issue defines it: the first load of a freshly compiled copy in a fresh process. The
    copy is compiled here (untimed); each load runs in a child rebuilt from ``child_spec()``."""
    runtime = FakeRuntime({"h0": H0})
    pkg = _package(tmp_path)
    record = time_load(runtime, pkg, "h0", "cpu_and_ne", cold=True, warmup=1, repeats=2, clock=runtime.clock,
                       fresh_process=True)  # fmt: skip
    assert record["results"]["samples_s"] == pytest.approx([6.7, 6.7], rel=1e-12)
    assert record["parameters"]["meaning"] == "first load of a freshly compiled .mlmodelc, in a fresh process"
    assert runtime.compiles == [str(pkg)] * 3 and [c for c in runtime.calls if c[0] == "load"] == []
    broken = FakeRuntime({"h0": FakeFunction(load_error="no such function")})  # control: a failing child is named
    with pytest.raises(RuntimeLoadError, match="fresh process failed"):
        time_load(broken, pkg, "h0", "cpu_and_ne", cold=True, repeats=1, clock=broken.clock, fresh_process=True)
