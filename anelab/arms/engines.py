"""The arms' one seam: who runs everything but the sidecars — ``numpy`` (anelab's whole-model forward,
``arms.arm_runs``, the independent reference where it models the family) or ``mlx`` (mlx-lm's model of the checkpoint,
``arms.mlx_engine``: every family mlx-lm runs). Both take the same arms, serve the sidecars through the same
``SidecarSet.serve`` and return the same ``ArmRun``s, so the comparisons do not know which ran."""

from __future__ import annotations

import numpy as np

from anelab.arms.arm_runs import Arm, ArmRun, run_arms
from anelab.arms.mlx_engine import run_mlx_arms
from anelab.core.errors import AnelabInputError

ENGINES = {"numpy": run_arms, "mlx": run_mlx_arms}


def run_arms_on(engine: str, model, prompt: np.ndarray, arms: list[Arm], **options) -> dict[str, ArmRun]:
    """``arms`` on ``engine``: ``model`` is a ``ModelCheckpoint`` (numpy) or an ``MlxArmsModel`` (mlx);
    ``options``: decode, chunk, sidecars, keep_hidden, layer_pairs (and, numpy only, order)."""
    if engine not in ENGINES:
        raise AnelabInputError(f"engine {engine!r}: use one of {', '.join(ENGINES)}")
    return ENGINES[engine](model, prompt, arms, **options)
