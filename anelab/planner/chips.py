"""Apple chips, their sourced figures, and the fastest each arm of a plan could run on one.

``CHIPS``: GPU FP16 throughput (TFLOPS), Neural Engine throughput (trillion operations per second) and
memory bandwidth (GB/s), each a ``Figure`` with the public page it was read from — or ``source=None``
and a note saying it is unsourced (a commonly cited figure, or one derived from Apple's wording) — and the
measured ANE / GPU figures of ``planner.chip_figures`` (``chip_row``). The M5 family's GPU figures are
extrapolated from Core ML's measured GPU matmul (see ``_M5_GPU``). ``SEED_CHIP`` is the M3 of every record.
Apple quotes GPU throughput in FP32 TFLOPS when it quotes it at all; the GPU's FP16 rate is taken as
its FP32 rate (assumed). Neural Engine TOPS are Apple's headline figure, taken as the FP16 rate for
attention (assumed; the precision behind the headline is not stated).

The bound of a prompt (``arm_bounds``): each arm at the chip's peak, the larger of compute time
(matmul FLOPs / peak) and memory time (weights read once / bandwidth) — no runtime can beat it:

- GPU arm: ``2 x active weights x tokens`` + attention ``4 x head_dim`` per GPU score entry;
- ANE arm: the GPU's non-attention as above, plus the ANE's attention over its padded score arena at
  the Neural Engine's peak (where the chip has no sourced TOPS figure the ANE bound is not given).
"""

from __future__ import annotations

from dataclasses import dataclass

from anelab.core.errors import AnelabInputError
from anelab.core.records import machine_description
from anelab.planner.catalogue import PlanGeometry, ane_score_entries, gpu_score_entries
from anelab.planner.chip_figures import (
    ANE_WATTS,
    EXTRAPOLATED_FIGURE,
    GPU_CORES,
    GPU_MATMUL_TFLOPS,
    GPU_WATTS,
    PLACEMENT,
    UNSOURCED_NOTE,
    Figure,
    ane_cliff,
    ane_dispatch_ms,
    ane_gemm,
    power,
)

SEED_CHIP = "M3"  # the chip of every seed record (TinyTitan's M3, 24 GB)
UNSOURCED = UNSOURCED_NOTE


@dataclass(frozen=True)
class Chip:
    name: str
    gpu_fp16_tflops: Figure
    ane_tops: Figure
    bandwidth_gbs: Figure

    def measured(self) -> dict[str, Figure]:
        """The chip's measured ANE / GPU figures (``planner.chip_figures``), each with its kind and source."""
        cliff_mb, cliff_factor = ane_cliff(self.name)
        return {
            "ane_fp16_gemm_tflops": ane_gemm(self.name),
            "ane_cliff_mb": cliff_mb,
            "ane_cliff_factor": cliff_factor,
            "ane_dispatch_ms": ane_dispatch_ms(self.name),
            "gpu_matmul_tflops": GPU_MATMUL_TFLOPS.get(self.name) or Figure(None, None, "not measured", kind="unknown"),
            "ane_watts": power(self.name, ANE_WATTS, "ANE power under load"),
            "gpu_watts": power(self.name, GPU_WATTS, "GPU power under load"),
        }

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "gpu_fp16_tflops": self.gpu_fp16_tflops.to_dict(),
            "ane_tops": self.ane_tops.to_dict(),
            "bandwidth_gbs": self.bandwidth_gbs.to_dict(),
            **{k: f.to_dict() for k, f in self.measured().items()},
        }


def _u(value: float | None, note: str = "") -> Figure:
    return Figure(value, None, note)


