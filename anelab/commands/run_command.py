"""``anelab run``: one papermill run of a study into runs/<study>/<run id>/."""

from __future__ import annotations

import argparse

from anelab.core.errors import AnelabInputError
from anelab.publish import notebooks


def setup_arg_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("notebook", help="study number, stem or notebook path (e.g. 02, 02_mask_fold)")
    p.add_argument(
        "-p", dest="params", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
        help="a parameter of the notebook's parameters cell (repeatable; checked against its declared type)",
    )  # fmt: skip
    p.add_argument("--out", default=None, help="run directory (default: <runs>/<study>/<run id>)")
    p.add_argument("--runs", default=None, help="root of the run directories (default: runs/)")
    p.add_argument(
        "--publish", action="store_true", help="write figures to the committed figures/ (and HTML to build/html)"
    )
    p.add_argument("--threads", type=int, default=None, help="BLAS/OpenMP threads of the notebook's kernel")
    p.add_argument("--timeout", type=float, default=None, help="seconds any one cell may take")
    p.add_argument("--resume", action="store_true", help="exit 0 if the run directory holds a successful run")


def main(args) -> int:
    notebook = notebooks.resolve_notebook(args.notebook)
    names = [name for name, _ in args.params]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise AnelabInputError(f"parameter {repeated[0]} given twice; pass each -p NAME VALUE once")
    if args.threads is not None and args.threads < 1:
        raise AnelabInputError(f"--threads must be at least 1, got {args.threads}")
    params = notebooks.check_parameters(notebook, dict(args.params), from_text=True)
    out = args.out or notebooks.run_directory(notebook, params, *([args.runs] if args.runs else []))
    finished = notebooks.read_result(out)
    if args.resume and finished is not None:
        if finished.get("status") == "ok":
            print(f"{out}: finished ok before; skipped (--resume)")
            return 0
        notebooks.clear_run_directory(out)  # a failed run runs again
    run = notebooks.run_study(
        notebook, params, out=out, publish=args.publish, threads=args.threads, timeout=args.timeout
    )
    print(run.line())
    print(f"run directory: {run.executed.parent}")
    return 0 if run.ok else 1
