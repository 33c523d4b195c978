"""One prompt prefilled chunk by chunk under different attention servers (arms), then decoded greedily.

An *arm* says who serves each attention layer during prefill and with which mask:

- ``reference``: every attention from ``anelab.core.reference`` (fp32), causal mask;
- ``sidecar``: every full-attention layer from its saved ``layer_<L>.mlpackage`` (NumPy evaluation
  of the saved program off-Mac, or Core ML through ``runtime_runner`` on a Mac), causal mask;
- mask arms for a sparse-indexed model (``Indexer``): ``folded`` (the QSA-shaped selection of
  ``anelab.core.selection`` folded into each chunk's mask) vs ``causal-only`` (the causal mask alone — what
  a sidecar without the fold computes); the indexer sparsifies the full-attention layers, a sliding
  layer keeps its window (every arm applies a layer's window, ``geometry.window_of``, in prefill and decode);
- ``mlp="sidecar"`` (any arm): each layer's MLP that the sidecars' MLP set serves (``SidecarSet.mlp``, packages of
  ``--graph mlp``; every layer or a chosen few) comes from its package during prefill, the rest from NumPy;
- a negative control: any arm with one layer perturbed (``mask_dropped``: that layer attends to
  every key of the chunk's coverage; ``rope_shifted``: that layer's chunks after the first are rotated
  one position late against their cached history — reference-served layers only; a shift of every
  position alike would cancel in q.k; ``start_shifted``: a sidecar-served layer's chunks are told a start
  one position late — its K/V history shifted back, or a stateful sidecar's ``start`` input).

The prompt is prefilled exactly as a runtime would: one call per chunk start s (function ``h<s>``),
the last chunk partial (padded to the sidecar width; padded rows come after every real row), each
layer's K/V cache threaded from the calls before. Then N tokens are decoded greedily one at a time
on the reference path (a sparse-indexed model's decode applies its indexer) from the cache the arm
produced — prefill on the sidecar, decode elsewhere.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np

from anelab.arms.resident import RESIDENT, WeightsPlan, weights_for_run
from anelab.arms.sidecars import SidecarSet
from anelab.checkpoints.whole_model import ModelCheckpoint
from anelab.core import reference
from anelab.core.decoder import DecoderLayerWeights, attention_input, embed, finish_layer, lm_logits_each
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import chunk_starts
from anelab.core.limits import memory_limit
from anelab.core.masks import causal, fold_with_causal
from anelab.core.parallel import DEFAULT_MAX_JOBS, available_cores, process_map, start_method
from anelab.core.progress import tqdm
from anelab.core.selection import select
from anelab.core.weights import AttentionWeights
from anelab.sidecar.checks.comparison import (
    relative_error,
)

ATTENTIONS = ("reference", "sidecar")
PERTURBATIONS = ("mask_dropped", "rope_shifted", "start_shifted")
REFERENCE_CHUNK = 16  # prefill chunk of arms run without sidecars


@dataclass(frozen=True)
class Indexer:
    """A QSA-shaped block indexer (``anelab.core.selection.select``): kept blocks x keys per block."""

    kept_blocks: int
    compress_ratio: int


@dataclass(frozen=True)
class Perturbation:
    """A negative control: one layer's attention made wrong (``mask_dropped``, ``rope_shifted`` or ``start_shifted``)."""

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
    mlp: str = "reference"  # ``sidecar``: every layer the sidecars' MLP set serves takes its MLP from its package
    gdn: str = "reference"  # ``sidecar``: a hybrid's Gated DeltaNet input projections from theirs (MLX engine only)

    def __post_init__(self):
        for server in (self.attention, self.mlp, self.gdn):  # who serves the attention, the MLPs, the projections
            if server not in ATTENTIONS:
                raise AnelabInputError(f"arm {self.name}: served by {server!r}; use one of {', '.join(ATTENTIONS)}")


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
    weights: WeightsPlan | None = None  # how the run held the decoder weights (resident or streamed)


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
        shifted = arm.perturbation == Perturbation(layer, "start_shifted")
        return sidecars.serve(layer, start, normed, k_hist, v_hist, mask, start_offset=int(shifted))
    # only chunks with a history: RoPE scores depend on q and k positions' difference, so shifting every
    # position of a layer alike (chunk 0 included) would cancel exactly
    shift = 1 if prefill and start > 0 and arm.perturbation == Perturbation(layer, "rope_shifted") else 0
    block = reference.attention_block(
        normed, k_hist, v_hist, mask.astype(np.float32), state.attention, g, start=start + shift,
        rope_coverage=state.rope_coverage,
    )  # fmt: skip
    return block.attn_out, block.k_chunk.transpose(1, 0, 2), block.v_chunk.transpose(1, 0, 2)


