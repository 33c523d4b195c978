"""``anelab export``: attention layers (full or sliding window) as multifunction Core ML (or Core AI) sidecars."""

from __future__ import annotations

import argparse

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.config import REFUSED, supported_families
from anelab.checkpoints.default import named_checkpoints, resolve_checkpoint
from anelab.checkpoints.formats import supported_formats
from anelab.checkpoints.whole_model import whole_model_support
from anelab.commands.arguments import CHECKPOINT_HELP, int_list, print_json
from anelab.core.errors import AnelabInputError
from anelab.runtimes.coreml.coreml_runtime import default_runtime
from anelab.runtimes.coreml.gate import AneGate
from anelab.sidecar.backends import get_backend
from anelab.sidecar.designs import SidecarRequest
from anelab.sidecar.export import export_request, selection_from_flags


def setup_arg_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", nargs="?", help=CHECKPOINT_HELP)
    p.add_argument(
        "--list-families",
        action="store_true",
        help="print the supported model families, RoPE types and what is refused",
    )
    p.add_argument(
        "--list-formats", action="store_true", help="print the checkpoint formats read (and named checkpoints)"
    )
    p.add_argument("--chunk", type=int, help="chunk width C (rows per call)")
    p.add_argument(
        "--jobs", type=int, default=None, help="layers exported at once off-Mac (default: up to 2, one per core)"
    )
    p.add_argument(
        "--histories",
        type=int_list,
        default=None,
        help="comma-separated histories, multiples of C (e.g. 0,C,2C); required unless --graph stateful --capacity N",
    )
    p.add_argument(
        "--layers", type=int_list, default=None, help="attention layers to export, full or windowed (default: all)"
    )
    p.add_argument(
        "--graph",
        "--design",
        dest="graph",
        default=None,
        help="sidecar design (anelab.sidecar.designs; default dense): dense | tiled (online softmax over key tiles) | "
        "stateful (K/V as Core ML state) | stateful-tiled (K/V in state, key and query tiles) | mlp (every layer's MLP, "
        "one function c<C>, no --histories) | gdn-proj (a hybrid's Gated DeltaNet input projections, likewise)",
    )
    p.add_argument("--query-tile", type=int, default=None, help="stateful-tiled graph: chunk rows per query tile")
    p.add_argument(
        "--mask-mode",
        default=None,
        help="stateful-tiled graph (default causal): causal (in-graph, no mask input; a windowed layer's window "
        "too) | additive (full-attention layers: plus a mask input [C, capacity], e.g. a folded selection)",
    )
    p.add_argument(
        "--tile",
        type=int,
        default=None,
        help="tiled graph: key positions per tile, a divisor of the chunk (default: the chunk); "
        "stateful-tiled: cache slots per tile, a divisor of the capacity",
    )
    p.add_argument("--weights", default="fp16", help="projection weights: fp16 | int8 | palettize4 | int4-block")
    p.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="stateful graph: cache slots per state (default: the histories' coverage)",
    )
    p.add_argument(
        "--decode", action="store_true", help="stateful graph: add a decode function c1 sharing the state and weights"
    )
    p.add_argument(
        "--backend",
        default=None,
        help="sidecar format (anelab.sidecar.backends): coreml (default: layer_<L>.mlpackage) | coreai (layer_<L>.aimodel, "
        "Core AI: the Core ML package lowered op by op, Neural Engine rules applied)",
    )
    p.add_argument("--out", help="output directory for layer_<L>.mlpackage (or .aimodel)")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.add_argument(
        "--selection-kept-blocks",
        type=int,
        default=None,
        help="sparse-indexed model: the indexer's kept blocks per query (records selectionFolded: true)",
    )
    p.add_argument(
        "--selection-compress-ratio", type=int, default=None, help="sparse-indexed model: keys per indexer block"
    )


def print_families(rows, refused) -> None:
    for r in rows:
        print(f"{r['model_type']:<17} {r['architecture']:<34} variant {r['variant']}")
        print(f"  RoPE: {', '.join(r['rope_types'])}; windows: {r['windows']}")
        if r["options"]:
            print(f"  options: {'; '.join(r['options'])}")
        print(f"  whole model (compare-arms): {r['whole_model']}")
    print("refused:")
    for line in refused:
        print(f"  {line}")


def print_formats(args) -> int:
    rows, named = supported_formats(), {n.name: n.what for n in named_checkpoints().values()}
    if args.json:
        print_json({"formats": rows, "named": named})
        return 0
    for row in rows:
        print(f"{row['format']:<12} {row['summary']}")
        print("".join(f"  refuses: {line}\n" for line in row["refuses"]), end="")
    print("named checkpoints:")
    print("".join(f"  {name:<14} {what}\n" for name, what in named.items()), end="")
    return 0


def sidecar_request(args) -> SidecarRequest:
    """The one options object of an export, from its flags (validated against the checkpoint by export)."""
    return SidecarRequest(
        args.chunk,
        args.histories,
        args.graph,
        key_tile=args.tile,
        query_tile=args.query_tile,
        capacity=args.capacity,
        decode=args.decode,
        mask_mode=args.mask_mode,
        weights=args.weights,
        selection=selection_from_flags(args.selection_kept_blocks, args.selection_compress_ratio),
        backend=args.backend,
    )


def main(args) -> int:
    if args.list_formats:
        return print_formats(args)
    if args.list_families:
        rows = [{**r, "whole_model": whole_model_support(r["model_type"])} for r in supported_families()]
        print_json({"families": rows, "refused": list(REFUSED)}) if args.json else print_families(rows, REFUSED)
        return 0
    missing = [
        flag
        for flag, value in (("CHECKPOINT", args.checkpoint), ("--chunk", args.chunk), ("--out", args.out))
        if value is None
    ]
    if missing:
        raise AnelabInputError(f"export: pass {', '.join(missing)} (or --list-families)")
    gate = AneGate.for_runtime(default_runtime())
    checkpoint, request = resolve_checkpoint(args.checkpoint), sidecar_request(args)
    get_backend(request.backend)  # an unknown --backend refused before the checkpoint is opened
    results = export_request(load_checkpoint(checkpoint), args.out, request, args.layers, gate=gate, jobs=args.jobs)
    summary = [
        {
            "package": str(r.package),
            "layer": r.metadata.layer,
            "functions": r.functions or r.metadata.functions,
            "coverage": r.metadata.coverage,
            "weight_bytes": r.weight_bytes,
            "single_function_weight_bytes": r.metadata.single_function_weight_bytes,
            "aneCompileVerified": r.metadata.ane_verified,
            "reason": r.metadata.ane_reason,
            "selectionFolded": r.metadata.selection_folded,
            "window_note": r.window_note,
        }
        for r in results
    ]
    if args.json:
        print_json(summary)
        return 0
    for s in summary:
        print(
            f"{s['package']}: functions {','.join(s['functions'])}; coverage {s['coverage']}; "
            f"weights {s['weight_bytes']:,} B ({s['weight_bytes'] / max(1, s['single_function_weight_bytes']):.3f}x one function)"
        )
        if s["window_note"]:
            print(f"  {s['window_note']}")
    if results and not results[0].metadata.ane_verified:
        print(f"aneCompileVerified: false — {results[0].metadata.ane_reason}")
    return 0