_M1PM = "https://www.apple.com/gw/newsroom/2021/10/introducing-m1-pro-and-m1-max-the-most-powerful-chips-apple-has-ever-built"
_M1U = "https://www.notebookcheck.net/Apple-M1-Ultra-revealed-with-UltraFusion-architecture-a-20-core-CPU-and-up-to-a-64-core-GPU.607117.0.html"
_M1U_GPU = "https://www.cpu-monkey.com/en/cpu-apple_m1_ultra_64_gpu"
_M2 = "https://www.macrumors.com/2022/06/06/apple-announces-m2-chip-with-support-for-up-to-24gb-memory/"
_M2_NE = "https://fudzilla.net/news/mobile/54963-apple-officially-unveils-the-m2-soc"
_M3 = "https://abachy.com/news/apples-m3-series-chips-enhanced-performance-and-advanced-gpus"
_M3P = "https://goodnewsapodcast.com/apples-m4-m4-pro-and-m4-max-compared-to-past-generations-and-to-each-other"
_M3M = "https://macmegasite.com/2024/10/30/m4-max-chip-has-16-core-cpu-40-core-gpu-and-35-increase-in-memory-bandwidth"
_M4 = "https://www.engadget.com/apples-m4-chip-arrives-with-a-big-focus-on-ai-142448428.html"
_M4PM = "https://techmoran.com/2024/10/31/apple-unveils-its-most-powerful-chips-the-m4-pro-and-m4-max/"
_M4PM_NE = "https://thedailyscout.com/s/QaFxvjmT9mU"
_M5 = "https://www.fonearena.com/blog/466700/apple-m5-specs-features.html"
_NOT_ANNOUNCED = "not announced in the sources searched (Dec 2026 corpus)"


def _m5_gpu() -> dict[str, Figure]:
    """The M5 family's GPU figure on the table's scale (FP32 headline taken as FP16, what mlx-lm's fit divides
    by): Core ML's measured GPU matmul times the M4 Pro's headline / measured (8.7 / 6.4), then by GPU cores;
    the M5 from Apple's 'over 4x peak GPU compute for AI' than the M4. All extrapolated."""
    m4p, m5max = GPU_MATMUL_TFLOPS["M4 Pro"], GPU_MATMUL_TFLOPS["M5 Max"]
    per_measured = 8.7 / m4p.value  # the M4 Pro's table figure (unsourced) over its measured matmul
    top = m5max.value * per_measured
    note = (
        f"extrapolated: Core ML GPU matmul {m5max.value} TF/s measured on the M5 Max ({m5max.source}) x the "
        f"M4 Pro's table / measured ratio {per_measured:.2f}"
    )
    pro = top * GPU_CORES["M5 Pro"].value / GPU_CORES["M5 Max"].value
    return {
        "M5 Max": Figure(top, m5max.source, note, top / per_measured, top, EXTRAPOLATED_FIGURE),
        "M5 Pro": Figure(pro, m5max.source, note + f"; x {GPU_CORES['M5 Pro'].value:.0f} / "
                         f"{GPU_CORES['M5 Max'].value:.0f} GPU cores ({GPU_CORES['M5 Pro'].source})",
                         pro / per_measured, pro, EXTRAPOLATED_FIGURE),
        "M5": Figure(4 * 4.3, _M5, "extrapolated: Apple's 'over 4x peak GPU compute for AI' x the M4's 4.3 "
                     "(unsourced)", 4 * 4.3, 4 * 4.3 * per_measured, EXTRAPOLATED_FIGURE),
    }  # fmt: skip


_M5_GPU = _m5_gpu()

