"""Benchmark: the stateful tiled sidecar against the untiled stateful one, NumPy evaluation from disk.

On a realistic layer (hidden 2048, 16 / 4 heads, head_dim 128, capacity 12,288) a 4,333-token prompt
is prefilled through ``c<C>`` of each design (C = 256 and 1,024; the last chunk partial), with
the state carried between calls. Per design and chunk it prints (nothing is asserted):

1. wall time of the whole prefill with the evaluator's fusions on (one run, ``time.perf_counter``);
2. peak working memory of a call: over the prefill's calls, the largest ``tracemalloc`` peak during a
   call less what was allocated when the call began (NumPy's buffers included; not counted: the
   state — the same [Hkv, capacity, d] fp16 K and V caches in both designs, updated in place, as
   item 3 does not count it — nor the call's inputs or the driver's prompt and outputs):
   - "as written": every op evaluated as the saved program writes it (``fuse=False``) — the working
     set the design itself asks for; the issue's memory target (tiled <= 1/8 of untiled) is on this;
   - "fused": with the evaluator's fusions on (the untiled graph's ``matmul -> add -> softmax ->
     matmul`` core in query tiles of the evaluator's own choosing, the tiled graph's online-softmax
     step per key tile) — NumPy's own best, shown for reference: the untiled fusion is itself a tiled
     algorithm the device is not given;
   each in a separate run, so tracing does not slow the timed one;
3. the saved program's largest working intermediate (op outputs other than the cache itself) and
   its op count, at capacity 12,288 and 3,072 (largest intermediate vs capacity);
4. attn_out of the tiled design against the untiled one (relative error).

The issue's targets: tiled peak memory <= 1/8 of the untiled design's (as written), tiled time <= 2x
the untiled design's (both fused: the strictest pairing, as the untiled fusion skips every key past
the visible ones while the tiled step skips whole key tiles only).

Usage: python benchmarks/bench_stateful_tiled.py [--quick] [--tile N] [--query-tile N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

REALISTIC = dict(
    hidden_size=2048, num_heads=16, num_kv_heads=4, head_dim=128, capacity=12288, chunks=[256, 1024], tiles=(1024, 256)
)
QUICK = dict(
    hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, capacity=1024, chunks=[64, 128], tiles=(128, 32)
)
PROMPT, QUICK_PROMPT = 4333, 700


def _geometry(p: dict):
    from anelab.core.geometry import AttentionGeometry

    return AttentionGeometry(
        variant="llama",
        hidden_size=p["hidden_size"],
        num_heads=p["num_heads"],
        num_kv_heads=p["num_kv_heads"],
        head_dim=p["head_dim"],
        rope_theta=1_000_000.0,
        num_layers=1,
        full_attention_layers=(0,),
    )


def _build(g, w, design: str, chunk: int, capacity: int, key_tile: int, query_tile: int, work: Path) -> Path:
    from anelab.sidecar.export import convert_program, merge_functions
    from anelab.sidecar.graphs.stateful import build_stateful_program
    from anelab.sidecar.graphs.stateful_tiled import build_stateful_tiled_program

    if design == "stateful":
        prog = build_stateful_program(g, w, chunk, capacity)
    else:
        prog = build_stateful_tiled_program(g, w, chunk, capacity, key_tile, min(query_tile, chunk))
    single = convert_program(prog, work / f"{design}-c{chunk}-n{capacity}.single.mlpackage")
    name = f"c{chunk}"  # the function name the prompt drivers call
    return merge_functions({name: single}, work / f"{design}-c{chunk}-n{capacity}.mlpackage", name)


def _prefill(saved, design: str, hidden: np.ndarray, chunk: int, capacity: int, evaluate=None) -> np.ndarray:
    """attn_out [P, D] of the whole prompt from an empty cache; ``evaluate(function, inputs, state)``
    runs each call (default: NumPy, fused)."""
    from anelab.sidecar.prompt import run_stateful, run_stateful_tiled

    if design == "stateful":  # whole chunks: pad the last one (the mask drops the padded slots)
        calls = -(-hidden.shape[0] // chunk)
        padded = np.zeros((calls * chunk, hidden.shape[1]), np.float16)
        padded[: hidden.shape[0]] = hidden
        return run_stateful(saved, padded, chunk, capacity, evaluate=evaluate)[0][: hidden.shape[0]]
    return run_stateful_tiled(saved, hidden, chunk, capacity, evaluate=evaluate)[0]


def _peak_working_bytes(saved, design: str, hidden: np.ndarray, chunk: int, capacity: int, fuse: bool) -> int:
    """The largest working memory of one call over the prefill: tracemalloc's peak during the call less
    what was allocated when it began (the state, the call's inputs, the driver's prompt and outputs)."""
    from anelab.sidecar.mil.evaluate import evaluate_with_state

    largest = 0

    def traced(function, inputs, state):
        nonlocal largest
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        out = evaluate_with_state(saved, function, inputs, state, fuse=fuse)
        largest = max(largest, tracemalloc.get_traced_memory()[1] - before)
        return out

    tracemalloc.start()
    try:
        _prefill(saved, design, hidden, chunk, capacity, traced)
    finally:
        tracemalloc.stop()
    return largest


def main(argv=None) -> int:
    from anelab.core.weights import random_attention_weights
    from anelab.sidecar.checks.comparison import relative_error
    from anelab.sidecar.mil.evaluate import SavedPackage
    from anelab.studies.one_function import intermediate_profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small geometry (seconds)")
    ap.add_argument("--tile", type=int, help="cache slots per key tile (default 1024; 128 with --quick)")
    ap.add_argument("--query-tile", type=int, help="chunk rows per query tile (default 256; 32 with --quick)")
    args = ap.parse_args(argv)
    p, prompt = (QUICK, QUICK_PROMPT) if args.quick else (REALISTIC, PROMPT)
    args.tile, args.query_tile = args.tile or p["tiles"][0], args.query_tile or p["tiles"][1]
    g = _geometry(p)
    w = random_attention_weights(g, 0, seed=0)
    cap = p["capacity"]
    hidden = np.random.default_rng(0).standard_normal((prompt, g.hidden_size)).astype(np.float16)
    print(
        f"layer: D={g.hidden_size}, heads {g.num_heads}/{g.num_kv_heads}, head_dim {g.head_dim}; capacity {cap}; "
        f"prompt {prompt}; tiles {args.tile} x {args.query_tile}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for chunk in p["chunks"]:
            results = {}
            for design in ("stateful", "stateful-tiled"):
                pkg = _build(g, w, design, chunk, cap, args.tile, args.query_tile, work)
                small = _build(g, w, design, chunk, cap // 4, args.tile, args.query_tile, work)
                prof = {n: intermediate_profile(x)[f"c{chunk}"] for n, x in ((cap, pkg), (cap // 4, small))}
                saved = SavedPackage(pkg)
                t0 = time.perf_counter()
                out = _prefill(saved, design, hidden, chunk, cap)
                seconds = time.perf_counter() - t0
                peak = {fuse: _peak_working_bytes(saved, design, hidden, chunk, cap, fuse) for fuse in (False, True)}
                results[design] = {"seconds": seconds, "peak": peak, "out": out, "profile": prof}
            base, tiled = results["stateful"], results["stateful-tiled"]
            print(f"\nchunk {chunk}: {-(-prompt // chunk)} calls")
            for design, r in results.items():
                prof = " | ".join(
                    f"capacity {n}: largest working {v['largest_working_bytes'] / 1e6:.1f} MB "
                    f"{v['largest_working_op']} {v['largest_working_shape']}, {v['ops']} ops"
                    for n, v in r["profile"].items()
                )
                print(
                    f"  {design:<15} {r['seconds']:8.2f} s  peak working memory: as written {r['peak'][False] / 1e6:7.1f} MB, "
                    f"fused {r['peak'][True] / 1e6:6.1f} MB  [{prof}]"
                )
            print(
                f"  tiled / untiled: time {tiled['seconds'] / base['seconds']:.2f}x (target <= 2), "
                f"peak working memory as written {tiled['peak'][False] / base['peak'][False]:.3f}x (target <= 0.125), "
                f"fused {tiled['peak'][True] / base['peak'][True]:.3f}x, program's largest working intermediate "
                f"{tiled['profile'][cap]['largest_working_bytes'] / base['profile'][cap]['largest_working_bytes']:.4f}x "
                f"(target <= 0.125); attn_out tiled vs untiled {relative_error(tiled['out'], base['out']):.2e}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
