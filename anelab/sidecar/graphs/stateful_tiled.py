"""The stateful tiled sidecar graph: one function per chunk width, K/V in state, online softmax over tiles.

One function ``c<C>`` (and ``c1`` for decode) serves every chunk start of a layer: the K/V cache lives in Core
ML state ([Hkv, capacity, d] each), the chunk's first absolute position is the int32 input ``start``, attention
visits the cache in key tiles of ``key_tile`` slots and the chunk in query tiles of ``query_tile`` rows (online
softmax); the largest score tensor is [Hkv, group x query_tile, key_tile]. Mask modes ``causal`` (in-graph) and
``additive`` (plus a [C, capacity] input), the ring of a sliding-window layer, the wasted arithmetic and RoPE
without int16 gathers are derived in docs/derivations.md.
"""

from __future__ import annotations

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.masks import MASKED
from anelab.core.weights import AttentionWeights
from anelab.sidecar.coremltools_import import coremltools_modules
from anelab.sidecar.format import STATE_NAMES
from anelab.sidecar.graphs.common import (
    attention_output,
    cache_for_attention,
    no_rotation,
    project_chunk,
    rope,
    rope_tables,
    softcap,
    update_kv_cache,
)

ROPE_SPLIT = 256  # start = hi * ROPE_SPLIT + lo: both gather indices stay far below int16's 32,767
MASK_MODES = ("causal", "additive")
DEFAULT_KEY_TILE = 1024
DEFAULT_QUERY_TILE = 256
# the in-graph causal limit is compared in fp16, which holds every integer only up to 2**11: a larger
# key tile would round a row's limit to its even neighbour (its own key dropped, or the next leaked)
MAX_KEY_TILE = 2**11
# gather indices hi < 32,768 after coremltools' int16 cast: capacity < 32,768 * ROPE_SPLIT
MAX_TILED_STATE_CAPACITY = (2**15 - 1) * ROPE_SPLIT