CHIPS: dict[str, Chip] = {
    c.name: c
    for c in (
        Chip("M1", _u(2.6), _u(11.0), _u(66.7, "derived: M1 Max's 400 GB/s is 'nearly 6x that of M1' (" + _M1PM + ")")),
        Chip("M1 Pro", _u(5.2), _u(11.0), Figure(200.0, _M1PM)),
        Chip("M1 Max", _u(10.4), _u(11.0), Figure(400.0, _M1PM)),
        Chip("M1 Ultra", Figure(21.2, _M1U_GPU, "FP32 (third-party spec page)"), Figure(22.0, _M1U), Figure(800.0, _M1U)),
        Chip("M2", _u(3.6), Figure(15.8, _M2_NE), Figure(100.0, _M2)),
        Chip("M2 Pro", _u(6.8), _u(15.8), Figure(204.8, _M3P)),
        Chip("M2 Max", _u(13.6), _u(15.8), _u(400.0)),
        Chip("M2 Ultra", _u(27.2), _u(31.6), _u(800.0)),
        Chip("M3", _u(3.6), _u(18.0), Figure(100.0, _M3)),
        Chip("M3 Pro", _u(6.4), _u(18.0), Figure(153.6, _M3P)),
        Chip("M3 Max", _u(16.4), _u(18.0), Figure(400.0, _M3M)),
        Chip("M3 Ultra", _u(32.8), _u(36.0), _u(819.0)),
        Chip("M4", _u(4.3), Figure(38.0, _M4), Figure(120.0, _M4)),
        Chip("M4 Pro", _u(8.7), Figure(38.0, _M4PM_NE), Figure(273.0, _M4PM)),
        Chip("M4 Max", _u(17.4), Figure(38.0, _M4PM_NE), Figure(546.0, _M4PM)),
        Chip("M5", _M5_GPU["M5"], _u(None, "Apple states a 'faster 16-core Neural Engine', no TOPS"), Figure(153.0, _M5)),
        Chip("M5 Pro", _M5_GPU["M5 Pro"], _u(None, _NOT_ANNOUNCED), _u(None, _NOT_ANNOUNCED)),
        Chip("M5 Max", _M5_GPU["M5 Max"], _u(None, _NOT_ANNOUNCED), Figure(614.0, PLACEMENT, "bus peak (Mac17,7)")),
        Chip("M5 Ultra", _u(None, _NOT_ANNOUNCED), _u(None, _NOT_ANNOUNCED), _u(None, _NOT_ANNOUNCED)),
    )
}  # fmt: skip


def get_chip(name: str) -> Chip:
    """The chip called ``name`` (case and spaces ignored: m3, "M3 Max", m3-max)."""
    key = {c.lower().replace(" ", "-"): c for c in CHIPS}
    found = key.get(str(name).strip().lower().replace(" ", "-"))
    if found is None:
        raise AnelabInputError(
            f"unknown --chip {name!r}; known: {', '.join(c.lower().replace(' ', '-') for c in CHIPS)}"
        )
    return CHIPS[found]


def chip_table() -> list[dict]:
    return [c.to_dict() for c in CHIPS.values()]


def arm_bounds(chip: Chip, *, prompt_tokens: int, active_weights: float, weight_bytes: float, gpu_entries: float,
               ane_entries: float, head_dim: int) -> dict:  # fmt: skip
    """The fastest each arm could run a prompt on ``chip`` (seconds; None where a figure is missing) and
    what bounds it. ``gpu_entries`` / ``ane_entries``: score entries of the offloaded layers on each device."""
    tflops, tops, bw = chip.gpu_fp16_tflops.value, chip.ane_tops.value, chip.bandwidth_gbs.value
    memory = weight_bytes / (bw * 1e9) if bw else None
    linear_flops = 2.0 * active_weights * prompt_tokens
    attention_flops = 4.0 * head_dim * gpu_entries
    if tflops is None:
        return {"chip": chip.name, "gpu_seconds": None, "ane_seconds": None, "bound": "no GPU figure for this chip"}
    gpu_compute = (linear_flops + attention_flops) / (tflops * 1e12)
    gpu = max(gpu_compute, memory or 0.0)
    ane = None
    if tops is not None:
        ane = max(linear_flops / (tflops * 1e12), memory or 0.0) + 4.0 * head_dim * ane_entries / (tops * 1e12)
    return {
        "chip": chip.name,
        "gpu_seconds": gpu,
        "ane_seconds": ane,
        "bound": "compute" if gpu_compute >= (memory or 0.0) else "bandwidth",
        "figures": chip.to_dict(),
    }


