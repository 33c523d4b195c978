"""Measured figures of each Apple chip's Neural Engine and GPU, each with the public page it was read from.

A ``Figure`` is a value with its source and its kind: ``published`` (read from the page), ``derived`` (arithmetic
on published values of the same chip, the note says which), ``extrapolated`` (carried from another chip or from
Apple's wording, the note says how; its interval is wider), ``unsourced`` (a commonly cited value) or ``unknown``
(no value: the planner names it and widens or refuses the arm that needs it).

What is measured (public, Dec 2026):

- ANE fp16 GEMM, peak (TF/s): ANEForge's cross-chip roofline table (``ANEFORGE``): M1 2.7-4.3 (two M1
  submissions), M1 Max 4.6, M2 Pro 3.4, M4 5.4, M5 8.7, M5 Pro 10.0. The M3 is not measured: Apple's wording
  ("the Neural Engine is up to 60 percent faster than in the M1 family", ``M3_NEURAL_ENGINE``) times the M1
  family's measured range gives it, extrapolated.
- ANE working-set cliff: M4's matmul falls from 5.7 to 4.0 TF/s once the working set passes ~32 MB of on-chip
  SRAM (``MADERIX``, 2048 -> 4096 square matmul). No other chip's cliff is published: M4's is assumed.
- ANE dispatch floor: ~0.095 ms per dispatch on the M4 (``MADERIX``, XPC + IOKit), 0.23 ms on the M1 (``ANEFORGE``).
- Core ML GPU matmul (TF/s): 6.4 on the M4 Pro, 39.2 on the M5 Max (M5's per-core GPU matrix units), and the
  GPU core counts 20 / 40 (``PLACEMENT``); M5 Pro 20 GPU cores (``ANEFORGE``'s machine table).
- Power under load (W): M5 Max ANE 4.8, GPU 39.4, CPU 4.0 driving Core ML (``PLACEMENT``, powermetrics, SigLIP);
  M1 ANE 4.4, GPU 32.5 on a 4096 square matmul (``ANE_GUIDE_POWER``).
- Memory bandwidth: M5 Max 614 GB/s bus peak (``PLACEMENT``).

The placement pair (SigLIP on the ANE at 1.14x the GPU's speed on the M4 Pro, 0.21x on the M5 Max) and the M5 Pro
prefill pair (``MOBIUS``) are *not* here: they are validation rows (``planner.chip_validation``), never inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PUBLISHED, DERIVED, EXTRAPOLATED_FIGURE, UNSOURCED, UNKNOWN = (
    "published",
    "derived",
    "extrapolated",
    "unsourced",
    "unknown",
)
UNSOURCED_NOTE = "unsourced: commonly cited, not found on a public page by this project"

ANEFORGE = "https://github.com/sbryngelson/ANEForge/blob/main/bench/results/ROOFLINES.md"
MADERIX = "https://maderix.substack.com/p/inside-the-m4-apple-neural-engine-615"
PLACEMENT = "https://github.com/erwinzhang7/coreml-compute-placement (README)"
ANE_GUIDE_POWER = "https://ane-guide.readthedocs.io/en/latest/part-3-performance/10-power-efficiency.html"
M3_NEURAL_ENGINE = "https://en.ocworkbench.com/apple-announces-m3-m3-pro-and-m3-max/"
MOBIUS = "https://github.com/FluidInference/mobius/pull/77"
COREAI_FLOOR = "https://developer.apple.com/forums/thread/857290"


@dataclass(frozen=True)
class Figure:
    """A chip's figure: ``value`` (None: unknown), its ``source`` (a public page; None: unsourced), ``kind``, a
    ``note`` saying how it was read, and an interval ``low`` .. ``high`` where the source gives a range."""

    value: float | None
    source: str | None
    note: str = ""
    low: float | None = None
    high: float | None = None
    kind: str = ""

    def __post_init__(self):
        if not self.kind:
            kind = UNKNOWN if self.value is None else (PUBLISHED if self.source else UNSOURCED)
            object.__setattr__(self, "kind", kind)

    @property
    def known(self) -> bool:
        return self.value is not None

    @property
    def band(self) -> float:
        """x/÷ half the figure's range (1.0 for a single value)."""
        if self.low and self.high and self.high > self.low:
            return math.sqrt(self.high / self.low)
        return 1.0

    def to_dict(self) -> dict:
        note = self.note or ("" if self.source else UNSOURCED_NOTE)
        return {"value": self.value, "source": self.source, "note": note, "low": self.low, "high": self.high,
                "kind": self.kind}  # fmt: skip


