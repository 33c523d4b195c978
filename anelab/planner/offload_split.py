"""Which blocks of prefill go to the ANE: every candidate split priced per chip, the best first, with intervals.

A *part* is one kind of block over the layers that hold it: ``attention`` (the full-attention and windowed
layers' attention, priced by ``planner.plan`` exactly as the attention-only plan prices it: its GPU attention
against its ANE attention plus loads), ``mlp`` (every layer's gate / up / down) and ``projections`` (a hybrid's
Gated DeltaNet input projections, ``in_proj_qkvz`` / ``in_proj_ba``). A *split* is a set of parts on the ANE;
the candidates are every subset (``none`` included) and, where a part's weights exceed one ANE program's address
window, the layers of it that fit one window.

Seconds, for a prompt of N tokens in chunks of C (``planner.plan``'s schedule), all-GPU arm ``T``::

    GPU seconds of a matmul part  g = non_attention x part weights / active weights   (one runtime rate per weight)
    ANE seconds of a matmul part  a = sum over its layers and chunks of
                                      max(compute, traffic) + dispatch + transfer          (the "your chip" roofline)
        compute  = 2 x weights x C FLOPs / (ANE fp16 GEMM x cliff factor once weights + activations pass the cliff)
        traffic  = the part's fp16 weights read once per call / memory bandwidth
        transfer = the boundary's activations, C x (in + out width) x 2 B, written by one engine and read by the
                   other / memory bandwidth
    split time   = T - sum g + sum a  (serial: the GPU waits for each block on the ANE)
    ratio        = T / split time     (above 1 the split is faster than all-GPU)

ANE efficiency: the published GEMM rate is a matmul benchmark's; the one sidecar graph on record (the seed's
attention, ``ane_chips.calibration``) ran at ``1 / gap`` of its roofline. A matmul part is priced between the
roofline and the roofline x gap (central: their geometric middle), x/÷ the chip's GEMM figure band. The GPU side
is x/÷ the runtime's band (``gpu_runtimes``). The ratio's interval is its extremes over those corners.

Residency: a part's weights (fp16 as anelab stores them) stay loaded on the ANE; one program holds at most
``ADDRESS_WINDOW`` bytes, so a split needs ``ceil(resident / window)`` programs (anelab writes one package per
layer; a single layer's part over the window cannot be one package and is refused). Loading the resident weights
is a one-time cost at the one load model's reload rate per GB (``planner.loads``; carried from score arenas to
weights, extrapolated), repaid after the prompts ``planner.cold_start`` counts. The parts' sources are named in
each split's ``figures``; an unknown chip figure refuses the chip in one line.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field

from anelab.checkpoints.blocks import gdn_geometry, linear_attention_layers
from anelab.checkpoints.config import config_int
from anelab.core.errors import AnelabInputError
from anelab.planner.ane_chips import calibration
from anelab.planner.catalogue import ane_score_entries, get_family
from anelab.planner.chip_figures import Figure
from anelab.planner.chips import CHIPS, SEED_CHIP, Chip, get_chip
from anelab.planner.cold_start import cold_start
from anelab.planner.fit import fit_costs
from anelab.planner.from_checkpoint import closest_family
from anelab.planner.gpu_model import active_parameters
from anelab.planner.gpu_runtimes import MLX_LM
from anelab.planner.plan import plan

BYTES = 2  # fp16, as anelab's sidecars store weights and activations
OMLX_DOC = "https://github.com/jundot/omlx/blob/main/docs/experimental/qwen35_ane_prefill.md"
OMLX_WINDOW_ISSUE = "https://github.com/jundot/omlx/issues/2781"
ADDRESS_WINDOW = Figure(
    4 * 2**30,
    OMLX_DOC,
    "~4 GiB of weights per ANE program (oMLX's notes, as quoted in anelab issue 43); a 3.75 GiB packed bank "
    f"failed to load on an M1 Ultra ({OMLX_WINDOW_ISSUE}), so the usable window may be smaller",
)
PACKAGE_LIMIT = Figure(None, None, "no public limit on a Core ML package's size was found", kind="unknown")
CALIBRATION_FAMILY = "qwen3.8-125b-a6b-4bit"  # the recorded ANE h0 prediction (0.43 s) the ANE rate comes from
CALIBRATION_CHUNK = 4096
ATTENTION, MLP, PROJECTIONS = "attention", "mlp", "projections"
PART_ORDER = (ATTENTION, MLP, PROJECTIONS)


@dataclass(frozen=True)
class MatmulPart:
    """One matmul block kind on ``layers`` layers: ``weights`` per layer, activations ``in_width`` -> ``out_width``
    per token (an MLP: hidden -> hidden; the GDN input projections: hidden -> their output width)."""

    name: str
    layers: int
    weights: float
    in_width: int
    out_width: int
    source: str


@dataclass(frozen=True)
class AttentionPart:
    """The attention-only plan's numbers (``planner.plan``): its GPU attention, its ANE attention with its loads,
    x/÷ ``band`` (the ANE carry's), and its fp16 weights (q/k/v/o of every offloaded layer)."""

    gpu_seconds: float
    ane_seconds: float
    band: float
    weights: float
    layers: int
    bound: str
    source: str


@dataclass(frozen=True)
class SplitInputs:
    """What every split of one prompt on one chip is priced from (module docstring's symbols)."""

    chip: str
    prompt_tokens: int
    chunk: int
    gpu_seconds: float  # T: the all-GPU arm
    non_attention_seconds: float
    active_weights: float
    gpu_band: float
    attention: AttentionPart | None
    parts: tuple[MatmulPart, ...]
    gpu_source: str


@dataclass(frozen=True)
class PartCost:
    """One part on the ANE: seconds on each side, the ANE side's interval, its binding term, its resident bytes."""

    name: str
    layers: int
    gpu_seconds: float
    ane_seconds: float
    ane_low: float
    ane_high: float
    bound: str
    resident_bytes: float
    largest_layer_bytes: float


@dataclass(frozen=True)
class Split:
    """One candidate: ``parts`` on the ANE, its seconds, its ratio to all-GPU with an interval, what decides it."""

    name: str
    parts: list
    seconds: float
    ratio: float
    ratio_low: float
    ratio_high: float
    decided_by: str
    resident_bytes: float
    programs: int
    one_time_load_seconds: float
    prompts_to_repay: int | None
    costs: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


# ---- the ANE side of one matmul part ---------------------------------------------------------------------------
def ane_efficiency_gap() -> float:
    """The seed's recorded attention layer-chunk over its M3 roofline (``ane_chips.calibration``): how far the one
    sidecar graph on record ran from the published GEMM rate."""
    fam = get_family(CALIBRATION_FAMILY)
    fit = fit_costs()
    recorded = fit.ane_seconds_per_entry * ane_score_entries(fam.geometry, CALIBRATION_CHUNK, 0)
    return float(calibration(recorded, fam.geometry, CALIBRATION_CHUNK)["recorded_over_roofline"])


def matmul_call_terms(chip: Chip, weights: float, rows: int, in_width: int, out_width: int) -> dict:
    """Seconds of one ANE call of a matmul block (``weights`` fp16 weights, ``rows`` tokens [rows, in_width] ->
    [rows, out_width]) on ``chip``: compute, weight traffic, dispatch and the boundary's transfer (None where the
    chip's figure is unknown)."""
    m = chip.measured()
    gemm, cliff_mb, cliff_factor, dispatch = (m[k] for k in ("ane_fp16_gemm_tflops", "ane_cliff_mb",
                                                             "ane_cliff_factor", "ane_dispatch_ms"))  # fmt: skip
    if not gemm.known:
        raise AnelabInputError(
            f"--chip {chip.name}: ANE fp16 matmul throughput unknown ({gemm.note}); no split can be priced on it"
        )
    activations = BYTES * rows * (in_width + out_width)
    past_cliff = BYTES * weights + activations > cliff_mb.value * 1e6
    compute = 2.0 * weights * rows / (gemm.value * 1e12 * (cliff_factor.value if past_cliff else 1.0))
    bw = chip.bandwidth_gbs
    traffic = BYTES * weights / (bw.value * 1e9) if bw.known else None
    transfer = 2.0 * activations / (bw.value * 1e9) if bw.known else None
    return {"compute": compute, "traffic": traffic, "dispatch": dispatch.value * 1e-3, "transfer": transfer,
            "past_cliff": past_cliff}  # fmt: skip


def _call_seconds(t: dict) -> float:
    return max(t["compute"], t["traffic"] or 0.0) + t["dispatch"] + (t["transfer"] or 0.0)


def _call_bound(t: dict) -> str:
    terms = {"compute" + (" past the cliff" if t["past_cliff"] else ""): t["compute"], "weight traffic":
             t["traffic"] or 0.0, "dispatch": t["dispatch"], "transfer": t["transfer"] or 0.0}  # fmt: skip
    return max(terms, key=terms.get)


def matmul_part_cost(chip: Chip, part: MatmulPart, inputs: SplitInputs, gap: float, layers: int | None = None):
    """``part`` (its first ``layers`` layers; None: all) on the ANE of ``chip`` (module docstring)."""
    layers = part.layers if layers is None else layers
    full, last = divmod(inputs.prompt_tokens, inputs.chunk)
    calls = [(inputs.chunk, full)] + ([(inputs.chunk, 1)] if last else [])  # a partial chunk is padded to C
    terms = matmul_call_terms(chip, part.weights, inputs.chunk, part.in_width, part.out_width)
    roofline = _call_seconds(terms) * sum(n for _, n in calls) * layers
    band = chip.measured()["ane_fp16_gemm_tflops"].band
    if not chip.bandwidth_gbs.known:  # traffic and transfer unknown: left out, the band widened by the seed's share
        seed = matmul_call_terms(CHIPS[SEED_CHIP], part.weights, inputs.chunk, part.in_width, part.out_width)
        band *= 1.0 + (max(seed["traffic"] - seed["compute"], 0.0) + seed["transfer"]) / _call_seconds(seed)
    central = roofline * math.sqrt(gap)
    gpu = inputs.non_attention_seconds * part.weights * layers / inputs.active_weights
    return PartCost(
        name=part.name if layers == part.layers else f"{part.name}[:{layers}]",
        layers=layers,
        gpu_seconds=gpu,
        ane_seconds=central,
        ane_low=roofline / band,
        ane_high=roofline * gap * band,
        bound=_call_bound(terms),
        resident_bytes=BYTES * part.weights * layers,
        largest_layer_bytes=BYTES * part.weights,
    )


def attention_part_cost(a: AttentionPart) -> PartCost:
    return PartCost(ATTENTION, a.layers, a.gpu_seconds, a.ane_seconds, a.ane_seconds / a.band, a.ane_seconds * a.band,
                    a.bound, BYTES * a.weights, BYTES * a.weights / max(a.layers, 1))  # fmt: skip


# ---- the splits ------------------------------------------------------------------------------------------------
def part_costs(inputs: SplitInputs) -> dict[str, PartCost]:
    """Each part of the model on the ANE of ``inputs.chip``; a part over one window also as the layers that fit."""
    chip, gap = get_chip(inputs.chip), ane_efficiency_gap()
    out = {}
    if inputs.attention is not None:
        out[ATTENTION] = attention_part_cost(inputs.attention)
    for part in inputs.parts:
        if part.layers == 0:
            continue
        if BYTES * part.weights > ADDRESS_WINDOW.value:
            raise AnelabInputError(
                f"one layer's {part.name} holds {BYTES * part.weights / 2**30:.1f} GiB of fp16 weights, over one ANE "
                f"program's ~{ADDRESS_WINDOW.value / 2**30:.0f} GiB window ({ADDRESS_WINDOW.source}): it cannot be "
                "one package; plan it with attention only"
            )
        out[part.name] = matmul_part_cost(chip, part, inputs, gap)
        fitting = int(ADDRESS_WINDOW.value // (BYTES * part.weights))
        if fitting < part.layers:
            out[f"{part.name}[:{fitting}]"] = matmul_part_cost(chip, part, inputs, gap, fitting)
    return out


def _ratio_interval(inputs: SplitInputs, costs: list[PartCost]) -> tuple[float, float]:
    """The ratio's extremes over the GPU side x/÷ its band and the ANE parts at their interval's ends."""
    t, g = inputs.gpu_seconds, sum(c.gpu_seconds for c in costs)
    ratios = []
    for s in (1.0 / inputs.gpu_band, inputs.gpu_band):
        for a in (sum(c.ane_low for c in costs), sum(c.ane_high for c in costs)):
            ratios.append(t * s / (t * s - g * s + a))
    return min(ratios), max(ratios)


def _decided_by(costs: list[PartCost], all_costs: dict[str, PartCost]) -> str:
    if not costs:
        closest = min(all_costs.values(), key=lambda c: c.ane_seconds / max(c.gpu_seconds, 1e-30), default=None)
        if closest is None:
            return "no part of this model can go to the ANE"
        return (f"every part is slower on the ANE; the closest, {closest.name}, costs {closest.ane_seconds:.3g} s there "
                f"against {closest.gpu_seconds:.3g} s on the GPU ({closest.bound}-bound)")  # fmt: skip
    top = max(costs, key=lambda c: abs(c.gpu_seconds - c.ane_seconds))
    verb = "saves" if top.gpu_seconds > top.ane_seconds else "loses"
    return (f"{top.name} {verb} {abs(top.gpu_seconds - top.ane_seconds):.3g} s (GPU {top.gpu_seconds:.3g} s, ANE "
            f"{top.ane_seconds:.3g} s, {top.bound}-bound)")  # fmt: skip


def price_split(inputs: SplitInputs, names: tuple[str, ...], all_costs: dict[str, PartCost]) -> Split:
    """One split: the parts ``names`` on the ANE (module docstring)."""
    costs = [all_costs[n] for n in names]
    seconds = inputs.gpu_seconds - sum(c.gpu_seconds for c in costs) + sum(c.ane_seconds for c in costs)
    low, high = _ratio_interval(inputs, costs)
    matmul = [c for c in costs if c.name != ATTENTION]  # the attention plan prices its own loads per prompt
    resident = sum(c.resident_bytes for c in matmul)
    load = resident / 1e9 * fit_costs().reload_seconds_per_gb
    start = cold_start(load, inputs.gpu_seconds, seconds, backend=None, assets=1, runs_on_ane=bool(matmul))
    return Split(
        name=" + ".join(names) if names else "none",
        parts=list(names),
        seconds=seconds,
        ratio=inputs.gpu_seconds / seconds,
        ratio_low=low,
        ratio_high=high,
        decided_by=_decided_by(costs, all_costs),
        resident_bytes=resident,
        programs=math.ceil(resident / ADDRESS_WINDOW.value) if resident else 0,
        one_time_load_seconds=load,
        prompts_to_repay=start["prompts_to_repay"],
        costs=[asdict(c) for c in costs],
    )


def candidate_names(available: list[str]) -> list[tuple[str, ...]]:
    """Every subset of the parts (``none`` first); a part's window-fitting layers never beside the whole part."""
    out = []
    for k in range(len(available) + 1):
        for combo in itertools.combinations(available, k):
            stems = [n.split("[")[0] for n in combo]
            if len(set(stems)) == len(stems):
                out.append(combo)
    return out


def offload_splits(inputs: SplitInputs) -> list[Split]:
    """Every candidate split of the prompt on ``inputs.chip``, fastest first (ties: fewer parts first)."""
    costs = part_costs(inputs)
    ordered = sorted(costs, key=lambda n: (PART_ORDER.index(n.split("[")[0]), n))
    splits = [price_split(inputs, names, costs) for names in candidate_names(ordered)]
    # a part that moves nothing (e.g. attention on a prompt shorter than one chunk) ties with fewer parts: the
    # seconds are compared to 1e-9 of the all-GPU arm, so float rounding never ranks a no-op above "none"
    return sorted(splits, key=lambda s: (round(s.seconds / inputs.gpu_seconds, 9), len(s.parts)))


# ---- a checkpoint's splits per chip ----------------------------------------------------------------------------
def checkpoint_parts(checkpoint) -> tuple[tuple[MatmulPart, ...], list[str]]:
    """(the checkpoint's matmul parts from its config.json, why a part is absent): every layer's gated MLP (gate / up /
    down, or a fused gate_up, ``intermediate_size`` wide; routed experts and an ungated MLP have no MLP sidecar) and
    a hybrid's Gated DeltaNet input projections. A part whose sizes the config does not state is absent, saying so."""
    parts, absent = [], []
    try:
        parts.append(_mlp_part(checkpoint))
    except AnelabInputError as e:
        absent.append(f"mlp: {e}")
    if not linear_attention_layers(checkpoint):
        absent.append("projections: no Gated DeltaNet layers (not a hybrid)")
        return tuple(parts), absent
    try:
        gg, hidden = gdn_geometry(checkpoint), checkpoint.geometry.hidden_size
    except AnelabInputError as e:
        return tuple(parts), [*absent, f"projections: {e}"]
    out = 2 * gg.key_dim + 2 * gg.value_dim + 2 * gg.value_heads  # in_proj_qkvz + in_proj_ba
    parts.append(MatmulPart(PROJECTIONS, len(linear_attention_layers(checkpoint)), float(hidden * out), hidden, out,
                            f"config.json: hidden {hidden} x (2 x key_dim {gg.key_dim} + 2 x value_dim {gg.value_dim} "
                            f"+ 2 x value heads {gg.value_heads}) per GDN layer"))  # fmt: skip
    return tuple(parts), absent


def _mlp_part(checkpoint) -> MatmulPart:
    """Every layer's gated MLP, or a one-line refusal naming why it has no MLP sidecar."""
    text, hidden = checkpoint.text, checkpoint.geometry.hidden_size
    if text.get("num_experts_per_tok") or text.get("moe_intermediate_size"):
        raise AnelabInputError("routed experts (an MoE MLP) have no MLP sidecar")
    stem = f"{checkpoint.prefix}layers.0.mlp."
    if not any(checkpoint.has_tensor(f"{stem}{name}.weight") for name in ("gate_proj", "gate_up_proj")):
        raise AnelabInputError("no gate projection (an ungated MLP); the MLP sidecar is a gated gate / up / down block")
    width = config_int(text, "intermediate_size", minimum=1)
    return MatmulPart(MLP, checkpoint.geometry.num_layers, 3.0 * hidden * width, hidden, hidden,
                      f"config.json: 3 x hidden {hidden} x intermediate {width} per layer")  # fmt: skip


def checkpoint_split_inputs(checkpoint, planned, parts: tuple[MatmulPart, ...]) -> SplitInputs:
    """``planned`` (``plan_from_checkpoint``'s ``CheckpointPlan``) as a split's inputs: the attention part is the
    sum of its kinds' attention plans (GPU attention against ANE attention + loads, the plan's own numbers)."""
    plans = list(planned.parts.values())
    first = plans[0]
    g = checkpoint.geometry
    per_layer = g.hidden_size * g.head_dim * (2 * g.num_heads + 2 * g.num_kv_heads)
    layers = sum(len(p.geometry["full_attention_layers"]) for p in plans)
    carry = first.ane_chip or {}
    attention = AttentionPart(
        gpu_seconds=sum(p.gpu_attention_seconds for p in plans),
        ane_seconds=sum(p.ane_prefill_seconds - p.non_attention_seconds for p in plans),
        band=carry.get("band", 1.0),
        weights=float(per_layer * layers),
        layers=layers,
        bound=carry.get("bound", "recorded"),
        source="planner.plan: the attention-only plan's GPU attention and ANE attention + loads",
    )
    return SplitInputs(
        chip=first.chip,
        prompt_tokens=first.prompt_tokens,
        chunk=first.chunk,
        gpu_seconds=planned.gpu_prefill_seconds,
        non_attention_seconds=first.non_attention_seconds,
        active_weights=first.weights["active"],
        gpu_band=first.gpu_runtime_band or 1.0,
        attention=attention,
        parts=parts,
        gpu_source=first.cost_sources.get("gpu_runtime", first.gpu_runtime),
    )


@dataclass(frozen=True)
class ChipSplits:
    """One chip's splits, fastest first (``splits``), or why the chip cannot be priced (``refused``)."""

    chip: str
    splits: list
    refused: str | None = None

    def to_dict(self) -> dict:
        return {"chip": self.chip, "refused": self.refused, "splits": [s.to_dict() for s in self.splits]}


def checkpoint_splits(checkpoint, prompt_tokens: int, chips, plan_for_chip) -> dict:
    """Each chip's splits of ``prompt_tokens`` on ``checkpoint`` (opened): ``plan_for_chip(chip)`` is that chip's
    ``CheckpointPlan``; a chip whose figures cannot price it is listed with the refusal's one line."""
    parts, absent = checkpoint_parts(checkpoint)
    out = []
    for chip in chips:
        try:
            planned = plan_for_chip(chip)
            out.append(ChipSplits(chip, offload_splits(checkpoint_split_inputs(checkpoint, planned, parts))))
        except AnelabInputError as e:
            out.append(ChipSplits(chip, [], str(e)))
    return {"prompt_tokens": prompt_tokens, "window": ADDRESS_WINDOW.to_dict(),
            "package_limit": PACKAGE_LIMIT.to_dict(), "absent": absent, "chips": [c.to_dict() for c in out]}  # fmt: skip


# ---- a part shared by rows: the ANE and the GPU at once (oMLX's and mlx-serve's scheme) --------------------------
def shared_split(inputs: SplitInputs, fractions: dict[str, float]) -> Split:
    """Each named matmul part split by output rows: ``fraction`` of its weights on the ANE, the rest on the GPU, both
    at once; the part takes the longer of the two (an MLP's slice returns a full-width partial sum, a projection's
    its share of the channels)::

        part time = max(g x (1 - fraction), a(fraction x weights)),   split time = T - sum g + sum part time
    """
    chip, gap = get_chip(inputs.chip), ane_efficiency_gap()
    parts = {p.name: p for p in inputs.parts}
    unknown = sorted(set(fractions) - set(parts))
    if unknown:
        raise AnelabInputError(f"this model has no {', '.join(unknown)} part to share; it has {', '.join(parts)}")
    rows = []
    for name, f in fractions.items():
        if not 0.0 < f < 1.0:
            raise AnelabInputError(f"a shared {name}'s ANE fraction must lie strictly between 0 and 1, got {f}")
        p = parts[name]
        out = p.out_width if name == MLP else max(1, round(f * p.out_width))
        ane = matmul_part_cost(chip, MatmulPart(name, p.layers, f * p.weights, p.in_width, out, p.source), inputs, gap)
        g = inputs.non_attention_seconds * p.weights * p.layers / inputs.active_weights
        rows.append((name, f, g, ane))

    def seconds(scale: float, ane_of) -> float:
        t = inputs.gpu_seconds * scale
        return (
            t - sum(g * scale for _, _, g, _ in rows) + sum(max(g * scale * (1 - f), ane_of(a)) for _, f, g, a in rows)
        )

    central = seconds(1.0, lambda a: a.ane_seconds)
    corners = [inputs.gpu_seconds * s / seconds(s, pick) for s in (1 / inputs.gpu_band, inputs.gpu_band)
               for pick in (lambda a: a.ane_low, lambda a: a.ane_high)]  # fmt: skip
    waits = [f"{n}@{f:.2f}: {'ANE' if a.ane_seconds > g * (1 - f) else 'GPU'} {max(a.ane_seconds, g * (1 - f)):.3g} s "
             f"(GPU alone {g:.3g} s; ANE {a.bound}-bound)" for n, f, g, a in rows]  # fmt: skip
    resident = sum(a.resident_bytes for *_, a in rows)
    return Split(
        name=" + ".join(f"{n}@{f:.2f}" for n, f, *_ in rows) + " (shared)",
        parts=[n for n, *_ in rows],
        seconds=central,
        ratio=inputs.gpu_seconds / central,
        ratio_low=min(corners),
        ratio_high=max(corners),
        decided_by="; ".join(waits),
        resident_bytes=resident,
        programs=math.ceil(resident / ADDRESS_WINDOW.value),
        one_time_load_seconds=resident / 1e9 * fit_costs().reload_seconds_per_gb,
        prompts_to_repay=None,
        costs=[asdict(a) for *_, a in rows],
    )


# ---- a model given by its sizes (a published configuration, no checkpoint on disk) ------------------------------
@dataclass(frozen=True)
class ModelSizes:
    """A model's sizes as its public config states them: ``full_attention_layers`` indices, the MLP width, and a
    hybrid's GDN layers with their input projections' output width (0 layers: not a hybrid)."""

    name: str
    hidden: int
    layers: int
    full_attention_layers: tuple
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    gdn_layers: int = 0
    gdn_out_width: int = 0
    source: str = ""

    def config(self) -> dict:
        """config.json's keys ``gpu_model.active_parameters`` reads."""
        return {"hidden_size": self.hidden, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                "intermediate_size": self.intermediate}  # fmt: skip

    def parts(self) -> tuple[MatmulPart, ...]:
        mlp = MatmulPart(MLP, self.layers, 3.0 * self.hidden * self.intermediate, self.hidden, self.hidden, self.source)
        if not self.gdn_layers:
            return (mlp,)
        gdn = MatmulPart(PROJECTIONS, self.gdn_layers, float(self.hidden * self.gdn_out_width), self.hidden,
                         self.gdn_out_width, self.source)  # fmt: skip
        return mlp, gdn


def sizes_split_inputs(model: ModelSizes, prompt_tokens: int, chunk: int, chip: str, bytes_per_weight: float = 2.0):
    """``model``'s splits' inputs on ``chip``: its attention-only plan (``planner.plan``, costs from the closest
    recorded dense family, mlx-lm's GPU prefill of its own FLOPs; past the family's coverage the attention stays on
    the GPU), and its matmul parts."""
    fam, _ = closest_family(model.heads, model.head_dim, len(model.full_attention_layers))
    active = active_parameters(model.config())
    planned = plan(prompt_tokens, family=fam, chunk=chunk, num_layers=model.layers,
                   full_attention_layers=model.full_attention_layers, num_heads=model.heads,
                   num_kv_heads=model.kv_heads, head_dim=model.head_dim, weights=(active, active * bytes_per_weight),
                   gpu_runtime=MLX_LM, chip=chip, allow_past_coverage=True)  # fmt: skip
    carry = planned.ane_chip or {}
    per_layer = model.hidden * model.head_dim * (2 * model.heads + 2 * model.kv_heads)
    attention = AttentionPart(planned.gpu_attention_seconds, planned.ane_prefill_seconds - planned.non_attention_seconds,
                              carry.get("band", 1.0), float(per_layer * len(model.full_attention_layers)),
                              len(model.full_attention_layers), carry.get("bound", "recorded"),
                              "planner.plan: the attention-only plan")  # fmt: skip
    return SplitInputs(chip=planned.chip, prompt_tokens=prompt_tokens, chunk=chunk,
                       gpu_seconds=planned.gpu_prefill_seconds, non_attention_seconds=planned.non_attention_seconds,
                       active_weights=active, gpu_band=planned.gpu_runtime_band or 1.0, attention=attention,
                       parts=model.parts(), gpu_source=planned.cost_sources.get("gpu_runtime", MLX_LM))  # fmt: skip
