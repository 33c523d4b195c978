"""The three-way verdict (``ane`` / ``gpu`` / ``depends``) of one design for one prompt, with its thresholds.

Both arms share everything but the offloaded attention (seconds)::

    GPU arm = S                               S: GPU prefill of the prompt
    ANE arm = S - share * S + A + n * L       share: the part of S the ANE takes over (modelled)
                                              A: ANE attention, all layers; n layers, L: one layer's loads

so the ANE wins iff ``gain = share * S - A - n * L > 0``. The two thresholds a user can check:

- ``max_load_per_layer_seconds`` X = (share * S - A) / n: at the GPU prefill S, the ANE wins iff
  one layer's loads for this prompt (every function it visits) take at most X;
- ``min_gpu_prefill_seconds`` Y = (A + n * L) / share: at the loads L, the ANE wins iff the GPU
  prefill of this prompt takes at least Y.

The verdict: ``gpu`` when the ANE does not run (short prompt, past coverage); otherwise the gain's
interval (each cost at the end of its interval that favours the other side) decides — ``ane`` above
0, ``gpu`` below; ``depends`` only when the interval spans 0 (a reachable value flips it), with the
measurement that would settle it. An extrapolated cost carries a band wide enough for what it does
not know (``planner.envelope``), so extrapolation alone never makes a verdict "depends"; and a
threshold below zero at the costs' most favourable ends (no load could be fast enough) decides "gpu".
With ``loads_in_arm`` False (no load in the arm, a what-if) the
loads are left out of the gain and X is reported for the record only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

from anelab.planner.catalogue import EXTRAPOLATED, FITTED
from anelab.planner.chips import SEED_CHIP
from anelab.planner.design_plans import DesignPlan
from anelab.planner.energy import DEFAULT_OBJECTIVE, arm_joules, chip_power, energy_decision, power_sources
from anelab.planner.envelope import (
    ANE_RATE_BAND,
    MEASURED,
    YOURS,
    Cost,
    gpu_band_fraction,
    kind_of,
    load_band_factor,
    worst_kind,
)
from anelab.planner.fit import fit_costs
from anelab.planner.plan import PrefillPlan
from anelab.sidecar.designs import DEFAULT_DESIGN

ANE, GPU, DEPENDS = "ane", "gpu", "depends"


@dataclass(frozen=True)
class ArmCosts:
    """What decides one design for one prompt (see the module docstring for the symbols)."""

    design: str
    layers: int
    loads_per_layer: int  # functions one layer loads for this prompt
    runs_on_ane: bool  # False: short prompt or past coverage — the prompt stays on the GPU
    gpu_prefill: Cost  # S
    offloaded_share: float  # share
    ane_attention: Cost  # A
    load_per_layer: Cost  # L
    loads_in_arm: bool = True
    structural_reason: str = ""
    chip: str = SEED_CHIP  # whose power figures price the joules (planner.energy)
    objective: str = DEFAULT_OBJECTIVE  # time: the seconds decide; energy: the joules decide


@dataclass(frozen=True)
class Verdict:
    """The answer for one design: decision, both arms (value and interval), thresholds, what settles it."""

    design: str
    decision: str
    gpu_prefill: dict
    ane_prefill: dict
    predicted_ratio: float
    gain_seconds: tuple  # (low, value, high) of share * S - A - n * L
    max_load_per_layer_seconds: float | None
    min_gpu_prefill_seconds: float | None
    extrapolated: tuple  # deciding costs that are extrapolated
    costs: dict  # name -> Cost.to_dict(): gpu_prefill, ane_attention, load_per_layer
    reason: str
    settle: tuple  # (what to measure, exact command) pairs
    energy: dict | None = None  # joules of both arms with intervals and sources, and the joules' decision
    objective: str = DEFAULT_OBJECTIVE
    time_decision: str = ""  # the decision on seconds (= decision when the objective is time)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["settle"] = [list(x) for x in self.settle]
        return d


def _ane_arm(c: ArmCosts, end: str) -> float:
    s, a, load = (getattr(x, end) for x in (c.gpu_prefill, c.ane_attention, c.load_per_layer))
    return s * (1 - c.offloaded_share) + a + (c.layers * load if c.loads_in_arm else 0.0)


def verdict_for(c: ArmCosts, settle_commands: dict | None = None) -> Verdict:
    """The verdict of one design (module docstring). ``settle_commands``: cost name -> (measurement,
    command) offered for each deciding cost that is extrapolated or near the line."""
    costs = {"gpu_prefill": c.gpu_prefill, "ane_attention": c.ane_attention, "load_per_layer": c.load_per_layer}
    s, a, load, share, n = c.gpu_prefill, c.ane_attention, c.load_per_layer, c.offloaded_share, c.layers
    ane = Cost(_ane_arm(c, "value"), _ane_arm(c, "low"), _ane_arm(c, "high"), worst(costs.values()), "ANE arm")
    ratio = s.value / ane.value if ane.value > 0 else 1.0
    if not c.runs_on_ane:
        return _verdict(c, GPU, s, ane, ratio, (0.0, 0.0, 0.0), None, None, (), costs, c.structural_reason, ())
    paid = n if c.loads_in_arm else 0
    gain = (share * s.low - a.high - paid * load.high, share * s.value - a.value - paid * load.value)
    gain = (*gain, share * s.high - a.low - paid * load.low)
    x = (share * s.value - a.value) / n if n else None
    y = (a.value + n * load.value) / share if share > 0 and c.loads_in_arm else None
    deciding = {"gpu_prefill": s, "ane_attention": a} | ({"load_per_layer": load} if c.loads_in_arm else {})
    extrapolated = tuple(k for k, v in deciding.items() if v.kind == EXTRAPOLATED)
    decision, why = _decide(c, gain, x)
    commands = settle_commands or {}
    open_costs = [k for k, v in deciding.items() if k in extrapolated or (decision == DEPENDS and v.kind == FITTED)]
    settle = tuple(dict.fromkeys(commands[k] for k in open_costs if k in commands))  # one line per command
    return _verdict(c, decision, s, ane, ratio, gain, x, y, extrapolated, costs, why, settle)


def _decide(c: ArmCosts, gain: tuple, x: float | None) -> tuple[str, str]:
    """ane / gpu / depends from the gain's reachable range: "depends" only when a value inside every
    cost's interval (extrapolated costs carry their wide bands) flips the sign of the gain."""
    s, a, share, n = c.gpu_prefill, c.ane_attention, c.offloaded_share, c.layers
    best_x = (share * s.high - a.low) / n if n else None  # the most load any reachable value allows
    if best_x is not None and best_x <= 0:
        return GPU, (
            f"the threshold is below zero: even at the GPU prefill's high end ({s.high:.4g} s) and the ANE "
            f"attention's low end ({a.low:.4g} s) one layer's loads would have to take <= {best_x:.3g} s, which no "
            "load can"
        )
    if gain[0] > 0:
        return ANE, f"the ANE gains {gain[0]:.1f} s or more at every reachable value of the costs"
    if gain[2] < 0:
        return GPU, f"the ANE loses at least {-gain[2]:.1f} s at every reachable value of the costs"
    return DEPENDS, (
        f"the ANE's gain ranges {gain[0]:.1f} .. {gain[2]:.1f} s over the costs' intervals: a reachable value "
        f"flips it (at the central GPU prefill the ANE wins iff one layer's loads take <= {x:.3g} s)"
    )


