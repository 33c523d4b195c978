"""``anelab compare-arms``: the whole model's per-layer hidden states, logits and greedy text with the attention
on the sidecars against the reference."""

from __future__ import annotations

import argparse

from anelab.arms.arm_comparison import compare_arms, named_with_sidecars, open_engine_model, read_tokens, require_engine
from anelab.arms.arm_runs import Indexer
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.default import named_checkpoints
from anelab.commands.arguments import CHECKPOINT_HELP, int_list, print_json
from anelab.core.errors import AnelabInputError


def setup_arg_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        help=CHECKPOINT_HELP + "; by name, its sidecars are exported first when --sidecars names a new directory",
    )
    p.add_argument("--sidecars", default=None, help="directory of layer_<L>.mlpackage for every full-attention layer")
    p.add_argument(
        "--mlp-sidecars",
        default=None,
        help="directory of --design mlp packages: adds the arms mlp-sidecar (MLPs on their sidecars) and, with "
        "--sidecars, all-sidecar (numpy engine)",
    )
    p.add_argument(
        "--mlp-layers", type=int_list, default=None, help="layers whose MLP the mlp arms serve (default: every layer)"
    )
    p.add_argument(
        "--gdn-sidecars",
        default=None,
        help="directory of --design gdn-proj packages (a Qwen 3.5 hybrid, mlx engine): adds the arm gdn-sidecar",
    )
    p.add_argument(
        "--gdn-layers", type=int_list, default=None, help="linear-attention layers the gdn arm serves (default: all)"
    )
    p.add_argument("--prompt-tokens", type=int, default=None, help="random prompt length (fixed seed)")
    p.add_argument("--tokens", default=None, help="token ids file (JSON list or whitespace-separated) instead")
    p.add_argument("--decode", type=int, default=32, help="greedy tokens decoded on the reference path (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default 0)")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk without sidecars (default 16)")
    p.add_argument("--kept-blocks", type=int, default=None, help="add folded / causal-only arms: indexer kept blocks")
    p.add_argument("--compress-ratio", type=int, default=4, help="indexer keys per block (default 4)")
    p.add_argument(
        "--compute-units",
        default=None,
        help="serve the sidecars through Core ML on a Mac (cpu_only | cpu_and_gpu | cpu_and_ne | all); "
        "default: NumPy evaluation of the saved programs",
    )
    p.add_argument(
        "--engine",
        default="auto",
        help="who runs everything but the sidecars: numpy (anelab's forward, the independent reference), mlx "
        "(mlx-lm's model: every family it runs, Qwen 3.5 hybrids and MoE included), or auto (default: numpy "
        "where anelab models the family, else mlx)",
    )
    p.add_argument(
        "--resident-budget",
        type=float,
        default=None,
        help="GiB of float32 decoder weights kept in memory (numpy engine; default 4; 0 streams every read from the "
        "checkpoint's files, the path for models that do not fit)",
    )
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")


def resident_bytes(gib: float) -> int:
    """``--resident-budget`` GiB as bytes (a finite number >= 0, else refused)."""
    if not gib >= 0 or gib == float("inf"):
        raise AnelabInputError(f"--resident-budget must be a finite number of GiB >= 0 (0 streams), got {gib}")
    return int(gib * 2**30)


def main(args) -> int:
    if (args.prompt_tokens is None) == (args.tokens is None):
        raise AnelabInputError("compare-arms: pass exactly one of --prompt-tokens N or --tokens FILE")
    checkpoint, sidecars = args.checkpoint, args.sidecars
    named = named_checkpoints().get(checkpoint)
    if named is not None:
        tokens = args.prompt_tokens or read_tokens(args.tokens).size
        checkpoint, sidecars = named_with_sidecars(checkpoint, sidecars, tokens, args.chunk or named.chunk)
    require_engine(args.engine)  # refused before the checkpoint is opened
    _, model = open_engine_model(load_checkpoint(checkpoint), args.engine)
    report = compare_arms(
        model,
        sidecars,
        args.prompt_tokens,
        decode=args.decode,
        tokens=read_tokens(args.tokens) if args.tokens else None,
        seed=args.seed,
        indexer=Indexer(args.kept_blocks, args.compress_ratio) if args.kept_blocks else None,
        chunk=args.chunk,
        compute_units=args.compute_units,
        resident_budget=None if args.resident_budget is None else resident_bytes(args.resident_budget),
        mlp_sidecars=args.mlp_sidecars,
        mlp_layers=args.mlp_layers,
        gdn_sidecars=args.gdn_sidecars,
        gdn_layers=args.gdn_layers,
    )
    if args.json:
        print_json(report.to_dict())
    else:
        print(report.table())
    return 0
