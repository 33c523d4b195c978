"""Every family's whole-model forward against an independent float64 forward, on hand-written checkpoints.

Each case writes a tiny checkpoint with the ``safetensors`` library and a hand-written config.json in
the family's real tensor names and keys (fused ``qkv_proj`` / ``gate_up_proj``, ``c_fc`` / ``c_proj``,
sandwich norms, LayerNorm biases, Gemma 3's ``model.language_model.`` wrapper), never through
anelab's writer. ``independent_forward`` is float64 NumPy written from transformers' modeling files
(docs/conventions.md §9 cites file:line): no cache, no chunks, the whole sequence recomputed for every
decoded token; every convention is a field of ``Conventions`` set by hand per case.

Negative controls switch one convention off **in the code under test** (the family row, the
geometry or the loaded model) and require the same comparison to fail by a wide margin: each
positive match below would break if anelab dropped that convention.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field, replace

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from anelab.arms.arm_runs import Arm, run_arm
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.whole_model import NormSlots, load_model
from anelab.core.decoder import MlpWeights
from anelab.sidecar.checks.comparison import relative_error

PROMPT, CHUNK, DECODE = 11, 4, 4  # 11 tokens in chunks of 4 (the last partial); windows of 4-6 bite in both phases
TOLERANCE = 1e-5  # fp32 forward against float64
CONTROL_MARGIN = 1e-3  # a convention switched off must miss by at least this (100x the tolerance)
HQ, HKV, D_HEAD, VOCAB, INTER = 4, 2, 8, 40, 24


@dataclass
class Conventions:
    """What the independent forward does; each field is one transformers convention (defaults: Llama)."""

    hidden: int = 32
    layers: int = 2
    eps: float = 1e-6
    theta: float = 500.0
    norms: tuple = ("input_layernorm", "post_attention_layernorm", None, None)  # attn-in, mlp-in, attn-out, mlp-out
    one_plus: bool = False  # RMSNorm x * (1 + w)
    layer_norm: bool = False  # LayerNorm with bias
    embed_scale: float = 1.0
    act: str = "silu"  # silu | gelu_tanh
    mlp: str = "gated"  # gated | fused | plain
    mlp_bias: bool = False
    residual: float = 1.0
    logit_divisor: float = 1.0
    final_cap: float | None = None
    tied: bool = False
    scale: float | None = None  # None: head_dim ** -0.5
    attn_cap: float | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    fused_qkv: bool = False
    qk_norm: str | None = None  # head | projection
    rotary: float = 1.0
    interleaved: bool = False
    no_rope: tuple = ()
    windows: dict = field(default_factory=dict)  # layer -> W
    local_theta: float | None = None  # RoPE base of the sliding layers
    rope_ext: tuple | None = None  # longrope: inv_freq / ext, cos and sin x rope_mscale
    rope_mscale: float = 1.0
    prefix: str = "model."


# ---- the independent forward (float64) -------------------------------------------------------------------------
def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _act(c, x):
    return _gelu_tanh(x) if c.act == "gelu_tanh" else x / (1 + np.exp(-x))


def _norm(c, t, name, x):
    w = t[name + ".weight"]
    if c.layer_norm:
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + c.eps) * w + t[name + ".bias"]
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + c.eps)
    return y * (1 + w) if c.one_plus else y * w


def _rope(c, x, layer):
    """x [P, heads, d] at positions 0..P-1; the first rotary dims rotate (halves, or GLM's pairs 2i, 2i+1)."""
    if layer in c.no_rope:
        return x
    theta = c.local_theta if (c.local_theta and layer in c.windows) else c.theta
    rot = int(D_HEAD * c.rotary)
    inv_freq = theta ** (-np.arange(0, rot, 2) / rot) / (np.array(c.rope_ext) if c.rope_ext else 1.0)
    ang = np.arange(x.shape[0])[:, None, None] * inv_freq  # [P, 1, rot/2]
    cos, sin, out = np.cos(ang) * c.rope_mscale, np.sin(ang) * c.rope_mscale, x.copy()
    if c.interleaved:
        a, b = x[..., 0:rot:2], x[..., 1:rot:2]
        out[..., 0:rot:2], out[..., 1:rot:2] = a * cos - b * sin, b * cos + a * sin
    else:
        a, b = x[..., : rot // 2], x[..., rot // 2 : rot]
        out[..., : rot // 2], out[..., rot // 2 : rot] = a * cos - b * sin, b * cos + a * sin
    return out


def _qk(c, t, p, x, name, heads, y):
    if c.qk_norm == "projection":  # OLMo 2: over the whole projection, before the head split
        y = _norm(replace(c, one_plus=False, layer_norm=False), t, f"{p}self_attn.{name}_norm", y)
    y = y.reshape(len(x), heads, D_HEAD)
    if c.qk_norm == "head":  # Gemma 3: per head, (1 + w)
        y = _norm(replace(c, layer_norm=False), t, f"{p}self_attn.{name}_norm", y)
    return y


def _attention(c, t, layer, x):
    """x [P, D] (the attention input) -> o_proj output [P, D]."""
    p = f"{c.prefix}layers.{layer}."
    if c.fused_qkv:  # Phi-3: Q | K | V rows
        w = t[p + "self_attn.qkv_proj.weight"]
        wq, wk, wv = w[: HQ * D_HEAD], w[HQ * D_HEAD : (HQ + HKV) * D_HEAD], w[(HQ + HKV) * D_HEAD :]
    else:
        wq, wk, wv = (t[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
    bias = (lambda n: t[p + f"self_attn.{n}_proj.bias"]) if c.qkv_bias else (lambda n: 0.0)
    q = _rope(c, _qk(c, t, p, x, "q", HQ, x @ wq.T + bias("q")), layer)
    k = _rope(c, _qk(c, t, p, x, "k", HKV, x @ wk.T + bias("k")), layer)
    v = (x @ wv.T + bias("v")).reshape(len(x), HKV, D_HEAD)
    k, v = np.repeat(k, HQ // HKV, axis=1), np.repeat(v, HQ // HKV, axis=1)  # query head h reads KV head h // group
    s = np.einsum("ihd,jhd->hij", q, k) * (c.scale if c.scale is not None else D_HEAD**-0.5)
    if c.attn_cap is not None:
        s = c.attn_cap * np.tanh(s / c.attn_cap)
    i, j = np.arange(len(x))[:, None], np.arange(len(x))[None, :]
    visible = (j <= i) & ((i - j < c.windows[layer]) if layer in c.windows else True)
    s = np.where(visible, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    out = np.einsum("hij,jhd->ihd", w / w.sum(-1, keepdims=True), v).reshape(len(x), HQ * D_HEAD)
    return out @ t[p + "self_attn.o_proj.weight"].T + (t[p + "self_attn.o_proj.bias"] if c.o_bias else 0.0)


def _mlp(c, t, p, x):
    if c.mlp == "plain":  # Starcoder2: c_proj(act(c_fc(x)))
        b = (lambda n: t[p + f"mlp.{n}.bias"]) if c.mlp_bias else (lambda n: 0.0)
        return _act(c, x @ t[p + "mlp.c_fc.weight"].T + b("c_fc")) @ t[p + "mlp.c_proj.weight"].T + b("c_proj")
    if c.mlp == "fused":  # Phi-3 / GLM: gate_up_proj output chunked in two, gate first
        gate, up = np.split(x @ t[p + "mlp.gate_up_proj.weight"].T, 2, axis=-1)
    b = (lambda n: t[p + f"mlp.{n}_proj.bias"]) if c.mlp_bias else (lambda n: 0.0)
    if c.mlp != "fused":
        gate, up = x @ t[p + "mlp.gate_proj.weight"].T + b("gate"), x @ t[p + "mlp.up_proj.weight"].T + b("up")
    return (_act(c, gate) * up) @ t[p + "mlp.down_proj.weight"].T + b("down")


def independent_forward(c: Conventions, t: dict, tokens) -> tuple[np.ndarray, np.ndarray]:
    """-> (hidden after every layer [L, P, D], logits at every position [P, V])."""
    x = t[c.prefix + "embed_tokens.weight"][list(tokens)] * c.embed_scale
    per_layer = []
    for layer in range(c.layers):
        p = f"{c.prefix}layers.{layer}."
        slot = [None if n is None else (lambda y, n=n: _norm(c, t, p + n, y)) for n in c.norms]
        keep = lambda y: y  # noqa: E731
        a = _attention(c, t, layer, (slot[0] or keep)(x))
        x = x + c.residual * (slot[2] or keep)(a)
        m = _mlp(c, t, p, (slot[1] or keep)(x))
        x = x + c.residual * (slot[3] or keep)(m)
        per_layer.append(x)
    head = t[c.prefix + "embed_tokens.weight"] if c.tied else t["lm_head.weight"]
    logits = _norm(c, t, c.prefix + "norm", x) @ head.T / c.logit_divisor
    if c.final_cap is not None:
        logits = c.final_cap * np.tanh(logits / c.final_cap)
    return np.stack(per_layer), logits


def independent_greedy(c, t, prompt, steps):
    seq, logits = list(prompt), []
    for _ in range(steps):
        logits.append(independent_forward(c, t, seq)[1][-1])
        seq.append(int(np.argmax(logits[-1])))
    return np.array(seq[len(prompt) :]), np.stack(logits)


# ---- hand-written checkpoints ------------------------------------------------------------------------------------
def _tensors(c: Conventions, seed: int) -> dict[str, np.ndarray]:
    """Every tensor of the case, named as transformers stores this family."""
    rng = np.random.default_rng(seed)
    n = lambda *shape: rng.standard_normal(shape) * shape[-1] ** -0.5  # noqa: E731
    norm_w = (lambda k: 0.1 * n(k)) if c.one_plus else (lambda k: 1 + 0.1 * n(k))  # zero-centred: stored near 0
    d, p0 = c.hidden, c.prefix
    t = {p0 + "embed_tokens.weight": rng.standard_normal((VOCAB, d)), "lm_head.weight": n(VOCAB, d)}

    def norm(name, k=d):
        t[name + ".weight"] = norm_w(k)
        if c.layer_norm:
            t[name + ".bias"] = 0.2 * n(k)

    norm(p0 + "norm")
    for layer in range(c.layers):
        p = f"{p0}layers.{layer}."
        for name in c.norms:
            if name is not None:
                norm(p + name)
        if c.fused_qkv:
            t[p + "self_attn.qkv_proj.weight"] = n((HQ + 2 * HKV) * D_HEAD, d)
        else:
            for x, heads in (("q", HQ), ("k", HKV), ("v", HKV)):
                t[p + f"self_attn.{x}_proj.weight"] = n(heads * D_HEAD, d)
        t[p + "self_attn.o_proj.weight"] = n(d, HQ * D_HEAD)
        for x, heads in (("q", HQ), ("k", HKV), ("v", HKV)) if c.qkv_bias else ():
            t[p + f"self_attn.{x}_proj.bias"] = 0.3 * n(heads * D_HEAD)
        if c.o_bias:
            t[p + "self_attn.o_proj.bias"] = 0.3 * n(d)
        if c.qk_norm == "head":
            norm(p + "self_attn.q_norm", D_HEAD), norm(p + "self_attn.k_norm", D_HEAD)
        elif c.qk_norm == "projection":
            t[p + "self_attn.q_norm.weight"], t[p + "self_attn.k_norm.weight"] = (
                1 + 0.3 * n(HQ * D_HEAD),
                1 + 0.3 * n(HKV * D_HEAD),
            )
        if c.mlp == "plain":
            t[p + "mlp.c_fc.weight"], t[p + "mlp.c_proj.weight"] = n(INTER, d), n(d, INTER)
            if c.mlp_bias:
                t[p + "mlp.c_fc.bias"], t[p + "mlp.c_proj.bias"] = 0.3 * n(INTER), 0.3 * n(d)
        elif c.mlp == "fused":
            t[p + "mlp.gate_up_proj.weight"], t[p + "mlp.down_proj.weight"] = n(2 * INTER, d), n(d, INTER)
        else:
            for x in ("gate", "up"):
                t[p + f"mlp.{x}_proj.weight"] = n(INTER, d)
            t[p + "mlp.down_proj.weight"] = n(d, INTER)
            for x, width in (("gate", INTER), ("up", INTER), ("down", d)) if c.mlp_bias else ():
                t[p + f"mlp.{x}_proj.bias"] = 0.3 * n(width)
    return {k: np.asarray(v, np.float32) for k, v in t.items()}


def _config(model_type: str, c: Conventions, **keys) -> dict:
    return {
        "model_type": model_type,
        "hidden_size": c.hidden,
        "num_attention_heads": HQ,
        "num_key_value_heads": HKV,
        "head_dim": D_HEAD,
        "num_hidden_layers": c.layers,
        "vocab_size": VOCAB,
        "intermediate_size": INTER,
        "rope_theta": c.theta,
        **keys,
    }


@dataclass
class Case:
    """One family: config.json as written by hand, the conventions, and the controls that must miss."""

    name: str
    config: dict
    conventions: Conventions
    controls: dict = field(default_factory=dict)  # label -> function(model) switching one convention off


def _family(model, **changes):
    model.family = replace(model.family, **changes)


def _geometry(model, **changes):
    model.checkpoint.geometry = replace(model.geometry, **changes)


def _swap_gate_up(model):
    read = model.layer

    def swapped(i):
        w = read(i)
        w.mlp = MlpWeights(w.mlp.up_proj, w.mlp.gate_proj, w.mlp.down_proj, w.mlp.activation)
        return w

    model.layer = swapped


GEMMA_CONTROLS = {  # Gemma 1's conventions, each switched off; Gemma 2 adds its own
    "(1 + w) norms": lambda m: _family(m, zero_centred=False),
    "embedding scale": lambda m: setattr(m, "embedding_multiplier", 1.0),
    "embedding scale in the model dtype": lambda m: setattr(m, "embedding_multiplier", float(np.sqrt(24))),
    "GELU-tanh": lambda m: setattr(m, "activation", "silu"),
}


def _gemma2() -> Case:
    bf16_sqrt = float(np.float32(np.sqrt(24)).astype(ml_dtypes.bfloat16))  # 4.90625, not 4.89898
    c = Conventions(
        hidden=24,
        layers=3,
        norms=(
            "input_layernorm",
            "pre_feedforward_layernorm",
            "post_attention_layernorm",
            "post_feedforward_layernorm",
        ),
        one_plus=True,
        embed_scale=bf16_sqrt,
        act="gelu_tanh",
        final_cap=2.0,
        tied=True,
        scale=64**-0.5,
        attn_cap=1.0,
        windows={0: 4, 2: 4},  # layer_types by default: even layers slide
    )
    config = _config(
        "gemma2",
        c,
        rms_norm_eps=c.eps,
        query_pre_attn_scalar=64,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=2.0,
        sliding_window=4,
        torch_dtype="bfloat16",
    )
    return Case(
        "gemma2",
        config,
        c,
        {
            **GEMMA_CONTROLS,
            "post-branch norms": lambda m: _family(m, norms=NormSlots(mlp="pre_feedforward_layernorm")),
            "final logit soft-cap": lambda m: setattr(m, "logit_softcap", None),
            "attention soft-cap": lambda m: _geometry(m, logit_softcap=None),
            "query_pre_attn_scalar": lambda m: _geometry(m, query_scale=None),
            "sliding windows": lambda m: _geometry(m, sliding_layers=()),
        },
    )


def _gemma3(nested: bool) -> Case:
    c = Conventions(
        hidden=24,
        layers=2,
        norms=(
            "input_layernorm",
            "pre_feedforward_layernorm",
            "post_attention_layernorm",
            "post_feedforward_layernorm",
        ),
        one_plus=True,
        embed_scale=float(np.float32(np.sqrt(24))),  # float32 model: sqrt(24) as a float32
        act="gelu_tanh",
        tied=True,
        scale=64**-0.5,
        qk_norm="head",
        theta=5000.0,
        local_theta=50.0,
        windows={0: 4},
        prefix="model.language_model." if nested else "model.",
    )
    text = _config(
        "gemma3_text",
        c,
        query_pre_attn_scalar=64,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 5000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
        torch_dtype="float32",
    )
    del text["rope_theta"]
    # the wrapper owns lm_head: its tie_word_embeddings decides (modeling_utils.py:2492), not the text config's
    wrapped = {**text, "tie_word_embeddings": False}
    config = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": wrapped}
    config["tie_word_embeddings"] = True
    controls = {
        "q/k norms (1 + w)": lambda m: setattr(
            m.checkpoint, "family", replace(m.checkpoint.family, zero_centred_norm=False)
        ),
        "sliding layers' RoPE base": lambda m: _geometry(m, local_rope_theta=None),
        "sliding windows": lambda m: _geometry(m, sliding_layers=(), local_rope_theta=None),
        "post-branch norms": lambda m: _family(m, norms=NormSlots(mlp="pre_feedforward_layernorm")),
        "embedding scale": lambda m: setattr(m, "embedding_multiplier", 1.0),
    }
    return Case("gemma3" if nested else "gemma3_text", config if nested else text, c, controls)


def _phi3() -> Case:
    c = Conventions(mlp="fused", fused_qkv=True, rotary=0.5, eps=1e-5, windows={0: 5, 1: 5})
    config = _config("phi3", c, partial_rotary_factor=0.5, sliding_window=5, rms_norm_eps=1e-5)
    return Case(
        "phi3",
        config,
        c,
        {
            "fused gate_up_proj, gate first": _swap_gate_up,
            "partial RoPE": lambda m: _geometry(m, partial_rotary_factor=1.0),
            "sliding windows": lambda m: _geometry(m, sliding_layers=()),
        },
    )


def _phi3_longrope() -> Case:
    """Phi-3's long-context RoPE: the prompt (11) is past original_max_position_embeddings (8), so transformers
    rotates every forward with long_factor and cos/sin x sqrt(1 + ln(64 / 8) / ln 8) (modeling_rope_utils.py:560-576)."""
    c = replace(_phi3().conventions, windows={}, rope_ext=(2.0, 5.0), rope_mscale=np.sqrt(1 + np.log(8) / np.log(8)))
    rope = {"type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 5.0]}
    config = _config("phi3", c, partial_rotary_factor=0.5, rms_norm_eps=1e-5, rope_scaling=rope)
    config.update(original_max_position_embeddings=8, max_position_embeddings=64)
    controls = {"long factors and attention factor": lambda m: _geometry(m, rope_scaling=None)}
    return Case("phi3-longrope", config, c, controls)


def _starcoder2() -> Case:
    c = Conventions(
        layer_norm=True, mlp="plain", mlp_bias=True, act="gelu_tanh", qkv_bias=True, o_bias=True, tied=True,
        eps=1e-5, windows={0: 6, 1: 6},
    )  # fmt: skip
    config = _config("starcoder2", c, sliding_window=6)  # use_bias, norm_epsilon, tie_word_embeddings: defaults
    return Case(
        "starcoder2",
        config,
        c,
        {
            "LayerNorm": lambda m: _family(m, norm_kind="rms"),
            "MLP biases": lambda m: setattr(m, "mlp_bias", False),
            "GELU-tanh": lambda m: setattr(m, "activation", "silu"),
            "tied embeddings by default": lambda m: setattr(m, "tied", False),
            "sliding windows": lambda m: _geometry(m, sliding_layers=()),
        },
    )


def _granite() -> Case:
    c = Conventions(embed_scale=3.0, residual=0.5, logit_divisor=4.0, scale=0.9, mlp_bias=True)
    config = _config(
        "granite",
        c,
        embedding_multiplier=3.0,
        residual_multiplier=0.5,
        logits_scaling=4.0,
        attention_multiplier=0.9,
        mlp_bias=True,
    )
    return Case(
        "granite",
        config,
        c,
        {
            "embedding_multiplier": lambda m: setattr(m, "embedding_multiplier", 1.0),
            "residual_multiplier": lambda m: setattr(m, "residual_multiplier", 1.0),
            "logits_scaling": lambda m: setattr(m, "logit_divisor", 1.0),
            "attention_multiplier": lambda m: _geometry(m, query_scale=None),
            "MLP biases (mlp_bias)": lambda m: setattr(m, "mlp_bias", False),
        },
    )


def _olmo2() -> Case:
    c = Conventions(norms=(None, None, "post_attention_layernorm", "post_feedforward_layernorm"), qk_norm="projection")
    config = _config("olmo2", c, rms_norm_eps=1e-6)
    return Case(
        "olmo2",
        config,
        c,
        {
            "post-branch norms": lambda m: _family(m, norms=NormSlots(input=None, mlp=None)),
            "q/k norm over the projection": lambda m: _geometry(m, qk_norm=None),
        },
    )


def _smollm3() -> Case:
    c = Conventions(layers=3, tied=True, no_rope=(1,), windows={1: 4})
    config = _config("smollm3", c, no_rope_layers=[1, 0, 1], use_sliding_window=True, sliding_window=4)
    return Case(
        "smollm3",
        config,
        c,
        {
            "no-RoPE layers": lambda m: _geometry(m, no_rope_layers=()),
            "their sliding window": lambda m: _geometry(m, sliding_layers=()),
        },
    )


def _windowed(model_type: str, windows: dict, layers: int = 2, **keys) -> Case:
    """Llama-layer families whose sliding window the run reaches (prefill and decode)."""
    c = Conventions(layers=layers, windows=windows, qkv_bias=model_type == "qwen2")
    c = replace(c, qk_norm="head") if model_type == "qwen3" else c
    return Case(
        model_type, _config(model_type, c, **keys), c, {"sliding windows": lambda m: _geometry(m, sliding_layers=())}
    )


def _glm(model_type: str) -> Case:
    norms = ("input_layernorm", "post_attention_layernorm")
    norms += ("post_self_attn_layernorm", "post_mlp_layernorm") if model_type == "glm4" else (None, None)
    c = Conventions(norms=norms, mlp="fused", rotary=0.5, interleaved=True, qkv_bias=True)
    config = _config(model_type, c, partial_rotary_factor=0.5, rms_norm_eps=1e-6)  # attention_bias: default true
    controls = {
        "fused gate_up_proj, gate first": _swap_gate_up,
        "interleaved RoPE pairs": lambda m: _geometry(m, rope_layout="half"),
    }
    if model_type == "glm4":
        controls["post-branch norms"] = lambda m: _family(m, norms=NormSlots())
    return Case(model_type, config, c, controls)


def _gemma() -> Case:
    bf16_sqrt = float(np.float32(np.sqrt(24)).astype(ml_dtypes.bfloat16))
    c = Conventions(hidden=24, one_plus=True, embed_scale=bf16_sqrt, act="gelu_tanh", tied=True)
    config = _config("gemma", c, hidden_act="gelu", torch_dtype="bfloat16")  # legacy "gelu" means the tanh form
    return Case(
        "gemma",
        config,
        c,
        {
            **GEMMA_CONTROLS,
        },
    )


CASES = [
    _gemma2(),
    _gemma3(nested=False),
    _gemma3(nested=True),
    _phi3(),
    _phi3_longrope(),
    _starcoder2(),
    _granite(),
    _olmo2(),
    _smollm3(),
    _windowed("ministral", {0: 4}, layer_types=["sliding_attention", "full_attention"], sliding_window=4),
    _windowed("mistral", {0: 5, 1: 5}, sliding_window=5),
    _windowed("qwen2", {1: 4}, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    _windowed("qwen3", {1: 4}, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    _glm("glm"),
    _glm("glm4"),
    _gemma(),
]


def _write(path, case: Case, seed: int) -> dict:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(case.config))
    tensors = _tensors(case.conventions, seed)
    save_file(tensors, str(path / "model.safetensors"))
    return {k: v.astype(np.float64) for k, v in tensors.items()}


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def family(request, tmp_path_factory):
    case = request.param
    path = tmp_path_factory.mktemp("families") / case.name
    t = _write(path, case, seed=len(case.name))
    prompt = np.random.default_rng(5).integers(0, VOCAB, PROMPT)
    hidden, _ = independent_forward(case.conventions, t, prompt)
    tokens, logits = independent_greedy(case.conventions, t, prompt, DECODE)
    return case, path, prompt, hidden, tokens, logits


def _miss(run, hidden, logits) -> float:
    """The largest relative difference over every layer's hidden state and the logits of every step run."""
    layers = [relative_error(run.hidden[i], hidden[i]) for i in range(hidden.shape[0])]
    return max(layers + [relative_error(run.logits, logits[: run.logits.shape[0]])])


def test_family_matches_the_independent_forward(family):
    case, path, prompt, hidden, tokens, logits = family
    run = run_arm(load_model(path), prompt, Arm("reference"), decode=DECODE, chunk=CHUNK)
    assert _miss(run, hidden, logits) < TOLERANCE
    assert run.tokens.tolist() == tokens.tolist()


def test_each_convention_switched_off_misses(family):
    """Negative controls: with one convention switched off in the code under test, the comparison above fails."""
    case, path, prompt, hidden, _, logits = family
    assert case.controls, f"{case.name} declares no convention to switch off"
    for label, switch_off in case.controls.items():
        model = load_model(path)
        switch_off(model)
        run = run_arm(model, prompt, Arm("reference"), decode=1, chunk=CHUNK)
        assert _miss(run, hidden, logits) > CONTROL_MARGIN, f"{case.name}: switching off {label} went unnoticed"


def test_every_whole_model_family_is_checked_here_or_in_test_decoder():
    """A row added to DECODER_FAMILIES without a case against the independent forward fails here."""
    from anelab.checkpoints.whole_model import DECODER_FAMILIES

    checked = {case.name for case in CASES} | {
        "llama",
        "qwen2",
        "qwen3_moe",
    }  # the last three: tests/core/test_decoder.py
    assert set(DECODER_FAMILIES) <= checked, sorted(set(DECODER_FAMILIES) - checked)


def test_list_families_says_what_compare_arms_runs_or_why_not(capsys):
    from anelab.checkpoints.config import MODEL_FAMILIES
    from anelab.checkpoints.whole_model import DECODER_FAMILIES
    from anelab.cli import main

    assert main(["export", "--list-families", "--json"]) == 0
    rows = {r["model_type"]: r["whole_model"] for r in json.loads(capsys.readouterr().out)["families"]}
    assert set(rows) == set(MODEL_FAMILIES)
    for model_type, line in rows.items():
        if model_type in DECODER_FAMILIES:
            assert line.startswith("runs"), model_type
        else:
            assert line.startswith("refused: ") and "linear-attention" in line and MODEL_FAMILIES[model_type].hybrid
    assert "final_logit_softcapping" in rows["gemma2"] and "c_fc/c_proj" in rows["starcoder2"]
    assert main(["export", "--list-families"]) == 0
    assert "whole model (compare-arms): refused: its linear-attention" in capsys.readouterr().out


@pytest.mark.parametrize(
    "case, change, message",
    [
        (_gemma3(nested=True), {"final_logit_softcapping": 5.0}, "final_logit_softcapping=5.0: gemma3 does not apply"),
        (_granite(), {"num_experts": 4}, "num_experts: routed experts are modelled for qwen3_moe only"),
        (_gemma2(), {"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not modelled"),
        (_starcoder2(), {"hidden_act": "relu"}, "hidden_act 'relu' is not modelled"),
        (_starcoder2(), {"hidden_act": [None]}, "hidden_act must be an activation name, got [None]"),
        (_granite(), {"tie_word_embeddings": "false"}, "'tie_word_embeddings' must be true or false, got 'false'"),
        (_granite(), {"attention_bias": 0}, "'attention_bias' must be true or false, got 0"),
        (
            _gemma2(),
            {"torch_dtype": ["bfloat16"]},
            "'torch_dtype' must be a dtype name such as \"bfloat16\", got ['bfloat16']",
        ),
    ],
    ids=[
        "gemma3-ignored-softcap",
        "granite-experts",
        "gemma2-exact-gelu",
        "starcoder2-relu",
        "activation-list",
        "tie-as-string",
        "bias-as-number",
        "dtype-as-list",
    ],  # fmt: skip
)
def test_unmodelled_options_are_refused_in_one_line(tmp_path, case, change, message):
    from anelab.core.errors import AnelabInputError

    _write(tmp_path / "m", case, seed=0)
    config = json.loads(json.dumps(case.config))
    (config.get("text_config") or config).update(change)  # Gemma3TextConfig holds the cap; the wrapper ignores it
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(AnelabInputError, match=re.escape(message)) as e:
        load_model(tmp_path / "m")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["gemma3_text", "olmo2", "phi3-longrope"])
def test_sidecar_arm_serves_the_family_within_fp16_noise(tmp_path, monkeypatch, name):
    """The saved packages (NumPy evaluation) in the whole model: Gemma 3's windows, local RoPE base and sandwich
    norms around the sidecar; OLMo 2's raw residual rows into it and its post-norm after it; Phi-3's long-context
    table (coverage 12 > 8). Controls: the window dropped from the arms' masks makes the sidecar arm miss the
    reference from the sliding layer on; packages whose coverage picks another RoPE table than the prompt's refused."""
    from anelab.arms import sidecars as arms
    from anelab.arms.arm_comparison import NOISE, compare_runs
    from anelab.arms.sidecars import open_sidecars
    from anelab.core.errors import AnelabInputError
    from anelab.sidecar.export import export_sidecars

    case = next(c for c in CASES if c.name == name)
    _write(tmp_path / "m", case, seed=len(name))
    export_sidecars(load_checkpoint(tmp_path / "m"), tmp_path / "sidecars", CHUNK, [0, CHUNK, 2 * CHUNK])
    model = load_model(tmp_path / "m")
    prompt = np.random.default_rng(5).integers(0, VOCAB, PROMPT)
    reference = run_arm(model, prompt, Arm("reference"), decode=DECODE, chunk=CHUNK)
    sidecars = open_sidecars(tmp_path / "sidecars", model, PROMPT)
    sidecar = compare_runs(
        reference, run_arm(model, prompt, Arm("sidecar", "sidecar"), decode=DECODE, sidecars=sidecars)
    )
    assert max(sidecar.layer_diffs) < NOISE and sidecar.prompt_logits_diff < NOISE
    assert sidecar.greedy_agreement == 1.0
    if model.geometry.rope_depends_on_coverage:
        with pytest.raises(AnelabInputError, match="picks another longrope RoPE table"):
            open_sidecars(tmp_path / "sidecars", model, 6)  # short factors for 6 tokens; the packages hold long
        read = arms.read_sidecar_metadata  # packages without tensor digests: h0 checked against the prompt's table
        monkeypatch.setattr(arms, "read_sidecar_metadata", lambda path: replace(read(path), source_tensors=None))
        assert open_sidecars(tmp_path / "sidecars", model, PROMPT).packages
    if model.geometry.sliding_layers:
        _geometry(model, sliding_layers=(), local_rope_theta=model.geometry.local_rope_theta)
        unwindowed = run_arm(model, prompt, Arm("sidecar", "sidecar"), decode=DECODE, sidecars=sidecars)
        assert compare_runs(reference, unwindowed).first_divergent_layer == min(case.conventions.windows)


def test_compare_arms_runs_a_family_and_refuses_a_hybrid_with_the_listed_reason(tmp_path, tiny_checkpoint, capsys):
    from anelab.checkpoints.whole_model import whole_model_support
    from anelab.cli import main

    _write(tmp_path / "gemma2", CASES[0], seed=0)
    argv = ["--prompt-tokens", str(PROMPT), "--decode", "2", "--chunk", str(CHUNK), "--json"]
    assert main(["compare-arms", str(tmp_path / "gemma2"), *argv]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]["reference"]) == 2
    reason = whole_model_support("qwen3_next").removeprefix("refused: ")
    assert main(["compare-arms", str(tiny_checkpoint("qwen3_next")), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and reason in err
    shutil.copytree(tiny_checkpoint("qwen3_next"), tmp_path / "future")  # an unlisted qwen3* hybrid model_type
    config = json.loads((tmp_path / "future" / "config.json").read_text())
    (tmp_path / "future" / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_future"}))
    assert main(["compare-arms", str(tmp_path / "future"), *argv]) == 2
    assert reason in capsys.readouterr().err


def test_indexer_arms_sparsify_full_layers_and_sliding_layers_keep_their_window(tmp_path):
    """Mistral (every layer slides): folded == causal-only bit for bit. Gemma 2 (layer 1 full): the two arms part
    at layer 1, the first full-attention layer, not before."""
    from anelab.arms.arm_comparison import compare_runs
    from anelab.arms.arm_runs import Indexer

    prompt = np.random.default_rng(5).integers(0, VOCAB, 30)
    for case, first in ((next(c for c in CASES if c.name == "mistral"), None), (CASES[0], 1)):
        _write(tmp_path / case.name, case, seed=1)
        model = load_model(tmp_path / case.name)
        runs = [
            run_arm(model, prompt, Arm(name, "reference", Indexer(1, 4), fold=fold), decode=2, chunk=8)
            for name, fold in (("folded", True), ("causal-only", False))
        ]
        pair = compare_runs(*runs)
        assert pair.first_divergent_layer == first, case.name
        if first is None:
            assert np.array_equal(runs[0].hidden, runs[1].hidden)


def test_a_run_across_a_rope_table_switch_is_refused(tmp_path):
    """longrope: a 6-token prompt (short factors) whose decode reaches position 8 (long factors in transformers) is
    refused in one line; the 11-token prompt above (long factors throughout) runs."""
    from anelab.core.errors import AnelabInputError

    _write(tmp_path / "m", _phi3_longrope(), seed=0)
    model = load_model(tmp_path / "m")
    run_arm(model, np.arange(6), Arm("reference"), decode=3, chunk=CHUNK)  # positions up to 7: short throughout
    with pytest.raises(AnelabInputError, match="switches RoPE tables") as e:
        run_arm(model, np.arange(6), Arm("reference"), decode=4, chunk=CHUNK)
    assert "\n" not in str(e.value)
