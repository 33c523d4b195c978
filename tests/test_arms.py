"""Whole-model arms: the sidecar arm equals the reference arm within fp16 noise on every layer, a perturbed
sidecar arm diverges from its layer on, mask arms separate past the indexer's window, bad input is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from anelab.arms.compare import NOISE, compare_arms, compare_runs
from anelab.arms.run import Arm, Indexer, Perturbation, run_arm
from anelab.arms.sidecars import open_sidecars, runtime_runner
from anelab.checkpoints.model import load_model, write_model_checkpoint
from anelab.cli import main
from anelab.core.decoder import random_head_weights, random_layer_weights
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.weights import random_attention_weights
from anelab.runtimes.fake import FakeFunction, FakeRuntime
from anelab.sidecar.export import export_sidecars

CHUNK, PROMPT, DECODE = 8, 13, 4  # two chunk starts (0, 8); the second chunk is partial (5 rows)
GEOMETRY = AttentionGeometry(
    variant="qwen3",
    hidden_size=32,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    num_layers=2,
    full_attention_layers=(0, 1),
)


def _model(path, seed=0, tied=False):
    g = GEOMETRY
    attention = {i: random_attention_weights(g, i, seed) for i in g.full_attention_layers}
    layers = {i: random_layer_weights(i, g.hidden_size, 48, seed) for i in range(g.num_layers)}
    head = random_head_weights(64, g.hidden_size, seed, tied=tied)
    return write_model_checkpoint(path, g, attention, layers, head, model_type="qwen3"), layers, head


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("arms")
    checkpoint, layers, head = _model(root / "model")
    export_sidecars(checkpoint, root / "sidecars", CHUNK, [0, CHUNK])
    model = load_model(checkpoint)
    prompt = np.random.default_rng(3).integers(0, model.vocab_size, PROMPT)
    reference = run_arm(model, prompt, Arm("reference"), decode=DECODE, chunk=CHUNK)
    return root, model, prompt, reference, layers, head


def test_the_writer_round_trips_the_whole_model(setup):
    _, model, _, _, layers, head = setup
    assert model.vocab_size == 64 and not model.tied
    for i, w in layers.items():
        read = model.layer(i)
        assert np.array_equal(read.input_norm.weight, w.input_norm.weight) and np.array_equal(
            read.mlp.down_proj, w.mlp.down_proj
        )
    assert np.array_equal(model.head().lm_head, head.lm_head)


def test_sidecar_arm_equals_reference_within_fp16_noise_on_every_layer(setup):
    root, model, prompt, reference, _, _ = setup
    calls = []
    sidecars = open_sidecars(root / "sidecars", model, PROMPT)
    numpy_run = sidecars.runner
    sidecars.runner = lambda layer, start, rows, inputs: (
        calls.append((layer, start, rows)) or numpy_run(layer, start, rows, inputs)
    )
    run = run_arm(model, prompt, Arm("sidecar", "sidecar"), decode=DECODE, sidecars=sidecars)
    cmp = compare_runs(reference, run)
    # layer-major: every chunk start of layer 0 (its cache threaded), then of layer 1; the last chunk partial
    assert calls == [(0, 0, 8), (0, 8, 5), (1, 0, 8), (1, 8, 5)]
    assert all(0 < d < NOISE for d in cmp.layer_diffs), cmp.layer_diffs  # > 0: really served by the package
    assert max(cmp.step_logits_diffs) < NOISE
    assert cmp.first_divergent_layer is None and cmp.greedy_agreement == 1.0


@pytest.mark.parametrize(
    "arm",
    [
        Arm("mask dropped", "sidecar", perturbation=Perturbation(1, "mask_dropped")),
        Arm("rope shifted", "reference", perturbation=Perturbation(1, "rope_shifted")),
    ],
    ids=["sidecar-mask-dropped", "reference-rope-shifted"],
)
def test_a_perturbed_layer_diverges_from_that_layer_on(setup, arm):
    root, model, prompt, reference, _, _ = setup
    sidecars = open_sidecars(root / "sidecars", model, PROMPT)
    cmp = compare_runs(reference, run_arm(model, prompt, arm, decode=DECODE, sidecars=sidecars))
    assert cmp.layer_diffs[0] < NOISE
    assert cmp.layer_diffs[1] > 2 * NOISE
    assert cmp.first_divergent_layer == 1
    assert cmp.prompt_logits_diff > NOISE


def test_mask_arms_separate_only_past_the_dense_exact_window(setup):
    root, model, prompt, _, _, _ = setup
    sidecars = open_sidecars(root / "sidecars", model, PROMPT)

    def pair(indexer):
        folded = run_arm(model, prompt, Arm("f", "sidecar", indexer, fold=True), decode=DECODE, sidecars=sidecars)
        causal = run_arm(model, prompt, Arm("c", "sidecar", indexer, fold=False), decode=DECODE, sidecars=sidecars)
        return compare_runs(folded, causal)

    inside = pair(Indexer(kept_blocks=8, compress_ratio=4))  # window 35 keys >= prompt + decode
    assert max(inside.layer_diffs) == 0.0 and inside.prompt_logits_diff == 0.0
    past = pair(Indexer(kept_blocks=1, compress_ratio=4))  # window 7 keys: rows 7.. drop keys
    assert past.first_divergent_layer == 0 and past.prompt_logits_diff > NOISE


def test_runtime_runner_loads_one_function_per_chunk_start(setup):
    root, model, prompt, _, _, _ = setup
    g = model.geometry
    outputs = {
        "attn_out": np.zeros((CHUNK, g.hidden_size), np.float16),
        "k_chunk": np.zeros((g.num_kv_heads, CHUNK, g.head_dim), np.float16),
        "v_chunk": np.zeros((g.num_kv_heads, CHUNK, g.head_dim), np.float16),
    }
    fake = FakeRuntime(default=FakeFunction(outputs=outputs))
    sidecars = open_sidecars(root / "sidecars", model, PROMPT)
    sidecars.runner = runtime_runner(sidecars, compute_units="cpu_only", runtime=fake)
    run_arm(model, prompt, Arm("sidecar", "sidecar"), decode=2, sidecars=sidecars)
    assert sorted((p.split("/")[-1], f) for p, f, _ in fake.loads) == [
        ("layer_0.mlpackage", "h0"),
        ("layer_0.mlpackage", "h8"),
        ("layer_1.mlpackage", "h0"),
        ("layer_1.mlpackage", "h8"),
    ]


def _refused(argv, capsys, match):
    capsys.readouterr()  # drop the export progress bars
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err


def _drop_source_tensors(package: Path) -> None:
    from anelab.sidecar.format import META, read_raw_metadata, write_package_metadata

    meta = {k: v for k, v in read_raw_metadata(package).items() if k != META["source_tensors"]}
    staged = package.with_name("legacy-" + package.name)
    write_package_metadata(package, staged, {**meta, META["source_tensors"]: "null"})
    shutil.rmtree(package)
    staged.rename(package)


def test_bad_sidecars_are_refused_in_one_line(setup, capsys):
    root, model, _, _, _, _ = setup
    ckpt, good = str(model.path), root / "sidecars"
    base = [ckpt, "--prompt-tokens", str(PROMPT), "--decode", "2", "--sidecars"]
    missing = root / "missing"
    missing.mkdir(exist_ok=True)
    shutil.copytree(good / "layer_0.mlpackage", missing / "layer_0.mlpackage", dirs_exist_ok=True)
    _refused(["compare-arms", *base, str(missing)], capsys, "layer_1.mlpackage is missing")
    mixed = root / "mixed"
    if not mixed.exists():
        export_sidecars(model.path, mixed, CHUNK // 2, [0], layers=[1])
        shutil.copytree(good / "layer_0.mlpackage", mixed / "layer_0.mlpackage")
    _refused(["compare-arms", *base, str(mixed)], capsys, "chunk width differs between packages")
    other = root / "other"
    if not other.exists():
        other_ckpt, _, _ = _model(root / "other-model", seed=1)
        export_sidecars(other_ckpt, other, CHUNK, [0], layers=[0])
        twin, _, _ = _model(root / "twin" / "model", seed=2)  # same geometry and directory name, other weights
        export_sidecars(twin, root / "twin-sidecars", CHUNK, [0, CHUNK])
        for layer in (0, 1):  # exported before packages recorded tensor digests: only h0's numbers can tell
            _drop_source_tensors(root / "twin-sidecars" / f"layer_{layer}.mlpackage")
    _refused(["compare-arms", *base, str(other)], capsys, "tensor model.layers.0.self_attn.k_norm.weight differs")
    _refused(["compare-arms", *base, str(root / "twin-sidecars")], capsys, "does not compute layer 0")
    _refused(["compare-arms", ckpt, "--prompt-tokens", "20", "--sidecars", str(good)], capsys, "lacks function h16")
    _refused(["compare-arms", ckpt, "--sidecars", str(good)], capsys, "exactly one of --prompt-tokens")


def test_cli_prints_the_per_layer_table_and_summary(setup, capsys):
    root, model, _, _, _, _ = setup
    argv = ["compare-arms", str(model.path), "--sidecars", str(root / "sidecars"), "--prompt-tokens", str(PROMPT)]
    assert main([*argv, "--decode", "3", "--kept-blocks", "1"]) == 0
    out = capsys.readouterr().out
    assert "sidecar vs reference" in out and "causal-only vs folded" in out and "greedy agreement" in out
    assert len([line for line in out.splitlines() if line.strip().split(" ")[0] in ("0", "1")]) == 2


def test_compare_arms_without_sidecars_refuses_a_sidecar_arm(setup):
    _, model, prompt, _, _, _ = setup
    with pytest.raises(AnelabInputError, match="runs on the sidecars"):
        run_arm(model, prompt, Arm("sidecar", "sidecar"), decode=1)
    report = compare_arms(model.path, None, PROMPT, decode=2, indexer=Indexer(1, 4), chunk=CHUNK)
    assert [(p.a, p.b) for p in report.pairs] == [("folded", "causal-only")]


def test_compare_arms_on_the_embedded_dense_default(tmp_path, monkeypatch, capsys):
    """The Done-when form: the dense sibling and its sidecars are generated on first use, and the table prints."""
    monkeypatch.chdir(tmp_path)
    argv = ["compare-arms", "default-dense", "--sidecars", "sc", "--prompt-tokens", "16", "--decode", "2", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    (pair,) = out["pairs"]
    assert (pair["a"], pair["b"]) == ("reference", "sidecar") and len(pair["layer_diffs"]) == 4
    assert max(pair["layer_diffs"]) < NOISE and pair["greedy_agreement"] == 1.0
    assert (tmp_path / "build" / "checkpoints" / "anelab-tiny-dense" / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "sc").iterdir()) == [f"layer_{i}.mlpackage" for i in range(4)]
