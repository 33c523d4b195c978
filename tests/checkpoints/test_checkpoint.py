"""Checkpoint loading and writing: round trips, conventions, refusals, the embedded default.

Expected values never come from the loader: they are hand-computed, quantised independently
(numpy float16 / ml_dtypes bfloat16 casts, hand-written bit patterns), or read back with the
reference ``safetensors`` library.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as st
from conftest import TINY_GEOMETRIES, TINY_MODEL_TYPES, TINY_SEED

from anelab.checkpoints.checkpoint import load_checkpoint, write_checkpoint
from anelab.checkpoints.config import full_attention_layers, geometry_from_config
from anelab.checkpoints.default import DEFAULT_CHECKPOINT, default_checkpoint_dir, make_default_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.weights import AttentionWeights, random_attention_weights

VARIANTS = ("llama", "qwen2", "qwen3", "qwen3_next")
DTYPES = ("F32", "F16", "BF16")
FIELDS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "q_bias", "k_bias", "v_bias", "o_bias")
NORMS = ("q_norm", "k_norm")


def quantise(x: np.ndarray, dtype: str) -> np.ndarray:
    """Independent storage rounding: what a float32 value becomes in an F32/F16/BF16 file."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "F16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "BF16":
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    return x


def expected_loaded(w: AttentionWeights, variant: str, dtype: str) -> dict[str, np.ndarray | None]:
    """What the loader must return for weights ``w`` written as ``dtype``."""
    out = {}
    for name in FIELDS:
        value = getattr(w, name)
        if value is None:
            out[name] = None
        elif name in NORMS and variant == "qwen3_next":
            # stored as w - 1 (zero-centred), read back as 1 + stored
            out[name] = np.float32(1.0) + quantise(value - np.float32(1.0), dtype)
        else:
            out[name] = quantise(value, dtype)
    return out


def raw_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """Hand-rolled safetensors writer (independent of anelab's), for crafted files."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, blob) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def tree_hash(directory: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(directory).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


# ---- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_matches_independent_quantisation(tiny_checkpoint, variant, dtype):
    geometry = TINY_GEOMETRIES[variant]
    ckpt = load_checkpoint(tiny_checkpoint(variant, dtype))
    assert ckpt.geometry == geometry
    assert ckpt.tensor_dtype() == dtype
    for layer in geometry.full_attention_layers:
        original = random_attention_weights(geometry, layer, TINY_SEED)
        expected = expected_loaded(original, variant, dtype)
        loaded = ckpt.layer(layer)
        assert loaded.layer == layer
        for name in FIELDS:
            got = getattr(loaded, name)
            if expected[name] is None:
                assert got is None, name
            else:
                assert got.dtype == np.float32, name
                np.testing.assert_array_equal(got, expected[name], err_msg=name)
        if dtype != "F32":  # negative control: rounding is visible, so the comparison above has teeth
            assert not np.array_equal(expected["q_proj"], original.q_proj)


def test_round_trip_distinguishes_layers_and_seeds(tiny_checkpoint):
    ckpt = load_checkpoint(tiny_checkpoint("qwen3_next"))
    a, b = ckpt.layer(1), ckpt.layer(3)
    assert not np.array_equal(a.q_proj, b.q_proj)
    other = random_attention_weights(TINY_GEOMETRIES["qwen3_next"], 1, TINY_SEED + 1)
    assert not np.array_equal(a.q_proj, other.q_proj)


def test_written_files_read_by_reference_safetensors_library(tiny_checkpoint):
    """anelab's writer is readable by the safetensors library, with the stored dtype and values."""
    geometry = TINY_GEOMETRIES["qwen3_next"]
    directory = tiny_checkpoint("qwen3_next", "BF16")
    tensors = st.load_file(str(directory / "model.safetensors"))
    header_bytes = struct.unpack("<Q", (directory / "model.safetensors").read_bytes()[:8])[0]
    assert header_bytes % 8 == 0  # data aligned like the library's own files
    original = random_attention_weights(geometry, 3, TINY_SEED)
    q = tensors["model.layers.3.self_attn.q_proj.weight"]
    assert q.dtype == ml_dtypes.bfloat16 and q.shape == (2 * 4 * 16, 48)
    np.testing.assert_array_equal(q.astype(np.float32), quantise(original.q_proj, "BF16"))
    # zero-centred norm: the file holds w - 1, not the effective multiplier w
    stored = tensors["model.layers.3.self_attn.q_norm.weight"].astype(np.float32)
    np.testing.assert_array_equal(stored, quantise(original.q_norm - np.float32(1.0), "BF16"))
    assert abs(float(stored.mean())) < 0.2 and abs(float(original.q_norm.mean()) - 1.0) < 0.2


