"""Benchmark: sidecar export and evaluation of the saved package at a realistic geometry.

Prints ratios measured in one run (nothing is asserted):
- export time, package weight bytes vs one function's, vs N separate packages;
- evaluation of the saved h<history> function vs the dense reference vs the GEMM floor (the
  block's FLOPs at this machine's NumPy fp32 matmul rate, measured in the same run);
- peak memory of the evaluation vs the fp32 score arena (heads x C x (H + C) x 4 bytes).

Each evaluation runs in a fresh subprocess so its peak RSS (ru_maxrss) is its own.
Usage: python benchmarks/bench_sidecar.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from anelab.checkpoints.checkpoint import load_checkpoint

REALISTIC = dict(
    hidden_size=2048, num_heads=16, num_kv_heads=4, head_dim=128, chunk=4096, histories=[0, 4096, 8192], probe=4096
)
QUICK = dict(hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64, chunk=512, histories=[0, 512, 1024], probe=512)


def gemm_rate(n: int = 2048, repeats: int = 3) -> float:
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _child(mode: str, ckpt: str, pkg: str, history: int, chunk: int) -> None:
    """Run one evaluation in this (fresh) process; print JSON with seconds and peak RSS."""
    from anelab.checkpoints.checkpoint import load_checkpoint
    from anelab.core import reference
    from anelab.core.masks import causal
    from anelab.sidecar.mil.evaluate import SavedPackage, evaluate

    ck = load_checkpoint(ckpt)
    g, w = ck.geometry, ck.layer(ck.geometry.full_attention_layers[0])
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((chunk, g.hidden_size)).astype(np.float16)
    kh = rng.standard_normal((history, g.num_kv_heads, g.head_dim)).astype(np.float16)
    vh = rng.standard_normal((history, g.num_kv_heads, g.head_dim)).astype(np.float16)
    mask = causal(chunk, history)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if mode == "package":
        saved = SavedPackage(pkg)
        inputs = {"hidden": hidden, "mask": mask, "k_history": kh, "v_history": vh}
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t = time.perf_counter()
        evaluate(saved, f"h{history}", inputs)
    else:
        args = (hidden.astype(np.float32), kh.astype(np.float32), vh.astype(np.float32), mask.astype(np.float32), w, g)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t = time.perf_counter()
        (reference.attention_block if mode == "reference" else reference.attention_block_tiled)(*args)
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "peak_rss": peak, "rss_before": base}))


def _run_child(*args) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", *map(str, args)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, ckpt, pkg, history, chunk = args.child
        return _child(mode, ckpt, pkg, int(history), int(chunk))

    from anelab.checkpoints.checkpoint import write_checkpoint
    from anelab.core.geometry import AttentionGeometry
    from anelab.core.weights import random_attention_weights
    from anelab.sidecar.export import convert_program, export_sidecars
    from anelab.sidecar.format import weight_bytes
    from anelab.sidecar.graphs.common import SidecarShape
    from anelab.sidecar.graphs.dense import build_dense_program

    p = QUICK if args.quick else REALISTIC
    g = AttentionGeometry(
        variant="qwen3",
        hidden_size=p["hidden_size"],
        num_heads=p["num_heads"],
        num_kv_heads=p["num_kv_heads"],
        head_dim=p["head_dim"],
        rope_theta=1e6,
        num_layers=1,
        full_attention_layers=(0,),
    )
    work = Path(tempfile.mkdtemp(prefix="anelab-bench-"))
    ckpt = write_checkpoint(work / "ckpt", g, {0: random_attention_weights(g, 0, seed=0)}, dtype="BF16")
    C, hist = p["chunk"], p["histories"]
    t = time.perf_counter()
    [result] = export_sidecars(load_checkpoint(ckpt), work / "out", C, hist)
    export_s = time.perf_counter() - t
    separate = sum(
        weight_bytes(
            convert_program(
                build_dense_program(g, random_attention_weights(g, 0, seed=0), SidecarShape(C, h)),
                work / f"sep_h{h}.mlpackage",
            )
        )
        for h in hist
    )
    one = result.metadata.single_function_weight_bytes
    print(
        f"geometry: hidden {g.hidden_size}, heads {g.num_heads}/{g.num_kv_heads} kv, head_dim {g.head_dim}, chunk {C}, histories {hist}"
    )
    print(
        f"export: {export_s:.1f} s for {len(hist)} functions; package weights {result.weight_bytes:,} B = "
        f"{result.weight_bytes / one:.3f}x one function's ({one:,} B); "
        f"N separate packages {separate:,} B = {separate / result.weight_bytes:.2f}x the package"
    )

    H = p["probe"]
    rate = gemm_rate()
    flops = g.block_flops(C, H)
    floor = flops / rate
    arena32 = g.score_arena_bytes(C, H, dtype_bytes=4)
    print(
        f"NumPy fp32 GEMM rate here: {rate / 1e9:.0f} GFLOP/s; block FLOPs at h{H}: {flops / 1e9:.0f} GFLOP -> GEMM floor {floor:.2f} s"
    )
    print(f"fp32 score arena heads x C x (H+C) x 4 = {arena32 / 2**20:,.0f} MiB")
    for mode in ("package", "reference", "tiled"):
        r = _run_child(mode, ckpt, result.package, H, C)
        grow = r["peak_rss"] - r["rss_before"]
        label = {
            "package": f"saved h{H} (NumPy eval, fp16 emulated)",
            "reference": "dense reference (fp32)",
            "tiled": "tiled reference (fp32)",
        }[mode]
        print(
            f"{label:<40} {r['seconds']:7.2f} s = {r['seconds'] / floor:5.2f}x GEMM floor; "
            f"peak RSS growth {grow / 2**20:8,.0f} MiB = {grow / arena32:5.2f}x fp32 arena"
        )


if __name__ == "__main__":
    main()
