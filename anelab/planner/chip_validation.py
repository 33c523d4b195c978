"""The per-chip model checked against public ANE-versus-GPU measurements on other chips (``plan --validate-chips``).

Each ``PublicPair`` is a published measurement of one workload on a chip's Neural Engine and on its GPU. The
model predicts the pair's ratio (GPU seconds / ANE seconds: above 1 the ANE is faster) from the chip's own figures
only (``planner.chips``, ``planner.chip_figures``) — a roofline per unit, the same terms the ANE arm is carried by
(``planner.ane_chips``)::

    unit seconds = max(FLOPs / the unit's matmul rate, weight bytes / memory bandwidth) + dispatches x floor (ANE)

The ANE's rate is its fp16 GEMM figure; the GPU's is Core ML's measured GPU matmul (a chip without one: the GPU
figure of ``planner.chips`` on the M4 Pro's measured / table scale). The interval is x/÷ the product of the two
rates' bands, each widened by ``CARRY_BAND`` (a benchmark's shapes carried to a model's). The seed's M3 rows are
``planner.plan``'s ratio against the recorded one, inside the verdict's interval or not.

These rows are predictions, never inputs: ``predict`` reads one pair and the chip table, nothing else, so leaving a
row out (or changing its published value) changes no other prediction (tested). Measurements the model cannot
express are listed in ``CANNOT_EXPRESS`` with why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from anelab.planner.ane_chips import calibration
from anelab.planner.catalogue import REFERENCE_CHUNK, get_family
from anelab.planner.chip_figures import CARRY_BAND, GPU_CORES, GPU_MATMUL_TFLOPS, MOBIUS, PLACEMENT, Figure
from anelab.planner.chips import SEED_CHIP, get_chip
from anelab.planner.fit import fit_costs
from anelab.planner.gpu_model import active_parameters
from anelab.planner.mlx_lm_rates import QWEN3_06B
from anelab.planner.plan import plan, predicted_vs_recorded
from anelab.planner.verdict import plan_arm_costs, verdict_for

# SigLIP-base-224 vision tower (ViT-B/16): 12 layers, hidden 768, MLP 3072, 196 patches; batch 16
_SIGLIP = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}
_SIGLIP_TOKENS = 16 * 196


@dataclass(frozen=True)
class PublicPair:
    """One public measurement of a workload on a chip's ANE and GPU: ``published_ratio`` = GPU s / ANE s."""

    name: str
    chip: str
    published_ratio: float
    flops: float  # matmul FLOPs of one run
    weight_bytes: float  # fp16 weights read once per run
    dispatches: int  # ANE dispatches per run
    source: str


def _linear_flops(config: dict, tokens: int) -> float:
    return 2.0 * active_parameters(config) * tokens


PUBLIC_PAIRS: tuple[PublicPair, ...] = (
    PublicPair("SigLIP-base-224 vision tower, batch 16, fp16 (204.4 vs 178.8 img/s)", "M4 Pro", 204.4 / 178.8,
               _linear_flops(_SIGLIP, _SIGLIP_TOKENS), 2.0 * active_parameters(_SIGLIP), 1, PLACEMENT),
    PublicPair("SigLIP-base-224 vision tower, batch 16, fp16 (233.0 vs 1085.7 img/s)", "M5 Max", 233.0 / 1085.7,
               _linear_flops(_SIGLIP, _SIGLIP_TOKENS), 2.0 * active_parameters(_SIGLIP), 1, PLACEMENT),
    PublicPair("Qwen3-0.6B Core ML prefill of 128 tokens (ANE 12.5 ms, GPU 9.3 ms)", "M5 Pro", 9.3 / 12.5,
               _linear_flops(QWEN3_06B, 128), 2.0 * active_parameters(QWEN3_06B), 1, MOBIUS),
)  # fmt: skip

