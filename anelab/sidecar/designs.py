"""The sidecar designs — dense, tiled, stateful, stateful-tiled — each declared once, in one registry.

A :class:`Design` is everything the rest of anelab may ask about one kind of sidecar: its name (the
one vocabulary of ``--graph``, ``--design``, the package's ``anelab.graph``, the planner, notebooks
and records), its options (one frozen, validated :class:`SidecarOptions`), how a chunk start maps to
a function name, the builder of each function's MIL program, the prompt driver, the verification and
the negative controls it declares, what opening it needs (a state, a mask input), whether the
whole-model arms serve it, and what the planner prices. export, verify, the prompt driver,
``open_sidecar``, the arms, the planner and the CLI ask the design; nothing outside this module
names a design (``tests/sidecar/test_designs.py`` walks the tree for the names).

- ``dense``: one function ``h<s>`` per chunk start s (the research seed's design), K/V history an
  input, all ``s + C`` keys scored at once;
- ``tiled``: the same functions, online softmax over key tiles of ``key_tile`` positions;
- ``stateful``: one function ``c<C>`` (and ``c1`` for decode) per layer, K/V in Core ML state of
  ``capacity`` slots, every slot scored at once;
- ``stateful-tiled``: the same functions, attention over key tiles of ``key_tile`` slots and query
  tiles of ``query_tile`` rows, causality in-graph (``mask_mode`` ``causal``) or plus a mask input
  (``additive``, which also carries a folded selection). A sliding-window layer keeps a ring of about
  W + C slots instead (its ``layer_layout``: ``stateful_tiled.window_ring``), its window in-graph.

Beside attention, the blocks without history (``Design.block``: a ``BlockReader`` says which layers have the block,
how its weights and digests are read; verified by ``sidecar.checks.verify_blocks``; not priced by the planner yet):

- ``mlp``: one function ``c<C>`` per layer, ``mlp_out = down(act(gate(x)) * up(x))`` (``graphs.mlp``);
- ``gdn-proj``: one function ``c<C>`` per linear-attention layer of a hybrid, its Gated DeltaNet input
  projections qkv, z, b, a (``graphs.gdn_projections``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from anelab.checkpoints import blocks as checkpoint_blocks
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry, chunk_starts, coverage, score_bytes, validate_chunk_and_histories
from anelab.core.limits import MAX_FUNCTIONS, MAX_POSITIONS, require_at_most, require_memory
from anelab.core.masks import MASKED, dense_exact_window
from anelab.core.weights import AttentionWeights
from anelab.sidecar import drivers
from anelab.sidecar.block_designs import BlockReader, build_gdn_projections, build_mlp, no_prompt_driver
from anelab.sidecar.checks import stateful_cases, verify_blocks, verify_cases
from anelab.sidecar.format import (
    MAX_STATE_CAPACITY,
    STATE_CAPACITY_META,
    STATE_FUNCTIONS_META,
    SidecarMetadata,
    function_name,
    stateful_function_name,
)
from anelab.sidecar.graphs.common import SidecarShape
from anelab.sidecar.graphs.dense import build_dense_program
from anelab.sidecar.graphs.gdn_projections import GDN_PROJECTIONS
from anelab.sidecar.graphs.mlp import MLP_OUTPUT, MLP_PROJECTIONS
from anelab.sidecar.graphs.stateful import build_stateful_program
from anelab.sidecar.graphs.stateful_tiled import (
    MAX_TILED_STATE_CAPACITY,
    build_stateful_tiled_program,
    validate_mask_mode,
    validate_tiles,
    window_ring,
)
from anelab.sidecar.graphs.tiled import build_tiled_program, validate_key_tile
from anelab.sidecar.quantize import validate_weights_mode

# the designs' names: written here and nowhere else (tests/sidecar/test_designs.py)
DENSE, TILED, STATEFUL, STATEFUL_TILED = "dense", "tiled", "stateful", "stateful-tiled"
MLP, GDN_PROJ = "mlp", "gdn-proj"  # the non-attention blocks' designs (one chunk-shaped function c<C> per layer)

# Non-const MIL ops of one function as built (before coremltools' passes), counted on built programs
# (tests/sidecar/test_stateful_tiled.py checks the formulas): a stateful-tiled function has a fixed part
# (projections, RoPE, cache update, output) and ~25 ops per (query tile, key tile) pair.
OPS_STATEFUL_TILED_BASE = 100
OPS_PER_TILE_PAIR = 25
OPS_STATEFUL = 82
OPS_PER_HISTORY = 92

# the flags each option comes from, as a user types them (for one-line refusals)
FLAGS = {
    "key_tile": "--tile",
    "query_tile": "--query-tile",
    "capacity": "--capacity",
    "decode": "--decode",
    "mask_mode": "--mask-mode",
    "selection": "the selection contract (--selection-kept-blocks / --selection-compress-ratio)",
}


@dataclass(frozen=True)
class SidecarOptions:
    """One export's options, validated against its design and the checkpoint's geometry.

    ``histories``: the chunk starts the package serves (per-history designs: one function each;
    stateful designs: the starts 0, C, ... of a prefill that fills the cache). ``key_tile``: key
    positions per tile (tiled) or cache slots per tile (stateful-tiled). ``selection``: what the
    package records about a sparse indexer (``selectionIndexer``), or None for a dense model.
    """

    chunk: int
    histories: tuple[int, ...]
    weights: str = "fp16"
    key_tile: int | None = None
    query_tile: int | None = None
    capacity: int | None = None
    mask_mode: str | None = None
    decode: bool = False
    selection: dict | None = field(default=None, hash=False)
    tile_requested: bool = False  # --tile given (a windowed layer's ring then rounds up to whole tiles of it)

    @property
    def coverage(self) -> int:
        return coverage(list(self.histories), self.chunk)

    @property
    def widths(self) -> list[int]:
        """Chunk widths of a stateful design's functions: the chunk, and 1 for decode."""
        return [self.chunk] + ([1] if self.decode and self.chunk != 1 else [])


