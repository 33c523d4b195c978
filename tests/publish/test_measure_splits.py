"""``anelab measure``'s ``split_ab`` step on a (fake) Mac: the splits the plan proposes for a model, each timed by
``anelab ab --split planned`` from packages the ANE gate passed, one ``whole_model_ab`` record per split and prompt;
off a Mac ``--dry-run`` names the step and ``measure`` refuses in one line."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from anelab.arms.ab_splits import planned_splits
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.publish.measure_splits import models_key, split_records
from anelab.runtimes.coreml.coreml_fake import FakeFunction, FakeRuntime
from anelab.runtimes.mlx.checkpoints import write_mlx_lm_checkpoint
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.format import META, read_raw_metadata, write_package_metadata

CHUNK, PROMPT = 8, 13
LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1, rope_theta=5e5,
             hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             rms_norm_eps=1e-6, vocab_size=96, max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip


def _gate_in_place(directory: Path) -> None:
    """The packages of ``directory`` recording a passed ANE gate, as an export on a Mac writes them."""
    for pkg in sorted(directory.glob("layer_*.mlpackage")):
        meta = {**read_raw_metadata(pkg), META["ane_verified"]: "true", META["ane_reason"]: "set by a test"}
        staged = pkg.with_name(f"gated_{pkg.name}")
        write_package_metadata(pkg, staged, meta)
        shutil.rmtree(pkg)
        staged.rename(pkg)


def test_split_ab_times_each_planned_split_from_gated_packages_and_records_it(tmp_path):
    checkpoint = write_mlx_lm_checkpoint(tmp_path / "model", LLAMA, seed=1)
    proposed = planned_splits(checkpoint, [PROMPT], ["planned"], None)
    assert proposed and all(s.name != "none" for s in proposed)
    build = tmp_path / "build"
    for part in {p for s in proposed for p in s.parts}:  # exported before (verified here): the step reuses them
        where = build / "splits" / "model" / part
        graph = {"attention": {}, "mlp": {"graph": "mlp"}}[part]
        export_sidecars(load_checkpoint(checkpoint), where, CHUNK, None if graph else [0, CHUNK], jobs=1, **graph)
        _gate_in_place(where)
    fake = FakeRuntime({n: FakeFunction(predict_s={"cpu_and_ne": 0.04}) for n in ("h0", "h8", "c8")}, numerics=True)
    records = split_records(fake, [str(checkpoint)], [PROMPT], CHUNK, build, tmp_path / "staging", repeats=1,
                            clock=lambda: time.perf_counter() + fake.clock())  # fmt: skip
    assert [r["parameters"]["split"] for r in records] == [s.name for s in proposed]
    for r in records:
        assert r["parameters"]["timings_are_a_macs"] is True and r["parameters"]["planned"]["prediction"]
        assert r["parameters"]["planned"]["chip_choice"]  # which chip's plan, said
        assert r["results"]["correctness"]["within_bound"]
    # the key moves with the model's bytes, the prompts and the chunk
    key = models_key([str(checkpoint)], [PROMPT], CHUNK)
    assert key != models_key([str(checkpoint)], [PROMPT + 1], CHUNK) != models_key([str(checkpoint)], [PROMPT], 16)


def test_split_ab_exports_an_unverified_package_again_through_the_gate_which_needs_the_runtime(tmp_path):
    checkpoint = write_mlx_lm_checkpoint(tmp_path / "model", LLAMA, seed=1)
    proposed = planned_splits(checkpoint, [PROMPT], ["planned"], None)
    build = tmp_path / "build"
    for part in {p for s in proposed for p in s.parts}:  # exported without the gate: not reused
        graph = {"attention": {}, "mlp": {"graph": "mlp"}}[part]
        export_sidecars(load_checkpoint(checkpoint), build / "splits" / "model" / part, CHUNK, None if graph else [0, CHUNK], jobs=1,
                        **graph)  # fmt: skip
    off = FakeRuntime(available=False, reason="not macOS")  # the gate's export needs the runtime: refused, one line
    with pytest.raises(AnelabInputError, match="not macOS") as refused:
        split_records(off, [str(checkpoint)], [PROMPT], CHUNK, build, tmp_path / "staging", repeats=1,
                      clock=time.perf_counter)  # fmt: skip
    assert "\n" not in str(refused.value) and not (tmp_path / "staging").exists()


def test_dry_run_names_the_split_step_and_off_a_mac_measure_refuses_in_one_line(capsys, tmp_path):
    assert main(["measure", "--dry-run", "--split-models", "default-real", "--split-prompt-tokens", "512"]) == 0
    out = capsys.readouterr().out
    assert "split_ab" in out and "models default-real, prompt tokens 512" in out
    assert main(["measure", "--records", str(tmp_path / "r")]) == 2
    assert "needs a Mac" in capsys.readouterr().err and not (tmp_path / "r").exists()