CANNOT_EXPRESS: tuple[dict, ...] = (
    {"measurement": "M4 Pro, SigLIP under ComputeUnit.ALL: a 79/21 ANE/GPU split runs slower than either unit alone",
     "source": PLACEMENT, "why": "a plan prices one unit per arm; a graph split across units pays a hand-off the "
     "model has no figure for"},
    {"measurement": "M3 Max / M3 Ultra: oMLX's dual ANE+GPU prefill of Qwen3.8-27B, +13% at 16K, +57% at 32K",
     "source": "https://github.com/jundot/omlx/issues/2781", "why": "the ANE runs INT8 weights concurrently with the "
     "GPU (pipelined, gated-delta layers); the model's arms are sequential fp16 sidecars of full attention"},
    {"measurement": "M5 Pro: Qwen3-0.6B decode with in-graph KV mutation, ANE rejected (ANECCompile -14)",
     "source": MOBIUS, "why": "a compile refusal, not a ratio; anelab's gate (runtimes) answers it, not the planner"},
)  # fmt: skip


def _gpu_matmul(chip_name: str) -> Figure:
    """The chip's Core ML GPU matmul: measured, else by GPU cores from a measured sibling, else from the table."""
    if chip_name in GPU_MATMUL_TFLOPS:
        return GPU_MATMUL_TFLOPS[chip_name]
    generation = chip_name.split()[0]
    for sibling, f in GPU_MATMUL_TFLOPS.items():
        if sibling.split()[0] == generation and chip_name in GPU_CORES and sibling in GPU_CORES:
            value = f.value * GPU_CORES[chip_name].value / GPU_CORES[sibling].value
            note = f"extrapolated: the {sibling}'s measured {f.value} TF/s x GPU cores {GPU_CORES[chip_name].value:g}/"
            return Figure(value, f.source, note + f"{GPU_CORES[sibling].value:g}", value / CARRY_BAND,
                          value * CARRY_BAND, "extrapolated")  # fmt: skip
    table = get_chip(chip_name).gpu_fp16_tflops
    scale = GPU_MATMUL_TFLOPS["M4 Pro"].value / get_chip("M4 Pro").gpu_fp16_tflops.value
    value = table.value * scale if table.known else None
    return Figure(value, table.source, f"extrapolated: the table's GPU figure x the M4 Pro's measured/table {scale:.2f}",
                  kind="extrapolated" if value else "unknown")  # fmt: skip


def _unit_seconds(flops: float, weight_bytes: float, rate: Figure, bandwidth: Figure, dispatch_s: float) -> float:
    compute = flops / (rate.value * 1e12)
    memory = weight_bytes / (bandwidth.value * 1e9) if bandwidth.known else 0.0
    return max(compute, memory) + dispatch_s


def predict(pair: PublicPair) -> dict:
    """The model's ratio for one pair (GPU s / ANE s) and its interval, from the chip's figures alone."""
    chip = get_chip(pair.chip)
    m = chip.measured()
    ane, gpu = m["ane_fp16_gemm_tflops"], _gpu_matmul(chip.name)
    missing = [n for n, f in (("ANE fp16 matmul", ane), ("GPU matmul", gpu)) if not f.known]
    if missing:
        return {"predicted_ratio": None, "low": None, "high": None, "why": f"unknown: {', '.join(missing)}"}
    dispatch = pair.dispatches * m["ane_dispatch_ms"].value * 1e-3
    ane_s = _unit_seconds(pair.flops, pair.weight_bytes, ane, chip.bandwidth_gbs, dispatch)
    gpu_s = _unit_seconds(pair.flops, pair.weight_bytes, gpu, chip.bandwidth_gbs, 0.0)
    band = ane.band * gpu.band * CARRY_BAND * CARRY_BAND
    ratio = gpu_s / ane_s
    figures = (f"ANE {ane.value:.3g} TF/s ({ane.kind}), GPU {gpu.value:.3g} TF/s ({gpu.kind}), bandwidth "
               + (f"{chip.bandwidth_gbs.value:g} GB/s" if chip.bandwidth_gbs.known else "unknown (left out)"))  # fmt: skip
    return {"predicted_ratio": ratio, "low": ratio / band, "high": ratio * band, "why": figures}


