"""Every study notebook: committed without outputs, one ``parameters`` cell with ``quick``, and a
successful quick run through papermill (discovered from notebooks/, so new notebooks are covered).
Plus the runner itself: a failing or hanging notebook is reported as failed, never as a pass."""

from __future__ import annotations

import html
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from anelab.core import paths
from anelab.core.errors import AnelabInputError
from anelab.publish import notebooks

NOTEBOOKS = notebooks.discover_notebooks()
IDS = [p.name for p in NOTEBOOKS]
QUICK_TIMEOUT = 120  # seconds per cell
NBSTRIPOUT = Path(sys.executable).parent / "nbstripout"


def _snapshot(directory: Path) -> dict:
    if not directory.exists():
        return {}
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in directory.rglob("*")}


def _tiny_notebook(path: Path, body: str, parameters: str | None = "quick: bool = False") -> Path:
    nb = nbformat.v4.new_notebook()
    if parameters is not None:
        cell = nbformat.v4.new_code_cell(parameters)
        cell.metadata["tags"] = ["parameters"]
        nb.cells.append(cell)
    nb.cells.append(nbformat.v4.new_code_cell(body))
    nbformat.write(nb, str(path))
    return path


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def executed_problems(nb) -> list[str]:
    """What a reader of an executed notebook would stumble on: stderr blocks (text progress bars),
    widgets outside the explore cells (empty gaps where progress bars were), an explore cell whose
    numbers are not printed as text, or a dataclass repr printed instead of numbers."""
    problems = []
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        outputs = cell.get("outputs", [])
        texts = "".join(o.get("text", "") for o in outputs if o.output_type == "stream" and o.name == "stdout")
        if any(o.output_type == "stream" and o.name == "stderr" for o in outputs):
            problems.append(f"code cell {i}: stderr output")
        widgets = [o for o in outputs if WIDGET_VIEW in o.get("data", {})]
        if "explore.show(" in cell.source:
            if len(widgets) != 1 or not texts.strip():
                problems.append(f"code cell {i}: an explore cell needs its text printed and one widget")
        elif widgets:
            problems.append(f"code cell {i}: {len(widgets)} widget output(s) outside an explore cell")
        if "Point(" in texts:
            problems.append(f"code cell {i}: a dataclass repr printed")
    return problems


def test_executed_notebook_checks_catch_noise():
    """Negative control for ``executed_problems``: stderr, a stray widget and a bare repr are caught."""
    nb = nbformat.v4.new_notebook()
    noisy = nbformat.v4.new_code_cell("for i in tqdm(range(3)): pass")
    noisy.outputs = [nbformat.v4.new_output("stream", name="stderr", text="100%|###| 3/3\n")]
    bar = nbformat.v4.new_code_cell("x")
    bar.outputs = [nbformat.v4.new_output("display_data", data={WIDGET_VIEW: {"model_id": "1"}, "text/plain": ""})]
    widget = nbformat.v4.new_code_cell("explore.show(e)")
    widget.outputs = [nbformat.v4.new_output("stream", name="stdout", text="BudgetPoint(kept_blocks=7)\n")]
    nb.cells += [noisy, bar, widget]
    assert len(executed_problems(nb)) == 4


def test_the_studies_are_discovered_in_order():
    names = [p.name for p in NOTEBOOKS]
    assert {"02_mask_fold.ipynb", "03_gather_sizing.ipynb"} <= set(names)
    assert names == sorted(names)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_is_committed_without_outputs(path):
    nb = notebooks.read_notebook(path)
    assert notebooks.output_problems(nb) == []
    verify = subprocess.run([str(NBSTRIPOUT), "--verify", str(path)], capture_output=True, text=True)
    assert verify.returncode == 0, f"{path.name} is not stripped; run: .venv/bin/nbstripout {path}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_has_one_parameters_cell_with_quick(path):
    nb = notebooks.read_notebook(path)
    assert len(notebooks.parameter_cells(nb)) == 1
    declared = notebooks.declared_parameters(path)
    assert declared["quick"]["default"] == "False"
    assert declared["quick"]["type"] == "bool"
    assert all(p["help"] for p in declared.values()), "every parameter needs a trailing comment"


