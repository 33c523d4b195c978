"""The prompt drivers: a prompt's chunks through a saved package, one driver per design (and the prompt's reference)."""

from __future__ import annotations

import numpy as np

from anelab.core import reference
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry, chunk_starts
from anelab.core.masks import MASKED, causal
from anelab.core.weights import AttentionWeights
from anelab.sidecar.format import function_name, stateful_function_name
from anelab.sidecar.mil.evaluate import SavedPackage

DECODE_STEPS = 2  # decode rows run after the prefill when the package has a c1 function


def stateful_mask(rows: int, start: int, capacity: int, window: int | None = None) -> np.ndarray:
    """Additive mask [rows, capacity] for a call at ``start``: causal (within the sliding ``window``,
    if any) over the filled prefix (slots < start + rows), every later cache slot dropped."""
    mask = np.full((rows, capacity), MASKED, dtype=np.float16)
    mask[:, : start + rows] = causal(rows, start, window=window)
    return mask


def _call_runner(saved: SavedPackage, evaluate, fp16: bool):
    """``evaluate(function, inputs, state)``: the caller's, or NumPy on ``saved`` (with ``fp16``).
    ``fp16=False`` only reaches NumPy: with a caller's runner it would be silently ignored, so it is refused."""
    if evaluate is None:
        return lambda function, inputs, state: saved.evaluate_with_state(function, inputs, state, fp16=fp16)
    if not fp16:
        raise AnelabInputError("fp16=False applies to NumPy evaluation only; drop it or drop evaluate=")
    return evaluate


def run_stateful(
    saved: SavedPackage,
    hidden: np.ndarray,
    chunk: int,
    capacity: int,
    *,
    decode_steps: int = 0,
    masks=None,
    fresh_state_each_call: bool = False,
    fp16: bool = True,
    evaluate=None,
    make_state=None,
    window: int | None = None,
) -> tuple[np.ndarray, dict]:
    """Feed ``hidden`` [P, D] through a saved stateful package: (P - decode_steps) / chunk calls of
    c<chunk>, then ``decode_steps`` calls of c1, carrying the state. Returns (attn_out [P, D], final state).

    ``masks(rows, start) -> [rows, capacity]`` overrides ``stateful_mask`` (with the package's
    sliding ``window``, if any). Refuses a call whose chunk would run past the state capacity (one
    line). ``evaluate(function, inputs, state)`` and ``make_state(function)`` run the calls elsewhere
    (e.g. Core ML; default: NumPy on ``saved``).
    """

    prefill = hidden.shape[0] - decode_steps
    if prefill < 0 or prefill % chunk:
        raise AnelabInputError(
            f"prompt of {hidden.shape[0]} rows with {decode_steps} decode steps is not whole chunks of {chunk}; pad the prompt"
        )
    calls = [(stateful_function_name(chunk), s, chunk) for s in (chunk_starts(prefill, chunk) if prefill else [])]
    calls += [(stateful_function_name(1), prefill + i, 1) for i in range(decode_steps)]
    masks = masks or (lambda rows, start: stateful_mask(rows, start, capacity, window))
    first = calls[0][0] if calls else stateful_function_name(chunk)
    evaluate = _call_runner(saved, evaluate, fp16)
    make_state = make_state or saved.new_state
    state = make_state(first)
    outs = []
    for function, start, rows in calls:
        if start + rows > capacity:
            raise AnelabInputError(
                f"chunk start {start} + {rows} rows is past the state capacity {capacity}; export with a larger --capacity"
            )
        if fresh_state_each_call:
            state = make_state(function)
        inputs = {
            "hidden": np.ascontiguousarray(hidden[start : start + rows]),
            "start": np.array([start], np.int32),
            "mask": masks(rows, start),
        }
        outs.append(evaluate(function, inputs, state)["attn_out"])
    return (np.concatenate(outs) if outs else np.zeros((0, hidden.shape[1]), np.float16)), state


