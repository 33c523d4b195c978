"""Run every benchmark in this directory (``make benchmarks``), one after another, each in its own process.

``bench_speed.py`` (issue 13's table: verify, evaluation, CLI, reproduce) runs first; then every other
``bench_*.py`` in file-name order. Extra arguments go to every script (e.g. ``--quick``);
``--only NAME`` runs one script; ``--reproduce`` also times ``anelab reproduce`` in ``bench_speed.py``
(issue 13's last row; it writes the repository's figures, as ``make reproduce`` does — ``make benchmarks``
passes it). Benchmarks print ratios measured in one run and never assert; a
failing script is reported and the rest still run (exit status 1 at the end).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIRST = "bench_speed.py"


def scripts() -> list[Path]:
    found = sorted(HERE.glob("bench_*.py"))
    return sorted(found, key=lambda p: p.name != FIRST)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run only this script, e.g. bench_speed.py")
    parser.add_argument("--reproduce", action="store_true", help="bench_speed.py also times 'anelab reproduce'")
    args, extra = parser.parse_known_args(argv)
    chosen = [p for p in scripts() if args.only in (None, p.name, p.stem)]
    if not chosen:
        print(f"no benchmark named {args.only!r}; have: {', '.join(p.name for p in scripts())}")
        return 2
    # the scripts import the anelab of this checkout (not whichever one the environment installed)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    failed = []
    for script in chosen:
        print(f"\n=== {script.name} {' '.join(extra)}", flush=True)
        start = time.perf_counter()
        own = ["--reproduce"] if args.reproduce and script.name == FIRST else []
        done = subprocess.run([sys.executable, str(script), *extra, *own], env=env)
        print(f"=== {script.name}: {time.perf_counter() - start:.0f} s, exit {done.returncode}", flush=True)
        if done.returncode:
            failed.append(script.name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
