"""Verification of a saved sidecar package against the independent NumPy reference.

For every function h<H> the same inputs — random fp16 hidden rows, a K/V history produced by the
reference from random history rows, and the causal mask — go to the saved package (evaluated from
disk with ``anelab.mil_eval``; Core ML on a Mac later) and to ``anelab.reference``. The relative
error ||package - reference|| / ||reference|| of ``attn_out``, ``k_chunk`` and ``v_chunk`` must stay
under ``RELATIVE_ERROR_THRESHOLD`` at a full chunk and at a partial chunk (fewer real rows, padded
and masked; the real rows see only real rows, so their reference is the full chunk's first rows).

The reference runs in float32 by default (``compare.REFERENCE_PRECISION``); each function's reference
is also run in float64 on its first rows, and its own error — reported with the comparisons — must
stay under ``compare.REFERENCE_ERROR_BOUND`` (1e-4), a hundredth of the threshold, or verification
fails. An error measured against the float32 reference differs from the float64 one by at most that
own error, so the cheaper reference cannot hide an error above the threshold.

Negative controls make the check able to fail — each must land *above* the threshold, or the
verification reports itself vacuous and fails:

- ``rope offset +1``: the reference is computed with the chunk starting one position late, so a
  graph with the wrong RoPE positions could not pass (on the chunk's first ``CONTROL_ROWS`` rows);
- ``mask reaches graph``: the *package* is fed a mask that drops a random half of each row's
  visible keys, so a graph that ignored its mask input could not pass.

Compressed weights (``--weights int8|palettize4|int4-block``): the reference above uses the
package's own dequantized projections (``anelab.quantize.dequantized_weights``), so the graph is
still held to the fp16 threshold; one more comparison per function measures the package against
the reference with the checkpoint's (fp16-exact) weights, bounded by ``quantize.ERROR_BOUNDS[mode]``
— a wrong scale or lookup table lands above it.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import numpy as np
from tqdm.auto import tqdm

from anelab import reference
from anelab.errors import AnelabInputError
from anelab.geometry import AttentionGeometry
from anelab.masks import MASKED, causal
from anelab.sidecar import quantize
from anelab.sidecar.compare import (
    OUTPUTS,
    REFERENCE_CHECK_ROWS,
    REFERENCE_ERROR_BOUND,
    REFERENCE_PRECISION,
    RELATIVE_ERROR_THRESHOLD,
    Comparison,
    FunctionInputs,
    load_matching_checkpoint,
    output_errors,
    random_function_inputs,
    reference_error,
    relative_error,
    run_package,
    run_reference,
)
from anelab.sidecar.evaluate import SavedPackage
from anelab.sidecar.format import STATE_NAMES, history_of, read_sidecar_metadata
from anelab.sidecar.prompt import DECODE_STEPS, prompt_reference, run_stateful, stateful_mask
from anelab.weights import AttentionWeights


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

    @property
    def vacuous(self) -> bool:
        return any(c.control and not c.passed for c in self.comparisons)

    @property
    def reference_ok(self) -> bool:
        """The reference's own error stays under REFERENCE_ERROR_BOUND wherever it was measured."""
        return all(max(r["errors"].values()) <= REFERENCE_ERROR_BOUND for r in self.reference_checks)

    @property
    def passed(self) -> bool:
        return bool(self.comparisons) and all(c.passed for c in self.comparisons) and self.reference_ok

    def to_dict(self) -> dict:
        return {
            "package": self.package,
            "checkpoint": self.checkpoint,
            "layer": self.layer,
            "threshold": self.threshold,
            "evaluator": self.evaluator,
            "passed": self.passed,
            "vacuous": self.vacuous,
            "comparisons": [{**asdict(c), "worst": c.worst, "passed": c.passed} for c in self.comparisons],
            "reference_precision": self.reference_precision,
            "reference_checks": self.reference_checks,
            "reference_error_bound": REFERENCE_ERROR_BOUND,
            "seconds": self.seconds,
        }

    def table(self) -> str:
        lines = [
            f"verify {self.package} (layer {self.layer}; reference {self.reference_precision}; "
            f"package via {self.evaluator}; threshold {self.threshold:.0e})",
            f"{'function':<10} {'case':<28} {'rows':>5} " + " ".join(f"{o:>10}" for o in OUTPUTS) + "  result",
        ]
        for c in self.comparisons:
            bound = self.threshold if c.bound is None else c.bound
            margin = f" ({c.worst / bound:.0f}x the bound)" if c.passed else ""
            verdict = (
                (f"ok: control fails{margin}" if c.passed else "VACUOUS")
                if c.control
                else ("ok" if c.passed else "FAIL")
            )
            errs = " ".join(f"{c.errors[o]:>10.2e}" if o in c.errors else f"{'-':>10}" for o in OUTPUTS)
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
        lines.append(
            "PASSED"
            if self.passed
            else ("FAILED: a negative control did not fail — the check is vacuous" if self.vacuous else "FAILED")
        )
        return "\n".join(lines)


