"""``anelab plan``: chunks, variants, setup and the ANE-vs-GPU decision for one prompt, from the recorded data's
fitted costs (the flags become one ``planner.plan_request.PlanOptions``; the planner picks the mode)."""

from __future__ import annotations

import argparse
from dataclasses import fields

from anelab.commands.arguments import (
    add_chip,
    add_gpu_runtime,
    add_protocol,
    add_user_gpu,
    float_list,
    int_list,
    print_json,
)
from anelab.planner.plan_request import PlanOptions, plan_request

PLAN_EXAMPLES = """examples:
  anelab plan --family qwen3.8-125b-a6b-4bit --prompt-tokens 4333
      the seed's lost case: chunks, variants visited, setup, predicted ratio and the decision
  anelab plan --prompt-tokens 4333 --design all --family qwen3.8-125b-a6b-4bit
      dense (one function per history) vs stateful vs stateful-tiled sidecars for one family
  anelab plan --checkpoint build/checkpoints/anelab-tiny-hybrid --prompt-tokens 2048
      your model's own layers and heads, costs from the closest recorded family
  anelab plan --list-families
      the families, what is recorded and what is unknown
  anelab plan --fit-report
      predicted vs recorded ratio of every recorded A/B row
  anelab plan --backtest
      every recorded row: recorded ratio, in-sample and family-held-out prediction, side
  anelab plan --family qwen3.5-2b-4bit --prompt-tokens 4333 --chip m3 --reload-policy preloaded
      the estimate beside the fastest an M3 could run each arm; reloads hidden behind the GPU
  anelab plan --family qwen3.5-2b-4bit --prompt-tokens 4333 --gpu-runtime mlx-lm --chip m4-max
      the same ANE arm against mlx-lm's prefill on an M4 Max instead of the seed's GPU path
  anelab plan --gpu-runtimes
      the GPU runtimes a plan can price and the public mlx-lm records behind mlx-lm's
  anelab plan --published-splits
      oMLX's and mlx-serve's published MLP / GDN-projection splits beside the planner's prediction"""


def setup_arg_parser(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Chunks, variants, setup and the ANE-vs-GPU decision for one prompt, from the recorded "
        "data's fitted costs (every number says where it came from)."
    )
    p.epilog, p.formatter_class = PLAN_EXAMPLES, argparse.RawDescriptionHelpFormatter
    p.add_argument("--family", help="a recorded family (see --list-families); supplies geometry and fitted costs")
    p.add_argument(
        "--checkpoint",
        help="plan a checkpoint's own layers (full and windowed), heads and head_dim; its GPU arm from its own "
        "FLOPs (mlx-lm), the ANE's costs from the closest family",
    )
    p.add_argument("--prompt-tokens", type=int, help="prompt length in tokens")
    p.add_argument("--chunk", type=int, help="prefill chunk = sidecar width (default with a family: 4096)")
    p.add_argument(
        "--histories", type=int_list, help="sidecar functions on hand, e.g. 0,4096 (default: what the prompt needs)"
    )
    p.add_argument(
        "--max-history", type=int, help="histories 0, chunk, ..., MAX_HISTORY (coverage = MAX_HISTORY + chunk)"
    )
    p.add_argument("--layers", type=int, help="number of layers")
    p.add_argument("--full-attention-layers", type=int_list, help="indices of the full-attention layers, e.g. 3,7,11")
    p.add_argument("--heads", type=int, help="query heads of a full-attention layer")
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--sparse-budget", type=int, help="keys per query on the GPU's sparse path (omit: dense)")
    p.add_argument("--load-seconds", type=float_list, help="per-variant load: one value, or one per history")
    p.add_argument("--gpu-attention-seconds", type=float, help="one layer's GPU attention, full chunk at history 0")
    p.add_argument("--ane-attention-seconds", type=float, help="one layer's ANE attention, full chunk at history 0")
    p.add_argument("--non-attention-seconds", type=float, help="the rest of this prompt's prefill")
    add_user_gpu(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--list-families", action="store_true", help="list the families, what is recorded and unknown")
    p.add_argument("--fit-report", action="store_true", help="predicted vs recorded ratio of every recorded A/B row")
    p.add_argument(
        "--backtest",
        action="store_true",
        help="every recorded A/B row: recorded ratio, in-sample and leave-one-family-out prediction, side",
    )
    add_protocol(p)
    add_chip(p)
    add_gpu_runtime(p)
    p.add_argument("--validate-chips", action="store_true", help="the per-chip model's predicted ANE-vs-GPU ratio "
                   "against every public measurement on other chips (inside its interval or not)")  # fmt: skip
    p.add_argument("--published-splits", action="store_true", help="the published oMLX and mlx-serve ANE/GPU splits "
                   "beside the offload split's prediction for each (or why it has none)")  # fmt: skip
    p.add_argument(
        "--gpu-runtimes",
        action="store_true",
        help="the GPU runtimes a plan can price and the public mlx-lm records behind mlx-lm's (each held out)",
    )
    p.add_argument(
        "--design",
        type=lambda t: t.split(","),
        help="compare sidecar designs: dense,stateful,stateful-tiled (or 'all'); every family unless --family",
    )
    p.add_argument("--tile", type=int, help="--design stateful-tiled: cache slots per key tile")
    p.add_argument("--query-tile", type=int, help="--design stateful-tiled: chunk rows per query tile")
    p.add_argument(
        "--backend",
        default=None,
        help="with --family: whose loads are priced — coreml (default: the recorded loads) | coreai (Core AI / Core ML "
        "load ratio from 'anelab measure' records on macOS 27, applied to them; prints the per-variant load that flips it)",
    )


def main(args) -> int:
    result = plan_request(PlanOptions(**{f.name: getattr(args, f.name) for f in fields(PlanOptions)}))
    print_json(result.payload) if args.json else print(result.text())
    return 0