def plan_bounds(plan: dict, chip_name: str) -> dict:
    """``arm_bounds`` of a plan (``PrefillPlan.to_dict()``) on a chip, beside the plan's own two arms."""

    chip = get_chip(chip_name)
    g = plan["geometry"]
    geometry = PlanGeometry(**{**g, "full_attention_layers": tuple(g["full_attention_layers"])})
    n_fa = len(geometry.full_attention_layers)
    ane = [c for c in plan["chunks"] if c["device"] == "ane"]
    gpu_entries = n_fa * sum(gpu_score_entries(geometry, c["tokens"], c["history"]) for c in plan["chunks"])
    ane_entries = n_fa * sum(ane_score_entries(geometry, plan["chunk"], c["history"]) for c in ane)
    weights = plan.get("weights") or {"active": 0.0, "bytes": 0.0}
    out = arm_bounds(chip, prompt_tokens=plan["prompt_tokens"], active_weights=weights["active"],
                     weight_bytes=weights["bytes"], gpu_entries=gpu_entries, ane_entries=ane_entries,
                     head_dim=geometry.head_dim or 128)  # fmt: skip
    if not ane:
        out["ane_seconds"] = out["gpu_seconds"]  # the ANE does not run this prompt: both arms are the GPU's
    out["estimate_gpu_seconds"] = plan["gpu_prefill_seconds"]
    out["estimate_ane_seconds"] = plan["ane_prefill_seconds"]
    return out


def bound_sentence(b: dict) -> str:
    """One line: each arm's estimate against the chip's bound."""

    def arm(name, estimate, bound):
        if bound is None:
            return f"{name} {estimate:.4g} s (no bound: a figure is missing)"
        return f"{name} {estimate:.4g} s >= {bound:.3g} s ({estimate / bound:.0f}x the bound)" if bound > 0 else name

    return (
        f"bound on {b['chip']} (peak figures, {b.get('bound', '')}-bound): "
        + arm("GPU arm", b["estimate_gpu_seconds"], b["gpu_seconds"])
        + "; "
        + arm("ANE arm", b["estimate_ane_seconds"], b["ane_seconds"])
    )


# ---- which chip a plan is for ---------------------------------------------------------------------------------
def chip_from_brand(brand: str | None) -> str | None:
    """The table's chip of a ``sysctl machdep.cpu.brand_string`` ("Apple M4 Pro" -> "M4 Pro"); None if not one."""
    text = str(brand or "").strip().removeprefix("Apple ").strip()
    return next((c for c in CHIPS if c.lower() == text.lower()), None)


def this_machines_brand() -> str | None:
    """The CPU brand string of this machine on a Mac (``core.records.machine_description``), else None."""
    import platform

    return machine_description()["chip"] if platform.system() == "Darwin" else None


def resolve_chip(name: str | None, brand: str | None = None) -> tuple[Chip, str]:
    """(chip, how it was chosen): ``--chip`` when given; else this Mac's (``brand``, read by
    :func:`this_machines_brand` when None); off a Mac, or on a chip the table lacks, the seed's M3 — said so."""
    if name is not None:
        return get_chip(name), "--chip"
    brand = this_machines_brand() if brand is None else brand
    found = chip_from_brand(brand)
    if found is not None:
        return CHIPS[found], f"detected on this Mac ({brand})"
    why = f"'{brand}' is not in the chip table" if brand else "not a Mac"
    return CHIPS[SEED_CHIP], f"the seed's {SEED_CHIP} ({why}; pass --chip to price another)"


def carry_recorded_gpu(chip: Chip) -> tuple[float, float, str]:
    """(attention factor, non-attention factor, basis) carrying the seed's GPU path from the M3 to ``chip``: its
    attention by GPU throughput, its non-attention (weights streamed once per token) by memory bandwidth."""
    seed = CHIPS[SEED_CHIP]
    figures = (("GPU throughput", chip.gpu_fp16_tflops), ("memory bandwidth", chip.bandwidth_gbs))
    missing = [what for what, f in figures if not f.known]
    if missing:
        raise AnelabInputError(f"--chip {chip.name}: no {' or '.join(missing)} figure for {chip.name}; tinytitan "
                               "cannot be carried to it (use --gpu-runtime mlx-lm or another --chip)")  # fmt: skip
    gpu = seed.gpu_fp16_tflops.value / chip.gpu_fp16_tflops.value
    non = seed.bandwidth_gbs.value / chip.bandwidth_gbs.value
    basis = (
        f"attention x {gpu:.3g} (GPU {seed.gpu_fp16_tflops.value:g} -> {chip.gpu_fp16_tflops.value:.3g} TFLOPS), "
        f"non-attention x {non:.3g} (bandwidth {seed.bandwidth_gbs.value:g} -> {chip.bandwidth_gbs.value:g} GB/s)"
    )
    return gpu, non, basis