def unknown(note: str) -> Figure:
    return Figure(None, None, note, kind=UNKNOWN)


def _range(low: float, high: float, source: str, note: str, kind: str = PUBLISHED) -> Figure:
    return Figure(math.sqrt(low * high), source, note, low, high, kind)


# ---- the Neural Engine ----------------------------------------------------------------------------------------
_M1_FAMILY = (2.7, 4.6)  # ANEForge: M1 (MacBookPro17,1) 2.7 .. M1 Max 4.6 TF/s; same 16-core engine
_M3_SPEEDUP = 1.6  # Apple: "up to 60 percent faster than in the M1 family"

ANE_GEMM_TFLOPS: dict[str, Figure] = {
    "M1": _range(2.7, 4.3, ANEFORGE, "peak fp16 GEMM over the table's M1 submissions"),
    "M1 Max": Figure(4.6, ANEFORGE, "peak fp16 GEMM (MacBookPro18,2)"),
    "M2 Pro": Figure(3.4, ANEFORGE, "peak fp16 GEMM (Mac14,12)"),
    "M3": _range(_M3_SPEEDUP * _M1_FAMILY[0], _M3_SPEEDUP * _M1_FAMILY[1], M3_NEURAL_ENGINE,
                 f"not measured: Apple's 'up to 60 percent faster than the M1 family' x the M1 family's measured "
                 f"{_M1_FAMILY[0]}-{_M1_FAMILY[1]} TF/s ({ANEFORGE})", EXTRAPOLATED_FIGURE),
    "M4": Figure(5.4, ANEFORGE, "peak fp16 GEMM (Mac16,12); 5.7 TF/s at a 2048 square matmul in " + MADERIX),
    "M5": Figure(8.7, ANEFORGE, "peak fp16 GEMM (Mac17,3)"),
    "M5 Pro": Figure(10.0, ANEFORGE, "peak fp16 GEMM (Mac17,8)"),
}  # fmt: skip

# x/÷ how far two published measurements of one chip's GEMM sit apart (the M1's two submissions): the band a
# figure carries to another chip, or from a benchmark's shapes to the sidecar's
CARRY_BAND = ANE_GEMM_TFLOPS["M1"].band

# a chip without its own measurement takes its generation's measured sibling (same 16-core engine), extrapolated
ANE_SIBLING = {
    "M1 Pro": "M1", "M2": "M2 Pro", "M2 Max": "M2 Pro", "M3 Pro": "M3", "M3 Max": "M3", "M4 Pro": "M4",
    "M4 Max": "M4", "M5 Max": "M5 Pro",
}  # fmt: skip
ULTRA_NOTE = "two Neural Engines on two dies; whether one sidecar uses both is not measured"

ANE_CLIFF_MB = Figure(32.0, MADERIX, "M4: the matmul working set past ~32 MB of on-chip SRAM spills to DRAM")
ANE_CLIFF_FACTOR = Figure(4.0 / 5.7, MADERIX, "M4: 5.7 TF/s at 2048 (24 MB working set) -> 4.0 at 4096 (96 MB)")
CLIFF_CHIP = "M4"  # the one chip whose cliff is measured

ANE_DISPATCH_MS: dict[str, Figure] = {
    "M1": Figure(0.23, ANEFORGE, "the floor under any single ANE dispatch (ANEForge's roofline)"),
    "M4": Figure(0.095, MADERIX, "XPC + IOKit overhead of one dispatch (256x256 matmul: 0.101 ms)"),
}
DISPATCH_RANGE_MS = (0.095, 0.23)  # the published floors (M4, M1): a chip without its own takes this range

