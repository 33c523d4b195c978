"""Batch reruns: grid parsing and expansion, bad input refused before anything is written, the
emitted commands, and one real two-run grid through papermill with --jobs 2 (one run fails on
purpose), its summary table and --resume."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import shlex
from pathlib import Path

import pytest

from anelab import cli
from anelab.core import parallel
from anelab.core.errors import AnelabInputError
from anelab.core.records import read_records
from anelab.publish import batch, notebooks
from anelab.publish.batch_summary import csv_table, markdown_table, summary_figure, summary_rows
from anelab.publish.studies import STUDIES, headline_values

GRIDS = Path(__file__).resolve().parents[2] / "grids"
GATHER = "03_gather_sizing"
OK_RUN = {"quick": True, "repeats": 1}
FAILING_RUN = {"quick": True, "repeats": 0}  # the probe refuses repeats 0: the run fails in its probe cell


def _grid(tmp_path: Path, text: str, name: str = "grid.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _main(argv, capsys) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- grids --------------------------------------------------------------------------------------


def test_expand_is_the_product_then_the_explicit_runs():
    runs = batch.expand({"quick": True}, {"seed": [0, 1], "compress_ratio": [4, 8]}, [{"seed": 7}, {"seed": 0}])
    assert runs[:4] == [
        {"quick": True, "seed": 0, "compress_ratio": 4},
        {"quick": True, "seed": 0, "compress_ratio": 8},
        {"quick": True, "seed": 1, "compress_ratio": 4},
        {"quick": True, "seed": 1, "compress_ratio": 8},
    ]
    assert runs[4:] == [{"quick": True, "seed": 7}, {"quick": True, "seed": 0}]
    assert batch.expand({"quick": True}, {}, []) == [{"quick": True}]  # nothing varied: one run
    assert batch.expand({}, {"seed": [1, 1]}, []) == [{"seed": 1}]  # duplicates once


@pytest.mark.parametrize("grid", sorted(GRIDS.glob("*.toml")), ids=lambda p: p.name)
def test_every_example_grid_plans_small_checked_runs(grid, tmp_path):
    planned = batch.plan_grid(grid, tmp_path)
    assert 2 <= len(planned) <= 4
    assert all(run.parameters["quick"] is True for run in planned)
    assert len({run.run_dir for run in planned}) == len(planned)
    assert all(run.run_dir.parent == tmp_path / run.study for run in planned)
    assert list(tmp_path.iterdir()) == []  # planning writes nothing


def test_every_study_has_an_example_grid():
    assert {p.stem for p in notebooks.discover_notebooks()} <= {p.stem for p in GRIDS.glob("*.toml")}


def test_threads_keep_jobs_times_threads_within_the_cores():
    assert parallel.threads_per_run(1, cores=8) == 8
    assert parallel.threads_per_run(3, cores=8) == 2
    assert parallel.threads_per_run(2, cores=2) == 1
    for jobs in (0, -1, 3):
        with pytest.raises(AnelabInputError, match="--jobs"):
            parallel.threads_per_run(jobs, cores=2)


BAD_GRIDS = {
    "empty grid": ("", "empty grid"),
    "does not parse": ("[02_mask_fold\nvary = {", "not valid TOML"),
    "unknown study": ("[99_nothing]\nfixed = { quick = true }", "unknown study"),
    "undeclared parameter": ("[02_mask_fold]\nvary = { sed = [0, 1] }", "has no parameter 'sed'"),
    "wrong type": ("[02_mask_fold]\nvary = { seed = [0, 'one'] }", "parameter seed must be int"),
    "empty list": ("[02_mask_fold]\nvary = { seed = [] }", "non-empty list"),
    "unknown key": ("[02_mask_fold]\nvarry = { seed = [0] }", "only fixed, vary, runs"),
    "run directory set": ("[02_mask_fold]\nfixed = { records_dir = 'x' }", "set by the run"),
}


@pytest.mark.parametrize("case", list(BAD_GRIDS))
def test_bad_grid_exits_2_with_one_line_and_writes_nothing(case, tmp_path, capsys):
    text, message = BAD_GRIDS[case]
    grid = _grid(tmp_path, text)
    runs = tmp_path / "runs"
    code, out, err = _main(["batch", grid, "--jobs", "1", "--runs", runs], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err
    assert not runs.exists()


def test_bad_jobs_and_missing_grid_exit_2(tmp_path, capsys):
    grid = GRIDS / "02_mask_fold.toml"
    runs = tmp_path / "runs"
    for argv in (["--jobs", "0"], ["--jobs", str(parallel.available_cores() + 1)]):
        code, _, err = _main(["batch", grid, *argv, "--runs", runs], capsys)
        assert code == 2 and "--jobs" in err and err.count("\n") == 1
    code, _, err = _main(["batch", tmp_path / "absent.toml", "--runs", runs], capsys)
    assert code == 2 and "no such grid file" in err
    assert not runs.exists()
    assert batch.plan_grid(grid, runs)  # control: the same grid with good options plans


def test_emit_jobs_prints_runnable_commands_and_writes_nothing(tmp_path, capsys):
    grid = GRIDS / "04_setup_cost.toml"  # has a list-valued parameter, the hardest to quote
    runs = tmp_path / "runs"
    code, out, _ = _main(["batch", grid, "--jobs", "1", "--emit-jobs", "--runs", runs], capsys)
    assert code == 0 and not runs.exists()
    lines = out.splitlines()
    planned = batch.plan_grid(grid, runs)
    assert len(lines) == len(planned)
    for line, run in zip(lines, planned, strict=True):
        words = shlex.split(line)
        assert words[:2] == ["anelab", "run"]
        args = cli.build_parser().parse_args(words[1:])  # the CLI accepts it as written
        notebook = notebooks.resolve_notebook(args.notebook)
        assert notebooks.check_parameters(notebook, dict(args.params), from_text=True) == run.parameters
    mangled = shlex.split(lines[0].replace("[1, 2, 3]", "[1, 2, three]"))
    args = cli.build_parser().parse_args(mangled[1:])
    with pytest.raises(AnelabInputError, match="must be list"):
        notebooks.check_parameters(notebooks.resolve_notebook(args.notebook), dict(args.params), from_text=True)


# ---- headlines and the summary table ---------------------------------------------------------------


def _mask_fold_record(widths: dict[int, float]) -> dict:
    def width(chunk, error):
        check = {"fold_error": error, "causal_off": 0.5, "noise_ratio": 0.5 / error}
        return {"check": check, "control": {"fold_error": 1.1}}

    return {"kind": "mask_fold", "results": {"widths": {str(c): width(c, e) for c, e in widths.items()}}}


def test_headlines_read_the_widest_chunk_of_the_records():
    values = headline_values("02_mask_fold", [_mask_fold_record({32: 4e-4, 64: 8e-4})])
    assert values == {"fold_error": 8e-4, "causal_off": 0.5, "causal_off_over_noise": 625.0, "control_error": 1.1}
    other = {**_mask_fold_record({32: 1e-3}), "kind": "gather_probe_numpy"}
    assert set(headline_values("02_mask_fold", [other]).values()) == {None}  # wrong kind: nothing read
    assert all(h.name and h.label and h.unit for s in STUDIES for h in s.headlines)


def _fake_run(root: Path, study: str, params: dict, status: str, record: dict | None) -> Path:
    run_dir = root / study / notebooks.run_id(f"{study}.ipynb", params)
    (run_dir / "records").mkdir(parents=True)
    if record is not None:
        from anelab.core.records import make_record, write_record

        write_record(run_dir / "records", make_record(record["kind"], {}, record["results"]))
    notebooks.write_result(
        run_dir, Path(f"{study}.ipynb"), params, 1, ok=status == "ok", error="" if status == "ok" else "boom", seconds=1
    )
    return run_dir


def test_summary_table_and_figure(tmp_path):
    dirs = [
        _fake_run(tmp_path, "02_mask_fold", {"seed": s, "compress_ratio": c}, "ok", _mask_fold_record({64: e}))
        for s, c, e in ((0, 4, 1e-3), (1, 4, 3e-3), (0, 8, 2e-3))
    ]
    dirs.append(_fake_run(tmp_path, "02_mask_fold", {"seed": 1, "compress_ratio": 8}, "failed", None))
    results = {d: notebooks.read_result(d) for d in dirs}
    rows = summary_rows(results)
    assert [r["fold_error"] for r in rows] == [1e-3, 3e-3, 2e-3, None]
    assert rows[-1]["status"] == "failed: boom"
    parsed = list(csv.DictReader(io.StringIO(csv_table(rows))))
    assert [p["fold_error"] for p in parsed] == ["0.001", "0.003", "0.002", ""]
    md = markdown_table(rows).splitlines()
    assert len(md) == 2 + 4 and md[0].startswith("| study | run_id | status |") and "| — |" in md[-1]
    png = summary_figure(rows, "02_mask_fold", tmp_path / "summary", "g")
    manifest = json.loads((tmp_path / "summary" / "MANIFEST.json").read_text())["figures"]["summary_02_mask_fold"]
    assert png.is_file() and manifest["caption"] and manifest["alt"] and "3 runs" in manifest["caption"]
    one_x = [r for r in rows if json.loads(r["parameters"])["compress_ratio"] == 4]
    assert summary_figure(one_x, "02_mask_fold", tmp_path / "one", "g") is None  # one x value: no figure


# ---- the real thing: two runs through papermill with --jobs 2 ------------------------------------------


def _interval(result: dict) -> tuple[float, float]:
    end = dt.datetime.fromisoformat(result["finished"]).timestamp()
    return end - result["seconds"] - 1.0, end + 1.0  # finished has one-second resolution


def test_two_run_grid_with_two_jobs_through_papermill(tmp_path, capsys):
    grid = _grid(tmp_path, f"[{GATHER}]\nfixed = {{ quick = true }}\nruns = [ {{ repeats = 1 }}, {{ repeats = 0 }} ]\n")
    runs = tmp_path / "runs"
    code, out, _ = _main(["batch", grid, "--jobs", "2", "--runs", runs, "--timeout", "120"], capsys)
    assert code == 1  # one run failed on purpose
    ok_dir, failed_dir = (batch.plan_grid(grid, runs)[i].run_dir for i in (0, 1))
    ok, failed = notebooks.read_result(ok_dir), notebooks.read_result(failed_dir)
    assert ok["status"] == "ok" and ok["parameters"] == OK_RUN
    assert failed["status"] == "failed" and "repeats must be a positive integer" in failed["error"]
    assert ok["threads"] == failed["threads"] == parallel.available_cores() // 2
    (a0, a1), (b0, b1) = _interval(ok), _interval(failed)
    assert a0 < b1 and b0 < a1, "the two runs did not overlap: not run in parallel"
    for d in (ok_dir, failed_dir):
        assert (d / f"{GATHER}.ipynb").is_file() and (d / f"{GATHER}.html").is_file()
        assert (d / "parameters.json").is_file()
    assert json.loads((ok_dir / "figures" / "MANIFEST.json").read_text())["figures"]
    [record] = read_records(ok_dir / "records")
    rows = {r["graph"]: r for r in record["results"]["rows"]}
    expected = rows["gather"]["largest_intermediate_bytes"] / rows["full-scores"]["largest_intermediate_bytes"]

    summary = runs / "batch-grid"
    table = list(csv.DictReader(io.StringIO((summary / "summary.csv").read_text())))
    assert [t["run_id"] for t in table] == [ok_dir.name, failed_dir.name]
    assert float(table[0]["gather_over_dense_intermediate"]) == pytest.approx(expected)
    assert table[1]["status"].startswith("failed: ") and table[1]["gather_over_dense_intermediate"] == ""
    assert ok_dir.name in (summary / "summary.md").read_text() and "1 of 2 runs ok, 1 failed" in out

    # without --resume a finished run is never overwritten; with it the ok run is skipped, the failed one rerun
    code, _, err = _main(["batch", grid, "--jobs", "2", "--runs", runs], capsys)
    assert code == 2 and "--resume" in err
    planned = batch.plan_grid(grid, runs)
    assert batch.pending(planned, resume=True) == ([planned[1]], [planned[0]])
    before = (ok_dir / "result.json").read_bytes()
    only_ok = _grid(tmp_path, f"[{GATHER}]\nfixed = {{ quick = true }}\nruns = [ {{ repeats = 1 }} ]\n", "ok.toml")
    code, out, err = _main(["batch", only_ok, "--jobs", "2", "--runs", runs, "--resume"], capsys)
    assert code == 0 and "1 finished run(s) skipped" in out + err and "1 of 1 runs ok" in out
    assert (ok_dir / "result.json").read_bytes() == before  # not run again
    assert ok_dir.name in (runs / "batch-ok" / "summary.md").read_text()  # the summary still lists it


def test_an_interrupted_run_directory_is_cleared_but_nothing_else_is(tmp_path):
    interrupted = tmp_path / "interrupted"
    (interrupted / "records").mkdir(parents=True)
    (interrupted / "parameters.json").write_text("{}")
    (interrupted / "records" / "stale.json").write_text("{}")
    notebooks.clear_run_directory(interrupted)
    assert not interrupted.exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(AnelabInputError, match="not a run directory"):
        notebooks.clear_run_directory(foreign)
    assert (foreign / "keep.txt").is_file()
    done = _fake_run(tmp_path, "02_mask_fold", {"seed": 0}, "ok", None)
    with pytest.raises(AnelabInputError, match="successful run"):
        notebooks.clear_run_directory(done)


def test_mac_only_headlines_read_the_timing_records():
    """Setup seconds and the A/B ratio come from records only a Mac writes (anelab.runtimes.coreml.timing's format)."""

    def load(function, cold, median):
        return {
            "kind": "load_timing",
            "parameters": {"function": function, "cold": cold},
            "results": {"median_s": median},
        }

    loads = [load("h0", True, 0.5), load("h64", True, 0.75), load("h0", False, 0.1)]
    assert headline_values("04_setup_cost", loads)["setup_seconds"] == 1.25  # cold loads only, one per function

    def predict(history, gpu, ne):
        return {
            "kind": "predict_timing",
            "parameters": {"function": f"h{history}", "input_shapes": {"hidden": [64, 48]}},
            "results": {  # as anelab.runtimes.coreml.timing writes them: median, min and max of each setting
                "cpu_and_gpu": {"median_s": gpu, "min_s": gpu, "max_s": gpu},
                "cpu_and_ne": {"median_s": ne, "min_s": ne, "max_s": ne},
            },
        }

    values = headline_values("01_dense_offload", [predict(128, 0.3, 0.1), predict(0, 0.2, 0.1)])
    assert values == {"gpu_over_ane": pytest.approx(3.0)}  # the largest history, whatever the order
    assert headline_values("01_dense_offload", []) == {"gpu_over_ane": None}  # Linux: no record, no number
