"""The sidecar set the arms serve from: every full-attention layer's saved package, checked against one
checkpoint and prompt; ``SidecarSet.serve`` runs one chunk of one layer through it whatever the design (K/V
history an input, or K/V in state read back), and the runner that evaluates a function (NumPy from disk, or
Core ML on a Mac)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from anelab.checkpoints.whole_model import ModelCheckpoint
from anelab.core import reference
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import chunk_starts
from anelab.core.masks import MASKED, causal
from anelab.runtimes.interface import NEURAL_ENGINE_UNITS, PREFLIGHT_LOAD_STEPS
from anelab.runtimes.open import open_sidecar
from anelab.sidecar.checks.comparison import (
    RELATIVE_ERROR_THRESHOLD,
    relative_error,
    require_same_geometry,
    require_same_tensors,
)
from anelab.sidecar.designs import MLP, Design, design_of, get_design
from anelab.sidecar.format import STATE_NAMES, SidecarMetadata, function_name, read_sidecar_metadata
from anelab.sidecar.mil.evaluate import SavedPackage, evaluate, evaluate_with_state, new_state

# (layer, chunk start, valid rows, inputs) -> outputs {attn_out [C, D], k_chunk [Hkv, C, d], v_chunk [Hkv, C, d]}
# inputs of a per-history design: hidden [C, D], mask [C, s + C], k_history / v_history [s, Hkv, d] (s > 0);
# of a stateful one: hidden [C, D], start [1] int32, mask [C, capacity] when it takes one — its runner keeps the
# layer's state (a fresh one at start 0) and returns the chunk's K/V read back from it (``state_rows``)
SidecarRunner = Callable[[int, int, int, dict], dict]


@dataclass
class SidecarSet:
    """Every full-attention layer's saved package, checked against one checkpoint and prompt.

    ``metadata``: each layer's package metadata (its design, state capacity, window). ``calls``: when a list,
    every served chunk is appended as (layer, chunk start, function, valid rows) — the call log.
    """

    directory: Path
    packages: dict[int, Path]
    chunk: int
    runner: SidecarRunner | None = None
    metadata: dict[int, SidecarMetadata] = field(default_factory=dict)
    calls: list | None = None
    # the block sidecars, each in the field named after its kind (designs.BlockReader.kind; None: none given)
    mlp: BlockSidecars | None = None  # the MLP sidecars an arm with ``mlp="sidecar"`` is served by
    gdn: BlockSidecars | None = None  # the GDN projections' sidecars (``gdn="sidecar"``; the MLX hybrid serves them)

    def design(self, layer: int) -> Design:
        return design_of(self.metadata[layer], str(self.packages[layer]))

    def takes_history(self, layer: int) -> bool:
        """Whether the layer's sidecar takes the K/V history as inputs (False: it keeps K/V in its state)."""
        return not self.design(layer).stateful

    def function_for(self, layer: int, start: int) -> str:
        """The function that serves the chunk at ``start`` of ``layer`` (the design registry's choice)."""
        return self.design(layer).function_for(self.chunk, int(start))

    def serve(self, layer: int, start: int, normed: np.ndarray, k_history, v_history, mask: np.ndarray,
              *, start_offset: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        """One chunk of ``layer`` at ``start`` through its sidecar -> (attn_out [r, D], k [r, Hkv, d], v [r, Hkv, d])
        float32 for the r real rows.

        normed [r, D]: the chunk's post-input-norm rows (r <= C; padded with zero rows to C, which come after
        every real row); k_history / v_history [start, Hkv, d]: the layer's cache so far, token-major (unused by
        a stateful design, whose state holds it; may be None then); mask [C, start + C] additive, position
        space (a stateful design gets it in slot space, [C, capacity], when it takes a mask at all).
        ``start_offset`` (a negative control): the chunk is told a start that many positions late — the K/V
        history shifted that far back for a per-history design, the ``start`` input for a stateful one.
        """
        g, width, rows = self.metadata[layer].geometry, self.chunk, normed.shape[0]
        hidden = np.zeros((width, g["hidden_size"]), np.float16)
        hidden[:rows] = normed
        inputs = {"hidden": hidden}
        design, meta = self.design(layer), self.metadata[layer]
        if design.stateful:
            inputs["start"] = np.array([start + start_offset], np.int32)
            if design.mask_input(meta):
                slots = np.full((width, meta.state_capacity), MASKED, np.float16)
                slots[:, : mask.shape[1]] = mask
                inputs["mask"] = slots
        else:
            inputs["mask"] = np.asarray(mask, np.float16)
            if start > 0:
                k, v = (np.asarray(h, np.float16) for h in (k_history, v_history))
                if start_offset:
                    k, v = (np.concatenate([np.zeros_like(h[:start_offset]), h[:-start_offset]]) for h in (k, v))
                inputs.update(k_history=k, v_history=v)
        if self.calls is not None:
            self.calls.append((layer, int(start), self.function_for(layer, start), rows))
        out = self.runner(layer, int(start), rows, inputs)
        kv = (g["num_kv_heads"], width, g["head_dim"])
        attn = np.asarray(out["attn_out"], np.float32).reshape(width, g["hidden_size"])[:rows]
        k, v = (np.asarray(out[n], np.float32).reshape(kv)[:, :rows].transpose(1, 0, 2) for n in ("k_chunk", "v_chunk"))
        return attn, k, v


@dataclass
class BlockSidecars:
    """One non-attention block's saved packages (the MLP's: ``--graph mlp``), one per served layer, checked against
    one checkpoint. ``serve`` runs one chunk of one layer's rows through its function ``c<C>`` (rows independent, no
    history), evaluated from disk with NumPy, or by ``runner`` (``CoreMLBlockRunner``: Core ML on a Mac) when one is
    set; ``calls``: when a list, every served chunk is appended as (layer, rows)."""

    directory: Path
    design: Design
    packages: dict[int, Path]
    chunk: int
    metadata: dict[int, SidecarMetadata] = field(default_factory=dict)
    calls: list | None = None
    keep_open: int = 2
    runner: Callable[[int, np.ndarray], dict] | None = None  # (layer, hidden [C, D] fp16) -> outputs; None: NumPy
    _opened: dict = field(default_factory=dict, repr=False)

    def serve(self, layer: int, rows: np.ndarray) -> np.ndarray:
        """rows [r, D] (r <= C; the block's input, e.g. the MLP's post-norm rows) -> the block's (first) output
        float32 [r, n] for the r real rows (padded with zero rows to C, read back without them)."""
        return self.serve_all(layer, rows)[self.design.block.outputs[0]]

    def serve_all(self, layer: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        """rows [r, D] -> every output of the block, float32 [r, n_output] for the r real rows (``serve``)."""

        r, width = rows.shape[0], self.chunk
        if not 0 < r <= width:
            raise AnelabInputError(f"a block sidecar call takes 1..{width} rows, got {r}")
        hidden = np.zeros((width, rows.shape[1]), np.float16)
        hidden[:r] = rows
        if self.calls is not None:
            self.calls.append((int(layer), int(r)))
        if self.runner is not None:
            out = self.runner(int(layer), hidden)
        else:
            if layer not in self._opened:
                while len(self._opened) >= max(1, self.keep_open):
                    self._opened.pop(next(iter(self._opened)))
                self._opened[layer] = SavedPackage(self.packages[layer])
            out = self._opened[layer].evaluate(self.metadata[layer].functions[0], {"hidden": hidden})
        return {name: np.asarray(out[name], np.float32).reshape(width, -1)[:r] for name in self.design.block.outputs}


def open_block_sidecars(directory: str | os.PathLike, model, name: str = MLP,
                        layers: list[int] | None = None) -> BlockSidecars:  # fmt: skip
    """Check ``directory/layer_<L>.mlpackage`` of the block design ``name`` (default the MLP's) for each layer of
    ``layers`` (default: every layer that has the block) against the checkpoint (``model``: a ``ModelCheckpoint`` or an
    opened ``Checkpoint``). Refuses (one line): a missing directory or package, a package of another design or layer,
    from another checkpoint (geometry, or a digest of the block's tensors), chunk widths that differ."""
    design, checkpoint = get_design(name), _checkpoint_of(model)
    directory = Path(directory)
    if not directory.is_dir():
        raise AnelabInputError(f"{name} sidecar directory {directory} does not exist; export them into it first")
    have = design.block.layers(checkpoint)
    if not have:
        raise AnelabInputError(f"{checkpoint.path} has no layer with a --graph {name} block")
    layers = have if layers is None else sorted({int(layer) for layer in layers})
    packages, metas = {}, {}
    for layer in layers:
        if layer not in have:
            raise AnelabInputError(f"layer {layer} has no --graph {name} block; its layers: {','.join(map(str, have))}")
        path = directory / f"layer_{layer}.mlpackage"
        if not path.exists():
            raise AnelabInputError(
                f"{directory}: layer_{layer}.mlpackage is missing; export it with 'anelab export CHECKPOINT --graph {name} "
                f"--out {directory} --layers {layer}' at the same --chunk"
            )
        meta = read_sidecar_metadata(path)
        if design_of(meta, str(path)) is not design:
            raise AnelabInputError(
                f"{path} is a --graph {meta.graph} package, not --graph {name}; pass a {name} export"
            )
        if meta.layer != layer:
            raise AnelabInputError(
                f"{path} records layer {meta.layer}, not {layer}; keep each package under its own name"
            )
        require_same_geometry(meta, checkpoint.geometry, checkpoint.path)
        require_same_tensors(meta, checkpoint, design.block.digests)
        packages[layer], metas[layer] = path, meta
    widths = sorted({meta.chunk for meta in metas.values()})
    if len(widths) != 1:
        raise AnelabInputError(
            f"{directory}: the {name} packages' chunk widths differ ({', '.join(map(str, widths))}); re-export with one --chunk"
            if widths
            else f"{directory}: no {name} package was asked for"
        )
    return BlockSidecars(directory, design, packages, widths[0], metas)


def state_rows(read, start: int, chunk: int) -> dict[str, np.ndarray]:
    """The K/V a stateful call at ``start`` wrote, read back from its state: {k_chunk, v_chunk} [Hkv, chunk, d].

    read(name) -> the state array [Hkv, S, d]; position p lives in slot p mod S (S = the capacity, or a
    windowed layer's ring of ``ring_slots``, which holds at least W + C positions)."""
    out = {}
    for name, key in zip(STATE_NAMES, ("k_chunk", "v_chunk"), strict=True):
        cache = np.asarray(read(name))
        out[key] = cache[:, (int(start) + np.arange(chunk)) % cache.shape[1], :]
    return out


def _package_meta(directory: Path, layer: int):
    path = directory / f"layer_{layer}.mlpackage"
    if not path.exists():
        raise AnelabInputError(
            f"{directory}: layer_{layer}.mlpackage is missing; the sidecar arm serves every full-attention layer — "
            f"export it with 'anelab export CHECKPOINT --out {directory} --layers {layer}' at the same --chunk"
        )
    return path, read_sidecar_metadata(path)


def _check_package(path: Path, meta, layer: int, model) -> None:
    if meta.layer != layer:
        raise AnelabInputError(f"{path} records layer {meta.layer}, not {layer}; keep each package under its own name")
    require_same_geometry(meta, model.geometry, model.path)
    require_same_tensors(meta, _checkpoint_of(model))


def _checkpoint_of(model):
    """The layers' checkpoint of a whole model (``ModelCheckpoint``) or of an opened ``Checkpoint`` itself."""
    return model.checkpoint if isinstance(model, ModelCheckpoint) else model


def _attention_of(model, layer: int):
    return model.attention(layer) if isinstance(model, ModelCheckpoint) else model.layer(layer)


def open_sidecars(
    directory: str | os.PathLike, model, prompt_tokens: int, runner: SidecarRunner | None = None
) -> SidecarSet:
    """Check ``directory/layer_<L>.mlpackage`` for every full-attention layer against the checkpoint and prompt.

    ``model``: the whole model (``ModelCheckpoint``) or only its attention layers (an opened ``Checkpoint``: what
    the MLX engine needs, mlx-lm running the rest). Refuses (one line): a missing directory or package; a package
    of a design the arms do not serve (``Design.served_by_arms``); a package from another checkpoint
    (geometry, or the digest of an attention tensor — a package without digests: h0 not computing this
    checkpoint's attention on seeded rows); chunk widths that differ between packages; histories that do
    not reach the prompt's chunk starts. ``runner`` serves the calls (default ``numpy_runner``: the saved
    programs evaluated with NumPy).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise AnelabInputError(f"sidecar directory {directory} does not exist; export the sidecars into it first")
    packages, chunks, histories, undigested, metas = {}, {}, {}, [], {}
    for layer in model.geometry.full_attention_layers:
        path, meta = _package_meta(directory, layer)
        design_of(meta, str(path)).require_arms(str(path))  # the design first: before anything else is asked
        _check_package(path, meta, layer, model)
        _check_rope_table(path, meta.coverage, layer, model, int(prompt_tokens))
        packages[layer], chunks[layer], histories[layer], metas[layer] = path, meta.chunk, set(meta.histories), meta
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
        if missing and metas[layer].state_capacity is not None:
            raise AnelabInputError(
                f"layer_{layer}.mlpackage holds {metas[layer].state_capacity} positions in its state; a {prompt_tokens}-"
                f"token prompt in chunks of {chunk} needs {starts[-1] + chunk}: re-export with --capacity {starts[-1] + chunk}"
            )
        if missing:
            raise AnelabInputError(
                f"layer_{layer}.mlpackage lacks function h{missing[0]} for a {prompt_tokens}-token prompt in chunks of "
                f"{chunk}; re-export with --histories reaching {starts[-1]} or shorten the prompt"
            )
    sidecars = SidecarSet(directory, packages, chunk, metadata=metas)
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

    g, c = model.geometry, sidecars.chunk
    rows = np.random.default_rng([layer, c]).standard_normal((c, g.hidden_size)).astype(np.float16)
    mask = causal(c, 0)
    got = evaluate(sidecars.packages[layer], function_name(0), {"hidden": rows, "mask": mask})["attn_out"]
    empty = np.zeros((0, g.num_kv_heads, g.head_dim), np.float32)
    want = reference.attention_block(
        rows, empty, empty, mask.astype(np.float32), _attention_of(model, layer), g, rope_coverage=rope_coverage
    ).attn_out
    if relative_error(got, want) > RELATIVE_ERROR_THRESHOLD:
        raise AnelabInputError(
            f"{sidecars.packages[layer]} does not compute layer {layer} of {model.path} "
            f"(h0 is {relative_error(got, want):.0%} off its reference); export the sidecars from this checkpoint"
        )


def numpy_runner(sidecars: SidecarSet, keep_open: int = 1) -> SidecarRunner:
    """Serve sidecar calls by evaluating the saved programs with NumPy (fp16 storage emulated; any OS).

    ``keep_open``: packages held open at once (1 suits a layer-major prefill, which opens each once; a
    chunk-major one, mlx-lm's order, keeps every layer's open). A stateful layer's state is kept between its
    calls (a fresh one at start 0) and the chunk's K/V read back from it."""

    opened: dict[int, SavedPackage] = {}
    states: dict[int, dict] = {}

    def run(layer: int, start: int, valid_rows: int, inputs: dict) -> dict:
        if layer not in opened:
            while len(opened) >= max(1, keep_open):
                opened.pop(next(iter(opened)))
            opened[layer] = SavedPackage(sidecars.packages[layer])
        function = sidecars.function_for(layer, start)
        if sidecars.takes_history(layer):
            return evaluate(opened[layer], function, inputs)
        if start == 0 or layer not in states:
            states[layer] = new_state(opened[layer], function)
        out = evaluate_with_state(opened[layer], function, inputs, states[layer])
        return {**out, **state_rows(states[layer].__getitem__, int(inputs["start"][0]), sidecars.chunk)}

    run.forkable = (
        True  # keeps nothing its caller reads: serves the same in a forked process (arms.arm_runs.arm_groups)
    )
    return run


@dataclass
class CoreMLTiming:
    """What a Core ML runner spent, on its clock: each function's load (first use in this process), and per
    served call the wall time of ``Sidecar.predict`` and Core ML's own predict duration (None where the runtime
    does not report it: the wall time then counts as predict)."""

    loads: dict[tuple[int, str], float] = field(default_factory=dict)  # (layer, function) -> seconds
    predict_wall_s: list[float] = field(default_factory=list)
    core_ml_predict_s: list[float | None] = field(default_factory=list)
    state_read_s: float = 0.0

    def reset_calls(self) -> None:
        self.predict_wall_s, self.core_ml_predict_s, self.state_read_s = [], [], 0.0

    @property
    def predict_s(self) -> float:
        """Core ML's own predict seconds (the wall time of a call whose own duration is not reported)."""
        return sum(own if own is not None else wall for wall, own in zip(self.predict_wall_s, self.core_ml_predict_s))

    @property
    def marshalling_s(self) -> float:
        """Seconds outside Core ML's prediction inside the calls: input checks and conversions, output copies,
        and reading a stateful layer's K/V back from its state."""
        return sum(self.predict_wall_s) - self.predict_s + self.state_read_s


class CoreMLBlockRunner:
    """Serve a block's chunks (``BlockSidecars.runner``) through Core ML: one opened sidecar per layer, its one function
    ``c<C>`` fed hidden [C, D] (fp16, handed to Core ML as a new writable fp32 array: ``prepare_inputs``) -> every
    output of the block [C, n] float32; each call timed on ``clock`` into ``timing`` (shared with the attention's
    runner, so a run's Core ML seconds are one sum). ``label``: the loads' prefix (``mlp:c8``)."""

    def __init__(self, block: BlockSidecars, *, compute_units: str, runtime, clock, timing: CoreMLTiming):
        self.block, self.clock, self.timing, self.label = block, clock, timing, block.design.block.kind
        self.opened = {
            layer: open_sidecar(pkg, compute_units=compute_units, chunk=block.chunk, runtime=runtime)
            for layer, pkg in block.packages.items()
        }

    def __call__(self, layer: int, hidden: np.ndarray) -> dict:
        sidecar = self.opened[layer]
        t0 = self.clock()
        out = sidecar.predict(0, {"hidden": hidden})  # a block's one function: the start-0 (history-free) call
        self.timing.predict_wall_s.append(self.clock() - t0)
        self.timing.core_ml_predict_s.append(sidecar.runtime.predict_duration_s(sidecar.handle_for(0)))
        missing = [name for name in self.block.design.block.outputs if name not in out]
        if missing:
            raise AnelabInputError(f"{sidecar.package}: Core ML returned no output {missing[0]!r}; re-export it")
        return out


class CoreMLRunner:
    """Serve sidecar calls through Core ML (``anelab.runtimes``): one opened sidecar per layer, each function
    loaded on first use (``load_all`` pays those loads up front, timed), a stateful layer's state kept between
    its calls and read back; every call timed on ``clock`` (``timing``). The set's block sidecars (``mlp``, ``gdn``)
    are served through Core ML too (``CoreMLBlockRunner``, installed as their runner), timed on the same clock."""

    def __init__(self, sidecars: SidecarSet, *, compute_units: str = "cpu_and_ne", runtime=None, clock=None):

        self.sidecars, self.clock, self.timing = sidecars, clock or time.perf_counter, CoreMLTiming()
        self.opened = {
            layer: open_sidecar(pkg, compute_units=compute_units, chunk=sidecars.chunk, runtime=runtime)
            for layer, pkg in sidecars.packages.items()
        }
        self.blocks = []
        for block in (sidecars.mlp, sidecars.gdn):
            if block is not None:
                block.runner = CoreMLBlockRunner(block, compute_units=compute_units, runtime=runtime,
                                                 clock=self.clock, timing=self.timing)  # fmt: skip
                self.blocks.append(block.runner)

    def _to_load(self, prompt_tokens: int) -> list[tuple[int, object, int, str]]:
        """(layer, sidecar, start, load key) of every function a prompt visits not loaded yet; a block's key is
        prefixed by its kind (``mlp:c8``): its layer's attention may be stateful, whose function is ``c8`` too."""
        starts = chunk_starts(int(prompt_tokens), self.sidecars.chunk)
        wanted = []
        for layer, sidecar in self.opened.items():
            for start in starts:
                name = sidecar.function_for(start)
                if (layer, name) not in self.timing.loads and name not in sidecar.loaded:
                    wanted.append((layer, sidecar, start, name))
        for runner in self.blocks:
            for layer, sidecar in runner.opened.items():
                name = sidecar.function_for(0)
                if (layer, f"{runner.label}:{name}") not in self.timing.loads and name not in sidecar.loaded:
                    wanted.append((layer, sidecar, 0, f"{runner.label}:{name}"))
        return list({(layer, name): (layer, s, start, name) for layer, s, start, name in wanted}.values())

    def prepare(self, prompt_tokens: int) -> None:
        """What ``load_all`` needs done before its clocks, paid here: the process's Core ML first use, and each
        function's Neural Engine compile survived once in a child (``CoreMLRuntime.preflight``, a subprocess)."""

        every = [*self.opened.values(), *(s for runner in self.blocks for s in runner.opened.values())]
        for runtime, units in {(s.runtime, s.compute_units) for s in every}:
            runtime.prepare_process(units)
        for _, sidecar, start, _ in self._to_load(prompt_tokens):
            name = sidecar.function_for(start)
            runtime, units = sidecar.runtime, sidecar.compute_units
            if units in NEURAL_ENGINE_UNITS and not runtime.is_child:
                runtime.preflight(sidecar.package, name, units, PREFLIGHT_LOAD_STEPS)
        self.prepared = int(prompt_tokens)

    def load_all(self, prompt_tokens: int) -> dict[tuple[int, str], float]:
        """Load every function a ``prompt_tokens`` prompt visits, layer by layer (seconds per (layer, function)),
        after ``prepare`` (called here unless it ran for this prompt): the timed load is the load alone."""
        if getattr(self, "prepared", None) != int(prompt_tokens):
            self.prepare(prompt_tokens)
        for layer, sidecar, start, name in self._to_load(prompt_tokens):
            t0 = self.clock()
            sidecar.handle_for(start)
            self.timing.loads[(layer, name)] = self.clock() - t0
        return self.timing.loads

    def __call__(self, layer: int, start: int, valid_rows: int, inputs: dict) -> dict:
        sidecar = self.opened[layer]
        if sidecar.stateful and start == 0:
            sidecar.reset_state()
        t0 = self.clock()
        out = sidecar.predict(start, inputs, valid_rows)
        self.timing.predict_wall_s.append(self.clock() - t0)
        self.timing.core_ml_predict_s.append(sidecar.runtime.predict_duration_s(sidecar.handle_for(start, valid_rows)))
        if sidecar.stateful:
            t0 = self.clock()
            out = {**out, **state_rows(sidecar.state.read_state, start, self.sidecars.chunk)}
            self.timing.state_read_s += self.clock() - t0
        return out


def runtime_runner(sidecars: SidecarSet, *, compute_units: str = "cpu_and_ne", runtime=None) -> SidecarRunner:
    """Serve sidecar calls through Core ML (``anelab.runtimes``): one opened sidecar per layer, functions loaded lazily."""
    return CoreMLRunner(sidecars, compute_units=compute_units, runtime=runtime)