# ---- the GPU --------------------------------------------------------------------------------------------------
GPU_MATMUL_TFLOPS: dict[str, Figure] = {
    "M4 Pro": Figure(6.4, PLACEMENT, "Core ML GPU matmul, 103.1 GFLOP per call (20 GPU cores)"),
    "M5 Max": Figure(39.2, PLACEMENT, "Core ML GPU matmul, 103.1 GFLOP per call (40 GPU cores; M5's matrix units)"),
}
GPU_CORES: dict[str, Figure] = {
    "M4 Pro": Figure(20, PLACEMENT, "Mac16,11"),
    "M5 Max": Figure(40, PLACEMENT, "Mac17,7"),
    "M5 Pro": Figure(20, ANEFORGE, "Mac17,8 (machine table)"),
}

# ---- power under load (W) -------------------------------------------------------------------------------------
ANE_WATTS: dict[str, Figure] = {
    "M5 Max": Figure(4.8, PLACEMENT, "powermetrics, SigLIP batch 16 on CPU_AND_NE"),
    "M1": Figure(4.4, ANE_GUIDE_POWER, "4096 square matmul, idle-subtracted package power"),
}
GPU_WATTS: dict[str, Figure] = {
    "M5 Max": Figure(39.4, PLACEMENT, "powermetrics, SigLIP batch 16 on CPU_AND_GPU"),
    "M1": Figure(32.5, ANE_GUIDE_POWER, "4096 square matmul, idle-subtracted package power"),
}
CPU_WATTS_DRIVING = Figure(4.0, PLACEMENT, "M5 Max CPU while driving Core ML on the ANE (powermetrics)")

CORE_AI_MODEL_FLOOR_S = Figure(10.0, COREAI_FLOOR, "macOS 27: ~10 s per Neural Engine model (the compiler "
                               "service's respawn is throttled; 16 models ~2.5 min)")  # fmt: skip


def published_range(table: dict[str, Figure], what: str) -> Figure:
    """A chip without its own figure: the range of the published ones (geometric middle), extrapolated."""
    values = [f.value for f in table.values() if f.value is not None]
    chips = ", ".join(table)
    return _range(min(values), max(values), ", ".join(sorted({f.source for f in table.values() if f.source})),
                  f"not published for this chip: the range of {what} published for {chips}", EXTRAPOLATED_FIGURE)  # fmt: skip


def ane_gemm(chip: str) -> Figure:
    """The chip's ANE fp16 GEMM figure: its own, its generation's measured sibling (extrapolated), or unknown."""
    if chip in ANE_GEMM_TFLOPS:
        return ANE_GEMM_TFLOPS[chip]
    sibling = ANE_SIBLING.get(chip)
    if sibling is None:
        return unknown(ULTRA_NOTE if chip.endswith("Ultra") else "no ANE fp16 matmul measurement found")
    f = ANE_GEMM_TFLOPS[sibling]
    low, high = (f.low or f.value) / CARRY_BAND, (f.high or f.value) * CARRY_BAND
    return Figure(f.value, f.source, f"not measured: the {sibling}'s figure (same 16-core engine)", low, high,
                  EXTRAPOLATED_FIGURE)  # fmt: skip


def ane_dispatch_ms(chip: str) -> Figure:
    if chip in ANE_DISPATCH_MS:
        return ANE_DISPATCH_MS[chip]
    return published_range(ANE_DISPATCH_MS, "ANE dispatch floors")


def ane_cliff(chip: str) -> tuple[Figure, Figure]:
    """(working-set MB, throughput factor past it): measured on the M4, assumed (extrapolated) elsewhere."""
    if chip == CLIFF_CHIP:
        return ANE_CLIFF_MB, ANE_CLIFF_FACTOR
    note = f"not measured: the {CLIFF_CHIP}'s cliff assumed"
    f = ANE_CLIFF_FACTOR
    return (Figure(ANE_CLIFF_MB.value, MADERIX, note, kind=EXTRAPOLATED_FIGURE),
            Figure(f.value, MADERIX, note, f.value, 1.0, EXTRAPOLATED_FIGURE))  # fmt: skip


def power(chip: str, table: dict[str, Figure], what: str) -> Figure:
    return table.get(chip) or published_range(table, what)
