"""Batch reruns of the studies: a TOML grid expanded into runs, executed in a local process pool.

A grid file has one table per study, keyed by the study's number, stem or notebook path::

    [02_mask_fold]
    fixed = { quick = true }               # every run of this study
    vary = { seed = [0, 1], compress_ratio = [4, 8] }   # the product of these lists
    runs = [ { seed = 7, compress_ratio = 16 } ]        # extra runs (irregular grids), over `fixed`

Every value is checked against the notebook's ``parameters`` cell before anything runs
(``notebooks.check_parameters``). ``run_batch`` executes the runs with N worker processes, each
notebook in its own kernel with ``cores // N`` BLAS threads (so N x threads <= cores), shows a
progress bar over runs, records a failed run (``result.json`` with its error) without stopping the
others, and with ``resume`` skips runs whose directory already holds a successful result.
``job_commands`` is the same grid as one ``anelab run`` command per line, for any other runner.
"""

from __future__ import annotations

import itertools
import os
import shlex
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

from anelab.core.errors import AnelabInputError
from anelab.core.parallel import threads_per_run
from anelab.core.paths import NOTEBOOK_DIR, RUNS_DIR
from anelab.core.progress import tqdm
from anelab.publish import notebooks

STUDY_KEYS = ("fixed", "vary", "runs")


@dataclass(frozen=True)
class PlannedRun:
    """One run of a grid: the study notebook, its (checked) parameters and its run directory."""

    notebook: Path
    parameters: dict
    run_dir: Path

    @property
    def study(self) -> str:
        return self.notebook.stem


def read_grid(path: str | os.PathLike) -> dict:
    """The grid file parsed (tomllib); a missing or unparsable file is refused in one line."""
    path = Path(path)
    try:
        grid = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise AnelabInputError(f"{path}: no such grid file") from None
    except (IsADirectoryError, UnicodeDecodeError):
        raise AnelabInputError(f"{path}: not a grid file (expected one UTF-8 TOML file)") from None
    except tomllib.TOMLDecodeError as e:
        raise AnelabInputError(f"{path}: not valid TOML ({e})") from None
    if not grid:
        raise AnelabInputError(f"{path}: empty grid; add a table per study, e.g. [02_mask_fold] with vary = {{...}}")
    return grid


def _study_table(path: Path, key: str, table) -> tuple[dict, dict, list]:
    if not isinstance(table, dict):
        raise AnelabInputError(f"{path}: [{key}] must be a table with fixed / vary / runs")
    unknown = sorted(set(table) - set(STUDY_KEYS))
    if unknown:
        raise AnelabInputError(f"{path}: [{key}] has {', '.join(unknown)}; a study table holds only fixed, vary, runs")
    fixed, vary, runs = table.get("fixed", {}), table.get("vary", {}), table.get("runs", [])
    if not isinstance(fixed, dict) or not isinstance(vary, dict) or not isinstance(runs, list):
        raise AnelabInputError(f"{path}: [{key}] fixed and vary are tables, runs a list of tables")
    for name, values in vary.items():
        if not isinstance(values, list) or not values:
            raise AnelabInputError(f"{path}: [{key}] vary.{name} must be a non-empty list of values")
    if not all(isinstance(r, dict) for r in runs):
        raise AnelabInputError(f"{path}: [{key}] runs must be a list of tables ({{ name = value, ... }})")
    return fixed, vary, runs


def expand(fixed: dict, vary: dict, runs: list[dict]) -> list[dict]:
    """Parameter sets: the product of ``vary`` (one run of ``fixed`` when there is nothing to vary
    and no explicit run), then each explicit run over ``fixed``; duplicates kept once, in order."""
    out: list[dict] = []
    if vary or not runs:
        names = list(vary)
        for combo in itertools.product(*(vary[n] for n in names)):
            out.append({**fixed, **dict(zip(names, combo, strict=True))})
    out += [{**fixed, **r} for r in runs]
    unique = []
    for params in out:
        if params not in unique:
            unique.append(params)
    return unique


def plan_grid(path: str | os.PathLike, runs_root: str | os.PathLike = RUNS_DIR) -> list[PlannedRun]:
    """Every run of a grid file, each parameter set checked against its notebook (nothing is written)."""
    path = Path(path)
    planned = []
    for key, table in read_grid(path).items():
        notebook = notebooks.resolve_notebook(key)
        fixed, vary, runs = _study_table(path, key, table)
        for params in expand(fixed, vary, runs):
            checked = notebooks.check_parameters(notebook, params)
            planned.append(PlannedRun(notebook, checked, notebooks.run_directory(notebook, checked, runs_root)))
    if not planned:
        raise AnelabInputError(f"{path}: the grid expands to no runs")
    return planned


def _value_text(value) -> str:
    return repr(value) if isinstance(value, list | dict) else str(value)


