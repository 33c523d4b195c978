"""The gather probe's graphs (study 3): a full-scores and a gather attention program over one chunk, their
inputs, the narrowing of gather indices in a saved program, and the independent NumPy truth of both."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.gather_size import GatherSizing, positive_int
from anelab.core.masks import MASKED, dense_exact_window
from anelab.core.selection import select
from anelab.sidecar.coremltools_import import coremltools_modules

# ---- the probe graphs -----------------------------------------------------------------------------------

# the probe graphs: ``full-scores`` scores every key and adds the folded mask; ``gather`` gathers the
# selected keys. (Not sidecar designs: ``anelab.sidecar.designs`` names those.)
FULL_SCORES, GATHER = PROBE_GRAPHS = ("full-scores", "gather")
# records written before the full-scores probe had its name (the seed's data/ane-gather-probe.json among
# them) call it "dense"; they are read under the new name and never rewritten
RECORDED_PROBE_NAMES = {"dense": FULL_SCORES}


def probe_graph_name(recorded: str) -> str:
    """A probe graph's name as a record states it, read under its current name."""
    return RECORDED_PROBE_NAMES.get(recorded, recorded)


INDEX_LIMITS = {"int16": 2**15 - 1, "uint16": 2**16 - 1, "int8": 2**7 - 1, "uint8": 2**8 - 1}


@dataclass(frozen=True)
class ProbeShape:
    """Shape of one probe: heads, head_dim, chunk (query rows), history, and the selection's budget."""

    heads: int
    head_dim: int
    chunk: int
    history: int
    budget: int

    def __post_init__(self):
        for name in ("heads", "head_dim", "chunk", "budget"):
            object.__setattr__(self, name, positive_int(name, getattr(self, name)))
        if isinstance(self.history, bool) or not isinstance(self.history, (int, np.integer)) or self.history < 0:
            raise AnelabInputError(f"history must be a non-negative integer, got {self.history!r}")
        object.__setattr__(self, "history", int(self.history))
        if self.budget > self.total:
            raise AnelabInputError(
                f"budget ({self.budget}) exceeds total keys ({self.total}); use a budget <= history + chunk"
            )

    @property
    def total(self) -> int:
        return self.history + self.chunk

    def sizing(self) -> GatherSizing:
        return GatherSizing(self.heads, self.head_dim, self.chunk, self.total, self.budget)

    def to_dict(self) -> dict:
        return {
            "heads": self.heads,
            "head_dim": self.head_dim,
            "chunk": self.chunk,
            "history": self.history,
            "total": self.total,
            "budget": self.budget,
        }


def build_full_scores_probe_program(shape: ProbeShape):
    """MIL program ``main(q, k, v, mask) -> out``: the masked attention core over every key (see above)."""

    ct, mb, types = coremltools_modules()
    H, C, T, d = shape.heads, shape.chunk, shape.total, shape.head_dim
    specs = [
        mb.TensorSpec(shape=(H, C, d), dtype=types.fp16),
        mb.TensorSpec(shape=(H, T, d), dtype=types.fp16),
        mb.TensorSpec(shape=(H, T, d), dtype=types.fp16),
        mb.TensorSpec(shape=(C, T), dtype=types.fp16),
    ]

    @mb.program(input_specs=specs, opset_version=ct.target.iOS18)
    def prog(q, k, v, mask):
        q = mb.mul(x=q, y=np.float16(1.0 / np.sqrt(d)))
        scores = mb.matmul(x=q, y=k, transpose_y=True)  # [H, C, T]: the score arena
        probs = mb.softmax(x=mb.add(x=scores, y=mask), axis=-1)
        return mb.matmul(x=probs, y=v, name="out")  # [H, C, d]

    return prog


def build_gather_probe_program(shape: ProbeShape):
    """MIL program ``main(q, k, v, keep_indices, keep_counts) -> out``: score only the gathered keys."""

    ct, mb, types = coremltools_modules()
    H, C, T, d, B = shape.heads, shape.chunk, shape.total, shape.head_dim, shape.budget
    specs = [
        mb.TensorSpec(shape=(H, C, d), dtype=types.fp16),
        mb.TensorSpec(shape=(H, T, d), dtype=types.fp16),
        mb.TensorSpec(shape=(H, T, d), dtype=types.fp16),
        mb.TensorSpec(shape=(C, B), dtype=types.int32),
        mb.TensorSpec(shape=(C,), dtype=types.int32),
    ]

    @mb.program(input_specs=specs, opset_version=ct.target.iOS18)
    def prog(q, k, v, keep_indices, keep_counts):
        kv = mb.concat(values=[k, v], axis=-1)  # [H, T, 2d]
        gathered = mb.gather(x=kv, indices=keep_indices, axis=1)  # [H, C, B, 2d]: one copy per row
        keys, values = mb.split(x=gathered, num_splits=2, axis=-1)  # [H, C, B, d] each
        q = mb.expand_dims(x=mb.mul(x=q, y=np.float16(1.0 / np.sqrt(d))), axes=[2])  # [H, C, 1, d]
        scores = mb.matmul(x=q, y=keys, transpose_y=True)  # [H, C, 1, B]
        slot = np.arange(B, dtype=np.int32)[None, :]  # [1, B]
        valid = mb.less(x=slot, y=mb.expand_dims(x=keep_counts, axes=[1]))  # [C, B]: slot < keep_counts[i]
        bias = mb.mul(x=mb.sub(x=mb.cast(x=valid, dtype="fp16"), y=np.float16(1.0)), y=np.float16(-MASKED))
        probs = mb.softmax(x=mb.add(x=scores, y=mb.expand_dims(x=bias, axes=[1])), axis=-1)
        context = mb.matmul(x=probs, y=values)  # [H, C, 1, d]
        return mb.reshape(x=context, shape=[H, C, d], name="out")

    return prog


