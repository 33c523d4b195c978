"""``anelab measure``'s ``split_ab`` step: on a Mac, each offload split the plan proposes for the real model(s) timed
against mlx-lm's GPU prefill (``anelab ab --split planned``), one ``whole_model_ab`` record per split and prompt.

Per model (default ``default-real``): the plan's splits on this Mac's chip (``arms.ab_splits``: the best and the
runner-up at each prompt length), the packages their parts need exported with the ANE gate (attention with the
histories the prompts visit, ``--graph mlp``, ``--graph gdn-proj``; a package verified here before is reused), then
the A/B of each split. A GGUF checkpoint runs on mlx-lm from its fp16 copy (``runtimes.mlx.from_gguf``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from anelab.arms.ab_splits import planned_splits
from anelab.arms.prefill_ab import ab_request, run_ab
from anelab.checkpoints.checkpoint import Checkpoint, load_checkpoint
from anelab.checkpoints.default import resolve_checkpoint
from anelab.core.geometry import chunk_starts
from anelab.core.records import read_records
from anelab.planner.chips import chip_from_brand
from anelab.planner.offload_split import ATTENTION, PROJECTIONS
from anelab.planner.offload_split import MLP as MLP_PART  # the part; MLP is the design
from anelab.runtimes.coreml.gate import AneGate
from anelab.runtimes.mlx.from_gguf import mlx_readable_path
from anelab.sidecar.designs import GDN_PROJ, MLP
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.format import read_sidecar_metadata

STEP = ("split_ab", "each offload split the plan proposes for the real model(s), timed against mlx-lm's GPU prefill "
        "(anelab ab --split planned)")  # fmt: skip
PART_GRAPHS = {ATTENTION: None, MLP_PART: MLP, PROJECTIONS: GDN_PROJ}  # None: the default attention design


def models_key(models, prompt_tokens, chunk: int) -> str:
    """What the step's records are keyed by (``parameters.measure.package_sha256``): each model's file or directory
    (name, size, modification time), the prompt lengths and the chunk."""
    said = []
    for model in models:
        path = resolve_checkpoint(model)
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        said.append([str(model), [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]])
    return hashlib.sha256(json.dumps([said, list(prompt_tokens), chunk]).encode()).hexdigest()


def _gated_export(
    runtime, checkpoint: Checkpoint, out: Path, chunk: int, graph: str | None, histories, again: bool
) -> Path:
    """``out`` holding the part's packages exported with the ANE gate (kept when every one is verified here)."""
    packages = sorted(out.glob("layer_*.mlpackage"))
    if packages and not again and all(read_sidecar_metadata(p).ane_verified for p in packages):
        return out
    options = {"graph": graph} if graph else {}
    export_sidecars(checkpoint, out, chunk, histories if graph is None else None, gate=AneGate(runtime), **options)
    return out


def split_records(runtime, models, prompt_tokens, chunk: int, build: Path, staging: Path, *, repeats: int,
                  clock: Callable[[], float], again: bool = False) -> list[dict]:  # fmt: skip
    """Every planned split of every model in ``models`` timed on ``runtime`` (module docstring) -> its records."""
    chip = chip_from_brand(runtime.versions().get("chip"))  # None: resolve_chip reads this Mac's, else the seed's
    for model in models:
        path = resolve_checkpoint(model)
        checkpoint = load_checkpoint(path)  # opened once: every part's export reads it
        splits = planned_splits(path, prompt_tokens, ["planned"], chip)
        parts = {part for split in splits for part in split.parts}
        histories = chunk_starts(max(prompt_tokens), chunk)
        where = Path(build) / "splits" / Path(str(model)).name
        directories = {part: _gated_export(runtime, checkpoint, where / part, chunk, PART_GRAPHS[part], histories, again)
                       for part in sorted(parts)}  # fmt: skip
        request = ab_request(
            path, directories.get(ATTENTION), prompt_tokens, mlp_sidecars=directories.get(MLP_PART),
            gdn_sidecars=directories.get(PROJECTIONS), splits=("planned",), chip=chip, runtime=runtime,
            clock=clock, out_dir=staging, repeats=repeats, mlx_checkpoint=mlx_readable_path(checkpoint),
        )  # fmt: skip
        run_ab(request)
    return read_records(staging, "whole_model_ab")