def job_command(run: PlannedRun, threads: int | None = None, runs_root: str | os.PathLike | None = None) -> str:
    """``anelab run <study> -p NAME VALUE ... --resume [--threads T]`` for one run (shell-quoted;
    ``--resume``: a job resubmitted after it finished is skipped, a failed one runs again)."""
    in_studies = run.notebook.parent.resolve() == NOTEBOOK_DIR.resolve()
    words = ["anelab", "run", run.study if in_studies else str(run.notebook), "--resume"]
    for name, value in run.parameters.items():
        words += ["-p", name, _value_text(value)]
    if threads is not None:
        words += ["--threads", str(threads)]
    if runs_root is not None:
        words += ["--runs", str(runs_root)]
    return shlex.join(words)


def job_commands(
    planned: list[PlannedRun], threads: int | None = 1, runs_root: str | os.PathLike | None = None
) -> Iterator[str]:
    """One runnable command per run (each run's directory is named on the machine that runs it)."""
    for run in planned:
        yield job_command(run, threads, runs_root)


def _execute_once(run: PlannedRun, threads: int, timeout: float | None, retried: str = "") -> dict:
    """One attempt of one run, never raising (an error becomes a failed result)."""
    started = time.perf_counter()
    try:
        done = notebooks.run_study(run.notebook, run.parameters, out=run.run_dir, threads=threads, timeout=timeout)
        if retried:  # the second attempt says why it exists
            notebooks.write_result(
                run.run_dir, run.notebook, run.parameters, threads, ok=done.ok, error=done.error,
                seconds=done.seconds, timed_out=done.timed_out, retried=retried,
            )  # fmt: skip
    except Exception as e:  # a crash outside the notebook (kernel start, disk) is recorded as the run's failure
        message = " ".join(f"{type(e).__name__}: {e}".split())
        seconds = time.perf_counter() - started
        notebooks.write_result(
            run.run_dir, run.notebook, run.parameters, threads, ok=False, error=message, seconds=seconds,
            retried=retried,
        )  # fmt: skip
    return notebooks.read_result(run.run_dir) or {"status": "failed", "error": "no result written"}


def _execute(run: PlannedRun, threads: int, timeout: float | None) -> dict:
    """Worker: one run; a run whose cell timed out is run once more (a hang is often transient, e.g.
    a kernel that never answered), and its result says so in ``retried``."""
    result = _execute_once(run, threads, timeout)
    if result.get("status") != "ok" and result.get("timed_out"):
        print(f"{run.study} {run.run_dir.name}: timed out ({result.get('error', '')}); retrying once", flush=True)
        notebooks.clear_run_directory(run.run_dir)
        result = _execute_once(run, threads, timeout, retried=f"first attempt timed out: {result.get('error', '')}")
    return result


def pending(planned: list[PlannedRun], resume: bool) -> tuple[list[PlannedRun], list[PlannedRun]]:
    """(runs to execute, runs skipped). With ``resume`` a run whose directory holds an ok result is
    skipped and a failed one is run again (its old directory cleared); without it, any finished run
    directory is refused, so nothing is overwritten. A directory without a result (an interrupted
    run) is run again either way."""
    todo, skipped = [], []
    for run in planned:
        result = notebooks.read_result(run.run_dir)
        if result is None:
            todo.append(run)
        elif not resume:
            raise AnelabInputError(f"{run.run_dir} already holds a finished run; pass --resume to skip finished runs")
        elif result.get("status") == "ok":
            skipped.append(run)
        else:
            todo.append(run)
    return todo, skipped


def run_batch(
    planned: list[PlannedRun], *, jobs: int, resume: bool = False, timeout: float | None = None
) -> dict[Path, dict]:
    """Execute the planned runs with ``jobs`` workers; returns {run_dir: result} for every run
    (skipped ones included, read from their directories)."""
    threads = threads_per_run(jobs)
    todo, skipped = pending(planned, resume)
    for run in todo:
        if run.run_dir.exists():  # a failed or interrupted run: start it afresh, without its stale records
            notebooks.clear_run_directory(run.run_dir)
    results = {run.run_dir: notebooks.read_result(run.run_dir) for run in skipped}
    if skipped:
        tqdm.write(f"resume: {len(skipped)} finished run(s) skipped")
    with tqdm(total=len(todo), desc="runs", unit="run") as bar:
        if todo:
            with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
                futures = {pool.submit(_execute, run, threads, timeout): run for run in todo}
                for future in as_completed(futures):
                    run = futures[future]
                    result = future.result()
                    results[run.run_dir] = result
                    state = "ok" if result.get("status") == "ok" else f"FAILED ({result.get('error', '')})"
                    state += " (retried once after a timeout)" if result.get("retried") else ""
                    tqdm.write(f"{run.study} {run.run_dir.name}: {state}")
                    bar.update(1)
    return {run.run_dir: results[run.run_dir] for run in planned}
