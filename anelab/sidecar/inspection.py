"""Inspect a saved sidecar package: functions, I/O signatures, metadata, weight bytes."""

from __future__ import annotations

import os

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.sidecar.format import SidecarMetadata, read_raw_metadata, weight_bytes
from anelab.sidecar.mil.evaluate import SavedPackage, state_signatures, var_bytes

DTYPE_BYTES = {"float16": 2, "float32": 4}


def largest_working_output(saved: SavedPackage, function: str) -> tuple[int, tuple[int, ...], str]:
    """(bytes, shape, op type) of the function's largest non-const op output that is not shaped like
    one of its states — the arena a call needs besides the state. A stateful function's cache reads
    (``read_state``) and writes (``slice_update``) are state-shaped ([Hkv, capacity, d]) by design: they
    grow with the capacity, its working tensors need not."""
    cache_shapes = {tuple(sig.shape) for sig in state_signatures(saved, function).values()}
    ops = [op for op in saved.mil_function(function).operations if op.op_type != "const"]
    sizes = [(var_bytes(v), tuple(v.shape or ()), op.op_type) for op in ops for v in op.outputs]
    working = [size for size in sizes if size[1] not in cache_shapes]
    return max(working) if working else (0, (), "")


def state_bytes(saved: SavedPackage, function: str) -> int:
    """Bytes of the function's states (the K and V cache of a stateful sidecar), 0 without states."""
    sigs = state_signatures(saved, function).values()
    return sum(int(np.prod(sig.shape, dtype=np.int64)) * DTYPE_BYTES.get(sig.dtype, 4) for sig in sigs)


def _function_entry(saved: SavedPackage, name: str, info) -> dict:
    arena, shape, op = largest_working_output(saved, name)
    return {
        "inputs": {s.name: s.to_dict() for s in info.inputs},
        "outputs": {s.name: s.to_dict() for s in info.outputs},
        "op_counts": info.op_counts,
        "largest_intermediate_bytes": info.largest_intermediate_bytes,  # any op output, the state's included
        "arena_bytes": arena,  # the largest op output not shaped like a state
        "arena_op": op,
        "arena_shape": list(shape),
        "state_bytes": state_bytes(saved, name),
    }


def inspect_package(package: str | os.PathLike) -> dict:
    """JSON-ready description: ``functions`` (name -> inputs/outputs name -> {shape, dtype},
    ``op_counts``, ``largest_intermediate_bytes`` (any op output), ``arena_bytes`` (the largest op
    output that is not state-shaped, with its op and shape) and ``state_bytes`` (the states'
    bytes, 0 for a function without state)), ``default_function``, ``weight_bytes``, ``metadata``."""
    saved = SavedPackage(package)
    return {
        "package": str(saved.path),
        "default_function": saved.default_function,
        "functions": {name: _function_entry(saved, name, info) for name, info in saved.functions.items()},
        "weight_bytes": weight_bytes(saved.path),
        "metadata": read_raw_metadata(saved.path),
        "contract": contract_notes(read_raw_metadata(saved.path), str(saved.path)),
    }


def contract_notes(raw: dict[str, str], where: str) -> list[str]:
    """What a caller must do around this layer's package, from its metadata: the mask (and its
    sliding window), the rows it feeds, what it applies to attn_out, the K-cache channel order."""
    try:
        meta = SidecarMetadata.from_strings(raw, where)
    except AnelabInputError as e:
        return [f"metadata unreadable: {e}"]
    g, w = meta.geometry, meta.sliding_window
    if w is None:
        notes = ["mask: masks.causal(C, H) (full attention)"]
    elif meta.ring_slots is not None:
        notes = [
            f"window: in-graph — key j visible from position p iff 0 <= p - j < {w}; the K/V state is a ring of "
            f"{meta.ring_slots} slots (position p in slot p mod {meta.ring_slots}), so every call scores "
            f"{meta.ring_slots} keys per row whatever the position (feed no mask)"
        ]
    else:
        notes = [
            f"mask: masks.causal(C, H, window={w}) — sliding window of {w} tokens (key j visible from position p "
            f"iff 0 <= p - j < {w})",
            f"window: from chunk start H >= {max(0, w - 1)} every row sees exactly {w} keys; only those keys reach "
            "the output, but each h<H> still takes the whole history (RoPE positions are absolute), so the layer "
            "needs the same functions as a full-attention one and its score work does not shrink",
        ]
    notes.append(
        "input rows: the raw residual stream (no input norm)"
        if g.get("input_rows") == "residual"
        else "input rows: the post-input-norm hidden rows"
    )
    notes.append(
        f"after attn_out: {g['after_o_proj']}" if g.get("after_o_proj") else "after attn_out: the residual add"
    )
    if g.get("rope_layout") == "interleaved":
        notes.append(
            "K cache (k_chunk / k_history): each head's rotary channels in half-rotated order "
            "(anelab.core.rope.interleaved_to_half of the model's interleaved layout)"
        )
    return notes


def format_inspection(info: dict) -> str:
    lines = [f"{info['package']}  (default function {info['default_function']}; weights {info['weight_bytes']:,} B)"]
    for name, f in info["functions"].items():
        lines.append(f"  {name}:")
        for kind in ("inputs", "outputs"):
            sig = ", ".join(f"{n} {v['dtype']}{v['shape']}" for n, v in f[kind].items())
            lines.append(f"    {kind:<8} {sig}")
        ops = ", ".join(f"{k} {v}" for k, v in f["op_counts"].items())
        lines.append(f"    ops      {sum(f['op_counts'].values())}: {ops}")
        if f.get("state_bytes"):  # the state's reads/writes are capacity-sized by design: reported apart
            lines.append(
                f"    arena    {f['arena_bytes']:,} B (largest op output besides the state: {f['arena_op']} "
                f"{f['arena_shape']})"
            )
            lines.append(f"    state    {f['state_bytes']:,} B (K and V cache, read and updated in place)")
        else:
            lines.append(f"    largest intermediate {f['largest_intermediate_bytes']:,} B")
    lines.append("  contract:")
    lines.extend(f"    {note}" for note in info.get("contract", []))
    lines.append("  metadata:")
    for k, v in sorted(info["metadata"].items()):
        lines.append(f"    {k}: {v if len(v) < 100 else v[:97] + '...'}")
    return "\n".join(lines)
