"""Issue 30: your model priced from your model, the chip bound, and "depends" only when reachable values flip it.

Configs are the public ones (HuggingFaceTB/SmolLM2-135M, meta-llama/Llama-3.2-1B config.json); expected values
are computed by hand in the test.
"""

import pytest

from anelab.cli import main
from anelab.planner.chips import CHIPS, arm_bounds, chip_table, get_chip, plan_bounds
from anelab.planner.envelope import Cost
from anelab.planner.fit import fit_costs
from anelab.planner.gpu_model import RUNTIME_BAND, active_parameters, own_non_attention, runtime_bandwidth
from anelab.planner.plan import plan
from anelab.planner.verdict import ArmCosts, plan_arm_costs, verdict_for

SMOLLM2 = {  # HuggingFaceTB/SmolLM2-135M config.json
    "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "intermediate_size": 1536, "vocab_size": 49152,
}  # fmt: skip
SMOLLM2_SHAPE = dict(num_layers=30, full_attention_layers=tuple(range(30)), num_heads=9, num_kv_heads=3, head_dim=64)
LLAMA_1B_SHAPE = dict(num_layers=16, full_attention_layers=tuple(range(16)), num_heads=32, num_kv_heads=8, head_dim=64)


def smollm2_plan(tokens: int, storage: str = "Q4_1"):
    fit = fit_costs()
    own = own_non_attention(SMOLLM2, storage, tokens, runtime_bandwidth(fit.non_attention_seconds))
    return plan(tokens, family="qwen3.5-2b-4bit", **SMOLLM2_SHAPE, own_non_attention=own)


def test_active_parameters_by_hand():
    # per layer: q,o 576x576 each, k,v 576x192 each, MLP 3 x 576 x 1536
    per_layer = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536
    assert active_parameters(SMOLLM2) == 30 * per_layer == 106_168_320
    # control: an MoE config counts only the routed experts a token visits
    moe = {**SMOLLM2, "num_experts": 64, "num_experts_per_tok": 2, "moe_intermediate_size": 256}
    assert active_parameters(moe) == 30 * (576 * 576 * 2 + 576 * 192 * 2 + 2 * 3 * 576 * 256)


def test_smollm2_gpu_arm_scales_from_its_own_weights_and_geometry():
    two_b = plan(4333, family="qwen3.5-2b-4bit")
    small = smollm2_plan(4333)
    fit = fit_costs()
    # non-attention: its own weights per token, at most a tenth of the 2B's
    assert small.non_attention_seconds <= two_b.non_attention_seconds / 10
    assert small.non_attention_seconds == pytest.approx(
        4333 * 106_168_320 * (20 / 32) / runtime_bandwidth(fit.non_attention_seconds)
    )
    # attention: the 2B's rate per FLOP (head_dim 256 -> 64) over its own 30 layers x 9 heads of score entries
    entries = 30 * 9 * (4096 * 4096 + 237 * 4333)
    assert small.gpu_attention_seconds == pytest.approx(fit.gpu_dense_seconds_per_entry * 64 / 256 * entries)
    # the runtime the rates describe is named, and the envelope covers a 10x runtime difference
    assert "TinyTitan" in small.cost_sources["non_attention"] and "TinyTitan" in small.cost_sources["gpu_runtime"]
    s = plan_arm_costs(small).gpu_prefill
    assert (s.low, s.high) == (pytest.approx(s.value / RUNTIME_BAND), pytest.approx(s.value * RUNTIME_BAND))
    # control: the 2B's own plan keeps its fitted few-percent band
    s2 = plan_arm_costs(two_b).gpu_prefill
    assert s2.high / s2.value < 1.5
    # the previous estimate was 135.4 s at 4,333 tokens: now under a quarter of it
    assert small.gpu_prefill_seconds < 135.4 / 4


def test_the_1b_shape_with_a_one_second_gpu_says_gpu():
    # issue 30: 4,096 tokens, the user's GPU prefills them in 1 s: the ANE's attention alone costs more
    p = plan(4096, family="qwen3.5-2b-4bit", **LLAMA_1B_SHAPE, gpu_prefill_seconds=1.0)
    v = verdict_for(plan_arm_costs(p))
    assert v.decision == "gpu" and "threshold is below zero" in v.reason
    # control: a slow GPU (100 s) leaves the ANE a real gain: not "gpu"
    slow = verdict_for(
        plan_arm_costs(plan(4096, family="qwen3.5-2b-4bit", **LLAMA_1B_SHAPE, gpu_prefill_seconds=100.0))
    )
    assert slow.decision != "gpu"


