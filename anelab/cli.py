"""anelab command line. Bad input: one line on stderr, exit code 2, no traceback.

Each subcommand has a ``_add_<name>(sub)`` parser builder and a ``_run_<name>(args)`` runner;
runners import their module lazily so ``anelab doctor`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys

from anelab.errors import AnelabInputError

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's default also prints usage)
        raise AnelabInputError(f"{self.prog}: {message} (see --help)")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise AnelabInputError(f"expected comma-separated integers, got {text!r}") from None


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


# ---- commands ----------------------------------------------------------------------------------
# (each section: _add_X registers the parser, _run_X executes; keep sections independent)

COMMANDS: list = []  # (name, add_fn, run_fn), filled below


def _register(name, add_fn, run_fn):
    COMMANDS.append((name, add_fn, run_fn))


# >>> section: core (export / inspect / evaluate / verify / reproduce)
# <<< section: core

# >>> section: runtime (doctor)
# <<< section: runtime

# >>> section: plan
# <<< section: plan

# >>> section: gather (size / probe)
# <<< section: gather


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="anelab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for name, add_fn, _ in COMMANDS:
        add_fn(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not args.command:
            parser.print_help()
            return EXIT_BAD_INPUT
        runners = {name: run_fn for name, _, run_fn in COMMANDS}
        return int(runners[args.command](args) or 0)
    except AnelabInputError as e:
        print(f"anelab: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("anelab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