def _energy(c: ArmCosts) -> dict:
    """Both arms' joules (low, value, high) on the chip's power figures: the GPU arm's S on the GPU; the ANE arm's
    S x (1 - share) on the GPU, A on the ANE, its loads on the CPU (planner.energy)."""
    watts = chip_power(c.chip)
    s, a, load = c.gpu_prefill, c.ane_attention, c.load_per_layer
    paid = c.layers if c.loads_in_arm else 0
    ends = lambda cost, k=1.0: (cost.low * k, cost.value * k, cost.high * k)  # noqa: E731
    gpu = arm_joules(ends(s), (0, 0, 0), (0, 0, 0), watts)
    ane = arm_joules(ends(s, 1 - c.offloaded_share), ends(a), ends(load, paid), watts) if c.runs_on_ane else gpu
    decision, why = energy_decision(gpu, ane, c.runs_on_ane)
    return {"gpu_joules": gpu, "ane_joules": ane, "power": power_sources(watts), "decision": decision, "reason": why}


def _verdict(c, decision, s, ane, ratio, gain, x, y, extrapolated, costs, why, settle) -> Verdict:
    energy = _energy(c)
    time_decision = decision
    if c.objective == "energy":
        decision, why = energy["decision"], f"energy: {energy['reason']} (time: {time_decision}, {why})"
    return Verdict(
        energy=energy,
        objective=c.objective,
        time_decision=time_decision,
        design=c.design,
        decision=decision,
        gpu_prefill=s.to_dict(),
        ane_prefill=ane.to_dict(),
        predicted_ratio=ratio,
        gain_seconds=tuple(float(g) for g in gain),
        max_load_per_layer_seconds=x,
        min_gpu_prefill_seconds=y,
        extrapolated=extrapolated,
        costs={k: v.to_dict() for k, v in costs.items()},
        reason=why,
        settle=settle,
    )


def worst(costs) -> str:
    """The least certain kind among costs (extrapolated > fitted > measured > yours > recorded)."""
    return worst_kind(c.kind for c in costs)