@dataclass(frozen=True)
class PlannerPricing:
    """What the planner prices for a design.

    ``one_function_per_layer``: the design loads one function per layer (False: one per chunk start
    visited, each priced by the planner's per-history plan). ``call``, for one function per layer:
    (heads, chunk, capacity, key_tile, query_tile) -> (key tile, query tile, score arena bytes of one
    call). ``ops``: (chunk, capacity, key_tile, query_tile) -> non-const MIL ops of one function.
    ``whole_key_tiles``: a default capacity is rounded up to whole key tiles too. ``window_ring``: on
    sliding-window layers, (window, chunk, key_tile) -> (ring slots, key tile) each call scores instead
    of the capacity (None: the design scores the whole history there too).
    """

    one_function_per_layer: bool
    call: Callable[[int, int, int, int | None, int | None], tuple[int | None, int | None, int]] | None
    ops: Callable[[int, int | None, int | None, int | None], int]
    whole_key_tiles: bool = False
    window_ring: Callable[[int, int, int | None], tuple[int, int]] | None = None


def _block_options(design: Design, geometry: AttentionGeometry, chunk: int, histories, given: dict) -> SidecarOptions:
    """A block design's options: the chunk only (its one function has no history)."""
    if histories is not None:
        raise AnelabInputError(
            f"--histories applies to the attention designs; a --graph {design.name} function has no history "
            "(one c<C> per layer): drop it"
        )
    return SidecarOptions(chunk, (0,))


def _no_state_options(
    design: Design, geometry: AttentionGeometry, chunk: int, histories, given: dict
) -> SidecarOptions:
    """A per-history design's options: the histories are required (multiples of the chunk)."""
    if histories is None:
        raise AnelabInputError(
            f"export: --histories is required for --graph {design.name} (e.g. --histories 0,C,2C); "
            "only a stateful design goes without"
        )
    key_tile = validate_key_tile(chunk if given.get("key_tile") is None else given["key_tile"], chunk)
    return SidecarOptions(
        chunk,
        tuple(validate_chunk_and_histories(chunk, list(histories))),
        key_tile=key_tile if "key_tile" in design.option_names else None,
    )


