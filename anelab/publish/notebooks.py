"""Running the study notebooks: papermill execution, executed copies, HTML export.

Every study is one notebook in ``notebooks/`` (``NOTEBOOKS``, in file-name order). A notebook has
exactly one cell tagged ``parameters``; the runner injects these parameters (each only if the
notebook declares it, except ``quick``, which every notebook must declare):

    quick        bool  small sizes, for the tests (each quick run stays well under a minute)
    figures_dir  str   where ``anelab.publish.figures.save_figure`` writes PNG/SVG + MANIFEST.json
    records_dir  str   where measured records go (``anelab.core.records.write_record``)
    build_dir    str   scratch space for packages and other build products

A full run (``make reproduce``) writes figures to the committed ``figures/`` and records to
``data/measured/``; a quick run keeps everything under the build directory, so tests never touch
the repository. Relative paths are relative to the repository root (``repo_path``): papermill
runs each notebook with the repository root as working directory, and a notebook opened in
JupyterLab (cwd ``notebooks/``) resolves its defaults the same way.

Each run has an execution timeout (seconds any one cell may take; papermill stops the kernel and
the run fails, marked ``timed_out``), sized from the last run's cell durations (``cell_timeout``) so
a hung cell becomes a recorded failure in minutes, not an hour. The kernel runs headless
(``anelab.core.progress.HEADLESS_VARIABLE``): no progress bars, and the explore cells print their numbers
as text beside disabled controls (``anelab.publish.explore``). A run leaves the executed copy in
``<build>/notebooks/`` and an HTML export in ``<build>/html/``, and prints one progress line.
Injected paths inside the repository are written relative to its root, as a reader would type them.

``anelab run`` (``run_study``) runs one study into a run directory ``runs/<study>/<run id>/``:
the executed notebook and its HTML, ``figures/``, ``records/``, ``build/`` (scratch),
``parameters.json`` and, written last, ``result.json`` (status, error, seconds, machine). Its
parameters are checked against the notebook's ``parameters`` cell first (``check_parameters``):
an undeclared name or a value of the wrong type is refused before anything is written. The run
id is a hash of the study and its parameters plus a tag of the machine, so the same grid run on
two machines gives two directories that merge side by side.
"""

from __future__ import annotations

import ast
import contextlib
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from anelab.core.errors import AnelabInputError
from anelab.core.parallel import CORE_BUDGET_VARIABLE, threads_per_run
from anelab.core.paths import FIGURES_DIR, MEASURED_DIR, NOTEBOOK_DIR, REPO_ROOT, RUNS_DIR
from anelab.core.progress import HEADLESS_VARIABLE, tqdm
from anelab.core.records import atomic_write_text, machine_description, read_json_file
from anelab.publish.docs_site import TEMPLATE_DIR
from anelab.publish.studies import STUDIES, study_notebooks
from anelab.publish.widget_manager import RENDERER_URL

ANELAB_KERNEL = "anelab"  # the Makefile installs it into the venv (ipykernel --sys-prefix)


FALLBACK_KERNEL = "python3"  # jupyter_client runs a "python" kernelspec with this interpreter


QUICK_TIMEOUT = 120  # seconds per cell in quick runs


FULL_TIMEOUT = 3600  # seconds per cell in full runs with no earlier run to size it from


TIMEOUT_FACTOR = 4  # a cell may take this many times the longest cell of the last run (plus the margin)


TIMEOUT_MARGIN = 60  # seconds added to the scaled duration (kernel start, a busy shared machine)


FULL_TIMEOUT_FLOOR = 300  # seconds: a full run's sized timeout is never shorter


INJECTED = ("quick", "figures_dir", "records_dir", "build_dir")


def discover_notebooks(directory: str | os.PathLike = NOTEBOOK_DIR) -> list[Path]:
    """The study notebooks in ``directory``, ordered by file name (01_..., 02_..., ...)."""
    return sorted(p for p in Path(directory).glob("*.ipynb") if not p.name.startswith("."))


NOTEBOOKS: list[Path] = discover_notebooks()


