"""The planner for a user's own checkpoint: its layers from config.json, costs from the closest recorded family or flags.

The checkpoint gives the attention layers (full and sliding window), heads, KV heads and head_dim
(``anelab.checkpoints`` reads only config.json and the tensor headers). Each kind of layer is planned with
:func:`anelab.planner.plan` on the same chunks:

- full-attention layers: the dense plan;
- sliding-window layers (window W): the GPU's attention scores at most W keys per query, so the
  GPU arm is planned with a key budget of W; the sidecar still scores every key of its history
  (the window is in the mask, RoPE positions are absolute), so the ANE arm and its setup are the
  same as a full layer's. Offloading a windowed layer therefore pays off later than a full one.
  ``checkpoint_designs`` (``--design``) prices the designs per kind as built: there the stateful
  tiled design gives a windowed layer one function over a ring of about W + C cache slots.

A kind is offloaded when its ANE arm beats its GPU arm; the two verdicts combine into one.
Costs: the GPU arm is the runtime's (``gpu_runtime``): by default mlx-lm's batched prefill of this
model's own FLOPs on the chip (``planner.mlx_lm_rates``: the fraction of peak public mlx-lm records
reach, x/÷ their spread); or TinyTitan's GPU path on an M3, the rates of the recorded dense family
closest in heads x head_dim and attention-layer count (or ``family``) carried to this model by what it
computes (``planner.gpu_model``: its own weights per token, its head_dim per score entry, x/÷ 10). The
ANE's attention and loads are the recorded family's (TinyTitan's sidecars on an M3). Any cost flag
overrides; ``cost_family`` / ``cost_family_reason`` say which family.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from anelab.checkpoints.checkpoint import Checkpoint
from anelab.core.errors import AnelabInputError
from anelab.planner.catalogue import FAMILIES, PlanGeometry, get_family
from anelab.planner.design_plans import DESIGNS, DesignCosts, chip_scale, design_plan
from anelab.planner.fit import fit_costs
from anelab.planner.gpu_model import active_parameters, bytes_per_weight, own_non_attention, runtime_bandwidth
from anelab.planner.gpu_runtimes import default_gpu_runtime, require_gpu_runtime
from anelab.planner.plan import PrefillPlan, plan
from anelab.sidecar.designs import SidecarRequest


@dataclass(frozen=True)
class CheckpointPlan:
    """The plan of one prompt on a checkpoint's layers; ``parts`` holds each kind's ``PrefillPlan``
    ("full", "windowed"); seconds are the combined arms (non-attention counted once)."""

    checkpoint: str
    model_type: str
    num_layers: int
    full_layers: list
    windowed_layers: list
    sliding_window: int | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    cost_family: str | None
    cost_family_reason: str
    parts: dict[str, PrefillPlan]
    offloaded: list
    gpu_prefill_seconds: float
    ane_prefill_seconds: float
    predicted_ratio: float
    decision: str

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "parts"}
        return {**d, "parts": {kind: p.to_dict() for kind, p in self.parts.items()}}


def closest_family(num_heads: int, head_dim: int, attention_layers: int) -> tuple[str, str]:
    """(name, why) of the recorded dense family closest to a model: the smallest
    |ln(heads*head_dim ratio)| + |ln(attention-layer ratio)|; ties by name."""

    def distance(f):
        g = f.geometry
        width = abs(math.log(num_heads * head_dim / (g.num_heads * g.head_dim)))
        return width + abs(math.log(attention_layers / len(g.full_attention_layers))), f.name

    dense = [f for f in FAMILIES.values() if not f.sparse and f.geometry.head_dim is not None]
    best = min(dense, key=distance)
    g = best.geometry
    why = (
        f"closest recorded dense family: {g.num_heads} heads x head_dim {g.head_dim}, "
        f"{len(g.full_attention_layers)} full-attention layers (this model: {num_heads} x {head_dim}, {attention_layers})"
    )
    return best.name, why


def plan_from_checkpoint(
    checkpoint: Checkpoint,
    prompt_tokens: int,
    *,
    family: str | None = None,
    chunk: int | None = None,
    histories=None,
    max_history: int | None = None,
    gpu_runtime: str | None = None,
    chip: str | None = None,
    **cost_flags,
) -> CheckpointPlan:
    """Plan ``prompt_tokens`` on the opened checkpoint's attention layers (see the module docstring).

    ``cost_flags``: ``load_seconds``, ``gpu_attention_seconds``, ``ane_attention_seconds``,
    ``non_attention_seconds`` as :func:`plan` takes them; with all four no family is used.
    ``gpu_prefill_seconds`` / ``gpu_tokens_per_second``: the user's GPU prefill of the prompt (a model
    with windowed layers is refused: one number cannot be split between its kinds of layer).
    ``gpu_runtime`` (default: the table's checkpoint default, mlx-lm, the runtime Mac users run a model with; ``tinytitan``: the seed's
    path) and ``chip`` (default the seed's M3): whose GPU prefill the GPU arm is (``planner.plan``).
    """

    g = checkpoint.geometry
    windowed = [i for i in g.full_attention_layers if i in g.sliding_layers]
    full = [i for i in g.full_attention_layers if i not in g.sliding_layers]
    all_costs = all(cost_flags.get(k) is not None for k in _COST_FLAGS)
    user_gpu = {k: cost_flags.get(k) for k in _USER_GPU_FLAGS if cost_flags.get(k) is not None}
    if user_gpu and windowed and full:
        raise AnelabInputError(
            f"{checkpoint.path} has windowed and full-attention layers; --gpu-prefill-seconds cannot be split "
            "between them: pass --gpu-attention-seconds and --non-attention-seconds instead"
        )
    if family is not None:
        if get_family(family).sparse:
            raise AnelabInputError(
                f"--family {family} has a sparse GPU path; this checkpoint's attention is dense: choose a dense family"
            )
        reason = f"--family {family}"
    elif all_costs:
        reason = "flags (no family)"
    else:
        family, reason = closest_family(g.num_heads, g.head_dim, len(g.full_attention_layers))

    own, active = None, active_parameters(checkpoint.text)
    weights = (active, active * bytes_per_weight(checkpoint.tensor_dtype())[0])
    gpu_runtime = gpu_runtime or default_gpu_runtime(checkpoint=True)
    own_flag = all_costs or cost_flags.get("non_attention_seconds") is not None
    if require_gpu_runtime(gpu_runtime).streams_weights and not own_flag:
        bandwidth = runtime_bandwidth(fit_costs().non_attention_seconds)
        own = own_non_attention(checkpoint.text, checkpoint.tensor_dtype(), prompt_tokens, bandwidth)
    parts = {}
    for kind, layers, budget in (("full", full, None), ("windowed", windowed, g.sliding_window)):
        if layers:
            parts[kind] = plan(
                prompt_tokens,
                family=None if all_costs else family,
                chunk=chunk,
                histories=histories,
                max_history=max_history,
                num_layers=g.num_layers,
                full_attention_layers=layers,
                num_heads=g.num_heads,
                num_kv_heads=g.num_kv_heads,
                head_dim=g.head_dim,
                sparse_budget=budget,
                **{k: v for k, v in cost_flags.items() if k in _COST_FLAGS or k in _PLAN_FLAGS},
                **user_gpu,
                own_non_attention=own,
                weights=weights,
                gpu_runtime=gpu_runtime,
                chip=chip,
            )
    return _combine(checkpoint, g, full, windowed, family if not all_costs else None, reason, parts)


def plans_on_chips(checkpoint, **keywords):
    """(chip, prompt tokens) -> :func:`plan_from_checkpoint` of ``checkpoint`` on that chip with ``keywords``, each
    planned once (a refusal too, raised again): the verdict map and the offload split share them."""

    @functools.cache
    def planned(chip: str, n: int):
        try:
            return plan_from_checkpoint(checkpoint, n, chip=chip, **keywords)
        except AnelabInputError as e:
            return e

    def plan_on(chip: str, n: int) -> CheckpointPlan:
        result = planned(chip, n)
        if isinstance(result, AnelabInputError):
            raise result
        return result

    return plan_on


_COST_FLAGS = ("load_seconds", "gpu_attention_seconds", "ane_attention_seconds", "non_attention_seconds")
_USER_GPU_FLAGS = ("gpu_prefill_seconds", "gpu_tokens_per_second")
_PLAN_FLAGS = ("protocol", "reload_policy", "objective")


def _combine(checkpoint, g, full, windowed, family, reason, parts) -> CheckpointPlan:
    """Offload each kind whose ANE arm beats its GPU arm; the combined arms count non-attention once."""
    n = next(iter(parts.values())).non_attention_seconds
    gpu_total, ane_total, offloaded = n, n, []
    for kind, p in parts.items():
        gpu_kind = p.gpu_attention_seconds
        ane_kind = p.ane_prefill_seconds - p.non_attention_seconds
        gpu_total += gpu_kind
        if p.decision == "ane" and ane_kind < gpu_kind:
            offloaded.append(kind)
            ane_total += ane_kind
        else:
            ane_total += gpu_kind
    ratio = gpu_total / ane_total if ane_total > 0 else 1.0
    return CheckpointPlan(
        checkpoint=str(checkpoint.path),
        model_type=checkpoint.model_type,
        num_layers=g.num_layers,
        full_layers=full,
        windowed_layers=windowed,
        sliding_window=g.sliding_window if windowed else None,
        num_heads=g.num_heads,
        num_kv_heads=g.num_kv_heads,
        head_dim=g.head_dim,
        cost_family=family,
        cost_family_reason=reason,
        parts=parts,
        offloaded=offloaded,
        gpu_prefill_seconds=gpu_total,
        ane_prefill_seconds=ane_total,
        predicted_ratio=ratio,
        decision="ane" if offloaded and ratio > 1.0 else "gpu",
    )


def checkpoint_designs(
    checkpoint: Checkpoint,
    prompt_tokens: int,
    designs=None,
    *,
    family: str | None = None,
    chunk: int | None = None,
    key_tile: int | None = None,
    query_tile: int | None = None,
    **cost_flags,
) -> tuple[CheckpointPlan, dict[str, list]]:
    """The checkpoint's plan and each sidecar design (``planner.design``) per kind of attention layer:
    ``{"full": [...], "windowed": [...]}`` (a kind the model lacks is absent). Each kind's per-history
    plan (costs from ``family`` or the closest recorded dense family) is what its other designs are
    compared with; every design is priced by the one load model at its score arena; windowed layers
    are priced as built (``design_plan``'s ``window``: the stateful-tiled ring of about W + C slots,
    the other designs scoring the whole history). ``cost_flags`` go to :func:`plan_from_checkpoint`."""

    checkpoint_plan = plan_from_checkpoint(checkpoint, prompt_tokens, family=family, chunk=chunk, **cost_flags)
    fit = fit_costs()
    plans = {}
    for kind, part in checkpoint_plan.parts.items():
        costs = DesignCosts(
            ane_seconds_per_entry=fit.ane_seconds_per_entry * chip_scale(part),
            load=fit.recorded_load_model(specialize=part.pays_specialization),
            gpu_prefill_seconds=part.gpu_prefill_seconds,
            gpu_attention_seconds=part.gpu_attention_seconds,
            non_attention_seconds=part.non_attention_seconds,
            per_history=part,
        )
        g = part.geometry
        geometry = PlanGeometry(**{**g, "full_attention_layers": tuple(g["full_attention_layers"])})
        window = checkpoint_plan.sliding_window if kind == "windowed" else None
        plans[kind] = [
            design_plan(
                geometry,
                prompt_tokens,
                SidecarRequest(part.chunk, graph=d, key_tile=key_tile, query_tile=query_tile),
                costs,
                window=window,
            )
            for d in (designs or DESIGNS)
        ]
    return checkpoint_plan, plans