def validate_state_capacity(
    capacity: int | None, chunk: int, histories: list[int] | None, *, limit: int = MAX_STATE_CAPACITY
) -> int:
    """The stateful graph's cache slots: given, or the coverage of ``histories``; never smaller than
    that coverage, a multiple of the chunk, at most ``limit`` (MAX_STATE_CAPACITY for --graph
    stateful, whose RoPE positions pass through int16; MAX_TILED_STATE_CAPACITY for stateful-tiled)."""
    if chunk <= 0:
        raise AnelabInputError(f"--chunk must be a positive integer, got {chunk}")
    cover = coverage(validate_chunk_and_histories(chunk, list(histories)), chunk) if histories else None
    if capacity is None:
        if cover is None:
            raise AnelabInputError(
                "--graph stateful needs --capacity N (cache slots per state) or --histories to derive it"
            )
        capacity = cover
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise AnelabInputError(f"--capacity must be a positive integer, got {capacity!r}")
    if cover is not None and capacity < cover:
        raise AnelabInputError(
            f"state capacity {capacity} is smaller than the coverage {cover}; use --capacity {cover} or more"
        )
    if capacity % chunk:
        raise AnelabInputError(
            f"state capacity {capacity} is not a multiple of the chunk {chunk}; use --capacity {-(-capacity // chunk) * chunk}"
        )
    if capacity > limit:
        hint = " or --graph stateful-tiled" if limit == MAX_STATE_CAPACITY else ""
        raise AnelabInputError(
            f"state capacity {capacity} exceeds {limit} (Core ML casts RoPE gather indices to int16); "
            f"use a smaller --capacity{hint}"
        )
    return capacity


def _state_options(design: Design, geometry: AttentionGeometry, chunk: int, histories, given: dict) -> SidecarOptions:
    """A stateful design's options: capacity (default: the histories' coverage) and, when tiled,
    the key / query tiles and the mask mode."""
    capacity = validate_state_capacity(given.get("capacity"), chunk, histories, limit=design.capacity_limit)
    tiles = {}
    if "query_tile" in design.option_names:
        kt, qt = validate_tiles(given.get("key_tile"), given.get("query_tile"), chunk, capacity)
        mode = validate_mask_mode("causal" if given.get("mask_mode") is None else given["mask_mode"])
        tiles = {
            "key_tile": kt,
            "query_tile": qt,
            "mask_mode": mode,
            "tile_requested": given.get("key_tile") is not None,
        }
    return SidecarOptions(
        chunk, tuple(chunk_starts(capacity, chunk)), capacity=capacity, decode=bool(given.get("decode")), **tiles
    )


def _require_export_bounds_before(chunk: int, histories, capacity) -> None:
    """The sizes an export's flags set, bounded before the options are worked out (``anelab.core.limits``)."""
    require_at_most("--chunk", chunk, MAX_POSITIONS, "use a chunk of at most a few thousand rows")
    if histories is not None:
        require_at_most("the number of --histories (one function each)", len(histories), MAX_FUNCTIONS,
                        "export fewer histories, or a stateful design (one function per layer)")  # fmt: skip
    if isinstance(capacity, int) and not isinstance(capacity, bool):
        require_at_most("--capacity", capacity, MAX_POSITIONS, "use a smaller --capacity")


def _require_export_bounds(design: Design, geometry: AttentionGeometry, opts: SidecarOptions) -> None:
    """A package's coverage, function count and the memory one function's build holds at least (its RoPE
    tables in float64: a cos and sin pair for the chunk rows and for the history, plus a stateful design's
    table over its capacity), checked before any weight is read."""
    require_at_most("the package's coverage (positions)", opts.coverage, MAX_POSITIONS, "cover fewer positions")
    functions = len(design.function_names(opts))
    require_at_most("the package's function count", functions, MAX_FUNCTIONS, "export fewer histories")
    tables = 4 * opts.chunk + 2 * (opts.capacity or 0)
    require_memory(f"one function's RoPE tables ({tables:,} rows of {geometry.rotary_dim})",
                   tables * geometry.rotary_dim * 8, "use a smaller --chunk or capacity")  # fmt: skip


