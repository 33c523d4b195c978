"""The MLX hybrid: mlx-lm's model with every full-attention layer's prefill chunks on its saved sidecar.

Checkpoints are written by mlx-lm itself in the Hugging Face layout (``runtimes.mlx.checkpoints``: mlx-lm reads
each back to the same tensors) for a Llama, a Qwen3-MoE, a Gemma 3 with sliding windows and a Qwen 3.5 hybrid
(Gated DeltaNet layers). The hybrid's logits must sit within fp16 noise of mlx-lm's own forward and above zero
(the sidecars really served); every control must fail: a sidecar of another checkpoint, a start one position
late, the mask dropped, a layer served by another layer's package.
"""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest
from conftest import gated_copy

from anelab.arms.arm_comparison import NOISE, compare_arms, compare_runs
from anelab.arms.arm_runs import Arm, Perturbation
from anelab.arms.engines import run_arms_on
from anelab.arms.mlx_engine import open_mlx_arms_model
from anelab.arms.prefill_ab import ab_request, run_ab
from anelab.arms.sidecars import SidecarSet, numpy_runner, open_sidecars
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.whole_model import load_model
from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.core.records import read_records
from anelab.runtimes.coreml.coreml_fake import FakeFunction, FakeRuntime
from anelab.runtimes.mlx.checkpoints import write_mlx_lm_checkpoint
from anelab.sidecar.checks.comparison import relative_error
from anelab.sidecar.designs import DESIGNS, SidecarRequest
from anelab.sidecar.export import export_request, export_sidecars