def repo_path(path: str | os.PathLike) -> Path:
    """``path`` itself if absolute, else relative to the repository root."""
    p = Path(path)
    return p if p.is_absolute() else REPO_ROOT / p


LAB_FIGURES_DIR = "build/lab/figures"  # the parameters cells' figures_dir: where a lab session's figures go


PUBLISH_VARIABLE = "ANELAB_PUBLISH"  # set to 1 by `make lab PUBLISH=1`: a lab session publishes to figures/


def publishing() -> bool:
    """Whether this process (a notebook kernel) was started to publish: ``ANELAB_PUBLISH`` is 1/true/yes."""
    return os.environ.get(PUBLISH_VARIABLE, "").strip().lower() in TRUE_WORDS


def figures_destination(figures_dir: str | os.PathLike) -> Path:
    """Where a notebook saves its figures (each notebook's first code cell calls this on its parameter).

    ``figures_dir`` as given (``repo_path``), except the lab default ``LAB_FIGURES_DIR``, which is the
    committed ``figures/`` when the kernel was started to publish (``make lab PUBLISH=1`` sets
    ``ANELAB_PUBLISH=1``). A run that injects its own ``figures_dir`` (papermill, ``anelab run``) gets it.
    """
    if Path(figures_dir) == Path(LAB_FIGURES_DIR) and publishing():
        return FIGURES_DIR
    return repo_path(figures_dir)


def repo_relative(path: str | os.PathLike) -> str:
    """``path`` as a notebook's parameters cell shows it: relative to the repository root when it lies
    inside it (``repo_path`` turns it back), else absolute."""
    p = Path(path).resolve()
    return str(p.relative_to(REPO_ROOT)) if p.is_relative_to(REPO_ROOT) else str(p)


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
    timed_out: bool = False  # a cell ran past the timeout (``timeout`` seconds)
    timeout: float | None = None

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
            "figures_dir": repo_relative(build / "figures"),
            "records_dir": repo_relative(build / "records"),
            "build_dir": repo_relative(build),
        }
    return {
        "quick": False,
        "figures_dir": repo_relative(FIGURES_DIR),
        "records_dir": repo_relative(MEASURED_DIR),
        "build_dir": repo_relative(build),
    }


NOTEBOOK_TEMPLATE = "executed_notebook.html.j2"  # in anelab/publish/templates: JupyterLab's page, no CDN scripts


