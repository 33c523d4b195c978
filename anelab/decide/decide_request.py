"""What one ``anelab decide`` run is asked (``DecideConfig``), what it opens once (``Opened``) and what it answers
(``Decision``, whose ``to_dict`` is ``decision.json``): the typed objects its stages and its report share."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from anelab.arms.mlx_engine import MlxArmsModel
from anelab.checkpoints.checkpoint import Checkpoint
from anelab.checkpoints.whole_model import ModelCheckpoint
from anelab.runtimes.interface import CoreMLRuntime

ARMS_DECODE = 8  # greedy tokens decoded after the prefill in the arms
SWEEP_POINTS = 16  # prompt lengths on the figure


@dataclass
class DecideConfig:
    """One ``anelab decide`` run (see the module docstring)."""

    checkpoint: Path
    prompt_tokens: int
    out: Path
    design: str = "auto"
    chunk: int | None = None
    family: str | None = None
    gpu_prefill_seconds: float | None = None
    gpu_tokens_per_second: float | None = None
    gpu_runtime: str | None = (
        None  # whose GPU prefill the GPU arm is (planner.gpu_runtimes; None: a checkpoint's default)
    )
    chip: str | None = None  # the Mac's chip (both arms are priced on it; None: this Mac's, else the seed's M3)
    objective: str = "time"  # what the verdict optimises: time or energy (planner.energy)
    measure: bool = False
    runtime: CoreMLRuntime | None = None  # default this machine's (needed only with measure)
    repeats: int = 3
    decode: int = ARMS_DECODE
    clock: object | None = None  # injectable clock for the timing (tests: the fake's)
    weights: str = "fp16"  # the packages' weight mode (sidecar.quantize); a compression's cost is reported beside

    @property
    def user_gpu(self) -> dict:
        flags = {"gpu_prefill_seconds": self.gpu_prefill_seconds, "gpu_tokens_per_second": self.gpu_tokens_per_second}
        return {k: v for k, v in flags.items() if v is not None}


@dataclass(frozen=True)
class Opened:
    """What decide opens once: the checkpoint (layers), the whole model (the arms: anelab's forward, or mlx-lm's
    model of a family it does not model) and the runtime (``--measure``)."""

    checkpoint: Checkpoint
    model: ModelCheckpoint | MlxArmsModel  # anelab's whole-model forward, or mlx-lm's model (engine mlx)
    runtime: CoreMLRuntime | None
    engine: str = "numpy"
    identity: dict = field(default_factory=dict)  # checkpoint_identity: what the evidence is keyed on

    @property
    def layers(self) -> list[int]:
        return list(self.checkpoint.geometry.full_attention_layers)


@dataclass
class Decision:
    """Everything the report shows (``to_dict`` is ``decision.json``)."""

    config: dict
    checkpoint: dict
    candidate: str
    verdicts: dict  # design -> Verdict.to_dict() (as planned, before any measurement)
    verdict: dict  # the candidate's final verdict (after measurement when measured)
    designs: list  # DesignPlan dicts
    plan: dict  # the per-history PrefillPlan of the full-attention layers
    evidence: dict = field(default_factory=dict)  # verify per layer, arms, measured
    sweep: list = field(default_factory=list)  # figure rows
    measured: bool = False
    yours: list = field(default_factory=list)  # which numbers are the user's / measured here
    chip_map: dict = field(default_factory=dict)  # chip x prompt length -> ratio and verdict (planner.chip_map)
    offload_split: dict = field(default_factory=dict)  # per chip, every split of prefill (planner.offload_split)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}
