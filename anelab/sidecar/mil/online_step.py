"""One key tile of online softmax, recognised in a saved program and evaluated as one step.

The stateful-tiled graph (``anelab.sidecar.graphs.stateful_tiled``) visits the cache one key tile at
a time; per tile it emits ``s = matmul(q, k_tile^T)``, one or two ``add(s, mask)``,
``tile_max = reduce_max(s)``, ``m_new = maximum(m, tile_max)`` (just ``tile_max`` on the first tile),
``p = exp(s - m_new)``, ``p_sum = reduce_sum(p)`` and ``pv = matmul(p, v_tile)``. Evaluated op by
op every tile costs eight full passes over a [B, R, key_tile] float32 tensor. Here the step runs per
batch (KV head) in one reused [R, key_tile] buffer, with the same rounding points as op by op (every
fp16 output rounded where it would be stored), on a few threads with one BLAS thread each.

A tile whose every row provably ends at weight 0 is skipped: when the largest score a row could
reach in it — ``score_bound(q, k_tile)`` (Cauchy-Schwarz) plus the row's largest mask value, plus
the fp16 rounding slack of each add — lies more than ``SKIP_MARGIN`` below the row's running max
``m``, op by op would give ``m_new = m`` (the tile's max is smaller), ``s - m_new <= -SKIP_MARGIN``
so ``p = exp(.) = 0`` exactly (in fp16 and in float32 alike), ``p_sum = 0`` and ``pv = 0``. Those are
the step's outputs then, bit for bit. This is how the causal tiles past a chunk's last position —
scored and dropped by the device (``wasted_score_fraction``) — cost nothing here. A non-finite
``m``, bound, mask or value tile never skips.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from anelab.core.fp16 import ROUNDING_BLOCK
from anelab.core.matmul import matmul
from anelab.core.reference import score_bound
from anelab.sidecar.mil.kernels import worker_count

SKIP_MARGIN = 128.0  # exp(-128) is 0 in float32 (and fp16): a skipped tile's weights are exactly 0
FP16_ROUNDING_SLACK = 32.0  # the largest change fp16 rounding makes to a finite value of magnitude <= 65504
FINITE_SCORE_LIMIT = 60000.0  # a bound past this could overflow fp16 somewhere in the step: never skip


@dataclass
class OnlineStep:
    """The ops of one key tile, in program order, and the roles the evaluation needs."""

    qk: object  # matmul(x=q [B, R, d], y=k_tile [B, key_tile, d], transpose_y=True)
    masks: list  # [(add op, name of its mask input)], in order: the causal tile, then an optional additive one
    tile_max: object  # reduce_max(s, axes=[-1], keep_dims=True)
    maximum: object | None  # maximum(m, tile_max), None on the first tile
    sub: object
    exp: object
    p_sum: object  # reduce_sum(p, axes=[-1], keep_dims=True)
    pv: object  # matmul(x=p, y=v_tile [B, key_tile, dv])
    ops: list
    last: object  # the op at whose place in the program the step runs

    @property
    def m_input(self):
        """The running max m [B, R, 1] coming in (None on the first tile)."""
        if self.maximum is None:
            return None
        x, y = self.maximum.inputs["x"], self.maximum.inputs["y"]
        return y if x is self.tile_max.outputs[0] else x

    @property
    def m_new(self):
        return (self.maximum or self.tile_max).outputs[0]


def _last_axis_reduction(op, kind: str) -> bool:
    if op is None or op.op_type != kind or "keep_dims" not in op.inputs or not bool(op.inputs["keep_dims"].val):
        return False
    axes = op.inputs["axes"].val if "axes" in op.inputs else None
    rank = len(op.inputs["x"].shape)
    return axes is not None and [int(a) % rank for a in np.atleast_1d(axes)] == [rank - 1]


def _plain_matmul(op, transpose_y: bool) -> bool:
    if op is None or op.op_type != "matmul" or len(op.outputs[0].shape) != 3:
        return False
    tx, ty = op.inputs.get("transpose_x"), op.inputs.get("transpose_y")
    return not (tx is not None and bool(tx.val)) and bool(ty is not None and ty.val) == transpose_y


def _match(exp, producer, consumers, uses):
    """The step closed by ``exp``, or None."""
    sub = producer.get(exp.inputs["x"].name)
    if sub is None or sub.op_type != "sub" or uses.get(sub.outputs[0].name) != 1:
        return None
    users = consumers.get(exp.outputs[0].name, [])
    p_sum = next((u for u in users if u.op_type == "reduce_sum"), None)
    pv = next((u for u in users if u.op_type == "matmul"), None)
    if len(users) != 2 or not _last_axis_reduction(p_sum, "reduce_sum") or not _plain_matmul(pv, False):
        return None
    if pv.inputs["x"] is not exp.outputs[0]:
        return None
    s, m_new = sub.inputs["x"], sub.inputs["y"]
    m_op = producer.get(m_new.name)
    if m_op is not None and m_op.op_type == "maximum":
        maximum = m_op
        tile_max = next(  # the operand reducing this tile's scores (m itself may come from a reduce_max too)
            (
                producer.get(v.name)
                for v in (m_op.inputs["x"], m_op.inputs["y"])
                if getattr(producer.get(v.name), "op_type", None) == "reduce_max"
                and producer.get(v.name).inputs["x"] is s
            ),
            None,
        )
        if tile_max is None or uses.get(tile_max.outputs[0].name) != 1:
            return None
    else:
        maximum, tile_max = None, m_op
    if not _last_axis_reduction(tile_max, "reduce_max") or tile_max.inputs["x"] is not s:
        return None
    if uses.get(s.name) != 2:  # read by reduce_max and sub only
        return None
    masks, node = [], producer.get(s.name)
    while node is not None and node.op_type == "add" and len(masks) < 2:
        out_shape = tuple(node.outputs[0].shape)
        chain = [
            (var, other)
            for var, other in ((node.inputs["x"], "y"), (node.inputs["y"], "x"))
            if tuple(var.shape) == out_shape and getattr(producer.get(var.name), "op_type", None) in ("add", "matmul")
        ]
        if not chain:
            return None
        scores, mask_name = chain[0]
        masks.insert(0, (node, mask_name))
        node = producer.get(scores.name)
        if uses.get(scores.name) != 1:
            return None
    if not masks or not _plain_matmul(node, True):
        return None
    return OnlineStep(node, masks, tile_max, maximum, sub, exp, p_sum, pv, [], None)


def find_online_steps(ops: list, uses: dict[str, int]) -> dict[int, OnlineStep]:
    """id(the step's last op in program order) -> step, for every recognisable online-softmax key tile.

    A step is kept only if nothing outside it reads one of its outputs before its last op runs."""
    producer, consumers, order = {}, {}, {}
    for i, op in enumerate(ops):
        order[id(op)] = i
        for v in op.outputs:
            producer[v.name] = op
        for v in op.inputs.values():
            for var in v if isinstance(v, (list, tuple)) else [v]:
                consumers.setdefault(var.name, []).append(op)
    steps = {}
    for op in ops:
        if op.op_type != "exp":
            continue
        step = _match(op, producer, consumers, uses)
        if step is None:
            continue
        members = [step.qk, *(a for a, _ in step.masks), step.tile_max, step.maximum, step.sub, op, step.p_sum, step.pv]
        step.ops = sorted((o for o in members if o is not None), key=lambda o: order[id(o)])
        step.last = step.ops[-1]
        inside = {id(o) for o in step.ops}
        position = order[id(step.last)]
        outputs = (step.m_new, step.p_sum.outputs[0], step.pv.outputs[0])
        if any(order[id(c)] < position for v in outputs for c in consumers.get(v.name, []) if id(c) not in inside):
            continue
        steps[id(step.last)] = step
    return steps


def _skippable(q_b, k_b, v_b, mask_tops: list[np.ndarray], m_b: np.ndarray | None) -> bool:
    """True when every row of this batch's tile provably ends at weight 0 (see the module docstring).

    q_b [R, d], k_b [key_tile, d], v_b [key_tile, dv]; mask_tops: each mask's row maxima [R]; m_b [R, 1]."""
    if m_b is None or not np.isfinite(m_b).all():
        return False
    bound = score_bound(q_b, k_b)
    if not bound < FINITE_SCORE_LIMIT:
        return False
    reach = bound * (1 + 2.0**-10) + sum(mask_tops) + FP16_ROUNDING_SLACK * (len(mask_tops) + 1)  # [R]
    reach = np.maximum(reach, -65504.0)  # a sum past fp16's range saturates (or is -inf): never above this
    if not np.all(reach + SKIP_MARGIN < m_b[:, 0]):  # NaN compares false: no skip
        return False
    return bool(np.isfinite(v_b).all())  # 0 * inf would be NaN op by op


def _row_maxima(mask: np.ndarray, batches: int) -> list[np.ndarray]:
    """Each batch's row maxima [R] (float64) of a mask broadcast to [B, R, T]; computed once when shared."""
    if mask.strides[0] == 0:
        top = mask[0].max(axis=1).astype(np.float64)
        return [top] * batches
    return [mask[b].max(axis=1).astype(np.float64) for b in range(batches)]


def run_online_step(it, step: OnlineStep) -> list[tuple[object, np.ndarray]]:
    """Evaluate ``step`` on interpreter ``it``; returns [(var, value)] for m_new, p_sum and pv.

    Values are already as stored (rounded where the vars are fp16); the caller stores them as exact."""
    q = it.value(step.qk.inputs["x"])  # [B, R, d]
    k = it.raw(step.qk.inputs["y"])  # [B, key_tile, d] (fp16 when sliced from a state)
    v = it.raw(step.pv.inputs["y"])  # [B, key_tile, dv]
    B, R, T = step.qk.outputs[0].shape
    masks = [np.broadcast_to(it.value(add.inputs[name]), (B, R, T)) for add, name in step.masks]
    m_var = step.m_input
    m = None if m_var is None else np.broadcast_to(it.value(m_var), (B, R, 1))
    dv = step.pv.outputs[0].shape[-1]
    m_new = np.empty((B, R, 1), np.float32)
    p_sum = np.zeros((B, R, 1), np.float32)
    pv = np.zeros((B, R, dv), np.float32)
    tops = [_row_maxima(mk, B) for mk in masks] if m is not None else []  # each [B][R]
    skipped = []

    def run(b: int) -> None:
        k_b = np.asarray(k[b], dtype=np.float32)
        v_b = np.asarray(v[b], dtype=np.float32)
        if _skippable(q[b], k_b, v_b, [t[b] for t in tops], None if m is None else m[b]):
            m_new[b] = m[b]
            skipped.append(b)
            return
        s = matmul(q[b], k_b.T)  # [R, T]
        scratch = np.empty(min(s.size, ROUNDING_BLOCK), np.int32)
        it.round_stored(step.qk.outputs[0], s, scratch)
        for (add, _), mk in zip(step.masks, masks):
            np.add(s, mk[b], out=s)
            it.round_stored(add.outputs[0], s, scratch)
        top = s.max(axis=1, keepdims=True)
        m_new[b] = top if m is None else np.maximum(m[b], top)
        np.subtract(s, m_new[b], out=s)
        it.round_stored(step.sub.outputs[0], s, scratch)
        np.exp(s, out=s)
        it.round_stored(step.exp.outputs[0], s, scratch)
        p_sum[b] = it.round_stored(step.p_sum.outputs[0], s.sum(axis=1, keepdims=True))
        pv[b] = it.round_stored(step.pv.outputs[0], matmul(s, v_b))

    workers = worker_count(B)
    if workers <= 1:
        for b in range(B):
            run(b)
    else:  # ufuncs and BLAS release the GIL: one single-threaded BLAS per worker
        with threadpool_limits(limits=1, user_api="blas"), ThreadPoolExecutor(workers) as pool:
            list(pool.map(run, range(B)))
    it.tile_counts["skipped"] += len(skipped)
    it.tile_counts["scored"] += B - len(skipped)
    return [(step.m_new, m_new), (step.p_sum.outputs[0], p_sum), (step.pv.outputs[0], pv)]
