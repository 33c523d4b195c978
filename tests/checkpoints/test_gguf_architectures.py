"""Every GGUF architecture anelab reads, written here the way llama.cpp's converter writes it, against the same weights
as a Hugging Face directory read through anelab's HF path.

Each case is a tiny model in transformers' names and keys (``test_decoder_families._tensors``), saved once as an F32
safetensors directory with a hand-written config.json and once as a GGUF file made by ``write_like_llama_cpp``: this
test's own copy of what llama.cpp's converter does for the architecture (tensor names through gguf's
``TensorNameMap`` as ``map_tensor_name`` does, Q/K rows permuted where ``LlamaModel.permute`` runs, Gemma's norms
stored ``+ 1``, experts stacked, the metadata keys its ``set_gguf_parameters`` writes) — never anelab's reader run
backwards. The HF config holds what llama.cpp's loader fixes for the architecture (Gemma 3's window pattern and local
RoPE base, Gemma's query scale, the embedding scale in float32, Granite's defaults), so the two must give the same
geometry and the same logits. Each convention has a control: anelab's row for the architecture with that convention
undone wrongly, which must miss by far more than the F32 round trip.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file
from test_decoder_families import D_HEAD, HKV, HQ, INTER, VOCAB, Conventions, _tensors

from anelab.arms.arm_runs import Arm, run_arm
from anelab.checkpoints import gguf_architectures, gguf_file
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.whole_model import whole_model
from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.sidecar.checks.comparison import relative_error

PROMPT = np.array([3, 17, 5, 29, 11, 2, 38, 7, 21, 13, 33, 1, 8, 19])  # 14 tokens: windows of 4 bite
DECODE = 3
SAME = 1e-5  # F32 file against F32 directory (Gemma's norms come back as (w + 1) - 1: a few ulps)
MISS = 1e-3  # a convention undone wrongly must miss by at least this
GEMMA_NORMS = ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm", "post_feedforward_layernorm")
EXPERTS, TOP_K, MOE_INTER = 4, 2, 16


def _hf_config(model_type: str, c: Conventions, **keys) -> dict:
    return {
        "model_type": model_type, "hidden_size": c.hidden, "num_attention_heads": HQ, "num_key_value_heads": HKV,
        "head_dim": D_HEAD, "num_hidden_layers": c.layers, "vocab_size": VOCAB, "intermediate_size": INTER,
        "rope_theta": c.theta, "max_position_embeddings": 4096, "tie_word_embeddings": c.tied, **keys,
    }  # fmt: skip


def _moe_tensors(c: Conventions, seed: int) -> dict[str, np.ndarray]:
    """A Qwen3-MoE model's tensors in transformers' names: the dense case's attention and norms, routed experts."""
    t = {k: v for k, v in _tensors(c, seed).items() if ".mlp." not in k}
    rng = np.random.default_rng(seed + 1)
    for layer in range(c.layers):
        p = f"model.layers.{layer}.mlp."
        t[p + "gate.weight"] = rng.standard_normal((EXPERTS, c.hidden)).astype(np.float32)
        for e in range(EXPERTS):
            for name, shape in (("gate_proj", (MOE_INTER, c.hidden)), ("up_proj", (MOE_INTER, c.hidden)),
                                ("down_proj", (c.hidden, MOE_INTER))):  # fmt: skip
                t[p + f"experts.{e}.{name}.weight"] = (rng.standard_normal(shape) * shape[1] ** -0.5).astype(np.float32)
    return t


