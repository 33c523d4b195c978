"""Whole-model arms: one prompt prefilled chunk by chunk under different attention servers, then decoded greedily.

An *arm* says who serves each attention layer during prefill and with which mask:

- ``reference``: every attention from ``anelab.reference`` (fp32), causal mask;
- ``sidecar``: every full-attention layer from its saved ``layer_<L>.mlpackage`` (NumPy evaluation
  of the saved program off-Mac, or Core ML through ``runtime_runner`` on a Mac), causal mask;
- mask arms for a sparse-indexed model (``Indexer``): ``folded`` (the QSA-shaped selection of
  ``anelab.selection`` folded into each chunk's mask) vs ``causal-only`` (the causal mask alone — what
  a sidecar without the fold computes); the indexer sparsifies the full-attention layers, a sliding
  layer keeps its window (every arm applies a layer's window, ``geometry.window_of``, in prefill and decode);
- a negative control: any arm with one layer perturbed (``mask_dropped``: that layer attends to
  every key of the chunk's coverage; ``rope_shifted``: that layer's chunks after the first are rotated
  one position late against their cached history — reference-served layers only; a shift of every
  position alike would cancel in q.k).

The prompt is prefilled exactly as a runtime would: one call per chunk start s (function ``h<s>``),
the last chunk partial (padded to the sidecar width; padded rows come after every real row), each
layer's K/V cache threaded from the calls before. Then N tokens are decoded greedily one at a time
on the reference path (a sparse-indexed model's decode applies its indexer) from the cache the arm
produced — prefill on the sidecar, decode elsewhere.

Comparisons per arm pair (``compare_runs``): relative difference of the hidden state after every
layer over all prompt positions; of the logits at the last prompt position and at every decoded
step; greedy token agreement; the first layer whose difference exceeds the fp16 noise threshold.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from anelab import reference
from anelab.decoder import DecoderLayerWeights, attention_input, embed, finish_layer, lm_logits_each
from anelab.errors import AnelabInputError
from anelab.geometry import chunk_starts
from anelab.hf.model import ModelCheckpoint, load_model
from anelab.masks import causal, fold_with_causal
from anelab.selection import select
from anelab.sidecar.compare import (
    RELATIVE_ERROR_THRESHOLD,
    relative_error,
    require_same_geometry,
    require_same_tensors,
)
from anelab.sidecar.designs import design_of
from anelab.sidecar.format import function_name, read_sidecar_metadata
from anelab.weights import AttentionWeights

NOISE = RELATIVE_ERROR_THRESHOLD  # a layer differs "beyond fp16 noise" above this relative difference
ATTENTIONS = ("reference", "sidecar")
PERTURBATIONS = ("mask_dropped", "rope_shifted")
REFERENCE_CHUNK = 16  # prefill chunk of arms run without sidecars


@dataclass(frozen=True)
class Indexer:
    """A QSA-shaped block indexer (``anelab.selection.select``): kept blocks x keys per block."""

    kept_blocks: int
    compress_ratio: int


@dataclass(frozen=True)
class Perturbation:
    """A negative control: one layer's attention made wrong (``mask_dropped`` or ``rope_shifted``)."""

    layer: int
    kind: str

    def __post_init__(self):
        if self.kind not in PERTURBATIONS:
            raise AnelabInputError(f"perturbation {self.kind!r}: use one of {', '.join(PERTURBATIONS)}")


@dataclass(frozen=True)
class Arm:
    """Who serves the attention during prefill, and with which mask.

    attention: ``reference`` or ``sidecar``; indexer: the model is sparse-indexed with this indexer
    (decode applies it); fold: prefill folds the indexer's selection into the mask (False: causal only).
    """

    name: str
    attention: str = "reference"
    indexer: Indexer | None = None
    fold: bool = True
    perturbation: Perturbation | None = None

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise AnelabInputError(f"arm {self.name}: attention {self.attention!r}; use one of {', '.join(ATTENTIONS)}")


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
    if relative_error(got, want) > NOISE:
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
    """Serve sidecar calls through Core ML (``anelab.runtime``): one opened sidecar per layer, functions loaded lazily."""
    from anelab.runtime.open import open_sidecar

    opened = {
        layer: open_sidecar(pkg, compute_units=compute_units, chunk=sidecars.chunk, runtime=runtime)
        for layer, pkg in sidecars.packages.items()
    }

    def run(layer: int, start: int, valid_rows: int, inputs: dict) -> dict:
        return opened[layer].predict(start, inputs, valid_rows)

    return run