def test_reads_files_written_by_reference_safetensors_library(tmp_path):
    """A checkpoint saved by safetensors.numpy.save_file (not by anelab) loads with the same values."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((32, 32)).astype(np.float16)
    k = rng.standard_normal((16, 32)).astype(np.float16)
    v = rng.standard_normal((16, 32)).astype(np.float16)
    o = rng.standard_normal((32, 32)).astype(np.float16)
    st.save_file(
        {
            "model.layers.0.self_attn.q_proj.weight": q,
            "model.layers.0.self_attn.k_proj.weight": k,
            "model.layers.0.self_attn.v_proj.weight": v,
            "model.layers.0.self_attn.o_proj.weight": o,
        },
        str(tmp_path / "model.safetensors"),
    )
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 32,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 1,
                "rope_theta": 500000.0,
            }
        )
    )
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.geometry.head_dim == 8  # hidden // heads when config.json has no head_dim
    assert ckpt.geometry.rope_theta == 500000.0
    w = ckpt.layer(0)
    for got, want in ((w.q_proj, q), (w.k_proj, k), (w.v_proj, v), (w.o_proj, o)):
        np.testing.assert_array_equal(got, want.astype(np.float32))


def test_bf16_bits_hand_checked(tmp_path):
    """BF16 reading and round-to-nearest-even writing, against hand-written bit patterns."""
    # reading: bf16 is the top 16 bits of float32
    bits = np.array([0x3FC0, 0xC010, 0x3E00, 0x4040], dtype="<u2")  # 1.5, -2.25, 0.125, 3.0
    values = np.array([1.5, -2.25, 0.125, 3.0], dtype=np.float32)
    pattern = np.tile(bits, 4 * 4 * 4 // 4)
    d = tmp_path / "read"
    d.mkdir()
    tensors = {f"model.layers.0.self_attn.{p}_proj.weight": ("BF16", (8, 8), pattern[:64].tobytes()) for p in "qkvo"}
    raw_safetensors(d / "model.safetensors", tensors)
    (d / "config.json").write_text(
        json.dumps({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1})
    )
    w = load_checkpoint(d).layer(0)
    np.testing.assert_array_equal(w.q_proj.reshape(-1), np.tile(values, 16))

    # writing: ties round to the even mantissa
    g = AttentionGeometry("llama", hidden_size=8, num_heads=2, num_kv_heads=2, head_dim=4)
    weights = random_attention_weights(g, 0, 0)
    weights.q_proj[0, :4] = [1.0, 1.00390625, 1.01171875, -2.0]  # 1, 1+2^-8 (tie), 1+3*2^-8 (tie), -2
    out = write_checkpoint(tmp_path / "write", g, {0: weights}, dtype="BF16")
    stored = st.load_file(str(out / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    assert [int(b) for b in stored.view("<u2")[0, :4]] == [0x3F80, 0x3F80, 0x3F82, 0xC000]


# ---- sharding and laziness ---------------------------------------------------------------------


def test_sharded_checkpoint_loads_same_values(tiny_checkpoint):
    single = load_checkpoint(tiny_checkpoint("qwen3_next", "F16", 1))
    sharded_dir = tiny_checkpoint("qwen3_next", "F16", 3)
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in sharded_dir.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(set(index["weight_map"].values())) == files
    assert index["metadata"]["total_size"] == sum(
        (p.stat().st_size - 8 - struct.unpack("<Q", p.read_bytes()[:8])[0]) for p in sharded_dir.glob("*.safetensors")
    )
    sharded = load_checkpoint(sharded_dir)
    assert sharded.geometry == single.geometry
    for layer in (1, 3):
        a, b = single.layer(layer), sharded.layer(layer)
        for name in FIELDS:
            if getattr(a, name) is None:
                assert getattr(b, name) is None
            else:
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def test_sharded_loading_is_lazy(tiny_checkpoint, tmp_path):
    """Two shards: layer 1 in the first, layer 3 in the second. Removing the second shard leaves
    layer 1 loadable (its file is never opened) and makes layer 3 name the missing file."""
    directory = copy_checkpoint(tiny_checkpoint("qwen3_next", "F32", 2), tmp_path / "ckpt")
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    second = "model-00002-of-00002.safetensors"
    assert {f for n, f in index.items() if ".layers.3." in n} == {second}
    assert {f for n, f in index.items() if ".layers.1." in n} == {"model-00001-of-00002.safetensors"}
    (directory / second).unlink()
    ckpt = load_checkpoint(directory)
    expected = expected_loaded(
        random_attention_weights(TINY_GEOMETRIES["qwen3_next"], 1, TINY_SEED), "qwen3_next", "F32"
    )
    np.testing.assert_array_equal(ckpt.layer(1).k_proj, expected["k_proj"])
    with pytest.raises(AnelabInputError, match=second):
        ckpt.layer(3)


# ---- config conventions ------------------------------------------------------------------------


def hybrid_config(**extra) -> dict:
    return {
        "model_type": "qwen3_next",
        "hidden_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "num_hidden_layers": 8,
        **extra,
    }


@pytest.mark.parametrize(
    "config, layers",
    [
        # full_attention_interval N: full attention where (i + 1) % N == 0 (hand-computed)
        (hybrid_config(full_attention_interval=4), (3, 7)),
        (hybrid_config(full_attention_interval=2, num_hidden_layers=6), (1, 3, 5)),
        (hybrid_config(), (3, 7)),  # transformers' default interval is 4
        (
            hybrid_config(
                layer_types=["linear_attention", "full_attention"] + ["linear_attention"] * 5 + ["full_attention"]
            ),
            (1, 7),
        ),
        (hybrid_config(layer_types=["attention", "mamba"] * 4), (0, 2, 4, 6)),  # legacy names
        ({"model_type": "llama", "hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 3}, (0, 1, 2)),
        (
            {
                "model_type": "qwen3",
                "hidden_size": 32,
                "num_attention_heads": 2,
                "num_hidden_layers": 4,
                "use_sliding_window": True,
                "sliding_window": 128,
                "max_window_layers": 2,
            },
            (0, 1, 2, 3),  # sliding layers 2, 3 are attention too (geometry.sliding_layers)
        ),
    ],
)
def test_full_attention_layers(config, layers):
    assert full_attention_layers(config) == layers


def test_interval_rule_is_not_zero_based():
    """Negative control: the (i % N == 0) reading would put full attention at layer 0."""
    layers = full_attention_layers(hybrid_config(full_attention_interval=4))
    assert 0 not in layers and 4 not in layers


def test_qwen3_5_nested_text_config_and_rope_parameters():
    config = {
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_hidden_layers": 4,
            "rms_norm_eps": 1e-5,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5e6,
                "partial_rotary_factor": 0.5,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
        },
    }
    g = geometry_from_config(config)
    assert (g.variant, g.hidden_size, g.num_heads, g.num_kv_heads, g.head_dim) == ("qwen3_next", 64, 4, 2, 32)
    assert (g.rope_theta, g.partial_rotary_factor, g.rotary_dim, g.rms_norm_eps) == (5e6, 0.5, 16, 1e-5)
    assert g.full_attention_layers == (3,) and g.num_layers == 4


def test_transformers_defaults_for_missing_keys():
    # Qwen3-Next: head_dim 256 and partial_rotary_factor 0.25 when absent (configuration_qwen3_next.py)
    g = geometry_from_config(
        {"model_type": "qwen3_next", "hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 4}
    )
    assert (g.head_dim, g.partial_rotary_factor, g.num_kv_heads, g.rope_theta) == (256, 0.25, 2, 10000.0)
    # Qwen2: q/k/v biases always, no o bias, no q/k norm -> llama variant
    g = geometry_from_config(
        {
            "model_type": "qwen2",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 1,
        }
    )
    assert (g.variant, g.has_qkv_bias, g.has_o_bias, g.head_dim) == ("llama", True, False, 16)
    g = geometry_from_config(
        {
            "model_type": "qwen2",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 1,
            "attention_bias": True,
        }
    )
    assert (g.has_qkv_bias, g.has_o_bias) == (True, False)  # Qwen2 ignores attention_bias
    # attention_bias covers q/k/v and o for llama / qwen3 / qwen3_next
    g = geometry_from_config(
        {
            "model_type": "qwen3",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "head_dim": 16,
            "num_hidden_layers": 1,
            "attention_bias": True,
        }
    )
    assert (g.variant, g.has_qkv_bias, g.has_o_bias) == ("qwen3", True, True)
    # rope_scaling dict (older configs) holding the plain type still reads rope_theta from the top level
    g = geometry_from_config(
        {
            "model_type": "mistral",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 1,
            "rope_theta": 1e6,
            "rope_scaling": {"type": "default"},
        }
    )
    assert (g.variant, g.rope_theta) == ("llama", 1e6)


def test_zero_centred_norm_depends_on_variant(tmp_path):
    """The same stored norm 0.5 is the multiplier 0.5 for qwen3 and 1.5 for qwen3_next."""

    def write(directory: Path, model_type: str, gated: bool):
        directory.mkdir()
        d, hq, hkv, dim = 8, 2, 1, 8
        f32 = lambda shape, v: np.full(shape, v, dtype="<f4").tobytes()  # noqa: E731
        tensors = {
            "model.layers.0.self_attn.q_proj.weight": (
                "F32",
                (hq * dim * (2 if gated else 1), d),
                f32((hq * dim * (2 if gated else 1), d), 0.01),
            ),
            "model.layers.0.self_attn.k_proj.weight": ("F32", (hkv * dim, d), f32((hkv * dim, d), 0.02)),
            "model.layers.0.self_attn.v_proj.weight": ("F32", (hkv * dim, d), f32((hkv * dim, d), 0.03)),
            "model.layers.0.self_attn.o_proj.weight": ("F32", (d, hq * dim), f32((d, hq * dim), 0.04)),
            "model.layers.0.self_attn.q_norm.weight": ("F32", (dim,), f32((dim,), 0.5)),
            "model.layers.0.self_attn.k_norm.weight": ("F32", (dim,), f32((dim,), -0.25)),
        }
        raw_safetensors(directory / "model.safetensors", tensors)
        config = {
            "model_type": model_type,
            "hidden_size": d,
            "num_attention_heads": hq,
            "num_key_value_heads": hkv,
            "head_dim": dim,
            "num_hidden_layers": 1,
        }
        if gated:
            config["layer_types"] = ["full_attention"]
        (directory / "config.json").write_text(json.dumps(config))
        return load_checkpoint(directory).layer(0)

    plain = write(tmp_path / "qwen3", "qwen3", gated=False)
    centred = write(tmp_path / "next", "qwen3_next", gated=True)
    np.testing.assert_array_equal(plain.q_norm, np.full(8, 0.5, np.float32))
    np.testing.assert_array_equal(plain.k_norm, np.full(8, -0.25, np.float32))
    np.testing.assert_array_equal(centred.q_norm, np.full(8, 1.5, np.float32))
    np.testing.assert_array_equal(centred.k_norm, np.full(8, 0.75, np.float32))


# ---- refusals ----------------------------------------------------------------------------------


def refusal(fn, *args) -> str:
    with pytest.raises(AnelabInputError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_refuses_missing_directory_and_config(tmp_path):
    assert str(tmp_path / "nope") in refusal(load_checkpoint, tmp_path / "nope")
    assert "config.json" in refusal(load_checkpoint, tmp_path)


def test_refuses_directory_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hybrid_config()))
    assert "safetensors" in refusal(load_checkpoint, tmp_path)


@pytest.mark.parametrize("model_type", ["gpt2", "mamba", None])
def test_refuses_unknown_model_type(tiny_checkpoint, tmp_path, model_type):
    directory = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "c")
    edit_config(directory, model_type=model_type)
    message = refusal(load_checkpoint, directory)
    assert "model_type" in message and repr(model_type) in message


def test_refuses_missing_tensor(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen3", "F32")
    directory = copy_checkpoint(src, tmp_path / "c")
    tensors = st.load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    st.save_file(tensors, str(directory / "model.safetensors"))
    ckpt = load_checkpoint(directory)
    ckpt.layer(0)  # control: the other layer is complete
    assert "model.layers.1.self_attn.k_norm.weight" in refusal(ckpt.layer, 1)


def test_refuses_shape_mismatch(tiny_checkpoint, tmp_path):
    directory = copy_checkpoint(tiny_checkpoint("qwen3_next"), tmp_path / "c")
    edit_config(directory, num_key_value_heads=4)  # file holds 2 KV heads of 16
    message = refusal(load_checkpoint(directory).layer, 1)
    assert "model.layers.1.self_attn.k_proj.weight" in message
    assert "[32, 48]" in message and "[64, 48]" in message


def test_refuses_gate_layout_mismatch(tiny_checkpoint, tmp_path):
    """A qwen3 (ungated) file read as qwen3_next must fail on q_proj's row count, not load silently."""
    directory = copy_checkpoint(tiny_checkpoint("qwen3"), tmp_path / "c")
    edit_config(directory, model_type="qwen3_next", layer_types=["full_attention", "full_attention"])
    message = refusal(load_checkpoint(directory).layer, 0)
    assert "q_proj.weight" in message and "[64, 48]" in message and "[128, 48]" in message