def _arms(s, a, load, share=0.5, layers=4):
    return ArmCosts("dense", layers, 2, True, s, share, a, load)


def test_depends_only_when_a_reachable_value_flips_it():
    ext = "extrapolated"
    # extrapolated but every reachable value gains: ane (the old rule said "depends")
    sure = _arms(Cost(100, 90, 110, ext, "s"), Cost(5, 4, 6, ext, "a"), Cost(1, 0.5, 2, ext, "l"))
    assert verdict_for(sure).decision == "ane"
    # the gain's interval spans zero: depends, and the reason says so
    close = _arms(Cost(100, 50, 200, ext, "s"), Cost(30, 20, 40, ext, "a"), Cost(3, 1, 6, ext, "l"))
    v = verdict_for(close)
    assert v.decision == "depends" and "reachable value" in v.reason
    # every reachable value loses: gpu
    lost = _arms(Cost(10, 9, 11, ext, "s"), Cost(4, 3.5, 4.5, ext, "a"), Cost(2, 1.5, 3, ext, "l"))
    assert verdict_for(lost).decision == "gpu"


# ---- the chip table and the bound ------------------------------------------------------------------
def test_every_chip_figure_is_sourced_or_marked():
    names = {c["name"] for c in chip_table()}
    assert {f"M{i}{s}" for i in range(1, 6) for s in ("", " Pro", " Max", " Ultra")} - names == {"M4 Ultra"}
    for chip in chip_table():
        for key in ("gpu_fp16_tflops", "ane_tops", "bandwidth_gbs"):
            fig = chip[key]
            assert (fig["source"] or "").startswith("https://") or fig["note"], (chip["name"], key)
    assert get_chip("m3-max").name == "M3 Max" and get_chip("M3 Max") is CHIPS["M3 Max"]


def test_arm_bounds_by_hand():
    m3 = CHIPS["M3"]  # 3.6 TFLOPS, 18 TOPS, 100 GB/s
    b = arm_bounds(m3, prompt_tokens=1000, active_weights=1e9, weight_bytes=1e9, gpu_entries=1e9, ane_entries=2e9,
                   head_dim=64)  # fmt: skip
    gpu = (2e9 * 1000 + 256 * 1e9) / 3.6e12
    assert b["gpu_seconds"] == pytest.approx(gpu) and b["bound"] == "compute"
    assert b["ane_seconds"] == pytest.approx(2e12 / 3.6e12 + 256 * 2e9 / 18e12)
    # control: one token is bandwidth-bound (weights read once: 1 GB / 100 GB/s)
    one = arm_bounds(
        m3, prompt_tokens=1, active_weights=1e9, weight_bytes=1e9, gpu_entries=0, ane_entries=0, head_dim=64
    )
    assert one["bound"] == "bandwidth" and one["gpu_seconds"] == pytest.approx(0.01)


def test_recorded_m3_estimates_sit_above_the_m3_bound():
    # the estimates describe a runtime on an M3: none can be faster than the M3's peak
    for family in ("qwen3.5-2b-4bit", "qwen3.5-9b-8bit", "agentworld-35b-a3b-4bit", "qwen3.8-125b-a6b-4bit"):
        b = plan_bounds(plan(4333, family=family).to_dict(), "m3")
        assert b["estimate_gpu_seconds"] > b["gpu_seconds"] > 0 and b["estimate_ane_seconds"] > b["ane_seconds"] > 0


def test_cli_chip(capsys):
    assert main(["plan", "--family", "qwen3.5-2b-4bit", "--prompt-tokens", "4333", "--chip", "m4-max"]) == 0
    assert "bound on M4 Max" in capsys.readouterr().out
    assert main(["plan", "--family", "qwen3.5-2b-4bit", "--prompt-tokens", "4333", "--chip", "m9"]) == 2
    assert "unknown --chip" in capsys.readouterr().err


