"""``anelab measure``'s Core AI step: the layer Core ML's loads were timed on, as ``.aimodel`` assets, timed.

Beside Core ML's loads of the same layer (same checkpoint, layer, chunk and histories; the records carry
the Core ML package's hash, ``coreml_package_sha256``), on macOS 27 (``runtimes.coreai.coreai_timing``):
specialization cold (cache cleared) and warm (cache hit), the cached entry from a fresh process, cold
specialization against the number of entrypoints (``ENTRYPOINT_COUNTS``: assets of histories 0, C, ...),
the ahead-of-time compiled asset's cold and warm loads, and one predict per entrypoint on the Neural
Engine. Off macOS 27 the step is not run and ``unavailable_reason`` says why in one line.
"""

from __future__ import annotations

from pathlib import Path

from anelab.checkpoints.checkpoint import Checkpoint
from anelab.runtimes.coreai import coreai_timing
from anelab.runtimes.interface import CoreAIRuntime
from anelab.sidecar.backends import COREML
from anelab.sidecar.coreai.asset import write_asset
from anelab.sidecar.export import export_sidecars

STEP = ("coreai", "Core AI (macOS 27): the layer as .aimodel — specialization cold / warm / fresh process / per "
        "entrypoint count (1, 3, 9, 30), the AOT-compiled asset's load, predict per entrypoint on the Neural Engine")  # fmt: skip


def export_assets(
    checkpoint: Checkpoint, layer: int, chunk: int, histories: list[int], build: Path
) -> tuple[Path, dict]:
    """(the layer's asset with ``histories``, {entrypoints: asset with histories 0, C, ... of that count}): one
    Core ML package of every history needed, each asset lowered from the functions it holds."""

    needed = sorted({*histories, *(i * chunk for i in range(max(coreai_timing.ENTRYPOINT_COUNTS)))})
    root = Path(build) / "coreai"
    [source] = export_sidecars(checkpoint, root / "source", chunk, needed, [layer], backend=COREML, jobs=1)

    def lowered(hs: list[int], name: str) -> Path:
        return write_asset(source.package, root / name / f"layer_{layer}.aimodel", source.metadata, list(hs))[0]

    counts = {n: lowered([i * chunk for i in range(n)], f"entrypoints{n}") for n in coreai_timing.ENTRYPOINT_COUNTS}
    return lowered(histories, "layer"), counts


def coreai_records(
    runtime: CoreAIRuntime, checkpoint: Checkpoint, layer: int, chunk: int, histories: list[int], build: Path, *,
    repeats: int, clock, coreml_key: str,
) -> list[dict]:  # fmt: skip
    """Every Core AI timing of the step (module docstring), each tagged with the layer and the Core ML package."""
    asset, counts = export_assets(checkpoint, layer, chunk, histories, build)
    extra = {"checkpoint": checkpoint.path.name, "layer": layer, "chunk": chunk, "histories": list(histories),
             "coreml_package_sha256": coreml_key}  # fmt: skip
    work = Path(build) / "coreai" / "work"
    t = coreai_timing
    records = [
        t.time_specialization(runtime, asset, cold=True, repeats=repeats, work=work / "cold", clock=clock, extra=extra),
        t.time_specialization(
            runtime, asset, cold=False, repeats=repeats, work=work / "warm", clock=clock, extra=extra
        ),
        t.time_fresh_process(runtime, asset, repeats=repeats, clock=clock, extra=extra),
    ]
    records += t.time_entrypoint_counts(
        runtime, counts, repeats=repeats, work=work / "counts", clock=clock, extra=extra
    )
    records += t.time_compiled(runtime, asset, repeats=repeats, work=work / "aot", clock=clock, extra=extra)
    records += t.time_predictions(runtime, asset, repeats=repeats, clock=clock, extra=extra)
    return t.flag_uncleared(records)