def test_refuses_layer_out_of_range_and_not_full_attention(tiny_checkpoint):
    ckpt = load_checkpoint(tiny_checkpoint("qwen3_next"))
    message = refusal(ckpt.layer, 4)
    assert "layer 4" in message and "0..3" in message
    assert "layer -1" in refusal(ckpt.layer, -1)
    message = refusal(ckpt.layer, 2)
    assert "layer 2" in message and "full-attention layers: 1, 3" in message


def test_refusal_names_linear_attention_layer_type(tmp_path):
    g = AttentionGeometry("qwen3_next", 16, 2, 1, 8, num_layers=3, full_attention_layers=(1,))
    directory = write_checkpoint(tmp_path / "c", g, {1: random_attention_weights(g, 1, 0)}, model_type="qwen3_5")
    assert "linear_attention" in refusal(load_checkpoint(directory).layer, 0)


def test_refuses_unsupported_dtype(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama", "F32")
    directory = copy_checkpoint(src, tmp_path / "c")
    tensors = st.load_file(str(src / "model.safetensors"))
    name = "model.layers.0.self_attn.v_proj.weight"
    tensors[name] = tensors[name].astype(np.float64)
    st.save_file(tensors, str(directory / "model.safetensors"))
    message = refusal(load_checkpoint(directory).layer, 0)
    assert name in message and "F64" in message


def test_refuses_undeclared_bias(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama", "F32")
    directory = copy_checkpoint(src, tmp_path / "c")
    tensors = st.load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    st.save_file(tensors, str(directory / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.bias" in refusal(load_checkpoint(directory).layer, 0)


def test_refuses_scaled_rope(tiny_checkpoint, tmp_path):
    directory = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "c")
    edit_config(directory, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    assert "llama3" in refusal(load_checkpoint, directory)


def test_refuses_corrupt_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hybrid_config()))
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    assert "model.safetensors" in refusal(load_checkpoint, tmp_path)


def test_writer_refusals(tmp_path):
    g = TINY_GEOMETRIES["qwen3"]
    weights = {i: random_attention_weights(g, i, 0) for i in g.full_attention_layers}
    assert "BF8" in refusal(lambda: write_checkpoint(tmp_path / "a", g, weights, dtype="BF8"))
    assert "[0]" in refusal(lambda: write_checkpoint(tmp_path / "a", g, {0: weights[0]}))
    bad = dict(weights)
    bad[1] = dataclasses.replace(weights[1], k_proj=weights[1].k_proj[:-1])
    assert "k_proj" in refusal(lambda: write_checkpoint(tmp_path / "a", g, bad))
    assert "llama" in refusal(lambda: write_checkpoint(tmp_path / "a", g, weights, model_type="llama"))
    write_checkpoint(tmp_path / "a", g, weights)
    assert "already exists" in refusal(lambda: write_checkpoint(tmp_path / "a", g, weights))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


# ---- the embedded default checkpoint -----------------------------------------------------------


def test_default_checkpoint_is_deterministic(tmp_path):
    a = make_default_checkpoint(tmp_path / "a")
    b = make_default_checkpoint(tmp_path / "b")
    c = make_default_checkpoint(tmp_path / "c", seed=1)
    assert tree_hash(a) == tree_hash(b)
    assert tree_hash(a) != tree_hash(c)


def test_default_checkpoint_geometry(tmp_path):
    ckpt = load_checkpoint(make_default_checkpoint(tmp_path / "d"))
    g = ckpt.geometry
    assert (g.variant, g.hidden_size, g.num_heads, g.num_kv_heads, g.head_dim) == ("qwen3_next", 256, 4, 2, 64)
    assert (g.partial_rotary_factor, g.rotary_dim, g.rope_theta, g.rms_norm_eps) == (0.25, 16, 1e7, 1e-6)
    assert (g.num_layers, g.full_attention_layers) == (8, (3, 7))
    assert json.loads((ckpt.path / "config.json").read_text())["full_attention_interval"] == 4
    assert ckpt.tensor_dtype() == "BF16"
    w = ckpt.layer(7)
    assert w.q_proj.shape == (512, 256) and w.o_proj.shape == (256, 256) and w.q_norm.shape == (64,)
    assert "full attention at 3, 7" in ckpt.describe()


def test_default_checkpoint_dir_generates_once(tmp_path):
    directory = default_checkpoint_dir(tmp_path / "build")
    assert directory == tmp_path / "build" / DEFAULT_CHECKPOINT
    stamp = os.stat(directory / "model.safetensors").st_mtime_ns
    assert default_checkpoint_dir(tmp_path / "build") == directory
    assert os.stat(directory / "model.safetensors").st_mtime_ns == stamp


def test_random_weights_keep_activations_order_one():
    g = TINY_GEOMETRIES["qwen3_next"]
    w = random_attention_weights(g, 1, 3)
    x = np.random.default_rng(9).standard_normal((256, g.hidden_size)).astype(np.float32)
    for proj in (w.q_proj, w.k_proj, w.v_proj):
        assert 0.8 < float((x @ proj.T).std()) < 1.2
    y = np.random.default_rng(10).standard_normal((256, g.attn_features)).astype(np.float32)
    assert 0.8 < float((y @ w.o_proj.T).std()) < 1.2
    assert np.all(np.abs(w.q_norm - 1.0) < 0.5) and np.all(np.abs(w.k_norm - 1.0) < 0.5)
    # negative control: unscaled weights would blow activations up by sqrt(fan_in)
    assert float((x @ (w.q_proj.T * np.sqrt(g.hidden_size))).std()) > 5


def test_conftest_factory_serves_every_variant(tiny_checkpoint):
    for variant in VARIANTS:
        ckpt = load_checkpoint(tiny_checkpoint(variant))
        assert ckpt.model_type == TINY_MODEL_TYPES[variant]
        assert ckpt.geometry == TINY_GEOMETRIES[variant]


def test_multi_token_prediction_stack_is_not_the_model(tiny_checkpoint, tmp_path):
    """Qwen3-Next checkpoints also hold mtp.layers.0.self_attn.*; the decoder stack is model.layers."""
    src = tiny_checkpoint("qwen3_next", "F32")
    directory = copy_checkpoint(src, tmp_path / "c")
    tensors = st.load_file(str(src / "model.safetensors"))
    tensors.update(
        {
            k.replace("model.layers.1.", "mtp.layers.0."): np.zeros_like(v)
            for k, v in tensors.items()
            if ".layers.1." in k
        }
    )
    st.save_file(tensors, str(directory / "model.safetensors"))
    ckpt = load_checkpoint(directory)
    assert ckpt.prefix == "model."
    np.testing.assert_array_equal(ckpt.layer(1).q_proj, tensors["model.layers.1.self_attn.q_proj.weight"])
