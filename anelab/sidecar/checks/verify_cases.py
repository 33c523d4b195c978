"""Verification of a saved sidecar package against the independent NumPy reference.

For every function h<H> the same inputs — random fp16 hidden rows (or, with ``activations``, a real prompt's
post-norm rows at the layer), a K/V history produced by the
reference from random history rows, and the causal mask — go to the saved package (evaluated from
disk with ``anelab.sidecar.mil.evaluate``; Core ML on a Mac later) and to ``anelab.core.reference``. The relative
error ||package - reference|| / ||reference|| of ``attn_out``, ``k_chunk`` and ``v_chunk`` must stay
under ``RELATIVE_ERROR_THRESHOLD`` at a full chunk and at a partial chunk (fewer real rows, padded
and masked; the real rows see only real rows, so their reference is the full chunk's first rows).

The reference runs in float32 by default (``compare.REFERENCE_PRECISION``), in blocks of chunk rows
that score only the keys their rows see (``compare.key_spans``), on parallel threads; each function's
reference is also run in float64 on a slice of its rows (``compare.reference_error``), and its own
error — reported with the comparisons — must stay under ``compare.REFERENCE_ERROR_BOUND`` (1e-4), a
hundredth of the threshold, or verification fails. An error measured against the float32 reference
differs from the float64 one by at most that own error, so the cheaper reference cannot hide an error
above the threshold.

Negative controls make the check able to fail — each must land *above* the threshold, or the
verification reports itself vacuous and fails:

- ``rope offset +N``: the reference is computed with the chunk starting N positions late, N the fewest at which
  the layer's median rotary pair turns a radian (``comparison.rope_control_offset``: 1 position barely moves a
  layer of base 1e6), so a graph with the wrong RoPE positions could not pass (on the first ``CONTROL_ROWS`` rows);
- ``mask reaches graph``: the *package* is fed a mask that drops a random half of each row's
  visible keys, so a graph that ignored its mask input could not pass.

Compressed weights (``--weights int8|palettize4|int4-block``) are judged twice, separately. The graph: the
reference above uses the package's own dequantized projections (``anelab.sidecar.quantize.dequantized_weights``,
each read from the mode's own decompression op — a package recording a compression but storing a projection
plain is refused), so the package is held to the fp16 threshold for computing what it stores; only this
decides ``passed``. The compression: one more comparison per function (``Comparison.cost``) measures the package
against the reference with the checkpoint's uncompressed weights and is reported, never judged — what real
weights lose is measured on the whole model (``anelab.arms.compression_cost``), not bounded by random weights.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import numpy as np

from anelab.checkpoints.checkpoint import Checkpoint
from anelab.core import reference
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.masks import MASKED, causal
from anelab.core.progress import tqdm
from anelab.core.weights import AttentionWeights
from anelab.sidecar import quantize
from anelab.sidecar.backends import open_saved, read_metadata
from anelab.sidecar.checks import foldcheck
from anelab.sidecar.checks.comparison import (
    OUTPUTS,
    REFERENCE_CHECK_ROWS,
    REFERENCE_ERROR_BOUND,
    REFERENCE_PRECISION,
    RELATIVE_ERROR_THRESHOLD,
    Comparison,
    Evaluator,
    FunctionInputs,
    load_matching_checkpoint,
    output_errors,
    random_function_inputs,
    random_history,
    reference_error,
    rope_control_case,
    rope_control_offset,
    run_package,
    run_reference,
)
from anelab.sidecar.format import SidecarMetadata, function_name, history_of
from anelab.sidecar.mil.evaluate import SavedPackage


@dataclass
class VerifyReport:
    package: str
    checkpoint: str
    layer: int
    threshold: float
    evaluator: str
    comparisons: list[Comparison] = field(default_factory=list)
    reference_precision: str = "fp64"
    # the reference's own error against fp64 on a slice: [{function, rows, errors}] (empty when it is fp64)
    reference_checks: list[dict] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per phase (package, reference, ...)
    # the negative controls the package's design declares for this run: (function label, case)
    declared_controls: list[tuple[str, str]] = field(default_factory=list)
    inputs: str = "random fp16 rows"  # what the cases were fed (real attention inputs: said where they came from)
    outputs: tuple[str, ...] = OUTPUTS  # the outputs compared (a block design's own: sidecar.checks.verify_blocks)

    @property
    def vacuous(self) -> bool:
        return any(c.control and not c.passed for c in self.comparisons)

    @property
    def missing_controls(self) -> list[str]:
        """Declared controls that did not run ("function: case"); a report that declares none misses one."""
        ran = {(c.function, c.case) for c in self.comparisons if c.control}
        missing = [f"{f}: {case}" for f, case in self.declared_controls if (f, case) not in ran]
        return missing if self.declared_controls else ["(no control declared)"]

    @property
    def reference_ok(self) -> bool:
        """The reference's own error stays under REFERENCE_ERROR_BOUND wherever it was measured."""
        return all(max(r["errors"].values()) <= REFERENCE_ERROR_BOUND for r in self.reference_checks)

    @property
    def passed(self) -> bool:
        """Every comparison within its bound, every declared control run and failed as it must, the
        reference's own error bounded."""
        return (
            bool(self.comparisons)
            and all(c.passed for c in self.comparisons)
            and not self.missing_controls
            and self.reference_ok
        )

    def to_dict(self) -> dict:
        return {
            "package": self.package,
            "checkpoint": self.checkpoint,
            "layer": self.layer,
            "threshold": self.threshold,
            "evaluator": self.evaluator,
            "inputs": self.inputs,
            "passed": self.passed,
            "vacuous": self.vacuous,
            "declared_controls": [list(d) for d in self.declared_controls],
            "missing_controls": self.missing_controls,
            "comparisons": [{**asdict(c), "worst": c.worst, "passed": c.passed} for c in self.comparisons],
            "reference_precision": self.reference_precision,
            "reference_checks": self.reference_checks,
            "reference_error_bound": REFERENCE_ERROR_BOUND,
            "seconds": self.seconds,
        }

    def table(self) -> str:
        lines = [
            f"verify {self.package} (layer {self.layer}; reference {self.reference_precision}; "
            f"package via {self.evaluator}; threshold {self.threshold:.0e}; inputs: {self.inputs})",
            f"{'function':<10} {'case':<28} {'rows':>5} " + " ".join(f"{o:>10}" for o in self.outputs) + "  result",
        ]
        for c in self.comparisons:
            bound = self.threshold if c.bound is None else c.bound
            margin = f" ({c.worst / bound:.0f}x the bound)" if c.passed else ""
            verdict = (
                (f"ok: control fails{margin}" if c.passed else "VACUOUS")
                if c.control
                else ("reported (not judged)" if c.cost else ("ok" if c.passed else "FAIL"))
            )
            errs = " ".join(f"{c.errors[o]:>10.2e}" if o in c.errors else f"{'-':>10}" for o in self.outputs)
            lines.append(f"{c.function:<10} {c.case:<28} {c.rows:>5} {errs}  {verdict}")
        for r in self.reference_checks:
            errs = " ".join(f"{r['errors'][o]:>10.2e}" for o in OUTPUTS)
            ok = "ok" if max(r["errors"].values()) <= REFERENCE_ERROR_BOUND else "FAIL"
            lines.append(
                f"{r['function']:<10} {'reference ' + self.reference_precision + ' vs fp64':<28} {r['rows']:>5} {errs}  "
                f"{ok} (bound {REFERENCE_ERROR_BOUND:.0e})"
            )
        if self.seconds:
            lines.append("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items()))
        if self.missing_controls:
            lines.append("declared controls that did not run: " + "; ".join(self.missing_controls))
        lines.append(
            "PASSED"
            if self.passed
            else ("FAILED: a negative control did not fail — the check is vacuous" if self.vacuous else "FAILED")
        )
        return "\n".join(lines)


def drop_half_mask(mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A copy of an additive mask [C, T] with a random half of each row's visible keys dropped
    (each key by a fair random bit; at least one kept per row)."""
    out = mask.copy()
    visible = mask > MASKED / 2
    bits = np.unpackbits(np.frombuffer(rng.bytes(-(-mask.size // 8)), np.uint8), count=mask.size)
    drop = visible & bits.reshape(mask.shape).view(bool)
    keep_first = np.argmax(visible, axis=1)
    drop[np.arange(mask.shape[0]), keep_first] = False
    np.copyto(out, np.asarray(MASKED, out.dtype), where=drop)
    return out


def partial_rows(chunk: int) -> int:
    """Real rows of the partial-chunk case: about 60 % of the chunk, never the full chunk."""
    return max(1, min(chunk - 1, (chunk * 3) // 5 + 1)) if chunk > 1 else 1


# The rope control's reference runs on the chunk's first rows only: a row's outputs depend only on the
# keys it sees, and a one-position RoPE shift moves every rotated key (k_chunk error ~0.2 on any row:
# measured 0.21 at hidden 2048 / head_dim 128, 21x the threshold), so the control fails by a wide margin
# on these rows (margin printed with the verdict).
CONTROL_ROWS = 128
# The random history rows come from this stream of the seed (one cache for all functions: a function's
# history is the first H rows), the chunk rows and controls from the function's own [seed, H] stream.
HISTORY_STREAM = 2**32 - 1


def verify_history(
    history: int,
    weights: AttentionWeights,
    *,
    geometry: AttentionGeometry,
    seed: int,
    rope_coverage: int | None,
    precision: str,
) -> tuple[np.ndarray, np.ndarray]:
    """The K/V cache (k, v fp16 [history, Hkv, d]) verify feeds its functions: ``HISTORY_STREAM`` rows
    of the seed projected by the reference; a shorter history is this one's first positions."""
    rng = np.random.default_rng([seed, HISTORY_STREAM])
    return random_history(history, weights, geometry, rng, rope_coverage=rope_coverage, precision=precision)


@contextmanager
def _timed(seconds: dict[str, float], phase: str):
    """Add the wall time of the block to ``seconds[phase]``."""
    t = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - t


def verify_per_history_package(
    package: str | os.PathLike,
    checkpoint: Checkpoint | None = None,
    *,
    seed: int = 0,
    fp16: bool = True,
    functions: list[str] | None = None,
    precision: str = REFERENCE_PRECISION,
    evaluator: Evaluator | None = None,
    progress: bool = True,
    activations: np.ndarray | None = None,
) -> VerifyReport:
    """Verify every function h<H> of a saved dense or tiled sidecar against the reference (module docstring).

    ``activations`` [P, D]: the layer's real attention inputs (post-norm rows of a prompt through the model,
    positions 0 .. P-1) feed the cases in place of random fp16 rows (``function_cases``).

    ``precision``: the reference's ("fp32": its own error against fp64 is measured on a slice of every
    function and must stay under ``REFERENCE_ERROR_BOUND``; "fp64": the exact math, slower).
    ``evaluator``: runs the package's functions instead of the NumPy evaluation (e.g. Core ML on a
    Mac). Every case then also reports the evaluator against the NumPy evaluation of the same package
    and the NumPy evaluation against the reference: three comparisons per output.
    """
    start = time.perf_counter()
    meta = read_metadata(package)
    checkpoint = load_matching_checkpoint(meta, checkpoint)
    saved = open_saved(package)
    names = functions or list(meta.functions)
    for name in names:
        saved.function(name)
    how = saved.description(fp16)
    report = VerifyReport(
        str(package),
        str(checkpoint.path),
        meta.layer,
        RELATIVE_ERROR_THRESHOLD,
        how if evaluator is None else f"{evaluator.name}, beside the NumPy evaluation",
        reference_precision=precision,
        declared_controls=per_history_controls(meta, checkpoint.geometry, names),
    )
    if activations is not None:
        report.inputs = "real attention inputs (the layer's post-norm rows of a prompt)"
    report.seconds["open"] = time.perf_counter() - start
    run = CaseRun(saved, checkpoint.geometry, fp16, precision, evaluator, meta.sliding_window,
                  checkpoint.geometry.window_of(meta.layer), meta.coverage, report.seconds, report.reference_checks)  # fmt: skip
    compressed = meta.weights != "fp16"
    compression = (checkpoint.layer(meta.layer), meta.weights) if compressed else None
    with tqdm(total=len(names) * (4 + compressed), desc="verify", unit="case", disable=not progress) as run.progress:
        for inputs, weights, rng in function_cases(
            meta, checkpoint, saved, names, seed=seed, run=run, activations=activations
        ):
            report.comparisons += function_comparisons(run, inputs, weights, rng, compression=compression)
    if meta.selection_folded:
        with _timed(report.seconds, "fold check"):
            report.comparisons.extend(fold_comparisons(saved, checkpoint, meta, seed=seed, evaluator=evaluator))
    saved.close()
    report.seconds["total"] = time.perf_counter() - start
    return report


@dataclass
class CaseRun:
    """How the cases of one dense or tiled package run: shared by all its functions.

    ``window``: the sliding window the package declares (its mask); ``true_window``: the model's, which
    the reference uses; ``rope_coverage``: the package coverage (dynamic / longrope). ``evaluator``
    (Core ML on a Mac): the package runs through it, and each chunk case also gets the evaluator vs NumPy
    and NumPy vs reference rows. ``seconds``: wall time per phase, accumulated; ``reference_checks``: the
    fp32 reference's own error on a slice of each function, appended; ``progress``: a tqdm bar per case.
    """

    saved: SavedPackage
    geometry: AttentionGeometry
    fp16: bool = True
    precision: str = "fp64"
    evaluator: Evaluator | None = None
    window: int | None = None
    true_window: int | None = None
    rope_coverage: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    reference_checks: list[dict] | None = None
    progress: object = None

    def masks(self, C: int, H: int, valid_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The causal masks [C, H + C] the package is fed (its window) and the reference uses (the model's)."""
        with _timed(self.seconds, "masks"):
            mask = causal(C, H, valid_rows, window=self.window)
            same = self.true_window == self.window
            return mask, mask if same else causal(C, H, valid_rows, window=self.true_window)

    def package(self, inputs: FunctionInputs, mask: np.ndarray, *, numpy: bool = False, **options) -> dict:
        """The package's outputs under ``mask`` (through the evaluator, unless ``numpy``)."""
        with _timed(self.seconds, "package"):
            evaluator = None if numpy else self.evaluator
            return run_package(self.saved, inputs, mask, fp16=self.fp16, evaluator=evaluator, **options)

    def reference(self, inputs: FunctionInputs, weights: AttentionWeights, mask: np.ndarray, **options):
        """The reference's outputs (``reference.BlockOutput``) under ``mask`` at this run's precision."""
        with _timed(self.seconds, "reference"):
            return run_reference(inputs, weights, self.geometry, mask, precision=self.precision,
                                 rope_coverage=self.rope_coverage, **options)  # fmt: skip

    def done(self, function: str, case: str) -> None:
        if self.progress is not None:
            self.progress.set_postfix_str(f"{function}: {case}", refresh=False)
            self.progress.update()


def function_cases(
    meta: SidecarMetadata,
    checkpoint,
    saved: SavedPackage,
    names: list[str],
    *,
    seed: int,
    run: CaseRun,
    activations: np.ndarray | None = None,
):
    """Per function ``h<H>``: (its inputs, the weights its graph holds, its random stream). The K/V history
    comes from one projection shared by every function (its first H positions), or — compressed weights —
    from each function's own stored weights (dequantized).

    ``activations`` [P, D] (the layer's real attention inputs, post-norm, positions 0 .. P-1; P >= the longest
    history + chunk): the history rows are its first H rows and the chunk rows the next C, in place of random
    fp16 rows (``activation_inputs``); the controls' random draws still come from the function's stream."""
    checkpoint_weights = checkpoint.layer(meta.layer)
    compressed = meta.weights != "fp16"
    cache = dict(geometry=checkpoint.geometry, seed=seed, rope_coverage=meta.coverage, precision=run.precision)
    if activations is not None:
        activations = check_activations(activations, checkpoint.geometry, max(map(history_of, names)) + meta.chunk)
    with _timed(run.seconds, "inputs"):
        shared = None if compressed or activations is not None else verify_history(
            max(map(history_of, names)), checkpoint_weights, **cache)  # fmt: skip
    for name in names:
        with _timed(run.seconds, "inputs"):
            weights = (
                quantize.dequantized_weights(saved, name, checkpoint_weights, meta.weights)
                if compressed
                else checkpoint_weights
            )
            rng = np.random.default_rng([seed, history_of(name)])
            if activations is not None:
                inputs = activation_inputs(name, meta.chunk, weights, checkpoint.geometry, activations,
                                           rope_coverage=meta.coverage, precision=run.precision)  # fmt: skip
                yield inputs, weights, rng
                continue
            history = verify_history(history_of(name), weights, **cache) if compressed else shared
            inputs = random_function_inputs(name, meta.chunk, weights, checkpoint.geometry, rng,
                                            rope_coverage=meta.coverage, precision=run.precision, history_kv=history)  # fmt: skip
        yield inputs, weights, rng


def check_activations(activations: np.ndarray, geometry: AttentionGeometry, rows: int) -> np.ndarray:
    """Real attention inputs [P, D] as fp16, refused in one line unless 2-D with D = hidden_size, P >= ``rows``
    and finite in fp16."""
    a = np.asarray(activations)
    if a.ndim != 2 or a.shape[1] != geometry.hidden_size or a.shape[0] < rows:
        raise AnelabInputError(
            f"activations must be [P >= {rows}, {geometry.hidden_size}] (the longest history + a chunk of rows), "
            f"got {list(a.shape)}; use a longer prompt"
        )
    with np.errstate(over="ignore"):
        a16 = a.astype(np.float16)
    if not np.all(np.isfinite(a16)):
        raise AnelabInputError("activations overflow fp16 (a row holds inf or nan); the sidecar could not take them")
    return a16


def activation_inputs(
    function: str,
    chunk: int,
    weights: AttentionWeights,
    geometry: AttentionGeometry,
    activations: np.ndarray,
    *,
    rope_coverage: int | None = None,
    precision: str = "fp64",
) -> FunctionInputs:
    """The inputs of ``h<H>`` from real rows (activations fp16 [P, D], positions 0 .. P-1): the cache is rows
    0 .. H-1 projected by the reference (fp16 [H, Hkv, d]), the chunk rows H .. H+C-1."""
    history = history_of(function)
    k_hist, v_hist = reference.history_kv(activations[:history], weights, geometry, precision,
                                          rope_coverage=rope_coverage)  # fmt: skip
    hidden = np.ascontiguousarray(activations[history : history + chunk])
    return FunctionInputs(function, history, hidden, k_hist.astype(np.float16), v_hist.astype(np.float16))


def function_comparisons(
    run: CaseRun,
    inputs: FunctionInputs,
    weights: AttentionWeights,
    rng: np.random.Generator,
    *,
    compression: tuple[AttentionWeights, str] | None = None,
) -> list[Comparison]:
    """One function at a full and a partial chunk, and its negative controls (and, with ``compression`` =
    (checkpoint weights, mode), what the compression costs: reported, not judged). The reference runs once at the full chunk;
    with fp32 its own error against an fp64 run of a slice of its rows is appended to ``run.reference_checks``."""
    name, C, H = inputs.function, inputs.hidden.shape[0], inputs.history
    mask, ref_mask = run.masks(C, H)
    out = run.package(inputs, mask)
    ref = run.reference(inputs, weights, ref_mask)
    comparisons = [Comparison(name, "full chunk", C, output_errors(out, ref, C))]
    if run.evaluator is not None:
        comparisons += cross_checks(name, "full chunk", C, out, run.package(inputs, mask, numpy=True), ref)
    if run.precision != "fp64" and run.reference_checks is not None:
        with _timed(run.seconds, "reference check (fp64 slice)"):
            rows, errors = reference_error(
                inputs, weights, run.geometry, ref_mask, ref, REFERENCE_CHECK_ROWS, rope_coverage=run.rope_coverage
            )
        run.reference_checks.append({"function": name, "rows": rows, "errors": errors})
    run.done(name, "full chunk")
    comparisons += partial_chunk_comparisons(run, inputs, weights, ref_mask, ref)
    comparisons += negative_controls(run, inputs, weights, rng, out, ref, (mask, ref_mask))
    if compression is not None:
        comparisons.append(compression_comparison(run, inputs, *compression, out=None if run.evaluator else out))
        run.done(name, "compression")
    return comparisons


def partial_chunk_comparisons(
    run: CaseRun, inputs: FunctionInputs, weights: AttentionWeights, ref_mask: np.ndarray, ref
) -> list[Comparison]:
    """The partial chunk: ``partial_rows(C)`` real rows, padded with zero rows whose outputs are ignored
    (``ref_mask`` / ``ref``: the full chunk's reference mask and outputs)."""
    name, C, H = inputs.function, inputs.hidden.shape[0], inputs.history
    n = partial_rows(C)
    padded = inputs.hidden.copy()
    padded[n:] = 0
    pmask, ref_pmask = run.masks(C, H, n)
    out = run.package(inputs, pmask, hidden=padded)
    with _timed(run.seconds, "reference"):
        pref = _partial_reference(
            inputs, weights, run.geometry, ref_mask, ref_pmask, ref, padded, n, run.precision, run.rope_coverage
        )
    comparisons = [Comparison(name, f"partial chunk ({n} of {C})", n, output_errors(out, pref, n))]
    if run.evaluator is not None:
        numpy_out = run.package(inputs, pmask, hidden=padded, numpy=True)
        comparisons += cross_checks(name, f"partial ({n} of {C})", n, out, numpy_out, pref)
    run.done(name, "partial chunk")
    return comparisons


def negative_controls(
    run: CaseRun,
    inputs: FunctionInputs,
    weights: AttentionWeights,
    rng: np.random.Generator,
    out: dict[str, np.ndarray],
    ref: reference.BlockOutput,
    masks: tuple[np.ndarray, np.ndarray],
) -> list[Comparison]:
    """The controls one function must fail: the reference ``rope_control_offset`` positions late (``out`` against it, on
    the first ``CONTROL_ROWS`` rows; not on a NoPE layer), the package under a mask with half its
    visible keys dropped, and — when the model's window hides keys here — the package without the
    window. ``out``/``ref``: the package's and the reference's full-chunk outputs; ``masks``: the
    causal masks [C, H + C] with the package's and the model's window."""
    name, C, H = inputs.function, inputs.hidden.shape[0], inputs.history
    mask, ref_mask = masks
    controls = []
    if run.geometry.uses_rope(weights.layer):  # a NoPE layer (SmolLM3) has no positions to get wrong
        rows = min(C, CONTROL_ROWS)
        offset = rope_control_offset(run.geometry, weights.layer, run.rope_coverage)
        wrong_rope = run.reference(inputs, weights, ref_mask, start=H + offset, rows=rows)
        errors = output_errors(out, wrong_rope, rows, ("attn_out", "k_chunk"))
        controls.append(Comparison(name, rope_control_case(offset), rows, errors, control=True))
    run.done(name, "control: rope offset")
    with _timed(run.seconds, "control inputs"):
        dropped_mask = drop_half_mask(mask, rng)
    dropped = run.package(inputs, dropped_mask)
    errors = output_errors(dropped, ref, C, ("attn_out",))
    controls.append(Comparison(name, "control: mask reaches graph", C, errors, control=True))
    run.done(name, "control: mask reaches graph")
    if run.true_window is not None and run.true_window < H + C:  # the window drops keys within this function
        errors = output_errors(run.package(inputs, causal(C, H)), ref, C, ("attn_out",))
        controls.append(Comparison(name, "control: window dropped", C, errors, control=True))
    return controls


def _partial_reference(inputs, weights, geometry, mask, pmask, ref, padded, n, precision, rope_coverage=None):
    """The reference of a partial chunk's n real rows. When the real rows see exactly what they see in
    the full chunk (padding lies after every real row), these are the full run's first n rows; otherwise
    the reference runs on the padded rows."""
    H = inputs.history
    same = np.array_equal(pmask[:n, : H + n], mask[:n, : H + n]) and not np.any(pmask[:n, H + n :] > MASKED / 2)
    if same and np.array_equal(padded[:n], inputs.hidden[:n]):
        return reference.BlockOutput(ref.attn_out[:n], ref.k_chunk[:, :n], ref.v_chunk[:, :n])
    padded_ref = run_reference(
        inputs, weights, geometry, pmask, hidden=padded, precision=precision, rope_coverage=rope_coverage
    )
    return reference.BlockOutput(padded_ref.attn_out[:n], padded_ref.k_chunk[:, :n], padded_ref.v_chunk[:, :n])


def compression_comparison(
    run: CaseRun,
    inputs: FunctionInputs,
    checkpoint_weights: AttentionWeights,
    mode: str,
    *,
    out: dict[str, np.ndarray] | None = None,
) -> Comparison:
    """What the compression costs: the package against the reference with the checkpoint's uncompressed weights
    (``out``: the package's NumPy outputs under the causal mask, when already computed); reported, not judged."""
    C, H = inputs.hidden.shape[0], inputs.history
    if out is None:
        out = run.package(inputs, causal(C, H, window=run.window), numpy=True)
    ref = run.reference(inputs, checkpoint_weights, causal(C, H, window=run.true_window))
    return compression_row(inputs.function, mode, C, output_errors(out, ref, C))


def cross_checks(
    function: str, case: str, rows: int, device: dict, numpy_out: dict, ref: reference.BlockOutput
) -> list[Comparison]:
    """The evaluator against the NumPy evaluation of the same package, and NumPy against the reference."""
    names = tuple(o for o in OUTPUTS if o in device and o in numpy_out)
    numpy_as_ref = reference.BlockOutput(**{o: np.asarray(numpy_out[o], np.float64) for o in OUTPUTS})
    return [
        Comparison(function, f"{case}: device vs NumPy", rows, output_errors(device, numpy_as_ref, rows, names)),
        Comparison(function, f"{case}: NumPy vs ref.", rows, output_errors(numpy_out, ref, rows)),
    ]


def fold_comparisons(
    saved: SavedPackage, checkpoint: Checkpoint, meta, *, seed: int = 0, evaluator: Evaluator | None = None
) -> list[Comparison]:
    """The fold check a sidecar recording ``selectionFolded: true`` gets automatically.

    On its longest history, a synthetic QSA-shaped selection (scored from the real q/k, with the
    recorded compress ratio and at most a quarter of each row's blocks kept) is folded into the mask:
    the package must match the reference under it, the causal-only mask must not, and the selection
    must move the reference enough that the check could fail (else it is vacuous). With an
    ``evaluator`` the package runs through it (Core ML on a Mac).
    """

    indexer = meta.selection_indexer or {}
    ratio = int(indexer.get("compress_ratio", 4))
    history = fold_history(meta)
    kept = max(1, min(int(indexer.get("kept_blocks", 1)), (history + 1) // ratio // 4))
    if meta.state_functions:  # through the state: the cache filled by the package's own calls (stateful-tiled)
        check = foldcheck.stateful_tiled_fold_check(
            saved, checkpoint, kept_blocks=kept, compress_ratio=ratio, seed=seed
        )
    else:
        case = foldcheck.make_case(saved, checkpoint, history=history, seed=seed)
        selection = foldcheck.selection_for(case, kept, ratio, seed=seed)
        check = foldcheck.fold_check(case, selection, strict=False, evaluator=evaluator)
    fn, rows = fold_label(meta), meta.chunk
    return [
        Comparison(fn, f"fold: {kept} blocks x {ratio} kept", rows, {"attn_out": check.fold_error}),
        Comparison(fn, "control: causal-only mask", rows, {"attn_out": check.causal_off}, control=True),
        Comparison(
            fn,
            "control: selection moves ref.",
            rows,
            {"attn_out": check.moved},
            control=True,
            bound=foldcheck.MIN_MOVE_OVER_THRESHOLD * RELATIVE_ERROR_THRESHOLD,
        ),
    ]


def fold_history(meta: SidecarMetadata) -> int:
    """The chunk start the fold check runs at: the longest history (per-history designs), or the last
    whole chunk of the state (stateful-tiled)."""
    return meta.state_capacity - meta.chunk if meta.state_functions else max(meta.histories)


def fold_label(meta: SidecarMetadata) -> str:
    """The function label of the fold check's rows."""
    return "+".join(meta.state_functions) if meta.state_functions else function_name(fold_history(meta))


def per_history_controls(
    meta: SidecarMetadata, geometry: AttentionGeometry, functions: list[str]
) -> list[tuple[str, str]]:
    """The negative controls a dense or tiled package declares, per verified function ``h<H>``: RoPE
    ``rope_control_offset`` positions late (unless the layer is NoPE), half the mask dropped, the window dropped
    (when the model's window hides keys within the function); and the fold check's two on the longest history when the
    package records ``selectionFolded``."""
    window = geometry.window_of(meta.layer)
    declared = []
    for name in functions:
        if geometry.uses_rope(meta.layer):
            declared.append((name, rope_control_case(rope_control_offset(geometry, meta.layer, meta.coverage))))
        declared.append((name, "control: mask reaches graph"))
        if window is not None and window < history_of(name) + meta.chunk:
            declared.append((name, "control: window dropped"))
    return declared + fold_controls_declared(meta)


def fold_controls_declared(meta: SidecarMetadata) -> list[tuple[str, str]]:
    """The fold check's two controls when the package records ``selectionFolded``."""
    if not meta.selection_folded:
        return []
    return [(fold_label(meta), "control: causal-only mask"), (fold_label(meta), "control: selection moves ref.")]


def compression_row(label: str, mode: str, rows: int, errors: dict[str, float]) -> Comparison:
    """What a compression costs: the package against the reference with the checkpoint's uncompressed weights
    (``Comparison.cost``: reported, never judged)."""
    return Comparison(label, f"cost: {mode} vs uncompressed", rows, errors, cost=True)
