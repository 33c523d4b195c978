"""``anelab measure`` end to end through the fake runtime: every step writes tagged records, a re-run
skips what is recorded for the same package and machine, ``--again`` measures again; off-Mac the
command exits 2 with one line and ``--dry-run`` lists the steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from anelab.cli import main
from anelab.core.records import read_records
from anelab.publish.measure import STEPS, MeasureConfig, measure
from anelab.runtimes.coreml.assumptions import ASSUMPTION_NAMES
from anelab.runtimes.coreml.coreml_fake import FakeFunction, FakeRuntime


def test_dry_run_lists_every_step_anywhere(capsys):
    assert main(["measure", "--dry-run", "--chunk", "32"]) == 0
    out = capsys.readouterr().out
    for name, _ in STEPS:
        assert name in out
    assert "histories 0,32,64" in out


def test_off_mac_measure_exits_2_with_one_line_naming_what_it_needs(capsys, tmp_path):
    assert main(["measure", "--records", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs a Mac with the Core ML runtime and a Neural Engine" in err
    assert not (tmp_path / "r").exists()  # nothing measured, nothing written


def test_no_neural_engine_is_refused_before_anything_runs(tmp_path):
    from anelab.core.errors import AnelabInputError

    runtime = FakeRuntime(machine="x86_64")
    with pytest.raises(AnelabInputError, match="x86_64, not Apple silicon"):
        measure(MeasureConfig(build=tmp_path / "b", records=tmp_path / "r"), runtime=runtime)
    assert runtime.calls == []


@pytest.fixture(scope="module")
def measured(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("measure")
    config = MeasureConfig(
        checkpoint=tiny_checkpoint("llama"), chunk=8, histories=[0, 8], repeats=1, probe_chunk=8,
        build=root / "build", records=root / "records", split_models=(),
    )  # fmt: skip  # split_ab (no model given here): tests/publish/test_measure_splits.py
    runtime = FakeRuntime(numerics=True, default=FakeFunction(cold_load_s=2.0, warm_load_s=0.5))
    first = measure(config, runtime=runtime, clock=runtime.clock, echo=lambda _: None)
    return config, runtime, first


def test_every_step_writes_records_tagged_with_the_package_and_provenance(measured):
    config, _, first = measured
    records = read_records(config.records)
    assert len(records) == len(first["written"]) and first["skipped"] == []
    steps = {r["parameters"]["measure"]["step"] for r in records}
    assert steps == {"probe", "export", "verify", "load", "block_ab", "gather_probe"}
    kinds = sorted({r["kind"] for r in records})
    assert kinds == [
        "ane_gate", "composition_load_timing", "core_ml_probe", "device_verify", "gather_probe_assignment",
        "load_memory", "load_timing", "predict_timing",
    ]  # fmt: skip
    probe = next(r for r in records if r["kind"] == "core_ml_probe")
    assert probe["results"]["failed"] == [] and len(probe["results"]["assumptions"]) == len(ASSUMPTION_NAMES)
    for r in records:
        assert len(r["parameters"]["measure"]["package_sha256"]) == 64
        assert {"chip", "os_version", "coremltools"} <= set(r["provenance"])
    verified = [r for r in records if r["kind"] == "device_verify"]
    assert [r["parameters"]["compute_units"] for r in verified] == ["cpu_and_ne", "cpu_and_gpu", "cpu_only"]
    assert all(r["results"]["passed"] for r in verified)
    gate = next(r for r in records if r["kind"] == "ane_gate")
    assert gate["results"]["verified"] is True and set(gate["results"]["evidence"]) == {"h0", "h8"}
    loads = [r for r in records if r["parameters"]["measure"]["step"] == "load" and r["kind"] == "load_timing"]
    cold = [r for r in loads if r["parameters"]["cold"]]
    assert {r["parameters"]["function"] for r in cold} == {"h0", "h8"}
    assert all(r["results"]["median_s"] == pytest.approx(2.0) for r in cold)  # load only: no compile, no teardown


def test_a_second_run_skips_what_is_recorded_and_again_measures_again(measured):
    config, runtime, first = measured
    before = len(read_records(config.records))
    second = measure(config, runtime=runtime, clock=runtime.clock, echo=lambda _: None)
    # the probe is first contact: never skipped; a step this machine cannot run (Core AI off macOS 27) is neither
    assert set(second["unavailable"]) == {"coreai", "split_ab"}
    assert second["skipped"] == [name for name, _ in STEPS[2:] if name not in second["unavailable"]]
    assert [Path(p).name.split("-")[0] for p in second["written"]] == ["core_ml_probe"]
    assert len(read_records(config.records)) == before + 1
    # --again: the same records no longer count as done (a full re-run is what the first run did)
    from dataclasses import replace

    from anelab.publish.measure import MeasureRun  # the skip rule itself, without a second full run

    key = read_records(config.records, kind="ane_gate")[0]["parameters"]["measure"]["package_sha256"]
    assert MeasureRun(config, runtime, runtime.clock, None).recorded("export", key)
    assert not MeasureRun(replace(config, again=True), runtime, runtime.clock, None).recorded("export", key)
    assert not MeasureRun(config, runtime, runtime.clock, None).recorded("export", "f" * 64)  # another package


# ---- fresh data in the studies ------------------------------------------------------------------------


def _mac_record(kind, function, seconds, date, chip="Apple M4", os_version="macOS 15.3", step="block_ab"):
    from anelab.core.records import make_record

    prov = {
        "machine_model": "Mac16,1", "chip": chip, "os_version": os_version, "python": "3.11", "coremltools": "9.0",
        "numpy": "2.1", "anelab": "0.1.0", "git_revision": "x", "date": date,
    }  # fmt: skip
    params = {"function": function, "measure": {"step": step, "package_sha256": "0" * 64}}
    return make_record(kind, params, {"median_s": seconds}, provenance_override=prov)


def test_fresh_data_takes_mac_records_of_the_newest_machine_labelled_and_deduplicated(tmp_path):
    from anelab.core.records import make_record, write_record
    from anelab.publish.fresh import fresh_data

    assert fresh_data("predict_timing", tmp_path / "none") is None
    write_record(tmp_path, make_record("predict_timing", {"function": "h0"}, {"median_s": 9.0}))  # this Linux box
    assert fresh_data("predict_timing", tmp_path) is None  # not a Mac record: never shown as fresh Mac data
    write_record(tmp_path, _mac_record("predict_timing", "h0", 1.0, "2026-01-01T00:00:00+00:00", chip="Apple M3"))
    write_record(tmp_path, _mac_record("predict_timing", "h0", 2.0, "2026-02-01T00:00:00+00:00"))
    write_record(tmp_path, _mac_record("predict_timing", "h0", 3.0, "2026-03-01T00:00:00+00:00"))  # --again
    write_record(tmp_path, _mac_record("predict_timing", "h64", 4.0, "2026-02-01T00:00:00+00:00"))
    fresh = fresh_data("predict_timing", tmp_path, step="block_ab")
    assert fresh.label == "measured on Apple M4, macOS 15.3"
    assert sorted(r["results"]["median_s"] for r in fresh.records) == [3.0, 4.0]
    assert fresh_data("predict_timing", tmp_path, step="load") is None
    assert fresh.provenance_note().startswith("fresh data: measured on Apple M4, macOS 15.3\n")


def test_reproduce_names_the_figures_drawn_from_fresh_data(tmp_path):
    import matplotlib

    from anelab.publish.figures import save_figure
    from anelab.publish.reproduce import fresh_figures_line

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures_dir = tmp_path / "build" / "figures"
    assert "none of the figures" in fresh_figures_line(True, tmp_path / "build")
    fresh = _mac_record("predict_timing", "h0", 1.0, "2026-02-01T00:00:00+00:00")
    from anelab.publish.fresh import FreshData

    for name, note in (
        ("replayed", "recorded on Mac15,3"),
        ("fresh_ab", FreshData("measured on M4", [fresh]).provenance_note()),
    ):
        fig, _ = plt.subplots()
        save_figure(fig, name, figures_dir=figures_dir, notebook="x.ipynb", parameters={}, provenance_note=note)
        plt.close(fig)
    assert fresh_figures_line(True, tmp_path / "build") == "fresh Mac data: fresh_ab"
