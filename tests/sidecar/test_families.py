"""Every supported family and RoPE type, from a checkpoint in its real config.json / tensor layout:
exported, evaluated from disk through h0 and h<C> (cache threaded), verified against the reference
— and one negative control per convention (the convention switched off in the reference must
miss the package by more than the threshold)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.config import geometry_from_config
from anelab.checkpoints.safetensors_io import write_safetensors
from anelab.core.errors import AnelabInputError
from anelab.core.masks import causal
from anelab.sidecar.checks.comparison import (
    RELATIVE_ERROR_THRESHOLD,
    load_matching_checkpoint,
    random_function_inputs,
    relative_error,
    run_package,
    run_reference,
)
from anelab.sidecar.checks.verify import verify_package
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.format import read_sidecar_metadata
from anelab.sidecar.mil.evaluate import SavedPackage

CHUNK = 4
HISTORIES = [0, CHUNK]
WINDOW = 3  # < CHUNK: the window bites inside h0 already


@dataclass
class Family:
    """A tiny model of one family: config.json keys, how its tensors are laid out, the layer to export."""

    name: str
    config: dict
    layer: int = 0
    head_dim: int = 8
    qkv_bias: bool = False
    o_bias: bool = False
    norm: str = "none"  # none | per_head | projection
    zero_centred: bool = False  # norm weights stored as w, applied as 1 + w
    fused_qkv: bool = False
    prefix: str = "model."
    nested: str | None = None  # outer model_type wrapping config in text_config
    controls: dict = field(default_factory=dict)  # name -> geometry/weights change that must miss


H, HQ, HKV = 32, 4, 2


def _base(model_type: str, layers: int = 2, **extra) -> dict:
    return {
        "model_type": model_type,
        "hidden_size": H,
        "num_attention_heads": HQ,
        "num_key_value_heads": HKV,
        "num_hidden_layers": layers,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "float32",
        **extra,
    }


def _rope_changed(g, **changes):
    return replace(g, rope_scaling=replace(g.rope_scaling, **changes))


FAMILIES = [
    Family("llama", _base("llama", attention_bias=True), qkv_bias=True, o_bias=True),
    Family(
        "llama-rope-llama3",
        _base(
            "llama",
            rope_theta=100.0,
            max_position_embeddings=256,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        controls={"factor 1": lambda g, w: (_rope_changed(g, factor=1.0), w)},
    ),
    Family(
        "llama-rope-linear",
        _base("llama", rope_theta=100.0, rope_scaling={"type": "linear", "factor": 4.0}),
        controls={"factor 1": lambda g, w: (replace(g, rope_scaling=None), w)},
    ),
    Family(
        "llama-rope-dynamic",  # coverage 8 > max_position_embeddings 4: the NTK-scaled base
        _base(
            "llama", rope_theta=100.0, max_position_embeddings=4, rope_scaling={"rope_type": "dynamic", "factor": 4.0}
        ),
        controls={"plain table": lambda g, w: (replace(g, rope_scaling=None), w)},
    ),
    Family(
        "llama-rope-yarn",
        _base(
            "llama",
            rope_theta=100.0,
            max_position_embeddings=64,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        ),
        controls={"attention factor 1": lambda g, w: (_rope_changed(g, attention_factor=1.0), w)},
    ),
    Family(
        "phi3-longrope",  # fused qkv, partial rotary 0.5, long factors (coverage 8 > original 4)
        _base(
            "phi3",
            head_dim=16,
            partial_rotary_factor=0.5,
            rope_theta=100.0,
            max_position_embeddings=64,
            original_max_position_embeddings=4,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0, 1.0, 1.0, 1.0],
                "long_factor": [1.0, 3.0, 9.0, 27.0],
            },
        ),
        head_dim=16,
        fused_qkv=True,
        controls={"short factors": lambda g, w: (_rope_changed(g, long_factor=g.rope_scaling.short_factor), w)},
    ),
    Family(
        "mistral-window",
        _base("mistral", sliding_window=WINDOW),
        controls={"window off": "window"},
    ),
    Family(
        "ministral-window",
        _base("ministral", head_dim=8, sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention"]),
        layer=1,
        controls={"window off": "window"},
    ),
    Family(
        "qwen2-window",  # max_window_layers 1: layer 1 slides; q/k/v biases, no o bias
        _base("qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        layer=1,
        qkv_bias=True,
        controls={"window off": "window"},
    ),
    Family(
        "qwen3_moe-window",  # no max_window_layers: every layer slides
        _base("qwen3_moe", head_dim=8, use_sliding_window=True, sliding_window=WINDOW),
        norm="per_head",
        controls={"window off": "window"},
    ),
    Family("gemma", _base("gemma", head_dim=8), controls={}),
    Family(
        "gemma2",  # layer 0 slides; scale query_pre_attn_scalar ** -0.5; soft-capped logits
        _base("gemma2", head_dim=8, query_pre_attn_scalar=32, attn_logit_softcapping=0.5, sliding_window=WINDOW),
        controls={
            "softcap off": lambda g, w: (replace(g, logit_softcap=None), w),
            "scale head_dim**-0.5": lambda g, w: (replace(g, query_scale=None), w),
            "window off": "window",
        },
    ),
    Family(
        "gemma3_text",  # layer 0 is local: its own RoPE base; zero-centred per-head q/k norms
        _base(
            "gemma3_text",
            head_dim=8,
            query_pre_attn_scalar=32,
            sliding_window=WINDOW,
            sliding_window_pattern=2,
            rope_theta=1e6,
            rope_local_base_freq=10.0,
        ),
        norm="per_head",
        zero_centred=True,
        controls={
            "norm offset dropped": lambda g, w: (g, replace(w, q_norm=w.q_norm - 1, k_norm=w.k_norm - 1)),
            "global RoPE base": lambda g, w: (replace(g, local_rope_theta=None), w),
            "window off": "window",
        },
    ),
    Family(
        "gemma3-nested",
        _base("gemma3_text", head_dim=8, query_pre_attn_scalar=32, sliding_window=WINDOW, rope_local_base_freq=10.0),
        layer=1,
        norm="per_head",
        zero_centred=True,
        prefix="model.language_model.",
        nested="gemma3",
        controls={"window off": "window"},
    ),
    Family(
        "olmo2",
        _base("olmo2"),
        norm="projection",
        controls={"no q/k norm": lambda g, w: (replace(g, qk_norm="none"), w)},
    ),
    Family(
        "granite",
        _base("granite", attention_multiplier=0.9, residual_multiplier=0.22),
        controls={"scale head_dim**-0.5": lambda g, w: (replace(g, query_scale=None), w)},
    ),
    Family(
        "glm4",  # interleaved partial RoPE (0.5 by default), q/k/v bias, no o bias
        _base("glm4", head_dim=16, rope_theta=100.0),
        head_dim=16,
        qkv_bias=True,
        controls={"half layout": lambda g, w: (replace(g, rope_layout="half"), w)},
    ),
    Family(
        "glm",
        _base("glm", head_dim=16, rope_theta=100.0),
        head_dim=16,
        qkv_bias=True,
        controls={"half layout": lambda g, w: (replace(g, rope_layout="half"), w)},
    ),
    Family(
        "smollm3",  # layer 3 has no RoPE and (use_sliding_window) slides
        _base("smollm3", layers=4, rope_theta=100.0, use_sliding_window=True, sliding_window=WINDOW),
        layer=3,
        controls={"RoPE applied": lambda g, w: (replace(g, no_rope_layers=()), w), "window off": "window"},
    ),
    Family(
        "starcoder2",
        _base("starcoder2", use_bias=True, sliding_window=WINDOW, norm_epsilon=1e-5),
        qkv_bias=True,
        o_bias=True,
        controls={"window off": "window"},
    ),
]


def write_family_checkpoint(directory: Path, fam: Family, seed: int = 0) -> Path:
    """config.json + model.safetensors with every layer's attention tensors in the family's layout."""
    rng = np.random.default_rng(seed)
    d, n = fam.head_dim, fam.config["num_hidden_layers"]
    tensors = {}
    for layer in range(n):
        base = f"{fam.prefix}layers.{layer}.self_attn."
        q = rng.standard_normal((HQ * d, H)) / np.sqrt(H)
        k = rng.standard_normal((HKV * d, H)) / np.sqrt(H)
        v = rng.standard_normal((HKV * d, H)) / np.sqrt(H)
        if fam.fused_qkv:
            tensors[base + "qkv_proj.weight"] = np.concatenate([q, k, v])
        else:
            tensors.update({base + "q_proj.weight": q, base + "k_proj.weight": k, base + "v_proj.weight": v})
        tensors[base + "o_proj.weight"] = rng.standard_normal((H, HQ * d)) / np.sqrt(HQ * d)
        if fam.qkv_bias:
            for p, rows in (("q", HQ * d), ("k", HKV * d), ("v", HKV * d)):
                tensors[base + f"{p}_proj.bias"] = rng.standard_normal(rows) * 0.1
        if fam.o_bias:
            tensors[base + "o_proj.bias"] = rng.standard_normal(H) * 0.1
        if fam.norm != "none":
            sizes = (d, d) if fam.norm == "per_head" else (HQ * d, HKV * d)
            for p, size in zip(("q", "k"), sizes, strict=True):
                w = rng.standard_normal(size) * 0.3
                tensors[base + f"{p}_norm.weight"] = w if fam.zero_centred else 1.0 + w
    directory.mkdir(parents=True)
    config = fam.config if fam.nested is None else {"model_type": fam.nested, "text_config": fam.config}
    (directory / "config.json").write_text(json.dumps(config))
    write_safetensors(
        directory / "model.safetensors", {k: np.asarray(v, np.float32) for k, v in tensors.items()}, "F32"
    )
    return directory


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """family name -> (checkpoint dir, package path); each family exported once, lazily."""
    cache = {}

    def get(fam: Family, graph: str = "dense"):
        key = (fam.name, graph)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"{fam.name}-{graph}")
            ckpt = write_family_checkpoint(root / "ckpt", fam)
            options = {"capacity": 2 * CHUNK} if graph in ("stateful", "stateful-tiled") else {}
            [result] = export_sidecars(
                load_checkpoint(ckpt), root / "out", CHUNK, HISTORIES, [fam.layer], graph=graph, **options
            )
            cache[key] = (ckpt, result.package)
        return cache[key]

    return get


def control_errors(package: Path, fam: Family) -> dict[str, float]:
    """h<C>: attn_out / k_chunk error of the package against the right reference (first entry
    ``right``) and against each control's wrong one."""
    meta = read_sidecar_metadata(package)
    checkpoint = load_matching_checkpoint(meta, None)
    g, w = checkpoint.geometry, checkpoint.layer(meta.layer)
    saved = SavedPackage(package)
    rng = np.random.default_rng(7)
    name = f"h{CHUNK}"
    inputs = random_function_inputs(name, CHUNK, w, g, rng, rope_coverage=meta.coverage)
    mask = causal(CHUNK, CHUNK, window=meta.sliding_window)
    out = run_package(saved, inputs, mask)

    def err(geometry, weights, ref_mask=mask):
        # the history the package sees was built with the right block, as a real cache would be
        ref = run_reference(inputs, weights, geometry, ref_mask, rope_coverage=meta.coverage)
        return max(relative_error(out["attn_out"], ref.attn_out), relative_error(out["k_chunk"], ref.k_chunk))

    errors = {"right": err(g, w)}
    for label, change in fam.controls.items():
        if change == "window":
            errors[label] = err(g, w, causal(CHUNK, CHUNK))
        else:
            errors[label] = err(*change(g, w))
    return errors


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_family_exports_and_verifies(fam, exported):
    ckpt, package = exported(fam)
    report = verify_package(package)
    assert report.passed, report.table()
    assert {c.function for c in report.comparisons} == {"h0", f"h{CHUNK}"}
    meta = read_sidecar_metadata(package)
    g = load_checkpoint(ckpt).geometry
    assert meta.sliding_window == g.window_of(fam.layer)
    errors = control_errors(package, fam)
    assert errors["right"] < RELATIVE_ERROR_THRESHOLD, errors
    for label, value in errors.items():
        if label != "right":
            assert value > RELATIVE_ERROR_THRESHOLD, f"control {label!r} does not fail: {errors}"


