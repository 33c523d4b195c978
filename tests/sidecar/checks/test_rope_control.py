"""The RoPE negative control must be able to fail on any RoPE base: its offset grows with the base.

A trained model's queries and keys weigh the slow rotary pairs (Gemma 3 270M's global layers on real text: a
one-position shift moved the outputs 7.9e-3, under the 1e-2 threshold, so verify called itself vacuous). The
checkpoints here put all of q and k in the slow half of the pairs, base 1e6 and head 256 as Gemma 3's global
layers: one position late turns no pair by more than 1e-3 radians.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY_GEOMETRIES, TINY_SEED

from anelab.checkpoints.checkpoint import load_checkpoint, write_checkpoint
from anelab.core.geometry import AttentionGeometry
from anelab.core.weights import random_attention_weights
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD, rope_control_offset
from anelab.sidecar.checks.verify import verify_package
from anelab.sidecar.export import export_sidecars

CHUNK = 8
GEMMA_GLOBAL_LIKE = AttentionGeometry(
    variant="llama", hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=256, rope_theta=1_000_000.0
)


def slow_pairs_only(geometry: AttentionGeometry, layer: int):
    """Random weights whose q/k rows of the fast half of the rotary pairs are zero ("half" layout: pair i is
    dims i and i + d/2 of each head), so q and k live only where a position turns the pair by <= base^(-1/2)."""
    weights = random_attention_weights(geometry, layer, TINY_SEED)
    d = geometry.head_dim
    fast = np.zeros(d, bool)
    fast[: d // 4] = fast[d // 2 : d // 2 + d // 4] = True  # pairs 0 .. d/4 - 1: the fast half
    for proj, heads in ((weights.q_proj, geometry.num_heads), (weights.k_proj, geometry.num_kv_heads)):
        proj[np.tile(fast, heads)] = 0.0
    return weights


@pytest.fixture(scope="module")
def slow_pair_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope-control")
    return load_checkpoint(
        write_checkpoint(
            root / "model",
            GEMMA_GLOBAL_LIKE,
            {0: slow_pairs_only(GEMMA_GLOBAL_LIKE, 0)},
            dtype="F32",
            model_type="llama",
        )
    )


def rope_controls(report):
    return [c for c in report.comparisons if c.control and c.case.startswith("control: rope offset")]


@pytest.mark.parametrize("design", ["dense", "stateful"])
def test_rope_control_fails_the_package_at_base_1e6_head_256(slow_pair_checkpoint, tmp_path, design):
    """Fails before the offset scaled with the base: the +1 control landed at ~1e-4, the report vacuous."""
    histories = [0, CHUNK] if design == "dense" else [0, CHUNK, 2 * CHUNK]
    [r] = export_sidecars(slow_pair_checkpoint, tmp_path, CHUNK, histories, [0], graph=design)
    report = verify_package(r.package, slow_pair_checkpoint)
    controls = rope_controls(report)
    assert controls and all(c.worst > 3 * RELATIVE_ERROR_THRESHOLD for c in controls), report.table()
    assert report.passed and not report.vacuous, report.table()


def test_rope_control_still_fails_the_package_on_llama(tiny_checkpoint, tmp_path):
    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    [r] = export_sidecars(ckpt, tmp_path, CHUNK, [0, CHUNK], [0], graph="dense")
    report = verify_package(r.package, ckpt)
    controls = rope_controls(report)
    assert len(controls) == 2 and all(c.worst > 10 * RELATIVE_ERROR_THRESHOLD for c in controls), report.table()
    assert report.passed, report.table()


@pytest.mark.parametrize(
    ("geometry", "offset"),
    [
        # median of 1e6^(-i/128), i = 0..127: (1e6^(-63/128) + 1e6^(-64/128)) / 2 = 1.0570e-3 -> 947
        (GEMMA_GLOBAL_LIKE, 947),
        # median of 1e4^(-i/8), i = 0..7: (1e4^(-3/8) + 1e4^(-4/8)) / 2 = 2.0811e-2 -> 49
        (TINY_GEOMETRIES["llama"], 49),
    ],
)
def test_rope_control_offset_turns_the_median_pair_a_radian(geometry, offset):
    assert rope_control_offset(geometry, 0) == offset
