"""Benchmark: verification, evaluation and the CLI at a realistic layer, as ratios measured in one run.

The layer (issue 13): hidden 2048, 16 query / 4 KV heads, head_dim 128, chunk 4096; a 3-function
package h0, h4096, h8192 exported from a random qwen3 checkpoint into a temporary directory. Rows:

1. ``anelab verify`` of the package: its wall time against the time of the package evaluations it
   runs itself (``VerifyReport.seconds``; goal <= 1.5x), its phases, and the reference's own error
   against fp64 on a slice;
2. the saved h4096 evaluated in-process against the dense fp32 reference on the same inputs,
   alternated, best of ``--repeats`` each (goal <= 1.15x);
3. ``anelab evaluate`` end to end (a fresh interpreter, .npz in / out) against the same evaluation
   in-process (opening the package + evaluate; goal <= in-process + 1 s);
4. with ``--reproduce``: ``anelab reproduce`` wall time (goal <= 180 s). It writes the repository's
   figures and a measured record, so it only runs when asked.

Prints, never asserts. The machine's load average is printed with each row: on a shared machine
compare the ratios, not the seconds. Usage: python benchmarks/bench_speed.py [--quick] [--reproduce]
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

import numpy as np

REALISTIC = dict(hidden_size=2048, num_heads=16, num_kv_heads=4, head_dim=128, chunk=4096, histories=[0, 4096, 8192])
QUICK = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, chunk=256, histories=[0, 256, 512])
VERIFY_GOAL, EVALUATE_GOAL, CLI_GOAL_SECONDS, REPRODUCE_GOAL_SECONDS = 1.5, 1.15, 1.0, 180.0
REPO = Path(__file__).resolve().parents[1]
IMPORTS_NEEDED = "anelab.sidecar.mil.evaluate, coremltools.converters.mil.frontend.milproto.load"


def _load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def _timed(fn):
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def build(work: Path, p: dict) -> tuple[Path, Path]:
    """A random qwen3 checkpoint and its 3-function package under ``work``."""
    from anelab.checkpoints.checkpoint import load_checkpoint, write_checkpoint
    from anelab.core.geometry import AttentionGeometry
    from anelab.core.weights import random_attention_weights
    from anelab.sidecar.export import export_sidecars

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
    ckpt = write_checkpoint(work / "ckpt", g, {0: random_attention_weights(g, 0, seed=0)}, dtype="BF16")
    [result] = export_sidecars(load_checkpoint(ckpt), work / "out", p["chunk"], p["histories"])
    return ckpt, result.package


def verify_row(package: Path, ckpt: Path) -> None:
    from anelab.checkpoints.checkpoint import load_checkpoint
    from anelab.sidecar.checks.verify import verify_package

    report = verify_package(package, load_checkpoint(ckpt))
    s = report.seconds
    ratio = s["total"] / s["package"]
    own = max(max(r["errors"].values()) for r in report.reference_checks)
    margin = min(c.worst / report.threshold for c in report.comparisons if c.control)
    print(
        f"[1] verify {len(report.comparisons)} comparisons ({'PASSED' if report.passed else 'FAILED'}): "
        f"{s['total']:.1f} s = {ratio:.2f}x its own package evaluations ({s['package']:.1f} s); goal <= {VERIFY_GOAL}x: "
        f"{'met' if ratio <= VERIFY_GOAL else 'NOT met'}  [{_load()}]"
    )
    print("    phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in s.items()))
    rest = s["total"] - s["package"]
    print(
        f"    everything but the package evaluations: {rest:.1f} s = {rest / s['package']:.2f}x the package part "
        f"(of which reference {s.get('reference', 0.0):.1f} s)"
    )
    print(
        f"    reference {report.reference_precision}: own error vs fp64 <= {own:.1e} (bound 1e-4, threshold 1e-2); "
        f"weakest control {margin:.0f}x the threshold"
    )


def _block_inputs(g, C: int, H: int) -> dict[str, np.ndarray]:
    from anelab.core.masks import causal

    rng = np.random.default_rng(0)
    return {
        "hidden": rng.standard_normal((C, g.hidden_size)).astype(np.float16),
        "mask": causal(C, H),
        "k_history": rng.standard_normal((H, g.num_kv_heads, g.head_dim)).astype(np.float16),
        "v_history": rng.standard_normal((H, g.num_kv_heads, g.head_dim)).astype(np.float16),
    }


def evaluate_row(package: Path, ckpt: Path, C: int, H: int, repeats: int) -> dict[str, np.ndarray]:
    from anelab.checkpoints.checkpoint import load_checkpoint
    from anelab.core import reference
    from anelab.sidecar.mil.evaluate import SavedPackage, evaluate

    checkpoint = load_checkpoint(ckpt)
    g, w = checkpoint.geometry, checkpoint.layer(0)
    inputs = _block_inputs(g, C, H)
    saved = SavedPackage(package)
    f32 = {k: v.astype(np.float32) for k, v in inputs.items()}
    pkg, ref = [], []
    for _ in range(repeats):  # alternated, so both see the same machine load
        pkg.append(_timed(lambda: evaluate(saved, f"h{H}", inputs))[0])
        ref.append(
            _timed(
                lambda: reference.attention_block(f32["hidden"], f32["k_history"], f32["v_history"], f32["mask"], w, g)
            )[0]
        )
    ratio = min(pkg) / min(ref)
    print(
        f"[2] saved h{H} evaluated in-process {min(pkg):.2f} s vs dense fp32 reference {min(ref):.2f} s "
        f"(best of {repeats}; all: {', '.join(f'{a:.2f}/{b:.2f}' for a, b in zip(pkg, ref))}) = {ratio:.2f}x; "
        f"goal <= {EVALUATE_GOAL}x: {'met' if ratio <= EVALUATE_GOAL else 'NOT met'}  [{_load()}]"
    )
    return inputs


def cli_row(package: Path, inputs: dict[str, np.ndarray], H: int, work: Path, repeats: int) -> None:
    from anelab.sidecar.mil.evaluate import SavedPackage, evaluate

    npz = work / "inputs.npz"
    np.savez(npz, **inputs)
    inproc, cli = [], []
    for i in range(repeats):
        inproc.append(_timed(lambda: evaluate(SavedPackage(package), f"h{H}", inputs))[0])
        out = work / f"out{i}.npz"
        command = [sys.executable, "-m", "anelab", "evaluate", str(package), "--function", f"h{H}"]
        command += ["--inputs", str(npz), "--out", str(out)]
        cli.append(_timed(lambda: subprocess.run(command, check=True, capture_output=True))[0])
    imports = [sys.executable, "-c", f"import anelab.cli, {IMPORTS_NEEDED}"]
    startup = min(_timed(lambda: subprocess.run(imports, check=True, capture_output=True))[0] for _ in range(repeats))
    extra = min(cli) - min(inproc)
    print(
        f"[3] anelab evaluate (CLI, .npz in/out) {min(cli):.2f} s vs in-process (open + evaluate) {min(inproc):.2f} s "
        f"(best of {repeats}) = in-process + {extra:.2f} s; goal <= + {CLI_GOAL_SECONDS:.0f} s: "
        f"{'met' if extra <= CLI_GOAL_SECONDS else 'NOT met'}  [{_load()}]"
    )
    print(
        f"    of which a fresh interpreter importing what the command needs (anelab.cli, coremltools' MIL loader): "
        f"{startup:.2f} s; the rest (arguments, .npz read and write): {extra - startup:.2f} s"
    )
    steps = [sys.executable, "-c", STEPS, str(package), f"h{H}", str(npz), str(work / "steps.npz")]
    fresh = json.loads(subprocess.run(steps, check=True, capture_output=True, text=True).stdout)
    print(
        "    the command's steps in a fresh interpreter: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in fresh.items())
        + f" (in-process open + evaluate above: {min(inproc):.2f} s)"
    )


# what `anelab evaluate` does, step by step, timed inside a fresh interpreter
STEPS = """
import time; t = [time.perf_counter()]
import io, json, sys
import numpy as np
from anelab.core.records import atomic_write_bytes
from anelab.sidecar.mil.evaluate import SavedPackage, evaluate
import coremltools.converters.mil.frontend.milproto.load
t.append(time.perf_counter()); package, function, inputs, out = sys.argv[1:]
pkg = SavedPackage(package); t.append(time.perf_counter())
with np.load(inputs, allow_pickle=False) as npz:
    arrays = {k: npz[k] for k in npz.files}