WINDOWED = {f.name: f for f in FAMILIES}


@pytest.mark.parametrize("name", ["gemma2", "glm4", "smollm3", "olmo2", "llama-rope-yarn", "phi3-longrope"])
@pytest.mark.parametrize("graph", ["tiled", "stateful"])
def test_family_options_in_every_graph(name, graph, exported):
    """softcap + scale + window, interleaved RoPE, NoPE, whole-projection norms, the cos/sin attention
    factor (applied once across the dense/tiled graphs' two rotations) and the coverage-picked
    longrope table in the tiled and stateful graphs."""
    _, package = exported(WINDOWED[name], graph)
    report = verify_package(package)
    assert report.passed, report.table()


@pytest.mark.parametrize(
    "name,expected",
    [
        ("mistral-window", (WINDOW, (0, 1))),
        ("ministral-window", (WINDOW, (1,))),
        ("qwen2-window", (WINDOW, (1,))),
        ("qwen3_moe-window", (WINDOW, (0, 1))),
        ("gemma2", (WINDOW, (0,))),
        ("gemma3_text", (WINDOW, (0,))),
        ("smollm3", (WINDOW, (3,))),
        ("starcoder2", (WINDOW, (0, 1))),
        ("llama", (None, ())),
        ("glm4", (None, ())),
    ],
)
def test_windows_read_as_transformers(name, expected):
    g = geometry_from_config(WINDOWED[name].config)
    assert (g.sliding_window, g.sliding_layers) == expected


