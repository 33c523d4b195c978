"""Study 3's back-end: would gathering the selected keys beat the dense graph? Sizing (bytes of the dense
score matrix vs gathered keys, crossovers) and the probe graphs (a full-scores and a gather attention program
built, saved and evaluated from disk, timed on a Mac)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.geometry import FP16_BYTES
from anelab.core.masks import MASKED
from anelab.core.output_paths import require_output_dir


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise AnelabInputError(f"{name} must be a positive integer, got {value!r}")
    if int(value) <= 0:
        raise AnelabInputError(f"{name} must be a positive integer, got {value}")
    return int(value)


def _gather_heads(heads: int, kv_heads) -> int:
    if kv_heads is None:
        return heads
    kv_heads = positive_int("kv_heads", kv_heads)
    if heads % kv_heads:
        raise AnelabInputError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    return kv_heads


@dataclass(frozen=True)
class GatherSizing:
    """Memory of the dense score matrix against a gather graph's gathered keys and values.

    heads: query heads; head_dim; chunk: query rows; total: keys per row (history + chunk);
    budget: keys gathered per row (anelab.core.selection's budget).
    kv_heads: None (default) — every query head materialises its own gathered keys, as the seed
        sizes it; an integer — the selection is shared by each GQA group, so keys are gathered once
        per KV head.
    """

    heads: int
    head_dim: int
    chunk: int
    total: int
    budget: int
    kv_heads: int | None = None
    dtype_bytes: int = FP16_BYTES

    def __post_init__(self):
        for name in ("heads", "head_dim", "chunk", "total", "budget", "dtype_bytes"):
            object.__setattr__(self, name, positive_int(name, getattr(self, name)))
        _gather_heads(self.heads, self.kv_heads)
        if self.total < self.chunk:
            raise AnelabInputError(
                f"total ({self.total}) is history + chunk, so it cannot be below the chunk ({self.chunk})"
            )
        if self.budget > self.total:
            raise AnelabInputError(
                f"budget ({self.budget}) exceeds the {self.total} keys a row can see; use a budget <= total"
            )

    @property
    def gather_heads(self) -> int:
        """Heads whose keys are materialised by the gather: kv_heads if given, else heads."""
        return _gather_heads(self.heads, self.kv_heads)

    @property
    def dense_score_shape(self) -> tuple[int, int, int]:
        return (self.heads, self.chunk, self.total)

    @property
    def gather_key_shape(self) -> tuple[int, int, int, int]:
        return (self.gather_heads, self.chunk, self.budget, self.head_dim)

    @property
    def dense_score_bytes(self) -> int:
        """[heads, chunk, total] scores."""
        return self.heads * self.chunk * self.total * self.dtype_bytes

    @property
    def gather_key_bytes(self) -> int:
        """[gather_heads, chunk, budget, head_dim] gathered keys."""
        return self.gather_heads * self.chunk * self.budget * self.head_dim * self.dtype_bytes

    @property
    def gather_value_bytes(self) -> int:
        """[gather_heads, chunk, budget, head_dim] gathered values (same shape as the keys)."""
        return self.gather_key_bytes

    @property
    def gather_score_bytes(self) -> int:
        """[heads, chunk, budget] scores of the gathered keys (small beside the keys)."""
        return self.heads * self.chunk * self.budget * self.dtype_bytes

    @property
    def ratio(self) -> float:
        """gather_key_bytes / dense_score_bytes."""
        return self.gather_key_bytes / self.dense_score_bytes

    @property
    def gather_keys_smaller(self) -> bool:
        """True when the gathered keys alone take fewer bytes than the dense score matrix."""
        return self.gather_key_bytes < self.dense_score_bytes

    def to_dict(self) -> dict:
        return {
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "gather_heads": self.gather_heads,
            "head_dim": self.head_dim,
            "chunk": self.chunk,
            "total": self.total,
            "budget": self.budget,
            "dtype_bytes": self.dtype_bytes,
            "dense_score_bytes": self.dense_score_bytes,
            "gather_key_bytes": self.gather_key_bytes,
            "gather_value_bytes": self.gather_value_bytes,
            "gather_score_bytes": self.gather_score_bytes,
            "ratio": self.ratio,
            "gather_keys_smaller": self.gather_keys_smaller,
            "crossover_budget": crossover_budget(self.heads, self.head_dim, self.total, kv_heads=self.kv_heads),
        }


def size(heads: int, head_dim: int, chunk: int, total: int, budget: int, kv_heads: int | None = None) -> dict:
    """``GatherSizing(...).to_dict()``: exact byte counts and the gathered-key / dense-score ratio."""
    return GatherSizing(heads, head_dim, chunk, total, budget, kv_heads=kv_heads).to_dict()


def crossover_budget(
    heads: int, head_dim: int, total: int, kv_heads: int | None = None, include_values: bool = False
) -> int:
    """Largest budget for which gathering takes fewer bytes than the dense score matrix (0: none).

    Keys only: gather_heads * chunk * budget * head_dim < heads * chunk * total
               <=> budget < heads * total / (gather_heads * head_dim)
               <=> budget <= (heads * total - 1) // (gather_heads * head_dim)     (integers)
    include_values doubles the gathered side (keys and values). Independent of chunk and dtype.
    """
    heads, head_dim, total = (
        positive_int(n, v) for n, v in (("heads", heads), ("head_dim", head_dim), ("total", total))
    )
    per_key = _gather_heads(heads, kv_heads) * head_dim * (2 if include_values else 1)
    return (heads * total - 1) // per_key


def crossover_total(
    heads: int, head_dim: int, budget: int, kv_heads: int | None = None, include_values: bool = False
) -> int:
    """Smallest total (history + chunk) at which gathering ``budget`` keys takes fewer bytes than dense.

    Same inequality solved for total: total > gather_heads * budget * head_dim / heads
    <=> total >= (gather_heads * budget * head_dim * factor) // heads + 1.
    """
    heads, head_dim, budget = (
        positive_int(n, v) for n, v in (("heads", heads), ("head_dim", head_dim), ("budget", budget))
    )
    per_key = _gather_heads(heads, kv_heads) * head_dim * (2 if include_values else 1)
    return (per_key * budget) // heads + 1


def sizing_table(
    chunks,
    budgets,
    *,
    heads: int,
    head_dim: int,
    history: int | None = None,
    total: int | None = None,
    kv_heads: int | None = None,
) -> list[dict]:
    """One ``size`` row per (chunk, budget), for plotting.

    Give exactly one of ``history`` (total = history + chunk per row) or ``total`` (fixed). A budget
    above a row's total is clipped to the total (a row cannot keep more keys than it sees) and the
    row records ``budget_clipped``.
    """
    if (history is None) == (total is None):
        raise AnelabInputError("give exactly one of history (total = history + chunk) or total")
    if history is not None and (isinstance(history, bool) or int(history) < 0):
        raise AnelabInputError(f"history must be >= 0, got {history}")
    rows = []
    for chunk in chunks:
        chunk = positive_int("chunk", chunk)
        row_total = positive_int("total", int(history) + chunk if history is not None else total)
        for budget in budgets:
            requested = positive_int("budget", budget)
            row = size(heads, head_dim, chunk, row_total, min(requested, row_total), kv_heads=kv_heads)
            row["budget_requested"] = requested
            row["budget_clipped"] = requested > row_total
            rows.append(row)
    return rows


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
    from anelab.sidecar.coremltools_import import coremltools_modules

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
    from anelab.sidecar.coremltools_import import coremltools_modules

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
    from anelab.core.masks import dense_exact_window
    from anelab.core.selection import select

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


@dataclass
class ProbeResult:
    """One saved probe graph, inspected and evaluated from disk.

    op_counts: non-const MIL ops by type in the saved program; largest_intermediate_bytes: the
    biggest tensor any op produces (fp16 bytes); arena_bytes: the analytic size of the graph's
    defining tensor (full-scores: scores [H, C, T]; gather: gathered keys + values [H, C, budget, 2d]).
    relative_error: ||package - selected_attention|| / ||selected_attention||;
    control_error: the same with the package fed a different (seeded random-score) selection —
    a negative control that must land above the threshold.
    numpy_eval_seconds: wall time of ``mil_eval.evaluate`` on this machine (NumPy, not the ANE).
    """

    graph: str
    shape: ProbeShape
    package: Path
    op_counts: dict
    largest_intermediate_bytes: int
    arena_bytes: int
    index_narrowing: list
    relative_error: float
    control_error: float
    threshold: float
    numpy_eval_seconds: list

    @property
    def ops(self) -> int:
        return int(sum(self.op_counts.values()))

    @property
    def agrees(self) -> bool:
        return self.relative_error < self.threshold < self.control_error

    def to_dict(self) -> dict:
        secs = sorted(self.numpy_eval_seconds)
        return {
            "graph": self.graph,
            **self.shape.to_dict(),
            "package": self.package.name,
            "ops": self.ops,
            "op_counts": dict(self.op_counts),
            "largest_intermediate_bytes": self.largest_intermediate_bytes,
            "arena_bytes": self.arena_bytes,
            "index_narrowing": list(self.index_narrowing),
            "relative_error": self.relative_error,
            "control_error": self.control_error,
            "threshold": self.threshold,
            "agrees": self.agrees,
            "numpy_eval_seconds": list(self.numpy_eval_seconds),
            "numpy_eval_min_s": secs[0] if secs else None,
            "numpy_eval_median_s": secs[len(secs) // 2] if secs else None,
        }


def save_probe(graph: str, shape: ProbeShape, out_dir) -> Path:
    """Build one probe graph and save it as ``out_dir/probe_<graph>_c<chunk>_t<total>_b<budget>.mlpackage``
    (fp16 mlprogram, macOS 15 — the exporter's ``convert_program``)."""
    from anelab.sidecar.export import convert_program

    if graph not in PROBE_GRAPHS:
        raise AnelabInputError(f"unknown probe graph {graph!r}; use one of {', '.join(PROBE_GRAPHS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prog = build_full_scores_probe_program(shape) if graph == FULL_SCORES else build_gather_probe_program(shape)
    dest = out_dir / f"probe_{graph}_c{shape.chunk}_t{shape.total}_b{shape.budget}.mlpackage"
    tmp = out_dir / f".{dest.name}.{os.getpid()}.tmp.mlpackage"
    shutil.rmtree(tmp, ignore_errors=True)
    convert_program(prog, tmp)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def run_probe(
    graph: str, shape: ProbeShape, inputs: ProbeInputs, out_dir, *, repeats: int = 3, control_seed: int = 1
) -> ProbeResult:
    """Save one probe graph, check its indices, evaluate it from disk ``repeats`` times against
    ``selected_attention`` and against a wrong selection (the negative control)."""
    import time

    from anelab.core.selection import select
    from anelab.sidecar.compare import RELATIVE_ERROR_THRESHOLD, relative_error
    from anelab.sidecar.evaluate import SavedPackage, evaluate

    repeats = positive_int("repeats", repeats)
    path = save_probe(graph, shape, out_dir)
    saved = SavedPackage(path)
    narrowing = index_narrowing(saved)
    check_index_range(narrowing, shape.total)
    sel = inputs.selection
    truth = selected_attention(inputs.q, inputs.k, inputs.v, sel.keep_indices, sel.keep_counts)
    feed = inputs.for_graph(graph)
    seconds, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = evaluate(saved, "main", feed)["out"]
        seconds.append(time.perf_counter() - start)
    wrong = select(
        inputs.q.transpose(1, 0, 2),
        inputs.k.transpose(1, 0, 2),
        shape.history,
        sel.kept_blocks,
        sel.compress_ratio,
        score="random",
        seed=control_seed,
    )
    control = evaluate(saved, "main", inputs.for_graph(graph, wrong))["out"]
    sizing = shape.sizing()
    arena = sizing.dense_score_bytes if graph == FULL_SCORES else sizing.gather_key_bytes + sizing.gather_value_bytes
    info = saved.function("main")
    return ProbeResult(
        graph,
        shape,
        path,
        dict(info.op_counts),
        int(info.largest_intermediate_bytes),
        int(arena),
        narrowing,
        relative_error(out, truth),
        relative_error(control, truth),
        RELATIVE_ERROR_THRESHOLD,
        seconds,
    )


def probe(
    chunk: int,
    *,
    heads: int = 4,
    head_dim: int = 64,
    history: int | None = None,
    kept_blocks: int = 4,
    compress_ratio: int = 4,
    repeats: int = 3,
    out_dir=None,
    seed: int = 0,
    graphs: tuple[str, ...] = PROBE_GRAPHS,
) -> list[ProbeResult]:
    """Build, save and evaluate the full-scores and gather probes at one chunk (``anelab probe``).

    history defaults to 3 x chunk (total = 4 x chunk); the budget is the indexer's
    kept_blocks x compress_ratio + compress_ratio - 1. out_dir: where the packages go (default: a
    temporary directory, removed afterwards — the results keep the package names only).
    """
    import tempfile

    from anelab.core.masks import dense_exact_window

    chunk = positive_int("chunk", chunk)
    if out_dir is not None:  # refused before the probes are built
        require_output_dir(out_dir)
    history = 3 * chunk if history is None else history
    shape = ProbeShape(heads, head_dim, chunk, history, dense_exact_window(kept_blocks, compress_ratio))
    inputs = probe_inputs(shape, kept_blocks, compress_ratio, seed)
    cleanup = out_dir is None
    out = Path(tempfile.mkdtemp(prefix=".anelab-probe-")) if cleanup else Path(out_dir)
    try:
        return [run_probe(g, shape, inputs, out, repeats=repeats) for g in graphs]
    finally:
        if cleanup:
            shutil.rmtree(out, ignore_errors=True)


def probe_table(results: list[ProbeResult]) -> str:
    """Plain-text table of probe results (op counts, bytes, agreement, NumPy timing)."""
    lines = [
        f"{'chunk':>5} {'graph':<6} {'ops':>4} {'largest tensor':>15} {'arena':>13} {'rel err':>9} "
        f"{'control':>8} {'agrees':>6} {'int16 idx':>9} {'numpy eval':>11}"
    ]
    for r in results:
        d = r.to_dict()
        lines.append(
            f"{r.shape.chunk:>5} {r.graph:<6} {r.ops:>4} {r.largest_intermediate_bytes:>15,} {r.arena_bytes:>13,} "
            f"{r.relative_error:>9.2e} {r.control_error:>8.2f} {str(r.agrees).lower():>6} "
            f"{'yes' if r.index_narrowing else 'no':>9} {d['numpy_eval_median_s']:>10.4f}s"
        )
    lines.append(
        "numpy eval: median wall time of the NumPy evaluation of the saved program on this machine, not the ANE"
    )
    return "\n".join(lines)


def probe_record(results: list[ProbeResult], repeats: int) -> dict:
    """A measured record (kind ``gather_probe_numpy``) of probe results."""
    from anelab.core.records import make_record

    if not results:
        raise AnelabInputError("no probe results to record")
    return make_record(
        "gather_probe_numpy",
        {
            "shape": results[0].shape.to_dict(),
            "repeats": int(repeats),
            "evaluator": "anelab.sidecar.evaluate (NumPy, fp16 storage emulated)",
        },
        {"rows": [r.to_dict() for r in results]},
        unknown=["ANE op assignment, load and predict times (need a Mac; see anelab.runtimes.timing)"],
    )


def measure_probes_on_runtime(
    runtime,
    results: list[ProbeResult],
    inputs: ProbeInputs,
    out_dir: Path,
    *,
    compute_units: str = "cpu_and_ne",
    repeats: int = 3,
    clock=None,
) -> list[dict]:
    """On a Mac: ANE op assignment, load and predict time of each saved probe (``anelab.runtimes.timing``).

    results must keep their packages (``probe(..., out_dir=...)``). Returns one dict per probe:
    {"graph", "chunk", "assignment", "load", "predict"} — a predict that fails is recorded as
    {"error": ...}, like the seed's chunk-64 gather. clock: ``anelab.runtimes.timing``'s clock (default
    ``time.perf_counter``; tests pass a fake runtime's clock). Each timing record is also written to
    ``out_dir``.
    """
    import time

    from anelab.runtimes import timing

    runtime.require_available()
    clock = time.perf_counter if clock is None else clock
    rows = []
    for r in results:
        assignment = runtime.compute_plan_assignment(r.package, compute_units)
        load = timing.time_load(
            runtime, r.package, None, compute_units, cold=True, repeats=repeats, clock=clock, out_dir=out_dir
        )
        predict = timing.time_predict(
            runtime,
            r.package,
            None,
            inputs.for_graph(r.graph),
            [compute_units],
            repeats=repeats,
            clock=clock,
            out_dir=out_dir,
        )
        rows.append(
            {
                "graph": r.graph,
                "chunk": r.shape.chunk,
                "assignment": assignment,
                "load": load["results"],
                "predict": predict["results"][compute_units],
            }
        )
    return rows