def _cases() -> dict:
    """arch -> (GGUF architecture, HF config, conventions of the tensors, metadata the converter writes)."""
    gemma3 = Conventions(hidden=24, layers=6, norms=GEMMA_NORMS, one_plus=True, act="gelu_tanh", tied=True,
                         qk_norm="head", theta=1e6)  # fmt: skip
    gemma2 = Conventions(hidden=24, layers=3, norms=GEMMA_NORMS, one_plus=True, act="gelu_tanh", tied=True)
    plain = Conventions()
    olmo2 = Conventions(norms=(None, None, "post_attention_layernorm", "post_feedforward_layernorm"),
                        qk_norm="projection")  # fmt: skip
    starcoder2 = Conventions(layer_norm=True, mlp="plain", mlp_bias=True, act="gelu_tanh", qkv_bias=True,
                             o_bias=True, tied=True, eps=1e-5)  # fmt: skip
    phi3 = Conventions(mlp="fused", fused_qkv=True, rotary=0.5, eps=1e-5)
    moe = Conventions(qk_norm="head", theta=1e6)
    windows = ["sliding_attention"] * 5 + ["full_attention"]  # llama.cpp's set_swa_pattern(6)
    return {
        "gemma3": ("gemma3", _hf_config(
            "gemma3_text", gemma3, rms_norm_eps=1e-6, query_pre_attn_scalar=D_HEAD, sliding_window=4,
            layer_types=windows, rope_local_base_freq=10000.0, torch_dtype="float32",
        ), gemma3, {"attention.sliding_window": 4}),
        "gemma2": ("gemma2", _hf_config(
            "gemma2", gemma2, rms_norm_eps=1e-6, query_pre_attn_scalar=D_HEAD, attn_logit_softcapping=1.0,
            final_logit_softcapping=2.0, sliding_window=4, torch_dtype="float32",
        ), gemma2, {"attention.sliding_window": 4, "attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0}),
        "granite": ("granite", _hf_config(
            "granite", plain, rms_norm_eps=1e-6, embedding_multiplier=3.0, residual_multiplier=0.5,
            logits_scaling=4.0, attention_multiplier=0.9,
        ), plain, {"attention.scale": 0.9, "embedding_scale": 3.0, "residual_scale": 0.5, "logit_scale": 4.0}),
        "mistral": ("llama", _hf_config("mistral", plain, rms_norm_eps=1e-6, sliding_window=None), plain, {}),
        "olmo2": ("olmo2", _hf_config("olmo2", olmo2, rms_norm_eps=1e-6), olmo2, {}),
        "starcoder2": ("starcoder2", _hf_config("starcoder2", starcoder2, norm_epsilon=1e-5, use_bias=True),
                       starcoder2, {}),
        "phi3": ("phi3", _hf_config("phi3", phi3, rms_norm_eps=1e-5, partial_rotary_factor=0.5, sliding_window=None),
                 phi3, {"rope.dimension_count": D_HEAD // 2, "attention.sliding_window": 5,
                        "rope.scaling.original_context_length": 4096}),
        "qwen3moe": ("qwen3moe", _hf_config(
            "qwen3_moe", moe, rms_norm_eps=1e-6, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
            moe_intermediate_size=MOE_INTER, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        ), moe, {"expert_count": EXPERTS, "expert_used_count": TOP_K, "expert_feed_forward_length": MOE_INTER}),
    }  # fmt: skip


CASES = _cases()
PERMUTED = ("llama", "granite")  # LlamaModel and its subclasses: LlamaModel.permute on q_proj / k_proj
NORM_SHIFTED = ("gemma2", "gemma3")  # Gemma2Model / Gemma3Model.modify_tensors: norm.weight + 1


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter, ``LlamaModel.permute``: each head's rotate-half halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stacked_experts(tensors: dict, layers: int) -> dict:
    """Qwen2MoeModel.modify_tensors: ``mlp.experts.{e}.{w}.weight`` stacked per layer into
    ``model.layers.{L}.mlp.experts.{w}.weight`` [E, N, K] before the name is mapped."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in range(layers):
        for w in ("gate_proj", "up_proj", "down_proj"):
            parts = [tensors[f"model.layers.{layer}.mlp.experts.{e}.{w}.weight"] for e in range(EXPERTS)]
            out[f"model.layers.{layer}.mlp.experts.{w}.weight"] = np.stack(parts)
    return out


def write_like_llama_cpp(path, arch: str, config: dict, tensors: dict, extra: dict):
    """A GGUF file of the HF model (``config``, ``tensors``) as llama.cpp's converter writes architecture ``arch``."""
    writer = gguf.GGUFWriter(path, arch)
    layers = config["num_hidden_layers"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    if arch == "starcoder2":
        writer.add_layer_norm_eps(config["norm_epsilon"])
    else:
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    for key, value in extra.items():
        add = writer.add_uint32 if isinstance(value, int) else writer.add_float32
        add(f"{arch}.{key}", value)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(VOCAB)])  # the vocabulary's size
    enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(enum, layers)
    if arch == "qwen3moe":
        tensors = _stacked_experts(tensors, layers)
    for name, value in sorted(tensors.items()):
        if name == "lm_head.weight" and config["tie_word_embeddings"]:
            continue  # a tied model has none
        base, suffix = name.rsplit(".", 1)
        if arch in PERMUTED and base.endswith(("q_proj", "k_proj")):
            value = llama_cpp_permute(value, HQ if base.endswith("q_proj") else HKV)
        if arch in NORM_SHIFTED and name.endswith("norm.weight"):
            value = value + np.float32(1.0)
        writer.add_tensor(f"{table.get_name(base)}.{suffix}", np.ascontiguousarray(value, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """case -> (HF directory, GGUF file) of the same weights."""
    root = tmp_path_factory.mktemp("gguf-archs")
    out = {}
    for seed, (name, (arch, config, c, extra)) in enumerate(CASES.items()):
        tensors = _moe_tensors(c, seed) if arch == "qwen3moe" else _tensors(c, seed)
        hf = root / name
        hf.mkdir()
        (hf / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(hf / "model.safetensors"))
        out[name] = hf, write_like_llama_cpp(root / f"{name}.gguf", arch, config, tensors, extra)
    return out


def _logits(checkpoint) -> np.ndarray:
    model = whole_model(checkpoint)
    return run_arm(model, PROMPT, Arm("reference"), decode=DECODE).logits


@pytest.mark.parametrize("name", list(CASES))
def test_a_gguf_of_each_architecture_gives_the_hf_directorys_geometry_and_logits(written, name):
    hf, path = written[name]
    ck, ref = load_checkpoint(path), load_checkpoint(hf)
    assert ck.format == "gguf"
    assert ck.geometry.to_dict() == ref.geometry.to_dict()
    assert relative_error(_logits(ck), _logits(ref)) < SAME


def _spec_change(name: str, **changes):
    arch = CASES[name][0]
    return lambda mp: mp.setitem(gguf_architectures.GGUF_ARCHITECTURES, arch,
                                 replace(gguf_architectures.GGUF_ARCHITECTURES[arch], **changes))  # fmt: skip


def _reverse_experts(mp):
    split = gguf_file._per_expert

    def reversed_order(names, by_gguf_name, path):
        entries, experts = split(names, by_gguf_name, path)
        return entries, {name: EXPERTS - 1 - e for name, e in experts.items()}

    mp.setattr(gguf_file, "_per_expert", reversed_order)


def _full_rotary(mp):
    read = gguf_architectures._head_dim

    def full(reader, arch, spec, config, path):
        head_dim = read(reader, arch, spec, config, path)
        config.pop("partial_rotary_factor", None)
        return head_dim

    mp.setattr(gguf_architectures, "_head_dim", full)


GEMMA3_FIXED = gguf_architectures.GGUF_ARCHITECTURES["gemma3"].fixed
CONTROLS = {
    "gemma3: norms not unshifted": ("gemma3", _spec_change("gemma3", norm_shift=0.0)),
    "gemma3: Gemma 2's window pattern": ("gemma3", _spec_change("gemma3", swa_pattern=2)),
    "gemma3: local RoPE base = the global one": (
        "gemma3", _spec_change("gemma3", fixed={**GEMMA3_FIXED, "rope_local_base_freq": 1e6})),
    "gemma3: query scale left to transformers' default": ("gemma3", _spec_change("gemma3", gemma_query_scale=False)),
    "gemma2: norms not unshifted": ("gemma2", _spec_change("gemma2", norm_shift=0.0)),
    "gemma2: soft-caps not read": ("gemma2", _spec_change("gemma2", keys={"attention.sliding_window": "sliding_window",
                                                                        "attn_logit_softcapping": "x_attn",
                                                                        "final_logit_softcapping": "x_final"})),
    "gemma2: query scale left to transformers' default": ("gemma2", _spec_change("gemma2", gemma_query_scale=False)),
    "granite: Q/K permutation not undone": ("granite", _spec_change("granite", permuted_qk=False)),
    "granite: multipliers not read": ("granite", _spec_change("granite", keys={
        "attention.scale": "x1", "embedding_scale": "x2", "residual_scale": "x3", "logit_scale": "x4"})),
    "mistral as llama: Q/K permutation not undone": ("mistral", _spec_change("mistral", permuted_qk=False)),
    "olmo2: Q/K 'unpermuted' although llama.cpp wrote them as they are": (
        "olmo2", _spec_change("olmo2", permuted_qk=True)),
    "starcoder2: Q/K 'unpermuted'": ("starcoder2", _spec_change("starcoder2", permuted_qk=True)),
    "starcoder2: activation left at silu": ("starcoder2", _spec_change("starcoder2", fixed={})),
    "phi3: rope.dimension_count not read (full rotary)": ("phi3", _full_rotary),
    "phi3: its window applied although llama.cpp disables it": ("phi3", _spec_change(
        "phi3", keys={"attention.sliding_window": "sliding_window"}, fixed={},
        ignored=("rope.scaling.original_context_length",))),
    "qwen3moe: experts taken in the wrong order": ("qwen3moe", _reverse_experts),
}  # fmt: skip


@pytest.mark.parametrize("label", list(CONTROLS))
def test_each_convention_undone_wrongly_misses(written, monkeypatch, label):
    name, change = CONTROLS[label]
    hf, path = written[name]
    want = _logits(load_checkpoint(hf))
    change(monkeypatch)
    assert relative_error(_logits(load_checkpoint(path)), want) > MISS, label


def _block_count_bomb(path, count: int):
    """A qwen3 GGUF whose metadata declares ``count`` layers (one tensor: the file is tiny), as
    ``gguf-set-metadata --force x.gguf qwen3.block_count N`` leaves one."""
    writer = gguf.GGUFWriter(path, "qwen3")
    writer.add_block_count(count)
    for add, value in ((writer.add_embedding_length, 8), (writer.add_feed_forward_length, 8),
                       (writer.add_head_count, 2), (writer.add_layer_norm_rms_eps, 1e-6)):  # fmt: skip
        add(value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_block_count_of_a_billion_is_refused_in_one_line_naming_the_key_before_any_map(tmp_path, capsys):
    """Issue 44 item 1: the tensor-name map was built for every declared layer before the 4,096-layer bound
    (147 s to a MemoryError for 1e9)."""
    path = _block_count_bomb(tmp_path / "bomb.gguf", 1_000_000_000)
    start = time.perf_counter()
    with pytest.raises(AnelabInputError, match=r"GGUF qwen3\.block_count is 1,000,000,000; the limit is 4,096") as e:
        load_checkpoint(path)
    assert time.perf_counter() - start < 2.0 and "\n" not in str(e.value)
    assert main(["export", str(path), "--out", str(tmp_path / "out"), "--chunk", "8", "--histories", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "qwen3.block_count" in err and "\n" not in err and "Traceback" not in err
    # the control: the same file with 2 layers gets past the bound (refused later for its missing tensors)
    with pytest.raises(AnelabInputError) as fine:
        load_checkpoint(_block_count_bomb(tmp_path / "two.gguf", 2))
    assert "block_count" not in str(fine.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [("attention.head_count", 10**7), ("embedding_length", 10**9), ("attention.key_length", 10**6)],
)
def test_every_size_the_metadata_declares_is_bounded(tmp_path, key, value):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, "qwen3")
    sizes = {"block_count": 2, "embedding_length": 8, "feed_forward_length": 8, "attention.head_count": 2, key: value}
    for k, v in sizes.items():
        writer.add_uint32(f"qwen3.{k}", v)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(AnelabInputError, match=rf"GGUF qwen3\.{key} is {value:,}; the limit"):
        load_checkpoint(path)


def test_phi3s_window_is_not_applied_as_llama_cpp_disables_it_and_a_gemma3_window_of_0_means_none(written):
    """llama.cpp's phi3 loader reads attention.sliding_window and turns SWA off (load_hparams, PR 13676); Gemma 3
    slides only when the file sets a window > 0."""
    assert load_checkpoint(written["phi3"][1]).geometry.sliding_layers == ()
    g = load_checkpoint(written["gemma3"][1]).geometry
    assert (g.sliding_window, g.sliding_layers, g.local_rope_theta) == (4, (0, 1, 2, 3, 4), 10000.0)


@pytest.mark.parametrize(
    ("name", "extra", "tensors", "message"),
    [
        ("gemma3", {"rope.freq_base_swa": 20000.0}, {}, r"gemma3\.rope\.freq_base_swa = 20000\.0 is not modelled"),
        ("gemma3", {"attention.sliding_window_pattern": 4}, {}, r"gemma3\.attention\.sliding_window_pattern = 4"),
        ("granite", {"expert_count": 4}, {}, r"granite\.expert_count > 0: routed experts are modelled for qwen3moe"),
        ("phi3", {}, {"rope_factors_long.weight": np.ones(2, np.float32)}, "rope_factors_long.weight has no place"),
        ("gemma2", {"attention.key_length_swa": 8}, {}, r"gemma2\.attention\.key_length_swa = 8 is not modelled"),
    ],
)
def test_what_an_architecture_does_not_model_is_refused_in_one_line_naming_the_key(
    written, tmp_path, name, extra, tensors, message
):
    arch, config, c, written_extra = CASES[name]
    source = _moe_tensors(c, 0) if arch == "qwen3moe" else _tensors(c, 0)
    path = write_like_llama_cpp(tmp_path / "m.gguf", arch, config, {**source, **tensors}, {**written_extra, **extra})
    with pytest.raises(AnelabInputError, match=message) as refused:
        load_checkpoint(path)
    assert "\n" not in str(refused.value)
