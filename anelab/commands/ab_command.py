"""``anelab ab``: the whole-model prefill A/B, mlx-lm's own prefill (the GPU arm) against the hybrid with every
full-attention layer (and / or every MLP, a hybrid's GDN projections: a split) on its sidecar (the ANE arm); each
split the plan proposes with ``--split planned``; measured on a Mac, a labelled correctness run elsewhere."""

from __future__ import annotations

import argparse
from pathlib import Path

from anelab.arms.prefill_ab import ab_request, run_ab
from anelab.checkpoints.default import resolve_checkpoint
from anelab.commands.arguments import int_list, print_json
from anelab.core.limits import require_prompt_lengths
from anelab.core.paths import MEASURED_DIR


def setup_arg_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="model directory (config.json + safetensors) mlx-lm reads")
    p.add_argument("--sidecars", help="directory of layer_<L>.mlpackage for every full-attention layer")
    p.add_argument("--mlp-sidecars", help="directory of --graph mlp packages: every MLP on its sidecar too (a split, "
                   "served through Core ML on a Mac; evaluated by NumPy elsewhere, for correctness)")  # fmt: skip
    p.add_argument("--gdn-sidecars", help="directory of --graph gdn-proj packages: a hybrid's GDN input projections "
                   "on their sidecars too (as --mlp-sidecars)")  # fmt: skip
    p.add_argument("--split", action="append", default=None, metavar="NAME",
                   help="time this split alone (repeatable): a name 'anelab plan --checkpoint' prints, e.g. "
                   "'attention', 'mlp', 'attention + mlp', 'mlp[:12]', each part served from its directory above; "
                   "'planned': the best split and the runner-up the plan proposes on --chip at each prompt length "
                   "('none' left out: the GPU arm times it). Default: the sidecars given, served together")  # fmt: skip
    p.add_argument("--chip", default=None, help="whose plan --split planned reads and each split's prediction is "
                   "printed for (default: this Mac's chip; off a Mac the seed's M3, said so)")  # fmt: skip
    p.add_argument("--prompt-tokens", type=int_list, required=True, help="prompt lengths, e.g. 512,2048 (random ids)")
    p.add_argument(
        "--compute-units", default="cpu_and_ne", help="the ANE arm's Core ML compute units (cpu_and_ne | all)"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of each arm first (default 1)")
    p.add_argument("--repeats", type=int, default=2, help="measured runs of each arm (default 2: the seed's protocol)")
    p.add_argument("--dtype", default=None, help="mlx-lm's parameters: float32 | float16 | bfloat16 (default: the "
                   "checkpoint's on a Mac, float32 elsewhere)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument(
        "--out", default=None, help="records directory (default data/measured; new files, never overwritten)"
    )
    p.add_argument("--json", action="store_true", help="print the records and verdicts as JSON")


def main(args) -> int:
    require_prompt_lengths(args.prompt_tokens)  # before the arms' work
    request = ab_request(
        resolve_checkpoint(args.checkpoint), args.sidecars, args.prompt_tokens, compute_units=args.compute_units,
        warmup=args.warmup, repeats=args.repeats, dtype=args.dtype, seed=args.seed,
        out_dir=Path(args.out) if args.out else MEASURED_DIR,
        mlp_sidecars=Path(args.mlp_sidecars) if args.mlp_sidecars else None,
        gdn_sidecars=Path(args.gdn_sidecars) if args.gdn_sidecars else None,
        splits=tuple(args.split or ()), chip=args.chip,
    )  # fmt: skip
    report = run_ab(request)
    if args.json:
        print_json(report.to_dict())
    else:
        print(report.table())
    return 0