# ---- one arm -------------------------------------------------------------------------------------------------
@dataclass
class ArmRun:
    """What one arm produced.

    hidden  [L, P, D] float32 — the hidden state after every layer at every prompt position (None when the
            run did not keep it: ``layer_diffs`` then holds what comparisons need)
    logits  [N, V] float32 — row 0 at the last prompt position, row i after feeding decoded token i-1
    tokens  [N] int — the greedy continuation (argmax of each logits row)
    layer_diffs  arm name -> per layer, the relative difference of this arm's hidden state from that arm's
            (computed during the prefill, for the pairs the run was asked for)
    """

    arm: Arm
    hidden: np.ndarray | None
    logits: np.ndarray
    tokens: np.ndarray
    layer_diffs: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class _Layer:
    """One layer during a run: its K/V cache so far, and its weights while they are in use (None otherwise)."""

    attention: AttentionWeights | None = None
    weights: DecoderLayerWeights | None = None
    k: list = field(default_factory=list)  # cached keys, token-major [n, Hkv, d] pieces
    v: list = field(default_factory=list)
    rope_coverage: int | None = None  # picks a dynamic / longrope table (ModelCheckpoint.rope_coverage)

    def history(self, geometry) -> tuple[np.ndarray, np.ndarray]:
        empty = np.zeros((0, geometry.num_kv_heads, geometry.head_dim), np.float32)
        k = np.concatenate(self.k) if self.k else empty
        v = np.concatenate(self.v) if self.v else empty
        return k, v

    def load(self, model: ModelCheckpoint, layer: int) -> None:
        self.attention, self.weights = model.attention(layer), model.layer(layer)

    def unload(self) -> None:
        self.attention = self.weights = None


def _selection_mask(normed, start, state: _Layer, k_hist, model, indexer: Indexer, width: int) -> np.ndarray:
    """The indexer's selection of these rows (scored on their reference q and every key) folded into a [width, s + width] mask."""
    rows = normed.shape[0]
    proj = reference.project(
        normed, start + np.arange(rows), state.attention, model.geometry, rope_coverage=state.rope_coverage
    )
    sel = select(proj.q, np.concatenate([k_hist, proj.k]), start, indexer.kept_blocks, indexer.compress_ratio)
    return fold_with_causal(sel.keep_indices, sel.keep_counts, start, width)


def _mask(normed, start, state, k_hist, model, arm: Arm, width: int, *, prefill: bool, layer: int) -> np.ndarray:
    """Additive mask float16 [width, start + width] for this layer's call (a sliding layer's window included)."""
    if prefill and arm.perturbation is not None and arm.perturbation == Perturbation(layer, "mask_dropped"):
        return np.zeros((width, start + width), np.float16)
    window = model.geometry.window_of(layer)
    if arm.indexer is not None and (arm.fold or not prefill) and window is None:
        return _selection_mask(normed, start, state, k_hist, model, arm.indexer, width)
    return causal(width, start, window=window)