def test_family_geometry_options():
    """The options each family's config sets (hand-derived from the transformers sources)."""
    get = lambda name: geometry_from_config(WINDOWED[name].config)  # noqa: E731
    assert get("gemma2").query_scale == pytest.approx(32**-0.5) and get("gemma2").logit_softcap == 0.5
    assert get("granite").query_scale == 0.9 and "0.22" in get("granite").after_o_proj
    assert get("glm4").rope_layout == "interleaved" and get("glm4").rotary_dim == 8
    assert (get("glm4").has_qkv_bias, get("glm4").has_o_bias) == (True, False)
    assert get("smollm3").no_rope_layers == (3,) and get("smollm3").rope_theta == 100.0
    assert get("olmo2").qk_norm_kind == "projection" and get("olmo2").input_rows == "residual"
    g3 = get("gemma3_text")
    assert (g3.rope_theta, g3.local_rope_theta) == (1e6, 10.0)
    assert g3.rope_frequencies(0)[0][1] == pytest.approx(10.0 ** (-2 / 8))  # local layer: local base
    assert get("phi3-longrope").rope_scaling.rope_type == "longrope"
    # transformers defaults: Mistral's window is 4096 when the key is absent; Qwen2's flag off: none
    assert geometry_from_config(_base("mistral")).sliding_window == 4096
    assert geometry_from_config(_base("qwen2", sliding_window=8)).sliding_layers == ()
    assert geometry_from_config(_base("qwen2", use_sliding_window=True, num_hidden_layers=30)).sliding_layers == (
        28,
        29,
    )