def test_output_checks_catch_an_executed_notebook(tmp_path):
    """Negative control for the two checks above: a notebook with an output fails both."""
    path = tmp_path / "dirty.ipynb"
    nb = nbformat.read(str(NOTEBOOKS[0]), as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.outputs = [nbformat.v4.new_output("stream", text="hello\n")]
    code.execution_count = 3
    nbformat.write(nb, str(path))
    problems = notebooks.output_problems(notebooks.read_notebook(path))
    assert any("outputs" in p for p in problems) and any("execution count" in p for p in problems)
    assert subprocess.run([str(NBSTRIPOUT), "--verify", str(path)], capture_output=True).returncode != 0


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs_in_quick_mode(path, tmp_path):
    watched = [paths.FIGURES_DIR, paths.MEASURED_DIR]
    before = [_snapshot(d) for d in watched]
    run = notebooks.run_notebook(path, quick=True, build=tmp_path, timeout=QUICK_TIMEOUT)
    assert run.ok, run.line()
    assert run.executed.is_file() and run.html is not None and run.html.is_file()
    assert run.parameters["quick"] is True
    assert [_snapshot(d) for d in watched] == before, "a quick run wrote into the repository"
    executed = nbformat.read(str(run.executed), as_version=4)
    assert executed_problems(executed) == []
    page = run.html.read_text()
    for cell in (c for c in executed.cells if c.cell_type == "code" and "explore.show(" in c.source):
        # without a kernel or a widget manager, the HTML still holds the explore cell's numbers as text
        printed = "".join(o.text for o in cell.outputs if o.output_type == "stream")
        text = html.unescape(page)  # nbconvert and html.escape spell quotes differently (&#39; / &#x27;)
        assert all(line in text for line in printed.splitlines() if line.strip())
        assert "application/vnd.jupyter.widget-state+json" in page  # and the widgets' state, for the manager
    manifest = tmp_path / "figures" / "MANIFEST.json"
    if manifest.exists():
        import hashlib

        for name, entry in json.loads(manifest.read_text())["figures"].items():
            assert entry["notebook"] == path.name
            for fmt, f in entry["files"].items():
                assert hashlib.sha256((tmp_path / "figures" / f["path"]).read_bytes()).hexdigest() == f["sha256"]


def test_run_all_reports_a_failing_notebook(tmp_path, capsys):
    good = _tiny_notebook(tmp_path / "01_good.ipynb", "print('fine', quick)")
    bad = _tiny_notebook(tmp_path / "02_bad.ipynb", "raise ValueError('boom')")
    assert notebooks.run_all_notebooks(quick=True, build=tmp_path / "build", notebooks=[good, bad], timeout=60) is False
    out = capsys.readouterr()
    text = out.out + out.err
    assert "01_good.ipynb: ok" in text
    assert "02_bad.ipynb: FAILED" in text and "ValueError" in text and "boom" in text
    assert (tmp_path / "build" / "notebooks" / "02_bad.ipynb").is_file()  # the executed copy shows where it failed
    assert notebooks.run_all_notebooks(quick=True, build=tmp_path / "build", notebooks=[good], timeout=60) is True


def test_run_all_with_two_jobs_runs_every_notebook_and_reports_a_failure(tmp_path, capsys):
    """Two workers: every notebook runs (each kernel capped at cores // 2 BLAS threads), a failing one
    is reported and fails the whole run, and each leaves its executed copy."""
    body = "import os\nprint('threads', os.environ.get('OMP_NUM_THREADS'))"
    good = _tiny_notebook(tmp_path / "01_good.ipynb", body)
    bad = _tiny_notebook(tmp_path / "02_bad.ipynb", "raise ValueError('boom')")
    other = _tiny_notebook(tmp_path / "03_other.ipynb", body)
    build = tmp_path / "build"
    assert (
        notebooks.run_all_notebooks(quick=True, build=build, notebooks=[good, bad, other], timeout=60, jobs=2) is False
    )
    out = capsys.readouterr()
    text = out.out + out.err
    assert "01_good.ipynb: ok" in text and "03_other.ipynb: ok" in text
    assert "02_bad.ipynb: FAILED" in text and "boom" in text
    from anelab.core.parallel import threads_per_run

    executed = nbformat.read(str(build / "notebooks" / "03_other.ipynb"), as_version=4)
    printed = "".join(o.get("text", "") for c in executed.cells for o in c.get("outputs", []))
    assert f"threads {threads_per_run(2)}" in printed
    assert notebooks.run_all_notebooks(quick=True, build=build, notebooks=[good, other], timeout=60, jobs=2) is True


def test_longest_first_orders_by_the_previous_run(tmp_path):
    """Never-run notebooks first (file order), then the previous durations, longest first."""
    nbs = [tmp_path / f"0{i}_x.ipynb" for i in range(1, 5)]
    build = tmp_path / "build"
    assert notebooks.longest_first(nbs, build) == nbs  # nothing ran yet: file order
    (build / "notebooks").mkdir(parents=True)
    for nb, seconds in zip(nbs[1:], (5.0, 300.0, 20.0)):  # 01 never ran
        (build / "notebooks" / nb.name).write_text(json.dumps({"metadata": {"papermill": {"duration": seconds}}}))
    assert notebooks.previous_seconds(build, nbs[2]) == 300.0
    assert notebooks.previous_seconds(build, nbs[0]) is None
    assert notebooks.longest_first(nbs, build) == [nbs[0], nbs[2], nbs[3], nbs[1]]
    (build / "notebooks" / nbs[3].name).write_text("{")  # an unreadable copy counts as never run
    assert notebooks.longest_first(nbs, build) == [nbs[0], nbs[3], nbs[2], nbs[1]]


def test_reproduce_runs_notebooks_one_at_a_time_when_a_device_times_them():
    from anelab.core.parallel import available_cores
    from anelab.publish.reproduce import MAX_JOBS, reproduce_jobs

    assert reproduce_jobs(device_available=True) == 1
    assert reproduce_jobs(device_available=False) == min(MAX_JOBS, available_cores())


def test_a_cell_past_the_timeout_fails_the_run(tmp_path):
    slow = _tiny_notebook(tmp_path / "slow.ipynb", "import time\ntime.sleep(60)")
    run = notebooks.run_notebook(slow, quick=True, build=tmp_path / "build", timeout=2, html=False)
    assert not run.ok
    assert run.seconds < 50
    assert "timed out" in run.error.lower() or "timeout" in run.error.lower()


def test_notebook_structure_is_refused_before_running(tmp_path):
    none = _tiny_notebook(tmp_path / "none.ipynb", "pass", parameters=None)
    with pytest.raises(AnelabInputError, match="exactly one cell tagged 'parameters'"):
        notebooks.run_notebook(none, quick=True, build=tmp_path)
    no_quick = _tiny_notebook(tmp_path / "noquick.ipynb", "pass", parameters="seed: int = 0")
    with pytest.raises(AnelabInputError, match="quick"):
        notebooks.run_notebook(no_quick, quick=True, build=tmp_path)
    (tmp_path / "broken.ipynb").write_text("{")
    with pytest.raises(AnelabInputError, match="not valid notebook JSON"):
        notebooks.run_notebook(tmp_path / "broken.ipynb", quick=True, build=tmp_path)


def test_run_parameters_keep_quick_runs_out_of_the_repository(tmp_path):
    quick = notebooks.run_parameters(True, tmp_path)
    assert all(Path(quick[k]).is_relative_to(tmp_path.resolve()) for k in ("figures_dir", "records_dir", "build_dir"))
    full = notebooks.run_parameters(False, tmp_path)
    assert notebooks.repo_path(full["figures_dir"]) == paths.FIGURES_DIR  # written repo-relative: "figures"
    assert notebooks.repo_path(full["records_dir"]) == paths.MEASURED_DIR
    assert notebooks.repo_path("figures") == paths.FIGURES_DIR
    assert notebooks.repo_path(tmp_path) == tmp_path


def test_kernel_runs_this_interpreter():
    assert notebooks.kernel_name() in (notebooks.ANELAB_KERNEL, notebooks.FALLBACK_KERNEL)


# ---- anelab run: study resolution, parameter checks, run directories ---------------------------------


def _run_cli(argv, capsys) -> tuple[int, str, str]:
    from anelab import cli

    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_study_resolves_by_number_stem_name_or_path():
    mask_fold = paths.NOTEBOOK_DIR / "02_mask_fold.ipynb"
    for spec in ("2", "02", "02_mask_fold", "02_mask_fold.ipynb", str(mask_fold)):
        assert notebooks.resolve_notebook(spec) == mask_fold
    with pytest.raises(AnelabInputError, match="unknown study '9'.*02_mask_fold"):
        notebooks.resolve_notebook("9")


def test_parameters_are_checked_against_the_parameters_cell():
    nb = notebooks.resolve_notebook("02")
    text = {"quick": "true", "seed": "3", "edge_fraction": "0.5", "compress_ratio": "8"}
    assert notebooks.check_parameters(nb, text, from_text=True) == {
        "quick": True,
        "seed": 3,
        "edge_fraction": 0.5,
        "compress_ratio": 8,
    }
    assert notebooks.check_parameters(nb, {"edge_fraction": 1}) == {"edge_fraction": 1.0}  # int is a float
    bad = {
        "undeclared": ({"sede": "3"}, "has no parameter 'sede'; 02_mask_fold declares quick: bool"),
        "int as text": ({"seed": "three"}, "parameter seed must be int"),
        "bool as text": ({"quick": "maybe"}, "parameter quick must be bool"),
        "run directory": ({"figures_dir": "x"}, "set by the run"),
    }
    for values, message in bad.values():
        with pytest.raises(AnelabInputError, match=message):
            notebooks.check_parameters(nb, values, from_text=True)
    with pytest.raises(AnelabInputError, match="parameter seed must be int"):
        notebooks.check_parameters(nb, {"seed": 1.5})  # typed values (grids) are checked too
    with pytest.raises(AnelabInputError, match="parameter seed must be int"):
        notebooks.check_parameters(nb, {"seed": True})


def test_run_ids_are_stable_per_machine_and_differ_across_machines(monkeypatch):
    a = notebooks.run_id("02_mask_fold.ipynb", {"seed": 1})
    assert a == notebooks.run_id("02_mask_fold.ipynb", {"seed": 1})
    assert a != notebooks.run_id("02_mask_fold.ipynb", {"seed": 2})
    monkeypatch.setattr(notebooks.platform, "node", lambda: "another-mac")
    other = notebooks.run_id("02_mask_fold.ipynb", {"seed": 1})
    assert other != a and other.split("-")[0] == a.split("-")[0]


def test_run_writes_a_run_directory_with_thread_limits(tmp_path, capsys):
    nb = _tiny_notebook(
        tmp_path / "tiny.ipynb",
        "import os\nprint('threads', os.environ.get('OMP_NUM_THREADS'), 'n', n)",
        parameters="quick: bool = False  # switch\nn: int = 1  # a number",
    )
    out_dir = tmp_path / "run"
    code, out, err = _run_cli(["run", nb, "-p", "n", "3", "--threads", "1", "--out", out_dir], capsys)
    assert code == 0, err
    # this notebook writes no figures or records, so only the run's own files are there
    assert sorted(p.name for p in out_dir.iterdir()) == ["parameters.json", "result.json", "tiny.html", "tiny.ipynb"]
    assert json.loads((out_dir / "parameters.json").read_text()) == {"n": 3}
    result = json.loads((out_dir / "result.json").read_text())
    assert result["status"] == "ok" and result["threads"] == 1 and result["parameters"] == {"n": 3}
    executed = nbformat.read(str(out_dir / "tiny.ipynb"), as_version=4)
    printed = "".join(o.get("text", "") for c in executed.cells for o in c.get("outputs", []))
    assert "threads 1 n 3" in printed
    code, _, err = _run_cli(["run", nb, "-p", "n", "4", "--out", out_dir], capsys)
    assert code == 2 and "already holds a finished run" in err  # never overwritten
    assert json.loads((out_dir / "parameters.json").read_text()) == {"n": 3}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "99"], "unknown study"),
        (["run", "02", "-p", "sede", "1"], "has no parameter 'sede'"),
        (["run", "02", "-p", "seed", "x"], "parameter seed must be int"),
        (["run", "02", "-p", "seed", "1", "-p", "seed", "2"], "given twice"),
    ],
)
def test_run_bad_input_exits_2_and_writes_nothing(argv, message, tmp_path, capsys):
    out_dir = tmp_path / "run"
    code, out, err = _run_cli([*argv, "--out", out_dir], capsys)
    assert code == 2 and message in err and err.count("\n") == 1 and out == ""
    assert not out_dir.exists()


