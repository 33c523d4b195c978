"""What one ``anelab decide`` run is asked (``DecideConfig``), what it opens once (``Opened``) and what it answers
(``Decision`` and its parts): the typed objects its stages and its report share. ``Decision.to_json`` is the one
place they become the dict ``decision.json`` holds (the planner's records inside it are their own ``to_dict``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from anelab.arms.compression_cost import ModeCost
from anelab.arms.mlx_engine import MlxArmsModel
from anelab.checkpoints.checkpoint import Checkpoint
from anelab.checkpoints.whole_model import ModelCheckpoint
from anelab.planner.design_plans import DesignPlan
from anelab.planner.plan import PrefillPlan
from anelab.planner.verdict import Verdict
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

    def to_json(self) -> dict:
        """The options ``decision.json`` records (paths as text; the runtime and clock are this process's)."""
        keys = ("checkpoint", "prompt_tokens", "out", "design", "chunk", "family", "gpu_prefill_seconds")
        keys += ("gpu_tokens_per_second", "measure", "repeats", "decode", "gpu_runtime", "chip", "objective", "weights")
        return {k: str(getattr(self, k)) if isinstance(getattr(self, k), Path) else getattr(self, k) for k in keys}


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


@dataclass(frozen=True)
class CheckpointSummary:
    """The model as the report names it: its path, type, attention shape, RoPE and stored dtype."""

    path: str
    model_type: str
    layers: int
    full_attention_layers: tuple[int, ...]
    sliding_layers: tuple[int, ...]
    sliding_window: int | None
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    rope: str  # the RoPE scaling type, "default" without one
    dtype: str  # the tensors' stored dtype (Checkpoint.tensor_dtype)

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> CheckpointSummary:
        g = checkpoint.geometry
        return cls(
            path=str(checkpoint.path),
            model_type=checkpoint.model_type,
            layers=g.num_layers,
            full_attention_layers=tuple(g.full_attention_layers),
            sliding_layers=tuple(g.sliding_layers),
            sliding_window=g.sliding_window,
            hidden_size=g.hidden_size,
            heads=g.num_heads,
            kv_heads=g.num_kv_heads,
            head_dim=g.head_dim,
            rope=g.rope_scaling.rope_type if g.rope_scaling is not None else "default",
            dtype=checkpoint.tensor_dtype(),
        )


@dataclass(frozen=True)
class LayerVerification:
    """One layer's package and its verification: ``decide.evidence.verify_summary``'s fields, where the package is,
    its content hash and whether an earlier run's sealed verification was reused."""

    passed: bool
    vacuous: bool
    cases: int
    controls: int
    max_relative_error: float | None  # worst judged case, against the weights the package stores
    compression_error: float | None  # compressed: worst against the uncompressed weights (reported, not judged)
    threshold: float
    reused: bool
    package: str
    sha256: str
    capacity: int | None  # the request's state capacity (stateful designs), None per history
    reverified: str | None = None  # why a reused package was verified again (None: it was not)

    def to_json(self) -> dict:
        d = asdict(self)
        if self.reverified is None:  # the key only where it happened
            del d["reverified"]
        return d


@dataclass(frozen=True)
class ArmsSummary:
    """The whole-model arms (sidecar vs reference) as ``decide.decision.run_whole_model_arms`` summarises them, the
    record ``evidence.json`` keeps for reuse; ``reused``: this run took it from there."""

    engine: str  # numpy (anelab's forward) or mlx (mlx-lm's)
    served_by: str  # the design whose packages served every layer
    note: str  # why another design served them ("" when the candidate's own did)
    prompt_tokens: int
    chunk: int
    decode: int  # greedy tokens decoded after the prefill
    logits_relative_difference: float  # the prompt's last logits, sidecar arm against the reference
    max_step_logits_difference: float | None
    greedy_agreement: float
    greedy_agreement_excluding_near_ties: float
    near_ties: int
    divergences: tuple[dict, ...]  # each greedy divergence's record (arms.arm_comparison, labelled near-tie or not)
    greedy_summary: str
    identical_text: bool
    first_divergent_layer: int | None  # the first layer whose difference is above ``noise`` (None: none)
    layer_differences: tuple[float, ...]  # per layer, relative difference of its output
    noise: float
    weights: str | None  # how the arms held the weights (arms.resident), None: as the engine loads them
    reused: bool = False

    @classmethod
    def from_json(cls, record: dict) -> ArmsSummary:
        """The summary from its JSON (``evidence.json``'s, or a fresh run's); a record of other keys: TypeError."""
        return cls(**{**record, "divergences": tuple(record["divergences"]),
                      "layer_differences": tuple(record["layer_differences"])})  # fmt: skip

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "divergences": list(self.divergences),
            "layer_differences": list(self.layer_differences),
        }


