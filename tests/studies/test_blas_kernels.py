"""The numbers the deterministic study figures draw do not move with the BLAS kernel (issue 44, item 11).

The arms figures of notebook 07 (sidecar vs reference per layer and at the logits, folded vs causal-only over
indexer budgets, verify's errors), notebook 02's real-text figure (folded vs causal-only on the reference path)
and notebook 06's tile-error figure (a stateful-tiled package against the float64 reference) each draw the
difference of two computations, and that difference's own digits moved with OpenBLAS's kernel: a float32 GEMM's
last bits flip fp16 roundings in the sidecar arm and move the difference in its third digit. Here the same study
functions run on a small random-weight checkpoint (packages exported once, in this process) in two processes,
each with OpenBLAS pinned to another core type and thread count (the second also without NumPy's AVX-512 loops),
and every number they return must be the same: float32-derived ones to the last bit, relative errors against a
float64 reference to that reference's own last bits (``_same``). The control: a plain float32 GEMM of the same
shapes gives other bits under the two kernels. With float32 GEMMs (before ``core.matmul``) all six groups moved.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
from conftest import random_whole_model

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core.geometry import AttentionGeometry, chunk_starts
from anelab.sidecar.export import export_sidecars
from anelab.studies.one_function import tile_error_exports

# two OpenBLAS kernels every x86-64 CPU with AVX2 runs, and whose float32 GEMMs round differently; each with
# another number of BLAS threads, the second with NumPy's own AVX-512 loops off too (an AVX2-only CPU's, e.g. AMD EPYC's)
RUNS = (("Haswell", 1, False), ("Sandybridge", 2, True))
CHUNK, PROMPT, DECODE, COMPRESS = 16, 40, 4, 4  # chunk starts 0, 16, 32 (the last partial)
FLOAT64_NOISE = 1e-11  # relative: what a float64 result's kernel-dependent last bits can move a number by
KEPT_BLOCKS = (3, 6)  # dense-exact windows of 15 and 27 keys: below the prompt, the arms differ
CAPACITY, KEY_TILES = 64, (64, 16)  # notebook 06's tile-error table: one and four key tiles
GEOMETRY = AttentionGeometry(
    variant="qwen3",
    hidden_size=192,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    num_layers=2,
    full_attention_layers=(0, 1),
)

COMPUTE = """
import json, sys
from pathlib import Path
import numpy as np
from anelab.arms.arm_comparison import compare_runs, random_prompt
from anelab.arms.arm_runs import Arm, run_arm
from anelab.arms.sidecars import open_sidecars
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.whole_model import load_model
from anelab.sidecar.checks.verify import verify_package
from anelab.studies import mask_fold, one_function, whole_model_arms

root, chunk, prompt_tokens, decode, compress, kept, capacity, key_tiles = json.loads(sys.argv[1])
root = Path(root)

class Words:  # the studies read tokens as words; any tokenizer will do
    def decode(self, tokens):
        return " ".join(str(int(t)) for t in tokens)

def numbers(comparison):
    return [comparison.layer_diffs, comparison.step_logits_diffs, comparison.prompt_logits_diff]