def run_stateful_tiled(
    saved: SavedPackage,
    hidden: np.ndarray,
    chunk: int,
    capacity: int,
    *,
    decode_steps: int = 0,
    first_start: int = 0,
    state: dict[str, np.ndarray] | None = None,
    start_offset: int = 0,
    masks=None,
    fresh_state_each_call: bool = False,
    fp16: bool = True,
    evaluate=None,
) -> tuple[np.ndarray, dict]:
    """Feed ``hidden`` [P, D] through a saved stateful-tiled package from absolute position
    ``first_start``: the first P - decode_steps rows in calls of c<chunk> (the last one padded with
    zero rows: its padded slots lie past every real position, so the in-graph causal mask drops them
    and later calls overwrite them), then ``decode_steps`` calls of c1. Returns (attn_out [P, D], state).

    ``state``: the cache to start from (default: empty). ``start_offset``: added to the ``start``
    input the package is given (a negative control: the wrong position). ``masks(rows, start) ->
    [rows, capacity]``: the additive mask of a package exported with mask mode ``additive``
    (default: ``stateful_mask``); ignored by a causal-only package, which has no mask input.
    ``evaluate(function, inputs, state)`` runs a call elsewhere (default: NumPy on ``saved``).
    """
    P, D = hidden.shape
    prefill = P - decode_steps
    if prefill < 0:
        raise AnelabInputError(f"prompt of {P} rows cannot hold {decode_steps} decode steps; lower decode_steps")
    calls = [(stateful_function_name(chunk), first_start + s, chunk) for s in range(0, prefill, chunk)]
    calls += [(stateful_function_name(1), first_start + prefill + i, 1) for i in range(decode_steps)]
    masks = masks or (lambda rows, start: stateful_mask(rows, start, capacity))
    evaluate = _call_runner(saved, evaluate, fp16)
    state = state if state is not None else saved.new_state(calls[0][0] if calls else stateful_function_name(chunk))
    rows_in = np.zeros((prefill + (-prefill) % chunk + decode_steps, D), np.float16)
    rows_in[:prefill] = hidden[:prefill]
    rows_in[len(rows_in) - decode_steps :] = hidden[prefill:]
    outs, at = [], 0
    for function, start, rows in calls:
        if start + start_offset + rows > capacity:
            raise AnelabInputError(
                f"chunk start {start + start_offset} + {rows} rows is past the state capacity {capacity}; "
                "export with a larger --capacity"
            )
        if fresh_state_each_call:
            state = saved.new_state(function)
        inputs = {
            "hidden": np.ascontiguousarray(rows_in[at : at + rows]),
            "start": np.array([start + start_offset], np.int32),
        }
        if "mask" in {s.name for s in saved.function(function).inputs}:
            inputs["mask"] = masks(rows, start)
        outs.append(evaluate(function, inputs, state)["attn_out"])
        at += rows
    out = np.concatenate(outs) if outs else np.zeros((0, D), np.float16)
    keep = np.r_[0:prefill, len(out) - decode_steps : len(out)]
    return out[keep], state


