"""Joules per prompt of each arm, from the chip's sourced power figures, and the verdict when energy is the objective.

Each arm's seconds split by who runs them (``planner.plan``'s terms), each at its unit's power under load
(``planner.chip_figures``; a chip without its own figure takes the published range, extrapolated)::

    GPU arm joules = GPU prefill seconds x GPU watts
    ANE arm joules = (its GPU seconds) x GPU watts + ANE attention x ANE watts + loads x CPU watts

The GPU is taken as idle (0 W) while the ANE runs and the loads are the CPU's (the compiler service): both
assumptions, said in the sources. Intervals: each seconds term at its interval's ends times each power at its
own; ``energy_decision`` is ``ane`` / ``gpu`` only when the joules' intervals do not overlap, else ``depends``.
"""

from __future__ import annotations

from anelab.core.errors import AnelabInputError
from anelab.planner.chip_figures import ANE_WATTS, CPU_WATTS_DRIVING, GPU_WATTS, Figure, power
from anelab.planner.chips import get_chip

OBJECTIVES = ("time", "energy")
DEFAULT_OBJECTIVE = "time"


def require_objective(name: str) -> str:

    if name not in OBJECTIVES:
        raise AnelabInputError(f"unknown --objective {name!r}; choose {' or '.join(OBJECTIVES)}")
    return name


def chip_power(chip: str) -> dict[str, Figure]:
    """The chip's GPU, ANE and CPU (driving loads) power under load, each a ``Figure`` with its source."""
    name = get_chip(chip).name
    return {"gpu": power(name, GPU_WATTS, "GPU power under load"), "ane": power(name, ANE_WATTS, "ANE power under load"),
            "cpu": CPU_WATTS_DRIVING}  # fmt: skip


def _ends(figure: Figure) -> tuple[float, float, float]:
    return (figure.low or figure.value, figure.value, figure.high or figure.value)


def arm_joules(gpu_seconds: tuple, ane_seconds: tuple, load_seconds: tuple, watts: dict[str, Figure]) -> dict:
    """Joules (low, value, high) of ``gpu_seconds`` on the GPU + ``ane_seconds`` on the ANE + ``load_seconds`` on the
    CPU; each seconds argument is (low, value, high)."""
    g, a, c = (_ends(watts[k]) for k in ("gpu", "ane", "cpu"))
    low, value, high = (gpu_seconds[i] * g[i] + ane_seconds[i] * a[i] + load_seconds[i] * c[i] for i in range(3))
    return {"value": value, "low": low, "high": high}


def power_sources(watts: dict[str, Figure]) -> dict:
    return {k: {"watts": f.value, "low": f.low, "high": f.high, "kind": f.kind, "source": f.source, "note": f.note}
            for k, f in watts.items()}  # fmt: skip


def plan_energy(chip: str, gpu_total: float, gpu_left: float, ane_attention: float, loads: float) -> dict:
    """Both arms' joules for a plan's central seconds (power intervals only): the GPU arm's ``gpu_total`` on the
    GPU; the ANE arm's ``gpu_left`` on the GPU, ``ane_attention`` on the ANE, ``loads`` on the CPU."""
    watts = chip_power(chip)
    point = lambda x: (x, x, x)  # noqa: E731
    return {
        "gpu_joules": arm_joules(point(gpu_total), point(0.0), point(0.0), watts),
        "ane_joules": arm_joules(point(gpu_left), point(ane_attention), point(loads), watts),
        "power": power_sources(watts),
        "assumes": "the GPU idle (0 W) while the ANE runs; loads at the CPU's power driving Core ML",
    }


def energy_decision(gpu_joules: dict, ane_joules: dict, runs_on_ane: bool = True) -> tuple[str, str]:
    """ane / gpu / depends on joules: decided only where the two arms' intervals do not overlap."""
    if not runs_on_ane:
        return "gpu", "the ANE does not run this prompt"
    if ane_joules["high"] < gpu_joules["low"]:
        return (
            "ane",
            f"the ANE arm takes at most {ane_joules['high']:.4g} J, the GPU arm at least {gpu_joules['low']:.4g} J",
        )
    if ane_joules["low"] > gpu_joules["high"]:
        return (
            "gpu",
            f"the ANE arm takes at least {ane_joules['low']:.4g} J, the GPU arm at most {gpu_joules['high']:.4g} J",
        )
    return "depends", (f"the arms' joules overlap: GPU {gpu_joules['low']:.4g} .. {gpu_joules['high']:.4g} J, ANE "
                       f"{ane_joules['low']:.4g} .. {ane_joules['high']:.4g} J")  # fmt: skip