rng = np.random.default_rng(0)  # the control: a plain float32 GEMM, its bits the kernel's
a, b = rng.standard_normal((48, 192)).astype(np.float32), rng.standard_normal((192, 160)).astype(np.float32)
out = {"control": (a @ b).tobytes().hex()}
model = load_model(root / "model")
prompt = random_prompt(model.vocab_size, prompt_tokens, 0)
sidecars = open_sidecars(root / "sidecars", model, prompt_tokens)
reference = run_arm(model, prompt, Arm("reference"), decode=decode, chunk=chunk)
sidecar = run_arm(model, prompt, Arm("sidecar", "sidecar"), decode=decode, sidecars=sidecars)
out["arms_sidecar_vs_reference"] = numbers(compare_runs(reference, sidecar)) + [sidecar.tokens.tolist()]
sweep = whole_model_arms.window_sweep(model, prompt, kept, compress, decode=decode, sidecars=sidecars)
out["arms_window_sweep"] = [numbers(p.comparison) + [p.comparison.greedy_agreement] for p in sweep]
pair = whole_model_arms.real_sidecar_comparison(model, prompt, sidecars, Words(), decode=decode)
out["arms_real_text"] = numbers(pair.comparison) + [pair.margins]
pair = mask_fold.real_fold_comparison(model, prompt, Words(), kept[0], compress, decode=decode, chunk=chunk)
out["mask_fold_real_text"] = numbers(pair.comparison) + [pair.margins, pair.tokens_b]
report = verify_package(sidecars.packages[0], load_checkpoint(root / "model"))
out["arms_verify_margin"] = [[c.case, c.worst] for c in report.comparisons]
packages = {kt: root / "tiles" / f"kt{kt}" / "layer_0.mlpackage" for kt in key_tiles}
rows = one_function.tile_errors(root / "model", packages, layer=0, capacity=capacity)
out["one_function_tile_error"] = [r["attn_out_error"] for r in rows]
print(json.dumps(out, default=lambda x: x.tolist() if hasattr(x, "tolist") else float(x), sort_keys=True))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 2-layer random-weight Qwen3 checkpoint, its arm sidecars and notebook 06's stateful-tiled packages."""
    root = tmp_path_factory.mktemp("blas_kernels")
    checkpoint = random_whole_model(root / "model", GEOMETRY, intermediate=384, vocab=512)
    export_sidecars(load_checkpoint(checkpoint), root / "sidecars", CHUNK, chunk_starts(PROMPT, CHUNK))
    packages = tile_error_exports(
        checkpoint, root / "tiles", layer=0, chunk=CHUNK, capacity=CAPACITY, key_tiles=KEY_TILES
    )
    assert all(p == root / "tiles" / f"kt{kt}" / "layer_0.mlpackage" for kt, p in packages.items())
    return root


def _same(a, b) -> bool:
    """Nested lists of numbers equal: integers and words exactly, floats to ``FLOAT64_NOISE`` of their value.

    The float64 references (notebook 06's, verify's) keep float64's own kernel-dependent last bits (~1e-16 per
    operation, ~1e-14 in a relative error): far below anything a figure draws. A float32 kernel's move is far above
    it: measured on these numbers with float32 GEMMs (before ``core.matmul``), every group moved by 1.6e-5 to 9e-3
    of a value at its largest."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= FLOAT64_NOISE * max(abs(a), abs(b))
    return a == b


def _without_avx512() -> dict:
    """The environment that turns NumPy's AVX-512 dispatch off (NumPy names the features it dispatches)."""
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__  # NumPy 2's private table of dispatched features
    except ImportError:
        return {}
    return {"NPY_DISABLE_CPU_FEATURES": " ".join(f for f in __cpu_dispatch__ if f.startswith("AVX512"))}


def _study_numbers(core_type: str, threads: int, no_avx512: bool, root) -> dict:
    env = {**os.environ, "OPENBLAS_CORETYPE": core_type, "OPENBLAS_NUM_THREADS": str(threads)}
    env.update(_without_avx512() if no_avx512 else {})
    args = json.dumps([str(root), CHUNK, PROMPT, DECODE, COMPRESS, list(KEPT_BLOCKS), CAPACITY, list(KEY_TILES)])
    done = subprocess.run([sys.executable, "-c", COMPUTE, args], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.blas_exact
@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="OpenBLAS's core types named here are x86-64's"
)
def test_the_study_figures_numbers_are_the_same_under_another_blas_kernel(exported):
    first, second = (_study_numbers(*run, exported) for run in RUNS)
    assert first.pop("control") != second.pop("control")  # control: the kernels compute other float32 bits
    assert min(first["arms_sidecar_vs_reference"][0]) > 0  # the difference is the modelled fp16 one, not 0
    assert max(first["arms_window_sweep"][0][0]) > 0.01  # the mask arms separate below the window
    assert len(first["one_function_tile_error"]) == len(KEY_TILES)
    moved = {name: (first[name], second[name]) for name in first if not _same(first[name], second[name])}
    assert moved == {}, f"moved with the BLAS kernel: {sorted(moved)}"


def test_the_comparison_sees_a_float32_last_bit_and_forgives_float64_noise():
    """The comparison's own controls: one float32 step apart is a move, float64's last bits are not."""
    value = 9.037623930888669e-4
    assert _same([[value, 3], "case"], [[value * (1 + 1e-14), 3], "case"])
    assert not _same([value], [float(np.nextafter(np.float32(value), np.float32(1)))])
    assert not _same([value, [1, 2]], [value, [1, 3]])
