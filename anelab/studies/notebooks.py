"""Running the study notebooks: papermill execution, executed copies, HTML export.

Every study is one notebook in ``notebooks/`` (``NOTEBOOKS``, in file-name order). A notebook has
exactly one cell tagged ``parameters``; the runner injects these parameters (each only if the
notebook declares it, except ``quick``, which every notebook must declare):

    quick        bool  small sizes, for the tests (each quick run stays well under a minute)
    figures_dir  str   where ``anelab.studies.figures.save_figure`` writes PNG/SVG + MANIFEST.json
    records_dir  str   where measured records go (``anelab.records.write_record``)
    build_dir    str   scratch space for packages and other build products

A full run (``make reproduce``) writes figures to the committed ``figures/`` and records to
``data/measured/``; a quick run keeps everything under the build directory, so tests never touch
the repository. Relative paths are relative to the repository root (``repo_path``): papermill
runs each notebook with the repository root as working directory, and a notebook opened in
JupyterLab (cwd ``notebooks/``) resolves its defaults the same way.

Each run has an execution timeout (seconds any one cell may take; papermill stops the kernel and
the run fails), leaves the executed copy in ``<build>/notebooks/`` and an HTML export in
``<build>/html/``, and prints one progress line.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from anelab.errors import AnelabInputError
from anelab.paths import FIGURES_DIR, MEASURED_DIR, NOTEBOOK_DIR, REPO_ROOT
from anelab.records import read_json_file

ANELAB_KERNEL = "anelab"  # the Makefile installs it into the venv (ipykernel --sys-prefix)


FALLBACK_KERNEL = "python3"  # jupyter_client runs a "python" kernelspec with this interpreter


QUICK_TIMEOUT = 120  # seconds per cell in quick runs


FULL_TIMEOUT = 3600  # seconds per cell in full runs


INJECTED = ("quick", "figures_dir", "records_dir", "build_dir")


def discover_notebooks(directory: str | os.PathLike = NOTEBOOK_DIR) -> list[Path]:
    """The study notebooks in ``directory``, ordered by file name (01_..., 02_..., ...)."""
    return sorted(p for p in Path(directory).glob("*.ipynb") if not p.name.startswith("."))


NOTEBOOKS: list[Path] = discover_notebooks()


def repo_path(path: str | os.PathLike) -> Path:
    """``path`` itself if absolute, else relative to the repository root."""
    p = Path(path)
    return p if p.is_absolute() else REPO_ROOT / p


def read_notebook(path: str | os.PathLike) -> dict:
    """A notebook's JSON (refused with a one-line message if it is not a readable notebook)."""
    path = Path(path)
    nb = read_json_file(path, "notebook")
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise AnelabInputError(f"{path}: not a notebook (no 'cells' list)")
    return nb


def parameter_cells(nb: dict) -> list[dict]:
    """Cells tagged ``parameters``."""
    return [c for c in nb["cells"] if "parameters" in (c.get("metadata", {}).get("tags") or [])]


def declared_parameters(path: str | os.PathLike) -> dict[str, dict]:
    """Top-level assignments of the notebook's ``parameters`` cell, as papermill reads them:
    {name: {"type": inferred type name, "default": source text, "help": trailing comment}}."""
    from papermill.translators import PythonTranslator

    cells = parameter_cells(read_notebook(path))
    if len(cells) != 1:
        raise AnelabInputError(f"{Path(path).name}: needs exactly one cell tagged 'parameters', found {len(cells)}")
    cell = dict(cells[0])
    if isinstance(cell.get("source"), list):
        cell["source"] = "".join(cell["source"])
    return {
        p.name: {"type": p.inferred_type_name, "default": p.default, "help": p.help}
        for p in PythonTranslator.inspect(cell)
    }


def output_problems(nb: dict) -> list[str]:
    """Why a notebook is not committable as-is: outputs, execution counts, or run metadata.

    The same checks as ``nbstripout --verify`` on the parts that matter for reproducibility.
    """
    problems = []
    for i, c in enumerate(nb["cells"]):
        if c.get("cell_type") == "code":
            if c.get("outputs"):
                problems.append(f"cell {i} has outputs")
            if c.get("execution_count") is not None:
                problems.append(f"cell {i} has an execution count")
        for key in ("execution", "papermill", "collapsed", "scrolled"):
            if key in c.get("metadata", {}):
                problems.append(f"cell {i} has metadata '{key}'")
    for key in ("papermill", "widgets"):
        if key in nb.get("metadata", {}):
            problems.append(f"notebook metadata has '{key}'")
    return problems


