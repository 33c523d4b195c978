"""anelab command line. Bad input: one line on stderr, exit code 2, no traceback.

``COMMANDS`` is the table of subcommands: name, the module of ``anelab.commands`` that owns it (its
``setup_arg_parser(parser)`` adds the flags, its ``main(args)`` runs it) and the one-line help ``anelab --help``
lists. Only the invoked command's module is imported, so a command pays only for what it uses (``anelab
evaluate``: NumPy and the saved-program evaluator; tests/commands/test_cli_imports.py holds the line).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

from anelab.core.errors import AnelabInputError

EXIT_BAD_INPUT = 2
EXIT_TERMINATED = 128 + 15

# name, module in anelab.commands (<command>_command.py), one-line help (anelab --help lists them in this order)
COMMANDS = (
    ("export", "export_command", "export attention layers (full or sliding window) as multifunction Core ML sidecars"),
    ("inspect", "inspect_command", "functions, shapes, op counts, weight bytes and metadata of a saved package"),
    ("evaluate", "evaluate_command", "run one function of a saved package with NumPy (any OS)"),
    ("verify", "verify_command",
     "check a saved package (or every package of an export directory) against the NumPy reference"),
    ("reproduce", "reproduce_command",
     "the main job: export + verify the default sidecar, run the study notebooks, write figures"),
    ("doctor", "doctor_command", "is the Core ML runtime available here, versions, which studies run fresh vs replay"),
    ("plan", "plan_command", "chunks, variants, setup and the ANE-vs-GPU decision for one prompt"),
    ("size", "size_command", "bytes of a gather graph's gathered keys against the dense score matrix"),
    ("probe", "probe_command", "build, save and evaluate the dense-masked and gather attention probes at one chunk"),
    ("compare-arms", "compare_arms_command",
     "whole model: per-layer hidden, logits and greedy text with the attention on the sidecars vs the reference"),
    ("ab", "ab_command",
     "whole-model prefill A/B: mlx-lm's own prefill (the GPU arm) against the hybrid with every full-attention "
     "layer on its sidecar (the ANE arm, cpu_and_ne); measured on a Mac, labelled correctness run elsewhere"),
    ("decide", "decide_command",
     "plan every design for a checkpoint, export + verify the candidate, run the whole-model arms, "
     "(on a Mac) measure, and write report.html / report.md / decision.json"),
    ("run", "run_command", "one papermill run of a study into runs/<study>/<run id>/"),
    ("batch", "batch_command", "run a TOML grid of study parameters in a local process pool"),
    ("records", "records_command", "list the records, or compare fresh values with the seeds' recorded ones"),
    ("docs", "docs_command", "build the figure gallery (build/docs/index.html) from figures/MANIFEST.json"),
    ("measure", "measure_command",
     "on a Mac: doctor, export with the ANE gate, verify on the device, load timings, block A/B, probe timing"),
)  # fmt: skip


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's default also prints usage); main adds "anelab: error:"
        command = self.prog.removeprefix("anelab").strip()
        raise AnelabInputError(f"{command + ': ' if command else ''}{message} (see {self.prog} --help)")

    def _check_value(self, action, value):  # an unknown choice (a mistyped command): the closest one, by name
        if action.choices is not None and value not in action.choices:
            close = difflib.get_close_matches(value, [str(c) for c in action.choices], n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"choose from {', '.join(map(str, action.choices))}"
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}; {hint}")
        super()._check_value(action, value)


def command_module(module: str):
    """The module of ``anelab.commands`` that owns a command (imported on first use)."""
    return importlib.import_module(f"anelab.commands.{module}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser: every command of the table listed with its help, the flags of ``command`` alone built (its
    module imported); None builds every command's (tests, the runbook check), a name outside the table none."""
    parser = _Parser(prog="anelab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for name, module, help_line in COMMANDS:
        p = sub.add_parser(name, help=help_line)
        if command is None or command == name:
            command_module(module).setup_arg_parser(p)
    return parser


def _is_gate_refusal(error: Exception) -> bool:
    """Whether ``error`` is the ANE gate's refusal (``anelab.runtimes.coreml.gate.AneGateError``). Only a command
    that imported the gate can raise it, so the gate is looked up, not imported (its import pulls in
    NumPy and the runtime layer, which most commands never need)."""
    gate = sys.modules.get("anelab.runtimes.coreml.gate")
    return gate is not None and isinstance(error, gate.AneGateError)


def main(argv: list[str] | None = None) -> int:
    # inside: `import anelab.cli` loads nothing of anelab beyond core.errors
    from anelab.core.termination import Terminated, terminate_by_exception

    try:
        with terminate_by_exception():  # SIGTERM runs every finally (an export's staging folder, its workers)
            return _main(sys.argv[1:] if argv is None else list(argv))
    except Terminated:
        print("anelab: terminated", file=sys.stderr)
        return EXIT_TERMINATED


def _main(argv: list[str]) -> int:
    try:
        modules = {name: module for name, module, _ in COMMANDS}
        parser = build_parser(argv[0] if argv and argv[0] in modules else "")  # "": no command's flags
        args = parser.parse_args(argv)
        if not args.command:
            parser.print_help()
            return EXIT_BAD_INPUT
        return int(command_module(modules[args.command]).main(args) or 0)
    except AnelabInputError as e:
        print(f"anelab: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        return 0
    except OSError as e:  # a full disk, a quota, a file-size limit, a read-only file system, a symlink loop: one line
        from anelab.core.output_paths import os_error_line  # inside: `import anelab.cli` stays light

        if os_error_line(e) is None:
            raise
        print(f"anelab: error: {os_error_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("anelab: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not _is_gate_refusal(e):
            raise
        print(f"anelab: export refused: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
