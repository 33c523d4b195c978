"""Verify a saved sidecar of any design against the independent reference: the design picks the cases.

``verify_package`` reads the package's design (``anelab.sidecar.designs``) and runs that design's
verification (``anelab.sidecar.checks.verify_cases``: per function at a full and a partial chunk for the
per-history designs, a whole prompt through the state for the stateful ones), each with the negative
controls that make it able to fail.
"""

from __future__ import annotations

import os

from anelab.checkpoints.checkpoint import Checkpoint
from anelab.core.errors import AnelabInputError
from anelab.sidecar.backends import read_metadata
from anelab.sidecar.checks.comparison import REFERENCE_PRECISION, Evaluator
from anelab.sidecar.checks.stateful_cases import verify_stateful_package, verify_stateful_tiled_package
from anelab.sidecar.checks.verify_cases import (
    CONTROL_ROWS,
    VerifyReport,
    drop_half_mask,
    fold_comparisons,
    function_comparisons,
    partial_rows,
    verify_history,
    verify_per_history_package,
)
from anelab.sidecar.designs import design_of

__all__ = [
    "CONTROL_ROWS",
    "VerifyReport",
    "drop_half_mask",
    "fold_comparisons",
    "function_comparisons",
    "partial_rows",
    "verify_history",
    "verify_package",
    "verify_per_history_package",
    "verify_stateful_package",
    "verify_stateful_tiled_package",
]


def verify_package(
    package: str | os.PathLike,
    checkpoint: Checkpoint | None = None,
    *,
    seed: int = 0,
    fp16: bool = True,
    functions: list[str] | None = None,
    precision: str = REFERENCE_PRECISION,
    evaluator: Evaluator | None = None,
    progress: bool = True,
    activations=None,
) -> VerifyReport:
    """Verify a saved sidecar against the reference with its design's cases and negative controls. ``checkpoint``:
    the opened checkpoint the package came from (None: the one its metadata records, opened here).

    ``functions``: only these functions (per-history designs); ``precision``: the reference's ("fp32":
    its own error against fp64 is measured on a slice and bounded; "fp64"); ``evaluator``: runs the
    package instead of the NumPy evaluation (Core ML on a Mac), beside it. A request the design cannot
    serve is refused in one line. ``progress``: show this package's own progress bar (``verify_export``
    shows one for the whole export instead). ``activations`` float [P, D]: the layer's real attention inputs
    (post-norm rows of a prompt, positions 0 .. P-1) feed the cases instead of random rows (per-history designs).
    """
    meta = read_metadata(package)
    design = design_of(meta, str(package))
    if evaluator is not None:
        design.require_device_verify()
    real = {}
    if activations is not None:
        if design.stateful or design.block is not None:
            raise AnelabInputError(
                f"{package}: real attention inputs feed the per-history designs' cases (dense, tiled), not {design.name}"
            )
        real["activations"] = activations
    return design.verify(
        package,
        checkpoint,
        seed=seed,
        fp16=fp16,
        functions=functions,
        precision=precision,
        evaluator=evaluator,
        progress=progress,
        **real,
    )
