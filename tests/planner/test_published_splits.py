"""The published oMLX and mlx-serve splits beside the planner: the figures as the sources state them (written out by
hand here), the rows the planner cannot price say why, and the shared-by-rows price worked by hand."""

from __future__ import annotations

import math

import pytest
from test_offload_split import GAP, M4_BANDWIDTH, M4_DISPATCH, M4_GEMM, inputs

from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.planner.offload_split import MatmulPart, shared_split
from anelab.planner.published_splits import PUBLISHED_SPLITS, QWEN38_27B, published_vs_predicted


def test_the_published_figures_are_the_sources():
    rows = {(r.runtime.split()[0], r.chip, r.prompt_tokens): r for r in PUBLISHED_SPLITS}
    assert rows[("oMLX", "M3 Ultra", 16384)].published == pytest.approx(1.178)
    assert rows[("oMLX", "M3 Ultra", 32768)].published == pytest.approx(1.189)
    assert rows[("oMLX", "M3 Max", 16384)].published == pytest.approx(258 / 212)  # 212 -> 258 tok/s
    m5 = rows[("oMLX", "M5 Pro", 2048)]
    assert (m5.published_low, m5.published_high) == (1.07, 1.27)
    assert rows[("mlx-serve", "M5 Max", 16384)].published == pytest.approx(0.886)  # -11.4 %
    assert all(r.source.startswith("https://github.com/") for r in PUBLISHED_SPLITS)
    # the GDN width from mlx-serve's 9,468,641,280 ANE bytes at share 0.45: (bytes / 0.45 - MLPs) / (48 x 5,120)
    derived = (9_468_641_280 / 0.45 - 64 * 3 * 5120 * 17408) / (48 * 5120)
    assert abs(QWEN38_27B.gdn_out_width - derived) < 50 and len(QWEN38_27B.full_attention_layers) == 16


def test_each_row_is_predicted_or_says_why_not(capsys):
    rows = published_vs_predicted()
    for r in rows:
        if r["chip"].endswith("Ultra"):  # two Neural Engines: no ANE figure, so no prediction
            assert r["predicted"] is None and "ANE fp16 matmul throughput unknown" in r["why_not"]
        else:
            assert r["why_not"] is None and r["predicted_low"] <= r["predicted"] <= r["predicted_high"]
            assert r["best_split"] and r["decided_by"]
    assert main(["plan", "--published-splits"]) == 0
    text = capsys.readouterr().out
    assert text.count("source: https://github.com/") == len(PUBLISHED_SPLITS) and "not predicted" in text


def test_a_shared_part_takes_the_longer_of_its_two_engines_by_hand():
    hidden, width, layers, f = 64, 128, 2, 0.5
    weights = 3 * hidden * width
    part = MatmulPart("mlp", layers, weights, hidden, hidden, "test")
    split = shared_split(inputs("M4", [part]), {"mlp": f})
    rows, calls = 256, 2 * layers
    activations = 2 * rows * 2 * hidden  # an MLP slice returns a full-width partial sum
    slice_weights = f * weights
    per_call = max(2 * slice_weights * rows / M4_GEMM, 2 * slice_weights / M4_BANDWIDTH) + M4_DISPATCH
    ane = (per_call + 2 * activations / M4_BANDWIDTH) * calls * math.sqrt(GAP)
    g = 8.0 * weights * layers / 1e9
    assert split.seconds == pytest.approx(10.0 - g + max(g * (1 - f), ane), rel=0.01)
    assert split.name == "mlp@0.50 (shared)" and split.ratio_low <= split.ratio <= split.ratio_high
    with pytest.raises(AnelabInputError, match="strictly between 0 and 1"):
        shared_split(inputs("M4", [part]), {"mlp": 1.0})
    with pytest.raises(AnelabInputError, match="no projections part"):
        shared_split(inputs("M4", [part]), {"projections": 0.5})
