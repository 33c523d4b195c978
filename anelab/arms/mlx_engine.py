"""The arms on mlx-lm (``run_arms(..., engine="mlx")``): the reference arm is mlx-lm's own forward of the
checkpoint, the sidecar arms the hybrid (``anelab.runtimes.mlx.hybrid``: every full-attention layer's prefill
chunks on its saved sidecar, and / or the MLPs of the MLP sidecar set on theirs, everything else mlx-lm's), all
prefilled in chunks of the sidecars' width with mlx-lm's caches threaded, then decoded greedily on mlx-lm from the
cache each arm left.

It runs every family mlx-lm runs, hybrids (Qwen 3.5's Gated DeltaNet layers) and MoE included; the NumPy engine
(``anelab.core.decoder``) stays the independent reference where it covers a family. Each layer's output rows
are taken as the prefill produces them, so per-layer differences cover every prompt position. Negative
controls perturb a sidecar-served layer (``mask_dropped``, ``start_shifted``); the sparse-indexer (mask fold)
arms run on the NumPy engine.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from anelab.arms.arm_runs import Arm, ArmRun
from anelab.arms.resident import RESIDENT, WeightsPlan
from anelab.arms.sidecars import SidecarSet
from anelab.checkpoints.checkpoint import Checkpoint
from anelab.core.errors import AnelabInputError
from anelab.core.limits import human_bytes
from anelab.runtimes.mlx.hybrid import Hybrid, decode_greedy, prefill
from anelab.runtimes.mlx.mlx_model import open_mlx_model, tapped_layers, to_numpy
from anelab.sidecar.checks.comparison import relative_error

MLX_CONTROLS = ("mask_dropped", "start_shifted")
MLX_REFERENCE_CHUNK = 16  # prefill chunk of an MLX run without sidecars


@dataclass
class MlxArmsModel:
    """A checkpoint opened for the MLX engine: anelab's view of its attention layers (``checkpoint``, what the
    sidecars are checked against) and mlx-lm's model of the whole (``mlx``)."""

    checkpoint: Checkpoint
    mlx: object  # anelab.runtimes.mlx.mlx_model.MlxModel

    @property
    def geometry(self):
        return self.checkpoint.geometry

    @property
    def path(self):
        return self.checkpoint.path

    @property
    def vocab_size(self) -> int:
        return self.mlx.vocab_size

    @property
    def num_layers(self) -> int:
        return self.mlx.num_layers


def open_mlx_arms_model(opened: Checkpoint, dtype: str | None = "float32") -> MlxArmsModel:
    """An opened checkpoint for the MLX engine (float32 by default: the arms compare within fp16 noise)."""

    mlx = open_mlx_model(opened.path, dtype=dtype)
    if mlx.num_layers != opened.geometry.num_layers:
        raise AnelabInputError(
            f"{opened.path}: mlx-lm builds {mlx.num_layers} decoder layers, config.json says {opened.geometry.num_layers}"
        )
    return MlxArmsModel(opened, mlx)


def _check_mlx_arm(arm: Arm, sidecars: SidecarSet | None) -> dict[int, str]:
    """Refuse what the MLX engine does not run (one line); the arm's hybrid controls (layer -> kind)."""
    if arm.indexer is not None:
        raise AnelabInputError(
            f"arm {arm.name}: the sparse-indexer (mask fold) arms run on the NumPy engine (--engine numpy)"
        )
    if arm.attention == "sidecar" and (sidecars is None or not sidecars.packages):
        raise AnelabInputError(f"arm {arm.name} runs on the sidecars; pass the sidecar directory")
    if arm.mlp == "sidecar" and (sidecars is None or sidecars.mlp is None):
        raise AnelabInputError(f"arm {arm.name} runs its MLPs on sidecars; pass the MLP sidecar directory")
    if arm.gdn == "sidecar" and (sidecars is None or sidecars.gdn is None):
        raise AnelabInputError(f"arm {arm.name} runs its GDN projections on sidecars; pass their sidecar directory")
    p = arm.perturbation
    if p is None:
        return {}
    if p.kind not in MLX_CONTROLS or arm.attention != "sidecar" or p.layer not in sidecars.packages:
        raise AnelabInputError(
            f"arm {arm.name}: on the mlx engine a control perturbs a sidecar-served layer ({', '.join(MLX_CONTROLS)}); "
            f"{p.kind} of layer {p.layer} is not one"
        )
    return {p.layer: p.kind}


