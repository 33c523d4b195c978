"""Issue 43: ``anelab ab`` times each offload split the plan proposes. On a Mac (here: the fake Core ML runtime,
which refuses what coremltools refuses) the block packages (``--graph mlp``) are served through Core ML beside the
attention's, timed with the same runner; off a Mac every split runs for correctness and says its times are not
measured. A split name the plan does not list, a part without its packages and a package of the wrong design are
refused in one line."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from conftest import gated_copy

from anelab.arms.ab_splits import planned_splits, split_parts
from anelab.arms.prefill_ab import ab_request, run_ab
from anelab.arms.sidecars import CoreMLBlockRunner, CoreMLTiming, open_block_sidecars
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.core.records import read_records
from anelab.runtimes.coreml.coreml_fake import FakeFunction, FakeRuntime
from anelab.runtimes.interface import RuntimePredictError
from anelab.runtimes.mlx.checkpoints import write_mlx_lm_checkpoint
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD, relative_error
from anelab.sidecar.export import export_sidecars

CHUNK, PROMPT = 8, 13  # chunk starts 0 and 8; the second chunk partial (5 rows)
LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1, rope_theta=5e5,
             hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             rms_norm_eps=1e-6, vocab_size=96, max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip
PREDICT_S, COLD_LOAD_S = 0.04, 0.5
NOISE = 0.02  # fp16 sidecars against mlx-lm's fp32 forward


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(checkpoint, attention sidecars, MLP sidecars), the sidecars as exported and as a gated Mac export writes them."""
    root = tmp_path_factory.mktemp("split_ab")
    checkpoint = write_mlx_lm_checkpoint(root / "model", LLAMA, seed=1)
    opened = load_checkpoint(checkpoint)
    export_sidecars(opened, root / "attention", CHUNK, [0, CHUNK])
    export_sidecars(opened, root / "mlp", CHUNK, None, graph="mlp", jobs=1)
    gated = {name: gated_copy(root / name, root / f"gated_{name}") for name in ("attention", "mlp")}
    return checkpoint, root / "attention", root / "mlp", gated, root / "mac" / "compiled"


def _fake_mac(cache_dir: Path, **options):
    """A fake Mac whose every function (attention h0 / h8, the MLP's c8) loads in COLD_LOAD_S and predicts in
    PREDICT_S, computing what the saved program computes; ``cache_dir`` shared by the module's fake Macs (one Mac:
    each function's pre-flight child runs once)."""
    functions = {name: FakeFunction(cold_load_s=COLD_LOAD_S, predict_s={"cpu_and_ne": PREDICT_S})
                 for name in ("h0", f"h{CHUNK}", f"c{CHUNK}")}  # fmt: skip
    fake = FakeRuntime(functions, numerics=True, cache_dir=cache_dir, **options)
    return fake, (lambda: time.perf_counter() + fake.clock())  # MLX runs here in real time, Core ML on the fake's


# ---- Core ML serving of a block package ------------------------------------------------------------------------
def test_a_block_package_served_through_core_ml_computes_what_numpy_computes_and_the_fake_refuses_bad_arrays(made):
    checkpoint, _, _, gated, mac = made
    fake, clock = _fake_mac(mac)
    block = open_block_sidecars(gated["mlp"], load_checkpoint(checkpoint))
    rows = np.random.default_rng(3).standard_normal((5, LLAMA["hidden_size"])).astype(np.float16)
    want = block.serve(0, rows)  # NumPy from disk
    block.runner = CoreMLBlockRunner(
        block, compute_units="cpu_and_ne", runtime=fake, clock=clock, timing=CoreMLTiming()
    )
    got = block.serve(0, rows)
    assert got.shape == want.shape == (5, LLAMA["hidden_size"])
    assert 0 < relative_error(got, want) < RELATIVE_ERROR_THRESHOLD  # the device's fp16 rounding, no more
    assert [c[:3] for c in fake.calls if c[0] == "predict"] == [("predict", str(block.packages[0]), f"c{CHUNK}")]
    assert block.runner.timing.core_ml_predict_s == [PREDICT_S]
    # controls: the binding takes int32 / fp32 / fp64 writable arrays only, as coremltools' does
    handle = block.runner.opened[0].handle_for(0)
    hidden = np.zeros((CHUNK, LLAMA["hidden_size"]), np.float32)
    for bad in (hidden.astype(np.int64), np.lib.stride_tricks.as_strided(hidden, writeable=False)):
        with pytest.raises(RuntimePredictError, match="value type not convertible"):
            fake.predict(handle, {"hidden": bad})
    assert fake.predict(handle, {"hidden": hidden.copy()})  # the same shape, writable fp32: served