# ---- from a plan or a design plan to its deciding costs ----------------------------------------------------
def banded(value: float, kind: str, band: float, basis: str, *, relative: bool = False) -> Cost:
    """A cost of ``kind`` with the band its kind carries: points for recorded / yours / measured;
    x/÷ ``band`` (or ± ``band`` x value when ``relative``) for fitted and extrapolated."""
    if kind not in (FITTED, EXTRAPOLATED) or value == 0:
        return Cost.point(value, kind, basis)
    if relative:
        return Cost(value, value * (1 - band), value * (1 + band), kind, basis)
    return Cost.band(value, band, kind, basis)


def plan_arm_costs(plan: PrefillPlan, design: DesignPlan | None = None, data_dir: str | Path | None = None) -> ArmCosts:
    """The deciding costs of a plan — or, given ``design`` (planned on that plan's costs), of that design —
    with their intervals."""
    fit = fit_costs(data_dir)
    sparse = plan.geometry["sparse_budget"] is not None
    kinds, sources = plan.provenance, plan.cost_sources
    layers = len(plan.geometry["full_attention_layers"])
    s = banded(
        plan.gpu_prefill_seconds,
        kinds["gpu_prefill"],
        gpu_band_fraction(sparse, data_dir),
        sources.get("gpu_prefill") or sources["gpu_attention"],
        relative=True,
    )
    band = plan.gpu_runtime_band
    if band and s.kind not in (YOURS, MEASURED):  # a runtime's rates carried to this model (and chip)
        s = Cost(s.value, s.value / band, s.value * band, EXTRAPOLATED,
                 f"{s.basis}; x/÷ {band:.3g} for the runtime ({sources.get('gpu_runtime', plan.gpu_runtime)})")  # fmt: skip
    offloaded = plan.attention_saved_seconds + plan.ane_attention_seconds
    ane_seconds = plan.ane_attention_seconds if design is None else design.ane_attention_seconds
    a = banded(ane_seconds, kinds["ane_attention"], ANE_RATE_BAND, sources["ane_attention"])
    if plan.ane_chip and plan.ane_chip["band"] > 1.0 and a.kind == EXTRAPOLATED:  # carried to another chip
        a = Cost(a.value, a.low / plan.ane_chip["band"], a.high * plan.ane_chip["band"], a.kind, a.basis)
    if design is None:
        setup, loads, load_kind, load_basis = plan.setup_seconds, len(plan.load_seconds), kinds["load"], sources["load"]
    else:
        setup, loads = design.setup_seconds, (design.loads // layers if layers else 0)
        load_kind = worst_kind(kind_of(x) for x in design.load_source.split("; ")) if design.loads else None
        load_basis = design.load_source
    per_layer = setup / layers if layers else 0.0
    load = banded(per_layer, load_kind or FITTED, load_band_factor(fit), load_basis)
    if "floored" in load_basis:  # a floored load is at least the smallest recorded one
        load = replace(load, low=load.value)
    runs = bool(loads) and plan.fits and plan.variants_visited > 0
    return ArmCosts(
        design=design.design if design else DEFAULT_DESIGN,
        layers=layers,
        loads_per_layer=loads,
        runs_on_ane=runs,
        gpu_prefill=s,
        offloaded_share=offloaded / plan.gpu_prefill_seconds if plan.gpu_prefill_seconds > 0 else 0.0,
        ane_attention=a,
        load_per_layer=load,
        loads_in_arm=plan.loads_in_arm,
        structural_reason="" if runs else plan.reason,
        chip=plan.chip,
        objective=plan.objective,
    )


def thresholds_sentence(v: dict) -> str:
    """ "The ANE wins if one layer load <= X s and the GPU prefill of this prompt >= Y s" (each at the other's
    central value), or why there is no threshold. ``v``: ``Verdict.to_dict()``."""
    x, y = v["max_load_per_layer_seconds"], v["min_gpu_prefill_seconds"]
    if x is None:
        return "no threshold: the ANE does not run this prompt"
    if x <= 0:
        return (
            f"no load is fast enough: the ANE's attention alone ({v['costs']['ane_attention']['value']:.3g} s) is no "
            f"faster than the GPU attention it replaces at a GPU prefill of {v['gpu_prefill']['value']:.4g} s"
        )
    text = f"the ANE wins if one layer's loads for this prompt take <= {x:.3g} s"
    if y is not None:
        text += f" and the GPU prefill of this prompt takes >= {y:.4g} s"
    return text + " (each at the other's central value)"


def provenance_label(kind: str) -> str:
    """How a cost's kind reads beside a number."""
    return {YOURS: "yours", MEASURED: "measured on this Mac"}.get(kind, kind)
