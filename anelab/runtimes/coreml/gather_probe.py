"""The gather probe run: each probe graph built, saved, inspected and evaluated from disk against the NumPy
truth (``anelab probe``), and on a Mac its ANE op assignment, load and predict times."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from anelab.core.errors import AnelabInputError
from anelab.core.gather_size import positive_int
from anelab.core.masks import dense_exact_window
from anelab.core.output_paths import require_output_dir
from anelab.core.records import make_record
from anelab.core.selection import select
from anelab.runtimes.coreml import timing
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD, relative_error
from anelab.sidecar.export import convert_program
from anelab.sidecar.graphs.probe_graphs import (
    FULL_SCORES,
    PROBE_GRAPHS,
    ProbeInputs,
    ProbeShape,
    build_full_scores_probe_program,
    build_gather_probe_program,
    check_index_range,
    index_narrowing,
    probe_inputs,
    selected_attention,
)
from anelab.sidecar.mil.evaluate import SavedPackage, evaluate


@dataclass
class ProbeResult:
    """One saved probe graph, inspected and evaluated from disk.

    op_counts: non-const MIL ops by type in the saved program; largest_intermediate_bytes: the
    biggest tensor any op produces (fp16 bytes); arena_bytes: the analytic size of the graph's
    defining tensor (full-scores: scores [H, C, T]; gather: gathered keys + values [H, C, budget, 2d]).
    relative_error: ||package - selected_attention|| / ||selected_attention||;
    control_error: the same with the package fed a different (seeded random-score) selection —
    a negative control that must land above the threshold.
    numpy_eval_seconds: wall time of ``sidecar.mil.evaluate`` on this machine (NumPy, not the ANE).
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

    if not results:
        raise AnelabInputError("no probe results to record")
    return make_record(
        "gather_probe_numpy",
        {
            "shape": results[0].shape.to_dict(),
            "repeats": int(repeats),
            "evaluator": "anelab.sidecar.mil.evaluate (NumPy, fp16 storage emulated)",
        },
        {"rows": [r.to_dict() for r in results]},
        unknown=["ANE op assignment, load and predict times (need a Mac; see anelab.runtimes.coreml.timing)"],
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
    """On a Mac: ANE op assignment, load and predict time of each saved probe (``anelab.runtimes.coreml.timing``).

    results must keep their packages (``probe(..., out_dir=...)``). Returns one dict per probe:
    {"graph", "chunk", "assignment", "load", "predict"} — a predict that fails is recorded as
    {"error": ...}, like the seed's chunk-64 gather. clock: ``anelab.runtimes.coreml.timing``'s clock (default
    ``time.perf_counter``; tests pass a fake runtime's clock). Each timing record is also written to
    ``out_dir``.
    """
    import time

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