def test_an_ungated_block_package_or_one_of_another_design_is_refused_on_a_mac(made, tmp_path):
    checkpoint, attention, mlp, gated, mac = made
    fake, clock = _fake_mac(mac)
    with pytest.raises(AnelabInputError, match="not verified for the Neural Engine"):  # exported without the gate
        run_ab(ab_request(checkpoint, None, [PROMPT], mlp_sidecars=mlp, runtime=fake, clock=clock))
    with pytest.raises(AnelabInputError, match="is a --graph dense package, not --graph mlp") as refused:
        run_ab(ab_request(checkpoint, None, [PROMPT], mlp_sidecars=gated["attention"], runtime=fake, clock=clock))
    assert "\n" not in str(refused.value)


# ---- the split on a (fake) Mac ----------------------------------------------------------------------------------
def test_ab_on_a_fake_mac_times_the_mlp_split_through_core_ml_and_its_components_add_up(made, tmp_path):
    checkpoint, _, _, gated, mac = made
    fake, clock = _fake_mac(mac)
    report = run_ab(ab_request(checkpoint, gated["attention"], [PROMPT], mlp_sidecars=gated["mlp"], runtime=fake,
                               clock=clock, out_dir=tmp_path / "rec"))  # fmt: skip
    [result] = report.prompts
    ane = result.results["ane_arm"]
    assert report.on_mac and result.record["parameters"]["split"] == "attention + mlp"
    assert set(ane["loads"]) == {"0:h0", "0:h8", "0:mlp:c8"}
    assert ane["load_total_s"] == pytest.approx(3 * COLD_LOAD_S, abs=0.1)  # every function's cold load, paid first
    for run in ane["runs"]:  # two chunks x (attention + MLP): four Core ML predicts per run
        assert run["calls"] == 4 and run["core_ml_predict_s"] == pytest.approx(4 * PREDICT_S)
        parts = sum(run[k] for k in ("mlx_eval_s", "mlx_graph_s", "core_ml_predict_s", "marshalling_s"))
        assert parts == pytest.approx(run["total_s"]) and "numpy_sidecar_s" not in run
    assert result.results["correctness"]["within_bound"]  # the fake computes what the saved programs compute
    placed = {Path(p["package"]).parent.name for p in result.record["parameters"]["placements"]}
    assert placed == {"gated_attention", "gated_mlp"} and len(result.record["parameters"]["placements"]) == 2
    assert result.verdict is not None and result.verdict.to_dict()["decision"] == "gpu"  # 1 s of loads per layer
    assert result.record["parameters"]["mlp_layers_on_sidecars"] == [0]
    assert [r["_file"] for r in read_records(tmp_path / "rec")] == [result.record["_file"]]


def test_ab_split_planned_on_a_fake_mac_times_each_proposed_split_beside_its_prediction(made, tmp_path):
    checkpoint, _, _, gated, mac = made
    fake, clock = _fake_mac(mac)
    proposed = planned_splits(checkpoint, [PROMPT, 2 * CHUNK], ["planned"], "M3")
    assert proposed and all(s.name != "none" for s in proposed)
    report = run_ab(ab_request(checkpoint, gated["attention"], [PROMPT, 2 * CHUNK], mlp_sidecars=gated["mlp"],
                               splits=("planned", "mlp"), chip="M3", runtime=fake, clock=clock,
                               out_dir=tmp_path / "rec"))  # fmt: skip
    names = list(dict.fromkeys([s.name for s in proposed] + ["mlp"]))
    assert [p.record["parameters"]["split"] for p in report.prompts] == [n for n in names for _ in range(2)]
    for p in report.prompts:
        planned = p.record["parameters"]["planned"]
        assert planned["chip"] == "M3" and planned["prediction"]["ratio"] > 0
        served = p.record["parameters"]
        assert bool(served["layers_on_sidecars"]) == ("attention" in planned["parts"])
        assert bool(served["mlp_layers_on_sidecars"]) == ("mlp" in planned["parts"])
    assert len(read_records(tmp_path / "rec", "whole_model_ab")) == 2 * len(names)  # one new record per (split, n)
    assert "measured" in report.table() and "on this Mac; predicted" in report.table()