@dataclass(frozen=True)
class CompressionEvidence:
    """``--weights`` other than fp16: what the compression costs the whole model on real text (``cost``), or why it
    was not costed (``note``)."""

    mode: str  # the weight mode (sidecar.quantize)
    cost: ModeCost | None = None  # arms.compression_cost: logits, greedy agreement, perplexity (None: ``note``)
    text: str = ""  # the real text it was costed on
    arm: str = ""  # the arm that carried the compressed projections
    note: str = ""  # why it was not costed

    def to_json(self) -> dict:
        if self.cost is None:
            return {"mode": self.mode, "note": self.note}
        return {**self.cost.to_dict(), "text": self.text, "arm": self.arm}


@dataclass
class MeasuredPackage:
    """One layer's package timed on this Mac: cold and warm loads per function, predictions per compute units
    (per-history functions). Each timing is ``runtimes.coreml.block_ab.timing_stats``'s dict (a record's reading),
    or None for a setting that did not load."""

    package: Path
    runtime: str
    loads: dict[str, dict[str, dict | None]]  # function -> {"cold": stats, "warm": stats}
    predicts: dict[str, dict[str, dict | None]]  # function -> compute units -> stats
    ane_failure: str | None = None  # why the ANE arm does not run on this Mac (a load or cpu_and_ne predict failed)
    placement: dict | None = (
        None  # Core ML's compute plan of the package under cpu_and_ne (runtimes.coreml.ane_placement)
    )
    whole_model: dict | None = None  # the whole-model A/B's record (arms.prefill_ab), or why it did not run

    def load(self, function: str) -> dict | None:
        return self.loads.get(function, {}).get("cold")

    def predict(self, function: str, units: str = "cpu_and_ne") -> dict | None:
        return self.predicts.get(function, {}).get(units)

    def to_dict(self) -> dict:
        return {"package": str(self.package), "runtime": self.runtime, "loads": self.loads, "predicts": self.predicts,
                "ane_failure": self.ane_failure, "placement": self.placement, "whole_model": self.whole_model}  # fmt: skip


@dataclass(frozen=True)
class DecisionEvidence:
    """What backs the verdict: each layer's verification, the whole-model arms, the compression's cost (``--weights``)
    and this Mac's timings (``--measure``)."""

    verify: dict[int, LayerVerification]  # layer -> its package's verification
    arms: ArmsSummary
    compression: CompressionEvidence | None  # None: fp16
    measured: MeasuredPackage | None  # None: not measured

    def to_json(self) -> dict:
        return {
            "verify": {str(k): v.to_json() for k, v in self.verify.items()},
            "arms": self.arms.to_json(),
            "compression": self.compression.to_json() if self.compression else None,
            "measured": self.measured.to_dict() if self.measured else None,
        }


@dataclass(frozen=True)
class SweepPoint:
    """The candidate's two arms at one prompt length (a point of the report's figure); ``gpu`` and ``ane`` are the
    verdict's arms (``Verdict.gpu_prefill``: value, low, high, kind, basis)."""

    prompt_tokens: int
    gpu: dict
    ane: dict
    decision: str


@dataclass(frozen=True)
class Decision:
    """Everything the report shows; ``to_json`` is ``decision.json``."""

    config: DecideConfig
    checkpoint: CheckpointSummary
    candidate: str  # the design exported, verified and served
    verdicts: dict[str, Verdict]  # design -> its verdict as planned, before any measurement
    verdict: Verdict  # the candidate's final verdict (after measurement when measured)
    designs: tuple[DesignPlan, ...]
    plan: PrefillPlan  # the per-history plan of the full-attention layers
    cost_family: str | None  # the recorded family the plan's costs came from
    evidence: DecisionEvidence
    sweep: tuple[SweepPoint, ...] = ()  # the figure's points
    yours: tuple[str, ...] = ()  # which numbers are the user's / measured here
    chip_map: dict = field(
        default_factory=dict
    )  # chip x prompt length -> ratio and verdict (planner.chip_map's record)
    offload_split: dict = field(default_factory=dict)  # per chip, every split of prefill (planner.offload_split)

    @property
    def measured(self) -> bool:
        return self.evidence.measured is not None

    def to_json(self) -> dict:
        """``decision.json``: the one place the decision becomes a dict."""
        return {
            "config": self.config.to_json(),
            "checkpoint": asdict(self.checkpoint),
            "candidate": self.candidate,
            "verdicts": {k: v.to_dict() for k, v in self.verdicts.items()},
            "verdict": self.verdict.to_dict(),
            "designs": [d.to_dict() for d in self.designs],
            "plan": {**self.plan.to_dict(), "cost_family": self.cost_family},
            "evidence": self.evidence.to_json(),
            "sweep": [asdict(p) for p in self.sweep],
            "measured": self.measured,
            "yours": list(self.yours),
            "chip_map": self.chip_map,
            "offload_split": self.offload_split,
        }
