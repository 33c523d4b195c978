"""The sidecar set the arms serve from: every full-attention layer's saved package, checked against one
checkpoint and prompt, and the runner that evaluates a function (NumPy from disk, or Core ML on a Mac)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anelab.checkpoints.model import ModelCheckpoint
from anelab.core import reference
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import chunk_starts
from anelab.core.masks import causal
from anelab.sidecar.compare import (
    RELATIVE_ERROR_THRESHOLD,
    relative_error,
    require_same_geometry,
    require_same_tensors,
)
from anelab.sidecar.designs import design_of
from anelab.sidecar.format import function_name, read_sidecar_metadata

# (layer, chunk start, valid rows, inputs {hidden [C, D], mask [C, s + C], k_history / v_history [s, Hkv, d]})
#   -> outputs {attn_out [C, D], k_chunk [Hkv, C, d], v_chunk [Hkv, C, d]}
SidecarRunner = Callable[[int, int, int, dict], dict]


@dataclass
class SidecarSet:
    """Every full-attention layer's saved package, checked against one checkpoint and prompt."""

    directory: Path
    packages: dict[int, Path]
    chunk: int
    runner: SidecarRunner | None = None


def _package_meta(directory: Path, layer: int):
    path = directory / f"layer_{layer}.mlpackage"
    if not path.exists():
        raise AnelabInputError(
            f"{directory}: layer_{layer}.mlpackage is missing; the sidecar arm serves every full-attention layer — "
            f"export it with 'anelab export CHECKPOINT --out {directory} --layers {layer}' at the same --chunk"
        )
    return path, read_sidecar_metadata(path)


def _check_package(path: Path, meta, layer: int, model: ModelCheckpoint) -> None:
    if meta.layer != layer:
        raise AnelabInputError(f"{path} records layer {meta.layer}, not {layer}; keep each package under its own name")
    require_same_geometry(meta, model.geometry, model.path)
    require_same_tensors(meta, model.checkpoint)


def open_sidecars(
    directory: str | os.PathLike, model: ModelCheckpoint, prompt_tokens: int, runner: SidecarRunner | None = None
) -> SidecarSet:
    """Check ``directory/layer_<L>.mlpackage`` for every full-attention layer against the checkpoint and prompt.

    Refuses (one line): a missing directory or package; a package of a design the arms do not serve
    (``Design.served_by_arms``: the stateful ones keep K/V in state); a package from another checkpoint
    (geometry, or the digest of an attention tensor — a package without digests: h0 not computing this
    checkpoint's attention on seeded rows); chunk widths that differ between packages; histories that do
    not reach the prompt's chunk starts. ``runner`` serves the calls (default ``numpy_runner``: the saved
    programs evaluated with NumPy).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise AnelabInputError(f"sidecar directory {directory} does not exist; export the sidecars into it first")
    packages, chunks, histories, undigested = {}, {}, {}, []
    for layer in model.geometry.full_attention_layers:
        path, meta = _package_meta(directory, layer)
        design_of(meta, str(path)).require_arms(str(path))  # the design first: before anything else is asked
        _check_package(path, meta, layer, model)
        _check_rope_table(path, meta.coverage, layer, model, int(prompt_tokens))
        packages[layer], chunks[layer], histories[layer] = path, meta.chunk, set(meta.histories)
        if meta.source_tensors is None:
            undigested.append(layer)
    widths = sorted(set(chunks.values()))
    if len(widths) > 1:
        a, b = (next(L for L, c in chunks.items() if c == w) for w in widths[:2])
        raise AnelabInputError(
            f"the chunk width differs between packages (layer_{a}: {chunks[a]}, layer_{b}: {chunks[b]}); "
            "re-export every layer with one --chunk"
        )
    chunk = widths[0]
    starts = chunk_starts(int(prompt_tokens), chunk)
    for layer, have in histories.items():
        missing = [s for s in starts if s not in have]
        if missing:
            raise AnelabInputError(
                f"layer_{layer}.mlpackage lacks function h{missing[0]} for a {prompt_tokens}-token prompt in chunks of "
                f"{chunk}; re-export with --histories reaching {starts[-1]} or shorten the prompt"
            )
    sidecars = SidecarSet(directory, packages, chunk)
    for layer in undigested:  # a dynamic / longrope h0 rotates by the prompt's table (_check_rope_table)
        _check_same_weights(sidecars, layer, model, int(prompt_tokens))
    sidecars.runner = runner if runner is not None else numpy_runner(sidecars)
    return sidecars


def _check_rope_table(path: Path, coverage: int, layer: int, model: ModelCheckpoint, prompt_tokens: int) -> None:
    """A dynamic / longrope package rotates by the table of its coverage; the run uses the prompt's table."""
    g = model.geometry
    if not g.rope_depends_on_coverage:
        return
    (have, have_factor), (want, want_factor) = (g.rope_frequencies(layer, c) for c in (coverage, prompt_tokens))
    if have_factor != want_factor or not np.array_equal(have, want):
        raise AnelabInputError(
            f"{path} covers {coverage} positions, which picks another {g.rope_scaling.rope_type} RoPE table than a "
            f"{prompt_tokens}-token prompt; export the sidecars with histories that end at this prompt's last chunk"
        )


