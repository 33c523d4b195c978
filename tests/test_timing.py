"""Timing utilities on a deterministic fake clock; results always become records."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from anelab.errors import AnelabInputError
from anelab.records import read_record, read_records
from anelab.runtime.fake import FakeClock, FakeFunction, FakeRuntime
from anelab.runtime.interface import RuntimeUnavailableError
from anelab.runtime.timing import COLD_LOAD_CAVEAT, TimingStats, measure, time_compositions, time_load, time_predict

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
    medians = {unit: r["median_s"] for unit, r in record["results"].items()}
    assert medians == pytest.approx({"cpu_only": 0.65, "cpu_and_ne": 0.43, "all": 0.5}, rel=1e-9)
    assert record["parameters"]["input_shapes"] == {"hidden": [4, 64], "mask": [4, 4]}
    predicts = [c for c in runtime.calls if c[0] == "predict"]
    assert len(predicts) == 3 * (1 + 3)  # warm-up + repeats per setting, loads not timed
    assert len(read_records(tmp_path / "records", kind="predict_timing")) == 1


def test_a_setting_that_does_not_load_is_recorded_not_fatal(tmp_path):
    runtime = FakeRuntime({"h0": FakeFunction(unloadable_units=frozenset({"cpu_and_ne"}))})
    record = time_predict(
        runtime, _package(tmp_path), "h0", {}, ["cpu_and_ne", "cpu_only"], repeats=1, clock=runtime.clock
    )
    assert "does not load under cpu_and_ne" in record["results"]["cpu_and_ne"]["error"]
    assert record["results"]["cpu_only"]["median_s"] == pytest.approx(0.5, rel=1e-12)


def test_predict_refuses_unknown_compute_units(tmp_path):
    runtime = FakeRuntime()
    with pytest.raises(AnelabInputError, match="cpu_and_gpu"):
        time_predict(runtime, _package(tmp_path), "h0", {}, ["gpu"])
    assert runtime.calls == []