def test_publish_writes_figures_to_the_committed_folder_only_when_asked(tmp_path, monkeypatch):
    nb = _tiny_notebook(
        tmp_path / "fig.ipynb",
        "from pathlib import Path\nPath(figures_dir).mkdir(parents=True, exist_ok=True)\n"
        "(Path(figures_dir) / 'f.txt').write_text('figure')",
        parameters='quick: bool = False  # switch\nfigures_dir: str = "figures"  # where figures go',
    )
    committed, repo = tmp_path / "committed_figures", tmp_path / "repo"
    repo.mkdir()  # the kernel runs in the (patched) repository root
    monkeypatch.setattr(notebooks, "FIGURES_DIR", committed)
    monkeypatch.setattr(notebooks, "REPO_ROOT", repo)
    plain = notebooks.run_study(nb, {}, out=tmp_path / "plain")
    assert plain.ok and (tmp_path / "plain" / "figures" / "f.txt").is_file() and not committed.exists()
    published = notebooks.run_study(nb, {}, out=tmp_path / "published", publish=True)
    assert published.ok and (committed / "f.txt").is_file()
    assert not (tmp_path / "published" / "figures").exists()
    assert (repo / "build" / "html" / "fig.html").is_file()  # where make docs links the notebook


def test_run_resume_skips_a_finished_run_and_reruns_a_failed_one(tmp_path, capsys):
    nb = _tiny_notebook(
        tmp_path / "flaky.ipynb", "assert n == 1", parameters="quick: bool = False  # s\nn: int = 0  # n"
    )
    out_dir = tmp_path / "run"
    code, _, _ = _run_cli(["run", nb, "--out", out_dir], capsys)
    assert code == 1 and notebooks.read_result(out_dir)["status"] == "failed"
    code, _, _ = _run_cli(["run", nb, "-p", "n", "1", "--out", out_dir, "--resume"], capsys)
    assert code == 0 and notebooks.read_result(out_dir)["status"] == "ok"  # the failed run ran again
    code, out, _ = _run_cli(["run", nb, "-p", "n", "1", "--out", out_dir, "--resume"], capsys)
    assert code == 0 and "skipped (--resume)" in out


