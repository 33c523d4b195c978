"""The whole-model reference arm against an independent forward written here, on hand-written checkpoints.

Each checkpoint is written with the ``safetensors`` library and a hand-written config.json, in
transformers' on-disk names (not through anelab's writer). The independent forward below is plain
float64 loops: per-token, per-head attention over every earlier position (no cache, no chunks), the
whole prompt recomputed for every decoded token. Configs: Llama with tied embeddings (and a junk
``lm_head.weight`` that tying must ignore), Qwen3-MoE with routed experts (top-k renormalised, one
MLP-only layer) and an untied head, Qwen2 with q/k/v biases.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from anelab.arms.arm_runs import Arm, run_arm
from anelab.checkpoints.whole_model import load_model
from anelab.core.decoder import MoeWeights, route
from anelab.core.errors import AnelabInputError
from anelab.sidecar.checks.comparison import relative_error

PROMPT, CHUNK, DECODE = 11, 4, 4  # 11 tokens in chunks of 4: the last chunk is partial


def _write(path, config: dict, tensors: dict) -> None:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(
        {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}, str(path / "model.safetensors")
    )


def _tiny_model(path, kind: str, sparse_step: int = 1) -> dict:
    """Write a tiny checkpoint; returns the spec the independent forward reads (float64 tensors + options).
    Qwen3-MoE: ``sparse_step`` 1 routes every layer but the MLP-only layer 1; a larger step routes layer L
    iff (L + 1) % step == 0 and lists no MLP-only layer (transformers' rule, below)."""
    rng = np.random.default_rng({"llama": 1, "qwen3_moe": 2, "qwen2": 3}[kind])
    hidden, vocab, inter = 16, 24, 20
    heads, kv, d, layers = {"llama": (4, 2, 4, 2), "qwen3_moe": (2, 1, 8, 3), "qwen2": (4, 4, 4, 2)}[kind]
    n = lambda *shape: rng.standard_normal(shape) * shape[-1] ** -0.5  # noqa: E731
    t = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden)), "model.norm.weight": 1 + 0.1 * n(hidden)}
    tied = kind == "llama"
    t["lm_head.weight"] = n(vocab, hidden)  # junk when tied: tying must ignore it
    config = {
        "model_type": kind,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": d,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "intermediate_size": inter,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500.0,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
    }
    if kind == "qwen3_moe":
        config.update(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=12)
        config.update(mlp_only_layers=[1] if sparse_step == 1 else [], decoder_sparse_step=sparse_step)
    for L in range(layers):
        p = f"model.layers.{L}."
        t[p + "input_layernorm.weight"] = 1 + 0.1 * n(hidden)
        t[p + "post_attention_layernorm.weight"] = 1 + 0.1 * n(hidden)
        t[p + "self_attn.q_proj.weight"] = n(heads * d, hidden)
        t[p + "self_attn.k_proj.weight"] = n(kv * d, hidden)
        t[p + "self_attn.v_proj.weight"] = n(kv * d, hidden)
        t[p + "self_attn.o_proj.weight"] = n(hidden, heads * d)
        if kind == "qwen3_moe":
            t[p + "self_attn.q_norm.weight"] = 1 + 0.1 * n(d)
            t[p + "self_attn.k_norm.weight"] = 1 + 0.1 * n(d)
        if kind == "qwen2":
            for x, width in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
                t[p + f"self_attn.{x}_proj.bias"] = 0.3 * n(width)
        routed = L != 1 if sparse_step == 1 else (L + 1) % sparse_step == 0
        experts = [f"mlp.experts.{e}." for e in range(4)] if kind == "qwen3_moe" and routed else ["mlp."]
        width = 12 if len(experts) > 1 else inter
        if len(experts) > 1:
            t[p + "mlp.gate.weight"] = n(4, hidden)
        for e in experts:
            t[p + e + "gate_proj.weight"] = n(width, hidden)
            t[p + e + "up_proj.weight"] = n(width, hidden)
            t[p + e + "down_proj.weight"] = n(hidden, width)
    _write(path, config, t)
    stored = {k: np.asarray(v, np.float32).astype(np.float64) for k, v in t.items()}
    return {"t": stored, "cfg": config, "tied": tied, "norm_topk_prob": True}


# ---- the independent forward (float64, loops, whole prompt recomputed) -----------------------------------------
def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x) + eps) * w


