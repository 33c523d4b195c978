"""``anelab probe``: build, save and evaluate the dense-masked and gather attention probes at one chunk."""

from __future__ import annotations

import argparse

from anelab.commands.arguments import print_json
from anelab.core.output_paths import require_output_dir
from anelab.core.records import write_record
from anelab.runtimes.coreml.gather_probe import probe, probe_record, probe_table


def setup_arg_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunk", type=int, required=True, help="query rows of the probe (e.g. 32, 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed NumPy evaluations per graph (default 3)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim (default 64)")
    p.add_argument("--history", type=int, default=None, help="keys before the chunk (default 3 x chunk)")
    p.add_argument("--kept-blocks", type=int, default=4, help="indexer blocks kept per row (default 4)")
    p.add_argument("--compress-ratio", type=int, default=4, help="keys per indexer block (default 4)")
    p.add_argument("--out", default=None, help="keep the saved probe packages in this directory")
    p.add_argument(
        "--records", default=None, help="write a measured record (kind gather_probe_numpy) into this directory"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def main(args) -> int:
    args.records and require_output_dir(args.records, "--records")  # before the probes, not after them
    results = probe(
        args.chunk,
        heads=args.heads,
        head_dim=args.head_dim,
        history=args.history,
        kept_blocks=args.kept_blocks,
        compress_ratio=args.compress_ratio,
        repeats=args.repeats,
        out_dir=args.out,
    )
    written = write_record(args.records, probe_record(results, args.repeats)) if args.records else None
    if args.json:
        print_json(
            {
                "rows": [r.to_dict() for r in results],
                "record": str(written) if written else None,
                "timing": "numpy_eval_* are NumPy evaluations of the saved programs on this machine, not ANE times",
            }
        )
    else:
        print(probe_table(results))
        if written:
            print(f"record written to {written}")
    return 0 if all(r.agrees for r in results) else 1