def selection_indexer_metadata(selection: dict) -> dict:
    """Validate a sparse indexer's parameters and return what the package records about it."""
    try:
        kept, ratio = int(selection["kept_blocks"]), int(selection["compress_ratio"])
    except (KeyError, TypeError, ValueError):
        raise AnelabInputError(
            "a sparse indexer needs both --selection-kept-blocks and --selection-compress-ratio"
        ) from None
    if kept <= 0 or ratio <= 0:
        raise AnelabInputError(
            f"--selection-kept-blocks and --selection-compress-ratio must be positive, got {kept} and {ratio}"
        )
    return {
        "kept_blocks": kept,
        "compress_ratio": ratio,
        "dense_exact_window": dense_exact_window(kept, ratio),
        "masked_value": float(MASKED),
    }


@dataclass(frozen=True)
class Design:
    """One sidecar design (see the module docstring). Callables take the design's validated options."""

    name: str
    summary: str
    stateful: bool  # K/V kept in Core ML state: functions c<C> (+ c1), a ``start`` input, one state per prompt
    option_names: frozenset[str]  # options beyond chunk / histories / weights this design takes
    builder: Callable[[AttentionGeometry, AttentionWeights, SidecarOptions, int], object]
    drive_prompt: Callable  # (saved, meta, hidden [P, D] fp16, fp16) -> attn_out [P, D]
    verify: Callable  # (package, the opened checkpoint or None, seed=, fp16=, functions=, precision=, evaluator=) -> VerifyReport
    # (metadata, geometry) -> the negative controls its verification declares, (function label, case):
    # a report passes only when each of them ran and failed as it must
    controls: Callable[[SidecarMetadata, AttentionGeometry], list[tuple[str, str]]]
    options_rule: Callable[..., SidecarOptions]
    capacity_limit: int | None = None
    verifies_on_device: bool = True
    takes_selection: bool = False
    served_by_arms: bool = False
    mask_input: Callable[[SidecarMetadata], bool] = lambda meta: True
    pricing: PlannerPricing | None = None
    # (options, the layer's sliding window or None) -> the layer's own metadata fields (key_tile,
    # query_tile, ring_slots) and its builder's extra arguments; refuses a layer the options cannot serve
    layer_layout: Callable[[SidecarOptions, int | None], dict] | None = None
    block: BlockReader | None = None  # a non-attention block's design (None: attention)

    # ---- options -----------------------------------------------------------------------------------------
    def options(
        self,
        geometry: AttentionGeometry,
        chunk: int,
        histories: list[int] | None,
        *,
        weights: str = "fp16",
        selection: dict | None = None,
        **given,
    ) -> SidecarOptions:
        """Validate one export's options; refuse (one line) an option this design does not take.
        ``given``: key_tile, query_tile, capacity, decode, mask_mode (None / False: not given)."""
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
            raise AnelabInputError(f"--chunk must be a positive integer, got {chunk!r}")
        unknown = [k for k in given if k not in FLAGS]
        if unknown:
            raise TypeError(f"unknown sidecar option {unknown[0]!r}")
        stray = [k for k, v in given.items() if v is not None and v is not False and k not in self.option_names]
        if selection is not None and not self.takes_selection:
            stray.append("selection")
        if stray:
            takers = [
                d.name
                for d in DESIGNS.values()
                if stray[0] in d.option_names or stray[0] == "selection" and d.takes_selection
            ]
            raise AnelabInputError(
                f"{FLAGS[stray[0]]} applies to --graph {' or '.join(takers)}, not {self.name}; drop it or change --graph"
            )
        validate_weights_mode(weights, geometry if self.block is None else None)  # a block checks its own shapes
        _require_export_bounds_before(chunk, histories, given.get("capacity"))
        opts = self.options_rule(self, geometry, chunk, histories, given)
        _require_export_bounds(self, geometry, opts)
        if selection is not None and "mask_mode" in self.option_names and opts.mask_mode != "additive":
            raise AnelabInputError(
                f"the selection contract of --graph {self.name} needs its mask input: add --mask-mode additive"
            )
        indexer = selection_indexer_metadata(selection) if selection is not None else None
        return SidecarOptions(**{**opts.__dict__, "weights": weights, "selection": indexer})

    # ---- functions -----------------------------------------------------------------------------------------
    def function_names(self, options: SidecarOptions) -> list[str]:
        """The package's function names, in merge order."""
        if self.block is not None:
            return [stateful_function_name(options.chunk)]
        if self.stateful:
            return [stateful_function_name(w) for w in options.widths]
        return [function_name(h) for h in options.histories]

    def function_for(self, chunk: int, start: int) -> str:
        """The function that serves the chunk starting at ``start``."""
        return stateful_function_name(chunk) if self.stateful or self.block is not None else function_name(start)

    def builds(
        self, geometry: AttentionGeometry, weights: AttentionWeights, options: SidecarOptions
    ) -> dict[str, Callable[[], object]]:
        """Function name -> a builder of its MIL program (built on demand: one at a time in memory)."""
        keys = options.widths if self.stateful else list(options.histories)
        if self.block is not None:
            self.block.require_compressible(options.weights, weights)
            keys = [options.chunk]
        return {
            name: (lambda key=key: self.builder(geometry, weights, options, key))
            for name, key in zip(self.function_names(options), keys, strict=True)
        }

    def metadata_fields(self, options: SidecarOptions, functions: list[str], window: int | None = None) -> dict:
        """The design's own fields of ``SidecarMetadata`` for a layer with sliding ``window`` (or None)."""
        fields = {
            "key_tile": options.key_tile,
            "query_tile": options.query_tile,
            "mask_mode": options.mask_mode,
            "state_capacity": options.capacity,
            "state_functions": list(functions) if self.stateful else None,
            "block": None if self.block is None else self.block.kind,
        }
        return {**fields, **self.layer_fields(options, window)}

    def layer_fields(self, options: SidecarOptions, window: int | None) -> dict:
        """One layer's own layout fields (a windowed layer's ring); refuses a layer the options cannot
        serve (one line). Empty for a design without a per-layer layout."""
        if self.layer_layout is None:
            return {}
        return {
            k: v for k, v in self.layer_layout(options, window).items() if k in ("key_tile", "query_tile", "ring_slots")
        }

    def check_metadata(self, meta: SidecarMetadata, where: str) -> SidecarMetadata:
        """Refuse metadata lacking what this design needs to be opened (one line)."""
        if self.stateful and (meta.state_capacity is None or not meta.state_functions):
            raise AnelabInputError(
                f"{where}: stateful sidecar metadata lacks '{STATE_CAPACITY_META}' or '{STATE_FUNCTIONS_META}'; "
                "re-export it with 'anelab export'"
            )
        return meta

    # ---- asks that must be refused in one line -------------------------------------------------------------
    def require_arms(self, where: str) -> None:
        if self.block is not None:
            raise AnelabInputError(
                f"{where} is a --graph {self.name} package, not an attention sidecar; the arms take block packages as "
                f"--mlp-sidecars (--graph {MLP}) or --gdn-sidecars (--graph {GDN_PROJ})"
            )
        if not self.served_by_arms:
            served = ", ".join(d.name for d in DESIGNS.values() if d.served_by_arms)
            raise AnelabInputError(
                f"{where} is a --graph {self.name} package; the whole-model arms thread each layer's K/V between "
                f"calls as inputs, which only --graph {served} packages take: re-export with --graph {served.split(',')[0]}"
            )

    def require_device_verify(self) -> None:
        if not self.verifies_on_device:
            raise AnelabInputError(
                f"verify on the device is not built for --graph {self.name} packages yet; verify it with NumPy "
                "(drop --compute-units)"
            )

    def require_pricing(self) -> PlannerPricing:
        if self.pricing is None:
            priced = ", ".join(d.name for d in DESIGNS.values() if d.pricing is not None)
            raise AnelabInputError(f"the planner does not price --design {self.name}; use one of: {priced}")
        return self.pricing