def _rope(x, pos, theta):
    """x [heads, d] at one position: rotate_half pairs dim i with i + d/2."""
    d = x.shape[-1]
    ang = pos * theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(np.r_[ang, ang]), np.sin(np.r_[ang, ang])
    return x * cos + np.concatenate([-x[:, d // 2 :], x[:, : d // 2]], axis=1) * sin


def _silu(x):
    return x / (1 + np.exp(-x))


def _swiglu(t, p, x):
    return t[p + "down_proj.weight"] @ (_silu(t[p + "gate_proj.weight"] @ x) * (t[p + "up_proj.weight"] @ x))


def _mlp(spec, L, x):
    t, cfg = spec["t"], spec["cfg"]
    p = f"model.layers.{L}.mlp."
    if p + "gate.weight" not in t:
        return _swiglu(t, p, x)
    logits = t[p + "gate.weight"] @ x
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    top = sorted(range(len(probs)), key=lambda e: -probs[e])[: cfg["num_experts_per_tok"]]
    weights = [probs[e] for e in top]
    if spec["norm_topk_prob"]:
        weights = [w / sum(weights) for w in weights]
    return sum(w * _swiglu(t, f"{p}experts.{e}.", x) for e, w in zip(top, weights, strict=True))


def _project(spec, L, x, name, heads, pos):
    t, cfg = spec["t"], spec["cfg"]
    p = f"model.layers.{L}.self_attn."
    y = t[p + f"{name}_proj.weight"] @ x + t.get(p + f"{name}_proj.bias", 0.0)
    y = y.reshape(heads, cfg["head_dim"])
    if name in "qk" and p + f"{name}_norm.weight" in t:
        y = np.stack([_rms(row, t[p + f"{name}_norm.weight"], cfg["rms_norm_eps"]) for row in y])
    return _rope(y, pos, cfg["rope_theta"]) if name in "qk" else y


def _attention(spec, L, xs):
    cfg, t = spec["cfg"], spec["t"]
    H, KV, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q = [_project(spec, L, x, "q", H, i) for i, x in enumerate(xs)]
    k = [_project(spec, L, x, "k", KV, i) for i, x in enumerate(xs)]
    v = [_project(spec, L, x, "v", KV, i) for i, x in enumerate(xs)]
    outs = []
    for i in range(len(xs)):
        heads = []
        for h in range(H):
            g = h // (H // KV)
            s = np.array([q[i][h] @ k[j][g] / np.sqrt(d) for j in range(i + 1)])
            w = np.exp(s - s.max())
            w /= w.sum()
            heads.append(sum(w[j] * v[j][g] for j in range(i + 1)))
        outs.append(t[f"model.layers.{L}.self_attn.o_proj.weight"] @ np.concatenate(heads))
    return outs


def independent_forward(spec, tokens):
    """-> (hidden after every layer [L, P, D], logits at every position [P, V])."""
    t, cfg = spec["t"], spec["cfg"]
    eps = cfg["rms_norm_eps"]
    h = [t["model.embed_tokens.weight"][tok].copy() for tok in tokens]
    per_layer = []
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        attn = _attention(spec, L, [_rms(x, t[p + "input_layernorm.weight"], eps) for x in h])
        h = [x + a for x, a in zip(h, attn, strict=True)]
        h = [x + _mlp(spec, L, _rms(x, t[p + "post_attention_layernorm.weight"], eps)) for x in h]
        per_layer.append(np.stack(h))
    head = t["model.embed_tokens.weight"] if spec["tied"] else t["lm_head.weight"]
    logits = np.stack([head @ _rms(x, t["model.norm.weight"], eps) for x in h])
    return np.stack(per_layer), logits


def independent_greedy(spec, prompt, steps):
    """Greedy continuation by recomputing the whole sequence for every token: (tokens [N], logits [N, V])."""
    seq, logits = list(prompt), []
    for _ in range(steps):
        last = independent_forward(spec, seq)[1][-1]
        logits.append(last)
        seq.append(int(np.argmax(last)))
    return np.array(seq[len(prompt) :]), np.stack(logits)


@pytest.fixture(scope="module", params=["llama", "qwen3_moe", "qwen2"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("decoder") / request.param
    spec = _tiny_model(path, request.param)
    prompt = np.random.default_rng(7).integers(0, spec["cfg"]["vocab_size"], PROMPT)
    return path, spec, prompt


def test_reference_arm_matches_the_independent_forward(tiny):
    path, spec, prompt = tiny
    run = run_arm(load_model(path), prompt, Arm("reference"), decode=DECODE, chunk=CHUNK)
    hidden, _ = independent_forward(spec, prompt)
    tokens, logits = independent_greedy(spec, prompt, DECODE)
    for L in range(hidden.shape[0]):
        assert relative_error(run.hidden[L], hidden[L]) < 1e-5, f"layer {L}"
    assert relative_error(run.logits, logits) < 1e-5
    assert run.tokens.tolist() == tokens.tolist()


def test_independent_forward_catches_a_wrong_convention(tiny):
    """Negative control: flipping one convention in the independent forward (routing renormalisation for
    MoE, the tied head for Llama, the q/k/v biases for Qwen2) moves it well past the tolerance above."""
    path, spec, prompt = tiny
    run = run_arm(load_model(path), prompt, Arm("reference"), decode=1, chunk=CHUNK)
    kind = spec["cfg"]["model_type"]
    wrong = dict(spec, t=dict(spec["t"]))
    if kind == "qwen3_moe":
        wrong["norm_topk_prob"] = False
    elif kind == "llama":
        wrong["tied"] = False
    else:
        wrong["t"] = {k: v for k, v in spec["t"].items() if not k.endswith("bias")}
    _, logits = independent_forward(wrong, prompt)
    assert relative_error(run.logits[0], logits[-1]) > 1e-2


def test_moe_router_is_softmax_then_top_k_renormalised():
    x = np.array([[1.0, 0.0], [0.0, 2.0]], np.float32)
    router = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]], np.float32)  # logits row 0: 1, 0, .5
    moe = MoeWeights(router, [], top_k=2, norm_topk_prob=False)
    experts, weights = route(x, moe)
    p = np.exp([1.0, 0.0, 0.5]) / np.exp([1.0, 0.0, 0.5]).sum()
    assert experts[0].tolist() == [0, 2] and np.allclose(weights[0], [p[0], p[2]])
    experts, weights = route(x, MoeWeights(router, [], top_k=2, norm_topk_prob=True))
    assert np.allclose(weights[0], [p[0] / (p[0] + p[2]), p[2] / (p[0] + p[2])])
    assert np.allclose(weights.sum(axis=1), 1.0)


def test_unmodelled_models_are_refused_in_one_line(tmp_path, tiny_checkpoint):
    with pytest.raises(AnelabInputError, match="linear-attention") as e:
        load_model(tiny_checkpoint("qwen3_next"))
    assert "\n" not in str(e.value)
    spec = _tiny_model(tmp_path / "m", "llama")
    config = dict(spec["cfg"])
    for change, message in (
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_experts": 4}, "num_experts"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ):
        (tmp_path / "m" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(AnelabInputError, match=message):
            load_model(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    (tmp_path / "m" / "model.safetensors").unlink()
    save_file({k: v.astype(np.float32) for k, v in spec["t"].items() if k != "lm_head.weight"},
              str(tmp_path / "m" / "model.safetensors"))  # fmt: skip
    with pytest.raises(AnelabInputError, match="lm_head.weight is missing"):
        load_model(tmp_path / "m").head()


def test_the_whole_model_writer_round_trips_a_moe_model(tmp_path):
    """anelab's writer (used for the embedded dense sibling) in transformers' names, MoE and MLP-only layers."""
    from anelab.checkpoints.whole_model import write_model_checkpoint
    from anelab.core.decoder import random_head_weights, random_layer_weights
    from anelab.core.geometry import AttentionGeometry
    from anelab.core.weights import random_attention_weights

    g = AttentionGeometry("qwen3", 16, 2, 1, 8, num_layers=2, full_attention_layers=(0, 1))
    layers = {0: random_layer_weights(0, 16, 12, 0, experts=4, top_k=2, norm_topk_prob=True)}
    layers[1] = random_layer_weights(1, 16, 20, 0)
    head = random_head_weights(24, 16, 0, tied=True)
    attention = {i: random_attention_weights(g, i, 0) for i in (0, 1)}
    path = write_model_checkpoint(tmp_path / "moe", g, attention, layers, head, model_type="qwen3_moe")
    model = load_model(path)
    assert (model.experts, model.top_k, model.norm_topk_prob, model.mlp_only_layers) == (4, 2, True, (1,))
    assert model.tied and not model.checkpoint.has_tensor("lm_head.weight")
    read = model.layer(0).mlp
    assert isinstance(read, MoeWeights) and np.array_equal(read.router, layers[0].mlp.router)
    assert np.array_equal(read.experts[3].down_proj, layers[0].mlp.experts[3].down_proj)
    assert np.array_equal(model.layer(1).mlp.gate_proj, layers[1].mlp.gate_proj)
    with pytest.raises(AnelabInputError, match="no routed experts"):
        write_model_checkpoint(tmp_path / "bad", g, attention, layers, head, model_type="qwen3")


def test_qwen3_moe_with_a_sparse_step_routes_every_other_layer(tmp_path):
    """``decoder_sparse_step`` 2 (every config above uses 1): layer L routes to experts iff it is not
    MLP-only and (L + 1) % 2 == 0 (transformers ``models/qwen3_moe/modeling_qwen3_moe.py``,
    ``Qwen3MoeDecoderLayer.__init__``), so of three layers only layer 1 does. The reference arm matches the
    independent forward, which reads each layer's MLP from the tensors alone. Negative control: the same
    checkpoint declared with step 1 asks layer 0 for experts it does not have, and is refused."""
    spec = _tiny_model(tmp_path / "moe-step2", "qwen3_moe", sparse_step=2)
    model = load_model(tmp_path / "moe-step2")
    assert model.sparse_step == 2 and [model.is_moe_layer(L) for L in range(3)] == [False, True, False]
    assert [isinstance(model.layer(L).mlp, MoeWeights) for L in range(3)] == [False, True, False]
    prompt = np.random.default_rng(7).integers(0, spec["cfg"]["vocab_size"], PROMPT)
    run = run_arm(model, prompt, Arm("reference"), decode=2, chunk=CHUNK)
    hidden, _ = independent_forward(spec, prompt)
    assert max(relative_error(run.hidden[L], hidden[L]) for L in range(3)) < 1e-5
    config = tmp_path / "moe-step2" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "decoder_sparse_step": 1}))
    with pytest.raises(AnelabInputError):
        load_model(tmp_path / "moe-step2").layer(0)