def _attend(model, layer, state: _Layer, normed, start, arm: Arm, sidecars, *, prefill: bool):
    """One layer's attention for rows at ``start``: (attn_out [r, D], k [r, Hkv, d], v [r, Hkv, d]) float32."""
    g = model.geometry
    rows = normed.shape[0]
    k_hist, v_hist = state.history(g)
    on_sidecar = prefill and arm.attention == "sidecar" and layer in sidecars.packages
    width = sidecars.chunk if on_sidecar else rows
    mask = _mask(normed, start, state, k_hist, model, arm, width, prefill=prefill, layer=layer)
    if on_sidecar:
        hidden = np.zeros((width, g.hidden_size), np.float16)
        hidden[:rows] = normed
        inputs = {"hidden": hidden, "mask": mask}
        if start > 0:
            inputs.update(k_history=k_hist.astype(np.float16), v_history=v_hist.astype(np.float16))
        out = sidecars.runner(layer, start, rows, inputs)
        attn = np.asarray(out["attn_out"], np.float32).reshape(width, g.hidden_size)[:rows]
        kc = np.asarray(out["k_chunk"], np.float32).reshape(g.num_kv_heads, width, g.head_dim)[:, :rows]
        vc = np.asarray(out["v_chunk"], np.float32).reshape(g.num_kv_heads, width, g.head_dim)[:, :rows]
        return attn, kc.transpose(1, 0, 2), vc.transpose(1, 0, 2)
    # only chunks with a history: RoPE scores depend on q and k positions' difference, so shifting every
    # position of a layer alike (chunk 0 included) would cancel exactly
    shift = 1 if prefill and start > 0 and arm.perturbation == Perturbation(layer, "rope_shifted") else 0
    block = reference.attention_block(
        normed, k_hist, v_hist, mask.astype(np.float32), state.attention, g, start=start + shift,
        rope_coverage=state.rope_coverage,
    )  # fmt: skip
    return block.attn_out, block.k_chunk.transpose(1, 0, 2), block.v_chunk.transpose(1, 0, 2)


def _layer_rows(model, layer: int, state: _Layer, x, start: int, arm: Arm, sidecars, *, prefill: bool) -> np.ndarray:
    """Rows x [r, D] at ``start`` through one loaded layer (its cache appended): the layer's output [r, D]."""
    normed = attention_input(x, state.weights, model.eps)
    attn, k, v = _attend(model, layer, state, normed, start, arm, sidecars, prefill=prefill)
    state.k.append(k.astype(np.float32))
    state.v.append(v.astype(np.float32))
    return finish_layer(x, attn, state.weights, model.eps)


@dataclass
class _Prefill:
    """One arm during the prefill: its layers' caches, its rows x [P, D] (the embeddings, then each layer's
    output in turn) and, when kept, every layer's output hidden [L, P, D]."""

    arm: Arm
    states: list[_Layer]
    x: np.ndarray
    hidden: np.ndarray | None


def _prefill_layer_major(model, runs: list[_Prefill], starts, chunk, sidecars, diffs: dict, progress) -> None:
    """Every chunk through layer 0 (its cache threaded), then through layer 1, ...: each layer's weights are
    read once for all arms and dropped, every arm's chunks through them on its own. After each layer, the
    relative difference of arm b's rows from arm a's is appended to ``diffs[(a, b)]`` (indices into runs)."""
    for layer in range(model.num_layers):
        with _loaded_once(model, layer, [run.states[layer] for run in runs]):
            for run in runs:
                for start in starts:
                    rows = slice(start, start + chunk)
                    run.x[rows] = _layer_rows(model, layer, run.states[layer], run.x[rows].copy(), start, run.arm,
                                              sidecars, prefill=True)  # fmt: skip
                if run.hidden is not None:
                    run.hidden[layer] = run.x
        for a, b in diffs:
            diffs[(a, b)].append(relative_error(runs[b].x, runs[a].x))
        progress.update()


@contextlib.contextmanager
def _loaded_once(model, layer: int, states: list[_Layer]):
    """Layer ``layer``'s weights read once and handed to every arm's state of it; dropped from all after."""
    states[0].load(model, layer)
    for state in states[1:]:
        state.attention, state.weights = states[0].attention, states[0].weights
    try:
        yield
    finally:
        for state in states:
            state.unload()


def _prefill_chunk_major(model, states, x, starts, chunk, arm, sidecars, hidden, progress) -> None:
    """Each chunk through every layer before the next chunk (a runtime's order): every layer's weights held."""
    for layer, state in enumerate(states):
        state.load(model, layer)
    for start in starts:
        rows = slice(start, start + chunk)
        y = x[rows].copy()
        for layer, state in enumerate(states):
            y = _layer_rows(model, layer, state, y, start, arm, sidecars, prefill=True)
            hidden[layer, rows] = y
        x[rows] = y
    for state in states:
        state.unload()
    progress.update(len(states))