@pytest.mark.parametrize(
    "config,needle",
    [
        (_base("gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention"),
        (_base("gemma3_text", attn_logit_softcapping=30.0), "attn_logit_softcapping"),
        (_base("llama", attn_logit_softcapping=30.0), "attn_logit_softcapping"),
        (_base("llama", partial_rotary_factor=0.5), "partial_rotary_factor"),
        (_base("llama", attention_chunk_size=128), "attention_chunk_size"),
        (_base("ministral", llama_4_scaling_beta=0.1), "llama_4_scaling_beta"),
        (_base("llama", rope_scaling={"rope_type": "proportional", "factor": 2.0}), "proportional"),
        (_base("mistral", layer_types=["sliding_attention"] * 2), "layer_types"),
        (_base("ministral", layer_types=["chunked_attention"] * 2), "chunked_attention"),
        (_base("llama4"), "unknown model_type"),
    ],
)
def test_unmodelled_options_are_refused(config, needle):
    with pytest.raises(AnelabInputError, match=needle) as info:
        geometry_from_config(config)
    assert "\n" not in str(info.value)


def _constant_checkpoint(directory: Path, fam: Family, tensors: dict[str, np.ndarray]) -> Path:
    directory.mkdir(parents=True)
    config = fam.config if fam.nested is None else {"model_type": fam.nested, "text_config": fam.config}
    (directory / "config.json").write_text(json.dumps(config))
    write_safetensors(
        directory / "model.safetensors", {k: np.asarray(v, np.float32) for k, v in tensors.items()}, "F32"
    )
    return directory


def test_phi3_fused_qkv_is_split_q_k_v(tmp_path):
    """Rows of qkv_proj: Hq*d of Q, then Hkv*d of K, then V (modeling_phi3.py: query_pos = Hq*d)."""
    fam = WINDOWED["phi3-longrope"]
    d = fam.head_dim
    fused = np.concatenate([np.full((HQ * d, H), 1.0), np.full((HKV * d, H), 2.0), np.full((HKV * d, H), 3.0)])
    base = "model.layers.0.self_attn."
    tensors = {base + "qkv_proj.weight": fused, base + "o_proj.weight": np.zeros((H, HQ * d))}
    w = load_checkpoint(_constant_checkpoint(tmp_path / "c", fam, tensors)).layer(0)
    assert (np.unique(w.q_proj), np.unique(w.k_proj), np.unique(w.v_proj)) == ([1.0], [2.0], [3.0])
    assert w.q_proj.shape == (HQ * d, H) and w.k_proj.shape == w.v_proj.shape == (HKV * d, H)
    # negative control: a fused tensor sized for another head count is refused, not mis-split
    tensors[base + "qkv_proj.weight"] = fused[: -HKV * d]
    with pytest.raises(AnelabInputError, match="qkv_proj.weight has shape"):
        load_checkpoint(_constant_checkpoint(tmp_path / "bad", fam, tensors)).layer(0)


@pytest.mark.parametrize("name,expected", [("gemma3_text", 1.5), ("qwen3_moe-window", 0.5)])
def test_norm_offset_folded_at_load(tmp_path, name, expected):
    """Gemma 3 stores q/k norm weights zero-centred (x * (1 + w)); Qwen3 stores the multiplier itself."""
    fam = WINDOWED[name]
    d = fam.head_dim
    base = "model.layers.0.self_attn."
    tensors = {
        base + "q_proj.weight": np.zeros((HQ * d, H)),
        base + "k_proj.weight": np.zeros((HKV * d, H)),
        base + "v_proj.weight": np.zeros((HKV * d, H)),
        base + "o_proj.weight": np.zeros((H, HQ * d)),
        base + "q_norm.weight": np.full(d, 0.5),
        base + "k_norm.weight": np.full(d, 0.5),
    }
    w = load_checkpoint(_constant_checkpoint(tmp_path / "c", fam, tensors)).layer(0)
    assert np.all(w.q_norm == expected) and np.all(w.k_norm == expected)


def test_olmo2_norms_span_the_projection(tmp_path):
    """OLMo 2's q_norm/k_norm weights are [Hq*d] / [Hkv*d]; per-head [d] weights are refused."""
    fam = WINDOWED["olmo2"]
    g = geometry_from_config(fam.config)
    shapes = g.parameter_shapes()
    assert (shapes["q_norm.weight"], shapes["k_norm.weight"]) == ((HQ * 8,), (HKV * 8,))
    d = fam.head_dim
    base = "model.layers.0.self_attn."
    tensors = {
        base + "q_proj.weight": np.zeros((HQ * d, H)),
        base + "k_proj.weight": np.zeros((HKV * d, H)),
        base + "v_proj.weight": np.zeros((HKV * d, H)),
        base + "o_proj.weight": np.zeros((H, HQ * d)),
        base + "q_norm.weight": np.ones(d),
        base + "k_norm.weight": np.ones(d),
    }
    with pytest.raises(AnelabInputError, match="q_norm.weight has shape"):
        load_checkpoint(_constant_checkpoint(tmp_path / "c", fam, tensors)).layer(0)


@pytest.mark.parametrize("name", ["gemma2", "glm4", "smollm3", "olmo2", "llama-rope-yarn", "phi3-longrope"])
def test_family_options_in_the_stateful_tiled_graph(name, exported):
    """The same block options in the one-function-per-layer design (RoPE table, factor and NoPE from
    the geometry, softcap in every key tile); a sliding-window layer (Gemma 2 with its soft-cap, SmolLM3's
    NoPE layer) keeps a ring of W + C slots, and its prompt runs past the window."""
    fam = WINDOWED[name]
    window = geometry_from_config(fam.config).window_of(fam.layer)
    _, package = exported(fam, "stateful-tiled")
    report = verify_package(package)
    assert report.passed, report.table()
    assert read_sidecar_metadata(package).ring_slots == (None if window is None else window + CHUNK)
    dropped = [c for c in report.comparisons if c.case == "control: window dropped (ref.)"]
    assert len(dropped) == (window is not None) and all(c.passed for c in dropped)
