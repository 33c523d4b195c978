"""``anelab batch``: a TOML grid of study parameters run in a local process pool (or printed as commands)."""

from __future__ import annotations

import argparse
from pathlib import Path

from anelab.core.parallel import threads_per_run
from anelab.core.paths import RUNS_DIR
from anelab.publish import batch
from anelab.publish.batch_summary import write_summary


def setup_arg_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("grid", help="grid file (see grids/), one table per study with fixed / vary / runs")
    p.add_argument(
        "--jobs", type=int, default=None,
        help="concurrent runs, default 1 (each gets cores // jobs BLAS threads; with --emit-jobs: --threads of each command)",
    )  # fmt: skip
    p.add_argument("--emit-jobs", action="store_true", help="print one 'anelab run ...' command per run; run nothing")
    p.add_argument("--resume", action="store_true", help="skip runs whose directory holds a successful result")
    p.add_argument("--runs", default=None, help="root of the run directories (default: runs/)")
    p.add_argument("--timeout", type=float, default=None, help="seconds any one cell may take")


def main(args) -> int:
    root = Path(args.runs) if args.runs else RUNS_DIR
    jobs = 1 if args.jobs is None else args.jobs
    threads = threads_per_run(jobs)
    planned = batch.plan_grid(args.grid, root)
    if args.emit_jobs:  # --threads only when --jobs says how many run at once on the machine running them
        for line in batch.job_commands(planned, threads=None if args.jobs is None else threads, runs_root=args.runs):
            print(line)
        return 0
    results = batch.run_batch(planned, jobs=jobs, resume=args.resume, timeout=args.timeout)
    written = write_summary(results, root / f"batch-{Path(args.grid).stem}", Path(args.grid).stem)
    print((root / f"batch-{Path(args.grid).stem}" / "summary.md").read_text())
    for what, path in written.items():
        print(f"{what}: {path}")
    failed = [r for r in results.values() if r.get("status") != "ok"]
    print(f"{len(results) - len(failed)} of {len(results)} runs ok" + (f", {len(failed)} failed" if failed else ""))
    return 1 if failed else 0