PREFILL_ORDERS = {"layer": _prefill_layer_major, "chunk": _prefill_chunk_major}


def _decode_step_together(model, runs: list[tuple[Arm, list[_Layer]]], tokens: list[int], position: int, sidecars,
                          head) -> list[np.ndarray]:  # fmt: skip
    """One greedy step of every arm on the reference path: each layer's weights (and the LM head's blocks) read
    once for all arms, every arm's row through them on its own -> one logits row [V] per arm."""
    xs = [embed(np.array([token]), head) for token in tokens]
    for layer in range(model.num_layers):
        with _loaded_once(model, layer, [states[layer] for _, states in runs]):
            for i, (arm, states) in enumerate(runs):
                xs[i] = _layer_rows(model, layer, states[layer], xs[i], position, arm, sidecars, prefill=False)
    return [rows[0] for rows in lm_logits_each(xs, head, model.eps)]


def _check_arm(arm: Arm, model: ModelCheckpoint, sidecars: SidecarSet | None) -> None:
    if arm.attention == "sidecar" and sidecars is None:
        raise AnelabInputError(f"arm {arm.name} runs on the sidecars; pass the sidecar directory")
    p = arm.perturbation
    if p is not None:
        if not 0 <= p.layer < model.num_layers:
            raise AnelabInputError(f"arm {arm.name}: perturbed layer {p.layer} is outside 0..{model.num_layers - 1}")
        if p.kind == "rope_shifted" and arm.attention == "sidecar" and p.layer in sidecars.packages:
            raise AnelabInputError(
                f"arm {arm.name}: a saved sidecar fixes its RoPE positions; shift RoPE on a reference-served layer"
            )


def run_arm(
    model: ModelCheckpoint,
    prompt: np.ndarray,
    arm: Arm,
    *,
    decode: int,
    chunk: int | None = None,
    sidecars: SidecarSet | None = None,
    order: str = "layer",
) -> ArmRun:
    """Prefill ``prompt`` (int [P]) chunk by chunk under ``arm``, then decode ``decode`` tokens greedily
    (``run_arms`` with one arm)."""
    return run_arms(model, prompt, [arm], decode=decode, chunk=chunk, sidecars=sidecars, order=order)[arm.name]


