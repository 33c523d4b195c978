"""Benchmark: ``anelab decide`` end to end off-Mac on a Llama-3.2-1B-shaped checkpoint.

The checkpoint has the real 1B's shape (16 layers, hidden 2048, 32 heads x 64, 8 KV heads, llama3
RoPE, MLP 8,192, tied 128,256-token vocabulary, BF16, two shards) with random weights, written by
the project's writer (``anelab.checkpoints.default.make_llama32_1b_shaped``). ``decide`` plans every design,
exports and verifies the candidate's sidecars for all 16 layers, runs the whole-model arms and
writes the report; the script prints the wall time of each phase (one run, nothing asserted), the
verdict section, and where report.html is. A second run in the same directory is timed too: it
reuses every exported and verified package (same content hash).

Usage: python benchmarks/bench_decide.py [--prompt-tokens N] [--chunk C] [--design D] [--out DIR] [--quick]
(``--quick``: the shape scaled down 8x in width, 2 layers, small vocabulary — what the tests run.)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=None, help="default: the cost family's (4,096)")
    parser.add_argument("--design", default="auto")
    parser.add_argument("--out", default="build/bench_decide")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()

    from anelab.checkpoints.default import make_llama32_1b_shaped
    from anelab.decide.report import verdict_lines
    from anelab.decide.run import DecideConfig, decide

    out = Path(args.out)
    checkpoint = out / ("llama32-1b-shaped-quick" if args.quick else "llama32-1b-shaped")
    start = time.perf_counter()
    if not (checkpoint / "config.json").exists():
        shape = dict(scale=8, num_layers=2, vocab=256, intermediate=128) if args.quick else {}
        make_llama32_1b_shaped(checkpoint, **shape)
    print(f"checkpoint {checkpoint}: {time.perf_counter() - start:.1f} s")
    tokens, chunk = (64, 32) if args.quick else (args.prompt_tokens, args.chunk)
    config = DecideConfig(checkpoint, tokens, out / "report", design=args.design, chunk=chunk)
    for run in ("first run", "second run (reuses the verified packages)"):
        start = time.perf_counter()
        decision = decide(config).to_dict()
        print(f"decide, {run}: {time.perf_counter() - start:.1f} s")
    print("\n".join(verdict_lines(decision)))
    print(f"report: {out / 'report' / 'report.html'}")


if __name__ == "__main__":
    main()
