"""Benchmark: compare-arms' wall time against the GEMM floor of its two arms' matmuls, resident vs streamed weights.

Issue 32: on ``default-real`` (SmolLM2-135M, Q4_1 GGUF) a 500-token prompt and 24 decoded tokens took 14x the
GEMM floor on a quiet machine, because every decoded step re-read and dequantized every layer from the file.
This script runs ``compare_arms`` (reference + sidecar arm) twice in one process — weights streamed
(``resident_budget=0``, the old path) and resident (the default budget) — and, right before each, times the
floor: every matrix product the two arms make, as NumPy float32 matmuls of the same shapes on random arrays
(per layer and chunk: the Q/K/V/O projections, the scores and the weighted values against the keys so far, the
MLP's gate/up/down; the LM head at the last prompt row; then the same for each decoded row). Each distinct shape
is timed alone (best of 3, on one BLAS thread and on the default threads, the faster kept) and multiplied by how
often the arms make it, so the floor is what NumPy could not beat; it is timed before and after each run and the
lower of the two divides the run's wall time. Prints wall and CPU seconds of each run, the
floor, the ratios, the weights mode and the near-tie summary; asserts nothing. The machine is shared: the load
average is printed beside every number, and ratios are only comparable within one run.

Usage: python benchmarks/bench_arms_floor.py [--checkpoint default-real] [--tokens FILE | --prompt-tokens N]
       [--decode 24] [--sidecars DIR] [--chunk C] [--quick]
(``--quick``: default-dense, 64 tokens, 4 decoded — a smoke run.) Without --tokens, default-real's prompt is the
first N tokens of the README frozen at a615004 (docs/prompt/readme-a615004.md, real prose); other checkpoints get
seeded random ids.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np

REPEATS = 3


def matmul_shapes(model, prompt_tokens: int, decode: int, chunk: int, arms: int = 2) -> Counter:
    """(batch, m, k, n) -> how many [batch, m, k] @ [batch, k, n] float32 products ``arms`` arms make."""
    from anelab.core.geometry import chunk_starts

    g = model.geometry
    d, hq, hkv, inter = g.hidden_size, g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim, model.intermediate
    group = g.num_heads // g.num_kv_heads
    shapes: Counter = Counter()

    def rows_through_layers(rows: int, keys: int) -> None:
        for k, n in ((d, hq), (d, hkv), (d, hkv), (hq, d), (d, inter), (d, inter), (inter, d)):
            shapes[(1, rows, k, n)] += arms * g.num_layers
        shapes[(g.num_kv_heads, group * rows, g.head_dim, keys)] += arms * g.num_layers  # scores
        shapes[(g.num_kv_heads, group * rows, keys, g.head_dim)] += arms * g.num_layers  # weighted values

    for start in chunk_starts(prompt_tokens, chunk):
        rows = min(chunk, prompt_tokens - start)
        rows_through_layers(rows, start + rows)
    for step in range(1, decode):
        rows_through_layers(1, prompt_tokens + step)
    shapes[(1, 1, d, model.vocab_size)] += arms * decode  # the LM head: the last prompt row, then each decoded row
    return shapes


def _best(a: np.ndarray, b: np.ndarray) -> float:
    np.matmul(a, b)
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        np.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_floor(shapes: Counter) -> tuple[float, float]:
    """(seconds of every product at its best, GFLOP) — each distinct shape timed on 1 and the default BLAS threads."""
    from threadpoolctl import ThreadpoolController

    rng = np.random.default_rng(0)
    controller = ThreadpoolController()
    total = flops = 0.0
    for (batch, m, k, n), count in shapes.items():
        a = rng.standard_normal((batch, m, k), dtype=np.float32)
        b = rng.standard_normal((batch, n, k), dtype=np.float32).transpose(0, 2, 1)  # weights stored [out, in]
        default = _best(a, b)
        with controller.limit(limits=1, user_api="blas"):
            one = _best(a, b)
        total += count * min(default, one)
        flops += count * 2.0 * batch * m * k * n
    return total, flops / 1e9


def _prompt(args, checkpoint):
    from anelab.arms.arm_comparison import read_tokens

    if args.tokens:
        return read_tokens(args.tokens)
    if args.checkpoint == "default-real":
        from anelab.checkpoints.checkpoint import load_checkpoint

        text = (Path(__file__).resolve().parent.parent / "docs/prompt/readme-a615004.md").read_text()
        return load_checkpoint(checkpoint).tokenizer().encode(text)[: args.prompt_tokens]
    return None


def _timed_run(label: str, checkpoint, sidecars, prompt, args, budget):
    from anelab.arms.arm_comparison import compare_arms
    from anelab.checkpoints.whole_model import load_model

    load = os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    report = compare_arms(load_model(checkpoint), sidecars, None if prompt is not None else args.prompt_tokens, tokens=prompt,
                          decode=args.decode, resident_budget=budget)  # fmt: skip
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{label}: {wall:.1f} s wall, {cpu:.1f} s CPU (load average {load:.1f} before); {report.weights.describe()}")
    return report, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="default-real")
    parser.add_argument("--tokens", default=None, help="token ids file (default: README prose for default-real)")
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--decode", type=int, default=24)
    parser.add_argument("--sidecars", default=None, help="default: build/bench_arms_floor/<checkpoint>-c<chunk>")
    parser.add_argument("--chunk", type=int, default=None, help="sidecar width (default: the named checkpoint's)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.checkpoint, args.prompt_tokens, args.decode = "default-dense", 64, 4

    from anelab.arms.arm_comparison import named_with_sidecars
    from anelab.checkpoints.default import named_checkpoints
    from anelab.checkpoints.whole_model import load_model

    named = named_checkpoints().get(args.checkpoint)
    chunk = args.chunk or (named.chunk if named else 256)
    sidecars = args.sidecars or f"build/bench_arms_floor/{args.checkpoint}-c{chunk}"
    started = time.perf_counter()
    checkpoint, sidecars = named_with_sidecars(args.checkpoint, sidecars, args.prompt_tokens, chunk)
    print(f"checkpoint {checkpoint}, sidecars {sidecars} ready: {time.perf_counter() - started:.1f} s")
    prompt = _prompt(args, checkpoint)
    tokens = args.prompt_tokens if prompt is None else int(prompt.size)
    shapes = matmul_shapes(load_model(checkpoint), tokens, args.decode, chunk)
    print(f"{tokens} prompt tokens in chunks of {chunk}, {args.decode} decoded, two arms (reference, sidecar)")
    first, gflop = gemm_floor(shapes)
    floors = [first]
    print(f"GEMM floor: {floors[0]:.2f} s for {gflop:.0f} GFLOP (load {os.getloadavg()[0]:.1f})")
    for label, budget in (("streamed (the old path)", 0), ("resident", None)):
        report, wall = _timed_run(label, checkpoint, sidecars, prompt, args, budget)
        floors.append(gemm_floor(shapes)[0])  # the floor before and after each run: the load drifts
        print(f"GEMM floor: {floors[-1]:.2f} s (load {os.getloadavg()[0]:.1f})")
        floor = min(floors[-2:])
        print(f"  {label}: {wall / floor:.1f}x the GEMM floor (the lower of the floors timed just before and after)")
    for pair in report.pairs:
        print(f"{pair.b} vs {pair.a}: {pair.greedy_summary()}")


if __name__ == "__main__":
    main()