# ---- one whole prompt per design (``designs.Design.drive_prompt``; ``prompt.prefill_prompt`` picks one) ----
def whole_chunks(hidden: np.ndarray, chunk: int) -> np.ndarray:
    """The prompt's rows [P, D] padded with zero rows to whole chunks [ceil(P / C) * C, D] (padded rows
    come after every real row, so no real row sees them)."""
    calls = -(-hidden.shape[0] // chunk)
    padded = np.zeros((calls * chunk, hidden.shape[1]), np.float16)
    padded[: hidden.shape[0]] = hidden
    return padded


def prefill_per_history(saved: SavedPackage, meta, hidden: np.ndarray, fp16: bool = True) -> np.ndarray:
    """dense / tiled: one call of ``h<s>`` per chunk start s, the K/V history [s, Hkv, d] built from the
    earlier calls' k_chunk / v_chunk outputs, causal mask (within the package's ``slidingWindow``).
    ``hidden`` [P, D] fp16 -> attn_out [P, D]."""
    C, P = meta.chunk, hidden.shape[0]
    padded = whole_chunks(hidden, C)
    missing = [s for s in range(0, len(padded), C) if s not in meta.histories]
    if missing:
        raise AnelabInputError(
            f"prompt of {P} tokens needs functions h{missing[0]}..h{missing[-1]}; export histories up to {len(padded) - C}"
        )
    outs, k_hist, v_hist = [], [], []
    for s in range(0, len(padded), C):
        inputs = {"hidden": padded[s : s + C], "mask": causal(C, s, window=meta.sliding_window)}
        if s > 0:
            inputs["k_history"] = np.ascontiguousarray(np.concatenate(k_hist, axis=0))
            inputs["v_history"] = np.ascontiguousarray(np.concatenate(v_hist, axis=0))
        result = saved.evaluate(function_name(s), inputs, fp16=fp16)
        outs.append(result["attn_out"])
        k_hist.append(np.transpose(result["k_chunk"], (1, 0, 2)).astype(np.float16))  # [Hkv, C, d] -> [C, Hkv, d]
        v_hist.append(np.transpose(result["v_chunk"], (1, 0, 2)).astype(np.float16))
    return np.concatenate(outs)[:P]


def prefill_stateful(saved: SavedPackage, meta, hidden: np.ndarray, fp16: bool = True) -> np.ndarray:
    """stateful: ``run_stateful`` over the prompt padded to whole chunks, the state carried between
    calls. ``hidden`` [P, D] fp16 -> attn_out [P, D]."""
    C, P, capacity = meta.chunk, hidden.shape[0], meta.state_capacity
    padded = whole_chunks(hidden, C)
    if len(padded) > capacity:
        raise AnelabInputError(
            f"prompt of {P} tokens needs {len(padded)} cache slots; the package has {capacity}; "
            f"re-export with --capacity {len(padded)}"
        )
    out, _ = run_stateful(saved, padded, C, capacity, fp16=fp16, window=meta.sliding_window)
    return out[:P]


def prefill_stateful_tiled(saved: SavedPackage, meta, hidden: np.ndarray, fp16: bool = True) -> np.ndarray:
    """stateful-tiled: ``run_stateful_tiled`` (the partial last chunk padded inside the driver,
    causality in-graph). ``hidden`` [P, D] fp16 -> attn_out [P, D]."""
    C, P = meta.chunk, hidden.shape[0]
    if P > meta.state_capacity:
        raise AnelabInputError(
            f"prompt of {P} tokens is longer than the state capacity {meta.state_capacity}; "
            f"re-export with --capacity {-(-P // C) * C}"
        )
    out, _ = run_stateful_tiled(saved, hidden, C, meta.state_capacity, fp16=fp16)
    return out


def prompt_reference(
    hidden: np.ndarray,
    weights: AttentionWeights,
    geometry: AttentionGeometry,
    *,
    start: int | None = None,
    window: int | None = None,
    rope_coverage: int | None = None,
) -> reference.BlockOutput:
    """The fp64 reference over a whole prompt's rows [P, D] from position 0 (``start`` shifts the RoPE
    positions: a negative control), causal (within ``window``), no history: attn_out [P, D],
    k_chunk/v_chunk [Hkv, P, d]. ``rope_coverage`` picks a dynamic / longrope table."""
    P = hidden.shape[0]
    empty = np.zeros((0, geometry.num_kv_heads, geometry.head_dim))
    return reference.attention_block(
        np.asarray(hidden, np.float64),
        empty,
        empty,
        causal(P, 0, window=window).astype(np.float64),
        weights,
        geometry,
        start=start,
        precision="fp64",
        rope_coverage=rope_coverage,
    )
