"""Benchmark: a new user's journey on a real-sized model — plan, export every layer, verify every package, compare-arms.

The checkpoint has the shape of Llama-3.2-1B (hidden 2048, 16 layers, 32/8 heads of 64, intermediate
8192, vocabulary 128,256, tied embeddings) or, with ``--shape 8b``, of Llama-3.1-8B (hidden 4096, 32
layers, 32/8 heads of 128, intermediate 14,336, untied); random bf16 weights written in shards by
anelab's own writer (``anelab.checkpoints.whole_model.write_random_model``, one tensor at a time). Each step is the
command a user types, run in a fresh process; its wall time and peak resident memory (the child's
ru_maxrss from wait4) and CPU seconds are printed beside the load average: a shared machine inflates wall
times much more than CPU seconds (a single-threaded step's CPU seconds approximate a quiet machine's wall
time; BLAS threads make CPU exceed wall).

Usage: python benchmarks/bench_journey.py [--shape 1b|8b|quick] [--steps plan,export,verify,compare-arms]
       [--prompt-tokens N] [--decode N] [--work DIR] [--json OUT]
``--work DIR`` keeps the checkpoint and sidecars between runs (written once). ``--quick``: a tiny shape.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = {
    "1b": dict(hidden=2048, layers=16, heads=32, kv=8, head_dim=64, intermediate=8192, vocab=128256, tied=True),
    "8b": dict(hidden=4096, layers=32, heads=32, kv=8, head_dim=128, intermediate=14336, vocab=128256, tied=False),
    "quick": dict(hidden=256, layers=2, heads=4, kv=2, head_dim=64, intermediate=512, vocab=1024, tied=True),
}
PROMPT = {"1b": 1800, "8b": 1800, "quick": 200}  # the run: 1,800 tokens in chunks of 512 (4 functions)
CHUNK = {"1b": 512, "8b": 512, "quick": 64}
STEPS = ("plan", "export", "verify", "compare-arms")


def write_model(path: Path, shape: str) -> float:
    from anelab.checkpoints.whole_model import write_random_model
    from anelab.core.geometry import AttentionGeometry

    s = SHAPES[shape]
    g = AttentionGeometry(
        "llama",
        s["hidden"],
        s["heads"],
        s["kv"],
        s["head_dim"],
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        num_layers=s["layers"],
        full_attention_layers=tuple(range(s["layers"])),
    )
    shards = 1 if shape == "quick" else (3 if shape == "1b" else 4)
    tile = 2**22 if shape == "8b" else None  # 8B: each tensor tiles a 4M-value random block (minutes, not an hour)
    write_random_model(
        path, g, vocab=s["vocab"], intermediate=s["intermediate"], tied=s["tied"], shards=shards, tile=tile
    )


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def write_model_in_child(path: Path, shape: str) -> float:
    """``write_model`` in its own process: Linux counts the pages a process holds when it forks a child in that
    child's peak RSS, so this launcher stays small (numpy and anelab are never imported here)."""
    t = time.perf_counter()
    code = f"import bench_journey as b; from pathlib import Path; b.write_model(Path({str(path)!r}), {shape!r})"
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), _env()["PYTHONPATH"]])}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return time.perf_counter() - t


def _own_peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_step(argv: list[str]) -> dict:
    """Run ``anelab ARGV`` in a fresh process: seconds, its own peak RSS, exit status, load average before/after."""
    env = _env()
    load_before = os.getloadavg()[0]
    t = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "anelab", *argv], env=env, stdout=subprocess.PIPE, text=True)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return {
        "seconds": time.perf_counter() - t,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,  # robust to other load: the wall time of a quiet machine
        "peak_rss_mb": usage.ru_maxrss / 1024,  # Linux: KiB
        "exit": child.returncode,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "tail": out.strip().splitlines()[-3:],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--quick", action="store_true", help="the tiny shape (make benchmarks --quick)")
    parser.add_argument("--steps", default=",".join(STEPS))
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--decode", type=int, default=8)
    parser.add_argument("--work", default=None, help="keep the checkpoint and sidecars here (reused when present)")
    parser.add_argument("--json", default=None, help="also write the results as JSON to this path")
    args = parser.parse_args(argv)
    shape = "quick" if args.quick else args.shape
    steps = args.steps.split(",")
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        parser.error(f"unknown step {unknown[0]}; steps: {', '.join(STEPS)}")
    prompt, chunk = args.prompt_tokens or PROMPT[shape], CHUNK[shape]
    histories = ",".join(str(h) for h in range(0, prompt, chunk))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="anelab-journey-"))
    ckpt, sidecars = work / f"checkpoint-{shape}", work / f"sidecars-{shape}-c{chunk}-p{prompt}"
    print(f"shape {shape} ({SHAPES[shape]}), prompt {prompt} tokens in chunks of {chunk}, decode {args.decode}")
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; work directory {work}")
    print(f"launcher's own peak RSS (counted in every step's): {_own_peak_mb():.0f} MB")
    if not ckpt.exists():
        print(
            f"writing the checkpoint (random bf16, not part of the journey): {write_model_in_child(ckpt, shape):.0f} s"
        )
    commands = {
        "plan": ["plan", "--checkpoint", str(ckpt), "--prompt-tokens", str(prompt)],
        "export": ["export", str(ckpt), "--chunk", str(chunk), "--histories", histories, "--out", str(sidecars)],
        "verify": ["verify", str(sidecars)],
        "compare-arms": [
            "compare-arms", str(ckpt), "--prompt-tokens", str(prompt), "--decode", str(args.decode),
            *(["--sidecars", str(sidecars)] if "export" in steps or sidecars.exists() else []),
        ],
    }  # fmt: skip
    results = {}
    print(f"{'step':<13} {'seconds':>8} {'cpu s':>8} {'peak RSS MB':>12} {'exit':>5} {'load before/after':>18}")
    for step in steps:
        if step == "export" and sidecars.exists():
            print(f"{'export':<13} {'(kept)':>8}  {sidecars}")
            continue
        r = results[step] = run_step(commands[step])
        loads = f"{r['load_before']:.1f}/{r['load_after']:.1f}"
        print(
            f"{step:<13} {r['seconds']:>8.1f} {r['cpu_seconds']:>8.1f} {r['peak_rss_mb']:>12.0f} {r['exit']:>5} "
            f"{loads:>18}",
            flush=True,
        )
        if r["exit"] not in (0, 1):
            print("\n".join(r["tail"]))
    total, cpu = (sum(r[k] for r in results.values()) for k in ("seconds", "cpu_seconds"))
    peak = max((r["peak_rss_mb"] for r in results.values()), default=0)
    print(f"{'total':<13} {total:>8.1f} {cpu:>8.1f} {peak:>12.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": shape, "prompt": prompt, "chunk": chunk, "steps": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