def test_decide_refuses_an_unknown_chip_before_any_work(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["decide", str(tmp_path / "no-model"), "--prompt-tokens", "64", "--chip", "m9", "--out", str(out)]
    assert main(argv) == 2
    assert "unknown --chip" in capsys.readouterr().err and not out.exists()


# ---- mlx-lm's GPU arm: public records on the chip's peak ------------------------------------------------
def test_mlx_lm_causal_steps_by_hand():
    from anelab.planner.mlx_lm_rates import causal_step_entries

    # 4,333 tokens in steps of 2,048: each step scores its history and half its own square (rounded up)
    assert causal_step_entries(4333) == 2048 * 1024 + 2048 * (2048 + 1024) + 237 * (4096 + 119) == 9_387_563
    # control: a windowed layer's mask is an array, every row scores min(window, keys) keys
    assert causal_step_entries(1000, window=512) == 1000 * 512


def test_mlx_lm_record_efficiency_by_hand():
    from anelab.planner.mlx_lm_rates import MLX_LM_RECORDS, fit_mlx_lm, record_efficiency

    qwen = next(r for r in MLX_LM_RECORDS if r.model == "Qwen3 0.6B Q4" and r.prompt_tokens == 2048)
    per_layer = 1024 * 128 * (2 * 16 + 2 * 8) + 3 * 1024 * 3072  # q,o + k,v at head_dim 128; the MLP
    flops = 2 * 28 * per_layer * 2048 + 4 * 128 * 16 * 28 * (2048 * 1024)
    by_hand = flops / (2048 / 10278.775) / 17.4e12  # the M4 Max's 17.4 TFLOPS figure
    assert record_efficiency(qwen) == pytest.approx(by_hand) and 0.6 < by_hand < 0.7
    fit = fit_mlx_lm()
    effs = [r["efficiency"] for r in fit.records]
    assert len(effs) == 9 and all(0.2 < e < 1.0 for e in effs)  # below the peak, as any runtime is
    assert min(effs) < fit.efficiency < max(effs)
    assert fit.band == pytest.approx(max(max(effs) / fit.efficiency, fit.efficiency / min(effs)))
    # each record predicted from the other eight lands within a factor of two of its speed
    assert all(abs(r["held_out_error"]) < 1.0 for r in fit.records)
    assert all(r["source"].startswith("https://github.com/ml-explore/") for r in fit.records)


def test_smollm2_on_mlx_lm_is_at_most_a_tenth_of_the_2b():
    """Issue 30's done-when: the 135M model's 4,333-token GPU prefill from its own FLOPs, at most a tenth of the
    2B's, on the same runtime; the control (TinyTitan's path, which streams the weights per token and whose
    attention dominates) is not."""
    from anelab.planner.mlx_lm_rates import fit_mlx_lm

    weights = (106_168_320, 106_168_320 * 20 / 32)
    small = plan(4333, family="qwen3.5-2b-4bit", **SMOLLM2_SHAPE, weights=weights, gpu_runtime="mlx-lm")
    two_b = plan(4333, family="qwen3.5-2b-4bit", gpu_runtime="mlx-lm")
    assert small.gpu_prefill_seconds <= two_b.gpu_prefill_seconds / 10
    rate = 3.6e12 * fit_mlx_lm().efficiency  # the M3's figure at the fitted fraction
    entries = 2048 * 1024 + 2048 * (2048 + 1024) + 237 * (4096 + 119)
    assert small.non_attention_seconds == pytest.approx(2 * 106_168_320 * 4333 / rate)
    assert small.gpu_attention_seconds == pytest.approx(4 * 64 * 9 * 30 * entries / rate)
    assert two_b.gpu_prefill_seconds == pytest.approx((2 * 2e9 * 4333 + 4 * 256 * 8 * 6 * entries) / rate)
    assert small.gpu_runtime == "mlx-lm" and "mlx-lm on an Apple M3" in small.cost_sources["gpu_runtime"]
    s = plan_arm_costs(small).gpu_prefill  # the envelope: the public records' spread
    assert s.kind == "extrapolated" and s.high / s.value == pytest.approx(fit_mlx_lm().band)
    # control: on TinyTitan's path the same model is not a tenth of the 2B
    tiny = smollm2_plan(4333)
    assert tiny.gpu_prefill_seconds > plan(4333, family="qwen3.5-2b-4bit").gpu_prefill_seconds / 10
    # every chip's estimate sits above its bound (the fraction of peak is below one)
    for chip in ("m1", "m3", "m3-max", "m4-max"):
        p = plan(4333, family="qwen3.5-2b-4bit", **SMOLLM2_SHAPE, weights=weights, gpu_runtime="mlx-lm", chip=chip)
        b = plan_bounds(p.to_dict(), chip)
        assert b["estimate_gpu_seconds"] > b["gpu_seconds"] > 0
    m4 = plan(4333, family="qwen3.5-2b-4bit", **SMOLLM2_SHAPE, weights=weights, gpu_runtime="mlx-lm", chip="m4-max")
    assert m4.gpu_prefill_seconds == pytest.approx(small.gpu_prefill_seconds * 3.6 / 17.4)


def test_the_seed_2b_on_mlx_lm_keeps_its_ane_costs_and_loses():
    # the ANE side is the recorded one either way; only the GPU arm changes: TinyTitan's 49.9 s vs mlx-lm's
    tiny, mlx = plan(4333, family="qwen3.5-2b-4bit"), plan(4333, family="qwen3.5-2b-4bit", gpu_runtime="mlx-lm")
    assert mlx.ane_attention_seconds == pytest.approx(tiny.ane_attention_seconds)
    assert mlx.setup_seconds == pytest.approx(tiny.setup_seconds)
    assert tiny.decision == "ane" and mlx.decision == "gpu" and mlx.gpu_prefill_seconds < tiny.gpu_prefill_seconds / 4


def test_gpu_runtime_refusals_and_listing(capsys):
    from anelab.core.errors import AnelabInputError

    with pytest.raises(AnelabInputError, match="sparse indexer mlx-lm does not run"):
        plan(4333, family="qwen3.8-125b-a6b-4bit", gpu_runtime="mlx-lm")
    assert main(["plan", "--family", "qwen3.5-2b-4bit", "--prompt-tokens", "4333", "--gpu-runtime", "cuda"]) == 2
    assert "unknown --gpu-runtime 'cuda'" in capsys.readouterr().err
    assert main(["plan", "--gpu-runtimes"]) == 0
    out = capsys.readouterr().out
    assert "tinytitan:" in out and "mlx-lm:" in out and out.count("https://github.com/ml-explore/") == 9
    argv = ["plan", "--family", "qwen3.5-2b-4bit", "--prompt-tokens", "4333"]
    assert main(argv) == 0 and "TinyTitan's GPU path on an Apple M3" in capsys.readouterr().out
    assert main([*argv, "--gpu-runtime", "mlx-lm", "--chip", "m4-max"]) == 0
    assert "mlx-lm on an Apple M4 Max" in capsys.readouterr().out
    assert main([*argv, "--gpu-prefill-seconds", "10"]) == 0 and "your GPU runtime's number" in capsys.readouterr().out
    flags = ["plan", "--prompt-tokens", "4096", "--chunk", "1024", "--layers", "4", "--full-attention-layers",
             "0,1,2,3", "--heads", "8", "--kv-heads", "2", "--head-dim", "64", "--load-seconds", "0.5",
             "--gpu-attention-seconds", "0.1", "--ane-attention-seconds", "0.05", "--non-attention-seconds", "2"]  # fmt: skip
    assert main(flags) == 0 and "= 6 s — the cost flags" in capsys.readouterr().out  # no runtime named for flags


def test_a_checkpoint_is_priced_on_mlx_lm_unless_told(tmp_path, capsys):
    from anelab.checkpoints.checkpoint import load_checkpoint
    from anelab.checkpoints.default import make_dense_checkpoint
    from anelab.planner.from_checkpoint import plan_from_checkpoint

    path = make_dense_checkpoint(tmp_path / "dense")
    ck = load_checkpoint(path)
    default, tiny = plan_from_checkpoint(ck, 2048), plan_from_checkpoint(ck, 2048, gpu_runtime="tinytitan")
    assert default.parts["full"].gpu_runtime == "mlx-lm" and tiny.parts["full"].gpu_runtime == "tinytitan"
    assert "TinyTitan" in tiny.parts["full"].cost_sources["gpu_runtime"]
    assert default.gpu_prefill_seconds < tiny.gpu_prefill_seconds
    assert main(["plan", "--checkpoint", str(path), "--prompt-tokens", "2048"]) == 0
    out = capsys.readouterr().out
    assert "the GPU arm is mlx-lm's" in out and "mlx-lm on an Apple M3" in out


def test_plan_checkpoint_passes_the_protocol_and_reload_policy(tmp_path, capsys):
    """``plan --checkpoint`` took --protocol / --reload-policy and dropped them (the defaults were planned)."""
    import json

    from anelab.checkpoints.default import make_dense_checkpoint

    ck = str(make_dense_checkpoint(tmp_path / "dense"))
    argv = ["plan", "--checkpoint", ck, "--prompt-tokens", "8192", "--chunk", "4096", "--json"]
    assert main([*argv, "--protocol", "prompt", "--reload-policy", "preloaded"]) == 0
    part = json.loads(capsys.readouterr().out)["parts"]["full"]
    assert (part["protocol"], part["pays_specialization"], part["reload_policy"]) == ("prompt", True, "preloaded")
    assert main(argv) == 0  # control: the defaults
    part = json.loads(capsys.readouterr().out)["parts"]["full"]
    assert (part["protocol"], part["pays_specialization"], part["reload_policy"]) == ("machine", False, "serialized")


def test_design_tables_take_the_runtime_and_the_protocol(tmp_path, capsys):
    """``plan --design`` priced TinyTitan's arm whatever --gpu-runtime said, and ``plan --checkpoint --design``
    dropped --protocol / --reload-policy; the record replays refuse --gpu-runtime rather than ignore it."""
    import json

    from anelab.checkpoints.default import make_dense_checkpoint

    argv = ["plan", "--prompt-tokens", "4333", "--design", "dense", "--family", "qwen3.5-2b-4bit"]
    assert main([*argv, "--json"]) == 0
    tiny = json.loads(capsys.readouterr().out)["qwen3.5-2b-4bit"][0]
    assert main([*argv, "--json", "--gpu-runtime", "mlx-lm"]) == 0
    mlx = json.loads(capsys.readouterr().out)["qwen3.5-2b-4bit"][0]
    assert mlx["gpu_prefill_seconds"] == pytest.approx(plan(4333, family="qwen3.5-2b-4bit", gpu_runtime="mlx-lm")
                                                       .gpu_prefill_seconds)  # fmt: skip
    assert mlx["gpu_prefill_seconds"] < tiny["gpu_prefill_seconds"] / 4
    assert main([*argv, "--gpu-runtime", "mlx-lm"]) == 0 and "GPU arm: mlx-lm on an Apple M3" in capsys.readouterr().out
    assert main([*argv, "--json", "--protocol", "prompt"]) == 0  # specialization paid per prompt, every design
    paid_family = json.loads(capsys.readouterr().out)["qwen3.5-2b-4bit"][0]
    assert paid_family["setup_seconds"] > tiny["setup_seconds"]
    ck = str(make_dense_checkpoint(tmp_path / "dense"))
    design = ["plan", "--checkpoint", ck, "--prompt-tokens", "8192", "--chunk", "4096", "--design", "dense", "--json"]
    assert main(design) == 0
    default = json.loads(capsys.readouterr().out)
    assert main([*design, "--protocol", "prompt"]) == 0
    paid = json.loads(capsys.readouterr().out)
    (rows_default,), (rows_paid,) = default.values(), paid.values()
    assert rows_paid[0]["setup_seconds"] > rows_default[0]["setup_seconds"]  # specialization paid per prompt
    # --backend prices a family plan's loads: with --design it was ignored (the refusal came after the return)
    assert main([*argv, "--backend", "coreai"]) == 2
    assert "--backend prices a --family plan's loads" in capsys.readouterr().err
    for replay in ("--backtest", "--fit-report", "--list-families"):
        assert main(["plan", replay, "--gpu-runtime", "mlx-lm"]) == 2
        assert "replays TinyTitan's recorded rows; drop --gpu-runtime" in capsys.readouterr().err
