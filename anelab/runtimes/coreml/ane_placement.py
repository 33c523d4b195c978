"""Whether a sidecar's predictions on this Mac are Neural Engine work at all: the Mac has a Neural Engine, and
Core ML's compute plan puts the package's operations on it under the compute units asked — checked before any
time is priced as ANE attention (a plan that leaves every operation on the CPU or GPU would make a "cpu_and_ne"
timing a fallback's)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from anelab.core.errors import AnelabInputError
from anelab.runtimes.interface import NEURAL_ENGINE_UNITS, CoreMLRuntime


@dataclass(frozen=True)
class AnePlacement:
    """Operations of one package's (default) function per preferred device under ``compute_units``."""

    package: str
    compute_units: str
    neural_engine: int
    gpu: int
    cpu: int
    total: int
    compute_ops: int = 0  # matmuls, linears, softmaxes (interface.COMPUTE_OPERATORS): the block's arithmetic
    compute_ops_on_neural_engine: int = 0

    @property
    def neural_engine_share(self) -> float:
        return self.neural_engine / self.total if self.total else 0.0

    @property
    def compute_share(self) -> float | None:
        """The share of the compute operations the plan puts on the Neural Engine (None: the plan named none)."""
        return self.compute_ops_on_neural_engine / self.compute_ops if self.compute_ops else None

    def to_dict(self) -> dict:
        return {**asdict(self), "neural_engine_share": self.neural_engine_share, "compute_share": self.compute_share}


# Priced as ANE attention only when at least this share of the block's compute operations (matmuls, linears,
# softmax) prefers the Neural Engine: an operation count weighs a reshape like a matmul (the seed's healthy
# sidecars have 64-74 of 173 operations there, 37-43 %), so the share that decides is the compute operations'.
MIN_COMPUTE_SHARE = 0.5


def require_neural_engine(runtime: CoreMLRuntime, doing: str) -> None:
    """Refuse ``doing`` (one line) on a machine without a Neural Engine (or without Core ML)."""
    reason = runtime.neural_engine_reason()
    if reason:
        raise AnelabInputError(f"{reason}; refusing to {doing}: nothing here would be Neural Engine time")


def require_ane_placement(
    runtime: CoreMLRuntime, pkg: str | os.PathLike, compute_units: str = "cpu_and_ne"
) -> AnePlacement:
    """This Mac's compute plan of ``pkg`` under ``compute_units``; refused (one line) when the Mac has no Neural
    Engine, the plan cannot be read, or it puts none of the package's operations on the Neural Engine."""
    pkg = Path(pkg)
    if compute_units not in NEURAL_ENGINE_UNITS:
        raise AnelabInputError(f"compute units {compute_units} do not ask for the Neural Engine; use cpu_and_ne or all")
    require_neural_engine(runtime, f"price {pkg.name} as ANE attention")
    try:
        counts = runtime.compute_plan_assignment(pkg, compute_units)
    except (RuntimeError, ValueError, OSError) as e:
        raise AnelabInputError(
            f"{pkg}: Core ML's compute plan could not be read ({' '.join(str(e).split())}); where its operations run "
            "is unknown, so its timings are not priced as ANE attention"
        ) from None
    placement = AnePlacement(
        str(pkg), compute_units, counts["neural_engine"], counts["gpu"], counts["cpu"], counts["total"],
        int(counts.get("compute_ops", 0)), int(counts.get("compute_ops_on_neural_engine", 0)),
    )  # fmt: skip
    if placement.neural_engine == 0:
        raise AnelabInputError(
            f"{pkg}: Core ML's compute plan under {compute_units} puts none of its {placement.total} operations on the "
            f"Neural Engine (cpu {placement.cpu}, gpu {placement.gpu}): its predictions would be a CPU/GPU fallback, "
            "refused as ANE attention; re-export it so the ANE gate runs on this Mac"
        )
    if placement.compute_share is not None and placement.compute_share < MIN_COMPUTE_SHARE:
        raise AnelabInputError(
            f"{pkg}: Core ML's compute plan under {compute_units} puts {placement.compute_ops_on_neural_engine} of its "
            f"{placement.compute_ops} compute operations (matmuls, softmax) on the Neural Engine, below "
            f"{MIN_COMPUTE_SHARE:.0%}: its predictions would be mostly CPU/GPU work, refused as ANE attention"
        )
    return placement