def export_html(executed: Path, dest: Path) -> Path:
    """Export an executed notebook to HTML (nbconvert), written atomically. Its widgets are rendered
    by the locally served html-manager bundle (``widget_manager.RENDERER_URL``, vendored by ``make
    docs``), never one from a CDN; the page loads no other script from the network (``NOTEBOOK_TEMPLATE``
    drops MathJax, mermaid and require.js, which the notebooks do not use)."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(executed), as_version=4)
    exporter = HTMLExporter(
        widget_renderer_url=RENDERER_URL, template_file=NOTEBOOK_TEMPLATE, extra_template_paths=[str(TEMPLATE_DIR)]
    )
    body, _ = exporter.from_notebook_node(nb)
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
    from nbclient.exceptions import CellTimeoutError
    from papermill.exceptions import PapermillExecutionError

    path = Path(path).resolve()
    declared = declared_parameters(path)
    if "quick" not in declared:
        raise AnelabInputError(f"{path.name}: its parameters cell must declare 'quick: bool = False'")
    build = Path(build).resolve()
    params = {**run_parameters(quick, build), **(parameters or {})}
    params = {k: v for k, v in params.items() if k in declared}
    executed = build / "notebooks" / path.name
    timeout = timeout if timeout is not None else cell_timeout(path, quick, [executed, *previous_runs(path)])
    executed.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    error, timed_out = "", False
    try:
        with kernel_environment({HEADLESS_VARIABLE: "1", PUBLISH_VARIABLE: "0"}):  # figures where injected
            papermill.execute_notebook(
                str(path),
                str(executed),
                parameters=params,
                kernel_name=kernel or kernel_name(),
                language="python",
                cwd=str(REPO_ROOT),
                progress_bar=False,
                log_output=False,
                execution_timeout=math.ceil(timeout),  # papermill takes whole seconds
                request_save_on_cell_execute=False,
            )
    except PapermillExecutionError as e:
        error = f"cell {e.exec_count}: {e.ename}: {str(e.evalue).splitlines()[0] if e.evalue else ''}"
    except CellTimeoutError as e:
        error, timed_out = f"CellTimeoutError: a cell ran past {timeout:.0f} s ({str(e).splitlines()[0]})", True
    except Exception as e:  # kernel death (nbclient raises its own types)
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    seconds = time.perf_counter() - started
    html_path = None
    if html and executed.exists():
        html_path = export_html(executed, build / "html" / (path.stem + ".html"))
    return NotebookRun(
        path.name, executed, html_path, seconds, ok=not error, error=error, parameters=params,
        timed_out=timed_out, timeout=timeout,
    )  # fmt: skip


def previous_runs(notebook: Path) -> list[Path]:
    """Executed copies of earlier runs to size a timeout from, besides the run's own build: the one
    ``make reproduce`` leaves in ``build/notebooks/``."""
    return [REPO_ROOT / "build" / "notebooks" / notebook.name]


def last_cell_seconds(executed: Path, quick: bool) -> list[float] | None:
    """The cell durations of a finished earlier run (papermill's per-cell metadata in its executed
    copy), or None when there is no readable copy, it ran with another ``quick``, or a cell failed."""
    try:
        nb = json.loads(Path(executed).read_text())
        run = nb["metadata"]["papermill"]
        if bool(run["parameters"].get("quick", False)) != bool(quick):
            return None
        cells = [c.get("metadata", {}).get("papermill", {}) for c in nb["cells"] if c.get("cell_type") == "code"]
        if any(c.get("exception") or c.get("status") not in ("completed", None) for c in cells):
            return None
        return [float(c["duration"]) for c in cells if c.get("duration") is not None]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def cell_timeout(notebook: Path, quick: bool, previous: list[Path]) -> float:
    """Seconds any one cell may take: ``TIMEOUT_FACTOR`` x the longest cell of the first readable
    earlier run in ``previous`` (same ``quick``) + ``TIMEOUT_MARGIN``, at least ``QUICK_TIMEOUT``
    (quick) or ``FULL_TIMEOUT_FLOOR`` (full) and at most ``FULL_TIMEOUT``; with no earlier run,
    ``QUICK_TIMEOUT`` or ``FULL_TIMEOUT``."""
    for executed in previous:
        durations = last_cell_seconds(executed, quick)
        if durations:
            floor = QUICK_TIMEOUT if quick else FULL_TIMEOUT_FLOOR
            return float(min(FULL_TIMEOUT, max(floor, TIMEOUT_FACTOR * max(durations) + TIMEOUT_MARGIN)))
    return float(QUICK_TIMEOUT if quick else FULL_TIMEOUT)


def previous_seconds(build: str | os.PathLike, notebook: str | os.PathLike) -> float | None:
    """How long ``notebook``'s last run into ``build`` took (papermill's duration, read from the
    executed copy it left in ``<build>/notebooks/``), or None when there is no readable copy."""
    executed = Path(build) / "notebooks" / Path(notebook).name
    try:
        return float(json.loads(executed.read_text())["metadata"]["papermill"]["duration"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def longest_first(notebooks: list[Path], build: str | os.PathLike) -> list[Path]:
    """``notebooks`` in the order a pool of workers should start them, longest first — so the longest study starts
    at once and the short ones fill the other workers around it. A notebook's length is its previous duration in
    ``build``, else its study's ``typical_seconds`` (a fresh checkout); notebooks with neither start first, in file
    order."""
    typical = {Path(s.notebook).name: s.typical_seconds for s in STUDIES}
    known = {nb: previous_seconds(build, nb) or typical.get(Path(nb).name) for nb in notebooks}
    fresh = [nb for nb in notebooks if known[nb] is None]
    return fresh + sorted((nb for nb in notebooks if known[nb] is not None), key=lambda nb: -known[nb])


def _run_in_worker(path: Path, quick: bool, build: str, timeout: float | None, threads: int) -> NotebookRun:
    """Worker of ``run_all_notebooks``: one notebook, its kernel capped at ``threads`` BLAS threads."""
    with thread_limits(threads):
        return run_notebook(path, quick=quick, build=build, timeout=timeout)


def run_all_notebooks(
    quick: bool = False,
    build: str | os.PathLike = "build",
    notebooks: list[Path] | None = None,
    timeout: float | None = None,
    jobs: int = 1,
) -> bool:
    """Run every study notebook (default: the notebooks of ``publish.studies.STUDIES``); one progress line each.
    True when all succeeded.

    jobs: notebooks run at once (each in its own kernel, with cores // jobs BLAS threads, started
    longest first by ``longest_first``); 1 runs them one after the other in file order. Every
    notebook writes into its own part of ``build``; figures' manifest updates are locked and records
    get fresh names, so concurrent notebooks never overwrite each other's output.
    """
    if notebooks is None:
        notebooks = study_notebooks()
    notebooks = [Path(p) for p in notebooks]
    if not notebooks:
        print(f"no notebooks in {NOTEBOOK_DIR}")
        return True
    runs = []
    with tqdm(total=len(notebooks), desc="notebooks", unit="nb") as bar:
        if jobs == 1:
            for nb in notebooks:
                bar.set_postfix_str(nb.name)
                run = run_notebook(nb, quick=quick, build=build, timeout=timeout)
                tqdm.write(run.line())
                runs.append(run)
                bar.update(1)
        else:
            runs = _run_pool(notebooks, quick, build, timeout, jobs, bar)
    failed = [r.notebook for r in runs if not r.ok]
    if failed:
        print(f"{len(failed)} of {len(runs)} notebooks failed: {', '.join(failed)}")
    return not failed


# ---- the core budget of concurrent runs: anelab.core.parallel (available_cores, threads_per_run) ----


def _run_pool(notebooks: list[Path], quick: bool, build, timeout: float | None, jobs: int, bar) -> list[NotebookRun]:
    """``run_all_notebooks`` with ``jobs`` worker processes; the runs in file order."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from multiprocessing import get_context

    threads = threads_per_run(jobs)
    done: dict[Path, NotebookRun] = {}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        futures = {
            pool.submit(_run_in_worker, nb, quick, str(build), timeout, threads): nb
            for nb in longest_first(notebooks, build)
        }
        for future in as_completed(futures):
            run = future.result()
            done[futures[future]] = run
            tqdm.write(run.line())
            bar.update(1)
    return [done[nb] for nb in notebooks]


