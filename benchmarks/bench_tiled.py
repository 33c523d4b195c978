"""Benchmark: dense vs tiled sidecar graphs, and compressed weights, from saved packages.

Prints (nothing is asserted):
1. largest intermediate (bytes, from the saved program's op output shapes — what ``anelab inspect
   --json`` reports as ``largest_intermediate_bytes``) of the dense and the tiled graph over chunk C
   and history H, and of the stateful graph with capacity H + C (it scores every cache slot), with
   the fp16 score tensor Hq x C x (H + C) x 2 bytes for scale;
2. per ``--weights`` mode: package weight bytes (vs fp16) and the relative error of attn_out vs
   the reference with the checkpoint's fp16-exact weights (``anelab verify``'s cost comparison).

Usage: python benchmarks/bench_tiled.py [--quick] [--tile N]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tqdm.auto import tqdm

from anelab.checkpoints.checkpoint import load_checkpoint

REALISTIC = dict(
    hidden_size=2048, num_heads=16, num_kv_heads=4, head_dim=128, chunks=[64, 256, 1024], histories=[0, 1024, 4096]
)
QUICK = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, chunks=[32, 64], histories=[0, 256])


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


def largest_intermediates(p: dict, key_tile: int, work: Path) -> list[dict]:
    from anelab.core.weights import random_attention_weights
    from anelab.sidecar.export import convert_program
    from anelab.sidecar.graphs.common import SidecarShape
    from anelab.sidecar.graphs.dense import build_dense_program
    from anelab.sidecar.graphs.stateful import build_stateful_program
    from anelab.sidecar.graphs.tiled import build_tiled_program
    from anelab.sidecar.mil.evaluate import SavedPackage

    g = _geometry(p)
    w = random_attention_weights(g, 0, seed=0)
    rows = []
    points = [(c, h) for c in p["chunks"] for h in p["histories"] if h % c == 0]
    for c, h in tqdm(points, desc="dense vs tiled", unit="shape"):
        tile = min(key_tile, c)
        row = {"chunk": c, "history": h, "tile": tile, "scores": 2 * g.num_heads * c * (h + c)}
        for name, build in (
            ("dense", lambda s: build_dense_program(g, w, s)),
            ("tiled", lambda s: build_tiled_program(g, w, s, tile)),
            ("stateful", lambda s: build_stateful_program(g, w, s.chunk, s.total)),
        ):
            pkg = convert_program(build(SidecarShape(chunk=c, history=h)), work / f"{name}-{c}-{h}.mlpackage")
            row[name] = SavedPackage(pkg).functions["main"].largest_intermediate_bytes
        rows.append(row)
    return rows


def weight_modes(p: dict, work: Path) -> list[dict]:
    from anelab.checkpoints.checkpoint import write_checkpoint
    from anelab.core.weights import random_attention_weights
    from anelab.sidecar.checks import verify
    from anelab.sidecar.export import export_sidecars
    from anelab.sidecar.quantize import WEIGHT_MODES

    g = _geometry(p)
    ckpt = write_checkpoint(work / "model", g, {0: random_attention_weights(g, 0, seed=0)}, model_type="llama")
    chunk = p["chunks"][0]
    rows = []
    for mode in WEIGHT_MODES:
        [r] = export_sidecars(load_checkpoint(ckpt), work / mode, chunk, [0, chunk], [0], weights_mode=mode)
        report = verify.verify_package(r.package, load_checkpoint(ckpt))
        cost = [c for c in report.comparisons if c.bound is not None] or [
            c for c in report.comparisons if not c.control
        ]
        rows.append(
            {
                "mode": mode,
                "bytes": r.weight_bytes,
                "attn_out": max(c.errors["attn_out"] for c in cost),
                "passed": report.passed,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tile", type=int, default=64, help="key tile of the tiled graph (capped at the chunk)")
    args = ap.parse_args()
    p = QUICK if args.quick else REALISTIC
    print(f"geometry: D={p['hidden_size']} Hq={p['num_heads']} Hkv={p['num_kv_heads']} d={p['head_dim']}")
    with tempfile.TemporaryDirectory(prefix="bench_tiled.") as tmp:
        rows = largest_intermediates(p, args.tile, Path(tmp))
        print(
            f"\n{'C':>5} {'H':>6} {'tile':>5} {'fp16 scores B':>14} {'dense largest B':>16} {'tiled largest B':>16} "
            f"{'dense/tiled':>11} {'stateful largest B':>19}"
        )
        for r in rows:
            print(
                f"{r['chunk']:>5} {r['history']:>6} {r['tile']:>5} {r['scores']:>14,} {r['dense']:>16,} {r['tiled']:>16,} "
                f"{r['dense'] / r['tiled']:>11.1f} {r['stateful']:>19,}"
            )
        rows = weight_modes(p, Path(tmp))
        fp16 = rows[0]["bytes"]
        print(f"\n{'weights':<11} {'package B':>10} {'vs fp16':>8} {'attn_out rel. error vs fp16 weights':>36} verify")
        for r in rows:
            print(
                f"{r['mode']:<11} {r['bytes']:>10,} {r['bytes'] / fp16:>8.3f} {r['attn_out']:>36.2e} "
                f"{'PASSED' if r['passed'] else 'FAILED'}"
            )
        print("(fp16 row: error of the fp16 package itself — fp16 storage only)")


if __name__ == "__main__":
    main()
