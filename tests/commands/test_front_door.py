"""The front door: doctor's study table, the CLI's errors and help, inspect's arena vs state, where a
lab session writes its figures, and the mode of generated files. Each test failed on the code before
issue 24 (doctor listed 5 of 7 studies, "anelab: error: anelab: ...", no "did you mean", ...)."""

from __future__ import annotations

import json
import os
import stat

import pytest
from conftest import TINY_GEOMETRIES

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.cli import main
from anelab.commands.plan_command import PLAN_EXAMPLES
from anelab.core.paths import REPO_ROOT
from anelab.core.records import atomic_write_text
from anelab.publish import notebooks
from anelab.publish.doctor import diagnose, format_report
from anelab.publish.studies import STUDIES, notebooks_without_a_row, study_of_figure
from anelab.runtimes.coreml.coreml_fake import FakeRuntime
from anelab.runtimes.coreml.coreml_runtime import MacRuntime

# ---- doctor: one table of the studies ---------------------------------------------------------------
STUDIES_DIR = REPO_ROOT / "anelab" / "studies"


def test_doctor_table_lists_every_notebook():
    names = [p.name for p in notebooks.discover_notebooks()]
    assert len(names) == 8
    assert notebooks_without_a_row(names) == []
    # negative control: the next notebook, without a row, is caught
    assert notebooks_without_a_row([*names, "09_next_study.ipynb"]) == ["09_next_study.ipynb"]


def notebook_study_imports(path) -> set[str]:
    """The ``anelab.studies`` modules a notebook's code cells import."""
    import ast

    found = set()
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        for node in ast.walk(ast.parse("".join(cell["source"]))):
            if isinstance(node, ast.ImportFrom) and node.module == "anelab.studies":
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("anelab.studies."):
                found.add(node.module.split(".")[2])
    return found


def study_modules(root=STUDIES_DIR) -> list[str]:
    """The back-end modules in ``anelab/studies/`` (``__init__`` aside)."""
    return sorted(p.stem for p in root.glob("*.py") if p.stem != "__init__")


def modules_no_study_uses(modules: list[str], studies=STUDIES) -> list[str]:
    """Modules of ``studies/`` that are no study's back-end: ``studies/`` holds one module per notebook."""
    return [m for m in modules if m not in {s.name for s in studies}]


def test_studies_holds_exactly_one_backend_per_notebook_which_the_notebook_imports():
    assert modules_no_study_uses(study_modules()) == []
    for study in STUDIES:
        assert (STUDIES_DIR / f"{study.name}.py").is_file(), study.backend
        assert study.name in notebook_study_imports(study.path), study.stem
    # negative control: a module no notebook backs is caught
    assert modules_no_study_uses([*study_modules(), "planner"]) == ["planner"]


def test_every_captioned_figure_belongs_to_one_study_and_its_notebook_draws_it():
    from anelab.publish.figures import caption_table, read_manifest

    claimed = [f for s in STUDIES for f in s.figures]
    assert len(claimed) == len(set(claimed))
    assert sorted(claimed) == sorted(caption_table())
    for name, entry in read_manifest()["figures"].items():
        assert study_of_figure(name).notebook.endswith(entry["notebook"]), name
    assert study_of_figure("no_such_figure") is None  # control


