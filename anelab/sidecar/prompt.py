"""A whole prompt prefilled chunk by chunk through a saved sidecar of any design (NumPy), and its reference."""

from __future__ import annotations

import os

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.sidecar.designs import design_of
from anelab.sidecar.drivers import (
    DECODE_STEPS,
    prompt_reference,
    run_stateful,
    run_stateful_tiled,
    stateful_mask,
)
from anelab.sidecar.format import read_sidecar_metadata
from anelab.sidecar.mil.evaluate import SavedPackage

__all__ = [
    "DECODE_STEPS",
    "prefill_prompt",
    "prompt_reference",
    "run_stateful",
    "run_stateful_tiled",
    "stateful_mask",
]


def prefill_prompt(package: str | os.PathLike, hidden: np.ndarray, *, fp16: bool = True, saved=None) -> np.ndarray:
    """Run a prompt's hidden rows [P, D] (fp16) through a saved sidecar of any design; returns attn_out [P, D].

    The package's design drives the calls (``designs.Design.drive_prompt``: per-history calls with the
    K/V history threaded, or the state carried between calls). ``saved``: an already opened
    ``SavedPackage`` of ``package`` (reading it is not part of a prefill).
    """
    meta = read_sidecar_metadata(package)
    design = design_of(meta, str(package))
    saved = saved if saved is not None else SavedPackage(package)
    hidden = np.asarray(hidden, dtype=np.float16)
    if hidden.ndim != 2 or hidden.shape[1] != meta.geometry["hidden_size"]:
        raise AnelabInputError(f"hidden must be [P, {meta.geometry['hidden_size']}], got {list(hidden.shape)}")
    return design.drive_prompt(saved, meta, hidden, fp16)
