"""``anelab verify``: a saved package (or every package of an export directory) against the NumPy reference,
on random rows, on real text (``--real-text N``) or through Core ML on a Mac (``--compute-units``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from anelab.arms.real_text import docs_activations
from anelab.checkpoints.checkpoint import Checkpoint
from anelab.checkpoints.default import resolve_checkpoint
from anelab.checkpoints.whole_model import load_model
from anelab.commands.arguments import CHECKPOINT_HELP, int_list, print_json
from anelab.core.errors import AnelabInputError
from anelab.runtimes.coreml.device_verify import verify_on_device
from anelab.sidecar.backends import is_sidecar, read_metadata
from anelab.sidecar.checks import verify  # verify.verify_package: read at call time (tests spy on it)
from anelab.sidecar.checks.comparison import open_package_checkpoint
from anelab.sidecar.checks.verify_export import export_packages, verify_export


def setup_arg_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "package",
        help="a layer_<L>.mlpackage or .aimodel, or an export directory: every package, one summary table",
    )
    p.add_argument("--checkpoint", default=None, help=CHECKPOINT_HELP + " (default: the one the package records)")
    p.add_argument("--fp32", action="store_true", help="evaluate the package in fp32 instead of emulating fp16 storage")
    p.add_argument(
        "--jobs", type=int, default=None, help="packages of an export directory verified at once (default: up to 2)"
    )
    p.add_argument(
        "--layers",
        type=int_list,
        default=None,
        help="an export directory made with export --layers: the layers it must hold (default: every attention layer)",
    )
    p.add_argument(
        "--compute-units",
        default=None,
        help="on a Mac: run every case through Core ML predict (cpu_and_ne | cpu_and_gpu | cpu_only) beside NumPy",
    )
    p.add_argument(
        "--real-text",
        type=int,
        default=None,
        metavar="N",
        help="feed the cases each layer's real attention inputs, the first N tokens of the README's frozen text "
        "(docs/prompt/readme-a615004.md) through the whole "
        "model (a checkpoint with a tokenizer, e.g. default-real; dense and tiled packages; N >= the longest "
        "history + the chunk), instead of random rows",
    )
    p.add_argument("--json", action="store_true")


def checkpoint_or_recorded(value: str | None) -> Checkpoint | None:
    """The ``--checkpoint`` given, resolved (a name made or fetched first) and opened, or None: the one each package
    records (opened by verify)."""
    return None if value is None else open_package_checkpoint(resolve_checkpoint(value))


def is_export_directory(path: Path) -> bool:
    """A directory of layer packages (not a package: an .mlpackage holds a Manifest.json, an .aimodel is a sidecar)."""
    return path.is_dir() and not (path / "Manifest.json").exists() and not is_sidecar(path)


def real_text_verify(path: Path, args):
    """``verify --real-text N``: one package's verification fed its layer's real attention inputs (one package at a
    time, in this process; the inputs computed once, from the checkpoint given or the one the packages record)."""
    if args.compute_units is not None:
        raise AnelabInputError("--real-text feeds the NumPy evaluation; drop --compute-units")
    if args.jobs is not None and args.jobs > 1:
        raise AnelabInputError("--real-text verifies one package at a time (the inputs are computed here); drop --jobs")
    if args.real_text < 1:
        raise AnelabInputError(f"--real-text must be at least 1 token, got {args.real_text}")
    first = export_packages(path)[0][1] if is_export_directory(path) else path
    source = resolve_checkpoint(args.checkpoint) if args.checkpoint is not None else read_metadata(first).source
    inputs, said = docs_activations(load_model(source), args.real_text)

    def verify_one(package, checkpoint):
        report = verify.verify_package(
            package, checkpoint, fp16=not args.fp32, activations=inputs[read_metadata(package).layer]
        )
        report.inputs = said
        return report

    return verify_one


def main(args) -> int:
    if args.real_text is not None:
        verify_one = real_text_verify(Path(args.package), args)
    elif args.compute_units is not None:

        def verify_one(package, checkpoint):
            return verify_on_device(package, checkpoint, compute_units=args.compute_units)
    else:

        def verify_one(package, checkpoint):
            return verify.verify_package(package, checkpoint, fp16=not args.fp32)

    path = Path(args.package)
    if is_export_directory(path):
        # on the device or on real text: one package at a time here; None: NumPy in worker processes
        one_by_one = verify_one if args.compute_units is not None or args.real_text is not None else None
        checkpoint = checkpoint_or_recorded(args.checkpoint)
        report = verify_export(
            path, checkpoint, fp16=not args.fp32, verify_one=one_by_one, jobs=args.jobs, layers=args.layers
        )
    else:
        if args.layers is not None:
            raise AnelabInputError("--layers applies to an export directory; drop it to verify one package")
        report = verify_one(path, checkpoint_or_recorded(args.checkpoint))
    if args.json:
        print_json(report.to_dict())
    else:
        print(report.table())
    return 0 if report.passed else 1
