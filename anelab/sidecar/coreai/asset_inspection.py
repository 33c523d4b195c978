"""Inspect a saved Core AI sidecar (``.aimodel``): entrypoints, weights stored once, Neural Engine problems.

Read from the asset on disk: its summary (Apple's ``AIModelAsset.summary``: entrypoint I/O and, with
statistics, the stored constants by element type, the op distribution and compute types of the program
*as coreai decomposes it*) and its program walked op by op (``AIModelAsset.program``; the walk needs the
MLIR module behind the facade, ``AIProgram._module`` — the beta exposes no public op iterator). A
problem is what Apple's Neural Engine rules reject in the saved program: an fp32 result, a tensor of
rank above 5. The summary's fp32 compute type is reported apart: coreai's own decomposition of
``reduce_sum`` / ``reduce_mean`` / ``softmax`` accumulates in fp32, which no authored op asks for.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

from anelab.sidecar.coreai.asset import CoreAIAsset, raw_asset_metadata, require_asset
from anelab.sidecar.coreai.coreai_import import coreai_modules
from anelab.sidecar.coreai.lowering import MAX_RANK
from anelab.sidecar.format import COREAI_META

ELEMENT_BYTES = {"Float16": 2, "Float32": 4, "BFloat16": 2, "Int8": 1, "UInt8": 1, "Int16": 2, "UInt16": 2,
                 "Int32": 4, "UInt32": 4, "Int64": 8, "UInt64": 8, "Bool": 1}  # fmt: skip
_TENSOR = re.compile(r"tensor<([^,>]*?)x?([a-z]+[0-9]*)(?:,|>)")


def _walk(operation):
    for region in operation.regions:
        for block in region.blocks:
            for op in block.operations:
                yield op
                yield from _walk(op.operation)


def _tensor_types(text: str) -> list[tuple[int, str]]:
    """(rank, element type) of every ``tensor<...>`` in a type's text (a handle wraps one)."""
    out = []
    for dims, element in _TENSOR.findall(text):
        out.append((len([d for d in dims.split("x") if d]), element))
    return out


def program_report(path: str | os.PathLike) -> dict:
    """The saved program walked op by op: op counts, max rank, fp32 and rank > 5 results, int32 results
    (by op name), and each entrypoint's handle (state) arguments."""
    ca = coreai_modules()
    asset = ca.authoring.AIModelAsset.load(require_asset(path))
    module = asset.program._module._mlir_module  # no public op iterator in the beta (module docstring)
    ops, fp32, over, int32, states = Counter(), Counter(), Counter(), Counter(), {}
    max_rank = 0
    for op in _walk(module.operation):
        name = op.name
        ops[name] += 1
        if name == "coreai.graph":
            graph = op.attributes["sym_name"].value
            args = op.regions[0].blocks[0].arguments
            names = [
                str(a).split('"')[1] if '"' in str(a) else f"arg{i}" for i, a in enumerate(op.attributes["arg_attrs"])
            ]
            states[graph] = {n: str(a.type) for n, a in zip(names, args, strict=False) if "handle" in str(a.type)}
        for result in op.results:
            for rank, element in _tensor_types(str(result.type)):
                max_rank = max(max_rank, rank)
                fp32[name] += element == "f32"
                over[name] += rank > MAX_RANK
                int32[name] += element == "si32" and name != "coreai.constant"
    clean = lambda c: {k: v for k, v in sorted(c.items()) if v}  # noqa: E731
    return {"ops": clean(ops), "max_rank": max_rank, "fp32_results": clean(fp32), "rank_over_5": clean(over),
            "int32_results": clean(int32), "states": states}  # fmt: skip


def stored_constant_bytes(path: str | os.PathLike) -> int:
    """Bytes of the constants the asset stores (its summary's storage types: element count x size)."""
    ca = coreai_modules()
    summary = ca.authoring.AIModelAsset.load(require_asset(path)).summary(include_statistics=True)
    return sum(count * ELEMENT_BYTES.get(kind, 4) for kind, count in summary.storage_types)