def _check_same_weights(sidecars: SidecarSet, layer: int, model: ModelCheckpoint, rope_coverage: int) -> None:
    """Refuse a package whose h0 does not compute this checkpoint's attention (seeded rows, NumPy evaluation):
    the same geometry and directory name can still hold another model's weights."""
    from anelab.sidecar.evaluate import evaluate

    g, c = model.geometry, sidecars.chunk
    rows = np.random.default_rng([layer, c]).standard_normal((c, g.hidden_size)).astype(np.float16)
    mask = causal(c, 0)
    got = evaluate(sidecars.packages[layer], function_name(0), {"hidden": rows, "mask": mask})["attn_out"]
    empty = np.zeros((0, g.num_kv_heads, g.head_dim), np.float32)
    want = reference.attention_block(
        rows, empty, empty, mask.astype(np.float32), model.attention(layer), g, rope_coverage=rope_coverage
    ).attn_out
    if relative_error(got, want) > RELATIVE_ERROR_THRESHOLD:
        raise AnelabInputError(
            f"{sidecars.packages[layer]} does not compute layer {layer} of {model.path} "
            f"(h0 is {relative_error(got, want):.0%} off its reference); export the sidecars from this checkpoint"
        )


def numpy_runner(sidecars: SidecarSet) -> SidecarRunner:
    """Serve sidecar calls by evaluating the saved programs with NumPy (fp16 storage emulated; any OS)."""
    from anelab.sidecar.evaluate import SavedPackage, evaluate

    opened: dict[int, SavedPackage] = {}

    def run(layer: int, start: int, valid_rows: int, inputs: dict) -> dict:
        if layer not in opened:  # one package open at a time: a layer-major prefill opens each once
            opened.clear()
            opened[layer] = SavedPackage(sidecars.packages[layer])
        return evaluate(opened[layer], function_name(start), inputs)

    return run


def runtime_runner(sidecars: SidecarSet, *, compute_units: str = "cpu_and_ne", runtime=None) -> SidecarRunner:
    """Serve sidecar calls through Core ML (``anelab.runtimes``): one opened sidecar per layer, functions loaded lazily."""
    from anelab.runtimes.open import open_sidecar

    opened = {
        layer: open_sidecar(pkg, compute_units=compute_units, chunk=sidecars.chunk, runtime=runtime)
        for layer, pkg in sidecars.packages.items()
    }

    def run(layer: int, start: int, valid_rows: int, inputs: dict) -> dict:
        return opened[layer].predict(start, inputs, valid_rows)

    return run
