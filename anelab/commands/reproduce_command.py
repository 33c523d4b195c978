"""``anelab reproduce``: export + verify the default sidecar, run the study notebooks, write the figures."""

from __future__ import annotations

import argparse

from anelab.publish.reproduce import reproduce


def setup_arg_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small parameters (what the tests run)")
    p.add_argument("--build", default="build", help="build directory (default: build)")


def main(args) -> int:
    return reproduce(quick=args.quick, build=args.build)