def run_arms(
    model: ModelCheckpoint,
    prompt: np.ndarray,
    arms: list[Arm],
    *,
    decode: int,
    chunk: int | None = None,
    sidecars: SidecarSet | None = None,
    order: str = "layer",
    keep_hidden: bool = True,
    layer_pairs: tuple[tuple[str, str], ...] = (),
) -> dict[str, ArmRun]:
    """Each arm's prefill of ``prompt`` (int [P]) chunk by chunk, then the arms' greedy decodes of ``decode``
    tokens in lockstep -> arm name -> its run.

    chunk: the prefill chunk (default: the sidecars' width, else ``REFERENCE_CHUNK``); with sidecars it
    must equal their width. order: ``layer`` (default) streams the weights — every chunk of every arm goes
    through layer 0 with its cache threaded, then layer 1, ..., each layer's weights read once for all
    arms and dropped; ``chunk`` runs each arm's chunks through every layer first (a runtime's order)
    holding every layer's weights. Both make the same calls on the same inputs: the results are equal
    bit for bit. Decode reads each layer's weights once per step for all arms (and the LM head's
    vocabulary blocks, the embedding rows on demand from the checkpoint's files). Every arm's rows go
    through the shared weights on their own, so an arm's results are bit for bit those of running it alone.

    ``layer_pairs`` (a, b): arm b's per-layer relative difference from arm a, computed as each layer
    finishes (``ArmRun.layer_diffs``); ``keep_hidden=False`` then drops each layer's hidden states
    [P, D] once compared instead of keeping [L, P, D] per arm (1.9 GB for two arms of an 8B model).
    """
    from anelab.progress import tqdm

    prompt = np.asarray(prompt)
    chunk = _check_run(model, prompt, arms, decode, chunk, sidecars, order)
    names = [arm.name for arm in arms]
    unknown = sorted({name for pair in layer_pairs for name in pair} - set(names))
    if unknown:
        raise AnelabInputError(f"layer pair names arm {unknown[0]!r}, which is not run; arms: {', '.join(names)}")
    pairs = {(names.index(a), names.index(b)): [] for a, b in layer_pairs}
    head, g = model.head(), model.geometry
    coverage = model.rope_coverage(prompt.size, decode)
    keep = keep_hidden or order != "layer"  # the chunk-major order compares afterwards, from the kept states
    runs = [
        _Prefill(arm, [_Layer(rope_coverage=coverage) for _ in range(model.num_layers)], embed(prompt, head),
                 np.zeros((model.num_layers, prompt.size, g.hidden_size), np.float32) if keep else None)
        for arm in arms
    ]  # fmt: skip
    starts = chunk_starts(prompt.size, chunk)
    with tqdm(total=model.num_layers * (1 if order == "layer" else len(arms)), desc="prefill", unit="layer",
              leave=False) as progress:  # fmt: skip
        if order == "layer":
            _prefill_layer_major(model, runs, starts, chunk, sidecars, pairs, progress)
        else:
            for run in runs:
                _prefill_chunk_major(model, run.states, run.x, starts, chunk, run.arm, sidecars, run.hidden, progress)
            for a, b in pairs:
                pairs[(a, b)] = [relative_error(runs[b].hidden[i], runs[a].hidden[i]) for i in range(model.num_layers)]
    logits = [[rows[0]] for rows in lm_logits_each([run.x[-1:] for run in runs], head, model.eps)]
    tokens = [[int(np.argmax(rows[0]))] for rows in logits]
    stepping = [(run.arm, run.states) for run in runs]
    for step in tqdm(range(1, decode), desc="decode", unit="token", leave=False, disable=decode < 2):
        step_logits = _decode_step_together(model, stepping, [t[-1] for t in tokens], prompt.size + step - 1,
                                            sidecars, head)  # fmt: skip
        for arm_logits, arm_tokens, row in zip(logits, tokens, step_logits, strict=True):
            arm_logits.append(row)
            arm_tokens.append(int(np.argmax(row)))
    results = {}
    for i, (run, arm_logits, arm_tokens) in enumerate(zip(runs, logits, tokens, strict=True)):
        diffs = {names[a]: d for (a, b), d in pairs.items() if b == i}
        hidden = run.hidden if keep_hidden else None
        results[run.arm.name] = ArmRun(run.arm, hidden, np.stack(arm_logits), np.array(arm_tokens), diffs)
    return results


def _check_run(model, prompt: np.ndarray, arms: list[Arm], decode: int, chunk, sidecars, order: str) -> int:
    """Refuse what ``run_arms`` cannot run (one line each); the prefill chunk it uses."""
    for arm in arms:
        _check_arm(arm, model, sidecars)
    if len({arm.name for arm in arms}) != len(arms):
        raise AnelabInputError(f"arm names must differ: {', '.join(arm.name for arm in arms)}")
    if decode < 1:
        raise AnelabInputError(f"decode must be >= 1 token, got {decode}")
    if order not in PREFILL_ORDERS:
        raise AnelabInputError(f"prefill order {order!r}: use one of {', '.join(PREFILL_ORDERS)}")
    chunk = (sidecars.chunk if sidecars else REFERENCE_CHUNK) if chunk is None else int(chunk)
    if sidecars is not None and chunk != sidecars.chunk:
        raise AnelabInputError(f"the prefill chunk {chunk} differs from the sidecars' width {sidecars.chunk}")
    if prompt.ndim != 1 or prompt.size < 1:
        raise AnelabInputError("the prompt needs at least one token id")
    return chunk


