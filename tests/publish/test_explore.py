"""Widgets without a kernel and headless runs that cannot hang: the explore cells' controls and text,
progress bars off under papermill, repo-relative injected paths, a cell timeout sized from the last
run, a timed-out batch run retried once, and the HTML export's widget manager."""

from __future__ import annotations

import contextlib
import io
import json
import tarfile
import time

import ipywidgets as widgets
import nbformat
import pytest

from anelab import planner
from anelab.core.errors import AnelabInputError
from anelab.core.progress import HEADLESS_VARIABLE, tqdm
from anelab.publish import batch, explore, notebooks, widget_manager
from anelab.studies.mask_fold import BudgetPoint

SEED_TOKENS, SEED_CHUNK = 4333, 4096  # the seed's workload: 4,333 tokens, chunk 4,096


def reaches(control, value) -> bool:
    """Whether a reader can set ``control`` to ``value`` (a slider step or an option)."""
    if isinstance(control, widgets.IntSlider):
        return control.min <= value <= control.max and (value - control.min) % control.step == 0
    return value in control.options


def label_fits(control) -> bool:
    return not control.description or control.style.description_width == "initial"


def test_the_planner_sliders_reach_the_seed_workload_and_labels_fit():
    e = explore.plan_explorer("qwen3.5-2b-4bit")
    assert reaches(e.controls["prompt_tokens"], SEED_TOKENS) and reaches(e.controls["chunk"], SEED_CHUNK)
    assert e.values() == {"family": "qwen3.5-2b-4bit", "prompt_tokens": SEED_TOKENS, "chunk": SEED_CHUNK}
    assert all(label_fits(c) for c in e.controls.values())
    assert "prompt 4,333 tokens" in e.text() and "decision:" in e.text()
    # negative controls: the old slider (step 64 from 256) and the old label style
    old = widgets.IntSlider(value=4352, min=256, max=32768, step=64, description="prompt_tokens")
    assert not reaches(old, SEED_TOKENS) and not label_fits(old)


def test_the_design_explorer_reaches_its_tiles_and_says_why_a_tile_does_not_fit():
    e = explore.design_explorer(SEED_TOKENS, "qwen3.8-125b-a6b-4bit", key_tile=1024, query_tile=256)
    assert reaches(e.controls["key_tile"], 1024) and reaches(e.controls["query_tile"], 256)
    assert all(label_fits(c) for c in e.controls.values())
    assert e.text().startswith("C=1024, tiles 1024 x 256: arena ")
    custom = explore.design_explorer(SEED_TOKENS, "qwen3.8-125b-a6b-4bit", key_tile=768, query_tile=256)
    assert reaches(custom.controls["key_tile"], 768)  # a parameter off the default options is added


def test_a_budget_point_prints_as_formatted_numbers_not_a_repr():
    point = BudgetPoint(
        kept_blocks=7, compress_ratio=4, budget=31, mean_kept_keys=27.25, reference_moved=1.6910674349994759,
        package_moved=1.6911, fold_error=0.000817, greedy_agreement=0.6666,
    )  # fmt: skip
    text = explore.format_budget_point(point)
    assert "BudgetPoint(" not in text and "1.6910674349994759" not in text
    assert "reference 169.11%" in text and "budget 31 keys" in text and "67%" in text
    assert "BudgetPoint(" in repr(point)  # negative control: what the old cell printed


def _counter_explorer():
    slider = explore.int_slider("n", 3, 1, 10)
    return explore.Explorer(lambda n: f"n squared is {n * n}", {"n": slider})


def test_live_explorer_redraws_one_text_in_place_and_prints_nothing():
    e = _counter_explorer()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        box = explore.explorer_box(e, live=True)
    assert out.getvalue() == ""  # nothing printed: no stale copy beside the widget
    text = box.children[-1]
    assert "n squared is 9" in text.value
    e.controls["n"].value = 7
    assert "n squared is 49" in text.value and "n squared is 9" not in text.value
    assert not any(isinstance(w, widgets.Output) for w in box.children)  # no output capture


def test_headless_explorer_prints_the_text_once_beside_disabled_controls(monkeypatch):
    monkeypatch.setenv(HEADLESS_VARIABLE, "1")
    e = _counter_explorer()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        explore.show(e)
    assert out.getvalue().count("n squared is 9") == 1
    assert e.controls["n"].disabled
    monkeypatch.delenv(HEADLESS_VARIABLE)  # negative control: live, the controls stay enabled
    e = _counter_explorer()
    with contextlib.redirect_stdout(io.StringIO()):
        explore.show(e)
    assert not e.controls["n"].disabled


def test_progress_bars_are_off_only_when_headless(monkeypatch):
    monkeypatch.setenv(HEADLESS_VARIABLE, "1")
    assert tqdm(range(3), file=io.StringIO()).disable
    monkeypatch.delenv(HEADLESS_VARIABLE)
    assert not tqdm(range(3), file=io.StringIO()).disable


def test_injected_paths_are_repo_relative_inside_the_repository(tmp_path):
    inside = notebooks.run_parameters(True, notebooks.REPO_ROOT / "build" / "x")
    assert inside["figures_dir"] == "build/x/figures" and inside["build_dir"] == "build/x"
    assert notebooks.run_parameters(False, notebooks.REPO_ROOT / "build")["figures_dir"] == "figures"
    outside = notebooks.run_parameters(True, tmp_path)  # negative control: outside, absolute
    assert outside["figures_dir"] == str(tmp_path.resolve() / "figures")