def _run_one(model: MlxArmsModel, prompt: np.ndarray, arm: Arm, decode: int, chunk: int, sidecars) -> tuple:
    """One arm's chunked prefill (every layer's output rows kept: [L, P, D] float32) and greedy decode."""

    controls = _check_mlx_arm(arm, sidecars)
    hidden = np.zeros((model.num_layers, prompt.size, model.geometry.hidden_size), np.float32)
    at = {"start": 0, "recording": True}

    def sink(layer: int, out) -> None:
        if at["recording"]:
            rows = to_numpy(out[0])
            hidden[layer, at["start"] : at["start"] + rows.shape[0]] = rows

    cache = model.mlx.make_cache()
    hybrid = None
    if "sidecar" in (arm.attention, arm.mlp, arm.gdn):
        attention = tuple(sidecars.packages) if arm.attention == "sidecar" else ()
        mlps = tuple(sidecars.mlp.packages) if arm.mlp == "sidecar" else ()
        gdns = tuple(sidecars.gdn.packages) if arm.gdn == "sidecar" else ()
        hybrid = Hybrid(model.mlx, sidecars, model.geometry, attention, controls=controls, mlp_layers=mlps,
                        gdn_layers=gdns)  # fmt: skip
    with tapped_layers(model.mlx, sink):
        with hybrid.installed() if hybrid is not None else contextlib.nullcontext():
            logits = prefill(model.mlx, prompt, chunk, cache, hybrid, on_chunk=lambda s: at.update(start=s))
            at["recording"] = False
            rows, tokens = decode_greedy(model.mlx, logits, cache, decode)
    return hidden, rows, tokens


def run_mlx_arms(
    model: MlxArmsModel,
    prompt: np.ndarray,
    arms: list[Arm],
    *,
    decode: int,
    chunk: int | None = None,
    sidecars: SidecarSet | None = None,
    keep_hidden: bool = True,
    layer_pairs: tuple[tuple[str, str], ...] = (),
) -> dict[str, ArmRun]:
    """Each arm run on mlx-lm (module docstring), one after another -> arm name -> its run (``run_arms``'s
    contract: logits [N, V], greedy tokens [N], the per-layer differences of ``layer_pairs``, hidden [L, P, D]
    when ``keep_hidden``)."""
    prompt = np.asarray(prompt)
    if decode < 1:
        raise AnelabInputError(f"decode must be >= 1 token, got {decode}")
    if prompt.ndim != 1 or prompt.size < 1:
        raise AnelabInputError("the prompt needs at least one token id")
    chunk = (sidecars.chunk if sidecars else MLX_REFERENCE_CHUNK) if chunk is None else int(chunk)
    if sidecars is not None and chunk != sidecars.chunk:
        raise AnelabInputError(f"the prefill chunk {chunk} differs from the sidecars' width {sidecars.chunk}")
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        raise AnelabInputError(f"arm names must differ: {', '.join(names)}")
    unknown = sorted({name for pair in layer_pairs for name in pair} - set(names))
    if unknown:
        raise AnelabInputError(f"layer pair names arm {unknown[0]!r}, which is not run; arms: {', '.join(names)}")
    for arm in arms:
        _check_mlx_arm(arm, sidecars)
    produced = {arm.name: _run_one(model, prompt, arm, decode, chunk, sidecars) for arm in arms}
    runs = {}
    for arm in arms:
        hidden, logits, tokens = produced[arm.name]
        diffs = {
            a: [relative_error(hidden[i], produced[a][0][i]) for i in range(model.num_layers)]
            for a, b in layer_pairs
            if b == arm.name
        }
        runs[arm.name] = ArmRun(arm, hidden if keep_hidden else None, logits, tokens, diffs, mlx_weights(model))
    return runs


def mlx_weights(model: MlxArmsModel) -> WeightsPlan:
    """How mlx-lm holds the weights: all resident from the open (``open_mlx_model`` evaluates every array), in
    its dtype; no resident budget applies (``--resident-budget`` is the NumPy engine's)."""

    size = model.mlx.parameter_bytes
    reason = (
        f"mlx-lm holds all {human_bytes(size)} of its {model.mlx.dtype} parameters from the open; no budget applies"
    )
    return WeightsPlan(RESIDENT, size, None, reason)