# ---- off a Mac, and the refusals --------------------------------------------------------------------------------
def test_ab_split_off_a_mac_runs_for_correctness_and_says_its_times_are_not_measured(made, tmp_path, capsys):
    checkpoint, attention, mlp, _, _ = made
    argv = ["ab", str(checkpoint), "--sidecars", str(attention), "--mlp-sidecars", str(mlp), "--prompt-tokens",
            str(PROMPT), "--split", "mlp", "--chip", "M3", "--out", str(tmp_path / "rec")]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "split mlp: not measured (not a Mac: correctness only); predicted" in out
    [record] = read_records(tmp_path / "rec", "whole_model_ab")
    assert record["parameters"]["split"] == "mlp" and record["parameters"]["layers_on_sidecars"] == []
    assert 0 < record["results"]["correctness"]["logits_relative_difference"] < NOISE


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--split", "attention + gdn"], "is not a planner split"),
        (["--split", "projections"], "is not one the plan lists for this checkpoint; it lists: attention, mlp"),
        (["--split", "none"], "is the GPU arm itself"),
        (["--split", "attention+mlp"], "serves mlp from sidecars: give --mlp-sidecars DIR (mlp)"),
    ],
)
def test_a_split_the_plan_does_not_know_or_cannot_serve_is_refused_in_one_line(made, capsys, flags, message):
    checkpoint, attention, _, _, _ = made
    argv = ["ab", str(checkpoint), "--sidecars", str(attention), "--prompt-tokens", str(PROMPT), "--chip", "M3"]
    assert main([*argv, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_split_names_read_as_the_planner_writes_them():
    assert split_parts("attention+mlp[:12]") == {"attention": None, "mlp": 12}
    with pytest.raises(AnelabInputError, match="not a planner split"):
        split_parts("mlp + mlp")


QWEN3_5 = dict(model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"], tie_word_embeddings=False,
               text_config=dict({k: v for k, v in LLAMA.items() if k not in ("model_type", "architectures",
                                 "rope_theta", "num_hidden_layers")}, model_type="qwen3_5_text", num_hidden_layers=2,
                                linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
                                attn_output_gate=True, layer_types=["linear_attention", "full_attention"],
                                rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                 "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]}))  # fmt: skip


def test_ab_on_a_fake_mac_serves_a_hybrids_gdn_projections_through_core_ml(made, tmp_path):
    """The oMLX-style split on a Qwen 3.5 hybrid: its linear-attention layer's four input projections from one Core ML
    call per chunk, the delta rule staying mlx-lm's. Served exactly (fp32 device outputs), the logits stay within the
    bound of mlx-lm's own forward; with the ANE's fp16 accumulation the fake models (``device_verify``: 2.3e-2 at a
    576-wide reduction, scaled by its square root) they do not, and the record says so (``within_bound`` false)."""
    *_, mac = made
    checkpoint = write_mlx_lm_checkpoint(tmp_path / "qwen3_5", QWEN3_5, seed=1)
    export_sidecars(load_checkpoint(checkpoint), tmp_path / "gdn", CHUNK, None, graph="gdn-proj", jobs=1)
    gated = gated_copy(tmp_path / "gdn", tmp_path / "gated_gdn")
    fake, clock = _fake_mac(mac, fp16_accumulation=False, noise={})
    [result] = run_ab(ab_request(checkpoint, None, [PROMPT], gdn_sidecars=gated, runtime=fake, clock=clock)).prompts
    ane = result.results["ane_arm"]
    assert set(ane["loads"]) == {"0:gdn:c8"} and result.record["parameters"]["split"] == "projections"
    assert all(run["calls"] == 2 and run["core_ml_predict_s"] == pytest.approx(2 * PREDICT_S) for run in ane["runs"])
    assert result.results["correctness"]["within_bound"], result.results["correctness"]
    predicted = [c for c in fake.calls if c[0] == "predict"]
    assert {c[1] for c in predicted} == {str(gated / "layer_0.mlpackage")}
    # the ANE's fp16 accumulation on the gates b and a: the correctness check notices, the record keeps it
    noisy, clock = _fake_mac(mac)
    [rounded] = run_ab(ab_request(checkpoint, None, [PROMPT], gdn_sidecars=gated, runtime=noisy, clock=clock)).prompts
    assert not rounded.results["correctness"]["within_bound"]
    assert rounded.results["correctness"]["against_fp32"] > result.results["correctness"]["against_fp32"]
