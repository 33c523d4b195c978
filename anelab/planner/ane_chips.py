"""The ANE arm on any chip: the seed's M3 records carried to another chip through its figures by a roofline.

One layer-chunk of a dense sidecar (``heads`` heads of head_dim ``d``, ``rows`` = the chunk, ``keys`` = history +
chunk) costs on a chip (``planner.chip_figures``)::

    compute   = 4 d x heads x rows x keys FLOPs / (ANE fp16 GEMM rate x cliff factor if one head's working set
                -- 2 bytes x (rows x d + 2 x keys x d + rows x keys): Q, K, V and its score tile -- passes the cliff)
    traffic   = the score arena (heads x rows x keys x 2 bytes) written and read back once / memory bandwidth
    dispatch  = one ANE dispatch (one function call per layer-chunk) at the chip's floor
    roofline  = max(compute, traffic) + dispatch

Calibration: on the seed's M3 the recorded ANE rate is taken as it is; what limits it is the M3 roofline's binding
term (``calibration``: at the recorded geometry, compute past the cliff — the recorded time is ~4x the roofline,
an efficiency the carry keeps). On chip C the ANE attention is the M3's times ``sum roofline_C / sum roofline_M3``
over the plan's ANE chunks: the term that binds moves with the geometry (a small chunk is dispatch-bound, a large
one past the cliff), so this is not one ratio per chip.

Interval: x/÷ the product of the bands of the figures the binding terms read on both chips (a published figure
``CARRY_BAND``, from a benchmark's shapes to the sidecar's; an extrapolated one its own range too); every figure
is listed with its kind. A figure the binding term needs that is unknown refuses the ANE arm on that chip in one
line naming it; an unknown bandwidth leaves traffic out and widens the band by the traffic's share on the M3.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from anelab.core.errors import AnelabInputError
from anelab.planner.catalogue import PlanGeometry
from anelab.planner.chip_figures import CARRY_BAND, Figure
from anelab.planner.chips import CHIPS, SEED_CHIP, Chip, get_chip

BYTES = 2  # fp16


@dataclass(frozen=True)
class AneCarry:
    """The seed's ANE attention carried to ``chip``: times ``scale``, x/÷ ``band``; ``bound``: the binding term."""

    chip: str
    scale: float
    band: float
    bound: str
    figures: dict  # name -> Figure.to_dict() the binding terms read (on the chip and on the M3)
    basis: str

    def to_dict(self) -> dict:
        return asdict(self)


def layer_chunk_terms(chip: Chip, heads: int, head_dim: int, rows: int, keys: int) -> dict:
    """Seconds of one layer-chunk's compute, score-arena traffic and dispatch on ``chip`` (None: figure unknown)."""
    m = chip.measured()
    gemm, cliff_mb, cliff_factor, dispatch = (m[k] for k in ("ane_fp16_gemm_tflops", "ane_cliff_mb",
                                                             "ane_cliff_factor", "ane_dispatch_ms"))  # fmt: skip
    flops = 4.0 * head_dim * heads * rows * keys
    working_set = BYTES * (rows * head_dim + 2 * keys * head_dim + rows * keys)
    past_cliff = working_set > cliff_mb.value * 1e6
    compute = None
    if gemm.known:
        compute = flops / (gemm.value * 1e12 * (cliff_factor.value if past_cliff else 1.0))
    bw = chip.bandwidth_gbs
    traffic = 2 * BYTES * heads * rows * keys / (bw.value * 1e9) if bw.known else None
    return {"compute": compute, "traffic": traffic, "dispatch": dispatch.value * 1e-3, "past_cliff": past_cliff}


def _roofline(terms: dict) -> float:
    return max(terms["compute"], terms["traffic"] or 0.0) + terms["dispatch"]


def _bound(terms: dict) -> str:
    core = "compute" if terms["compute"] >= (terms["traffic"] or 0.0) else "traffic"
    if terms["dispatch"] > max(terms["compute"], terms["traffic"] or 0.0):
        return "dispatch"
    return core + (" past the cliff" if core == "compute" and terms["past_cliff"] else "")


def _read_figures(chip: Chip, bound: str) -> dict[str, Figure]:
    m = chip.measured()
    names = {"dispatch": ["ane_dispatch_ms"], "traffic": []}.get(bound.split()[0], ["ane_fp16_gemm_tflops"])
    if "cliff" in bound:
        names.append("ane_cliff_factor")
    figures = {f"{chip.name} {n}": m[n] for n in names}
    if bound.startswith("traffic"):
        figures[f"{chip.name} bandwidth_gbs"] = chip.bandwidth_gbs
    return figures


def carry_ane(chip_name: str, geometry: PlanGeometry, chunk: int, histories: list[int]) -> AneCarry:
    """The seed's (M3) ANE attention of the ANE chunks at ``histories`` carried to ``chip_name`` (module docstring)."""
    chip, seed = get_chip(chip_name), CHIPS[SEED_CHIP]
    if chip.name == SEED_CHIP or not histories:
        return AneCarry(chip.name, 1.0, 1.0, "recorded", {}, f"the seed's {SEED_CHIP} records")
    gemm = chip.measured()["ane_fp16_gemm_tflops"]
    if not gemm.known:
        raise AnelabInputError(
            f"--chip {chip.name}: ANE fp16 matmul throughput unknown ({gemm.note}); the ANE arm cannot be priced "
            "on it — pass --ane-attention-seconds or another --chip"
        )
    heads, head_dim = geometry.num_heads, geometry.head_dim or 256
    on_chip = [layer_chunk_terms(chip, heads, head_dim, chunk, h + chunk) for h in histories]
    on_seed = [layer_chunk_terms(seed, heads, head_dim, chunk, h + chunk) for h in histories]
    band = CARRY_BAND
    if not chip.bandwidth_gbs.known:  # traffic unknown: left out, widened by its share on the seed's chip
        share = sum(t["traffic"] for t in on_seed) / sum(_roofline(t) for t in on_seed)
        band *= 1.0 + share
    scale = sum(_roofline(t) for t in on_chip) / sum(_roofline(t) for t in on_seed)
    bounds = {c.name: _bound(max(ts, key=_roofline)) for c, ts in ((chip, on_chip), (seed, on_seed))}
    figures = {**_read_figures(chip, bounds[chip.name]), **_read_figures(seed, bounds[seed.name])}
    for f in figures.values():
        band *= f.band
    basis = (
        f"extrapolated: the seed's {SEED_CHIP} ANE attention x {scale:.3g} (ANE roofline {chip.name} / {SEED_CHIP}: "
        f"{bounds[chip.name]}-bound on the {chip.name}, {bounds[seed.name]}-bound on the {SEED_CHIP}; "
        + ", ".join(f"{k} {f.value:.3g} ({f.kind})" for k, f in figures.items())
        + f"), x/÷ {band:.2f}"
    )
    return AneCarry(chip.name, scale, band, bounds[chip.name], {k: f.to_dict() for k, f in figures.items()}, basis)


def calibration(recorded_seconds: float, geometry: PlanGeometry, chunk: int, history: int = 0) -> dict:
    """What limits the sidecar graph on the seed's M3 at one recorded layer-chunk: each roofline term, the binding
    one, and the recorded time over the roofline (the efficiency every chip's carry keeps)."""
    terms = layer_chunk_terms(CHIPS[SEED_CHIP], geometry.num_heads, geometry.head_dim or 256, chunk, history + chunk)
    roof = _roofline(terms)
    return {**terms, "roofline": roof, "bound": _bound(terms), "recorded": recorded_seconds,
            "recorded_over_roofline": recorded_seconds / roof}  # fmt: skip
