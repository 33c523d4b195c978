"""``anelab measure``: on a Mac, everything fresh in one command — doctor, export with the ANE gate, verify on the
device, load timings, block A/B, the planned offload splits' A/B on the real model, probe timing (``--dry-run``
lists the steps anywhere)."""

from __future__ import annotations

import argparse

from anelab.checkpoints.default import resolve_checkpoint
from anelab.commands.arguments import int_list
from anelab.publish.measure import MeasureConfig, measure, plan_text


def setup_arg_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the embedded default)")
    p.add_argument("--layer", type=int, default=None, help="full-attention layer (default: the first)")
    p.add_argument("--chunk", type=int, default=64, help="chunk width C (default 64)")
    p.add_argument("--histories", type=int_list, default=None, help="histories (default 0,C,2C)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement (default 3)")
    p.add_argument("--build", default=None, help="build directory for packages (default build/measure)")
    p.add_argument("--records", default=None, help="where records go (default data/measured)")
    p.add_argument("--again", action="store_true", help="measure again what is already recorded here")
    p.add_argument("--dry-run", action="store_true", help="list the steps and exit (runs anywhere)")
    p.add_argument("--split-models", default="default-real", help="the split_ab step's models, comma-separated "
                   "(default default-real; '' skips the step): each split the plan proposes, timed by 'anelab ab'")  # fmt: skip
    p.add_argument("--split-prompt-tokens", type=int_list, default=(256,), help="the split_ab step's prompt "
                   "lengths (default 256)")  # fmt: skip


def main(args) -> int:
    checkpoint = None if args.checkpoint is None else resolve_checkpoint(args.checkpoint)
    config = MeasureConfig(
        checkpoint=checkpoint, layer=args.layer, chunk=args.chunk, histories=args.histories,
        repeats=args.repeats, again=args.again,
        split_models=tuple(m for m in args.split_models.split(",") if m), split_prompt_tokens=tuple(args.split_prompt_tokens),
    )  # fmt: skip
    if args.build:
        config.build = args.build
    if args.records:
        config.records = args.records
    if args.dry_run:
        print(plan_text(config))
        return 0
    summary = measure(config)
    print(
        f"{len(summary['written'])} records written to {config.records}; skipped: {', '.join(summary['skipped']) or 'none'}"
    )
    return 0
