"""The offload split: each part of prefill priced on a chip's ANE against the GPU, every candidate split ranked.

Expected values are worked by hand here from the stated public figures (chip_figures: M4's ANE 5.4 TF/s, 0.095 ms
dispatch, its 32 MB cliff at 4.0 / 5.7; the M4's 120 GB/s; the seed's recorded 0.43 s h0 layer-chunk of Qwen 3.8 on
the M3) — never read back from the code under test. Controls: a chip whose ANE is slower makes "none" win; a model
whose MLP weights exceed one ~4 GiB window cannot hold every MLP in one program; one layer over the window is refused.
"""

from __future__ import annotations

import math

import pytest

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.planner.from_checkpoint import plan_from_checkpoint
from anelab.planner.offload_split import (
    MatmulPart,
    SplitInputs,
    checkpoint_parts,
    checkpoint_split_inputs,
    offload_splits,
)

M4_GEMM, M4_DISPATCH, M4_BANDWIDTH = 5.4e12, 0.095e-3, 120e9
CLIFF_BYTES, CLIFF_FACTOR = 32e6, 4.0 / 5.7
# the seed's M3 roofline of the recorded Qwen 3.8 h0 layer-chunk (24 heads x head_dim 256, 4,096 x 4,096):
# ANE GEMM sqrt(1.6 x 2.7 x 1.6 x 4.6) TF/s (Apple's +60 % over the M1 family), past the cliff (39.8 MB working set);
# dispatch the geometric middle of the published floors 0.095 and 0.23 ms
M3_GEMM = math.sqrt(1.6 * 2.7 * 1.6 * 4.6) * 1e12
M3_ROOFLINE = 4 * 256 * 24 * 4096 * 4096 / (M3_GEMM * CLIFF_FACTOR) + math.sqrt(0.095 * 0.23) * 1e-3
GAP = 0.43 / M3_ROOFLINE  # recorded 0.43 s over that roofline


def inputs(chip, parts, *, gpu=10.0, non_attention=8.0, active=1e9, prompt=512, chunk=256, band=1.0):
    return SplitInputs(chip=chip, prompt_tokens=prompt, chunk=chunk, gpu_seconds=gpu,
                       non_attention_seconds=non_attention, active_weights=active, gpu_band=band, attention=None,
                       parts=tuple(parts), gpu_source="test")  # fmt: skip


def by_name(splits):
    return {s.name: s for s in splits}


def test_an_mlp_on_the_m4_is_its_roofline_per_call_and_the_ratio_follows_by_hand():
    hidden, width, layers = 64, 128, 2
    weights = 3 * hidden * width  # 24,576
    part = MatmulPart("mlp", layers, weights, hidden, hidden, "test")
    split = by_name(offload_splits(inputs("M4", [part])))["mlp"]
    rows, calls = 256, 2 * layers  # 512 tokens in chunks of 256, per layer
    activations = 2 * rows * (hidden + hidden)
    assert 2 * weights + activations < CLIFF_BYTES  # under the cliff: the full rate
    compute = 2 * weights * rows / M4_GEMM
    traffic = 2 * weights / M4_BANDWIDTH
    transfer = 2 * activations / M4_BANDWIDTH
    roofline = (max(compute, traffic) + M4_DISPATCH + transfer) * calls
    cost = split.costs[0]
    assert cost["ane_low"] == pytest.approx(roofline, rel=1e-9)  # the M4's GEMM figure is one value: band 1
    assert cost["ane_high"] == pytest.approx(roofline * GAP, rel=0.01)
    assert cost["ane_seconds"] == pytest.approx(roofline * math.sqrt(GAP), rel=0.01)
    assert cost["bound"] == "dispatch"  # 0.095 ms dwarfs a 24k-weight matmul
    gpu_part = 8.0 * weights * layers / 1e9  # non-attention x the part's share of the active weights
    assert cost["gpu_seconds"] == pytest.approx(gpu_part, rel=1e-12)
    assert split.ratio == pytest.approx(10.0 / (10.0 - gpu_part + roofline * math.sqrt(GAP)), rel=0.01)
    assert split.ratio_low <= split.ratio <= split.ratio_high
    assert split.programs == 1 and split.resident_bytes == 2 * weights * layers


