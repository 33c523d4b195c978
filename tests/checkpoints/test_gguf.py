"""GGUF files as checkpoints, written here by the gguf package's own writer from checkpoints in the real layout.

Each file is made the way llama.cpp's converter makes one (conversion/llama.py ``LlamaModel.permute`` applied
to every Q and K projection of a ``llama`` model, tensor names from gguf's ``TensorNameMap``, 2-D weights
quantized by ``gguf.quants``, 1-D ones kept F32) and read back through ``load_checkpoint``: equal to the
source within the quantization's own error — bit-equal to what gguf's dequantizer gives for the file — and
the whole model's logits equal to the source's for F32. Negative controls: the permutation not undone
(weights off by far more than the quantization, a verify that fails), other architectures and unmodelled
metadata refused in one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from anelab.arms.arm_runs import Arm, run_arm
from anelab.checkpoints import gguf_file
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.whole_model import load_model, write_random_model
from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.sidecar.checks.verify import verify_package
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.format import read_sidecar_metadata

Q = gguf.GGMLQuantizationType
GEOMETRIES = {
    "llama": AttentionGeometry("llama", 64, 4, 2, 16, rope_theta=50000.0, rms_norm_eps=1e-5, num_layers=2,
                               full_attention_layers=(0, 1)),
    "qwen2": AttentionGeometry("llama", 64, 4, 2, 16, rope_theta=1e6, rms_norm_eps=1e-6, num_layers=2,
                               full_attention_layers=(0, 1), has_qkv_bias=True, has_o_bias=False),
    "qwen3": AttentionGeometry("qwen3", 64, 4, 2, 32, rope_theta=1e6, rms_norm_eps=1e-6, num_layers=2,
                               full_attention_layers=(0, 1)),
    "llama_bias": AttentionGeometry("llama", 64, 4, 2, 16, rope_theta=50000.0, rms_norm_eps=1e-5, num_layers=2,
                                    full_attention_layers=(0, 1), has_qkv_bias=True, has_o_bias=True),
}  # fmt: skip
VOCAB, INTERMEDIATE = 256, 128
# relative (Frobenius) error of a 2-D weight read back from each storage type, an upper bound on what gguf's
# own quantizer leaves on N(0, 1/fan_in) weights (measured, worst projection: F16 2.2e-4, BF16 1.7e-3,
# Q8_0 5.5e-3, Q5_1 3.9e-2, Q4_1 8.0e-2, Q4_0 9.0e-2)
READ_BACK_BOUND = {"F32": 0.0, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 1e-2, "Q5_1": 6e-2, "Q4_1": 0.15, "Q4_0": 0.15}


def llamacpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's converter (conversion/llama.py, ``LlamaModel.permute``), as it is applied to q_proj (n_head,
    n_head) and k_proj (n_head, n_head_kv) weights and biases: written here independently of anelab's reader."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(source: Path, out: Path, qtype: str, *, arch: str | None = None, permute: bool = True,
               extra_kv: dict | None = None, extra_tensors: dict | None = None) -> Path:  # fmt: skip
    """A GGUF file of the Hugging Face checkpoint ``source`` (F32 safetensors), as llama.cpp's converter writes it."""
    config = json.loads((source / "config.json").read_text())
    arch = arch or config["model_type"]
    tensors = safetensors.numpy.load_file(source / "model.safetensors")
    heads, kv_heads, layers = config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]
    writer = gguf.GGUFWriter(out, arch)
    writer.add_block_count(layers)
    writer.add_context_length(config.get("max_position_embeddings", 4096))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    for key, value in (extra_kv or {}).items():
        writer.add_uint32(key, value)
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == (arch if arch in ("llama", "qwen2", "qwen3")
                                                                            else "llama"))  # fmt: skip
    table = gguf.get_tensor_name_map(arch_enum, layers)
    for name, value in sorted({**tensors, **(extra_tensors or {})}.items()):
        base, suffix = name.rsplit(".", 1)
        if permute and arch == "llama" and base.endswith(("q_proj", "k_proj")):
            value = llamacpp_permute(value, heads, heads if base.endswith("q_proj") else kv_heads)
        stem = table.get_name(base)
        target = (stem + "." + suffix) if stem else name
        if value.ndim == 2 and qtype != "F32":
            writer.add_tensor(target, gguf.quants.quantize(value, Q[qtype]), raw_dtype=Q[qtype])
        else:
            writer.add_tensor(target, np.ascontiguousarray(value, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """model_type -> a whole F32 Hugging Face checkpoint with random weights (the project's own writer)."""
    root = tmp_path_factory.mktemp("gguf-src")
    return {
        kind: write_random_model(
            root / kind,
            g,
            vocab=VOCAB,
            intermediate=INTERMEDIATE,
            seed=3,
            model_type=kind.removesuffix("_bias"),
            dtype="F32",
        )  # fmt: skip
        for kind, g in GEOMETRIES.items()
    }


def expected_read_back(value: np.ndarray, qtype: str, heads: int | None) -> np.ndarray:
    """What a correct reader returns: gguf's own quantize -> dequantize of the permuted rows, rows put back by
    indexing with the permutation (computed here from an index array, not by anelab's inverse)."""
    rows = np.arange(value.shape[0])
    order = llamacpp_permute(rows, heads, heads) if heads else rows
    stored = value[order]
    if qtype == "F32":
        round_trip = stored
    elif qtype == "F16":
        round_trip = stored.astype(np.float16).astype(np.float32)
    elif qtype == "BF16":
        round_trip = stored.astype(ml_dtypes.bfloat16).astype(np.float32)
    else:
        round_trip = gguf.quants.dequantize(gguf.quants.quantize(stored, Q[qtype]), Q[qtype])
    back = np.empty_like(round_trip)
    back[order] = round_trip
    return back


@pytest.mark.parametrize("qtype", list(READ_BACK_BOUND))
def test_a_llama_gguf_reads_back_its_source_within_the_quantizations_error(sources, tmp_path, qtype):
    path = write_gguf(sources["llama"], tmp_path / f"m.{qtype}.gguf", qtype)
    ck, src = load_checkpoint(path), load_checkpoint(sources["llama"])
    assert ck.format == "gguf" and ck.quantized == (qtype not in ("F32", "F16", "BF16"))
    assert ck.geometry.to_dict() == src.geometry.to_dict()
    g = ck.geometry
    for layer in (0, 1):
        got, want = ck.layer(layer), src.layer(layer)
        for proj, heads in (("q_proj", g.num_heads), ("k_proj", g.num_kv_heads), ("v_proj", None), ("o_proj", None)):
            read, source = getattr(got, proj), getattr(want, proj)
            np.testing.assert_array_equal(read, expected_read_back(source, qtype, heads), err_msg=f"{proj} {qtype}")
            assert np.linalg.norm(read - source) <= READ_BACK_BOUND[qtype] * np.linalg.norm(source) + 1e-12


def test_biases_and_norms_come_back_in_transformers_order(sources, tmp_path):
    """A Llama's Q/K biases are permuted by the converter like its weights (and put back); llama.cpp writes
    Qwen2/Qwen3 Q/K rows as they are (NeoX RoPE); Qwen2's q/k/v biases and Qwen3's q/k norms come through under
    transformers' names."""
    for kind in ("llama_bias", "qwen2", "qwen3"):
        ck = load_checkpoint(write_gguf(sources[kind], tmp_path / f"{kind}.gguf", "F32"))
        src = load_checkpoint(sources[kind])
        assert (ck.model_type, ck.geometry.to_dict()) == (kind.removesuffix("_bias"), src.geometry.to_dict())
        for field in ("q_proj", "k_proj", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm"):
            a, b = getattr(ck.layer(1), field), getattr(src.layer(1), field)
            assert (a is None) == (b is None), field
            if a is not None:
                np.testing.assert_array_equal(a, b, err_msg=f"{kind} {field}")


def test_the_whole_model_from_an_f32_gguf_gives_the_sources_logits(sources, tmp_path):
    path = write_gguf(sources["llama"], tmp_path / "m.gguf", "F32")
    prompt = np.arange(1, 20) * 7 % VOCAB
    got = run_arm(load_model(path), prompt, Arm("reference"), decode=4)
    want = run_arm(load_model(sources["llama"]), prompt, Arm("reference"), decode=4)
    np.testing.assert_array_equal(got.logits, want.logits)
    np.testing.assert_array_equal(got.tokens, want.tokens)


def test_without_undoing_the_permutation_the_weights_are_wrong(sources, tmp_path, monkeypatch):
    """Negative control: a reader that forgets llama.cpp's row order reads Q far outside the Q8_0 error."""
    path = write_gguf(sources["llama"], tmp_path / "m.gguf", "Q8_0")
    monkeypatch.setitem(gguf_file.GGUF_ARCHITECTURES, "llama",
                        gguf_file.GgufArchitecture("llama", "LlamaForCausalLM", "LLAMA"))  # fmt: skip
    got, want = load_checkpoint(path).layer(0).q_proj, load_checkpoint(sources["llama"]).layer(0).q_proj
    assert np.linalg.norm(got - want) > 1.0 * np.linalg.norm(want)


def test_a_gguf_exports_and_verifies_and_verify_fails_when_the_permutation_is_not_undone(
    sources, tmp_path, monkeypatch
):
    path = write_gguf(sources["llama"], tmp_path / "m.gguf", "Q4_1")
    export_sidecars(load_checkpoint(path), tmp_path / "sc", 8, [0, 8], layers=[1], jobs=1)
    pkg = tmp_path / "sc" / "layer_1.mlpackage"
    meta = read_sidecar_metadata(pkg)
    assert meta.source == str(path.resolve())
    assert meta.source_format == {"format": "gguf", "attention_storage": ["Q4_1"], "quantized": True,
                                  "sidecar_weights": "the dequantized attention projections (fp16)"}  # fmt: skip
    report = verify_package(pkg, progress=False)
    assert report.passed and not report.vacuous
    # the reader forgets the permutation when verify reads the checkpoint: same file bytes (digests match), wrong Q/K
    monkeypatch.setitem(gguf_file.GGUF_ARCHITECTURES, "llama",
                        gguf_file.GgufArchitecture("llama", "LlamaForCausalLM", "LLAMA"))  # fmt: skip
    wrong = verify_package(pkg, progress=False)
    assert not wrong.passed
    assert max(c.worst for c in wrong.comparisons if not c.control) > 10 * wrong.threshold


def test_a_package_from_a_gguf_matches_a_copy_and_refuses_another_quantization(sources, tmp_path):
    path = write_gguf(sources["llama"], tmp_path / "m.gguf", "Q8_0")
    export_sidecars(load_checkpoint(path), tmp_path / "sc", 8, [0], layers=[0], jobs=1)
    copy = tmp_path / "copy.gguf"
    shutil.copy(path, copy)
    assert verify_package(tmp_path / "sc" / "layer_0.mlpackage", load_checkpoint(copy), progress=False).passed
    other = write_gguf(sources["llama"], tmp_path / "other.gguf", "Q4_0")
    with pytest.raises(AnelabInputError, match=r"tensor model\.layers\.0\.self_attn\.\w_proj\.weight differs"):
        verify_package(tmp_path / "sc" / "layer_0.mlpackage", load_checkpoint(other), progress=False)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(arch="falcon"), "GGUF architecture 'falcon' is not modelled"),
        (dict(extra_kv={"llama.attention.sliding_window": 64}), "llama.attention.sliding_window = 64 is not modelled"),
        (dict(extra_kv={"llama.expert_count": 8}), "routed experts"),
        (
            dict(extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)}),
            "GGUF tensor rope_freqs.weight has no place",
        ),
    ],
)
def test_what_the_reader_does_not_model_is_refused_in_one_line(sources, tmp_path, change, match):
    path = write_gguf(sources["llama"], tmp_path / "m.gguf", "F32", **change)
    with pytest.raises(AnelabInputError, match=match) as refused:
        load_checkpoint(path)
    assert "\n" not in str(refused.value)


