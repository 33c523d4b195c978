"""Real text in the studies (``anelab.arms.real_text``, the real-text parts of ``mask_fold`` and
``whole_model_arms``) and verification on real activations (``verify_cases`` with ``activations``).

Fast: a tiny two-layer model written here, short prompts; each check with a negative control."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from conftest import random_whole_model

from anelab.arms import real_text
from anelab.arms.arm_comparison import NOISE
from anelab.arms.arm_runs import Arm, Perturbation, run_arms
from anelab.arms.sidecars import open_sidecars
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.whole_model import load_model
from anelab.core import reference
from anelab.core.decoder import finish_layer
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.paths import REPO_ROOT
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD
from anelab.sidecar.checks.verify_cases import activation_inputs, check_activations, verify_per_history_package
from anelab.sidecar.drivers import prompt_reference
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.mil.evaluate import SavedPackage
from anelab.studies import mask_fold, whole_model_arms

CHUNK, PROMPT, DECODE, RATIO = 8, 40, 4, 4
FROZEN_README_SHA256 = "b0f99bcea9856674d7f0dbd8b9a5552d97ee11f1ce859697e04ed919b48fd645"  # a615004:README.md
GEOMETRY = AttentionGeometry(variant="qwen3", hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                             num_layers=2, full_attention_layers=(0, 1))  # fmt: skip


class WordTokenizer:
    """A stand-in tokenizer: one id per word of a fixed vocabulary (ids wrap), decode joins ``w<id>``."""

    def encode(self, text: str) -> np.ndarray:
        return np.array([sum(map(ord, w)) % 64 for w in text.split()], dtype=np.int64)

    def decode(self, ids) -> str:
        return " ".join(f"w{int(i)}" for i in ids)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("real_text")
    checkpoint = random_whole_model(root / "model", GEOMETRY, intermediate=48, vocab=64)
    model = load_model(checkpoint)
    prompt = real_text.docs_prompt(WordTokenizer(), PROMPT)
    return root, checkpoint, model, prompt


# ---- the prompt from the docs ----------------------------------------------------------------------------------
def test_docs_text_is_prose_from_the_readme():
    text = real_text.docs_text()
    assert "Neural Engine" in text  # the README's own words (frozen at a615004 in docs/prompt/)
    assert "```" not in text and "make reproduce   #" not in text  # its code blocks are dropped
    assert not any(line.lstrip().startswith("|") for line in text.splitlines())  # and its tables


def test_the_prompt_text_is_the_frozen_readme_the_figures_were_drawn_from():
    """The real-text prompt is the README as it stood at a615004, byte for byte (``git show a615004:README.md``):
    the committed real-text figures and the numbers notebooks 02 and 07 quote were drawn from it. Control: the
    README of today (a newcomer's page) is another text, and would give other numbers."""
    frozen = REPO_ROOT / real_text.DOCS_SOURCE
    assert hashlib.sha256(frozen.read_bytes()).hexdigest() == FROZEN_README_SHA256
    assert real_text.docs_text().startswith("# anelab\n\nEvidence for one decision")
    assert hashlib.sha256((REPO_ROOT / "README.md").read_bytes()).hexdigest() != FROZEN_README_SHA256
    assert real_text.docs_text("README.md")[:2000] != real_text.docs_text()[:2000]


def test_docs_prompt_refuses_what_the_docs_cannot_give():
    tok = WordTokenizer()
    assert real_text.docs_prompt(tok, 5).tolist() == tok.encode(real_text.docs_text())[:5].tolist()
    with pytest.raises(AnelabInputError, match="holds"):
        real_text.docs_prompt(tok, 10**7)
    with pytest.raises(AnelabInputError, match="not a Markdown file"):
        real_text.docs_text("pyproject.toml")


def test_top2_margins_is_the_gap_between_the_two_largest_logits():
    assert real_text.top2_margins(np.array([[1.0, 3.0, 2.5], [0.0, 0.0, 0.0]])) == [0.5, 0.0]


def test_layer_kind_summary_tells_sliding_layers_from_global_ones():
    """By hand on a 6-layer Gemma 3-like geometry (layers 0-4 slide, 5 is global); controls: a wrong count of
    differences is refused, and a geometry with no sliding layer puts every layer under "global"."""
    windowed = AttentionGeometry(variant="qwen3", hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                                 num_layers=6, full_attention_layers=tuple(range(6)), sliding_window=8,
                                 sliding_layers=(0, 1, 2, 3, 4))  # fmt: skip
    diffs = [1e-4, 3e-4, 2e-4, 5e-4, 4e-4, 9e-3]
    summary = whole_model_arms.layer_kind_summary(windowed, diffs)
    assert summary == {"sliding": {"layers": [0, 1, 2, 3, 4], "max": 5e-4, "median": 3e-4},
                       "global": {"layers": [5], "max": 9e-3, "median": 9e-3}}  # fmt: skip
    with pytest.raises(AnelabInputError, match="6 layers"):
        whole_model_arms.layer_kind_summary(windowed, diffs[:5])
    dense = whole_model_arms.layer_kind_summary(GEOMETRY, [1e-4, 2e-4])
    assert list(dense) == ["global"] and dense["global"]["max"] == 2e-4


# ---- real attention inputs --------------------------------------------------------------------------------------
def test_attention_inputs_are_what_each_layer_attends_to(setup):
    """Layer 1's inputs through its attention and MLP give the reference arm's hidden state after layer 1;
    control: layer 0's inputs (the wrong layer's rows) do not."""
    _, _, model, prompt = setup
    rows = real_text.attention_inputs(model, prompt, [0, 1], chunk=CHUNK)
    hidden = run_arms(model, prompt, [Arm("reference")], decode=1, chunk=CHUNK)["reference"].hidden
    layer = model.layer(1)

    def after_layer_1(inputs):
        attn = prompt_reference(inputs, model.attention(1), model.geometry).attn_out
        return finish_layer(hidden[0], attn.astype(np.float32), layer, model.eps)

    def error(x):
        return np.linalg.norm(x - hidden[1]) / np.linalg.norm(hidden[1])

    assert rows[1].shape == (PROMPT, GEOMETRY.hidden_size)
    assert error(after_layer_1(rows[1])) < 1e-5
    assert error(after_layer_1(rows[0])) > 0.1
    with pytest.raises(AnelabInputError, match="layers must be within"):
        real_text.attention_inputs(model, prompt, [2])


def test_verify_takes_real_rows_in_place_of_random_ones(setup):
    """The chunk rows of h<H> are rows H .. H+C-1 and the cache the reference's projection of rows 0 .. H-1."""
    _, _, model, prompt = setup
    acts = check_activations(real_text.attention_inputs(model, prompt, [0], chunk=CHUNK)[0], model.geometry, 16)
    inputs = activation_inputs("h8", CHUNK, model.attention(0), model.geometry, acts)
    k, v = reference.history_kv(acts[:8], model.attention(0), model.geometry, "fp64")
    assert np.array_equal(inputs.hidden, acts[8:16])
    assert np.array_equal(inputs.k_history, k.astype(np.float16)) and np.array_equal(
        inputs.v_history, v.astype(np.float16)
    )
    with pytest.raises(AnelabInputError, match="longest history"):
        check_activations(acts[:15], model.geometry, 16)
    with pytest.raises(AnelabInputError, match="overflow fp16"):
        check_activations(np.full((16, 32), 1e6), model.geometry, 16)


# ---- the verify margin --------------------------------------------------------------------------------------------
def test_verify_margins_on_real_activations_pass_and_a_perturbed_sidecar_fails(setup, monkeypatch):
    root, checkpoint, model, prompt = setup
    acts = real_text.attention_inputs(model, prompt, [0, 1], chunk=CHUNK)
    rows = whole_model_arms.verify_margins(checkpoint, root / "margins", ["fp16", "int8"], [0, 1], chunk=CHUNK,
                                           activations=acts, label="tiny")  # fmt: skip
    assert [(r.mode, r.inputs, r.layer) for r in rows][:2] == [
        ("fp16", "random rows", 0),
        ("fp16", "prompt activations", 0),
    ]
    assert len(rows) == 8 and all(r.passed and 0 < r.error < r.threshold and r.control_margin > 1 for r in rows)
    assert all((r.compression is None) == (r.mode == "fp16") for r in rows)
    summary = whole_model_arms.margin_summary(rows)
    assert summary[("tiny", "fp16", "prompt activations")]["layers"] == 2
    int8 = summary[("tiny", "int8", "random rows")]
    assert 0 < int8["compression_median"] <= int8["compression_max"] and "compression_bound" not in int8
    # negative control: a sidecar whose attention output is off by 3 % must land above the threshold
    package = root / "margins" / "fp16" / "layer_0.mlpackage"
    evaluate = SavedPackage.evaluate

    def perturbed(self, function, feed, **options):
        out = dict(evaluate(self, function, feed, **options))
        out["attn_out"] = out["attn_out"] * np.float16(1.03)
        return out

    monkeypatch.setattr(SavedPackage, "evaluate", perturbed)
    report = verify_per_history_package(package, load_checkpoint(checkpoint), progress=False, activations=acts[0])
    row = whole_model_arms.margin_row(report, "tiny", "fp16", "prompt activations")
    assert row.error > RELATIVE_ERROR_THRESHOLD and not row.passed


# ---- the studies' real-text comparisons ------------------------------------------------------------------------------
def test_fold_on_real_text_separates_the_logits_and_a_covering_budget_does_not(setup):
    """A budget whose window is below the prompt: the causal-only arm's logits move beyond the threshold
    (the separation); control: a budget covering the prompt leaves the two arms identical."""
    _, _, model, prompt = setup
    tok = WordTokenizer()
    tight = mask_fold.real_fold_comparison(model, prompt, tok, 2, RATIO, decode=DECODE, chunk=CHUNK)
    sep = mask_fold.separation(tight)
    assert sep["prompt_logits_diff"] > NOISE and sep["first_layer_beyond_threshold"] == 0
    assert tight.text_a.startswith("w") and len(tight.margins) == DECODE
    covering = mask_fold.real_fold_comparison(model, prompt, tok, PROMPT, RATIO, decode=DECODE, chunk=CHUNK)
    sep = mask_fold.separation(covering)
    assert sep["text_identical"] and sep["agreeing_steps"] == DECODE
    assert sep["max_logits_diff_while_agreeing"] == 0.0 and sep["agreeing_steps_beyond_threshold"] == 0
    assert covering.text_a == covering.text_b


def test_sidecar_on_real_text_stays_at_fp16_noise_and_a_broken_layer_does_not(setup):
    root, checkpoint, model, prompt = setup
    export_sidecars(load_checkpoint(checkpoint), root / "sidecars", CHUNK, list(range(0, PROMPT, CHUNK)))
    sidecars = open_sidecars(root / "sidecars", model, PROMPT)
    tok = WordTokenizer()
    pair = whole_model_arms.real_sidecar_comparison(model, prompt, sidecars, tok, decode=DECODE)
    assert pair.comparison.identical_text and pair.text_a == pair.text_b
    assert 0 < pair.comparison.prompt_logits_diff < NOISE and all(0 < d < NOISE for d in pair.comparison.layer_diffs)
    broken = Arm("sidecar", "sidecar", perturbation=Perturbation(0, "mask_dropped"))
    control = real_text.run_pair(model, prompt, (Arm("reference"), broken), tok, decode=DECODE, sidecars=sidecars)
    assert control.comparison.first_divergent_layer == 0 and control.comparison.prompt_logits_diff > NOISE


def test_docs_prompt_through_the_real_tokenizer_reads_back_as_the_readme(real_gguf):
    """default-real's own tokenizer (from the GGUF metadata): the prompt decodes to the README's first words;
    control: the same ids shifted by one decode to other text."""
    from anelab.checkpoints.checkpoint import load_checkpoint

    tokenizer = load_checkpoint(real_gguf).tokenizer()
    ids = real_text.docs_prompt(tokenizer, 32)
    text = real_text.docs_text()
    assert ids.size == 32 and text.startswith(tokenizer.decode(ids)) and len(tokenizer.decode(ids)) > 60
    assert not text.startswith(tokenizer.decode(ids + 1))


# ---- verify --real-text ----------------------------------------------------------------------------------------
def test_verify_real_text_feeds_each_layer_its_own_real_rows(real_gguf, tmp_path, capsys, monkeypatch):
    """``verify DIR --real-text N`` on default-real: every package's cases take its own layer's rows of the first N
    README tokens (a spy sees [N, D] rows, a different array per layer) and the report says so; control: the
    same packages on random rows report other errors and say "random fp16 rows"."""
    import json

    from anelab.cli import main
    from anelab.sidecar.checks import verify as verify_module

    out = tmp_path / "sidecars"
    export_sidecars(load_checkpoint(real_gguf), out, 16, [0, 16], [0, 1], jobs=1)
    fed = {}
    inner = verify_module.verify_package

    def spy(package, checkpoint=None, **kwargs):
        fed[str(package)] = kwargs.get("activations")
        return inner(package, checkpoint, **kwargs)

    monkeypatch.setattr(verify_module, "verify_package", spy)
    argv = ["verify", str(out), "--layers", "0,1", "--json"]
    assert main([*argv, "--real-text", "32"]) == 0
    real = json.loads(capsys.readouterr().out)
    said = "the first 32 tokens of docs/prompt/readme-a615004.md"  # the README frozen at a615004
    assert all(said in v["report"]["inputs"] for v in real["layers"])
    arrays = [fed[str(out / f"layer_{layer}.mlpackage")] for layer in (0, 1)]
    assert all(a.shape == (32, 576) for a in arrays) and not np.array_equal(arrays[0], arrays[1])
    assert main(argv) == 0  # control: random rows
    random_rows = json.loads(capsys.readouterr().out)
    assert all(v["report"]["inputs"] == "random fp16 rows" for v in random_rows["layers"])
    worst = [[c["worst"] for c in v["report"]["comparisons"]] for v in real["layers"]]
    assert worst != [[c["worst"] for c in v["report"]["comparisons"]] for v in random_rows["layers"]]


def test_verify_real_text_refuses_what_it_cannot_feed(setup, real_gguf, tmp_path, capsys):
    """One line each: a checkpoint without a tokenizer, --jobs above 1, --compute-units, a prompt shorter than a
    function's rows, and (through the API) a stateful package."""
    from anelab.cli import main
    from anelab.sidecar.checks.verify import verify_package
    from anelab.sidecar.designs import SidecarRequest
    from anelab.sidecar.export import export_request

    _, checkpoint, _, _ = setup
    export_sidecars(load_checkpoint(checkpoint), tmp_path / "tiny", CHUNK, [0, CHUNK], jobs=1)
    export_sidecars(load_checkpoint(real_gguf), tmp_path / "real", 16, [0, 16], [0], jobs=1)
    cases = [
        (["verify", str(tmp_path / "tiny"), "--real-text", "16"], "needs a checkpoint with a tokenizer"),
        (["verify", str(tmp_path / "real"), "--layers", "0", "--real-text", "32", "--jobs", "2"], "drop --jobs"),
        (
            ["verify", str(tmp_path / "real"), "--real-text", "32", "--compute-units", "cpu_only"],
            "drop --compute-units",
        ),
        (["verify", str(tmp_path / "real" / "layer_0.mlpackage"), "--real-text", "20"], "longest history"),
    ]
    capsys.readouterr()  # the exports' progress bars
    for argv, words in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err  # beside progress bars (the prompt's prefill), one error line
        errors = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("anelab: error")]
        assert len(errors) == 1 and words in errors[0] and "Traceback" not in err, err
    request = SidecarRequest(CHUNK, None, "stateful", capacity=2 * CHUNK)
    [stateful] = export_request(load_checkpoint(checkpoint), tmp_path / "stateful", request, [0], jobs=1)
    with pytest.raises(AnelabInputError, match="per-history designs"):
        verify_package(stateful.package, load_checkpoint(checkpoint), activations=np.zeros((2 * CHUNK, 32), np.float32))