def _executed(path, durations, quick=True, failed_cell=None):
    nb = nbformat.v4.new_notebook()
    nb.metadata["papermill"] = {"parameters": {"quick": quick}, "duration": sum(durations)}
    for i, seconds in enumerate(durations):
        cell = nbformat.v4.new_code_cell("pass")
        cell.metadata["papermill"] = {"duration": seconds, "exception": i == failed_cell, "status": "completed"}
        nb.cells.append(cell)
    nbformat.write(nb, str(path))
    return path


def test_cell_timeout_is_sized_from_the_last_run(tmp_path):
    nb = tmp_path / "02_x.ipynb"
    last = _executed(tmp_path / "last.ipynb", [1.0, 40.0, 3.0])
    assert notebooks.cell_timeout(nb, True, [last]) == 4 * 40.0 + 60
    full = _executed(tmp_path / "full.ipynb", [1.0, 50.0], quick=False)
    assert notebooks.cell_timeout(nb, False, [full]) == 300  # the floor of a full run
    long = _executed(tmp_path / "long.ipynb", [2000.0], quick=False)
    assert notebooks.cell_timeout(nb, False, [long]) == notebooks.FULL_TIMEOUT  # the cap
    # negative controls: another quick, a failed run and no run at all fall back to the defaults
    assert notebooks.cell_timeout(nb, False, [last]) == notebooks.FULL_TIMEOUT
    failed = _executed(tmp_path / "failed.ipynb", [1.0, 40.0], failed_cell=1)
    assert notebooks.cell_timeout(nb, True, [failed, tmp_path / "missing.ipynb"]) == notebooks.QUICK_TIMEOUT


def _notebook(path, body):
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("quick: bool = False  # small")
    params.metadata["tags"] = ["parameters"]
    nb.cells += [params, nbformat.v4.new_code_cell(body)]
    nbformat.write(nb, str(path))
    return path


HANGS_ONCE = """import os, time
from pathlib import Path
marker = Path(os.environ["ANELAB_TEST_MARKER"])
if not marker.exists():
    marker.write_text("first attempt")
    time.sleep(60)
print("second attempt done")
"""


def test_batch_retries_a_timed_out_run_once_and_says_so(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("ANELAB_TEST_MARKER", str(tmp_path / "marker"))
    nb = _notebook(tmp_path / "01_hang.ipynb", HANGS_ONCE)
    run = batch.PlannedRun(nb, {"quick": True}, tmp_path / "runs" / "a")
    started = time.perf_counter()
    result = batch._execute(run, threads=1, timeout=8)
    assert time.perf_counter() - started < 55  # the hang became a timeout, not a 60 s wait
    assert result["status"] == "ok" and result["timed_out"] is False
    assert result["retried"].startswith("first attempt timed out: CellTimeoutError")
    out = capfd.readouterr().out
    assert "01_hang" in out and "timed out" in out and "retrying once" in out
    # negative control: a run that always hangs is retried once, then recorded as a timed-out failure
    monkeypatch.setenv("ANELAB_TEST_MARKER", str(tmp_path / "never"))
    always = _notebook(tmp_path / "02_always.ipynb", "import time\ntime.sleep(60)")
    result = batch._execute(batch.PlannedRun(always, {"quick": True}, tmp_path / "runs" / "b"), 1, timeout=4)
    assert result["status"] == "failed" and result["timed_out"] is True and result["retried"]


def test_html_export_loads_no_widget_manager_from_a_cdn(tmp_path):
    nb = _notebook(tmp_path / "w.ipynb", "import ipywidgets\nipywidgets.IntSlider(3)")
    run = notebooks.run_notebook(nb, quick=True, build=tmp_path / "build", timeout=60)
    assert run.ok, run.line()
    executed = json.loads(run.executed.read_text())
    assert "application/vnd.jupyter.widget-state+json" in executed["metadata"]["widgets"]
    page = run.html.read_text()
    assert widget_manager.RENDERER_URL in page
    for cdn in ("unpkg.com/@jupyter-widgets", "cdn.jsdelivr.net/npm/@jupyter-widgets", "require.min.js"):
        assert cdn not in page
    # negative control: nbconvert's default export does load it from a CDN
    from nbconvert import HTMLExporter

    default, _ = HTMLExporter().from_notebook_node(nbformat.read(str(run.executed), as_version=4))
    assert "@jupyter-widgets/html-manager@" in default


def test_the_vendored_widget_manager_is_refused_unless_it_is_the_pinned_tarball(tmp_path):
    fake = tmp_path / widget_manager.tarball_name()
    payload = tmp_path / "embed.js"
    payload.write_text("alert('not the widget manager')")
    with tarfile.open(fake, "w:gz") as tar:
        tar.add(payload, arcname="package/dist/embed.js")
    with pytest.raises(AnelabInputError, match="integrity differs"):
        widget_manager.extract_bundle(fake, tmp_path / "docs")
    assert not (tmp_path / "docs").exists()
    assert widget_manager.integrity_of(b"") == (
        "sha512-z4PhNX7vuL3xVChQ1m2AB9Yg5AULVxXcg/SpIdNs6c5H0NE8XYXysP+DGNKHfuwvY7kxvUdBeoGlODJ6+SfaPg=="
    )  # npm's format: sha512 of the empty input, base64
    # the pinned version is one a tested ipywidgets speaks to (widget state version 2)
    assert widget_manager.VERSION.startswith("1.") and int(widgets.__version__.split(".")[0]) == 8
    assert planner.REFERENCE_TOKENS == SEED_TOKENS and planner.REFERENCE_CHUNK == SEED_CHUNK