def _seed_rows(data_dir=None) -> list[dict]:
    """The seed's M3 rows: the plan's ratio against the recorded one, inside the verdict's ratio interval or not."""

    rows = []
    for r in predicted_vs_recorded(data_dir):
        v = verdict_for(plan_arm_costs(plan(r["prompt_tokens"], family=r["family"], chunk=r["chunk"], chip=SEED_CHIP,
                                            data_dir=data_dir), data_dir=data_dir))  # fmt: skip
        low, high = (
            v.gpu_prefill["low"] / v.ane_prefill["high"],
            v.gpu_prefill["high"] / max(v.ane_prefill["low"], 1e-12),
        )
        rows.append({"name": f"{r['family']} at {r['prompt_tokens']:,} tokens, chunk {r['chunk']:,} ({r['record']})",
                     "chip": SEED_CHIP, "published_ratio": r["recorded_ratio"], "predicted_ratio": r["plan_ratio"],
                     "low": low, "high": high, "inside": low <= r["recorded_ratio"] <= high,
                     "why": "the seed's record (the fit's own data: in-sample)", "source": "data/ (seed 000)"})  # fmt: skip
    return rows


def seed_calibration(data_dir=None) -> dict:
    """What limits the sidecar graph on the seed's M3 (``ane_chips.calibration``) at the one recorded ANE prediction:
    Qwen 3.8's h0 layer-chunk (its heads x 4,096 x 4,096 at head_dim 256), from the fitted rate per score entry."""

    g = get_family("qwen3.8-125b-a6b-4bit").geometry
    recorded = fit_costs(data_dir).ane_seconds_per_entry * g.num_heads * REFERENCE_CHUNK * REFERENCE_CHUNK
    return calibration(recorded, g, REFERENCE_CHUNK)


def validate_chips(pairs: tuple[PublicPair, ...] = PUBLIC_PAIRS, *, seed_rows: bool = True, data_dir=None) -> dict:
    """Every public pair predicted and compared (``inside`` its interval or not), the seed's M3 rows, and the
    measurements the model cannot express."""
    rows = []
    for pair in pairs:
        p = predict(pair)
        inside = p["predicted_ratio"] is not None and p["low"] <= pair.published_ratio <= p["high"]
        rows.append({**{k: v for k, v in asdict(pair).items() if k in ("name", "chip", "published_ratio", "source")},
                     **p, "inside": inside})  # fmt: skip
    if seed_rows:
        rows += _seed_rows(data_dir)
    return {"rows": rows, "cannot_express": list(CANNOT_EXPRESS), "calibration": seed_calibration(data_dir)}


def format_validation(v: dict) -> str:
    """The validation table as text: predicted vs published ratio (GPU s / ANE s), interval, inside or not."""
    c = v["calibration"]
    out = [f"calibration on the seed's {SEED_CHIP} (Qwen 3.8 h0, one layer-chunk): recorded {c['recorded']:.3g} s; "
           f"roofline compute {c['compute']:.3g} s{' past the cliff' if c['past_cliff'] else ''}, score-arena traffic "
           f"{c['traffic']:.3g} s, dispatch {c['dispatch'] * 1e3:.2g} ms -> {c['bound']}-bound, recorded / roofline "
           f"{c['recorded_over_roofline']:.2f} (kept by every chip's carry)",
           f"{'chip':7s} {'published':>9s} {'predicted':>9s} {'interval':>15s} inside  measurement — figures — source"]  # fmt: skip
    for r in v["rows"]:
        pred = "-" if r["predicted_ratio"] is None else f"{r['predicted_ratio']:.3g}"
        interval = "-" if r["low"] is None else f"{r['low']:.3g} .. {r['high']:.3g}"
        out.append(f"{r['chip']:7s} {r['published_ratio']:9.3g} {pred:>9s} {interval:>15s} "
                   f"{'yes' if r['inside'] else 'NO':6s}  {r['name']} — {r['why']} — {r['source']}")  # fmt: skip
    inside = sum(r["inside"] for r in v["rows"])
    out.append(
        f"{inside} of {len(v['rows'])} inside their interval (ratio = GPU seconds / ANE seconds; > 1: ANE faster)"
    )
    out.append("cannot express:")
    out += [f"  {c['measurement']}: {c['why']} ({c['source']})" for c in v["cannot_express"]]
    return "\n".join(out)
