"""``anelab records``: list the records, or compare fresh values with the seeds' recorded ones."""

from __future__ import annotations

import argparse
import sys

from anelab.commands.arguments import print_json
from anelab.core.errors import AnelabInputError
from anelab.publish import records_compare as rc


def setup_arg_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["list", "compare"])
    p.add_argument("--kind", default=None, help="list: only records of this kind")
    p.add_argument("--machine", default=None, help="only records whose machine (model, chip, OS) contains this")
    p.add_argument(
        "--dir", dest="dirs", action="append", default=None,
        help="records directory (repeatable; default: data/, data/measured/ and runs/*/*/records)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON")


def main(args) -> int:
    skipped: list = []
    records = rc.gather_records(args.dirs, skipped=skipped if args.action == "list" else None)
    if args.action == "list":  # an unreadable record is reported on stderr; the others are listed
        for path, reason in skipped:
            print(f"anelab: skipped an unreadable record: {reason}", file=sys.stderr)
        rows = rc.list_rows(rc.select(records, kind=args.kind, machine=args.machine))
        if args.json:
            print_json(rows)
            return 0
        for r in rows:
            print(f"{r['kind']:<24} {r['origin']:<9} {r['machine']:<44} {r['date']:<26} {r['path']}")
        print(f"{len(rows)} records" + (f" ({len(skipped)} unreadable, skipped: see stderr)" if skipped else ""))
        return 0
    if args.kind is not None:
        raise AnelabInputError("records compare: --kind applies to list; compare covers its declared quantities")
    rows = rc.compare(records, machine=args.machine)
    print_json(rows) if args.json else print(rc.compare_table(rows))
    return 0
