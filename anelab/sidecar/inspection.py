"""Inspect a saved sidecar package: functions, I/O signatures, metadata, weight bytes."""

from __future__ import annotations

import os

from anelab.sidecar.evaluate import SavedPackage
from anelab.sidecar.format import read_raw_metadata, weight_bytes


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
    }


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
    lines.append("  metadata:")
    for k, v in sorted(info["metadata"].items()):
        lines.append(f"    {k}: {v if len(v) < 100 else v[:97] + '...'}")
    return "\n".join(lines)
