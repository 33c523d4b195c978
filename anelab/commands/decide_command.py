"""``anelab decide``: plan every design for a checkpoint, export + verify the candidate, run the whole-model arms,
(on a Mac) measure, and write report.html / report.md / decision.json."""

from __future__ import annotations

import argparse
from pathlib import Path

from anelab.checkpoints.default import resolve_checkpoint
from anelab.commands.arguments import CHECKPOINT_HELP, add_chip, add_gpu_runtime, add_user_gpu, print_json
from anelab.core.errors import AnelabInputError
from anelab.core.limits import MAX_POSITIONS, require_at_most
from anelab.decide.decision import DecideConfig, decide
from anelab.decide.decision_report import offload_split_report_lines, verdict_lines
from anelab.planner.chips import bound_sentence, get_chip, plan_bounds
from anelab.planner.gpu_runtimes import default_gpu_runtime, require_gpu_runtime
from anelab.planner.plan import check_user_gpu


def setup_arg_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help=CHECKPOINT_HELP)
    p.add_argument("--prompt-tokens", type=int, required=True, help="your prompt length in tokens")
    add_user_gpu(p)
    p.add_argument("--design", default="auto", help="auto (best predicted ratio) | dense | stateful | stateful-tiled")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk = sidecar width (default: the cost family's)")
    p.add_argument("--family", default=None, help="recorded dense family for the costs (default: the closest)")
    p.add_argument("--out", default=None, help="report directory (default: decide-<checkpoint name>)")
    p.add_argument("--measure", action="store_true", help="on a Mac: time the packages and plan again with the times")
    p.add_argument("--repeats", type=int, default=3, help="--measure: timed repeats per measurement (default 3)")
    p.add_argument("--json", action="store_true", help="print decision.json's verdict as JSON")
    p.add_argument("--weights", default="fp16", help="the packages' weight mode: fp16 | int8 | palettize4 | int4-block "
                   "(verified against their own weights; the compression's cost on real text reported beside)")  # fmt: skip
    add_chip(p)
    add_gpu_runtime(p)


def check_options(args) -> None:
    """Every option refused before decide writes its report directory (one line naming the fix)."""
    if args.prompt_tokens < 1:
        raise AnelabInputError(f"--prompt-tokens must be a positive integer, got {args.prompt_tokens}")
    require_at_most("--prompt-tokens", args.prompt_tokens, MAX_POSITIONS, "decide for a shorter prompt")
    check_user_gpu(args.gpu_prefill_seconds, args.gpu_tokens_per_second)
    if args.chip is not None:
        get_chip(args.chip)
    require_gpu_runtime(args.gpu_runtime or default_gpu_runtime(checkpoint=True))


def main(args) -> int:
    check_options(args)
    out = Path(args.out) if args.out else Path(f"decide-{Path(args.checkpoint).name}")
    config = DecideConfig(
        checkpoint=resolve_checkpoint(args.checkpoint),
        prompt_tokens=args.prompt_tokens,
        out=out,
        design=args.design,
        chunk=args.chunk,
        family=args.family,
        gpu_prefill_seconds=args.gpu_prefill_seconds,
        gpu_tokens_per_second=args.gpu_tokens_per_second,
        gpu_runtime=args.gpu_runtime,
        chip=args.chip,
        objective=args.objective,
        measure=args.measure,
        repeats=args.repeats,
        weights=args.weights,
    )
    decision = decide(config)
    if args.json:
        print_json(decision.verdict.to_dict())
        return 0
    print("\n".join(verdict_lines(decision) + offload_split_report_lines(decision)))
    if args.chip is not None:
        print(bound_sentence(plan_bounds(decision.plan.to_dict(), args.chip)))
    print(f"report: {out / 'report.html'} (also report.md, decision.json)")
    return 0