def _layer_rows(model, layer: int, state: _Layer, x, start: int, arm: Arm, sidecars, *, prefill: bool) -> np.ndarray:
    """Rows x [r, D] at ``start`` through one loaded layer (its cache appended): the layer's output [r, D]. One row
    (a decoded token, a prompt's last chunk of one) goes through on one BLAS thread (``one_blas_thread``)."""
    with one_blas_thread() if x.shape[0] == 1 else contextlib.nullcontext():
        normed = attention_input(x, state.weights, model.eps)
        attn, k, v = _attend(model, layer, state, normed, start, arm, sidecars, prefill=prefill)
        state.k.append(k.astype(np.float32))
        state.v.append(v.astype(np.float32))
        return finish_layer(x, attn, state.weights, model.eps, mlp=_mlp_server(layer, arm, sidecars, prefill=prefill))


def _mlp_server(layer: int, arm: Arm, sidecars, *, prefill: bool):
    """Who computes ``layer``'s MLP for this call: its sidecar in an arm's prefill with ``mlp="sidecar"`` when the
    sidecars serve that layer's MLP ((normed rows [r, D]) -> [r, D]); else None (the layer's weights, in NumPy)."""
    served = prefill and arm.mlp == "sidecar" and sidecars is not None and sidecars.mlp is not None
    if not served or layer not in sidecars.mlp.packages:
        return None
    return lambda rows: sidecars.mlp.serve(layer, rows)


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


_BLAS = []  # one threadpoolctl controller, made on first use


def one_blas_thread():
    """Context: BLAS on one thread. A decoded step's products are matrix-vector ones, bound by memory: a second
    BLAS thread only adds its hand-off, and on a shared machine a thread waiting for a busy core makes each
    product ~20x slower (0.3 ms -> 6 ms for [1, 576] x [576, 1536] under a load of 10 on 2 cores). A
    matrix-vector product also splits its sums differently on more threads (its last bits change; a
    matrix-matrix one's do not): on one thread, every one-row product of the arms is the same on any machine and
    in the processes of ``_run_apart``."""
    if not _BLAS:
        from threadpoolctl import ThreadpoolController

        _BLAS.append(ThreadpoolController())
    return _BLAS[0].limit(limits=1, user_api="blas")


def _decode_step_together(model, runs: list[tuple[Arm, list[_Layer]]], tokens: list[int], position: int, sidecars,
                          head) -> list[np.ndarray]:  # fmt: skip
    """One greedy step of every arm on the reference path: each layer's weights (and the LM head's blocks) read
    once for all arms, every arm's row through them on its own -> one logits row [V] per arm (on one BLAS thread:
    ``one_blas_thread``)."""
    xs = [embed(np.array([token]), head) for token in tokens]
    with one_blas_thread():
        for layer in range(model.num_layers):
            with _loaded_once(model, layer, [states[layer] for _, states in runs]):
                for i, (arm, states) in enumerate(runs):
                    xs[i] = _layer_rows(model, layer, states[layer], xs[i], position, arm, sidecars, prefill=False)
        return [rows[0] for rows in lm_logits_each(xs, head, model.eps)]


