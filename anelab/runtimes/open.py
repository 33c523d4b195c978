"""Opening a sidecar for use: every refusal happens before anything is loaded.

A request the sidecar cannot serve must be refused up front (and fall back to the GPU path), never
die at load time (ANE prefill research seed, "Wide coverage on this geometry"). ``open_sidecar``
reads only the package metadata and refuses:

- a package without ``aneCompileVerified: true`` when the compute units ask for the Neural Engine;
- a chunk width different from the package's (the configured prefill chunk must equal the width);
- a prompt that needs a history the package does not have (beyond coverage = max(histories) + chunk);
- for a sparse-indexed model: a package without ``selectionFolded: true`` (the fold contract), and a
  chunk past the dense-exact window with no selection ("refuses to attend densely": a causal mask
  there attends to keys the model's indexer drops).

- a package whose design (``anelab.sidecar.designs``) is unknown or whose metadata lacks what that
  design needs to be opened.

Functions are then loaded lazily through the runtime (from the package's compiled copy), named by
the package's design: one ``h<s>`` per chunk start s, or, for a stateful design (functions ``c<C>`` /
``c1``, K/V in Core ML state), one function served through one state shared by its functions:
``predict`` runs the prefill chunks through ``c<C>`` (passing the state and the ``start`` input),
``decode`` the following rows through ``c1`` on the same state (refused when the package has no
``c1``, or where ``anelab doctor --probe`` found that one state does not serve two functions'
handles), ``reset_state`` starts a new prompt. A design whose package takes no mask input
(stateful-tiled, causal mask mode) is fed none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.geometry import chunk_starts
from anelab.core.masks import MASKED, causal, dense_exact_window
from anelab.runtimes.coreml.assumptions import (
    FRESH_STATE_ZEROED,
    INT32_INPUTS_ACCEPTED,
    STATE_SHARED_BY_FUNCTIONS,
    STATEFUL_PREDICTS_STABLE,
)
from anelab.runtimes.coreml.coreml_runtime import default_runtime
from anelab.runtimes.interface import NEURAL_ENGINE_UNITS, CoreMLRuntime, check_compute_units, prepare_inputs
from anelab.sidecar.designs import DENSE, Design, design_of
from anelab.sidecar.format import SidecarMetadata, read_sidecar_metadata
from anelab.sidecar.prompt import stateful_mask


def _indexer_window(meta: SidecarMetadata, where: str) -> int:
    indexer = meta.selection_indexer or {}
    try:
        return dense_exact_window(int(indexer["kept_blocks"]), int(indexer["compress_ratio"]))
    except (KeyError, TypeError, ValueError):
        raise AnelabInputError(
            f"{where}: selectionIndexer metadata lacks kept_blocks / compress_ratio; re-export the sidecar "
            f"with the indexer parameters"
        ) from None


@dataclass
class Sidecar:
    """An opened sidecar package: metadata checked, functions loaded on first use.

    ``dense_exact_window`` is set for a sparse-indexed model (keys a row may see before the causal
    mask stops matching the indexer's selection); ``None`` for a dense model.
    """

    package: Path
    metadata: SidecarMetadata
    compute_units: str
    runtime: CoreMLRuntime
    sparse_indexed: bool = False
    selection: Any = None
    dense_exact_window: int | None = None
    _handles: dict = field(default_factory=dict, repr=False)
    _state: Any = field(default=None, repr=False)
    _state_made_by: str | None = field(default=None, repr=False)

    @property
    def design(self) -> Design:
        return design_of(self.metadata, str(self.package))

    @property
    def stateful(self) -> bool:
        """K/V in Core ML state: one state carried between calls, a ``start`` input."""
        return self.design.stateful

    @property
    def takes_mask(self) -> bool:
        """Whether the package's functions take a ``mask`` input (a causal-only stateful-tiled one does not)."""
        return self.design.mask_input(self.metadata)

    @property
    def chunk(self) -> int:
        return self.metadata.chunk

    @property
    def coverage(self) -> int:
        return self.metadata.coverage

    @property
    def sliding_window(self) -> int | None:
        """The layer's sliding window in tokens (the package's ``slidingWindow``; None: full attention)."""
        return self.metadata.sliding_window

    def mask_for(self, start: int, valid_rows: int | None = None) -> np.ndarray:
        """The causal mask (within the sliding window, if the layer has one) the chunk at ``start``
        is fed when its caller has no selection to fold: fp16 [C, start + C], or [C, capacity] for a
        stateful sidecar. A sparse-indexed model folds its selection into this mask."""
        rows = self.chunk if valid_rows is None else int(valid_rows)
        if self.stateful:
            return stateful_mask(self.chunk, int(start), self.metadata.state_capacity, self.sliding_window)
        return causal(self.chunk, int(start), valid_rows=rows, window=self.sliding_window)

    def _refuse_keys_outside_the_window(self, start: int, mask: np.ndarray, widest: np.ndarray | None = None) -> None:
        """A windowed layer's mask must hide every key outside its window: a mask that shows one would
        silently compute full attention where the model slides. ``widest``: the widest allowed mask
        (default ``mask_for(start)``)."""
        if self.sliding_window is None:
            return
        allowed = (self.mask_for(start) if widest is None else widest) > MASKED / 2
        visible = np.asarray(mask, dtype=np.float32) > MASKED / 2
        if visible.shape != allowed.shape:
            raise AnelabInputError(f"mask must have shape {list(allowed.shape)}, got {list(visible.shape)}")
        outside = visible & ~allowed
        if outside.any():
            row, key = (int(x[0]) for x in np.nonzero(outside))
            raise AnelabInputError(
                f"{self.package}: the mask shows key {key} to row {row} of the chunk at {start}, outside the layer's "
                f"sliding window of {self.sliding_window} tokens; build it with Sidecar.mask_for (or fold into it)"
            )

    @property
    def loaded(self) -> list[str]:
        """Functions loaded so far."""
        return list(self._handles)

    def function_for(self, start: int, valid_rows: int | None = None) -> str:
        """The function ``h<start>`` that serves the chunk starting at ``start`` (nothing is loaded).

        ``valid_rows``: real rows of a partial chunk (default: a full chunk). Refuses a start that is
        not a multiple of the chunk, a history the package lacks, and — for a sparse-indexed model
        opened without a selection — a chunk whose rows see more keys than the dense-exact window.
        """
        start = int(start)
        rows = self.chunk if valid_rows is None else int(valid_rows)
        if not 0 < rows <= self.chunk:
            raise AnelabInputError(f"valid_rows must be in 1..{self.chunk}, got {valid_rows}")
        if start < 0 or start % self.chunk:
            raise AnelabInputError(f"chunk start {start} is not a multiple of the sidecar's chunk {self.chunk}")
        if start not in self.metadata.histories:
            raise AnelabInputError(
                f"{self.package}: a chunk starting at {start} needs history {start}, but the package has histories "
                f"{','.join(map(str, self.metadata.histories))} (coverage {self.coverage} tokens); "
                f"re-export with --histories reaching {start} or keep this prompt on the GPU"
            )
        self._refuse_dense_past_window(start + rows)
        return self.design.function_for(self.chunk, start)  # stateful: c<C>, the history lives in the state

    def _refuse_dense_past_window(self, keys_seen: int) -> None:
        if self.sparse_indexed and self.selection is None and keys_seen > self.dense_exact_window:
            raise AnelabInputError(
                f"{self.package}: refusing to attend densely: rows see up to {keys_seen} keys, past the dense-exact "
                f"window of {self.dense_exact_window}, and no selection was given; pass the indexer's selection "
                f"(keep_indices / keep_counts) so it is folded into the mask"
            )

    def handle_for(self, start: int, valid_rows: int | None = None):
        """The loaded function for the chunk at ``start`` (loaded through the runtime on first use)."""
        name = self.function_for(start, valid_rows)
        if name not in self._handles:
            self._handles[name] = self.runtime.load(self.package, name, self.compute_units)
        return self._handles[name]

    @property
    def state(self) -> Any:
        """A stateful sidecar's current state (``None`` before the first predict or after ``reset_state``)."""
        return self._state

    def reset_state(self) -> None:
        """A stateful sidecar: start a new prompt (a fresh state at the next predict)."""
        self._state = self._state_made_by = None

    def _complete_inputs(self, start: int, inputs: dict, valid_rows: int | None) -> dict:
        """The inputs this package's design declares: the default mask, the ``start`` of a stateful call."""
        if self.takes_mask:
            if "mask" not in inputs:
                inputs["mask"] = self.mask_for(start, valid_rows)
            self._refuse_keys_outside_the_window(start, inputs["mask"])
        elif "mask" in inputs:
            raise AnelabInputError(
                f"{self.package}: this --graph {self.design.name} package takes no mask input (mask mode "
                f"{self.metadata.mask_mode}: causality in-graph); drop the mask or export with --mask-mode additive"
            )
        if self.stateful:
            given = inputs.setdefault("start", np.array([start], np.int32))
            if int(np.asarray(given).reshape(-1)[0]) != start:
                raise AnelabInputError(f"the start input {given} differs from the chunk start {start}; pass one start")
        return inputs

    def predict(self, start: int, inputs: dict, valid_rows: int | None = None) -> dict:
        """Run the chunk at ``start``.

        Dense/tiled: inputs hidden [C, D], k_history / v_history [start, Hkv, d], mask [C, start + C].
        Stateful: hidden [C, D], start [1] int32 (added when missing), mask [C, capacity] when the
        package takes one; the sidecar's state is passed (created with the first call, shared by
        ``c<C>`` and ``c1``). Without a ``mask`` the chunk is fed ``mask_for(start, valid_rows)``; a
        windowed layer's mask is refused when it shows a key outside the window, and a mask given to a
        package without a mask input is refused (its causality is in-graph).
        """

        inputs = self._complete_inputs(int(start), dict(inputs), valid_rows)
        handle = self.handle_for(start, valid_rows)
        if not self.stateful:
            return self.runtime.predict(handle, prepare_inputs(inputs))
        return self._predict_on_state(self.function_for(start, valid_rows), handle, inputs)

    def _predict_on_state(self, name: str, handle, inputs: dict) -> dict:

        if self._state is None:
            self._state, self._state_made_by = self.runtime.make_state(handle), name
        elif self._state_made_by != name:  # c1 on the state c<C> made: Core ML documents no such sharing
            self.runtime.require_assumptions(STATE_SHARED_BY_FUNCTIONS, compute_units=self.compute_units)
        return self.runtime.predict(handle, prepare_inputs(inputs), state=self._state)

    def decode_function(self) -> str:
        """The decode function ``c1`` of a stateful sidecar exported with decode (nothing is loaded)."""
        functions = self.metadata.state_functions or []
        name = self.design.function_for(1, 0) if self.stateful else None  # a stateful design's width-1 function
        if name is None or name not in functions:
            raise AnelabInputError(
                f"{self.package}: no decode function c1 (graph {self.metadata.graph or DENSE}, functions "
                f"{','.join(functions) or 'h<H>'}); export a stateful sidecar with --decode, or keep decode on the GPU"
            )
        return name

    def decode(self, position: int, inputs: dict) -> dict:
        """Run one decode row at ``position`` through ``c1`` on the state the prefill left.

        inputs: hidden [1, D]; ``start`` [1] int32 and ``mask`` [1, capacity] default to ``position``
        and the causal (windowed) mask of that row. Refuses before the first prefill (no state), a
        position past the state's capacity, and a package without ``c1``.
        """
        name = self.decode_function()
        position, capacity = int(position), self.metadata.state_capacity
        if not 0 <= position < capacity:
            raise AnelabInputError(
                f"{self.package}: decode position {position} is outside the state's 0..{capacity - 1}"
            )
        if self._state is None:
            raise AnelabInputError(
                f"{self.package}: decode needs the prompt's K/V in the state; run predict (the prefill) first"
            )
        inputs = dict(inputs)
        inputs.setdefault("start", np.array([position], np.int32))
        if self.takes_mask:
            widest = stateful_mask(1, position, capacity, self.sliding_window)
            inputs.setdefault("mask", widest)
            self._refuse_keys_outside_the_window(position, inputs["mask"], widest)
        elif "mask" in inputs:
            raise AnelabInputError(
                f"{self.package}: this package takes no mask input (causality in-graph); drop the mask"
            )
        if name not in self._handles:
            self._handles[name] = self.runtime.load(self.package, name, self.compute_units)
        return self._predict_on_state(name, self._handles[name], inputs)


def open_sidecar(
    pkg: str | os.PathLike,
    *,
    compute_units: str,
    chunk: int,
    prompt_tokens: int | None = None,
    sparse_indexed: bool = False,
    selection: Any = None,
    runtime: CoreMLRuntime | None = None,
) -> Sidecar:
    """Check a sidecar against a request and return it unloaded; refuse (one line) what it cannot serve.

    pkg:            a ``layer_<L>.mlpackage`` written by ``anelab export``.
    compute_units:  ``cpu_only`` | ``cpu_and_gpu`` | ``cpu_and_ne`` | ``all``.
    chunk:          the configured prefill chunk width; must equal the package's.
    prompt_tokens:  when given, every chunk start of the prompt must have its history in the package.
    sparse_indexed: the model chooses keys with a sparse indexer (e.g. Qwen 3.8's QSA).
    selection:      the indexer's selection source (e.g. an ``anelab.core.selection.Selection``), or ``None``.
    runtime:        a ``CoreMLRuntime`` (default: this machine's); it must be available.
    """
    check_compute_units(compute_units)
    pkg = Path(pkg)
    meta = read_sidecar_metadata(pkg)
    design_of(meta, str(pkg))  # an unknown design, or metadata lacking what it needs, is refused here
    if compute_units in NEURAL_ENGINE_UNITS and not meta.ane_verified:
        raise AnelabInputError(
            f"{pkg}: not verified for the Neural Engine (aneCompileVerified is false; its export recorded: "
            f"{meta.ane_reason or 'no reason'}); export it with the ANE gate ('anelab export' gates it where Core ML "
            f"runs), or use compute units cpu_only / cpu_and_gpu"
        )
    if int(chunk) != meta.chunk:
        raise AnelabInputError(
            f"{pkg}: the prefill chunk is {chunk} but the sidecar's width is {meta.chunk}; configure chunk {meta.chunk} "
            f"or export a sidecar with --chunk {chunk}"
        )
    window = None
    if sparse_indexed:
        if not meta.selection_folded:
            raise AnelabInputError(
                f"{pkg}: the model is sparse-indexed but the sidecar does not record selectionFolded: true "
                f"(the contract that its mask carries the indexer's selection); re-export it for the sparse-indexed model"
            )
        window = _indexer_window(meta, str(pkg))
        indexer = meta.selection_indexer
        for name in ("kept_blocks", "compress_ratio"):
            given = getattr(selection, name, None)
            if given is not None and int(given) != int(indexer[name]):
                raise AnelabInputError(
                    f"{pkg}: the selection's {name} is {given} but the sidecar records {indexer[name]}; "
                    f"use the indexer the sidecar was exported for"
                )
    sidecar = Sidecar(
        package=pkg,
        metadata=meta,
        compute_units=compute_units,
        runtime=None,  # type: ignore[arg-type]
        sparse_indexed=sparse_indexed,
        selection=selection,
        dense_exact_window=window,
    )
    if prompt_tokens is not None:
        starts = chunk_starts(int(prompt_tokens), meta.chunk)
        missing = [h for h in starts if h not in meta.histories]
        if missing:
            raise AnelabInputError(
                f"{pkg}: a {prompt_tokens}-token prompt needs histories up to {starts[-1]} (coverage {starts[-1] + meta.chunk}), "
                f"but the package covers {meta.coverage} tokens (histories {','.join(map(str, meta.histories))}; "
                f"missing {','.join(map(str, missing))}); keep this prompt on the GPU or re-export with more --histories"
            )
        last_rows = int(prompt_tokens) - starts[-1]
        for start in starts:
            sidecar.function_for(start, last_rows if start == starts[-1] else None)
    runtime = runtime if runtime is not None else default_runtime()
    runtime.require_available()
    runtime.require_assumptions(
        *assumptions_relied_on(meta, sidecar.stateful, compute_units), compute_units=compute_units
    )
    sidecar.runtime = runtime
    return sidecar


def assumptions_relied_on(meta: SidecarMetadata, stateful: bool, compute_units: str) -> tuple[str, ...]:
    """The probe rows a sidecar's predicts rely on, asked for when it is opened (before any clock): a stateful one's
    int32 start and zero-filled fresh state; a palettized stateful one's surviving many Neural Engine predicts
    (apple/coremltools#2716)."""
    if not stateful:
        return ()
    needed = (INT32_INPUTS_ACCEPTED, FRESH_STATE_ZEROED)
    if str(meta.weights).startswith("palettize") and compute_units in NEURAL_ENGINE_UNITS:
        needed += (STATEFUL_PREDICTS_STABLE,)
    return needed