CHUNK, PROMPT, DECODE = 8, 13, 3  # chunk starts 0 and 8; the second chunk partial (5 rows)
BASE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rms_norm_eps=1e-6, vocab_size=96, max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip
CONFIGS = {
    "llama": dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=2, rope_theta=5e5),
    "qwen3_moe": dict(BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=2,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                      mlp_only_layers=[], norm_topk_prob=True, rope_theta=1e6),
    "gemma3_text": dict(BASE, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], num_hidden_layers=2,
                        sliding_window=6, sliding_window_pattern=2, layer_types=["sliding_attention", "full_attention"],
                        query_pre_attn_scalar=16, rope_local_base_freq=10000.0, rope_theta=1e6,
                        final_logit_softcapping=None, attn_logit_softcapping=None,
                        hidden_activation="gelu_pytorch_tanh"),
    "qwen3_5": dict(model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"], tie_word_embeddings=False,
                    text_config=dict(BASE, model_type="qwen3_5_text", num_hidden_layers=4, linear_num_value_heads=4,
                                     linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                     linear_conv_kernel_dim=4, full_attention_interval=4, attn_output_gate=True,
                                     layer_types=["linear_attention"] * 3 + ["full_attention"],
                                     rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                      "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]})),
}  # fmt: skip
FULL_ATTENTION = {"llama": (0, 1), "qwen3_moe": (0, 1), "gemma3_text": (0, 1), "qwen3_5": (3,)}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """family -> (checkpoint, dense sidecars for a PROMPT-token prompt in chunks of CHUNK)."""
    root = tmp_path_factory.mktemp("mlx")
    out = {}
    for family, config in CONFIGS.items():
        checkpoint = write_mlx_lm_checkpoint(root / family / "model", config, seed=1)
        export_sidecars(load_checkpoint(checkpoint), root / family / "sidecars", CHUNK, [0, CHUNK])
        out[family] = (checkpoint, root / family / "sidecars")
    return out


def _opened(made, family):
    checkpoint, directory = made[family]
    model = open_mlx_arms_model(load_checkpoint(checkpoint))
    sidecars = open_sidecars(directory, model.checkpoint, PROMPT)
    sidecars.runner, sidecars.calls = numpy_runner(sidecars, keep_open=len(sidecars.packages)), []
    return model, sidecars


def _prompt(model):
    return np.random.default_rng(7).integers(0, model.vocab_size, PROMPT)


def _arms(model, sidecars, *arms):
    pairs = tuple(("reference", arm.name) for arm in arms)
    runs = run_arms_on("mlx", model, _prompt(model), [Arm("reference"), *arms], decode=DECODE, sidecars=sidecars,
                       layer_pairs=pairs)  # fmt: skip
    return {arm.name: compare_runs(runs["reference"], runs[arm.name]) for arm in arms}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_hybrid_matches_mlx_lms_own_forward_and_logs_each_layers_function_per_chunk(made, family):
    model, sidecars = _opened(made, family)
    assert model.checkpoint.geometry.full_attention_layers == FULL_ATTENTION[family]
    cmp = _arms(model, sidecars, Arm("sidecar", "sidecar"))["sidecar"]
    assert 0 < cmp.prompt_logits_diff < NOISE and max(cmp.step_logits_diffs) < NOISE, cmp.step_logits_diffs
    assert cmp.identical_text and max(cmp.layer_diffs) < NOISE
    served = FULL_ATTENTION[family]
    if family == "qwen3_5":  # the Gated DeltaNet layers before the one full-attention layer are mlx-lm's, untouched
        assert cmp.layer_diffs[:3] == [0.0, 0.0, 0.0] and cmp.layer_diffs[3] > 0
    # mlx-lm's order is chunk-major: chunk 0 through every served layer, then chunk 8 (5 real rows)
    assert sidecars.calls == [(L, 0, "h0", 8) for L in served] + [(L, 8, "h8", 5) for L in served]


def test_gemma3s_sliding_layer_is_served_with_its_window_from_mlx_lms_rotating_cache(made):
    from mlx_lm.models.cache import RotatingKVCache

    model, sidecars = _opened(made, "gemma3_text")
    assert model.checkpoint.geometry.window_of(0) == 6 and isinstance(model.mlx.make_cache()[0], RotatingKVCache)
    assert sidecars.metadata[0].sliding_window == 6 and sidecars.metadata[1].sliding_window is None


@pytest.mark.parametrize("kind", ["mask_dropped", "start_shifted"])
def test_a_dropped_mask_or_a_start_one_late_is_caught(made, kind):
    model, sidecars = _opened(made, "llama")
    cmp = _arms(model, sidecars, Arm("sidecar", "sidecar"), Arm("bad", "sidecar", perturbation=Perturbation(0, kind)))
    assert cmp["sidecar"].prompt_logits_diff < NOISE
    assert cmp["bad"].layer_diffs[0] > NOISE and cmp["bad"].prompt_logits_diff > NOISE, cmp["bad"].layer_diffs


def test_a_layer_served_by_another_layers_package_is_refused_and_would_be_caught(made, tmp_path):
    model, sidecars = _opened(made, "llama")
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    for a, b in ((0, 1), (1, 0)):
        shutil.copytree(sidecars.packages[b], swapped / f"layer_{a}.mlpackage")
    with pytest.raises(AnelabInputError, match="records layer 1, not 0"):
        open_sidecars(swapped, model.checkpoint, PROMPT)
    wrong = SidecarSet(sidecars.directory, {0: sidecars.packages[1], 1: sidecars.packages[0]}, CHUNK,
                       metadata={0: sidecars.metadata[1], 1: sidecars.metadata[0]})  # fmt: skip
    wrong.runner = numpy_runner(wrong, keep_open=2)
    assert _arms(model, wrong, Arm("sidecar", "sidecar"))["sidecar"].prompt_logits_diff > NOISE


def test_a_sidecar_from_another_checkpoint_is_refused_and_would_be_caught(made, tmp_path):
    model, sidecars = _opened(made, "llama")
    other = write_mlx_lm_checkpoint(tmp_path / "other", CONFIGS["llama"], seed=2)
    export_sidecars(load_checkpoint(other), tmp_path / "other_sidecars", CHUNK, [0, CHUNK])
    with pytest.raises(AnelabInputError, match="differs from the checkpoint"):
        open_sidecars(tmp_path / "other_sidecars", model.checkpoint, PROMPT)
    foreign = open_sidecars(tmp_path / "other_sidecars", open_mlx_arms_model(load_checkpoint(other)).checkpoint, PROMPT)
    foreign.runner = numpy_runner(foreign, keep_open=2)
    assert _arms(model, foreign, Arm("sidecar", "sidecar"))["sidecar"].prompt_logits_diff > NOISE


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gemma3_text"])
def test_where_both_engines_run_they_agree(made, family):
    """anelab's NumPy forward and mlx-lm's forward are written independently: the reference arms agree to fp32
    rounding, and the sidecar arms (the same saved packages) to fp16 noise."""
    checkpoint, directory = made[family]
    prompt = _prompt(open_mlx_arms_model(load_checkpoint(checkpoint)))
    runs = {}
    for engine, model in (("numpy", load_model(checkpoint)), ("mlx", open_mlx_arms_model(load_checkpoint(checkpoint)))):
        sidecars = open_sidecars(directory, model if engine == "numpy" else model.checkpoint, PROMPT)
        arms = [Arm("reference"), Arm("sidecar", "sidecar")]
        runs[engine] = run_arms_on(engine, model, prompt, arms, decode=DECODE, sidecars=sidecars)
    for arm, bound in (("reference", 1e-5), ("sidecar", NOISE)):
        mlx, numpy = runs["mlx"][arm], runs["numpy"][arm]
        assert relative_error(mlx.logits, numpy.logits) < bound and np.array_equal(mlx.tokens, numpy.tokens)
        assert max(relative_error(mlx.hidden[i], numpy.hidden[i]) for i in range(2)) < bound
    assert relative_error(runs["mlx"]["sidecar"].logits, runs["mlx"]["reference"].logits) > 1e-5  # not vacuous
    held = {engine: runs[engine]["reference"].weights for engine in runs}  # both hold every float32 weight
    assert held["mlx"].mode == held["numpy"].mode == "resident" and held["mlx"].budget_bytes is None
    assert held["mlx"].float32_bytes == held["numpy"].float32_bytes  # mlx-lm's arrays vs the checkpoint's tensors


@pytest.mark.parametrize("family, design", [("qwen3_5", "stateful"), ("qwen3_5", "stateful-tiled"),
                                            ("gemma3_text", "stateful-tiled")])  # fmt: skip
def test_stateful_designs_are_served_their_state_mirrored_into_mlx_lms_cache(made, tmp_path, family, design):
    checkpoint, _ = made[family]
    request = SidecarRequest(chunk=CHUNK, graph=design, capacity=2 * CHUNK, histories=(0, CHUNK))
    export_request(load_checkpoint(checkpoint), tmp_path / design, request, None, jobs=1)
    report = compare_arms(open_mlx_arms_model(load_checkpoint(checkpoint)), tmp_path / design, PROMPT, decode=DECODE)
    pair = report.pairs[0]
    assert DESIGNS[design].stateful and 0 < pair.prompt_logits_diff < NOISE
    assert max(pair.step_logits_diffs) < NOISE and pair.identical_text  # decode read the mirrored K/V


def test_compare_arms_runs_a_qwen3_5_hybrid_end_to_end(made, capsys):
    checkpoint, directory = made["qwen3_5"]
    argv = ["compare-arms", str(checkpoint), "--sidecars", str(directory), "--prompt-tokens", str(PROMPT)]
    assert main(argv + ["--decode", "3"]) == 0  # engine auto: anelab's forward does not model Gated DeltaNet
    out = capsys.readouterr().out
    assert "on mlx-lm" in out and "greedy agreement 100% (identical)" in out
    assert "weights resident (mlx-lm holds all" in out  # how the engine held the weights, said
    assert main(argv + ["--engine", "numpy"]) == 2
    assert "linear-attention" in capsys.readouterr().err


def test_a_gguf_file_on_mlx_lm_is_refused_in_one_line(made, capsys):
    """mlx-lm reads checkpoint directories: a GGUF file (default-real) given to the mlx engine or to the A/B (by
    name) is refused in one line naming the NumPy engine (it crashed in mlx-lm's loader: ``<file>/config.json``)."""
    from anelab.arms.arm_comparison import open_engine_model
    from anelab.checkpoints.default import resolve_checkpoint

    with pytest.raises(AnelabInputError, match="not GGUF files.*--engine numpy"):
        open_engine_model(load_checkpoint(resolve_checkpoint("default-real")), "mlx")
    _, directory = made["llama"]
    assert main(["ab", "default-real", "--sidecars", str(directory), "--prompt-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert "not GGUF files" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    # control: the same engine on a checkpoint directory opens it
    assert open_mlx_arms_model(load_checkpoint(made["llama"][0])).num_layers > 0


# ---- the A/B ---------------------------------------------------------------------------------------------------
def test_ab_off_a_mac_gives_both_arms_labelled_and_prices_nothing(made, tmp_path, capsys):
    checkpoint, directory = made["qwen3_5"]
    argv = ["ab", str(checkpoint), "--sidecars", str(directory), "--prompt-tokens", f"{PROMPT},9"]
    assert main(argv + ["--out", str(tmp_path / "rec")]) == 0
    out = capsys.readouterr().out
    assert "not a Mac's timings, never priced" in out and "no verdict" in out
    [first, second] = read_records(tmp_path / "rec", "whole_model_ab")
    for record in (first, second):
        assert record["parameters"]["timings_are_a_macs"] is False and record["provenance"]["mlx"]
        assert record["results"]["correctness"]["logits_relative_difference"] < NOISE
        assert record["results"]["gpu_arm"]["median_s"] > 0 and len(record["results"]["ane_arm"]["runs"]) == 2
    assert main(argv[:-1] + ["40"]) == 2  # past the packages' histories: refused in one line
    assert "lacks function h16" in capsys.readouterr().err


PREDICT_S, COLD_LOAD_S = 0.04, 0.5


def _fake_mac(**kwargs):
    functions = {f"h{s}": FakeFunction(cold_load_s=COLD_LOAD_S, predict_s={"cpu_and_ne": PREDICT_S}, **kwargs)
                 for s in (0, CHUNK)}  # fmt: skip
    fake = FakeRuntime(functions, numerics=True)
    return fake, (lambda: time.perf_counter() + fake.clock())  # MLX runs here in real time, Core ML on the fake's


def test_ab_on_a_fake_mac_measures_both_arms_and_its_components_add_up(made, tmp_path):
    checkpoint, directory = made["llama"]
    fake, clock = _fake_mac()
    report = run_ab(ab_request(checkpoint, gated_copy(directory, tmp_path / "gated"), [PROMPT], runtime=fake, clock=clock,
                               out_dir=tmp_path / "rec"))  # fmt: skip
    [result] = report.prompts
    ane = result.results["ane_arm"]
    assert report.on_mac and set(ane["loads"]) == {"0:h0", "0:h8", "1:h0", "1:h8"}
    assert ane["load_total_s"] == pytest.approx(4 * COLD_LOAD_S, abs=0.1)  # the fake's cold loads, paid first
    for run in ane["runs"]:
        assert run["calls"] == 4 and run["core_ml_predict_s"] == pytest.approx(4 * PREDICT_S)
        parts = sum(run[k] for k in ("mlx_eval_s", "mlx_graph_s", "core_ml_predict_s", "marshalling_s"))
        assert parts == pytest.approx(run["total_s"]) and run["mlx_graph_s"] >= 0
    assert ane["median_s"] > 4 * PREDICT_S and result.results["correctness"]["same_greedy_token"]
    assert result.record["parameters"]["placements"][0]["neural_engine"] > 0
    v = result.verdict.to_dict()
    assert {c["kind"] for c in v["costs"].values()} == {"measured on this Mac"}
    assert v["gpu_prefill"]["value"] == pytest.approx(result.results["gpu_arm"]["median_s"])
    assert v["costs"]["load_per_layer"]["value"] == pytest.approx(2 * COLD_LOAD_S, abs=0.05)
    assert v["decision"] == "gpu"  # 1 s of loads per layer against a GPU prefill of milliseconds
    assert [r["_file"] for r in read_records(tmp_path / "rec")] == [result.record["_file"]]


def test_ab_refuses_a_mac_without_a_neural_engine_or_ane_placement_or_working_predicts(made, tmp_path):
    checkpoint, directory = made["llama"]
    gated = gated_copy(directory, tmp_path / "gated")
    no_ane = FakeRuntime(neural_engine=False)
    with pytest.raises(AnelabInputError, match="no Neural Engine"):
        run_ab(ab_request(checkpoint, gated, [PROMPT], runtime=no_ane))
    on_cpu = FakeRuntime(default=FakeFunction(assignment={"neural_engine": 0, "gpu": 0, "cpu": 90}))
    with pytest.raises(AnelabInputError, match="puts none of its 90 operations on the Neural Engine"):
        run_ab(ab_request(checkpoint, gated, [PROMPT], runtime=on_cpu))
    failing, clock = _fake_mac(predict_error="ANE compiler service failed")
    with pytest.raises(AnelabInputError, match="the ANE arm does not run on this Mac") as refused:
        run_ab(ab_request(checkpoint, gated, [PROMPT], runtime=failing, clock=clock, out_dir=tmp_path / "rec"))
    assert "\n" not in str(refused.value) and not (tmp_path / "rec").exists()  # nothing of the failed run kept


def test_decide_runs_a_qwen3_5_hybrid_end_to_end_on_its_own_candidate(made, tmp_path):
    from anelab.decide.decision import DecideConfig, decide

    checkpoint, _ = made["qwen3_5"]
    decision = decide(DecideConfig(checkpoint, 2 * CHUNK, tmp_path / "decide", chunk=CHUNK, decode=DECODE))
    arms = decision.evidence.arms
    assert arms.engine == "mlx" and arms.served_by == decision.candidate and arms.note == ""
    assert 0 < arms.logits_relative_difference < NOISE and arms.identical_text
    assert arms.layer_differences[:3] == (0.0, 0.0, 0.0)  # the Gated DeltaNet layers stay mlx-lm's


def test_ab_runs_a_block_split_off_a_mac_for_correctness_and_a_mac_refuses_its_ungated_packages(made, tmp_path, capsys):
    """Issue 43: ``ab --mlp-sidecars`` serves every MLP from its packages (here with no attention sidecar: the MLP
    split alone). Off a Mac it runs labelled, its logits within the bound; a Mac serves them through Core ML
    (tests/arms/test_split_ab.py) and refuses, in one line, packages no ANE gate passed."""
    checkpoint, _ = made["qwen3_5"]
    mlp = tmp_path / "mlp"
    export_sidecars(load_checkpoint(checkpoint), mlp, CHUNK, None, graph="mlp", jobs=1)
    argv = ["ab", str(checkpoint), "--mlp-sidecars", str(mlp), "--prompt-tokens", str(PROMPT)]
    assert main([*argv, "--out", str(tmp_path / "rec")]) == 0
    out = capsys.readouterr().out
    assert "ANE arm (hybrid: mlp on sidecars)" in out and "not a Mac's timings" in out
    [record] = read_records(tmp_path / "rec", "whole_model_ab")
    assert record["parameters"]["split"] == "mlp" and record["parameters"]["design"] is None
    correctness = record["results"]["correctness"]
    assert correctness["within_bound"] and 0 < correctness["logits_relative_difference"] < NOISE
    with pytest.raises(AnelabInputError, match="not verified for the Neural Engine"):
        run_ab(ab_request(checkpoint, None, [PROMPT], mlp_sidecars=mlp, runtime=_fake_mac()[0]))
    assert main(["ab", str(checkpoint), "--prompt-tokens", str(PROMPT)]) == 2  # no sidecars at all: refused
    assert "needs sidecars to serve" in capsys.readouterr().err
