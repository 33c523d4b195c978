"""MLX-quantized checkpoints, made by the real tools: an mlx-lm model with random weights, then ``mlx_lm.convert -q``.

The reader's dequantization is checked against ``mx.dequantize`` itself, bit for bit (every affine bit width,
group sizes 32/64/128, fp32/fp16/bf16 scales), and every quantized weight of every converted directory
(4- and 8-bit, groups 32 and 64, mixed 3/6-bit per-layer overrides) reads as ``mx.dequantize`` of its stored
arrays. An MLX 4-bit checkpoint exports, verifies (its negative controls failing as they must) and is
refused against its fp32 source; other quantization modes are refused in one line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map_with_path

from anelab.arms.arm_runs import Arm, run_arm
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.mlx_quantized import Quantization, dequantize
from anelab.checkpoints.whole_model import load_model
from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.sidecar.checks.verify import verify_package
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.format import read_sidecar_metadata

CONFIGS = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=128, num_hidden_layers=2,
                  intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False,
                  torch_dtype="float32"),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=128, num_hidden_layers=2,
                  intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256,
                  rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=2048, tie_word_embeddings=True,
                  torch_dtype="float32"),
}  # fmt: skip
# name -> (source, mlx_lm.convert flags): 4/8 bits, groups 32/64, scales in fp16 / bf16 / fp32, mixed per-layer bits
CONVERSIONS = {
    "q4g32": ("llama", ["--q-bits", "4", "--q-group-size", "32", "--dtype", "float16"]),
    "q4g64": ("llama", ["--q-bits", "4", "--q-group-size", "64", "--dtype", "bfloat16"]),
    "q8g32": ("llama", ["--q-bits", "8", "--q-group-size", "32"]),
    "q8g64": ("llama", ["--q-bits", "8", "--q-group-size", "64", "--dtype", "bfloat16"]),
    "mixed36": ("llama", ["--quant-predicate", "mixed_3_6", "--q-group-size", "64"]),
    "qwen3q4": ("qwen3", ["--q-bits", "4", "--q-group-size", "64"]),
}
# relative (Frobenius) error of a projection against its fp32 source: 4-bit groups of 64 leave ~7 %, 8-bit ~0.5 %
SOURCE_ERROR_BOUND = {4: 0.12, 8: 0.012, 3: 0.25}


def write_mlx_model(kind: str, directory: Path, seed: int = 0) -> Path:
    """An mlx-lm model of ``CONFIGS[kind]`` with random weights (norms 1 + N(0, 0.1^2) so they matter), saved by
    mlx-lm's own writer with a small word-level tokenizer (mlx_lm.convert loads one)."""
    import importlib

    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = CONFIGS[kind]
    module = importlib.import_module(f"mlx_lm.models.{kind}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(tree_map_with_path(lambda k, v: v + 0.1 * mx.random.normal(v.shape) if "norm" in k else v,
                                    model.parameters()))  # fmt: skip
    mx.eval(model.parameters())
    directory.mkdir(parents=True)
    save_model(directory, model)
    save_config(dict(config), config_path=directory / "config.json")
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(config["vocab_size"])}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def mlx_convert(source: Path, out: Path, flags: list[str]) -> Path:
    command = [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(source), "--mlx-path", str(out), "-q"]
    done = subprocess.run(command + flags, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx")
    sources = {kind: write_mlx_model(kind, root / f"{kind}-fp32") for kind in CONFIGS}
    dirs = {name: mlx_convert(sources[kind], root / name, flags) for name, (kind, flags) in CONVERSIONS.items()}
    return sources, dirs


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_dequantize_is_mx_dequantize_bit_for_bit(bits, dtype):
    rng = np.random.default_rng(bits)
    for group in (32, 64, 128):
        w = mx.array(rng.standard_normal((6, 256)).astype(np.float32)).astype(dtype)
        packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
        want = np.array(mx.dequantize(packed, scales, biases, group_size=group, bits=bits).astype(mx.float32))
        got = dequantize(np.array(packed), _numpy(scales), _numpy(biases), Quantization(bits, group))
        np.testing.assert_array_equal(got, want, err_msg=f"{bits}-bit g{group} {dtype}")


def _numpy(array: mx.array) -> np.ndarray:
    """An mlx array in numpy with its dtype (bf16 through ml_dtypes)."""
    import ml_dtypes

    if array.dtype == mx.bfloat16:
        return np.array(array.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.array(array)


def _module_quantization(config: dict, module: str) -> tuple[int, int]:
    """(bits, group_size) of ``module`` as config.json records them (a per-module entry, else the default)."""
    quant = config["quantization"]
    entry = quant.get(module, quant)
    return entry["bits"], entry["group_size"]


def test_every_quantized_weight_reads_as_mx_dequantize_of_its_stored_arrays(converted):
    sources, dirs = converted
    seen_bits = set()
    for name, directory in dirs.items():
        config = json.loads((directory / "config.json").read_text())
        stored = {}
        for file in sorted(directory.glob("*.safetensors")):
            stored.update(mx.load(str(file)))
        ck = load_checkpoint(directory)
        assert (ck.format, ck.quantized) == ("mlx", True)
        modules = sorted(k.removesuffix(".scales") for k in stored if k.endswith(".scales"))
        assert modules, name
        for module in modules:
            bits, group = _module_quantization(config, module)
            seen_bits.add(bits)
            want = mx.dequantize(stored[f"{module}.weight"], stored[f"{module}.scales"], stored[f"{module}.biases"],
                                 group_size=group, bits=bits)  # fmt: skip
            np.testing.assert_array_equal(ck.tensors.read_float32(f"{module}.weight"),
                                          np.array(want.astype(mx.float32)), err_msg=f"{name} {module}")  # fmt: skip
    assert {3, 4, 6, 8} <= seen_bits  # the mixed recipe's per-layer 3- and 6-bit overrides were read as such


def test_the_attention_layers_are_the_fp32_source_within_the_quantizations_error(converted):
    sources, dirs = converted
    errors = {}
    for name, directory in dirs.items():
        kind = CONVERSIONS[name][0]
        got, want = load_checkpoint(directory), load_checkpoint(sources[kind])
        assert got.geometry.to_dict() == want.geometry.to_dict()
        config = json.loads((directory / "config.json").read_text())
        for layer in (0, 1):
            a, b = got.layer(layer), want.layer(layer)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                bits, _ = _module_quantization(config, f"model.layers.{layer}.self_attn.{proj}")
                error = np.linalg.norm(getattr(a, proj) - getattr(b, proj)) / np.linalg.norm(getattr(b, proj))
                errors[(name, layer, proj)] = error
                assert 0 < error < SOURCE_ERROR_BOUND.get(bits, 0.1), (name, layer, proj, error)
            if a.q_norm is not None:  # qwen3: the norms are stored unquantized
                np.testing.assert_array_equal(a.q_norm, b.q_norm)
    print({k: f"{v:.2e}" for k, v in errors.items()})


def test_an_mlx_4bit_checkpoint_exports_and_verifies_with_its_controls_failing(converted, tmp_path):
    sources, dirs = converted
    export_sidecars(load_checkpoint(dirs["q4g64"]), tmp_path / "sc", 8, [0, 8], jobs=1)
    for layer in (0, 1):
        pkg = tmp_path / "sc" / f"layer_{layer}.mlpackage"
        meta = read_sidecar_metadata(pkg)
        assert meta.source_format == {
            "format": "mlx",
            "attention_storage": ["MLX affine 4-bit g64 (BF16 scales)"],
            "quantized": True,
            "sidecar_weights": "the dequantized attention projections (fp16)",
        }
        report = verify_package(pkg, progress=False)
        controls = [c for c in report.comparisons if c.control]
        assert report.passed and not report.vacuous and controls and all(c.passed for c in controls)
    with pytest.raises(AnelabInputError, match=r"tensor model\.layers\.1\.self_attn\.\w_proj\.weight differs"):
        verify_package(tmp_path / "sc" / "layer_1.mlpackage", load_checkpoint(sources["llama"]), progress=False)


def test_the_whole_model_runs_from_an_mlx_checkpoint(converted):
    sources, dirs = converted
    prompt = np.arange(1, 24) * 11 % 256
    got = run_arm(load_model(dirs["q8g64"]), prompt, Arm("reference"), decode=3)
    want = run_arm(load_model(sources["llama"]), prompt, Arm("reference"), decode=3)
    assert np.linalg.norm(got.logits[0] - want.logits[0]) < 0.05 * np.linalg.norm(want.logits[0])
    np.testing.assert_array_equal(got.tokens[:1], want.tokens[:1])


def test_a_quantized_embedding_without_its_biases_is_far_off(converted, tmp_path):
    """Negative control for the test above: the same checkpoint with the embedding's group biases zeroed."""
    sources, dirs = converted
    edited = shutil.copytree(dirs["q8g64"], tmp_path / "edited")
    weights = mx.load(str(edited / "model.safetensors"))
    weights["model.embed_tokens.biases"] = mx.zeros_like(weights["model.embed_tokens.biases"])
    mx.save_safetensors(str(edited / "model.safetensors"), weights, metadata={"format": "mlx"})
    prompt = np.arange(1, 24) * 11 % 256
    got = run_arm(load_model(edited), prompt, Arm("reference"), decode=1)
    want = run_arm(load_model(sources["llama"]), prompt, Arm("reference"), decode=1)
    assert np.linalg.norm(got.logits[0] - want.logits[0]) > 0.2 * np.linalg.norm(want.logits[0])


def test_plan_and_decide_take_an_mlx_checkpoint(converted, tmp_path, capsys):
    _, dirs = converted
    assert main(["plan", "--checkpoint", str(dirs["q4g32"]), "--prompt-tokens", "64", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["full_layers"], plan["model_type"], plan["num_heads"]) == ([0, 1], "llama", 4)
    out = tmp_path / "decide"
    argv = ["decide", str(dirs["q4g32"]), "--prompt-tokens", "64", "--chunk", "32", "--design", "dense"]
    assert main([*argv, "--out", str(out)]) == 0
    evidence = json.loads((out / "decision.json").read_text())
    assert evidence["checkpoint"]["dtype"] == "MLX affine 4-bit g32 (F16 scales)"


def test_other_modes_and_unmodelled_entries_are_refused_in_one_line(converted, tmp_path):
    sources, dirs = converted
    mxfp4 = mlx_convert(sources["llama"], tmp_path / "mxfp4", ["--q-mode", "mxfp4"])
    with pytest.raises(AnelabInputError, match="mode 'mxfp4'") as refused:
        load_checkpoint(mxfp4)
    assert "\n" not in str(refused.value)
    edited = tmp_path / "edited"
    shutil.copytree(dirs["q4g64"], edited)
    config = json.loads((edited / "config.json").read_text())
    config["quantization"]["model.layers.0.self_attn.q_proj"] = False
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(AnelabInputError, match="q_proj.scales exists but config.json says"):
        load_checkpoint(edited).layer(0)