def _big_mlp(layers=4):
    hidden, width = 2048, 8192  # 50.3 M weights a layer: 100 MB fp16, past the 32 MB cliff
    return MatmulPart("mlp", layers, 3.0 * hidden * width, hidden, hidden, "test")


def test_a_chip_whose_ane_is_slower_makes_none_win():
    part, rows = _big_mlp(), 2048
    # by hand, compute-bound past the cliff: M4 at 5.4 TF/s, M1 at sqrt(2.7 x 4.3) TF/s (its two submissions)
    m4 = 2 * part.weights * rows / (M4_GEMM * CLIFF_FACTOR) * math.sqrt(GAP)
    m1 = 2 * part.weights * rows / (math.sqrt(2.7 * 4.3) * 1e12 * CLIFF_FACTOR) * math.sqrt(GAP)
    gpu_per_call = (m4 + m1) / 2  # between the two: the ANE pays on the M4 only
    calls = part.layers  # one chunk of 2,048 tokens
    non_attention = gpu_per_call * calls * 1e9 / (part.weights * part.layers)  # seconds making g = that per call
    kw = dict(gpu=20.0, non_attention=non_attention, active=1e9, prompt=rows, chunk=rows)
    on_m4 = offload_splits(inputs("M4", [part], **kw))
    on_m1 = offload_splits(inputs("M1", [part], **kw))
    assert on_m4[0].name == "mlp" and on_m4[0].ratio > 1.0
    assert on_m1[0].name == "none" and by_name(on_m1)["mlp"].ratio < 1.0
    assert "slower on the ANE" in on_m1[0].decided_by and "mlp" in on_m1[0].decided_by
    assert "saves" in on_m4[0].decided_by and "compute past the cliff" in on_m4[0].decided_by


def test_mlp_weights_over_one_window_cannot_all_sit_in_one_program():
    window = 4 * 2**30
    per_layer_bytes = 2 * _big_mlp().weights
    fitting = window // per_layer_bytes  # 42 layers of 100.7 MB
    part = _big_mlp(layers=int(fitting) + 10)
    splits = by_name(offload_splits(inputs("M4", [part], prompt=2048, chunk=2048)))
    assert splits["mlp"].programs == 2 and splits["mlp"].resident_bytes > window
    subset = splits[f"mlp[:{int(fitting)}]"]
    assert subset.programs == 1 and subset.resident_bytes == fitting * per_layer_bytes
    assert "mlp + mlp" not in " ".join(splits)  # the subset is never priced beside the whole part
    # control: a model under one window has no subset candidate
    small = by_name(offload_splits(inputs("M4", [_big_mlp(layers=4)], prompt=2048, chunk=2048)))
    assert not [n for n in small if "[" in n]


def test_one_layer_over_the_window_is_refused_in_one_line():
    huge = MatmulPart("mlp", 2, 2.5 * 2**30, 8192, 8192, "test")  # 5 GiB of fp16 in one layer
    with pytest.raises(AnelabInputError, match="window") as e:
        offload_splits(inputs("M4", [huge]))
    assert "\n" not in str(e.value)


def test_a_chip_without_an_ane_figure_is_refused():
    with pytest.raises(AnelabInputError, match="M3 Ultra: ANE fp16 matmul throughput unknown"):
        offload_splits(inputs("M3 Ultra", [_big_mlp()]))