def test_doctor_json_lists_seven_studies_with_an_accurate_mode(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    listed = sorted(s["notebook"].rsplit("/", 1)[-1] for s in report["studies"].values())
    assert listed == [p.name for p in notebooks.discover_notebooks()]
    if not MacRuntime().available():
        modes = {name: s["mode"] for name, s in report["studies"].items()}
        assert modes["mask_fold"] == "runs here"  # docs/studies.md (and the README): 02 runs everything here
        assert {m for n, m in modes.items() if n != "mask_fold"} == {"partly"}
    # with the runtime every study runs here (the fake stands in for a Mac)
    assert {s["mode"] for s in diagnose(FakeRuntime())["studies"].values()} == {"runs here"}


def test_doctor_says_the_runtime_sentence_once(capsys):
    report = diagnose(MacRuntime(platform_name="linux"))  # unavailable on any host, a Mac included
    assert not report["runtime"]["available"] and report["runtime"]["reason"]
    text = format_report(report)
    assert text.count(report["runtime"]["reason"]) == 1
    assert "Neural Engine:   unavailable (no Core ML runtime, above)" in text


# ---- the CLI's errors and help ---------------------------------------------------------------------


def test_a_mistyped_command_gets_did_you_mean_and_one_prefix(capsys):
    assert main(["verfy"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("anelab: error: ") and err.count("anelab:") == 1
    assert "did you mean 'verify'?" in err
    # negative control: a word close to no command gets the list, not a guess
    assert main(["xyzzy"]) == 2
    err = capsys.readouterr().err
    assert "did you mean" not in err and "verify" in err


@pytest.mark.parametrize("argv", [["plan", "--bogus"], ["plan"], ["run", "02", "--threads"], ["compare-arms"]])
def test_every_cli_error_has_one_prefix(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("anelab: error: ") and err.count("anelab:") == 1, err


def test_plan_help_has_examples_that_run(capsys, tiny_checkpoint):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "anelab plan --family qwen3.8-125b-a6b-4bit --prompt-tokens 4333" in out
    commands = [line.split()[2:] for line in PLAN_EXAMPLES.splitlines() if line.strip().startswith("anelab plan")]
    assert (
        len(commands) == 10
    )  # with --backtest, --chip, --gpu-runtime and --gpu-runtimes (issue 30), --published-splits
    for argv in commands:
        if "--checkpoint" in argv:  # the example's path is the embedded default; the tiny one here
            argv = [str(tiny_checkpoint("qwen3")) if a.startswith("build/") else a for a in argv]
        assert main(["plan", *argv]) == 0, argv
        capsys.readouterr()
    # negative control: the same example with an unknown family is refused
    assert main(["plan", "--family", "no-such-family", "--prompt-tokens", "4333"]) == 2


# ---- inspect: the arena without the state, the state apart -------------------------------------------


def test_inspect_reports_the_arena_and_the_state_apart(tiny_checkpoint, tmp_path, capsys):
    from anelab.sidecar.export import export_sidecars
    from anelab.sidecar.inspection import inspect_package

    ckpt = tiny_checkpoint("qwen3_next")
    layer = TINY_GEOMETRIES["qwen3_next"].full_attention_layers[-1]
    g = TINY_GEOMETRIES["qwen3_next"]
    info = {}
    for capacity in (32, 128):
        [r] = export_sidecars(
            load_checkpoint(ckpt), tmp_path / f"c{capacity}", 8, None, [layer], graph="stateful-tiled", capacity=capacity,
            key_tile=8, query_tile=4,
        )  # fmt: skip
        info[capacity] = inspect_package(r.package)["functions"]["c8"]
    # the state: K and V, [kv_heads, capacity, head_dim] fp16 each
    for capacity, f in info.items():
        assert f["state_bytes"] == 2 * g.num_kv_heads * capacity * g.head_dim * 2
    assert info[32]["arena_bytes"] == info[128]["arena_bytes"] > 0  # tiled: flat in the capacity
    assert info[32]["arena_op"] not in ("read_state", "slice_update")
    # negative control: the old single number is the cache's own read, and grows with the capacity
    assert info[128]["largest_intermediate_bytes"] > info[32]["largest_intermediate_bytes"]
    assert info[128]["largest_intermediate_bytes"] == g.num_kv_heads * 128 * g.head_dim * 2
    assert main(["inspect", str(tmp_path / "c128" / f"layer_{layer}.mlpackage")]) == 0
    out = capsys.readouterr().out
    assert f"arena    {info[128]['arena_bytes']:,} B" in out and f"state    {info[128]['state_bytes']:,} B" in out


def test_inspect_of_a_stateless_package_has_no_state(tiny_checkpoint, tmp_path):
    from anelab.sidecar.export import export_sidecars
    from anelab.sidecar.inspection import inspect_package

    layer = TINY_GEOMETRIES["qwen3"].full_attention_layers[0]
    [r] = export_sidecars(load_checkpoint(tiny_checkpoint("qwen3")), tmp_path, 8, [0, 8], [layer])
    for f in inspect_package(r.package)["functions"].values():
        assert f["state_bytes"] == 0 and f["arena_bytes"] == f["largest_intermediate_bytes"]


# ---- a lab session writes figures under build/ --------------------------------------------------------


def _default_figures_dir(path) -> str:
    return notebooks.declared_parameters(path)["figures_dir"]["default"].strip("\"'")


def _writes_under_build(figures_dir: str) -> bool:
    return notebooks.repo_path(figures_dir).resolve().is_relative_to(notebooks.REPO_ROOT / "build")


@pytest.mark.parametrize("path", notebooks.discover_notebooks(), ids=lambda p: p.name)
def test_a_lab_session_writes_figures_under_build(path):
    assert _writes_under_build(_default_figures_dir(path))
    assert not _writes_under_build("figures")  # negative control: the committed folder is not build/


def test_the_publish_switch_sends_only_the_lab_default_to_the_committed_figures(monkeypatch):
    lab = notebooks.LAB_FIGURES_DIR
    monkeypatch.delenv(notebooks.PUBLISH_VARIABLE, raising=False)
    assert notebooks.figures_destination(lab) == notebooks.REPO_ROOT / "build" / "lab" / "figures"
    monkeypatch.setenv(notebooks.PUBLISH_VARIABLE, "0")  # control: switched off
    assert notebooks.figures_destination(lab) == notebooks.REPO_ROOT / "build" / "lab" / "figures"
    monkeypatch.setenv(notebooks.PUBLISH_VARIABLE, "1")
    assert notebooks.figures_destination(lab) == notebooks.REPO_ROOT / "figures"
    assert notebooks.figures_destination("build/x/figures") == notebooks.REPO_ROOT / "build" / "x" / "figures"


@pytest.mark.parametrize("path", notebooks.discover_notebooks(), ids=lambda p: p.name)
def test_every_notebook_saves_its_figures_where_the_switch_says(path):
    nb = notebooks.read_notebook(path)
    code = [
        "".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code" and c not in notebooks.parameter_cells(nb)
    ]
    assert _default_figures_dir(path) == notebooks.LAB_FIGURES_DIR
    assert sum("FIGURES, RECORDS, BUILD = figures_destination(figures_dir)," in c for c in code) == 1
    saves = [line for c in code for line in c.splitlines() if "save_figure(" in line]
    assert saves and all("figures_dir=FIGURES" in line for line in saves)
    assert not any("repo_path(figures_dir)" in c for c in code)  # a notebook bypassing the switch is caught here


def _make_lab_command(*overrides: str) -> str:
    import shutil
    import subprocess

    make = shutil.which("make")
    assert make, "make is needed (the README's two commands are make targets)"
    done = subprocess.run(
        [make, "-n", "lab", "VENV=/nonexistent-venv", *overrides],
        cwd=notebooks.REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if "jupyter lab" in line][-1]


def test_make_lab_publishes_only_when_told():
    assert _make_lab_command().startswith(f"{notebooks.PUBLISH_VARIABLE}=0 ")
    assert _make_lab_command("PUBLISH=1").startswith(f"{notebooks.PUBLISH_VARIABLE}=1 ")


LAB_BODY = """from pathlib import Path
import anelab.publish.notebooks as n
n.REPO_ROOT, n.FIGURES_DIR = Path({root!r}), Path({root!r}) / "figures"  # a copy of the repository layout
out = n.figures_destination(figures_dir)
out.mkdir(parents=True, exist_ok=True)
(out / "f.txt").write_text("figure")
"""


def _lab_notebook(path, root) -> dict:
    import nbformat

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell('quick: bool = False\nfigures_dir: str = "build/lab/figures"')
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell, nbformat.v4.new_code_cell(LAB_BODY.format(root=str(root)))]
    nbformat.write(nb, str(path))
    return nb


def test_a_lab_kernel_writes_figures_to_build_unless_started_to_publish(tmp_path):
    """A kernel started as JupyterLab starts it (inheriting make lab's environment) runs the lab default;
    under papermill (anelab run, make reproduce) the switch is off whatever the caller's environment."""
    from nbclient import NotebookClient

    for publish, root in (("0", tmp_path / "plain"), ("1", tmp_path / "published")):
        nb = _lab_notebook(tmp_path / f"lab{publish}.ipynb", root)
        with notebooks.kernel_environment({notebooks.PUBLISH_VARIABLE: publish}):
            NotebookClient(nb, kernel_name=notebooks.kernel_name(), timeout=60).execute()
    assert (tmp_path / "plain" / "build" / "lab" / "figures" / "f.txt").is_file()
    assert not (tmp_path / "plain" / "figures").exists()
    assert (tmp_path / "published" / "figures" / "f.txt").is_file()
    assert not (tmp_path / "published" / "build").exists()
    guarded = tmp_path / "guarded"
    _lab_notebook(tmp_path / "guarded.ipynb", guarded)
    with notebooks.kernel_environment({notebooks.PUBLISH_VARIABLE: "1"}):
        run = notebooks.run_notebook(
            tmp_path / "guarded.ipynb", quick=False, build=tmp_path / "build", html=False,
            parameters={"figures_dir": notebooks.LAB_FIGURES_DIR}, timeout=60,
        )  # fmt: skip
    assert run.ok, run.error
    assert (guarded / "build" / "lab" / "figures" / "f.txt").is_file() and not (guarded / "figures").exists()


# ---- generated files are readable by the group ------------------------------------------------------------


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_writes_get_the_umask_mode(tmp_path):
    saved = os.umask(0o022)
    try:
        assert _mode(atomic_write_text(tmp_path / "index.html", "x")) == 0o644
        os.umask(0o077)  # negative control: a private umask keeps files private
        assert _mode(atomic_write_text(tmp_path / "private.json", "x")) == 0o600
    finally:
        os.umask(saved)


def test_gallery_index_is_readable_by_the_group(tmp_path):
    from anelab.core.paths import FIGURES_DIR
    from anelab.publish.docs_site import build_docs

    saved = os.umask(0o022)
    try:
        index, _ = build_docs(FIGURES_DIR, tmp_path / "html", tmp_path / "docs")
    finally:
        os.umask(saved)
    assert _mode(index) == 0o644
