"""``anelab inspect``: functions, shapes, op counts, weight bytes and metadata of a saved package."""

from __future__ import annotations

import argparse

from anelab.commands.arguments import print_json
from anelab.sidecar.backends import backend_of


def setup_arg_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("package")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    backend = backend_of(args.package)
    info = backend.inspect(args.package)
    if args.json:
        print_json(info)
    else:
        print(backend.format_inspection(info))
    return 0