# ---- one study run into its own directory (``anelab run``) ------------------------------------------

RESULT_FILE = "result.json"  # written last: a run directory holding it is complete (ok or failed)


PARAMETERS_FILE = "parameters.json"


THREAD_VARIABLES = (  # BLAS/OpenMP pools the kernel's NumPy may start
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes"), ("false", "0", "no")


def resolve_notebook(spec: str | os.PathLike, notebooks: list[Path] | None = None) -> Path:
    """A study notebook from its number (``2``, ``02``), stem (``02_mask_fold``), name or path."""
    notebooks = discover_notebooks() if notebooks is None else notebooks
    text = str(spec)
    path = Path(text)
    if path.suffix == ".ipynb" and path.is_file():
        return path.resolve()
    for nb in notebooks:
        number = nb.name.split("_", 1)[0]
        if text in (nb.name, nb.stem) or (text.isdigit() and number.isdigit() and int(text) == int(number)):
            return nb
    names = ", ".join(nb.stem for nb in notebooks)
    raise AnelabInputError(f"unknown study {text!r}; use a number, stem or path of one of: {names}")


def _declared_summary(declared: dict[str, dict]) -> str:
    return ", ".join(f"{name}: {d['type']}" for name, d in declared.items() if name not in INJECTED[1:])


def _coerce_text(name: str, text: str, kind: str):
    """A command-line string as the declared type (``None`` when it does not parse as one)."""
    if kind == "bool":
        low = text.strip().lower()
        return True if low in TRUE_WORDS else False if low in FALSE_WORDS else None
    if kind in ("int", "float"):
        with contextlib.suppress(ValueError):
            return int(text) if kind == "int" else float(text)
        return None
    if kind in ("list", "dict"):
        with contextlib.suppress(ValueError, SyntaxError):
            return ast.literal_eval(text)
        return None
    return text


def _type_ok(value, kind: str) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "list":
        return isinstance(value, list)
    if kind == "dict":
        return isinstance(value, dict)
    return True  # papermill could not infer a type ("None"): any JSON value


def check_parameters(path: str | os.PathLike, values: dict, *, from_text: bool = False) -> dict:
    """``values`` checked against the notebook's ``parameters`` cell; returns them typed.

    from_text: values are command-line strings, parsed as the declared type. An undeclared name, a
    value of the wrong type, or one of the run's own directories (set by the run) is refused in one
    line naming the declared parameters.
    """
    path = Path(path)
    declared = declared_parameters(path)
    listing = f"{path.stem} declares {_declared_summary(declared)}"
    out = {}
    for name, value in values.items():
        if name in INJECTED[1:]:
            raise AnelabInputError(f"{name} is set by the run (its run directory); {listing}")
        if name not in declared:
            raise AnelabInputError(f"{path.stem} has no parameter {name!r}; {listing}")
        kind = declared[name]["type"]
        typed = _coerce_text(name, value, kind) if from_text and isinstance(value, str) else value
        if typed is None or not _type_ok(typed, kind):
            raise AnelabInputError(f"{path.stem}: parameter {name} must be {kind}, got {value!r}; {listing}")
        out[name] = float(typed) if kind == "float" else typed
    return out


def machine_tag() -> str:
    """A short file-name-safe tag of this machine: its model and a hash of its host name
    (two machines of the same model get different tags; the host name itself is not written)."""
    model = re.sub(r"[^A-Za-z0-9]+", "-", machine_description()["machine_model"]).strip("-") or "machine"
    host = hashlib.sha256(platform.node().encode()).hexdigest()[:6]
    return f"{model}-{host}"


def run_id(notebook: str | os.PathLike, parameters: dict) -> str:
    """``<hash of study + parameters>-<machine tag>``: the same run on the same machine keeps its
    directory (``--resume``), the same run on another machine gets its own."""
    text = json.dumps({"notebook": Path(notebook).name, "parameters": parameters}, sort_keys=True)
    return f"{hashlib.sha256(text.encode()).hexdigest()[:10]}-{machine_tag()}"


def run_directory(notebook: str | os.PathLike, parameters: dict, runs: str | os.PathLike = RUNS_DIR) -> Path:
    """``<runs>/<study stem>/<run id>``."""
    return Path(runs) / Path(notebook).stem / run_id(notebook, parameters)


def read_result(run_dir: str | os.PathLike) -> dict | None:
    """The run's ``result.json`` (None while the run has not finished)."""
    path = Path(run_dir) / RESULT_FILE
    return read_json_file(path, "run result") if path.is_file() else None


@contextlib.contextmanager
def kernel_environment(variables: dict[str, str]):
    """Set ``variables`` for kernels started inside the block (they inherit the environment)."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def thread_limits(threads: int | None):
    """Cap the BLAS/OpenMP threads of kernels started inside the block (they inherit the environment)."""
    if threads is None:
        yield
        return
    with kernel_environment(
        {**{k: str(int(threads)) for k in THREAD_VARIABLES}, CORE_BUDGET_VARIABLE: str(int(threads))}
    ):
        yield


def run_study(
    notebook: str | os.PathLike,
    parameters: dict,
    *,
    out: str | os.PathLike | None = None,
    publish: bool = False,
    threads: int | None = None,
    timeout: float | None = None,
) -> NotebookRun:
    """Run one study (already resolved, parameters already checked) into its run directory.

    out: the run directory (default ``run_directory``); a directory already holding a result is
    refused (runs are records: never overwritten). publish: figures go to the committed
    ``figures/`` and the HTML to ``build/html/`` (what ``make docs`` links), records stay in the run.
    threads: BLAS/OpenMP threads of the kernel. Returns the ``NotebookRun``; ``result.json`` says
    ok or failed with the error.
    """
    notebook = Path(notebook)
    run_dir = Path(out) if out is not None else run_directory(notebook, parameters)
    if read_result(run_dir) is not None:
        raise AnelabInputError(f"{run_dir} already holds a finished run; choose another --out or remove it")
    if "quick" not in declared_parameters(notebook):  # what run_notebook would refuse: refused before writing
        raise AnelabInputError(f"{notebook.name}: its parameters cell must declare 'quick: bool = False'")
    if timeout is not None and not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
        raise AnelabInputError(f"--timeout must be a finite number of seconds above 0, got {timeout}")
    kernel_name()  # no kernel for this interpreter: refused now, not after parameters.json is written
    if run_dir.exists() and not run_dir.is_dir():
        raise AnelabInputError(f"--out {run_dir} is a file, not a directory; choose another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / PARAMETERS_FILE, json.dumps(parameters, indent=2, sort_keys=True) + "\n")
    injected = {
        "figures_dir": repo_relative(FIGURES_DIR if publish else run_dir / "figures"),
        "records_dir": repo_relative(run_dir / "records"),
        "build_dir": repo_relative(run_dir / "build"),
    }
    quick = bool(parameters.get("quick", False))
    with thread_limits(threads):
        run = run_notebook(notebook, quick=quick, build=run_dir, timeout=timeout, parameters={**injected, **parameters})
    _move_outputs(run, run_dir, notebook, publish)
    write_result(
        run_dir, notebook, parameters, threads, ok=run.ok, error=run.error, seconds=run.seconds, timed_out=run.timed_out
    )
    return run


def _move_outputs(run: NotebookRun, run_dir: Path, notebook: Path, publish: bool) -> None:
    """The executed notebook and its HTML at the top of the run directory (and, when publishing,
    the HTML where ``make docs`` looks)."""
    executed = run_dir / notebook.name
    if run.executed.exists():
        os.replace(run.executed, executed)
        run.executed = executed
        with contextlib.suppress(OSError):
            (run_dir / "notebooks").rmdir()
    if run.html is not None and run.html.exists():
        html = run_dir / run.html.name
        os.replace(run.html, html)
        run.html = html
        with contextlib.suppress(OSError):
            (run_dir / "html").rmdir()
        if publish:
            dest = REPO_ROOT / "build" / "html" / html.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(html, dest)


def write_result(
    run_dir: Path,
    notebook: Path,
    parameters: dict,
    threads: int | None,
    *,
    ok: bool,
    error: str,
    seconds: float,
    timed_out: bool = False,
    retried: str = "",
) -> Path:
    """Write the run's ``result.json`` (last, atomically): the marker of a finished run. ``timed_out``:
    a cell ran past the timeout; ``retried``: why this is the second attempt (``anelab batch``)."""
    result = {
        "timed_out": timed_out,
        **({"retried": retried} if retried else {}),
        "study": notebook.stem,
        "notebook": notebook.name,
        "run_id": Path(run_dir).name,
        "status": "ok" if ok else "failed",
        "error": error,
        "seconds": round(seconds, 3),
        "parameters": parameters,
        "threads": threads,
        "machine": machine_description(),
        "finished": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    return atomic_write_text(Path(run_dir) / RESULT_FILE, json.dumps(result, indent=2, sort_keys=True) + "\n")


def clear_run_directory(run_dir: Path) -> None:
    """Remove a failed or interrupted run's directory before it runs again. A successful run, or a
    directory that is not a run directory (no parameters.json), is never removed."""
    run_dir = Path(run_dir)
    result = read_result(run_dir)
    if result is not None and result.get("status") == "ok":
        raise AnelabInputError(f"{run_dir} holds a successful run; it is not removed")
    if not (run_dir / PARAMETERS_FILE).is_file():
        raise AnelabInputError(f"{run_dir} is not a run directory (no {PARAMETERS_FILE}); remove it yourself")
    shutil.rmtree(run_dir)