def window_ring(window: int, chunk: int, key_tile: int | None = None) -> tuple[int, int]:
    """(ring slots, key tile) of a windowed layer: at least W + C slots in whole key tiles. Without
    a key tile, the fewest tiles of at most DEFAULT_KEY_TILE slots that hold W + C, evened out (so
    the ring exceeds W + C by less than one slot per tile)."""
    need = window + chunk
    if key_tile is None:
        tiles = -(-need // DEFAULT_KEY_TILE)
        key_tile = -(-need // tiles)
    return -(-need // key_tile) * key_tile, int(key_tile)


def validate_tiles(key_tile: int | None, query_tile: int | None, chunk: int, capacity: int) -> tuple[int, int]:
    """(key_tile, query_tile): key tiles divide the capacity, query tiles divide the chunk (defaults:
    min(DEFAULT_KEY_TILE, capacity) and min(DEFAULT_QUERY_TILE, chunk), rounded down to divisors)."""

    def divisor_at_most(n: int, cap: int) -> int:
        return max(t for t in range(1, min(n, cap) + 1) if n % t == 0)

    key_tile = divisor_at_most(capacity, DEFAULT_KEY_TILE) if key_tile is None else key_tile
    query_tile = divisor_at_most(chunk, DEFAULT_QUERY_TILE) if query_tile is None else query_tile
    for flag, value, whole, what in (
        ("--tile", key_tile, capacity, "state capacity"),
        ("--query-tile", query_tile, chunk, "chunk"),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise AnelabInputError(f"{flag} must be a positive integer, got {value!r}")
        if whole % value:
            raise AnelabInputError(
                f"{flag} {value} does not divide the {what} {whole}; use {divisor_at_most(whole, value)}"
            )
    if key_tile > MAX_KEY_TILE:
        raise AnelabInputError(
            f"--tile {key_tile} exceeds {MAX_KEY_TILE} (the causal limit is compared in fp16, exact to 2048); "
            f"use --tile {divisor_at_most(capacity, MAX_KEY_TILE)}"
        )
    return int(key_tile), int(query_tile)


def validate_mask_mode(mode: str) -> str:
    if mode not in MASK_MODES:
        raise AnelabInputError(f"unknown mask mode {mode!r}; use one of: {', '.join(MASK_MODES)}")
    return mode


def wasted_score_fraction(prompt: int, chunk: int, capacity: int) -> float:
    """Share of the score entries a C-chunked prefill of ``prompt`` tokens computes but drops.

    Computed: ceil(P / C) calls x C rows x capacity slots. Used: sum over real rows p of (p + 1)
    visible keys (causal)."""
    calls = -(-prompt // chunk)
    computed = calls * chunk * capacity
    used = prompt * (prompt + 1) // 2
    return 1.0 - used / computed


def _split_rope_tables(geometry: AttentionGeometry, layer: int, capacity: int):
    """cos/sin of hi*ROPE_SPLIT*theta [ceil(capacity / ROPE_SPLIT), rot/2] and of lo*theta
    [ROPE_SPLIT, rot/2], float64 -> fp16; theta_j from ``geometry.rope_frequencies`` at coverage =
    capacity (the attention factor is applied once, by the row-offset tables)."""
    inv_freq, _ = geometry.rope_frequencies(layer, capacity)
    hi = np.arange(-(-capacity // ROPE_SPLIT), dtype=np.float64)[:, None] * ROPE_SPLIT * inv_freq[None, :]
    lo = np.arange(ROPE_SPLIT, dtype=np.float64)[:, None] * inv_freq[None, :]
    as16 = lambda a: a.astype(np.float16)  # noqa: E731
    return as16(np.cos(hi)), as16(np.sin(hi)), as16(np.cos(lo)), as16(np.sin(lo))


def _start_rotation(mb, geometry: AttentionGeometry, layer: int, capacity: int, start):
    """cos/sin(start * theta) [1, 1, rot/2] fp16 from int32 start [1], via hi/lo tables (no index >= 2**15)."""
    cos_hi_t, sin_hi_t, cos_lo_t, sin_lo_t = _split_rope_tables(geometry, layer, capacity)
    hi = mb.floor_div(x=start, y=np.int32(ROPE_SPLIT))  # [1]
    lo = mb.sub(x=start, y=mb.mul(x=hi, y=np.int32(ROPE_SPLIT)))
    cos_hi, sin_hi = (mb.gather(x=t, indices=hi, axis=0) for t in (cos_hi_t, sin_hi_t))  # [1, rot/2]
    cos_lo, sin_lo = (mb.gather(x=t, indices=lo, axis=0) for t in (cos_lo_t, sin_lo_t))
    cos = mb.sub(x=mb.mul(x=cos_hi, y=cos_lo), y=mb.mul(x=sin_hi, y=sin_lo))  # cos(a + b)
    sin = mb.add(x=mb.mul(x=sin_hi, y=cos_lo), y=mb.mul(x=cos_hi, y=sin_lo))  # sin(a + b)
    return mb.expand_dims(x=cos, axes=[0]), mb.expand_dims(x=sin, axes=[0])


def _causal_tile_mask(mb, start, r0: int, k0: int, groups: int, query_tile: int, key_tile: int):
    """Additive causal mask [groups * query_tile, key_tile] fp16 for rows (g, r0 + i) and slots k0..:
    slot k0 + j is visible to row r0 + i iff k0 + j <= start + r0 + i (the same for every query head
    g of a KV head). The limit is formed in int32 and clipped to [-1, key_tile] before the fp16 cast,
    so it is exact whatever the position (key_tile <= MAX_KEY_TILE)."""
    rows = np.tile(np.arange(r0 - k0, r0 - k0 + query_tile, dtype=np.int32), groups)
    limit = mb.add(x=start, y=rows)  # [groups * query_tile] int32
    limit = mb.minimum(x=mb.maximum(x=limit, y=np.int32(-1)), y=np.int32(key_tile))
    limit = mb.expand_dims(x=mb.cast(x=limit, dtype="fp16"), axes=[1])  # [groups * query_tile, 1]
    slots = np.arange(key_tile, dtype=np.float16)[None, :]  # [1, key_tile]
    visible = mb.less_equal(x=slots, y=limit)
    return mb.select(cond=visible, a=np.float16(0.0), b=np.float16(MASKED))


def validate_ring(
    window: int | None, slots: int | None, chunk: int, capacity: int, key_tile: int, mask_mode: str
) -> int:
    """The cache slots of a layer: ``capacity`` (full attention, no ``slots``), or a windowed layer's
    ring, which must hold W + C - 1 keys in whole key tiles and takes no additive mask (one line each)."""
    if window is None:
        if slots is not None:
            raise AnelabInputError("a ring of cache slots is for sliding-window layers only; drop slots")
        return capacity
    if slots is None:
        raise AnelabInputError(f"a {window}-token sliding-window layer needs its ring size (window_ring)")
    if slots < window + chunk - 1 or (key_tile and slots % key_tile):
        raise AnelabInputError(
            f"a ring of {slots} slots cannot serve a {window}-token window with chunks of {chunk} in key tiles of "
            f"{key_tile}; use window_ring({window}, {chunk}, {key_tile})[0] = {window_ring(window, chunk, key_tile)[0]}"
        )
    if mask_mode != "causal":
        raise AnelabInputError(
            "--mask-mode additive is for full-attention layers (its mask spans the positions, not a windowed "
            "layer's ring); export the windowed layers with --mask-mode causal"
        )
    return slots


def _write_ring(mb, cache, new, start, C: int):
    """The ring cache [Hkv, S, d] with new [Hkv, C, d] written at slots (start + i) mod S, wrapping
    past slot S - 1 (static shapes: the cache extended by its first C slots, one slice_update at
    start mod S, the wrapped rows selected back into slots 0 .. C - 1)."""
    Hkv, S, d = cache.shape
    offset = mb.sub(x=start, y=mb.mul(x=mb.floor_div(x=start, y=np.int32(S)), y=np.int32(S)))  # start mod S [1]
    head = mb.slice_by_index(x=cache, begin=[0, 0, 0], end=[Hkv, C, d])
    extended = mb.concat(values=[cache, head], axis=1)  # [Hkv, S + C, d]: slots S.. alias slots 0..
    zero = np.zeros(1, np.int32)
    begin = mb.concat(values=[zero, offset, zero], axis=0)
    end = mb.concat(
        values=[np.array([Hkv], np.int32), mb.add(x=offset, y=np.int32(C)), np.array([d], np.int32)], axis=0
    )
    extended = mb.slice_update(x=extended, update=new, begin=begin, end=end)
    # slot j < C was written past the end (at S + j) iff j < offset + C - S
    wrapped = mb.less(x=np.arange(C, dtype=np.int32).reshape(1, C, 1), y=mb.add(x=offset, y=np.int32(C - S)))
    tail = mb.slice_by_index(x=extended, begin=[0, S, 0], end=[Hkv, S + C, d])
    first = mb.select(cond=wrapped, a=tail, b=mb.slice_by_index(x=extended, begin=[0, 0, 0], end=[Hkv, C, d]))
    rest = mb.slice_by_index(x=extended, begin=[0, C, 0], end=[Hkv, S, d])
    return mb.concat(values=[first, rest], axis=1)


def _window_tile_mask(window: int, slots: int, chunk: int):
    """The tile limit of a windowed layer's ring (module docstring): a function like
    ``_causal_tile_mask`` returning the additive mask [groups * query_tile, key_tile] fp16 for rows
    (g, r0 + i) and ring slots k0..: slot k0 + j is kept iff the age of the position it holds lies in
    [0, min(window - 1, start + r0 + i)]."""

    def tile_mask(mb, start, r0: int, k0: int, groups: int, query_tile: int, key_tile: int):
        rows = np.tile(np.arange(r0, r0 + query_tile, dtype=np.int32), groups)
        # a = (start + C - 1 - k0) mod S: the age of slot k0 from the chunk's last row (kept >= 0 before the mod)
        shifted = mb.add(x=start, y=np.int32(chunk - 1 - k0 + slots))
        a = mb.sub(x=shifted, y=mb.mul(x=mb.floor_div(x=shifted, y=np.int32(slots)), y=np.int32(slots)))
        newest = mb.add(x=a, y=rows + np.int32(1 - chunk))  # [groups * query_tile]: slot k0 + newest has age 0
        oldest = mb.sub(x=newest, y=mb.minimum(x=mb.add(x=start, y=rows), y=np.int32(window - 1)))
        visible = None
        for lift in (0, slots):  # the interval, and its copy one ring later
            lo, hi = (
                mb.expand_dims(
                    x=mb.cast(
                        x=mb.minimum(
                            x=mb.maximum(x=mb.add(x=v, y=np.int32(lift)), y=np.int32(-1)), y=np.int32(key_tile)
                        ),
                        dtype="fp16",
                    ),
                    axes=[1],
                )
                for v in (oldest, newest)
            )  # [groups * query_tile, 1], exact in fp16 (|value| <= key_tile <= MAX_KEY_TILE)
            slot_ids = np.arange(key_tile, dtype=np.float16)[None, :]
            inside = mb.logical_and(x=mb.greater_equal(x=slot_ids, y=lo), y=mb.less_equal(x=slot_ids, y=hi))
            visible = inside if visible is None else mb.logical_or(x=visible, y=inside)
        return mb.select(cond=visible, a=np.float16(0.0), b=np.float16(MASKED))

    return tile_mask


def _online_softmax_rows(
    mb, geometry: AttentionGeometry, q_tile, caches, start, mask, r0: int, dims: tuple[int, int, int, int, int]
):
    """Context [Hkv, G * query_tile, d] of one query tile over every key tile of the cache.

    q_tile [Hkv, G * query_tile, d] (scaled; rows ordered (g, i)); caches = (keys, values)
    [Hkv, capacity, d]; mask: None or the additive input [C, capacity]; ``dims`` ends with the tile
    limit (``_causal_tile_mask``, or a windowed layer's ``_window_tile_mask``). Every matmul is 3-D
    with the KV head as its batch (no broadcast batch dimension)."""
    capacity, key_tile, query_tile, d, G, limit = dims
    keys, values = caches
    m = l = acc = None
    for k0 in range(0, capacity, key_tile):
        k_t, v_t = (
            mb.slice_by_index(x=c, begin=[0, k0, 0], end=[0, k0 + key_tile, d], end_mask=[True, False, True])
            for c in (keys, values)
        )  # [Hkv, key_tile, d]
        s = softcap(mb, mb.matmul(x=q_tile, y=k_t, transpose_y=True), geometry)  # [Hkv, G * query_tile, key_tile]
        s = mb.add(x=s, y=limit(mb, start, r0, k0, G, query_tile, key_tile))
        if mask is not None:
            cols = mb.slice_by_index(x=mask, begin=[r0, k0], end=[r0 + query_tile, k0 + key_tile])
            s = mb.add(x=s, y=mb.tile(x=cols, reps=[G, 1]) if G > 1 else cols)
        tile_max = mb.reduce_max(x=s, axes=[-1], keep_dims=True)  # [Hkv, G * query_tile, 1]
        m_new = tile_max if m is None else mb.maximum(x=m, y=tile_max)
        p = mb.exp(x=mb.sub(x=s, y=m_new))
        p_sum = mb.reduce_sum(x=p, axes=[-1], keep_dims=True)
        pv = mb.matmul(x=p, y=v_t)  # [Hkv, G * query_tile, d]
        if m is None:
            l, acc = p_sum, pv
        else:
            alpha = mb.exp(x=mb.sub(x=m, y=m_new))
            l = mb.add(x=mb.mul(x=l, y=alpha), y=p_sum)
            acc = mb.add(x=mb.mul(x=acc, y=alpha), y=pv)
        m = m_new
    return mb.real_div(x=acc, y=l)


def build_stateful_tiled_program(
    geometry: AttentionGeometry,
    weights: AttentionWeights,
    chunk: int,
    capacity: int,
    key_tile: int,
    query_tile: int,
    mask_mode: str = "causal",
    slots: int | None = None,
):
    """The stateful tiled function for chunks of width ``chunk`` (1 = decode).

    States (fp16): k_cache, v_cache [Hkv, S, d] (normed, rotated K; V), S = ``capacity`` for a
    full-attention layer, the ring ``slots`` (``window_ring``) for a windowed one. Inputs: hidden
    [C, D] fp16; start [1] int32 (first absolute position; the caller keeps start + C <= capacity,
    the positions the RoPE tables serve); with ``mask_mode="additive"`` (full-attention layers) also
    mask [C, capacity] fp16. Output: attn_out [C, D] fp16.
    """
    ct, mb, types = coremltools_modules()
    g = geometry
    C, N = chunk, capacity
    validate_mask_mode(mask_mode)
    Hkv, d, G = g.num_kv_heads, g.head_dim, g.group_size
    window = g.window_of(weights.layer)
    S = validate_ring(window, slots, C, N, key_tile, mask_mode)  # cache slots: the capacity, or the ring
    key_tile, query_tile = validate_tiles(key_tile, query_tile, C, S)
    cos_i, sin_i, _, _ = rope_tables(g, weights.layer, C, 0, coverage=N)
    specs = [mb.StateTensorSpec(shape=(Hkv, S, d), dtype=types.fp16) for _ in STATE_NAMES]
    specs += [mb.TensorSpec(shape=(C, g.hidden_size), dtype=types.fp16), mb.TensorSpec(shape=(1,), dtype=types.int32)]
    if mask_mode == "additive":
        specs.append(mb.TensorSpec(shape=(C, N), dtype=types.fp16))

    def body(k_cache, v_cache, hidden, start, mask):
        cos_s, sin_s = _start_rotation(mb, g, weights.layer, N, start)

        def rotate(x, name):  # by the row offset i (static), then by start (from the split tables)
            return rope(mb, rope(mb, x, cos_i, sin_i, g, f"{name}_i"), cos_s, sin_s, g, name)

        if not g.uses_rope(weights.layer):  # a NoPE layer (SmolLM3)
            rotate = no_rotation

        q, gate, k_chunk, v_chunk = project_chunk(mb, g, weights, hidden, C, rotate)
        if window is None:
            caches = update_kv_cache(mb, g, (k_cache, v_cache), (k_chunk, v_chunk), start, C)
        else:
            caches = []
            for state, new in ((k_cache, k_chunk), (v_cache, v_chunk)):
                updated = _write_ring(mb, mb.read_state(input=state), new, start, C)
                mb.coreml_update_state(state=state, value=updated)
                caches.append(cache_for_attention(mb, state, updated))
        limit = _causal_tile_mask if window is None else _window_tile_mask(window, S, C)
        dims = (S, key_tile, query_tile, d, G, limit)
        if query_tile == C:  # q [Hkv, G*C, d] is already one query tile
            context = _online_softmax_rows(mb, g, q, caches, start, mask, 0, dims)
        else:
            q = mb.reshape(x=q, shape=[Hkv, G, C, d])
            contexts = []
            for r0 in range(0, C, query_tile):
                q_tile = mb.slice_by_index(x=q, begin=[0, 0, r0, 0], end=[Hkv, G, r0 + query_tile, d])
                q_tile = mb.reshape(x=q_tile, shape=[Hkv, G * query_tile, d])
                ctx = _online_softmax_rows(mb, g, q_tile, caches, start, mask, r0, dims)
                contexts.append(mb.reshape(x=ctx, shape=[Hkv, G, query_tile, d]))
            context = mb.concat(values=contexts, axis=2)  # [Hkv, G, C, d]
        return attention_output(mb, g, weights, context, gate, C)

    if mask_mode == "additive":

        @mb.program(input_specs=specs, opset_version=ct.target.iOS18)
        def prog(k_cache, v_cache, hidden, start, mask):
            return body(k_cache, v_cache, hidden, start, mask)
    else:

        @mb.program(input_specs=specs, opset_version=ct.target.iOS18)
        def prog(k_cache, v_cache, hidden, start):
            return body(k_cache, v_cache, hidden, start, None)

    return prog