def test_a_truncated_gguf_is_refused_in_one_line(sources, tmp_path):
    path = write_gguf(sources["llama"], tmp_path / "m.gguf", "Q8_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(AnelabInputError, match="truncated|not a readable GGUF"):
        load_checkpoint(cut).layer(1)


def _metadata_arrays_file(path: Path) -> Path:
    """A GGUF file whose metadata holds every kind of array gguf writes: strings (a vocabulary with multi-byte
    and empty ones), integers, floats, booleans, and an array of arrays (its writer writes no empty array)."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("t.tokens", [f"tok{i}" for i in range(300)] + ["é✓", "", "<|end|>"])
    writer.add_array("t.scores", [float(i) / 7 for i in range(50)])
    writer.add_array("t.types", list(range(-3, 40)))
    writer.add_array("t.flags", [True, False, True])
    writer.add_array("t.nested", [[1, 2], [3, 4, 5]])
    writer.add_string("t.name", "x")
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_reader_serves_metadata_arrays_as_ggufs_own_reader_does_without_reading_them_at_open(tmp_path):
    """anelab's reader (``gguf_file._lazy_array_reader``) leaves metadata arrays unread at open, yet every field,
    every element, slice and index of it, and every tensor are what gguf's own ``GGUFReader`` gives."""
    path = _metadata_arrays_file(tmp_path / "arrays.gguf")
    ours, theirs = gguf_file._lazy_array_reader()(str(path)), gguf.GGUFReader(path)
    lazy = {k for k, f in ours.fields.items() if isinstance(f, gguf_file.LazyArrayField)}
    assert lazy == {"t.tokens", "t.scores", "t.types", "t.flags"}  # the nested array is gguf's own
    assert all(ours.fields[k]._field is None for k in lazy)  # nothing of them built at open
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.name, list(mine.types)) == (field.offset, field.name, list(field.types))
        value = field.contents()
        assert mine.contents() == value and [type(v) for v in np.ravel(mine.contents())] == [
            type(v) for v in np.ravel(value)
        ]
        if isinstance(value, list) and value:
            for index in (0, -1, slice(1, 4), slice(None, None, 3)):
                assert mine.contents(index) == field.contents(index), (key, index)
        assert mine.data == field.data and len(mine.parts) == len(field.parts)
        assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True))
    assert ours.fields["t.tokens"].count == 303
    assert ours.data_offset == theirs.data_offset
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data_offset, a.n_bytes) == (b.name, b.tensor_type, b.data_offset, b.n_bytes)
        assert np.array_equal(a.data, b.data)