# ---- comparisons ---------------------------------------------------------------------------------------------
@dataclass
class PairComparison:
    """Arm ``b`` against arm ``a``.

    layer_diffs: relative difference of the hidden state after each layer (all prompt positions);
    step_logits_diffs: per decoded step (step 0 = the last prompt position; later steps condition on
    each arm's own tokens); first_divergent_layer: first layer above ``noise`` (None: none).
    """

    a: str
    b: str
    layer_diffs: list[float]
    step_logits_diffs: list[float]
    greedy_agreement: float
    first_divergent_step: int | None
    first_divergent_layer: int | None
    noise: float

    @property
    def prompt_logits_diff(self) -> float:
        return self.step_logits_diffs[0]

    @property
    def identical_text(self) -> bool:
        return self.first_divergent_step is None

    def to_dict(self) -> dict:
        return {
            "a": self.a,
            "b": self.b,
            "layer_diffs": self.layer_diffs,
            "prompt_logits_diff": self.prompt_logits_diff,
            "step_logits_diffs": self.step_logits_diffs,
            "greedy_agreement": self.greedy_agreement,
            "identical_text": self.identical_text,
            "first_divergent_step": self.first_divergent_step,
            "first_divergent_layer": self.first_divergent_layer,
            "noise": self.noise,
        }


def compare_runs(a: ArmRun, b: ArmRun, noise: float = NOISE) -> PairComparison:
    """Per-layer hidden, per-step logits and greedy comparison of two runs of one prompt (the per-layer
    differences from the kept hidden states, else from those ``run_arms`` computed for the pair)."""
    if a.tokens.shape != b.tokens.shape or (a.hidden is not None and b.hidden is not None
                                            and a.hidden.shape != b.hidden.shape):  # fmt: skip
        raise AnelabInputError(f"arms {a.arm.name} and {b.arm.name} ran different prompts or decode lengths")
    if a.hidden is not None and b.hidden is not None:
        layers = [relative_error(b.hidden[i], a.hidden[i]) for i in range(a.hidden.shape[0])]
    elif a.arm.name in b.layer_diffs:
        layers = list(b.layer_diffs[a.arm.name])
    else:
        raise AnelabInputError(
            f"arms {a.arm.name} and {b.arm.name} kept no hidden states and no differences for this pair; "
            "run them with layer_pairs or keep_hidden"
        )
    steps = [relative_error(b.logits[i], a.logits[i]) for i in range(a.logits.shape[0])]
    differ = np.flatnonzero(a.tokens != b.tokens)
    beyond = [i for i, d in enumerate(layers) if d > noise]
    return PairComparison(
        a.arm.name,
        b.arm.name,
        layers,
        steps,
        float(np.mean(a.tokens == b.tokens)),
        int(differ[0]) if differ.size else None,
        beyond[0] if beyond else None,
        float(noise),
    )


@dataclass
class ArmsReport:
    """Every arm's run of one prompt and the comparison of each listed pair."""

    checkpoint: Path
    prompt: np.ndarray
    decode: int
    chunk: int
    runs: dict[str, ArmRun]
    pairs: list[PairComparison]

    def table(self) -> str:
        """The per-layer table (relative hidden difference per pair) and the summary lines."""
        heads = [f"{p.b} vs {p.a}" for p in self.pairs]
        width = max([len(h) for h in heads] + [12])
        lines = [
            f"checkpoint {self.checkpoint}: prompt {self.prompt.size} tokens in chunks of {self.chunk}, "
            f"{self.decode} decoded greedily on the reference path",
            f"{'layer':>5}  " + "  ".join(f"{h:>{width}}" for h in heads),
        ]
        for layer in range(len(self.pairs[0].layer_diffs) if self.pairs else 0):
            lines.append(f"{layer:>5}  " + "  ".join(f"{p.layer_diffs[layer]:>{width}.3e}" for p in self.pairs))
        for p in self.pairs:
            first = "none" if p.first_divergent_layer is None else str(p.first_divergent_layer)
            step = "identical" if p.identical_text else f"first differs at step {p.first_divergent_step}"
            lines.append(
                f"{p.b} vs {p.a}: logits at the last prompt position {p.prompt_logits_diff:.3%}, max over "
                f"{len(p.step_logits_diffs)} steps {max(p.step_logits_diffs):.3%}; greedy agreement "
                f"{p.greedy_agreement:.0%} ({step}); first layer beyond {p.noise:.0e}: {first}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "checkpoint": str(self.checkpoint),
            "prompt_tokens": int(self.prompt.size),
            "decode": self.decode,
            "chunk": self.chunk,
            "tokens": {name: run.tokens.tolist() for name, run in self.runs.items()},
            "pairs": [p.to_dict() for p in self.pairs],
        }


