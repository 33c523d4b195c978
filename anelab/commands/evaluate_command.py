"""``anelab evaluate``: one function of a saved package run with NumPy (any OS).

Imports only NumPy, the record writer and the saved-program evaluator (tests/commands/test_cli_imports.py holds it).
"""

from __future__ import annotations

import argparse
import io

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.output_paths import require_output_file
from anelab.core.records import atomic_write_bytes
from anelab.sidecar.mil.evaluate import SavedPackage, evaluate


def setup_arg_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("package")
    p.add_argument("--function", required=True, help="function name, h<history>")
    p.add_argument("--inputs", required=True, help=".npz with arrays named like the function's inputs")
    p.add_argument("--out", required=True, help=".npz to write the outputs to")
    p.add_argument("--fp32", action="store_true", help="evaluate in fp32 (no fp16 storage emulation)")


def main(args) -> int:
    require_output_file(args.out)  # before the package is read
    pkg = SavedPackage(args.package)
    pkg.function(args.function)
    try:
        with np.load(args.inputs, allow_pickle=False) as npz:
            inputs = {k: npz[k] for k in npz.files}
    except FileNotFoundError:
        raise AnelabInputError(f"{args.inputs}: no such file; give an .npz of the function's inputs") from None
    except (ValueError, OSError) as e:
        raise AnelabInputError(
            f"{args.inputs}: not a readable .npz ({type(e).__name__}); write it with numpy.savez"
        ) from None
    outputs = evaluate(pkg, args.function, inputs, fp16=not args.fp32)
    del inputs
    buf = io.BytesIO()
    np.savez(buf, **outputs)
    with buf.getbuffer() as data:  # the archive's bytes, written without another copy
        atomic_write_bytes(args.out, data)
    print(f"{args.out}: " + ", ".join(f"{k} {list(v.shape)} {v.dtype}" for k, v in outputs.items()))
    return 0