def test_a_string_array_running_past_the_end_of_the_file_is_refused_at_open(tmp_path):
    """Negative control: the lengths of a metadata string array are walked at open, so a length that runs past the
    end of the file is refused there in one line (gguf's own reader would read short strings silently)."""
    path = _metadata_arrays_file(tmp_path / "arrays.gguf")
    data = bytearray(path.read_bytes())
    at = data.index(b"tok299") - 8  # the u64 length before the 300th token
    data[at : at + 8] = (len(data)).to_bytes(8, "little")
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(AnelabInputError, match="not a readable GGUF file .*past the end of the file") as refused:
        gguf_file.read_gguf(tmp_path / "bad.gguf")
    assert "\n" not in str(refused.value)
    gguf_file.read_gguf(path)  # the intact file opens


def test_the_cli_exports_verifies_and_compares_arms_on_a_gguf_file(sources, tmp_path, capsys):
    path = write_gguf(sources["llama"], tmp_path / "m.gguf", "Q8_0")
    out = tmp_path / "sc"
    assert main(["export", str(path), "--chunk", "8", "--histories", "0,8,16", "--out", str(out), "--jobs", "1"]) == 0
    assert main(["verify", str(out), "--jobs", "1"]) == 0
    capsys.readouterr()
    assert main(["compare-arms", str(path), "--sidecars", str(out), "--prompt-tokens", "20", "--decode", "3",
                 "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    pair = report["pairs"][0]
    assert pair["prompt_logits_diff"] < 1e-2


def _with_tokenizer(source: Path, out: Path, pre: str) -> Path:
    """A tiny GGUF whose byte-level BPE vocabulary has a merged-digits token "12" (pre-tokenizer ``pre``)."""
    path = write_gguf(source, out.with_suffix(".base.gguf"), "F32")
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(out, "llama")
    for key, field in reader.fields.items():
        if key.startswith("llama."):
            writer.add_uint32(key, field.contents()) if isinstance(field.contents(), int) else writer.add_float32(
                key, field.contents()
            )
    tokens = ["<|endoftext|>", "a", "\u0120", "1", "2", "12", "\u0120a"] + [f"x{i}" for i in range(VOCAB - 7)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (VOCAB - 1))
    writer.add_token_merges(["1 2", "\u0120 a"])
    writer.add_eos_token_id(0)
    writer.add_chat_template(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %} a{% endif %}"
    )
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_smollms_pre_tokenizer_splits_every_digit_as_llamacpp_does(sources, tmp_path):
    """llama.cpp's ``smollm`` pre-tokenizer isolates each digit before GPT-2's split (src/llama-vocab.cpp), so
    "12" is never merged; the control: the same vocabulary under ``gpt2`` merges it."""
    split = load_checkpoint(_with_tokenizer(sources["llama"], tmp_path / "smollm.gguf", "smollm")).tokenizer()
    plain = load_checkpoint(_with_tokenizer(sources["llama"], tmp_path / "gpt2.gguf", "gpt2")).tokenizer()
    spelled = lambda tok, text: [tok.backend.id_to_token(int(i)) for i in tok.encode(text)]  # noqa: E731
    assert spelled(split, "a 12 a") == ["a", "\u0120", "1", "2", "\u0120a"]
    assert spelled(plain, "a 12 a") == ["a", "\u0120", "12", "\u0120a"]
    assert split.decode(split.chat("a 12")) == "a 12 a"  # the file's chat template, with the generation prompt
    unknown = _with_tokenizer(sources["llama"], tmp_path / "other.gguf", "some-new-pre")
    with pytest.raises(AnelabInputError, match="tokenizer.ggml.pre 'some-new-pre'"):
        load_checkpoint(unknown).tokenizer()