def random_prompt(vocab_size: int, tokens: int, seed: int = 0) -> np.ndarray:
    """Token ids int64 [tokens] drawn uniformly from the vocabulary with a fixed seed."""
    if tokens < 1:
        raise AnelabInputError(f"--prompt-tokens must be >= 1, got {tokens}")
    return np.random.default_rng([int(seed), 0x7E4]).integers(0, vocab_size, int(tokens))


def read_tokens(path: str | os.PathLike) -> np.ndarray:
    """Token ids from a file: a JSON list, or integers separated by whitespace or commas."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise AnelabInputError(f"{path}: no such token file") from None
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else text.replace(",", " ").split()
        tokens = np.array([int(v) for v in values], dtype=np.int64)
    except (ValueError, TypeError, json.JSONDecodeError):
        raise AnelabInputError(
            f"{path}: token file must hold integer token ids (a JSON list or whitespace-separated)"
        ) from None
    if tokens.size == 0:
        raise AnelabInputError(f"{path}: the token file is empty")
    return tokens


def compare_arms(
    checkpoint: str | os.PathLike,
    sidecars: str | os.PathLike | None,
    prompt_tokens: int | None = None,
    *,
    decode: int = 32,
    tokens: np.ndarray | None = None,
    seed: int = 0,
    indexer: Indexer | None = None,
    chunk: int | None = None,
    compute_units: str | None = None,
    runtime=None,
) -> ArmsReport:
    """Run the arms on one prompt and compare them.

    Arms: ``reference``; ``sidecar`` when a sidecar directory is given; with an ``indexer``, ``folded``
    and ``causal-only`` (on the sidecars when given, else on the reference). Pairs: sidecar vs
    reference, causal-only vs folded (a sparse-indexed model is a different model from the dense
    reference, so folded is not compared with reference). ``tokens`` (int [P]) overrides the seeded
    random prompt of ``prompt_tokens`` ids. ``compute_units``: serve the sidecars through Core ML
    (``runtime_runner``; ``runtime`` defaults to this machine's, refused off-Mac) instead of NumPy.
    """

    model = load_model(checkpoint)
    prompt = random_prompt(model.vocab_size, prompt_tokens or 0, seed) if tokens is None else np.asarray(tokens)
    sidecar_set = open_sidecars(sidecars, model, prompt.size) if sidecars is not None else None
    if compute_units is not None:
        if sidecar_set is None:
            raise AnelabInputError("compute units apply to the sidecar arm; pass the sidecar directory too")
        sidecar_set.runner = runtime_runner(sidecar_set, compute_units=compute_units, runtime=runtime)
    arms = [Arm("reference")]
    if sidecar_set is not None:
        arms.append(Arm("sidecar", "sidecar"))
    if indexer is not None:
        served = "sidecar" if sidecar_set is not None else "reference"
        arms += [Arm("folded", served, indexer, fold=True), Arm("causal-only", served, indexer, fold=False)]
    order = [("reference", "sidecar"), ("folded", "causal-only")]
    names = {arm.name for arm in arms}
    wanted = tuple((a, b) for a, b in order if a in names and b in names)
    runs = run_arms(model, prompt, arms, decode=decode, chunk=chunk, sidecars=sidecar_set, keep_hidden=False,
                    layer_pairs=wanted)  # fmt: skip
    pairs = [compare_runs(runs[a], runs[b]) for a, b in wanted]
    used = sidecar_set.chunk if sidecar_set else (chunk or REFERENCE_CHUNK)
    return ArmsReport(model.path, prompt, decode, used, runs, pairs)


DEFAULT_DENSE = "default-dense"  # compare-arms' name for the embedded dense sibling


def default_dense(sidecars: str | os.PathLike | None, prompt_tokens: int, chunk: int = REFERENCE_CHUNK):
    """The embedded dense sibling (generated on first use) and, when ``sidecars`` names a directory that
    does not exist yet, its sidecars exported there for a ``prompt_tokens`` prompt. Returns (checkpoint, sidecars)."""
    from anelab.hf.default import dense_checkpoint_dir

    checkpoint = dense_checkpoint_dir()
    if sidecars is not None and not Path(sidecars).exists():
        export_arm_sidecars(checkpoint, sidecars, chunk, prompt_tokens)
    return checkpoint, sidecars


# ---- the study (notebook 07) ------------------------------------------------------------------------------------
def export_arm_sidecars(
    checkpoint: str | os.PathLike, out_dir: str | os.PathLike, chunk: int, prompt_tokens: int
) -> Path:
    """Export every full-attention layer with the functions h0, hC, ... a ``prompt_tokens`` prompt needs."""
    from anelab.sidecar.export import export_sidecars

    export_sidecars(checkpoint, out_dir, int(chunk), chunk_starts(int(prompt_tokens), int(chunk)))
    return Path(out_dir)


@dataclass
class WindowPoint:
    """Folded vs causal-only arms at one indexer budget (``window`` = its dense-exact window in keys)."""

    kept_blocks: int
    window: int
    comparison: PairComparison

    def to_dict(self) -> dict:
        return {"kept_blocks": self.kept_blocks, "window": self.window, **self.comparison.to_dict()}


def window_sweep(
    model: ModelCheckpoint,
    prompt: np.ndarray,
    kept_blocks: list[int],
    compress_ratio: int,
    *,
    decode: int,
    sidecars: SidecarSet | None = None,
    chunk: int | None = None,
) -> list[WindowPoint]:
    """For each kept-blocks value: the folded arm against the causal-only arm (on the sidecars when given)."""
    from anelab.masks import dense_exact_window
    from anelab.progress import tqdm

    served = "sidecar" if sidecars is not None else "reference"
    points = []
    for kb in tqdm(list(kept_blocks), desc="indexer budgets", unit="budget"):
        indexer = Indexer(int(kb), int(compress_ratio))
        arms = [Arm(name, served, indexer, fold=fold) for name, fold in (("folded", True), ("causal-only", False))]
        runs = run_arms(model, prompt, arms, decode=decode, chunk=chunk, sidecars=sidecars, keep_hidden=False,
                        layer_pairs=(("folded", "causal-only"),))  # fmt: skip
        points.append(WindowPoint(int(kb), dense_exact_window(kb, compress_ratio), compare_runs(*runs.values())))
    return points


def greedy_proxy(
    package: str | os.PathLike, checkpoint: str | os.PathLike, kept_blocks: int, compress_ratio: int, seed: int = 0
):
    """Notebook 02's stand-in for the text check on one layer (``anelab.studies.mask_fold.greedy_comparison``):
    the package's longest function under the folded vs the causal-only mask, argmax over a random projection."""
    from anelab.sidecar.foldcheck import make_case, selection_for
    from anelab.studies.mask_fold import greedy_comparison

    case = make_case(package, checkpoint, seed=seed)
    return greedy_comparison(case, selection_for(case, kept_blocks, compress_ratio))


def arms_record(
    parameters: dict, pairs: dict[str, PairComparison], sweep: list[WindowPoint], proxy: list[dict]
) -> dict:
    """A measured record (kind ``whole_model_arms``) of the per-layer differences, the sweep and the proxy."""
    from anelab.records import make_record

    return make_record(
        "whole_model_arms",
        {**parameters, "noise": NOISE, "evaluator": "saved packages evaluated with NumPy (fp16 storage emulated)"},
        {"pairs": {k: p.to_dict() for k, p in pairs.items()}, "sweep": [p.to_dict() for p in sweep], "proxy": proxy},
        unknown=["Core ML / ANE numerics (this run evaluates the saved programs with NumPy)"],
    )