# ---- the four designs -------------------------------------------------------------------------------------------
def _build_dense(geometry, weights, options: SidecarOptions, history: int):
    return build_dense_program(geometry, weights, SidecarShape(options.chunk, history, options.coverage))


def _build_tiled(geometry, weights, options: SidecarOptions, history: int):
    shape = SidecarShape(options.chunk, history, options.coverage)
    return build_tiled_program(geometry, weights, shape, options.key_tile)


def _build_stateful(geometry, weights, options: SidecarOptions, width: int):
    return build_stateful_program(geometry, weights, width, options.capacity)


def _build_stateful_tiled(geometry, weights, options: SidecarOptions, width: int):
    layout = _stateful_tiled_layout(options, geometry.window_of(weights.layer))
    qt = min(layout["query_tile"], width)  # the decode function's query tile is 1
    return build_stateful_tiled_program(
        geometry,
        weights,
        width,
        options.capacity,
        layout["key_tile"],
        qt,
        options.mask_mode,
        slots=layout["ring_slots"],
    )


def _stateful_tiled_layout(options: SidecarOptions, window: int | None) -> dict:
    """A full-attention layer tiles its ``capacity`` slots (ring None); a windowed one tiles its ring of
    about W + C slots (``window_ring``: a requested key tile rounds the ring up to whole tiles of it)
    and takes no additive mask (its mask would span positions, not ring slots)."""
    if window is None:
        return {"key_tile": options.key_tile, "query_tile": options.query_tile, "ring_slots": None}
    if options.mask_mode == "additive":
        raise AnelabInputError(
            "--mask-mode additive is for full-attention layers (its mask spans the positions, not a windowed "
            "layer's ring); export the windowed layers with --mask-mode causal"
        )
    ring, key_tile = window_ring(window, options.chunk, options.key_tile if options.tile_requested else None)
    key_tile, query_tile = validate_tiles(key_tile, options.query_tile, options.chunk, ring)
    return {"key_tile": key_tile, "query_tile": query_tile, "ring_slots": ring}