def drop_half_mask(mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A copy of an additive mask [C, T] with a random half of each row's visible keys dropped
    (at least one kept per row)."""
    out = mask.copy()
    visible = mask > MASKED / 2
    drop = visible & (rng.random(mask.shape) < 0.5)
    keep_first = np.argmax(visible, axis=1)
    drop[np.arange(mask.shape[0]), keep_first] = False
    np.copyto(out, np.asarray(MASKED, out.dtype), where=drop)
    return out


def partial_rows(chunk: int) -> int:
    """Real rows of the partial-chunk case: about 60 % of the chunk, never the full chunk."""
    return max(1, min(chunk - 1, (chunk * 3) // 5 + 1)) if chunk > 1 else 1


# The rope control's reference runs on the chunk's first rows only: a row's outputs depend only on the
# keys it sees, and a one-position RoPE shift moves every rotated key (k_chunk error ~0.2 on any row), so
# the control fails by a wide margin on these rows (margin printed with the verdict).
CONTROL_ROWS = 512


@contextmanager
def _timed(seconds: dict[str, float], phase: str):
    """Add the wall time of the block to ``seconds[phase]``."""
    t = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - t


def verify_package(
    package: str | os.PathLike,
    checkpoint_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    fp16: bool = True,
    functions: list[str] | None = None,
    precision: str = REFERENCE_PRECISION,
) -> VerifyReport:
    """Verify every function of a saved sidecar against the reference (see module docstring).

    ``precision``: the reference's ("fp32": its own error against fp64 is measured on a slice of every
    function and must stay under ``REFERENCE_ERROR_BOUND``; "fp64": the exact math, slower).
    """
    start = time.perf_counter()
    meta = read_sidecar_metadata(package)
    if meta.graph == "stateful":  # one function per chunk width, K/V in Core ML state
        return verify_stateful_package(package, checkpoint_dir, seed=seed, fp16=fp16)
    checkpoint = load_matching_checkpoint(meta, checkpoint_dir)
    saved = SavedPackage(package)
    names = functions or list(meta.functions)
    for name in names:
        saved.function(name)
    report = VerifyReport(
        str(package),
        str(checkpoint.path),
        meta.layer,
        RELATIVE_ERROR_THRESHOLD,
        "NumPy evaluation of the saved MIL program (" + ("fp16 storage emulated" if fp16 else "fp32") + ")",
        reference_precision=precision,
    )
    seconds = report.seconds
    checkpoint_weights = checkpoint.layer(meta.layer)
    compressed = meta.weights != "fp16"
    with tqdm(total=len(names) * (4 + compressed), desc="verify", unit="case") as bar:
        for name in names:
            with _timed(seconds, "inputs"):
                weights = checkpoint_weights
                if compressed:  # the graph is checked with the weights it stores
                    weights = quantize.dequantized_weights(saved, name, checkpoint_weights)
                rng = np.random.default_rng([seed, history_of(name)])
                inputs = random_function_inputs(
                    name, meta.chunk, weights, checkpoint.geometry, rng, precision=precision
                )
            report.comparisons.extend(
                function_comparisons(
                    saved,
                    inputs,
                    weights,
                    checkpoint.geometry,
                    rng,
                    fp16=fp16,
                    precision=precision,
                    compression=(checkpoint_weights, meta.weights) if compressed else None,
                    progress=bar,
                    seconds=seconds,
                    reference_checks=report.reference_checks,
                )
            )
    if meta.selection_folded:
        with _timed(seconds, "fold check"):
            report.comparisons.extend(fold_comparisons(saved, checkpoint.path, meta, seed=seed))
    seconds["total"] = time.perf_counter() - start
    return report


def function_comparisons(
    saved: SavedPackage,
    inputs: FunctionInputs,
    weights: AttentionWeights,
    geometry: AttentionGeometry,
    rng: np.random.Generator,
    *,
    fp16: bool = True,
    precision: str = "fp64",
    compression: tuple[AttentionWeights, str] | None = None,
    progress=None,
    seconds: dict[str, float] | None = None,
    reference_checks: list[dict] | None = None,
) -> list[Comparison]:
    """One function at a full and a partial chunk, and its two negative controls (and, with
    ``compression`` = (checkpoint weights, mode), what the compression costs).

    The reference runs once at the full chunk (``precision``); with fp32 its own error against an fp64
    run of the first rows is appended to ``reference_checks``. ``progress``: a tqdm bar advanced per
    case; ``seconds``: wall time per phase, accumulated.
    """
    seconds = {} if seconds is None else seconds
    name, C, H = inputs.function, inputs.hidden.shape[0], inputs.history

    def done(case: str) -> None:
        if progress is not None:
            progress.set_postfix_str(f"{name}: {case}", refresh=False)
            progress.update()

    mask = causal(C, H)
    with _timed(seconds, "package"):
        out = run_package(saved, inputs, mask, fp16=fp16)
    with _timed(seconds, "reference"):
        ref = run_reference(inputs, weights, geometry, mask, precision=precision)
    comparisons = [Comparison(name, "full chunk", C, output_errors(out, ref, C))]
    if precision != "fp64" and reference_checks is not None:
        with _timed(seconds, "reference check (fp64 slice)"):
            rows, errors = reference_error(inputs, weights, geometry, mask, ref, REFERENCE_CHECK_ROWS)
        reference_checks.append({"function": name, "rows": rows, "errors": errors})
    done("full chunk")
    # partial chunk: n real rows, padded with zero rows; padded rows' outputs are ignored
    n = partial_rows(C)
    padded = inputs.hidden.copy()
    padded[n:] = 0
    pmask = causal(C, H, valid_rows=n)
    with _timed(seconds, "package"):
        partial_out = run_package(saved, inputs, pmask, hidden=padded, fp16=fp16)
    with _timed(seconds, "reference"):
        partial_ref = _partial_reference(inputs, weights, geometry, mask, pmask, ref, padded, n, precision)
    comparisons.append(Comparison(name, f"partial chunk ({n} of {C})", n, output_errors(partial_out, partial_ref, n)))
    done("partial chunk")
    # negative controls: the reference one position late must miss; so must the package under a changed mask
    rows = min(C, CONTROL_ROWS)
    with _timed(seconds, "reference"):
        wrong_rope = run_reference(inputs, weights, geometry, mask, start=H + 1, precision=precision, rows=rows)
    comparisons.append(
        Comparison(
            name,
            "control: rope offset +1",
            rows,
            output_errors(out, wrong_rope, rows, ("attn_out", "k_chunk")),
            control=True,
        )
    )
    done("control: rope offset +1")
    with _timed(seconds, "control inputs"):
        dropped_mask = drop_half_mask(mask, rng)
    with _timed(seconds, "package"):
        dropped = run_package(saved, inputs, dropped_mask, fp16=fp16)
    comparisons.append(
        Comparison(name, "control: mask reaches graph", C, output_errors(dropped, ref, C, ("attn_out",)), control=True)
    )
    done("control: mask reaches graph")
    if compression is not None:
        with _timed(seconds, "reference"):
            comparisons.append(
                compression_comparison(
                    saved, inputs, compression[0], geometry, compression[1], fp16=fp16, precision=precision, out=out
                )
            )
        done("compression")
    return comparisons


def _partial_reference(inputs, weights, geometry, mask, pmask, ref, padded, n, precision):
    """The reference of a partial chunk's n real rows. When the real rows see exactly what they see in
    the full chunk (padding lies after every real row), these are the full run's first n rows; otherwise
    the reference runs on the padded rows."""
    H = inputs.history
    same = np.array_equal(pmask[:n, : H + n], mask[:n, : H + n]) and not np.any(pmask[:n, H + n :] > MASKED / 2)
    if same and np.array_equal(padded[:n], inputs.hidden[:n]):
        return reference.BlockOutput(ref.attn_out[:n], ref.k_chunk[:, :n], ref.v_chunk[:, :n])
    padded_ref = run_reference(inputs, weights, geometry, pmask, hidden=padded, precision=precision)
    return reference.BlockOutput(padded_ref.attn_out[:n], padded_ref.k_chunk[:, :n], padded_ref.v_chunk[:, :n])


def compression_comparison(
    saved: SavedPackage,
    inputs: FunctionInputs,
    checkpoint_weights: AttentionWeights,
    geometry: AttentionGeometry,
    mode: str,
    *,
    fp16: bool = True,
    precision: str = "fp64",
    out: dict[str, np.ndarray] | None = None,
) -> Comparison:
    """What the compression costs: the package against the reference with the checkpoint's weights
    (``out``: the package's outputs under the causal mask, when already computed)."""
    C = inputs.hidden.shape[0]
    mask = causal(C, inputs.history)
    if out is None:
        out = run_package(saved, inputs, mask, fp16=fp16)
    ref = run_reference(inputs, checkpoint_weights, geometry, mask, precision=precision)
    bound = quantize.ERROR_BOUNDS[mode]
    return Comparison(inputs.function, f"{mode} vs fp16 w. (<={bound:g})", C, output_errors(out, ref, C), bound=bound)


def fold_comparisons(saved: SavedPackage, checkpoint_dir, meta, *, seed: int = 0) -> list[Comparison]:
    """The fold check a sidecar recording ``selectionFolded: true`` gets automatically.

    On its longest history, a synthetic QSA-shaped selection (scored from the real q/k, with the
    recorded compress ratio and at most a quarter of each row's blocks kept) is folded into the mask:
    the package must match the reference under it, the causal-only mask must not, and the selection
    must move the reference enough that the check could fail (else it is vacuous).
    """
    from anelab.sidecar import foldcheck

    indexer = meta.selection_indexer or {}
    ratio = int(indexer.get("compress_ratio", 4))
    case = foldcheck.make_case(saved, checkpoint_dir, history=max(meta.histories), seed=seed)
    visible_blocks = (case.history + 1) // ratio
    kept = max(1, min(int(indexer.get("kept_blocks", 1)), visible_blocks // 4))
    check = foldcheck.fold_check(case, foldcheck.selection_for(case, kept, ratio, seed=seed), strict=False)
    fn, rows = case.function, case.chunk
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


def verify_stateful_package(
    package: str | os.PathLike, checkpoint_dir: str | os.PathLike | None = None, *, seed: int = 0, fp16: bool = True
) -> VerifyReport:
    """Verify a stateful sidecar over a multi-chunk prompt (and decode steps when it has ``c1``):
    the attn_out rows and the whole final cache against the fp64 reference over the prompt, then
    three controls (RoPE one position late, a changed mask, a fresh state per call)."""
    meta = read_sidecar_metadata(package)
    checkpoint = load_matching_checkpoint(meta, checkpoint_dir)
    saved = SavedPackage(package)
    for name in meta.functions:
        saved.function(name)
    geometry, capacity, C = checkpoint.geometry, meta.state_capacity, meta.chunk
    checkpoint_weights = checkpoint.layer(meta.layer)
    weights = checkpoint_weights
    if meta.weights != "fp16":
        weights = quantize.dequantized_weights(saved, meta.functions[0], checkpoint_weights)
    decode_steps = DECODE_STEPS if ("c1" in meta.functions and C != 1) else 0
    prefill = ((capacity - decode_steps) // C) * C
    if prefill == 0:
        raise AnelabInputError(
            f"state capacity {capacity} leaves no room for a chunk of {C} and {decode_steps} decode steps; "
            "re-export with a larger --capacity"
        )
    P = prefill + decode_steps
    label = "+".join(meta.functions)
    report = VerifyReport(
        str(package),
        str(checkpoint.path),
        meta.layer,
        RELATIVE_ERROR_THRESHOLD,
        "NumPy evaluation of the saved MIL program, state carried between calls ("
        + ("fp16 storage emulated" if fp16 else "fp32")
        + ")",
    )
    rng = np.random.default_rng([seed, P])
    hidden = rng.standard_normal((P, geometry.hidden_size)).astype(np.float16)

    def run(**options):
        return run_stateful(saved, hidden, C, capacity, decode_steps=decode_steps, fp16=fp16, **options)

    steps = tqdm(total=4 + (meta.weights != "fp16"), desc="verify stateful", unit="run")
    out, state = run()
    ref = prompt_reference(hidden, weights, geometry)
    report.comparisons.append(
        Comparison(label, f"prompt {prefill}+{decode_steps} rows", P, stateful_errors(out, state, ref))
    )
    steps.update()
    errs = stateful_errors(out, state, prompt_reference(hidden, weights, geometry, start=1))
    report.comparisons.append(
        Comparison(label, "control: rope offset +1", P, {k: errs[k] for k in ("attn_out", "k_chunk")}, control=True)
    )
    steps.update()
    dropped, _ = run(masks=lambda rows, start: drop_half_mask(stateful_mask(rows, start, capacity), rng))
    report.comparisons.append(
        Comparison(
            label, "control: mask reaches graph", P, {"attn_out": relative_error(dropped, ref.attn_out)}, control=True
        )
    )
    steps.update()
    forgetful, _ = run(fresh_state_each_call=True)
    report.comparisons.append(
        Comparison(
            label, "control: state carried", P, {"attn_out": relative_error(forgetful, ref.attn_out)}, control=True
        )
    )
    steps.update()
    if meta.weights != "fp16":
        bound = quantize.ERROR_BOUNDS[meta.weights]
        fp16_ref = prompt_reference(hidden, checkpoint_weights, geometry)
        report.comparisons.append(
            Comparison(
                label, f"{meta.weights} vs fp16 w. (<={bound:g})", P, stateful_errors(out, state, fp16_ref), bound=bound
            )
        )
        steps.update()
    steps.close()
    return report


def stateful_errors(out: np.ndarray, state: dict[str, np.ndarray], ref: reference.BlockOutput) -> dict[str, float]:
    """attn_out rows [P, D], and the whole final cache [Hkv, capacity, d] against the reference K/V
    [Hkv, P, d] padded with zeros (slots past the prompt must stay empty)."""
    P = out.shape[0]
    errs = {"attn_out": relative_error(out, ref.attn_out)}
    for column, name, expected in (("k_chunk", STATE_NAMES[0], ref.k_chunk), ("v_chunk", STATE_NAMES[1], ref.v_chunk)):
        full = np.zeros(state[name].shape)
        full[:, :P] = expected
        errs[column] = relative_error(state[name], full)
    return errs
