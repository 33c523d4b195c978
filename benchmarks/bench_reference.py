"""How fast and how lean is the NumPy reference block on this machine?

(a) Speed: measured NumPy fp32 GEMM rate (GFLOP/s, best of 3, measured before and after the
    block runs; the faster is used), the block's GEMM floor (block_flops / rate)
    at hidden 2048, 16 heads, 4 KV heads, head_dim 128, chunk 4096, history 4096, and the dense
    reference's time as a multiple of that floor (target <= 2x). The tiled form's time is printed
    beside it.
(b) Memory: peak memory of ``attention_block_tiled`` at chunk 4096 x coverage 12,288 x 24 heads x
    head_dim 256 (hidden 3072, 4 KV heads, qwen3_next), against the bytes of the dense fp32 score
    matrix [heads, chunk, coverage] (target <= 1/8). Measured in a fresh subprocess with two
    meters: ``tracemalloc`` peak of allocations made during the call (NumPy reports its array
    buffers to tracemalloc; inputs allocated before the call are excluded), and the resident-set
    growth: the kernel's peak RSS (VmHWM, reset via /proc/self/clear_refs just before the call)
    minus the RSS before the call — everything, BLAS buffers included.

The dense form runs twice; the first run also pays for first-touch page faults of its fresh
score buffer (slow on this VM), so the ratio uses the second (warm) run and both are printed.

Prints, never asserts. ``--quick`` shrinks every size for a smoke run.

    .venv/bin/python benchmarks/bench_reference.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anelab.core.geometry import FP32_BYTES, AttentionGeometry  # noqa: E402
from anelab.core.masks import causal  # noqa: E402
from anelab.core.reference import attention_block, attention_block_tiled  # noqa: E402
from anelab.core.weights import random_attention_weights

SPEED_GEOMETRY = AttentionGeometry("llama", hidden_size=2048, num_heads=16, num_kv_heads=4, head_dim=128)
MEMORY_GEOMETRY = AttentionGeometry(
    "qwen3_next", hidden_size=3072, num_heads=24, num_kv_heads=4, head_dim=256, partial_rotary_factor=0.25
)
FULL = {"gemm": 4096, "chunk": 4096, "history": 4096, "mem_chunk": 4096, "mem_coverage": 12288}
QUICK = {"gemm": 1024, "chunk": 512, "history": 512, "mem_chunk": 512, "mem_coverage": 1536}
SPEED_TARGET = 2.0
MEMORY_TARGET = 1 / 8


def gemm_gflops(n: int, repeats: int = 3) -> float:
    """Best-of-``repeats`` fp32 rate of an [n, n] @ [n, n/2] matmul, GFLOP/s."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n // 2), dtype=np.float32)
    a @ b  # warm up BLAS threads
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n * n * (n // 2) / best / 1e9


def block_inputs(g: AttentionGeometry, chunk: int, history: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((chunk, g.hidden_size), dtype=np.float32)
    k_history = rng.standard_normal((history, g.num_kv_heads, g.head_dim), dtype=np.float32)
    v_history = rng.standard_normal((history, g.num_kv_heads, g.head_dim), dtype=np.float32)
    return hidden, k_history, v_history, causal(chunk, history)


def speed(sizes: dict) -> None:
    g = SPEED_GEOMETRY
    chunk, history = sizes["chunk"], sizes["history"]
    rate_before = gemm_gflops(sizes["gemm"])
    flops = g.block_flops(chunk, history)
    weights = random_attention_weights(g, 0, 0)
    hidden, k_history, v_history, mask = block_inputs(g, chunk, history)
    attention_block(hidden[:64], k_history[:64], v_history[:64], causal(64, 64), weights, g)  # warm-up
    dense_runs = []
    for _ in range(2):
        t0 = time.perf_counter()
        dense = attention_block(hidden, k_history, v_history, mask, weights, g)
        dense_runs.append(time.perf_counter() - t0)
    dense_s = dense_runs[-1]
    t0 = time.perf_counter()
    tiled = attention_block_tiled(hidden, k_history, v_history, mask, weights, g)
    tiled_s = time.perf_counter() - t0
    rate_after = gemm_gflops(sizes["gemm"])
    rate = max(rate_before, rate_after)  # the faster rate gives the stricter (larger) ratio
    floor = flops / (rate * 1e9)
    agree = float(np.max(np.abs(tiled.attn_out - dense.attn_out)) / np.max(np.abs(dense.attn_out)))
    print(
        "(a) speed — fp32, geometry",
        json.dumps({k: getattr(g, k) for k in ("variant", "hidden_size", "num_heads", "num_kv_heads", "head_dim")}),
    )
    print(
        f"    NumPy fp32 GEMM rate ([{sizes['gemm']}x{sizes['gemm']}] @ [{sizes['gemm']}x{sizes['gemm'] // 2}], best of 3): "
        f"{rate_before:.1f} GFLOP/s before, "
        f"{rate_after:.1f} after the block runs; the floor uses {rate:.1f}"
    )
    print(f"    block FLOPs at chunk {chunk}, history {history}: {flops / 1e9:.1f} GFLOP -> GEMM floor {floor:.3f} s")
    print(
        f"    dense reference: {dense_s:.3f} s warm (first run {dense_runs[0]:.3f} s) = {dense_s / floor:.2f}x the floor "
        f"(target <= {SPEED_TARGET:g}x)"
    )
    print(
        f"    tiled reference: {tiled_s:.3f} s = {tiled_s / floor:.2f}x the floor (dense vs tiled max rel diff {agree:.1e})"
    )


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(chunk: int, coverage: int) -> None:
    """Run in a fresh process: one tiled call, print its peak-memory meters as JSON."""
    g = MEMORY_GEOMETRY
    weights = random_attention_weights(g, 0, 0)
    hidden, k_history, v_history, mask = block_inputs(g, chunk, coverage - chunk)
    rss_before = _proc_status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    tracemalloc.start()
    t0 = time.perf_counter()
    attention_block_tiled(hidden, k_history, v_history, mask, weights, g)
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(
        json.dumps(
            {
                "tracemalloc_peak_bytes": peak,
                "rss_growth_bytes": _proc_status_bytes("VmHWM") - rss_before,
                "rss_before_bytes": rss_before,
                "seconds": seconds,
            }
        )
    )


def memory(sizes: dict) -> None:
    g = MEMORY_GEOMETRY
    chunk, coverage = sizes["mem_chunk"], sizes["mem_coverage"]
    proc = subprocess.run(
        [sys.executable, __file__, "--memory-child", str(chunk), str(coverage)],
        capture_output=True,
        text=True,
        check=True,
    )
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    dense_bytes = g.score_arena_bytes(chunk, coverage - chunk, dtype_bytes=FP32_BYTES)
    print(
        f"(b) memory — tiled fp32, {g.variant}, chunk {chunk} x coverage {coverage} x {g.num_heads} heads x head_dim {g.head_dim} "
        f"(hidden {g.hidden_size}, {g.num_kv_heads} KV heads), fresh subprocess, {m['seconds']:.1f} s"
    )
    print(f"    dense fp32 score matrix [heads, chunk, coverage]: {dense_bytes / 2**20:.0f} MiB")
    for name, key in (
        ("tracemalloc peak during the call", "tracemalloc_peak_bytes"),
        ("peak RSS growth across the call", "rss_growth_bytes"),
    ):
        print(
            f"    {name}: {m[key] / 2**20:.0f} MiB = 1/{dense_bytes / max(m[key], 1):.1f} of the dense scores "
            f"(target <= 1/{1 / MEMORY_TARGET:g})"
        )
    print(f"    (process RSS before the call, inputs + weights: {m['rss_before_bytes'] / 2**20:.0f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--memory-child", nargs=2, type=int, metavar=("CHUNK", "COVERAGE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(*args.memory_child)
        return
    sizes = QUICK if args.quick else FULL
    speed(sizes)
    memory(sizes)


if __name__ == "__main__":
    main()
