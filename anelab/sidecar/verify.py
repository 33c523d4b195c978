"""Verification of a saved sidecar package against the independent NumPy reference.

For every function h<H> the same inputs — random fp16 hidden rows, a K/V history produced by the
reference from random history rows, and the causal mask — go to the saved package (evaluated from
disk with ``anelab.mil_eval``; Core ML on a Mac later) and to ``anelab.reference`` in float64. The
relative error ||package - reference|| / ||reference|| of ``attn_out``, ``k_chunk`` and ``v_chunk``
must stay under ``RELATIVE_ERROR_THRESHOLD`` at a full chunk and at a partial chunk (fewer real
rows, padded and masked).

Negative controls make the check able to fail — each must land *above* the threshold, or the
verification reports itself vacuous and fails:

- ``rope offset +1``: the reference is computed with the chunk starting one position late, so a
  graph with the wrong RoPE positions could not pass;
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from tqdm.auto import tqdm

from anelab import reference
from anelab.errors import AnelabInputError
from anelab.hf.checkpoint import load_checkpoint
from anelab.masks import MASKED, causal
from anelab.sidecar.compare import OUTPUTS, RELATIVE_ERROR_THRESHOLD, Comparison, relative_error
from anelab.sidecar.evaluate import SavedPackage, evaluate
from anelab.sidecar.format import history_of, read_sidecar_metadata
from anelab.sidecar.prompt import DECODE_STEPS, run_stateful, stateful_mask


@dataclass
class VerifyReport:
    package: str
    checkpoint: str
    layer: int
    threshold: float
    evaluator: str
    comparisons: list[Comparison] = field(default_factory=list)

    @property
    def vacuous(self) -> bool:
        return any(c.control and not c.passed for c in self.comparisons)

    @property
    def passed(self) -> bool:
        return bool(self.comparisons) and all(c.passed for c in self.comparisons)

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
        }

    def table(self) -> str:
        lines = [
            f"verify {self.package} (layer {self.layer}; reference fp64; package via {self.evaluator}; "
            f"threshold {self.threshold:.0e})",
            f"{'function':<10} {'case':<28} {'rows':>5} " + " ".join(f"{o:>10}" for o in OUTPUTS) + "  result",
        ]
        for c in self.comparisons:
            verdict = ("ok: control fails" if c.passed else "VACUOUS") if c.control else ("ok" if c.passed else "FAIL")
            errs = " ".join(f"{c.errors[o]:>10.2e}" if o in c.errors else f"{'-':>10}" for o in OUTPUTS)
            lines.append(f"{c.function:<10} {c.case:<28} {c.rows:>5} {errs}  {verdict}")
        lines.append(
            "PASSED"
            if self.passed
            else ("FAILED: a negative control did not fail — the check is vacuous" if self.vacuous else "FAILED")
        )
        return "\n".join(lines)


def _errors(out: dict, ref: reference.BlockOutput, rows: int, names=OUTPUTS) -> dict[str, float]:
    expected = {"attn_out": ref.attn_out[:rows], "k_chunk": ref.k_chunk[:, :rows], "v_chunk": ref.v_chunk[:, :rows]}
    actual = {
        "attn_out": out["attn_out"][:rows],
        "k_chunk": out["k_chunk"][:, :rows],
        "v_chunk": out["v_chunk"][:, :rows],
    }
    return {n: relative_error(actual[n], expected[n]) for n in names}


def drop_half_mask(mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A copy of an additive mask [C, T] with a random half of each row's visible keys dropped
    (at least one kept per row)."""
    out = mask.copy()
    visible = mask > MASKED / 2
    drop = visible & (rng.random(mask.shape) < 0.5)
    keep_first = np.argmax(visible, axis=1)
    drop[np.arange(mask.shape[0]), keep_first] = False
    out[drop] = MASKED
    return out