def _check_arm(arm: Arm, model: ModelCheckpoint, sidecars: SidecarSet | None) -> None:
    if arm.attention == "sidecar" and (sidecars is None or not sidecars.packages):
        raise AnelabInputError(f"arm {arm.name} runs on the sidecars; pass the sidecar directory")
    if arm.mlp == "sidecar" and (sidecars is None or sidecars.mlp is None):
        raise AnelabInputError(f"arm {arm.name} runs its MLPs on sidecars; pass the MLP sidecar directory")
    if arm.gdn == "sidecar":
        raise AnelabInputError(
            f"arm {arm.name}: Gated DeltaNet projections are served on the mlx engine (anelab's NumPy forward does not "
            "run hybrids); pass --engine mlx"
        )
    p = arm.perturbation
    if p is not None:
        if not 0 <= p.layer < model.num_layers:
            raise AnelabInputError(f"arm {arm.name}: perturbed layer {p.layer} is outside 0..{model.num_layers - 1}")
        served = arm.attention == "sidecar" and p.layer in sidecars.packages
        if p.kind == "rope_shifted" and served:
            raise AnelabInputError(
                f"arm {arm.name}: a saved sidecar fixes its RoPE positions; shift RoPE on a reference-served layer"
            )
        if p.kind == "start_shifted" and not served:
            raise AnelabInputError(
                f"arm {arm.name}: start_shifted perturbs a sidecar-served layer; {p.layer} is not one"
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
    resident_budget: int | None = None,
) -> dict[str, ArmRun]:
    """Each arm's prefill of ``prompt`` (int [P]) chunk by chunk, then the arms' greedy decodes of ``decode``
    tokens in lockstep -> arm name -> its run.

    This is the NumPy engine (``model`` a ``ModelCheckpoint``, anelab's forward); ``arms.engines.run_arms_on``
    picks it or the MLX engine (``arms.mlx_engine``: mlx-lm runs everything but the sidecars).

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

    ``resident_budget`` (bytes; default ``arms.resident.RESIDENT_BUDGET_BYTES``, 0 streams): the decoder weights
    are kept resident in float32 from their first read when they fit it, else streamed from the files at every
    read as described above (``arms.resident``; the results are equal bit for bit either way). Each run's
    ``weights`` says which.
    """

    prompt = np.asarray(prompt)
    chunk = _check_run(model, prompt, arms, decode, chunk, sidecars, order)
    model, weights = weights_for_run(model, resident_budget)
    names = [arm.name for arm in arms]
    unknown = sorted({name for pair in layer_pairs for name in pair} - set(names))
    if unknown:
        raise AnelabInputError(f"layer pair names arm {unknown[0]!r}, which is not run; arms: {', '.join(names)}")
    pairs = {(names.index(a), names.index(b)): [] for a, b in layer_pairs}
    head, g = model.head(), model.geometry
    coverage = model.rope_coverage(prompt.size, decode)
    groups = arm_groups(model, weights, len(arms), prompt.size, order, sidecars)
    apart = len(groups) > 1  # each group of arms in its own process (``arm_groups``)
    keep = keep_hidden or order != "layer" or apart  # compared afterwards, from the kept states
    hidden_shape = (model.num_layers, prompt.size, g.hidden_size)
    runs = [
        _Prefill(arm, [_Layer(rope_coverage=coverage) for _ in range(model.num_layers)], embed(prompt, head),
                 (_shared_zeros(hidden_shape) if apart else np.zeros(hidden_shape, np.float32)) if keep else None)
        for arm in arms
    ]  # fmt: skip
    starts = chunk_starts(prompt.size, chunk)
    with tqdm(total=model.num_layers * (1 if order == "layer" else len(arms)), desc="prefill", unit="layer",
              leave=False) as progress:  # fmt: skip
        if apart:
            logits, tokens = _run_apart(model, runs, groups, starts, chunk, sidecars, decode, head, progress)
        elif order == "layer":
            _prefill_layer_major(model, runs, starts, chunk, sidecars, pairs, progress)
        else:
            for run in runs:
                _prefill_chunk_major(model, run.states, run.x, starts, chunk, run.arm, sidecars, run.hidden, progress)
        if apart or order != "layer":
            for a, b in pairs:
                pairs[(a, b)] = [relative_error(runs[b].hidden[i], runs[a].hidden[i]) for i in range(model.num_layers)]
    if not apart:
        logits, tokens = _logits_and_decode(model, runs, decode, prompt.size, sidecars, head)
    results = {}
    for i, (run, arm_logits, arm_tokens) in enumerate(zip(runs, logits, tokens, strict=True)):
        diffs = {names[a]: d for (a, b), d in pairs.items() if b == i}
        hidden = run.hidden if keep_hidden else None
        results[run.arm.name] = ArmRun(run.arm, hidden, np.stack(arm_logits), np.array(arm_tokens), diffs, weights)
    return results


def _logits_and_decode(model, runs: list[_Prefill], decode: int, prompt_tokens: int, sidecars, head, *,
                       progress: bool = True) -> tuple[list[list[np.ndarray]], list[list[int]]]:  # fmt: skip
    """After the prefill: each run's logits at the last prompt position, then ``decode - 1`` greedy steps of every
    run in lockstep -> (per run, its logits rows [V] float32; per run, its tokens)."""

    with one_blas_thread():  # matrix-vector products, as each decoded step's
        logits = [[rows[0]] for rows in lm_logits_each([run.x[-1:] for run in runs], head, model.eps)]
    tokens = [[int(np.argmax(rows[0]))] for rows in logits]
    stepping = [(run.arm, run.states) for run in runs]
    for step in tqdm(range(1, decode), desc="decode", unit="token", leave=False, disable=decode < 2 or not progress):
        step_logits = _decode_step_together(model, stepping, [t[-1] for t in tokens], prompt_tokens + step - 1,
                                            sidecars, head)  # fmt: skip
        for arm_logits, arm_tokens, row in zip(logits, tokens, step_logits, strict=True):
            arm_logits.append(row)
            arm_tokens.append(int(np.argmax(row)))
    return logits, tokens