def test_a_fresh_checkout_starts_the_studies_longest_first(tmp_path):
    """With no previous run, the studies' ``typical_seconds`` order them: the two real-model studies (05, 07) start at
    once, the short ones fill in around them; a notebook no study names keeps the front, a previous run's duration
    overrides the table (the control: 07 made short)."""
    from anelab.publish.studies import STUDIES

    nbs = [Path(s.notebook) for s in STUDIES]
    order = [nb.stem for nb in notebooks.longest_first(nbs, tmp_path / "build")]
    assert set(order[:2]) == {"05_tiled_stateful", "07_whole_model_arms"}
    assert [s.typical_seconds for s in sorted(STUDIES, key=lambda s: order.index(s.stem))] == sorted(
        (s.typical_seconds for s in STUDIES), reverse=True
    )
    stray = tmp_path / "09_new.ipynb"
    assert notebooks.longest_first([*nbs, stray], tmp_path / "build")[0] == stray
    (tmp_path / "build" / "notebooks").mkdir(parents=True)
    (tmp_path / "build" / "notebooks" / "07_whole_model_arms.ipynb").write_text(
        json.dumps({"metadata": {"papermill": {"duration": 1.0}}})
    )
    assert notebooks.longest_first(nbs, tmp_path / "build")[-1].stem == "07_whole_model_arms"