def partial_rows(chunk: int) -> int:
    """Real rows of the partial-chunk case: about 60 % of the chunk, never the full chunk."""
    return max(1, min(chunk - 1, (chunk * 3) // 5 + 1)) if chunk > 1 else 1


def verify_package(
    package: str | os.PathLike,
    checkpoint_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    fp16: bool = True,
    functions: list[str] | None = None,
    evaluator: Evaluator | None = None,
) -> VerifyReport:
    """Verify every function of a saved sidecar against the reference (see module docstring).

    ``evaluator``: runs the package's functions instead of the NumPy evaluation (see ``Evaluator``;
    e.g. Core ML on a Mac). Every case then also reports the evaluator against the NumPy evaluation
    of the same package and the NumPy evaluation against the reference.
    """
    meta = read_sidecar_metadata(package)
    if meta.graph == "stateful":  # one function per chunk width, K/V in Core ML state
        return verify_stateful_package(package, checkpoint_dir, seed=seed, fp16=fp16, evaluator=evaluator)
    source = Path(checkpoint_dir) if checkpoint_dir is not None else Path(meta.source)
    if not (source / "config.json").is_file():
        raise AnelabInputError(
            f"checkpoint {source} (recorded in the package) has no config.json; pass --checkpoint DIR"
        )
    checkpoint = load_checkpoint(source)
    weights = checkpoint.layer(meta.layer)
    geometry = checkpoint.geometry
    if geometry.to_dict() != meta.geometry:
        raise AnelabInputError(
            f"checkpoint {source} has a different geometry than the package records; pass the checkpoint it was exported from"
        )
    saved = SavedPackage(package)
    names = functions or [f for f in meta.functions]
    for name in names:
        saved.function(name)
    report = VerifyReport(
        str(package),
        str(source),
        meta.layer,
        RELATIVE_ERROR_THRESHOLD,
        "NumPy evaluation of the saved MIL program (" + ("fp16 storage emulated" if fp16 else "fp32") + ")"
        if evaluator is None
        else f"{evaluator.name}, beside the NumPy evaluation",
    )
    C, D = meta.chunk, geometry.hidden_size
    checkpoint_weights = weights
    for name in tqdm(names, desc="verify functions", unit="fn"):
        H = history_of(name)
        if meta.weights != "fp16":
            from anelab.sidecar import quantize

            weights = quantize.dequantized_weights(saved, name, checkpoint_weights)
        rng = np.random.default_rng([seed, H])
        hidden_history = rng.standard_normal((H, D)).astype(np.float16)
        k_hist, v_hist = reference.history_kv(hidden_history.astype(np.float64), weights, geometry, "fp64")
        k_hist, v_hist = k_hist.astype(np.float16), v_hist.astype(np.float16)
        hidden = rng.standard_normal((C, D)).astype(np.float16)

        def run_package(hid, mask, numpy=False):
            inputs = {"hidden": hid, "mask": mask}
            if H > 0:
                inputs.update(k_history=k_hist, v_history=v_hist)
            if evaluator is None or numpy:
                return evaluate(saved, name, inputs, fp16=fp16)
            return evaluator(name, inputs)

        def run_reference(hid, mask, start=None):
            return reference.attention_block(
                hid.astype(np.float64),
                k_hist.astype(np.float64),
                v_hist.astype(np.float64),
                mask.astype(np.float64),
                weights,
                geometry,
                start=start,
                precision="fp64",
            )

        mask = causal(C, H)
        out = run_package(hidden, mask)
        ref = run_reference(hidden, mask)
        report.comparisons.append(Comparison(name, "full chunk", C, _errors(out, ref, C)))
        if evaluator is not None:
            report.comparisons += cross_checks(name, "full chunk", C, out, run_package(hidden, mask, numpy=True), ref)
        # partial chunk: n real rows, padded with zero rows; padded rows' outputs are ignored
        n = partial_rows(C)
        padded = hidden.copy()
        padded[n:] = 0
        pmask = causal(C, H, valid_rows=n)
        partial, pref = run_package(padded, pmask), run_reference(padded, pmask)
        report.comparisons.append(Comparison(name, f"partial chunk ({n} of {C})", n, _errors(partial, pref, n)))
        if evaluator is not None:
            numpy_partial = run_package(padded, pmask, numpy=True)
            report.comparisons += cross_checks(name, f"partial ({n} of {C})", n, partial, numpy_partial, pref)
        # negative controls
        wrong_rope = run_reference(hidden, mask, start=H + 1)
        report.comparisons.append(
            Comparison(
                name, "control: rope offset +1", C, _errors(out, wrong_rope, C, ("attn_out", "k_chunk")), control=True
            )
        )
        dropped = run_package(hidden, drop_half_mask(mask, rng))
        report.comparisons.append(
            Comparison(name, "control: mask reaches graph", C, _errors(dropped, ref, C, ("attn_out",)), control=True)
        )
        if meta.weights != "fp16":  # what the compression costs, against the checkpoint's weights
            fp16_ref = reference.attention_block(
                hidden.astype(np.float64),
                k_hist.astype(np.float64),
                v_hist.astype(np.float64),
                mask.astype(np.float64),
                checkpoint_weights,
                geometry,
                precision="fp64",
            )
            report.comparisons.append(
                Comparison(
                    name,
                    f"{meta.weights} vs fp16 w. (<={quantize.ERROR_BOUNDS[meta.weights]:g})",
                    C,
                    _errors(out, fp16_ref, C),
                    bound=quantize.ERROR_BOUNDS[meta.weights],
                )
            )
    if meta.selection_folded:
        report.comparisons.extend(fold_comparisons(saved, source, meta, seed=seed))
    return report


class Evaluator(Protocol):
    """Runs one function of the package being verified (the seam for Core ML on a Mac; the default is
    ``anelab.sidecar.evaluate.evaluate``): ``evaluator(function, inputs, state=None) -> outputs``,
    inputs and outputs name -> array as in the package's signature. ``name`` labels the report."""

    name: str

    def __call__(self, function: str, inputs: dict, state=None) -> dict: ...

    def make_state(self, function: str): ...


def cross_checks(function: str, case: str, rows: int, device: dict, numpy_out: dict, ref) -> list[Comparison]:
    """The evaluator against the NumPy evaluation of the same package, and NumPy against the reference."""
    names = [o for o in OUTPUTS if o in device and o in numpy_out]
    cut = {"attn_out": lambda a: a[:rows], "k_chunk": lambda a: a[:, :rows], "v_chunk": lambda a: a[:, :rows]}
    versus_numpy = {o: relative_error(cut[o](device[o]), cut[o](numpy_out[o])) for o in names}
    return [
        Comparison(function, f"{case}: device vs NumPy", rows, versus_numpy),
        Comparison(function, f"{case}: NumPy vs ref.", rows, _errors(numpy_out, ref, rows)),
    ]


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
    package: str | os.PathLike,
    checkpoint_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    fp16: bool = True,
    evaluator: Evaluator | None = None,
) -> VerifyReport:
    """Verify a stateful sidecar over a multi-chunk prompt (see the comment above).

    ``evaluator`` (with ``make_state(function)``): the calls run through it, carrying its state; its
    attn_out is compared with the reference and with the NumPy run, whose caches are checked as usual.
    """
    from anelab.sidecar.format import STATE_CAPACITY_META, STATE_FUNCTIONS_META, STATE_NAMES, read_raw_metadata

    meta = read_sidecar_metadata(package)
    raw = read_raw_metadata(package)
    try:
        capacity = int(raw[STATE_CAPACITY_META])
        functions = raw[STATE_FUNCTIONS_META].split(",")
    except (KeyError, ValueError):
        raise AnelabInputError(
            f"{package}: stateful sidecar metadata lacks '{STATE_CAPACITY_META}'; re-export it with 'anelab export'"
        ) from None
    source = Path(checkpoint_dir) if checkpoint_dir is not None else Path(meta.source)
    if not (source / "config.json").is_file():
        raise AnelabInputError(
            f"checkpoint {source} (recorded in the package) has no config.json; pass --checkpoint DIR"
        )
    checkpoint = load_checkpoint(source)
    geometry = checkpoint.geometry
    if geometry.to_dict() != meta.geometry:
        raise AnelabInputError(
            f"checkpoint {source} has a different geometry than the package records; pass the checkpoint it was exported from"
        )
    saved = SavedPackage(package)
    for name in functions:
        saved.function(name)
    checkpoint_weights = checkpoint.layer(meta.layer)
    weights = checkpoint_weights
    if meta.weights != "fp16":
        from anelab.sidecar import quantize

        weights = quantize.dequantized_weights(saved, functions[0], checkpoint_weights)
    C = meta.chunk
    decode_steps = DECODE_STEPS if ("c1" in functions and C != 1) else 0
    prefill = ((capacity - decode_steps) // C) * C
    if prefill == 0:
        raise AnelabInputError(
            f"state capacity {capacity} leaves no room for a chunk of {C} and {decode_steps} decode steps; "
            "re-export with a larger --capacity"
        )
    P = prefill + decode_steps
    label = "+".join(functions)
    report = VerifyReport(
        str(package),
        str(source),
        meta.layer,
        RELATIVE_ERROR_THRESHOLD,
        "NumPy evaluation of the saved MIL program, state carried between calls ("
        + ("fp16 storage emulated" if fp16 else "fp32")
        + ")"
        if evaluator is None
        else f"{evaluator.name}, state carried between calls, beside the NumPy evaluation",
    )
    rng = np.random.default_rng([seed, P])
    hidden = rng.standard_normal((P, geometry.hidden_size)).astype(np.float16)
    empty = np.zeros((0, geometry.num_kv_heads, geometry.head_dim))

    def reference_over_prompt(w, start=None):
        return reference.attention_block(
            hidden.astype(np.float64),
            empty,
            empty,
            causal(P, 0).astype(np.float64),
            w,
            geometry,
            start=start,
            precision="fp64",
        )

    def cache_errors(out, state, ref):
        """attn_out rows, and the whole final cache vs the reference K/V padded with zeros."""
        errs = {"attn_out": relative_error(out, ref.attn_out)}
        for column, name, expected in (
            ("k_chunk", STATE_NAMES[0], ref.k_chunk),
            ("v_chunk", STATE_NAMES[1], ref.v_chunk),
        ):
            full = np.zeros(state[name].shape)
            full[:, :P] = expected
            errs[column] = relative_error(state[name], full)
        return errs

    steps = tqdm(total=4 + (meta.weights != "fp16"), desc="verify stateful", unit="run")
    on = (
        {}
        if evaluator is None
        else {"evaluate": lambda f, i, st: evaluator(f, i, state=st), "make_state": evaluator.make_state}
    )
    if evaluator is not None:  # the device's state is not read back: its attn_out is compared, the caches via NumPy
        cache_errors = lambda o, st, r, numpy_errors=cache_errors: (  # noqa: E731
            numpy_errors(o, st, r) if isinstance(st, dict) else {"attn_out": relative_error(o, r.attn_out)}
        )
    out, state = run_stateful(saved, hidden, C, capacity, decode_steps=decode_steps, fp16=fp16, **on)
    ref = reference_over_prompt(weights)
    report.comparisons.append(
        Comparison(label, f"prompt {prefill}+{decode_steps} rows", P, cache_errors(out, state, ref))
    )
    if evaluator is not None:
        numpy_out, numpy_state = run_stateful(saved, hidden, C, capacity, decode_steps=decode_steps, fp16=fp16)
        report.comparisons += [
            Comparison(label, "device vs NumPy", P, {"attn_out": relative_error(out, numpy_out)}),
            Comparison(label, "NumPy vs ref.", P, cache_errors(numpy_out, numpy_state, ref)),
        ]
    steps.update()
    wrong_rope = reference_over_prompt(weights, start=1)
    errs = cache_errors(out, state, wrong_rope)
    report.comparisons.append(
        Comparison(
            label,
            "control: rope offset +1",
            P,
            {k: errs[k] for k in ("attn_out", "k_chunk") if k in errs},
            control=True,
        )
    )
    steps.update()
    dropped, _ = run_stateful(
        saved,
        hidden,
        C,
        capacity,
        decode_steps=decode_steps,
        fp16=fp16,
        masks=lambda rows, start: drop_half_mask(stateful_mask(rows, start, capacity), rng),
        **on,
    )
    report.comparisons.append(
        Comparison(
            label, "control: mask reaches graph", P, {"attn_out": relative_error(dropped, ref.attn_out)}, control=True
        )
    )
    steps.update()
    forgetful, _ = run_stateful(
        saved, hidden, C, capacity, decode_steps=decode_steps, fp16=fp16, fresh_state_each_call=True, **on
    )
    report.comparisons.append(
        Comparison(
            label, "control: state carried", P, {"attn_out": relative_error(forgetful, ref.attn_out)}, control=True
        )
    )
    steps.update()
    if meta.weights != "fp16":
        fp16_ref = reference_over_prompt(checkpoint_weights)
        report.comparisons.append(
            Comparison(
                label,
                f"{meta.weights} vs fp16 w. (<={quantize.ERROR_BOUNDS[meta.weights]:g})",
                P,
                cache_errors(out, state, fp16_ref),
                bound=quantize.ERROR_BOUNDS[meta.weights],
            )
        )
        steps.update()
    steps.close()
    return report
