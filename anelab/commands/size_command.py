"""``anelab size``: bytes of a gather graph's gathered keys against the dense score matrix."""

from __future__ import annotations

import argparse

from anelab.commands.arguments import print_json
from anelab.core.gather_size import GatherSizing
from anelab.core.geometry import GB


def setup_arg_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heads", type=int, required=True, help="query heads")
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--chunk", type=int, required=True, help="query rows per chunk")
    p.add_argument("--total", type=int, required=True, help="keys per row: history + chunk")
    p.add_argument("--budget", type=int, required=True, help="keys gathered per row")
    p.add_argument("--kv-heads", type=int, default=None, help="gather once per KV head (default: per query head)")
    p.add_argument("--json", action="store_true", help="print the sizing as JSON")


def main(args) -> int:
    s = GatherSizing(args.heads, args.head_dim, args.chunk, args.total, args.budget, kv_heads=args.kv_heads)
    d = s.to_dict()
    if args.json:
        print_json(d)
        return 0
    rows = [
        ("dense scores", list(s.dense_score_shape), s.dense_score_bytes),
        ("gathered keys", list(s.gather_key_shape), s.gather_key_bytes),
        ("gathered values", list(s.gather_key_shape), s.gather_value_bytes),
    ]
    print(f"{'tensor':<16} {'shape':<26} {'bytes':>16} {'GB':>10}")
    for name, shape, nbytes in rows:
        print(f"{name:<16} {str(shape):<26} {nbytes:>16,} {nbytes / GB:>10.2f}")
    print(f"gathered keys / dense scores: {s.ratio:.2f}x (GB = 1e9 bytes)")
    print(f"gathered keys are smaller than dense scores only for budget <= {d['crossover_budget']}")
    return 0