t.append(time.perf_counter()); outputs = evaluate(pkg, function, arrays); t.append(time.perf_counter())
buf = io.BytesIO(); np.savez(buf, **outputs)
with buf.getbuffer() as data:
    atomic_write_bytes(out, data)
t.append(time.perf_counter())
names = ("imports (interpreter running)", "open", ".npz read", "evaluate", ".npz write")
print(json.dumps({k: b - a for k, a, b in zip(names, t, t[1:])}))
"""


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def notebook_seconds(build_dir: Path) -> list[tuple[str, float, list[tuple[float, int]]]]:
    """Per executed notebook under ``build_dir/notebooks``: (name, summed cell seconds, its three longest cells as
    (seconds, cell index)) from papermill's per-cell durations."""
    rows = []
    for path in sorted((build_dir / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        durations = [(float(c.get("metadata", {}).get("papermill", {}).get("duration") or 0.0), i)
                     for i, c in enumerate(cells)]  # fmt: skip
        rows.append((path.stem, sum(d for d, _ in durations), sorted(durations, reverse=True)[:3]))
    return rows


def reproduce_row() -> None:
    """``anelab reproduce`` wall and CPU time (its processes' user + system: on a shared machine the CPU time is
    the comparable number; <= 2 x the goal on two cores), then each notebook's summed cell time and longest cells."""
    command = [sys.executable, "-m", "anelab", "reproduce"]
    cpu = _children_cpu()
    seconds, done = _timed(lambda: subprocess.run(command, cwd=REPO, capture_output=True, text=True))
    cpu = _children_cpu() - cpu
    print(
        f"[4] anelab reproduce {seconds:.0f} s wall, {cpu:.0f} s CPU (exit {done.returncode}); goal <= "
        f"{REPRODUCE_GOAL_SECONDS:.0f} s: {'met' if seconds <= REPRODUCE_GOAL_SECONDS and done.returncode == 0 else 'NOT met'}"
        f"  [{_load()}]"
    )
    for name, total, longest in notebook_seconds(REPO / "build"):
        cells = ", ".join(f"cell {i} {d:.0f} s" for d, i in longest)
        print(f"    {name}: {total:.0f} s over its cells (longest: {cells})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--repeats", type=int, default=2, help="alternated runs per timing (best is used)")
    parser.add_argument("--reproduce", action="store_true", help="also time 'anelab reproduce' (writes figures/)")
    args = parser.parse_args(argv)
    import anelab

    print(f"anelab from {Path(anelab.__file__).parent}")
    p = QUICK if args.quick else REALISTIC
    with tempfile.TemporaryDirectory(prefix="anelab-speed-") as tmp:
        work = Path(tmp)
        ckpt, package = build(work, p)
        print(
            f"layer: hidden {p['hidden_size']}, heads {p['num_heads']}/{p['num_kv_heads']} kv, head_dim {p['head_dim']}, "
            f"chunk {p['chunk']}; package functions {', '.join(f'h{h}' for h in p['histories'])}; {os.cpu_count()} cores"
        )
        verify_row(package, ckpt)
        H = p["histories"][1]
        inputs = evaluate_row(package, ckpt, p["chunk"], H, args.repeats)
        cli_row(package, inputs, H, work, args.repeats)
    if args.reproduce:
        reproduce_row()


if __name__ == "__main__":
    main()