def test_the_attention_split_is_the_attention_only_plan(tiny_checkpoint):
    # cost flags make attention pay on the ANE; the split "attention" must give the checkpoint plan's own ratio
    ck = load_checkpoint(tiny_checkpoint("llama"))
    planned = plan_from_checkpoint(ck, 64, chunk=32, load_seconds=0.001, gpu_attention_seconds=1.0,
                                   ane_attention_seconds=0.1, non_attention_seconds=2.0)  # fmt: skip
    assert planned.offloaded == ["full"]
    parts, absent = checkpoint_parts(ck)
    splits = by_name(offload_splits(checkpoint_split_inputs(ck, planned, parts)))
    assert splits["attention"].ratio == pytest.approx(planned.predicted_ratio, rel=1e-12)
    assert splits["none"].ratio == 1.0
    # this checkpoint holds attention weights only: no MLP to offload, and the reason is listed, not guessed
    assert parts == () and [a.split(":")[0] for a in absent] == ["mlp", "projections"]
    assert "no gate projection" in absent[0]
    # control: with the ANE attention 40x slower the attention split loses
    slow = plan_from_checkpoint(ck, 64, chunk=32, load_seconds=0.001, gpu_attention_seconds=1.0,
                                ane_attention_seconds=4.0, non_attention_seconds=2.0)  # fmt: skip
    assert by_name(offload_splits(checkpoint_split_inputs(ck, slow, parts)))["attention"].ratio < 1.0


def test_a_qwen35_hybrid_has_mlp_and_gdn_projection_parts_sized_from_its_config(tmp_path):
    from test_block_sidecars import CONFIGS

    from anelab.checkpoints.checkpoint import load_checkpoint
    from anelab.runtimes.mlx.checkpoints import write_mlx_lm_checkpoint

    ck = load_checkpoint(write_mlx_lm_checkpoint(tmp_path / "qwen3_5", CONFIGS["qwen3_5"], seed=5))
    parts, absent = checkpoint_parts(ck)
    sizes = {p.name: (p.layers, p.weights, p.out_width) for p in parts}
    # hidden 32; MLP 3 x 32 x 48 on all 4 layers; GDN: 2 x (2 x 16) + 2 x (4 x 8) + 2 x 4 = 136 outputs on 3 layers
    assert sizes == {"mlp": (4, 3 * 32 * 48, 32), "projections": (3, 32 * 136, 136)} and absent == []
    planned = plan_from_checkpoint(ck, 4096, chip="M4")
    names = {s.name for s in offload_splits(checkpoint_split_inputs(ck, planned, parts))}
    assert names == {"none", "attention", "mlp", "projections", "attention + mlp", "attention + projections",
                     "mlp + projections", "attention + mlp + projections"}  # fmt: skip


def test_a_prompt_shorter_than_one_chunk_keeps_attention_off_the_ane():
    # default-real at 1,024 tokens in chunks of 2,048: no ANE chunk, so the attention split moves nothing (its seconds
    # differ from all-GPU in the last bits only) and ties with "none", which ranks first (fewer parts)
    from anelab.checkpoints.checkpoint import load_checkpoint
    from anelab.checkpoints.default import resolve_checkpoint

    ck = load_checkpoint(resolve_checkpoint("default-real"))
    planned = plan_from_checkpoint(ck, 1024, chunk=2048, chip="M3")
    splits = offload_splits(checkpoint_split_inputs(ck, planned, ()))
    assert [s.name for s in splits] == ["none", "attention"] and splits[1].ratio == pytest.approx(1.0, rel=1e-9)


def test_when_none_wins_the_closest_part_is_the_one_nearest_to_paying_not_the_smallest():
    # the MLP loses on the M1 by a factor ~1.2 over many seconds; a tiny projections part loses by far more per second
    # of GPU time but by fewer seconds: "closest" is the MLP (the ratio of its ANE to GPU seconds), not the tiny part
    part, rows = _big_mlp(), 2048
    m4 = 2 * part.weights * rows / (M4_GEMM * CLIFF_FACTOR) * math.sqrt(GAP)
    m1 = 2 * part.weights * rows / (math.sqrt(2.7 * 4.3) * 1e12 * CLIFF_FACTOR) * math.sqrt(GAP)
    non_attention = (m4 + m1) / 2 * part.layers * 1e9 / (part.weights * part.layers)
    tiny = MatmulPart("projections", 1, 64.0 * 64, 64, 64, "test")  # dispatch-bound: ANE >> its GPU share
    splits = offload_splits(inputs("M1", [part, tiny], gpu=20.0, non_attention=non_attention, active=1e9,
                                   prompt=rows, chunk=rows))  # fmt: skip
    assert splits[0].name == "none" and "the closest, mlp," in splits[0].decided_by
