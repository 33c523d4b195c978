"""Whole-model arms: the sidecar arm equals the reference arm within fp16 noise on every layer, a perturbed
sidecar arm diverges from its layer on, mask arms separate past the indexer's window, bad input is refused; a
greedy divergence at a built tie is a near-tie and a wrong mask's is a divergence; resident and streamed weights
give the same runs bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from anelab.arms.arm_comparison import NOISE, compare_arms, compare_runs
from anelab.arms.arm_runs import Arm, Indexer, Perturbation, run_arm
from anelab.arms.sidecars import open_sidecars, runtime_runner
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.whole_model import load_model, write_model_checkpoint
from anelab.cli import main
from anelab.core.decoder import random_head_weights, random_layer_weights
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.weights import random_attention_weights
from anelab.runtimes.coreml.coreml_fake import FakeFunction, FakeRuntime
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
    export_sidecars(load_checkpoint(checkpoint), root / "sidecars", CHUNK, [0, CHUNK])
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


def test_arms_in_processes_of_their_own_give_the_runs_of_one_process_bit_for_bit(setup, monkeypatch):
    """On two cores or more the arms run in forked processes of their own (``arms.arm_runs.arm_groups``), one BLAS
    thread each; every logit, token and per-layer difference is the one a single process gives on its own BLAS
    threads (a one-row product, a prompt's last chunk of one row here, runs on one thread either way)."""
    import anelab.arms.arm_runs as arms_run
    from anelab.arms.resident import weights_for_run
    from anelab.core.parallel import available_cores

    root, model, prompt, _, _, _ = setup
    prompt = prompt[: CHUNK + 1]  # a last chunk of one row
    _, weights = weights_for_run(model)
    sidecars = open_sidecars(root / "sidecars", model, prompt.size)
    assert available_cores() >= 2 and len(arms_run.arm_groups(model, weights, 2, prompt.size, "layer", sidecars)) == 2
    arms = [Arm("reference"), Arm("sidecar", "sidecar")]
    pairs = (("reference", "sidecar"),)
    options = dict(decode=DECODE, sidecars=sidecars, layer_pairs=pairs, keep_hidden=False)  # as compare_arms runs
    apart = arms_run.run_arms(model, prompt, arms, **options)
    monkeypatch.setattr(arms_run, "arm_groups", lambda model, weights, n, *args: [list(range(n))])
    together = arms_run.run_arms(model, prompt, arms, **options)
    for name in ("reference", "sidecar"):
        a, b = apart[name], together[name]
        assert np.array_equal(a.logits, b.logits) and np.array_equal(a.tokens, b.tokens)
        assert a.layer_diffs == b.layer_diffs and a.hidden is None
    assert apart["sidecar"].layer_diffs["reference"][0] > 0  # control: the two arms' layers really differ
    assert not np.array_equal(apart["sidecar"].logits, apart["reference"].logits)


def test_a_sidecar_runner_that_keeps_what_its_caller_reads_keeps_the_arms_in_one_process(setup):
    """A call log or a runner of the caller's own (a Core ML runtime, a spy) would lose what a forked process
    records: such arms run in this process."""
    import anelab.arms.arm_runs as arms_run
    from anelab.arms.resident import weights_for_run

    root, model, prompt, _, _, _ = setup
    _, weights = weights_for_run(model)
    sidecars = open_sidecars(root / "sidecars", model, PROMPT)
    assert len(arms_run.arm_groups(model, weights, 2, PROMPT, "layer", sidecars)) == 2
    sidecars.calls = []
    assert arms_run.arm_groups(model, weights, 2, PROMPT, "layer", sidecars) == [[0, 1]]
    sidecars.calls, numpy_run = None, sidecars.runner
    sidecars.runner = lambda *a: numpy_run(*a)
    assert arms_run.arm_groups(model, weights, 2, PROMPT, "layer", sidecars) == [[0, 1]]
    assert arms_run.arm_groups(model, weights, 2, PROMPT, "chunk", None) == [[0, 1]]  # chunk-major: one process


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
        export_sidecars(load_checkpoint(model.path), mixed, CHUNK // 2, [0], layers=[1])
        shutil.copytree(good / "layer_0.mlpackage", mixed / "layer_0.mlpackage")
    _refused(["compare-arms", *base, str(mixed)], capsys, "chunk width differs between packages")
    other = root / "other"
    if not other.exists():
        other_ckpt, _, _ = _model(root / "other-model", seed=1)
        export_sidecars(load_checkpoint(other_ckpt), other, CHUNK, [0], layers=[0])
        twin, _, _ = _model(root / "twin" / "model", seed=2)  # same geometry and directory name, other weights
        export_sidecars(load_checkpoint(twin), root / "twin-sidecars", CHUNK, [0, CHUNK])
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
    report = compare_arms(model, None, PROMPT, decode=2, indexer=Indexer(1, 4), chunk=CHUNK)
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


# ---- near-ties: a greedy divergence at a tie is labelled so, a real one is not ------------------------------------
def _tied_at(run, step: int, margin: float):
    """``run`` (an ArmRun) with its logits at ``step`` made to hold a second token ``margin`` below its top one:
    (the edited run, that token)."""
    from dataclasses import replace

    logits = run.logits.copy()
    top = int(np.argmax(logits[step]))
    runner_up = (top + 1) % logits.shape[1]
    logits[step, runner_up] = logits[step, top] - np.float32(margin)
    return replace(run, logits=logits), runner_up


def test_a_divergence_at_a_built_tie_is_a_near_tie_and_agreement_excludes_it(setup):
    from dataclasses import replace

    from anelab.arms.arm_comparison import DIVERGENCE, NEAR_TIE

    root, model, prompt, reference, _, _ = setup
    sidecars = open_sidecars(root / "sidecars", model, PROMPT)
    arm = run_arm(model, prompt, Arm("sidecar", "sidecar"), decode=DECODE, sidecars=sidecars)
    assert np.array_equal(arm.tokens, reference.tokens)  # the unedited pair agrees
    noise = float(np.max(np.abs(arm.logits[0] - reference.logits[0])))
    assert noise > 0
    # the reference's top two logits at step 2 built 1e-6 apart, and the arm taking the other one there
    tied, other = _tied_at(reference, 2, 1e-6)
    tokens = arm.tokens.copy()
    tokens[2] = other
    (d,) = compare_runs(tied, replace(arm, tokens=tokens)).divergences
    assert (d.step, d.label, d.same_text_before) == (2, NEAR_TIE, True)
    assert d.reference_margin == pytest.approx(1e-6, rel=0.5) and d.arm_noise == pytest.approx(noise)
    cmp = compare_runs(tied, replace(arm, tokens=tokens))
    assert cmp.greedy_agreement == pytest.approx((DECODE - 1) / DECODE) and cmp.agreement_excluding_near_ties == 1.0
    assert cmp.closest[0] == 2 and cmp.closest[1] == pytest.approx(1e-6, rel=0.5)  # the built tie is the closest call
    assert compare_runs(reference, arm).closest[1] > 1e-3  # control: unedited, no step comes that near
    # control: the same swap where the reference's margin is 10x the arm's noise is a divergence
    wide, other = _tied_at(reference, 2, 20 * noise)
    tokens[2] = other
    (d,) = compare_runs(wide, replace(arm, tokens=tokens)).divergences
    assert d.label == DIVERGENCE
    assert compare_runs(wide, replace(arm, tokens=tokens)).agreement_excluding_near_ties < 1.0


def test_a_wrong_mask_divergence_is_labelled_a_divergence_even_at_a_small_margin(setup):
    from anelab.arms.arm_comparison import DIVERGENCE, label_divergences

    root, model, prompt, _, _, _ = setup
    sidecars = open_sidecars(root / "sidecars", model, PROMPT)
    reference = run_arm(model, prompt, Arm("reference"), decode=12, chunk=CHUNK)
    wrong = run_arm(model, prompt, Arm("mask dropped", "sidecar", perturbation=Perturbation(0, "mask_dropped")),
                    decode=12, sidecars=sidecars)  # fmt: skip
    cmp = compare_runs(reference, wrong)
    assert cmp.prompt_logits_diff > NOISE and cmp.divergences  # the wrong mask moves the text
    assert {d.label for d in cmp.divergences} == {DIVERGENCE}
    assert cmp.agreement_excluding_near_ties == cmp.greedy_agreement < 1.0
    first = cmp.divergences[0]
    assert first.same_text_before and first.reference_margin < 2 * first.arm_noise  # a margin the noise could swap
    # the rule's guard labels it: with the wrong arm's difference counted as fp16 noise it would be a near-tie
    loose = label_divergences(reference.logits, wrong.logits, reference.tokens, wrong.tokens, noise=10.0)
    assert loose[0].step == first.step and loose[0].label == "near-tie"


def test_near_ties_are_reported_in_the_table_and_json(setup, monkeypatch, capsys):
    import anelab.arms.arm_comparison as compare

    root, model, _, _, _, _ = setup
    real = compare.compare_runs

    def tie_at_step_1(a, b, noise=NOISE):
        tied, other = _tied_at(a, 1, 1e-7)
        b.tokens[1] = other
        return real(tied, b, noise)

    monkeypatch.setattr(compare, "compare_runs", tie_at_step_1)
    argv = ["compare-arms", str(model.path), "--sidecars", str(root / "sidecars"), "--prompt-tokens", str(PROMPT)]
    assert main([*argv, "--decode", "3"]) == 0
    out = capsys.readouterr().out
    assert "step 1: near-tie (reference top-2 margin" in out and "excluding 1 near-tie(s)" in out
    assert "near-tie: the reference's top-2 logit margin at the step is at most twice" in out
    assert main([*argv, "--decode", "3", "--json"]) == 0
    (pair,) = json.loads(capsys.readouterr().out)["pairs"]
    assert pair["near_ties"] == 1 and pair["greedy_agreement_excluding_near_ties"] == 1.0
    assert pair["divergences"][0]["label"] == "near-tie" and "near_tie_rule" in pair


def test_label_divergences_refuses_mismatched_logits():
    from anelab.arms.arm_comparison import label_divergences

    with pytest.raises(AnelabInputError, match="not one"):
        label_divergences(np.zeros((3, 5)), np.zeros((2, 5)), np.zeros(3, int), np.zeros(3, int))


# ---- resident or streamed weights: the same results, and said which -----------------------------------------------
def _counting(model, monkeypatch):
    """Count ModelCheckpoint.layer reads of ``model``'s class during a run."""
    from anelab.checkpoints.whole_model import ModelCheckpoint

    reads = []
    real = ModelCheckpoint.layer
    monkeypatch.setattr(ModelCheckpoint, "layer", lambda self, layer: reads.append(layer) or real(self, layer))
    return reads


def test_resident_and_streamed_weights_give_identical_runs(setup, monkeypatch, tmp_path):
    from anelab.arms.arm_runs import run_arms
    from anelab.arms.resident import RESIDENT, STREAMED

    root, model, prompt, _, _, _ = setup
    sidecars = open_sidecars(root / "sidecars", model, PROMPT)
    arms = [Arm("reference"), Arm("sidecar", "sidecar")]
    reads = _counting(model, monkeypatch)
    runs = {}
    for budget in (None, 0):
        reads.clear()
        runs[budget] = run_arms(model, prompt, arms, decode=DECODE, sidecars=sidecars, resident_budget=budget)
        runs[budget, "reads"] = list(reads)
    resident, streamed = runs[None], runs[0]
    assert resident["sidecar"].weights.mode == RESIDENT and streamed["sidecar"].weights.mode == STREAMED
    assert runs[None, "reads"] == [0, 1]  # resident: each layer read once for the whole run
    assert runs[0, "reads"] == [0, 1] * DECODE  # streamed: the prefill's read and one per decoded step after it
    for name in ("reference", "sidecar"):
        assert np.array_equal(resident[name].logits, streamed[name].logits)
        assert np.array_equal(resident[name].tokens, streamed[name].tokens)
        assert np.array_equal(resident[name].hidden, streamed[name].hidden)
    # control: the comparison sees a run of another model's weights
    other = load_model(_model(tmp_path / "seed-1-model", seed=1)[0])
    control = run_arms(other, prompt, arms[:1], decode=DECODE, chunk=CHUNK, resident_budget=0)
    assert not np.array_equal(control["reference"].logits, resident["reference"].logits)


def test_the_budget_picks_streamed_and_the_output_says_which(setup, capsys):
    from anelab.arms.resident import STREAMED, float32_bytes, plan_weights

    root, model, _, _, _, _ = setup
    size = float32_bytes(model)
    assert size == 4 * sum(int(np.prod(model.checkpoint.tensors.shape(n))) for n in model.checkpoint.tensors.names())
    assert plan_weights(model, size).mode == "resident" and plan_weights(model, size - 1).mode == STREAMED
    with pytest.raises(AnelabInputError, match="budget must be >= 0"):
        plan_weights(model, -1)
    argv = ["compare-arms", str(model.path), "--sidecars", str(root / "sidecars"), "--prompt-tokens", str(PROMPT)]
    assert main([*argv, "--decode", "2"]) == 0
    assert "weights resident (float32" in capsys.readouterr().out
    assert main([*argv, "--decode", "2", "--resident-budget", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weights"]["mode"] == STREAMED
    assert main([*argv, "--decode", "2", "--resident-budget", "-1"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