def _stateful_call(heads, chunk, capacity, key_tile, query_tile):
    return None, None, score_bytes(heads, chunk, capacity)


def _stateful_tiled_call(heads, chunk, capacity, key_tile, query_tile):
    kt, qt = validate_tiles(key_tile, query_tile, chunk, capacity)
    return kt, qt, score_bytes(heads, qt, kt)


def _verify_stateful(package, checkpoint, *, seed, fp16, functions, precision, evaluator, progress=True):
    """A stateful package verifies over one whole prompt through its state (fp64 reference): no subset."""
    _refuse_function_subset(functions)
    return stateful_cases.verify_stateful_package(
        package, checkpoint, seed=seed, fp16=fp16, evaluator=evaluator, progress=progress
    )


def _verify_stateful_tiled(package, checkpoint, *, seed, fp16, functions, precision, evaluator, progress=True):
    _refuse_function_subset(functions)
    return stateful_cases.verify_stateful_tiled_package(package, checkpoint, seed=seed, fp16=fp16, progress=progress)


def _refuse_function_subset(functions) -> None:
    if functions is not None:
        raise AnelabInputError(
            "a stateful package is verified over a whole prompt through all its functions; drop the function list"
        )


def stateful_tiled_ops(chunk: int, capacity: int, key_tile: int, query_tile: int) -> int:
    """Approximate non-const MIL ops of one stateful-tiled function (see ``OPS_PER_TILE_PAIR``)."""
    return OPS_STATEFUL_TILED_BASE + OPS_PER_TILE_PAIR * (chunk // query_tile) * (capacity // key_tile)


_BLOCK = dict(
    stateful=False,
    option_names=frozenset(),
    options_rule=_block_options,
    drive_prompt=no_prompt_driver,
    verifies_on_device=False,
    mask_input=lambda meta: False,
)
_MLP_READER = BlockReader(MLP, checkpoint_blocks.mlp_layers, checkpoint_blocks.mlp_weights,
                          checkpoint_blocks.mlp_digests, MLP_PROJECTIONS, (MLP_OUTPUT,), checkpoint_blocks.mlp_source_record)  # fmt: skip
_GDN_READER = BlockReader("gdn", checkpoint_blocks.linear_attention_layers, checkpoint_blocks.gdn_projection_weights,
                          checkpoint_blocks.gdn_digests, GDN_PROJECTIONS, tuple(GDN_PROJECTIONS),
                          checkpoint_blocks.gdn_source_record)  # fmt: skip


def _block_design(name: str, summary: str, builder, reader: BlockReader, cases: verify_blocks.BlockCases) -> Design:
    """A non-attention block's design: verified by ``verify_blocks`` with its reader and cases."""
    return Design(name, summary, builder=builder, block=reader,
                  verify=functools.partial(verify_blocks.verify_block_package, reader=reader, cases=cases),
                  controls=cases.declared, **_BLOCK)  # fmt: skip


_PER_HISTORY = dict(
    stateful=False,
    options_rule=_no_state_options,
    drive_prompt=drivers.prefill_per_history,
    verify=verify_cases.verify_per_history_package,
    controls=lambda meta, geometry: verify_cases.per_history_controls(meta, geometry, meta.functions),
    takes_selection=True,
    served_by_arms=True,
)
# the arms serve a stateful design too: its state carries the K/V, read back after each call (arms.sidecars)
_STATEFUL = dict(stateful=True, options_rule=_state_options, takes_selection=False, served_by_arms=True)

DESIGNS: dict[str, Design] = {
    d.name: d
    for d in (
        Design(
            DENSE,
            "one function h<s> per chunk start s; K/V history an input; all s + C keys scored at once",
            option_names=frozenset(),
            builder=_build_dense,
            pricing=PlannerPricing(False, None, lambda c, cap, kt, qt: OPS_PER_HISTORY),
            **_PER_HISTORY,
        ),
        Design(
            TILED,
            "one function h<s> per chunk start s; online softmax over key tiles of --tile positions",
            option_names=frozenset({"key_tile"}),
            builder=_build_tiled,
            **_PER_HISTORY,
        ),
        Design(
            STATEFUL,
            "one function c<C> (+ c1) per layer; K/V in Core ML state; every slot scored at once",
            option_names=frozenset({"capacity", "decode"}),
            builder=_build_stateful,
            drive_prompt=drivers.prefill_stateful,
            verify=_verify_stateful,
            controls=stateful_cases.stateful_controls_declared,
            capacity_limit=MAX_STATE_CAPACITY,
            pricing=PlannerPricing(True, _stateful_call, lambda c, cap, kt, qt: OPS_STATEFUL),
            **_STATEFUL,
        ),
        Design(
            STATEFUL_TILED,
            "one function c<C> (+ c1) per layer; K/V in state; key tiles x query tiles, causality in-graph",
            option_names=frozenset({"capacity", "decode", "key_tile", "query_tile", "mask_mode"}),
            builder=_build_stateful_tiled,
            drive_prompt=drivers.prefill_stateful_tiled,
            verify=_verify_stateful_tiled,
            controls=stateful_cases.stateful_tiled_controls_declared,
            capacity_limit=MAX_TILED_STATE_CAPACITY,
            verifies_on_device=False,
            mask_input=lambda meta: meta.mask_mode == "additive",
            pricing=PlannerPricing(
                True, _stateful_tiled_call, stateful_tiled_ops, whole_key_tiles=True, window_ring=window_ring
            ),
            layer_layout=_stateful_tiled_layout,
            **{**_STATEFUL, "takes_selection": True},
        ),
        _block_design(
            MLP,
            "one function c<C> per layer: the MLP, down(act(gate(x)) * up(x)), the family's activation; no history",
            build_mlp,
            _MLP_READER,
            verify_blocks.MLP_CASES,
        ),
        _block_design(
            GDN_PROJ,
            "one function c<C> per linear-attention layer: its Gated DeltaNet input projections qkv, z, b, a",
            build_gdn_projections,
            _GDN_READER,
            verify_blocks.GDN_CASES,
        ),
    )
}
ATTENTION_DESIGNS = tuple(name for name, d in DESIGNS.items() if d.block is None)
BLOCK_DESIGNS = tuple(name for name, d in DESIGNS.items() if d.block is not None)
DEFAULT_DESIGN = DENSE
PRICED = tuple(name for name, d in DESIGNS.items() if d.pricing is not None)


RENAMED = {"per-history": DENSE}  # earlier names of a design (the planner's), refused with the new one


def get_design(name: str, flag: str = "--graph") -> Design:
    """The design called ``name``; refuse an unknown one naming the known ones."""
    if name in RENAMED:
        raise AnelabInputError(f"{flag} {name!r} is now called {RENAMED[name]!r}; use {flag} {RENAMED[name]}")
    if name not in DESIGNS:
        raise AnelabInputError(f"unknown {flag} {name!r}; supported: {', '.join(DESIGNS)}")
    return DESIGNS[name]


def design_of(meta: SidecarMetadata, where: str = "sidecar") -> Design:
    """The design of a package's metadata (refused in one line when its metadata lacks what it needs)."""
    design = get_design(meta.graph or DEFAULT_DESIGN)  # a package from before anelab.graph existed: dense
    design.check_metadata(meta, where)
    return design


def default_capacity(design: Design, prompt_tokens: int, chunk: int, key_tile: int | None) -> int:
    """The planner's default capacity: the prompt in whole chunks (and whole key tiles when the design
    tiles its cache and a key tile is given)."""
    cap = -(-prompt_tokens // chunk) * chunk
    if key_tile is not None and (isinstance(key_tile, bool) or not isinstance(key_tile, int) or key_tile <= 0):
        raise AnelabInputError(f"--tile must be a positive integer, got {key_tile}")
    if design.pricing is not None and design.pricing.whole_key_tiles and key_tile is not None:
        unit = math.lcm(chunk, key_tile)
        cap = -(-cap // unit) * unit
    return cap


@dataclass(frozen=True)
class SidecarRequest:
    """One sidecar as a user asks for it: the design (``graph``) and its options as the CLI's flags give them
    (--chunk, --histories, --tile, --query-tile, --capacity, --weights, --mask-mode, --decode, the selection
    contract), before they are checked against a checkpoint. ``options_for`` validates it (one-line refusals)
    into the design and its :class:`SidecarOptions`. The CLI builds one; export takes it, the planner's design
    plans give one (``DesignPlan.sidecar_request``), decide records it beside its evidence (``to_dict``)."""

    chunk: int | None
    histories: tuple[int, ...] | None = None
    graph: str = DEFAULT_DESIGN
    key_tile: int | None = None
    query_tile: int | None = None
    capacity: int | None = None
    decode: bool = False
    mask_mode: str | None = None
    weights: str = "fp16"
    selection: dict | None = field(default=None, hash=False)
    backend: str = "coreml"  # the sidecar format (sidecar.backends.DEFAULT_BACKEND, or coreai)

    def __post_init__(self):
        if self.histories is not None:
            object.__setattr__(self, "histories", tuple(int(h) for h in self.histories))
        if self.graph is None:
            object.__setattr__(self, "graph", DEFAULT_DESIGN)
        if self.backend is None:
            object.__setattr__(self, "backend", "coreml")

    def options_for(self, geometry: AttentionGeometry) -> tuple[Design, SidecarOptions]:
        """The design and this request's options validated against ``geometry``."""
        if self.chunk is None:
            raise AnelabInputError("export: pass --chunk (the sidecar's width in rows)")
        design = get_design(self.graph)
        histories = None if self.histories is None else list(self.histories)
        options = design.options(
            geometry,
            self.chunk,
            histories,
            weights=self.weights,
            selection=self.selection,
            key_tile=self.key_tile,
            query_tile=self.query_tile,
            capacity=self.capacity,
            decode=self.decode,
            mask_mode=self.mask_mode,
        )
        return design, options

    def to_dict(self) -> dict:
        """The request as JSON (what ``anelab decide``'s evidence records); ``from_dict`` reads it back."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["histories"] = None if self.histories is None else list(self.histories)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SidecarRequest:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise AnelabInputError(f"a sidecar request with unknown fields {sorted(unknown)}")
        return cls(**d)
