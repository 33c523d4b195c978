"""Benchmark: each study notebook alone, as ``make reproduce`` runs it (its default parameters), one at a time.

Every notebook runs through ``anelab run NN`` in its own process, into its own scratch run directory (its build
directory, figures and records there: nothing in the repository is written, and the shared evidence cache starts
cold, as on a fresh clone). Printed per notebook: wall time, CPU time (the run's processes, user + system) and its three longest
cells (papermill's durations); then the sum, and the wall time two lanes would take packing the notebooks longest
first (``reproduce`` runs two at a time off a Mac; goal <= 180 s). Each kernel gets the BLAS threads ``reproduce``
gives it (cores // lanes: one on 2 cores; ``--threads`` to change): on a shared machine a second BLAS thread
waiting for a busy core spins, and a whole-model run of default-real then costs ~3x the CPU (7 s against 2.7 s,
measured here beside one other job). The load average is printed with each row: on a
shared machine compare CPU times, not wall times. Notebooks 05 and 07 share their real-model evidence through the
build directory's cache in ``reproduce``; run alone, each computes it (the sum counts it twice).

Prints, never asserts. Usage: python benchmarks/bench_notebooks.py [--only 05,07] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from anelab.core.parallel import available_cores, threads_per_run

REPO = Path(__file__).resolve().parents[1]
REPRODUCE_GOAL_SECONDS = 180.0
LANES = 2  # notebooks reproduce runs at once off a Mac (anelab.publish.reproduce.MAX_JOBS)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def longest_cells(executed: Path, count: int = 3) -> list[tuple[float, int]]:
    """The ``count`` longest cells of an executed notebook: (seconds, cell index), from papermill's metadata."""
    cells = json.loads(executed.read_text())["cells"]
    durations = [
        (float(c.get("metadata", {}).get("papermill", {}).get("duration") or 0.0), i) for i, c in enumerate(cells)
    ]
    return sorted(durations, reverse=True)[:count]


def run_alone(study: str, scratch: Path, quick: bool, threads: int) -> tuple[float, float, int, Path]:
    """``anelab run <study> --threads <threads>`` into ``scratch/run-<study>`` (the run directory holds its build
    directory, figures and records): (wall s, CPU s, exit code, the executed notebook)."""
    out = scratch / f"run-{study}"
    command = [sys.executable, "-m", "anelab", "run", study, "--out", str(out), "-p", "quick", str(quick),
               "--threads", str(threads)]  # fmt: skip
    cpu, start = _children_cpu(), time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
    executed = next(iter(sorted(out.rglob("*.ipynb"))), out / "missing.ipynb")
    return wall, cpu, done.returncode, executed


def two_lane_wall(seconds: list[float], lanes: int = LANES) -> float:
    """The wall time of ``lanes`` lanes each taking the next notebook, longest first (as ``longest_first``)."""
    ends = [0.0] * lanes
    for s in sorted(seconds, reverse=True):
        ends[ends.index(min(ends))] += s
    return max(ends)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated study numbers (default: every study)")
    parser.add_argument("--quick", action="store_true", help="the notebooks' quick parameters (what the tests run)")
    parser.add_argument("--threads", type=int, default=None,
                        help="BLAS threads of each kernel (default: what reproduce gives each of its lanes)")  # fmt: skip
    args = parser.parse_args(argv)
    threads = args.threads or threads_per_run(min(LANES, available_cores()))
    studies = (
        args.only.split(",")
        if args.only
        else sorted(p.name[:2] for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    )
    walls = []
    with tempfile.TemporaryDirectory(prefix="anelab-notebooks-") as tmp:
        scratch = Path(tmp)
        for study in studies:
            wall, cpu, code, executed = run_alone(study, scratch, args.quick, threads)
            walls.append(wall)
            cells = ", ".join(f"cell {i} {d:.0f} s" for d, i in longest_cells(executed)) if executed.exists() else "-"
            print(f"{study}: {wall:.0f} s wall, {cpu:.0f} s CPU, {threads} BLAS thread(s) (exit {code}); "
                  f"longest: {cells}  [{_load()}]", flush=True)  # fmt: skip
    packed = two_lane_wall(walls)
    print(
        f"sum {sum(walls):.0f} s; {LANES} lanes longest first: {packed:.0f} s; goal <= {REPRODUCE_GOAL_SECONDS:.0f} s "
        f"({'met' if packed <= REPRODUCE_GOAL_SECONDS else 'NOT met'}; the default checkpoint's export and verification "
        "that reproduce runs first not included)"
    )


if __name__ == "__main__":
    main()
