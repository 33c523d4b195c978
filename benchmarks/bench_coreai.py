"""Benchmark: the Core AI sidecar of the default checkpoint's layer, exported and run here (no Mac).

Prints what one run measures (nothing is asserted):
- export: Core ML package alone vs the same export with ``--backend coreai`` (the lowering's own cost);
- sizes: the .aimodel's bytes, the constants it stores once, one Core ML function's weights, and what
  its entrypoints reference in all;
- one call of each entrypoint on coreai-core's bundled CPU runtime (first call: the child process, the
  ODIX compile and the function load; then the median of repeats) against the NumPy evaluation of the
  saved Core ML package's same function, and the relative difference of their attn_out.

Usage: python benchmarks/bench_coreai.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from anelab.checkpoints.checkpoint import load_checkpoint


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="chunk 16 and one repeat")
    args = parser.parse_args(argv)
    from anelab.checkpoints.default import default_checkpoint_dir
    from anelab.core.masks import causal
    from anelab.sidecar.backends import BACKENDS
    from anelab.sidecar.coreai.asset import CoreAIAsset
    from anelab.sidecar.export import export_sidecars
    from anelab.sidecar.mil.evaluate import SavedPackage, evaluate

    chunk, repeats = (16, 1) if args.quick else (64, 5)
    histories = [0, chunk, 2 * chunk]
    root = Path(tempfile.mkdtemp(prefix="bench-coreai-"))
    ckpt = default_checkpoint_dir(root / "ckpt")
    t_ml, [ml] = _timed(lambda: export_sidecars(load_checkpoint(ckpt), root / "coreml", chunk, histories, [3], jobs=1))
    t_ai, [ai] = _timed(
        lambda: export_sidecars(load_checkpoint(ckpt), root / "coreai", chunk, histories, [3], backend="coreai", jobs=1)
    )
    info = BACKENDS["coreai"].inspect(ai.package)
    w = info["weights"]
    print(f"export layer 3, chunk {chunk}, histories {histories}: Core ML {t_ml:.1f} s, with --backend coreai {t_ai:.1f} s "
          f"({t_ai / t_ml:.2f}x: the lowering adds {t_ai - t_ml:.1f} s)")  # fmt: skip
    print(f".aimodel {w['asset_bytes']:,} B; constants stored {w['stored_constant_bytes']:,} B = "
          f"{w['stored_over_one_function']:.3f}x one Core ML function's {w['single_function_weight_bytes']:,} B; "
          f"the entrypoints reference {w['sum_over_entrypoints']:,} B")  # fmt: skip
    saved, asset = SavedPackage(ml.package), CoreAIAsset(ai.package)
    rng = np.random.default_rng(0)
    g = 256
    for h in histories:
        name = f"h{h}"
        feed = {"hidden": rng.standard_normal((chunk, g)).astype(np.float16), "mask": causal(chunk, h)}
        if h:
            feed |= {k: rng.standard_normal((h, 2, 64)).astype(np.float16) for k in ("k_history", "v_history")}
        first, out = _timed(lambda feed=feed, name=name: asset.evaluate(name, feed))
        runs = [_timed(lambda feed=feed, name=name: asset.evaluate(name, feed))[0] for _ in range(repeats)]
        numpy_runs = [_timed(lambda feed=feed, name=name: evaluate(saved, name, feed))[0] for _ in range(repeats)]
        ref = evaluate(saved, name, feed)["attn_out"].astype(np.float64)
        diff = np.linalg.norm(out["attn_out"] - ref) / np.linalg.norm(ref)
        cpu, npy = statistics.median(runs), statistics.median(numpy_runs)
        print(f"{name}: CPU runtime first call {first:.2f} s, then {cpu * 1e3:.0f} ms; NumPy evaluation "
              f"{npy * 1e3:.1f} ms ({cpu / npy:.0f}x); attn_out differs by {diff:.2e}")  # fmt: skip
    asset.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
