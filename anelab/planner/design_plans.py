"""Compare sidecar designs for one prompt: per-history functions, one stateful function, one stateful tiled one.

The designs the planner prices (``anelab.sidecar.designs``: each declares its ``PlannerPricing``)
differ in what the runtime loads and what each call computes:

- ``dense``: one function ``h<s>`` per chunk start s and full-attention layer (the seed's
  design): loads = layers x chunks visited, each costing the recorded / fitted load at its score
  arena ``heads x C x (s + C)``; attention scores ``heads x C x (s + C)`` entries per layer-chunk.
- ``stateful``: one function ``c<C>`` per layer, K/V in state of ``capacity`` slots: loads = layers;
  the arena is ``heads x C x capacity`` (every slot scored at once); every call scores the whole
  capacity, slots past the position masked.
- ``stateful-tiled``: the same single function, attention over key tiles of ``key_tile`` slots and
  query tiles of ``query_tile`` rows: loads = layers; the arena is ``heads x query_tile x key_tile``;
  the arithmetic is the stateful design's (every slot scored; no control flow skips a tile), and the
  op count grows with the tile pairs ``(C / query_tile) x (capacity / key_tile)``.

Sliding-window layers (``window`` W) are priced as built: a design whose pricing declares a
``window_ring`` (stateful-tiled) keeps a ring of about W + C slots, so each call scores
``heads x C x ring`` entries and its arena and op count are the ring's, whatever the prompt; the
others still score every key of the history (the window is only in the mask; RoPE positions are
absolute, so a per-history windowed layer needs as many functions as a full one).

Assumptions (stated in every :class:`DesignPlan`): a load costs what the one load model says for
its score arena (``LoadModel.at_arena``: Qwen 3.8's recorded load where the arena and geometry are
recorded, else the power law in score-arena bytes, floored at the smallest recorded load) — the same
arena costs the same in every design; whether compile time also grows with the op count is not
recorded anywhere, so ``break_even_load_seconds`` says how slow one load may be before the design
loses; ANE attention costs the recorded rate per score entry, masked entries included; the GPU arm,
non-attention and GPU attention come from :func:`anelab.planner.plan.plan` unchanged.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from anelab.core.errors import AnelabInputError
from anelab.core.geometry import chunk_starts
from anelab.planner.catalogue import PlanGeometry, chunk_schedule, get_family, require_plannable, require_positive
from anelab.planner.fit import LoadModel, fit_costs
from anelab.planner.plan import PrefillPlan, plan
from anelab.sidecar.designs import PRICED, SidecarRequest, default_capacity, get_design
from anelab.sidecar.graphs.stateful_tiled import wasted_score_fraction

DESIGNS = PRICED  # the designs the planner prices, named as everywhere else


@dataclass(frozen=True)
class DesignCosts:
    """What the design comparison takes from the fitted cost model and from the per-history plan."""

    ane_seconds_per_entry: float
    load: LoadModel  # the plan's load model (one for every design)
    gpu_prefill_seconds: float
    gpu_attention_seconds: float  # all of it moves to the ANE when the prompt is at least one chunk
    non_attention_seconds: float
    per_history: PrefillPlan  # the per-history plan the other designs are compared with


@dataclass(frozen=True)
class DesignPlan:
    """One design's prediction for one prompt (seconds, bytes, counts); ratio = GPU / ANE arm."""

    design: str
    prompt_tokens: int
    chunk: int
    capacity: int | None
    key_tile: int | None
    query_tile: int | None
    loads: int
    load_seconds_each: float
    setup_seconds: float
    per_call_arena_bytes: int
    score_entries_computed: int  # per full-attention layer, over the prompt
    score_entries_used: int  # causal: what a query can see
    wasted_fraction: float
    ops_per_function: int
    functions_per_layer: int
    load_source: str  # where one load's seconds came from (recorded / fitted / extrapolated / flag)
    ane_attention_seconds: float
    gpu_prefill_seconds: float
    ane_prefill_seconds: float
    predicted_ratio: float
    decision: str
    break_even_load_seconds: float | None
    assumptions: tuple
    window: int | None = None  # the layers' sliding window (None: full attention)
    ring_slots: int | None = None  # a ring of cache slots on windowed layers (stateful-tiled)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["assumptions"] = list(self.assumptions)
        return d

    def sidecar_request(self) -> SidecarRequest:
        """What to export for this plan: the functions its prompt visits (one per chunk start), or one state of
        the planned capacity — at least two chunks, which verification of a stateful package needs — rounded up
        to whole key tiles."""
        if self.capacity is None:
            return SidecarRequest(self.chunk, tuple(chunk_starts(self.prompt_tokens, self.chunk)), self.design)
        unit = math.lcm(self.chunk, self.key_tile or self.chunk)
        capacity = -(-max(self.capacity, 2 * self.chunk) // unit) * unit
        return SidecarRequest(
            self.chunk, None, self.design, key_tile=self.key_tile, query_tile=self.query_tile, capacity=capacity
        )


def family_design_costs(family: str, prompt_tokens: int, chunk: int, **runtime) -> DesignCosts:
    """A recorded family's costs for the comparison (the per-history plan past any coverage cap is
    planned as if the histories existed: the cap is a property of that design); ``runtime``: :func:`plan`'s
    ``gpu_runtime``, ``chip``, ``protocol``, ``reload_policy``."""
    p = plan(prompt_tokens, family=family, chunk=chunk, max_history=None, allow_past_coverage=True, **runtime)
    if not p.fits:  # past the family's recorded cap: plan the per-history design as if it were built
        needed = max(c["history"] for c in p.chunks)
        fam = get_family(family)
        p = plan(
            prompt_tokens,
            chunk=chunk,
            histories=chunk_starts(needed + 1, chunk),
            num_layers=fam.geometry.num_layers,
            full_attention_layers=fam.geometry.full_attention_layers,
            num_heads=fam.geometry.num_heads,
            head_dim=fam.geometry.head_dim,
            sparse_budget=fam.geometry.sparse_budget,
            family=family,
            **runtime,
        )
    fit = fit_costs()
    return DesignCosts(
        ane_seconds_per_entry=fit.ane_seconds_per_entry * chip_scale(p),
        load=fit.recorded_load_model(specialize=p.pays_specialization),
        gpu_prefill_seconds=p.gpu_prefill_seconds,
        gpu_attention_seconds=p.gpu_attention_seconds,
        non_attention_seconds=p.non_attention_seconds,
        per_history=p,
    )


def chip_scale(per_history: PrefillPlan) -> float:
    """The per-history plan's ANE carry to its chip (``ane_chips``), applied to every design's ANE rate: the same
    chunk on the same engine (1.0 on the seed's M3 or with a flag's ANE attention)."""
    return per_history.ane_chip["scale"] if per_history.ane_chip else 1.0


def design_plan(
    geometry: PlanGeometry,
    prompt_tokens: int,
    request: SidecarRequest,
    costs: DesignCosts,
    *,
    window: int | None = None,
) -> DesignPlan:
    """Predict one design for one prompt (module docstring: model and assumptions): ``request`` names the
    design (``graph``), its chunk and, where given, its capacity and tiles. The capacity defaults to the prompt
    rounded up to whole chunks (and, for a given key tile, whole key tiles); tiles default as the exporter's
    (``validate_tiles``). ``window``: the layers' sliding window W (None: full attention)."""
    design, chunk, capacity = request.graph, request.chunk, request.capacity
    key_tile, query_tile = request.key_tile, request.query_tile
    pricing = get_design(design, "--design").require_pricing()
    require_positive("--prompt-tokens", prompt_tokens)
    require_positive("--chunk", chunk)
    schedule = chunk_schedule(prompt_tokens, chunk)
    on_ane = schedule[0].device == "ane"
    used = geometry.num_heads * sum(min(p + 1, window or p + 1) for p in range(prompt_tokens))  # keys a query sees
    scale = chip_scale(costs.per_history) if costs.per_history is not None else 1.0
    carried = f", carried to the {costs.per_history.chip} x {scale:.3g} (ane_chips)" if scale != 1.0 else ""
    assumptions = [
        f"ANE attention: recorded rate per score entry (Qwen 3.8 h0 prediction){carried}, masked entries included",
        "GPU arm, non-attention and GPU attention: the per-history plan's (plan())",
    ]
    price = _per_history_terms if not pricing.one_function_per_layer else _one_function_terms
    t = price(geometry, schedule, chunk, get_design(design), costs, capacity, key_tile, query_tile, window)
    cap, kt, qt, loads, setup, ane_attn, computed = (
        t[k] for k in ("cap", "kt", "qt", "loads", "setup", "ane", "computed")
    )
    assumptions += t["assumptions"]
    offloaded = costs.gpu_attention_seconds if on_ane else 0.0
    rest = costs.non_attention_seconds + costs.gpu_attention_seconds - offloaded + ane_attn
    ane_total = rest + setup
    ratio = costs.gpu_prefill_seconds / ane_total
    return DesignPlan(
        design=design,
        prompt_tokens=prompt_tokens,
        chunk=chunk,
        capacity=cap,
        key_tile=kt,
        query_tile=qt,
        loads=loads,
        load_seconds_each=setup / loads if loads else 0.0,
        setup_seconds=setup,
        per_call_arena_bytes=int(t["arena"]),
        score_entries_computed=int(computed),
        score_entries_used=int(used),
        wasted_fraction=wasted_score_fraction(prompt_tokens, chunk, cap)
        if pricing.one_function_per_layer and t.get("ring") is None and window is None
        else 1.0 - used / computed,
        ops_per_function=int(t["ops"]),
        functions_per_layer=t["functions"],
        load_source=t["load_source"],
        ane_attention_seconds=ane_attn,
        gpu_prefill_seconds=costs.gpu_prefill_seconds,
        ane_prefill_seconds=ane_total,
        predicted_ratio=ratio,
        decision="ane" if on_ane and ratio > 1.0 else "gpu",
        break_even_load_seconds=(costs.gpu_prefill_seconds - rest) / loads if loads else None,
        assumptions=tuple(assumptions),
        window=window,
        ring_slots=t.get("ring"),
    )


def _per_history_terms(geometry, schedule, chunk, design, costs, capacity, key_tile, query_tile, window) -> dict:
    """A per-history design's loads, setup and attention: the per-history plan's (``costs.per_history``)."""
    ph, heads = costs.per_history, geometry.num_heads
    return {
        "cap": None, "kt": None, "qt": None, "functions": len(schedule),
        "computed": sum(heads * chunk * (c.start + chunk) for c in schedule),
        "loads": ph.variants_visited,
        "arena": geometry.score_arena_bytes(chunk, schedule[-1].start),
        "ops": design.pricing.ops(chunk, None, None, None),
        "setup": ph.setup_seconds, "ane": ph.ane_attention_seconds,
        "load_source": "; ".join(sorted({v["source"] for v in ph.load_seconds.values()})) or "no load",
        "assumptions": ["loads: recorded per history where they apply, else the arena fit (as plan())"],
    }  # fmt: skip


def _one_function_terms(geometry, schedule, chunk, design, costs, capacity, key_tile, query_tile, window) -> dict:
    """A design with one function per layer: one load each, priced by the arena fit; every cache slot
    scored at every call (on windowed layers, a design with a ``window_ring`` scores its ring)."""
    on_ane, calls, n_fa = schedule[0].device == "ane", len(schedule), len(geometry.full_attention_layers)
    prompt_tokens = schedule[-1].start + schedule[-1].tokens
    cap = capacity if capacity is not None else default_capacity(design, prompt_tokens, chunk, key_tile)
    if cap < calls * chunk or cap % chunk:
        raise AnelabInputError(f"--capacity {cap} must be a multiple of {chunk} holding the prompt ({calls * chunk})")
    ring = None
    if window is not None and design.pricing.window_ring is not None:  # the cache is a ring of about W + C slots
        ring, key_tile = design.pricing.window_ring(window, chunk, key_tile)
    scored = cap if ring is None else ring
    computed = calls * geometry.num_heads * chunk * scored
    loads = n_fa if on_ane else 0
    kt, qt, arena = design.pricing.call(geometry.num_heads, chunk, scored, key_tile, query_tile)
    each, load_source = costs.load.at_arena(geometry.num_heads, geometry.head_dim, chunk, int(arena))
    assumptions = [
        f"one load per layer ({n_fa}); load by the one load model at the function's score arena "
        f"({load_source}); op count's effect on compile time not modelled"
    ]
    if ring is not None:
        assumptions.append(f"windowed layers: a ring of {ring} slots; ops as a full layer's per tile pair")
    return {
        "cap": cap, "kt": kt, "qt": qt, "functions": 1, "computed": computed, "loads": loads, "arena": arena,
        "ops": design.pricing.ops(chunk, scored, kt, qt), "setup": loads * each, "load_source": load_source,
        "ring": ring,
        "ane": costs.ane_seconds_per_entry * computed * n_fa if on_ane else 0.0, "assumptions": assumptions,
    }  # fmt: skip


def compare_designs(
    prompt_tokens: int,
    family: str,
    chunk: int,
    designs=DESIGNS,
    *,
    capacity: int | None = None,
    key_tile: int | None = None,
    query_tile: int | None = None,
    **plan_options,
) -> list[DesignPlan]:
    """Every requested design for a recorded family at one prompt and chunk width; ``plan_options``:
    :func:`plan`'s ``gpu_runtime``, ``chip``, ``protocol``, ``reload_policy``."""
    require_plannable(prompt_tokens, chunk)
    fam = get_family(family)
    costs = family_design_costs(family, prompt_tokens, chunk, **plan_options)
    return [
        design_plan(
            fam.geometry,
            prompt_tokens,
            SidecarRequest(chunk, graph=d, capacity=capacity, key_tile=key_tile, query_tile=query_tile),
            costs,
        )
        for d in designs
    ]
