"""Verification of a saved stateful package (``stateful``, ``stateful-tiled``) against the independent NumPy reference:
the prompt carried through the state chunk by chunk, then decoded steps, with its negative controls."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from anelab.checkpoints.checkpoint import Checkpoint
from anelab.core import reference
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.progress import tqdm
from anelab.sidecar import quantize
from anelab.sidecar.backends import open_saved, read_metadata
from anelab.sidecar.checks.comparison import (
    RELATIVE_ERROR_THRESHOLD,
    Comparison,
    Evaluator,
    load_matching_checkpoint,
    relative_error,
    rope_control_case,
    rope_control_offset,
)
from anelab.sidecar.checks.verify_cases import (
    VerifyReport,
    compression_row,
    drop_half_mask,
    fold_comparisons,
    fold_controls_declared,
    partial_rows,
)
from anelab.sidecar.drivers import DECODE_STEPS, prompt_reference, run_stateful, run_stateful_tiled, stateful_mask
from anelab.sidecar.format import STATE_NAMES, SidecarMetadata
from anelab.sidecar.mil.evaluate import SavedPackage


def stateful_prompt_rows(meta: SidecarMetadata) -> tuple[int, int]:
    """(prefill rows, decode steps) of the stateful check: whole chunks filling the capacity, then
    ``DECODE_STEPS`` rows through ``c1`` when the package has it."""
    C, capacity = meta.chunk, meta.state_capacity
    decode_steps = DECODE_STEPS if ("c1" in meta.functions and C != 1) else 0
    prefill = ((capacity - decode_steps) // C) * C
    if prefill == 0:
        raise AnelabInputError(
            f"state capacity {capacity} leaves no room for a chunk of {C} and {decode_steps} decode steps; "
            "re-export with a larger --capacity"
        )
    return prefill, decode_steps


def stateful_controls_declared(meta: SidecarMetadata, geometry: AttentionGeometry) -> list[tuple[str, str]]:
    """The negative controls a stateful package declares (one label for all its functions): RoPE
    ``rope_control_offset`` positions late (unless NoPE), half the mask dropped, a fresh state per call, the window
    dropped (when the model's window hides keys within the prompt)."""
    label, window = "+".join(meta.functions), geometry.window_of(meta.layer)
    offset = rope_control_offset(geometry, meta.layer, meta.state_capacity) if geometry.uses_rope(meta.layer) else 0
    cases = [rope_control_case(offset)] if offset else []
    cases += ["control: mask reaches graph", "control: state carried"]
    if window is not None and window < sum(stateful_prompt_rows(meta)):
        cases.append("control: window dropped")
    return [(label, case) for case in cases]


def stateful_tiled_controls_declared(meta: SidecarMetadata, geometry: AttentionGeometry) -> list[tuple[str, str]]:
    """The negative controls a stateful-tiled package declares: the wrong position (start + 1), a fresh
    state per call, the window dropped (a windowed layer whose window hides keys within the prompt),
    with an additive mask input half the mask dropped, and the fold check's when it records a selection."""
    cases = ["control: wrong position (start + 1)", "control: state carried"]
    window = geometry.window_of(meta.layer)
    if window is not None and window < sum(stateful_tiled_prompt(meta)):
        cases.append("control: window dropped (ref.)")
    if meta.mask_mode == "additive":
        cases.append("control: mask reaches graph")
    return [("+".join(meta.functions), case) for case in cases] + fold_controls_declared(meta)


def stateful_report(package, checkpoint, meta, fp16: bool, evaluator: Evaluator | None, saved) -> VerifyReport:
    """An empty report for a stateful package, naming how its calls are evaluated (``saved``: the package
    read back, which names its own evaluation: NumPy for a Core ML package, the CPU runtime for Core AI)."""
    how = (
        f"{saved.description(fp16)}, state carried between calls"
        if evaluator is None
        else f"{evaluator.name}, state carried between calls, beside the NumPy evaluation"
    )
    return VerifyReport(str(package), str(checkpoint.path), meta.layer, RELATIVE_ERROR_THRESHOLD, how)


def open_stateful_package(package: str | os.PathLike, checkpoint: Checkpoint | None):
    """A stateful package's metadata, matching checkpoint, saved program (every function checked), the
    weights its graph holds (dequantized when compressed) and the checkpoint's own weights."""
    meta = read_metadata(package)
    checkpoint = load_matching_checkpoint(meta, checkpoint)
    saved = open_saved(package)
    for name in meta.functions:
        saved.function(name)
    checkpoint_weights = checkpoint.layer(meta.layer)
    weights = checkpoint_weights
    if meta.weights != "fp16":
        weights = quantize.dequantized_weights(saved, meta.functions[0], checkpoint_weights, meta.weights)
    return meta, checkpoint, saved, weights, checkpoint_weights


def verify_stateful_package(
    package: str | os.PathLike,
    checkpoint: Checkpoint | None = None,
    *,
    seed: int = 0,
    fp16: bool = True,
    evaluator: Evaluator | None = None,
    progress: bool = True,
) -> VerifyReport:
    """Verify a stateful sidecar over a multi-chunk prompt (and decode steps when it has ``c1``):
    the attn_out rows and the whole final cache against the fp64 reference over the prompt, then
    three controls (RoPE ``rope_control_offset`` positions late, a changed mask, a fresh state per call).

    ``evaluator`` (with ``make_state`` and ``state_arrays``): the calls run through it, carrying its
    state; its attn_out and final caches are compared with the reference, beside the NumPy run."""
    meta, checkpoint, saved, weights, checkpoint_weights = open_stateful_package(package, checkpoint)
    geometry, capacity = checkpoint.geometry, meta.state_capacity
    prefill, decode_steps = stateful_prompt_rows(meta)
    P = prefill + decode_steps
    label = "+".join(meta.functions)
    report = stateful_report(package, checkpoint, meta, fp16, evaluator, saved)
    report.declared_controls = stateful_controls_declared(meta, geometry)
    rng = np.random.default_rng([seed, P])
    hidden = rng.standard_normal((P, geometry.hidden_size)).astype(np.float16)

    window, true_window = meta.sliding_window, geometry.window_of(meta.layer)
    run = stateful_runner(saved, hidden, meta, decode_steps=decode_steps, fp16=fp16, evaluator=evaluator)

    def truth(w, **options):
        return prompt_reference(hidden, w, geometry, window=true_window, rope_coverage=capacity, **options)

    steps = tqdm(total=4 + (meta.weights != "fp16"), desc="verify stateful", unit="run", disable=not progress)
    out, state = run()
    if evaluator is not None:  # the device's state read back (MLState.read_state), as NumPy's is
        state = evaluator.state_arrays(state)
    ref = truth(weights)
    report.comparisons.append(
        Comparison(label, f"prompt {prefill}+{decode_steps} rows", P, stateful_errors(out, state, ref))
    )
    if evaluator is not None:
        numpy_out, numpy_state = run(numpy=True)
        report.comparisons += [
            Comparison(label, "device vs NumPy", P, {"attn_out": relative_error(out, numpy_out)}),
            Comparison(label, "NumPy vs ref.", P, stateful_errors(numpy_out, numpy_state, ref)),
        ]
    steps.update()
    report.comparisons += stateful_controls(
        run,
        lambda **o: truth(weights, **o),
        out,
        state,
        ref,
        label=label,
        capacity=capacity,
        window=window,
        true_window=true_window,
        rope_offset=rope_control_offset(geometry, meta.layer, capacity) if geometry.uses_rope(meta.layer) else 0,
        rng=rng,
    )
    steps.update(3)
    if meta.weights != "fp16":
        report.comparisons.append(
            compression_row(label, meta.weights, P, stateful_errors(out, state, truth(checkpoint_weights)))
        )
        steps.update()
    steps.close()
    saved.close()
    return report


def stateful_runner(saved: SavedPackage, hidden: np.ndarray, meta: SidecarMetadata, *, decode_steps: int, fp16: bool,
                    evaluator: Evaluator | None) -> Callable[..., tuple[np.ndarray, object]]:  # fmt: skip
    """``run(numpy=False, **options)``: the prompt ``hidden`` [P, D] through a stateful package with
    ``run_stateful`` (options as it takes them; the package's window by default), through ``evaluator``
    (its own state) unless ``numpy`` or no evaluator is given."""
    on = {} if evaluator is None else {"evaluate": lambda f, i, st: evaluator(f, i, state=st),
                                       "make_state": evaluator.make_state}  # fmt: skip

    def run(numpy: bool = False, **options):
        options.setdefault("window", meta.sliding_window)
        device = {} if numpy else on
        storage = {} if device else {"fp16": fp16}  # fp16 picks the NumPy emulation; the device stores fp16 itself
        return run_stateful(saved, hidden, meta.chunk, meta.state_capacity, decode_steps=decode_steps,
                            **storage, **device, **options)  # fmt: skip

    return run


def stateful_controls(
    run: Callable[..., tuple[np.ndarray, object]],
    truth: Callable[..., reference.BlockOutput],
    out: np.ndarray,
    state: dict[str, np.ndarray],
    ref: reference.BlockOutput,
    *,
    label: str,
    capacity: int,
    window: int | None,
    true_window: int | None,
    rope_offset: int,
    rng: np.random.Generator,
) -> list[Comparison]:
    """The stateful run's negative controls, each of which must miss the reference: RoPE ``rope_offset``
    positions late (``comparison.rope_control_offset``; 0 on a NoPE layer: none), half the visible keys dropped
    from the mask, a fresh state at every call, and the sliding window dropped (when the model's window hides keys in this prompt).
    ``run(**options)`` reruns the prompt through the package; ``truth(**options)`` the reference."""
    P = out.shape[0]

    def control(case: str, actual: np.ndarray) -> Comparison:
        return Comparison(label, case, P, {"attn_out": relative_error(actual, ref.attn_out)}, control=True)

    controls = []
    if rope_offset:  # a NoPE layer has no positions to get wrong
        errs = stateful_errors(out, state, truth(start=rope_offset))
        controls.append(
            Comparison(
                label, rope_control_case(rope_offset), P, {k: errs[k] for k in ("attn_out", "k_chunk")}, control=True
            )
        )
    dropped, _ = run(masks=lambda rows, start: drop_half_mask(stateful_mask(rows, start, capacity, window), rng))
    controls.append(control("control: mask reaches graph", dropped))
    controls.append(control("control: state carried", run(fresh_state_each_call=True)[0]))
    if true_window is not None and true_window < P:
        controls.append(control("control: window dropped", run(window=None)[0]))
    return controls


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


def stateful_tiled_prompt_rows(capacity: int, chunk: int) -> int:
    """Prefill rows of the stateful-tiled check: every chunk call the capacity holds (at least two, so
    the state must be carried), the last one partial (``partial_rows``)."""
    calls = capacity // chunk
    if calls < 2:
        raise AnelabInputError(
            f"state capacity {capacity} holds fewer than two chunks of {chunk}; verification needs two calls: "
            f"re-export with --capacity {2 * chunk}"
        )
    return (calls - 1) * chunk + partial_rows(chunk)


def stateful_tiled_prompt(meta: SidecarMetadata) -> tuple[int, int]:
    """(prefill rows, decode steps) of the stateful-tiled check (``stateful_tiled_prompt_rows``, then
    up to ``DECODE_STEPS`` rows through ``c1`` when the package has it)."""
    prefill = stateful_tiled_prompt_rows(meta.state_capacity, meta.chunk)
    has_decode = "c1" in meta.functions and meta.chunk != 1
    return prefill, min(DECODE_STEPS, meta.state_capacity - prefill) if has_decode else 0


def verify_stateful_tiled_package(
    package: str | os.PathLike,
    checkpoint: Checkpoint | None = None,
    *,
    seed: int = 0,
    fp16: bool = True,
    progress: bool = True,
) -> VerifyReport:
    """Verify a stateful-tiled sidecar over a whole prompt whose last chunk is partial, then decode
    steps through ``c1`` when present: attn_out rows and the cache slots the prompt wrote, against the
    fp64 reference (within the layer's sliding window, if any: its cache is then a ring and the prompt
    runs past the window whenever the capacity does). Controls (each must fail): the package told the
    wrong position (start + 1, over the prompt's whole chunks), a fresh state per call (state not
    carried), a windowed layer's window dropped (the reference without it), with an additive mask
    input a changed mask, and the fold check when the package records a selection."""
    meta, checkpoint, saved, weights, checkpoint_weights = open_stateful_package(package, checkpoint)
    geometry, capacity, C = checkpoint.geometry, meta.state_capacity, meta.chunk
    prefill, decode_steps = stateful_tiled_prompt(meta)
    P = prefill + decode_steps
    label = "+".join(meta.functions)
    report = stateful_report(package, checkpoint, meta, fp16, None, saved)
    report.declared_controls = stateful_tiled_controls_declared(meta, geometry)
    rng = np.random.default_rng([seed, P])
    hidden = rng.standard_normal((P, geometry.hidden_size)).astype(np.float16)

    def run(**options):
        rows = hidden[:whole] if "start_offset" in options else hidden
        return run_stateful_tiled(saved, rows, C, capacity, **{"decode_steps": decode_steps, "fp16": fp16, **options})

    window = geometry.window_of(meta.layer)
    ref = prompt_reference(hidden, weights, geometry, window=window, rope_coverage=capacity)
    whole = (prefill // C) * C  # the wrong-position control runs the whole chunks only (one slot must stay spare)
    cases = [
        ("wrong position (start + 1)", {"start_offset": 1, "decode_steps": 0}),
        ("state carried", {"fresh_state_each_call": True}),
    ]
    if meta.mask_mode == "additive":
        cases.append(("mask reaches graph", {"masks": lambda r, s: drop_half_mask(stateful_mask(r, s, capacity), rng)}))
    steps = tqdm(
        total=1 + len(cases) + (meta.weights != "fp16"), desc="verify stateful-tiled", unit="run", disable=not progress
    )
    out, state = run()
    case = f"prompt {prefill} (last chunk partial)+{decode_steps}"
    report.comparisons.append(Comparison(label, case, P, stateful_tiled_errors(out, state, ref, window)))
    if window is not None and window < P:  # the window must matter at this prompt, or the check could not see it
        full = prompt_reference(hidden, weights, geometry, rope_coverage=capacity).attn_out
        err = {"attn_out": relative_error(out, full)}
        report.comparisons.append(Comparison(label, "control: window dropped (ref.)", P, err, control=True))
    steps.update()
    report.comparisons += stateful_tiled_controls(run, ref, cases, label, P, steps, window)
    if meta.weights != "fp16":
        fp16_ref = prompt_reference(hidden, checkpoint_weights, geometry, window=window, rope_coverage=capacity)
        errs = stateful_tiled_errors(out, state, fp16_ref, window)
        report.comparisons.append(compression_row(label, meta.weights, P, errs))
        steps.update()
    steps.close()
    if meta.selection_folded:
        report.comparisons.extend(fold_comparisons(saved, checkpoint, meta, seed=seed))
    saved.close()
    return report


def stateful_tiled_controls(
    run, ref: reference.BlockOutput, cases, label: str, P: int, steps=None, window: int | None = None
) -> list[Comparison]:
    """Each control case ``(name, run options)`` rerun through ``run(**options)`` and compared with the
    reference's rows it covers (the wrong position also with the cache it wrote; a fresh state or a
    changed mask still writes the right cache, so only attn_out counts there)."""
    controls = []
    for name, options in cases:
        wrong, wrong_state = run(**options)
        part = reference.BlockOutput(
            ref.attn_out[: len(wrong)], ref.k_chunk[:, : len(wrong)], ref.v_chunk[:, : len(wrong)]
        )
        errs = stateful_tiled_errors(wrong, wrong_state, part, window)
        if "start_offset" not in options:
            errs = {"attn_out": errs["attn_out"]}
        controls.append(Comparison(label, f"control: {name}", P, errs, control=True))
        if steps is not None:
            steps.update()
    return controls


def stateful_tiled_errors(
    out: np.ndarray, state: dict[str, np.ndarray], ref: reference.BlockOutput, window: int | None = None
) -> dict[str, float]:
    """attn_out rows [P, D], and the cache slots the prompt wrote ([Hkv, :P, d]) against the reference
    K/V [Hkv, P, d] (slots past P hold a partial chunk's padding, dropped by the causal mask). A
    windowed layer's ring [Hkv, S, d]: slot p mod S of each of the last ``window`` positions p — every
    key a later call can still see (an older slot may hold a partial chunk's overwritten padding)."""
    P = out.shape[0]
    errs = {"attn_out": relative_error(out, ref.attn_out)}
    for column, name, expected in (("k_chunk", STATE_NAMES[0], ref.k_chunk), ("v_chunk", STATE_NAMES[1], ref.v_chunk)):
        if window is None:
            errs[column] = relative_error(state[name][:, :P], expected)
        else:
            live = np.arange(max(0, P - window), P)
            errs[column] = relative_error(state[name][:, live % state[name].shape[1]], expected[:, live])
    return errs