def _producers(fn) -> dict:
    producer = {}
    for op in fn.operations:
        for v in op.outputs:
            producer[v.name] = op
    return producer


def index_narrowing(saved, function: str = "main") -> list[dict]:
    """Casts to a narrow integer type on the way into any gather's indices, in a saved program.

    Returns [{"op", "dtype", "limit", "gather"}] — ``limit`` is the largest index the narrowed type
    holds (32,767 for int16). Walks back from each gather/gather_along_axis ``indices`` input through
    its producers to the function inputs.
    """
    fn = saved.mil_function(function)
    producer = _producers(fn)
    found, seen = [], set()
    for op in fn.operations:
        if op.op_type not in ("gather", "gather_along_axis", "gather_nd"):
            continue
        stack = [op.inputs["indices"]]
        while stack:
            var = stack.pop()
            src = producer.get(var.name)
            if src is None or id(src) in seen or src.op_type == "const":
                continue
            seen.add(id(src))
            if src.op_type == "cast":
                dtype = str(src.inputs["dtype"].val)
                if dtype in INDEX_LIMITS:
                    found.append({"op": src.name, "dtype": dtype, "limit": INDEX_LIMITS[dtype], "gather": op.name})
            for v in src.inputs.values():
                stack.extend(v if isinstance(v, (list, tuple)) else [v])
    return found


def check_index_range(narrowing: list[dict], total: int) -> None:
    """Refuse a program whose narrowed gather indices cannot hold position ``total - 1``."""
    for cast in narrowing:
        if total - 1 > cast["limit"]:
            raise AnelabInputError(
                f"the saved gather program narrows its indices to {cast['dtype']} ({cast['op']}), so key positions "
                f"past {cast['limit']:,} would wrap (total {total:,}); convert without common::add_int16_cast or "
                f"keep the coverage <= {cast['limit'] + 1:,}"
            )


def selected_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, keep_indices: np.ndarray, keep_counts: np.ndarray
) -> np.ndarray:
    """Independent NumPy truth for both probes, float64: each row attends to its kept keys only.

    q [H, C, d], k / v [H, T, d], keep_indices [C, budget], keep_counts [C] -> out [H, C, d].
    Row by row: take the row's keep_counts[i] kept keys, softmax their scaled scores, weight values.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    heads, chunk, d = q.shape
    out = np.empty((heads, chunk, d))
    for i in range(chunk):
        kept = np.asarray(keep_indices[i, : int(keep_counts[i])], dtype=np.int64)
        s = np.einsum("hd,hnd->hn", q[:, i], k[:, kept]) / np.sqrt(d)  # [H, n]
        w = np.exp(s - s.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        out[:, i] = np.einsum("hn,hnd->hd", w, v[:, kept])
    return out


@dataclass(eq=False)
class ProbeInputs:
    """Random fp16 q [H, C, d], k / v [H, T, d] and the QSA-shaped selection of the chunk's rows."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    selection: object  # anelab.core.selection.Selection

    def for_graph(self, graph: str, selection=None) -> dict:
        sel = self.selection if selection is None else selection
        if graph == FULL_SCORES:
            return {"q": self.q, "k": self.k, "v": self.v, "mask": sel.mask()}
        return {
            "q": self.q,
            "k": self.k,
            "v": self.v,
            "keep_indices": sel.keep_indices.astype(np.int32),
            "keep_counts": sel.keep_counts.astype(np.int32),
        }


def probe_inputs(shape: ProbeShape, kept_blocks: int, compress_ratio: int, seed: int = 0) -> ProbeInputs:
    """Seeded inputs for a probe; the selection scores the chunk's q against k (``selection.select``)."""

    if dense_exact_window(kept_blocks, compress_ratio) != shape.budget:
        raise AnelabInputError(
            f"budget {shape.budget} is not kept_blocks x compress_ratio + compress_ratio - 1 = "
            f"{dense_exact_window(kept_blocks, compress_ratio)}; build the shape with that budget"
        )
    rng = np.random.default_rng([int(seed), shape.chunk, shape.total])
    q = rng.standard_normal((shape.heads, shape.chunk, shape.head_dim)).astype(np.float16)
    k = rng.standard_normal((shape.heads, shape.total, shape.head_dim)).astype(np.float16)
    v = rng.standard_normal((shape.heads, shape.total, shape.head_dim)).astype(np.float16)
    sel = select(
        q.transpose(1, 0, 2).astype(np.float32),
        k.transpose(1, 0, 2).astype(np.float32),
        shape.history,
        kept_blocks,
        compress_ratio,
    )
    return ProbeInputs(q, k, v, sel)
