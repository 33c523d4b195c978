"""Inspect a saved sidecar package: functions, I/O signatures, metadata, weight bytes."""

from __future__ import annotations

import os

from anelab.errors import AnelabInputError
from anelab.sidecar.evaluate import SavedPackage
from anelab.sidecar.format import SidecarMetadata, read_raw_metadata, weight_bytes


def inspect_package(package: str | os.PathLike) -> dict:
    """JSON-ready description: ``functions`` (name -> inputs/outputs name -> {shape, dtype},
    ``op_counts``, ``largest_intermediate_bytes``), ``default_function``, ``weight_bytes``, ``metadata``."""
    saved = SavedPackage(package)
    return {
        "package": str(saved.path),
        "default_function": saved.default_function,
        "functions": {
            name: {
                "inputs": {s.name: s.to_dict() for s in info.inputs},
                "outputs": {s.name: s.to_dict() for s in info.outputs},
                "op_counts": info.op_counts,
                "largest_intermediate_bytes": info.largest_intermediate_bytes,
            }
            for name, info in saved.functions.items()
        },
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
            "(anelab.rope.interleaved_to_half of the model's interleaved layout)"
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
        lines.append(f"    largest intermediate {f['largest_intermediate_bytes']:,} B")
    lines.append("  contract:")
    lines.extend(f"    {note}" for note in info.get("contract", []))
    lines.append("  metadata:")
    for k, v in sorted(info["metadata"].items()):
        lines.append(f"    {k}: {v if len(v) < 100 else v[:97] + '...'}")
    return "\n".join(lines)