def inspect_asset(path: str | os.PathLike) -> dict:
    """JSON-ready description of a saved ``.aimodel`` (see the module docstring)."""
    ca = coreai_modules()
    saved = CoreAIAsset(path)
    summary = ca.authoring.AIModelAsset.load(saved.path).summary(include_statistics=True)
    raw = raw_asset_metadata(saved.path)
    fields = raw.get(COREAI_META) or {}
    program = program_report(saved.path)
    stored = sum(count * ELEMENT_BYTES.get(kind, 4) for kind, count in summary.storage_types)
    once = fields.get("weightsOnce", {})
    single = saved.metadata.single_function_weight_bytes
    problems = [
        f"fp32 result of {op} ({n}x): the Neural Engine runs fp16 / int8 / int16 only"
        for op, n in program["fp32_results"].items()
    ]
    problems += [
        f"rank > {MAX_RANK} result of {op} ({n}x): the Neural Engine rejects rank-6+ tensors"
        for op, n in program["rank_over_5"].items()
    ]
    notes = []
    if "Float32" in summary.compute_types:
        notes.append("coreai's decomposition (summary statistics) computes in fp32 where it accumulates "
                     "(reduce_sum / reduce_mean / softmax); no authored op has an fp32 result")  # fmt: skip
    if program["int32_results"]:
        notes.append(
            "int32 results (the rule lists fp16 / int8 / int16): "
            + ", ".join(f"{k} {v}" for k, v in program["int32_results"].items())
        )
    saved.close()
    return {
        "package": str(saved.path),
        "backend": "Core AI",
        "entrypoints": {
            name: {
                "inputs": {s.name: s.to_dict() for s in info.inputs},
                "outputs": {s.name: s.to_dict() for s in info.outputs},
                "states": program["states"].get(name, {}),
            }
            for name, info in saved.functions.items()
        },  # fmt: skip
        "weights": {
            "stored_constant_bytes": stored,
            "asset_bytes": sum(p.stat().st_size for p in Path(saved.path).rglob("*") if p.is_file()),
            "single_function_weight_bytes": single,
            "stored_over_one_function": stored / single if single else None,
            "referenced_by_each_entrypoint": once.get("per_function", {}),
            "sum_over_entrypoints": once.get("sum_over_functions"),
        },
        "program": program,
        "framework_compute_types": list(summary.compute_types),
        "problems": problems,
        "notes": notes,
        "neural_engine_rules": fields.get("neuralEngineRules", []),
        "masked_value": fields.get("maskedValue"),
        "metadata": {k: v for k, v in raw.items() if isinstance(v, str)},
    }


def format_asset_inspection(info: dict) -> str:
    w = info["weights"]
    lines = [
        f"{info['package']}  (Core AI asset; {len(info['entrypoints'])} entrypoints; {w['asset_bytes']:,} B on disk)",
        f"  weights: {w['stored_constant_bytes']:,} B of constants stored once for {len(info['entrypoints'])} entrypoints"
        + (f" ({w['stored_over_one_function']:.3f}x one Core ML function's {w['single_function_weight_bytes']:,} B)"
           if w["stored_over_one_function"] else "")
        + (f"; the entrypoints reference {w['sum_over_entrypoints']:,} B in all" if w["sum_over_entrypoints"] else ""),
    ]  # fmt: skip
    for name, e in info["entrypoints"].items():
        lines.append(f"  {name}:")
        for kind in ("inputs", "outputs"):
            lines.append(f"    {kind:<8} " + ", ".join(f"{n} {v['dtype']}{v['shape']}" for n, v in e[kind].items()))
        if e["states"]:
            lines.append("    states   " + ", ".join(f"{n} {t}" for n, t in e["states"].items()))
    p = info["program"]
    lines.append(f"  program: {sum(p['ops'].values())} ops, max rank {p['max_rank']}")
    lines.append("  problems: " + ("none (no fp32 result, no rank > 5)" if not info["problems"] else ""))
    lines += [f"    {x}" for x in info["problems"]]
    lines += [f"  note: {x}" for x in info["notes"]]
    lines.append(f"  Neural Engine rules (mask drop value {info['masked_value']}):")
    lines += [f"    {r['rule']}: {r['status']} — {r['detail']}" for r in info["neural_engine_rules"]]
    return "\n".join(lines)