def test_reproduce_gives_each_notebook_kernel_its_share(monkeypatch):
    import os

    from anelab.core import parallel

    monkeypatch.delenv(parallel.CORE_BUDGET_VARIABLE, raising=False)
    with notebooks.thread_limits(1):
        assert os.environ[parallel.CORE_BUDGET_VARIABLE] == "1" and os.environ["OPENBLAS_NUM_THREADS"] == "1"
    assert parallel.CORE_BUDGET_VARIABLE not in os.environ  # restored on leaving


SHOWN_FIGURE = """
import io
import matplotlib.pyplot as plt
from PIL import Image
from anelab.publish import figures
figures.use_style()
{setup}
fig, axes = plt.subplots(1, 2, figsize=(9.4, 3.6))
for ax in axes:
    ax.plot([1, 2, 3], [1, 2, 3]); ax.set_xlabel("prompt tokens")
figures.label_provenance(axes[-1], "a provenance note as long as a real one, predicted by the planner", recorded=False)
saved = Image.open(io.BytesIO(figures.figure_bytes(fig, "png"))).size
plt.show()
print("saved", saved)
"""


def _shown_and_saved(tmp_path, setup: str) -> tuple[tuple[int, int], tuple[int, int]]:
    import base64
    import io

    import papermill
    from PIL import Image

    path = _tiny_notebook(tmp_path / "shown.ipynb", SHOWN_FIGURE.format(setup=setup), parameters=None)
    out = tmp_path / "shown.out.ipynb"
    papermill.execute_notebook(str(path), str(out), kernel_name=notebooks.kernel_name(), progress_bar=False)
    outputs = nbformat.read(str(out), as_version=4).cells[0].outputs
    png = next(o.data["image/png"] for o in outputs if "image/png" in o.get("data", {}))
    saved = next(o.text for o in outputs if o.get("name") == "stdout").split("saved ", 1)[1].strip()
    return Image.open(io.BytesIO(base64.b64decode(png))).size, tuple(int(v) for v in saved.strip("()").split(","))


def test_a_notebook_shows_a_figure_as_it_is_saved_footer_and_all(tmp_path):
    """The inline backend's default "tight" crop moved the panels onto the provenance footer in the notebooks' HTML;
    ``figures.use_style`` has figures shown at their saved size. Control: with the crop put back, the shown image
    is another size than the saved one."""
    shown, saved = _shown_and_saved(tmp_path, setup="")
    assert shown == saved
    cropped, saved = _shown_and_saved(
        tmp_path,
        setup="from matplotlib_inline.backend_inline import set_matplotlib_formats\n"
        "set_matplotlib_formats('png', bbox_inches='tight')",
    )
    assert cropped != saved
    from anelab.publish import figures

    assert figures.show_as_saved() is False  # outside a kernel (here): nothing to set
