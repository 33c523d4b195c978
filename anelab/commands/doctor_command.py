"""``anelab doctor``: is the Core ML runtime available here, versions, which studies run fresh vs replay;
``--probe`` exercises every Core ML behaviour anelab relies on (a Mac)."""

from __future__ import annotations

import argparse

from anelab.commands.arguments import print_json
from anelab.publish.doctor import diagnose, format_report
from anelab.runtimes.coreml.coreml_runtime import default_runtime
from anelab.runtimes.coreml.probe import format_probe, probe_core_ml


def setup_arg_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.add_argument(
        "--probe",
        action="store_true",
        help="on a Mac: exercise every Core ML behaviour anelab relies on, on a tiny package, and print each "
        "assumption passed / failed (exit 1 if one failed)",
    )


def main(args) -> int:
    if args.probe:
        record = probe_core_ml(default_runtime())  # off-Mac: one line naming what it needs, exit 2
        print_json(record) if args.json else print(format_probe(record))
        return 1 if record["results"]["failed"] else 0
    report = diagnose()
    if args.json:
        print_json(report)
    else:
        print(format_report(report))
    return 0