def kernel_name() -> str:
    """The kernel to run notebooks with: ``anelab`` if it is installed and runs this interpreter,
    else ``python3`` (which jupyter_client starts with this interpreter)."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    manager = KernelSpecManager()
    for name in (ANELAB_KERNEL, FALLBACK_KERNEL):
        try:
            spec = manager.get_kernel_spec(name)
        except NoSuchKernel:
            continue
        exe = spec.argv[0] if spec.argv else ""
        if exe in ("python", f"python{sys.version_info[0]}", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
            return name  # jupyter_client substitutes sys.executable
        if Path(exe).exists() and Path(exe).resolve() == Path(sys.executable).resolve():
            return name
        if name == ANELAB_KERNEL:
            continue  # an 'anelab' kernel of another environment: do not run the studies in it
        raise AnelabInputError(
            f"kernel {name!r} runs {exe}, not this interpreter ({sys.executable}); run 'make install'"
        )
    raise AnelabInputError(f"no Jupyter kernel for {sys.executable}; run 'make install' (installs the 'anelab' kernel)")


@dataclass
class NotebookRun:
    """Outcome of one notebook run."""

    notebook: str
    executed: Path
    html: Path | None
    seconds: float
    ok: bool
    error: str = ""
    parameters: dict = field(default_factory=dict)

    def line(self) -> str:
        where = self.html if self.html is not None else self.executed
        if self.ok:
            return f"{self.notebook}: ok in {self.seconds:.1f} s -> {where}"
        return f"{self.notebook}: FAILED after {self.seconds:.1f} s ({self.error}); executed copy: {self.executed}"


def run_parameters(quick: bool, build: Path) -> dict:
    """The injected parameters of a run (see the module docstring)."""
    build = Path(build).resolve()
    if quick:
        return {
            "quick": True,
            "figures_dir": str(build / "figures"),
            "records_dir": str(build / "records"),
            "build_dir": str(build),
        }
    return {"quick": False, "figures_dir": str(FIGURES_DIR), "records_dir": str(MEASURED_DIR), "build_dir": str(build)}


def export_html(executed: Path, dest: Path) -> Path:
    """Export an executed notebook to HTML (nbconvert), written atomically."""
    import nbformat
    from nbconvert import HTMLExporter

    from anelab.records import atomic_write_text

    nb = nbformat.read(str(executed), as_version=4)
    body, _ = HTMLExporter().from_notebook_node(nb)
    return atomic_write_text(dest, body)


def run_notebook(
    path: str | os.PathLike,
    *,
    quick: bool,
    build: str | os.PathLike = "build",
    timeout: float | None = None,
    parameters: dict | None = None,
    html: bool = True,
    kernel: str | None = None,
) -> NotebookRun:
    """Execute one notebook with papermill; returns a ``NotebookRun`` (never raises on a failing cell).

    quick: inject ``quick=True`` and keep figures/records under ``build``; timeout: seconds per
    cell (default ``QUICK_TIMEOUT`` / ``FULL_TIMEOUT``); parameters: overrides of the injected
    parameters; html: also export ``<build>/html/<name>.html``.
    """
    import papermill
    from papermill.exceptions import PapermillExecutionError

    path = Path(path).resolve()
    declared = declared_parameters(path)
    if "quick" not in declared:
        raise AnelabInputError(f"{path.name}: its parameters cell must declare 'quick: bool = False'")
    build = Path(build).resolve()
    params = {**run_parameters(quick, build), **(parameters or {})}
    params = {k: v for k, v in params.items() if k in declared}
    timeout = timeout if timeout is not None else (QUICK_TIMEOUT if quick else FULL_TIMEOUT)
    executed = build / "notebooks" / path.name
    executed.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    error = ""
    try:
        papermill.execute_notebook(
            str(path),
            str(executed),
            parameters=params,
            kernel_name=kernel or kernel_name(),
            language="python",
            cwd=str(REPO_ROOT),
            progress_bar=False,
            log_output=False,
            execution_timeout=timeout,
            request_save_on_cell_execute=False,
        )
    except PapermillExecutionError as e:
        error = f"cell {e.exec_count}: {e.ename}: {str(e.evalue).splitlines()[0] if e.evalue else ''}"
    except Exception as e:  # kernel death, cell timeout (nbclient raises its own types)
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    seconds = time.perf_counter() - started
    html_path = None
    if html and executed.exists():
        html_path = export_html(executed, build / "html" / (path.stem + ".html"))
    return NotebookRun(path.name, executed, html_path, seconds, ok=not error, error=error, parameters=params)


def run_all_notebooks(
    quick: bool = False,
    build: str | os.PathLike = "build",
    notebooks: list[Path] | None = None,
    timeout: float | None = None,
) -> bool:
    """Run every study notebook in order; one progress line each. True when all succeeded."""
    notebooks = discover_notebooks() if notebooks is None else [Path(p) for p in notebooks]
    if not notebooks:
        print(f"no notebooks in {NOTEBOOK_DIR}")
        return True
    runs = []
    with tqdm(notebooks, desc="notebooks", unit="nb") as bar:
        for nb in bar:
            bar.set_postfix_str(nb.name)
            run = run_notebook(nb, quick=quick, build=build, timeout=timeout)
            tqdm.write(run.line())
            runs.append(run)
    failed = [r.notebook for r in runs if not r.ok]
    if failed:
        print(f"{len(failed)} of {len(runs)} notebooks failed: {', '.join(failed)}")
    return not failed