# ---- arms in processes of their own ------------------------------------------------------------------------------
def arm_groups(
    model, weights: WeightsPlan, arms: int, prompt_tokens: int, order: str, sidecars=None
) -> list[list[int]]:
    """Which arms run together, each group in a process of its own: one group (this process) unless the arms are
    several, the order is layer-major, the weights are resident, this machine has two cores or more, worker
    processes are forked (``core.parallel.start_method``: they inherit the opened model and sidecars), the sidecars
    (if any) are served by a runner that keeps nothing its caller reads (``numpy_runner``; no call log, the MLP
    sidecars' neither), and every
    process's resident weights and every arm's layer outputs [L, P, D] float32 fit half this process's memory;
    then arms i, i + n, i + 2n, ... form group i of n = min(arms, cores, ``DEFAULT_MAX_JOBS``).

    An arm's run does not depend on the others it runs beside (``run_arms``), so the results are the same bit
    for bit: BLAS's products are the same on one thread as on several (a test runs both ways)."""

    n = min(arms, available_cores(), DEFAULT_MAX_JOBS)
    served_anywhere = sidecars is None or (sidecars.calls is None and getattr(sidecars.runner, "forkable", False)
                                           and (sidecars.mlp is None or sidecars.mlp.calls is None))  # fmt: skip
    if n < 2 or order != "layer" or weights.mode != RESIDENT or start_method() != "fork" or not served_anywhere:
        return [list(range(arms))]
    hidden = arms * model.num_layers * prompt_tokens * model.geometry.hidden_size * 4
    if n * weights.float32_bytes + hidden > memory_limit()[0] // 2:
        return [list(range(arms))]
    return [list(range(i, arms, n)) for i in range(n)]


def _shared_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """float32 zeros [shape] in memory shared with the processes forked after it (an anonymous shared map)."""
    import mmap

    return np.frombuffer(mmap.mmap(-1, max(1, int(np.prod(shape)) * 4)), np.float32, int(np.prod(shape))).reshape(shape)


_APART: dict = {}  # the run that the processes of ``_run_apart`` inherit (set just before they fork)


def _run_apart(model, runs: list[_Prefill], groups: list[list[int]], starts, chunk, sidecars, decode: int, head,
               progress) -> tuple[list, list]:  # fmt: skip
    """Each group of runs prefilled layer-major and decoded in a forked process of its own (``core.parallel``: one
    BLAS thread each), every run's layer outputs written into its shared ``hidden`` [L, P, D]; ``progress`` counts
    the layers done -> (per run, its logits rows; per run, its tokens), in the order of ``runs``. ``model`` is a
    resident one (``arm_groups``): every layer is read here first, once, and the processes inherit it."""
    import multiprocessing
    import threading

    for layer in range(model.num_layers):  # resident weights read once, here: the processes share these pages
        model.attention(layer)
        model.layer(layer)
    done = multiprocessing.get_context("fork").Value("i", 0)
    _APART.update(model=model, runs=runs, groups=groups, starts=starts, chunk=chunk, sidecars=sidecars,
                  decode=decode, head=head, done=done, prompt_tokens=runs[0].x.shape[0])  # fmt: skip
    finished = threading.Event()

    def show() -> None:  # the layers every process has finished, as they finish
        while not finished.wait(0.2):
            progress.update(done.value // len(groups) - progress.n)

    watcher = threading.Thread(target=show, name="anelab-arms-progress", daemon=True)
    watcher.start()
    try:
        results = process_map(_run_group, range(len(groups)), jobs=len(groups))
    finally:
        finished.set()
        watcher.join()
        _APART.clear()
    progress.update(progress.total - progress.n)
    logits, tokens = [None] * len(runs), [None] * len(runs)
    for group, (group_logits, group_tokens) in zip(groups, results, strict=True):
        for index, arm_logits, arm_tokens in zip(group, group_logits, group_tokens, strict=True):
            logits[index], tokens[index] = arm_logits, arm_tokens
    return logits, tokens


class _Counter:
    """A progress bar's ``update`` that counts into a shared integer (a forked process's layers)."""

    def __init__(self, value):
        self.value = value

    def update(self, n: int = 1) -> None:
        with self.value.get_lock():
            self.value.value += n


def _run_group(index: int) -> tuple[list, list]:
    """In a forked process: group ``index`` of ``_APART``'s runs prefilled (layer outputs into their shared
    ``hidden``) and decoded -> (per run of the group, its logits rows; its tokens)."""
    job = _APART
    runs = [job["runs"][i] for i in job["groups"][index]]
    _prefill_layer_major(job["model"], runs, job["starts"], job["chunk"], job["sidecars"], {}, _Counter(job["done"]))
    model = job["model"]
    return _logits_and_decode(model, runs, job["decode"], job["prompt_tokens"], job["sidecars"], job["head"],
                              progress=False)  # fmt: skip


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
