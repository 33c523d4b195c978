"""The whole-model cost of a weight compression (``anelab.arms.compression_cost``): per-position negative
log-likelihood against the arms' own last-position logits, and each mode's cost against the uncompressed reference,
with controls. Fast: a tiny two-layer model written here, a short prompt."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_whole_model

from anelab.arms import compression_cost, real_text
from anelab.arms.arm_runs import Arm, run_arms
from anelab.arms.sidecars import open_sidecars
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.whole_model import load_model
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.sidecar.export import export_sidecars

CHUNK, PROMPT, DECODE, VOCAB = 8, 24, 3, 64
GEOMETRY = AttentionGeometry(variant="qwen3", hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                             num_layers=2, full_attention_layers=(0, 1))  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("compression_cost")
    checkpoint = random_whole_model(root / "model", GEOMETRY, intermediate=48, vocab=VOCAB)
    model = load_model(checkpoint)
    prompt = np.random.default_rng(3).integers(0, VOCAB, PROMPT)
    sidecars = {}
    for mode in ("fp16", "int4-block"):
        out = root / mode
        export_sidecars(load_checkpoint(checkpoint), out, CHUNK, list(range(0, PROMPT, CHUNK)), weights_mode=mode)
        sidecars[mode] = open_sidecars(out, model, PROMPT)
    return model, prompt, sidecars


def test_prompt_nll_matches_the_last_position_logits_of_shorter_prompts(setup):
    """nll[k - 1] of the whole prompt equals -log softmax(logits at the last position of prompt[:k])[prompt[k]],
    the logits run_arms computes itself for the shorter prompt (causal: later tokens do not move position k - 1)."""
    model, prompt, _ = setup
    full = run_arms(model, prompt, [Arm("reference")], decode=1, chunk=CHUNK)["reference"]
    nll = compression_cost.prompt_nll(model, prompt, full.hidden[-1])
    assert nll.shape == (PROMPT - 1,) and np.all(nll > 0)
    for k in (5, 13, PROMPT - 1):
        short = run_arms(model, prompt[:k], [Arm("reference")], decode=1, chunk=CHUNK)["reference"]
        logits = short.logits[0].astype(np.float64)
        expected = np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[prompt[k]]
        assert abs(nll[k - 1] - expected) < 1e-4 * max(1.0, expected), (k, nll[k - 1], expected)
        # negative control: the next position's target would give another value
        assert (
            abs(nll[k - 1] - (np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[prompt[k] ^ 1]))
            > 1e-3
        )
    assert compression_cost.perplexity(np.log([2.0, 8.0])) == pytest.approx(4.0)
    with pytest.raises(AnelabInputError, match="do not cover"):
        compression_cost.prompt_nll(model, prompt[:-1], full.hidden[-1])


def test_each_modes_cost_against_the_reference(setup):
    """The fp16 sidecars are at fp16 noise; int4-block moves logits and perplexity far more (the control: a
    cost measure that could not tell the modes apart would fail here)."""
    model, prompt, sidecars = setup
    costs = compression_cost.compression_costs(model, prompt, sidecars, decode=DECODE)
    fp16, int4 = costs["fp16"], costs["int4-block"]
    assert fp16.logits_diff < 1e-2 and abs(fp16.perplexity_change) < 1e-3, fp16
    assert int4.logits_diff > 5 * fp16.logits_diff and abs(int4.perplexity_change) > 5 * abs(fp16.perplexity_change)
    assert fp16.reference_perplexity == int4.reference_perplexity  # one reference run for every mode
    assert 1 < fp16.reference_perplexity < 10 * VOCAB
    assert 0 <= int4.greedy_agreement <= 1 and fp16.decode == DECODE and fp16.prompt_tokens == PROMPT
    row = int4.to_dict()
    assert row["perplexity_change"] == pytest.approx(int4.perplexity / int4.reference_perplexity - 1)
    table = compression_cost.cost_table(costs)
    assert table.splitlines()[2].startswith("int4-block")
    with pytest.raises(AnelabInputError, match="no weight mode"):
        compression_cost.compression_costs(model, prompt, {}, decode=DECODE)


def test_real_text_prompt_feeds_the_cost(setup):
    """The docs prompt (what the notebooks cost the modes on) runs through the same path."""
    model, _, sidecars = setup

    class Words:
        def encode(self, text):
            return np.array([sum(map(ord, w)) % VOCAB for w in text.split()], dtype=np.int64)

    prompt = real_text.docs_prompt(Words(), PROMPT)
    costs = compression_cost.compression_costs(model, prompt, {"fp16": sidecars["fp16"]}, decode=1)
    assert costs["fp16"].prompt_tokens == PROMPT and np.isfinite(costs["fp16"].perplexity)


def test_stored_weights_arm_is_the_sidecar_arm_within_fp16_noise(setup):
    """The reference decoder with the int4-block packages' stored projections lands where the int4-block sidecar
    arm lands (the two differ by fp16 activations only), far from the uncompressed reference; with the fp16
    packages' projections it is the reference within fp16 weight rounding."""
    model, prompt, sidecars = setup
    stored = {mode: compression_cost.stored_attention(s.packages, model) for mode, s in sidecars.items()}
    for layer, w in stored["int4-block"].items():  # really the compressed weights, not the checkpoint's
        assert not np.allclose(w.q_proj, model.attention(layer).q_proj, rtol=1e-3, atol=1e-4)
    by_weights = compression_cost.stored_weights_costs(model, prompt, stored, decode=DECODE, chunk=CHUNK)
    by_sidecar = compression_cost.compression_costs(model, prompt, sidecars, decode=DECODE)
    assert by_weights["fp16"].logits_diff < 2e-3
    int4_w, int4_s = by_weights["int4-block"], by_sidecar["int4-block"]
    assert int4_w.logits_diff > 5 * by_weights["fp16"].logits_diff
    assert abs(int4_w.logits_diff - int4_s.logits_diff) < 0.25 * int4_s.logits_diff, (int4_w, int4_s)
    assert abs(int4_w.perplexity_change - int4_s.perplexity_change) < 0.25 * abs(int4_s.perplexity_change)
    # negative control: a mode missing a layer's weights is refused, never served by the checkpoint's own
    partial = {"int4-block": {0: stored["int4-block"][0]}}
    with pytest.raises(AnelabInputError, match="no stored weights for layer 1"):
        compression_cost.stored_weights_costs(model, prompt, partial, decode=DECODE, chunk=CHUNK)


def test_weight_mode_evidence_is_made_once_and_read_by_a_second_study(setup, tmp_path):
    """Two studies asking the same request: the first exports, verifies and costs; the second reuses all of it from
    the cache (what notebooks 05 and 07 share). Control: another decode length is another cost."""
    from anelab.sidecar.checks.evidence_cache import CacheUse

    model, prompt, _ = setup
    acts = real_text.attention_inputs(model, prompt, [1], chunk=CHUNK)
    runs = []
    for decode in (DECODE, DECODE, DECODE + 1):
        use = CacheUse()
        ev = compression_cost.weight_mode_evidence(model, tmp_path, ["fp16", "int8"], prompt, chunk=CHUNK,
                                                   histories=[0], verified=[1], decode=decode, activations=acts,
                                                   use=use)  # fmt: skip
        runs.append((ev, use))
    (first, use1), (second, use2), (third, use3) = runs
    assert use1.computed == {"export": 2, "verify": 4, "whole-model cost": 2} and not use1.reused
    assert use2.reused == {"export": 2, "verify": 4, "whole-model cost": 2} and not use2.computed
    assert use3.computed == {"whole-model cost": 2}  # the packages and verifications are the same
    for mode in ("fp16", "int8"):
        assert second[mode].to_dict() == first[mode].to_dict()
        s = first[mode].verify_summary()
        assert s["passed"] and s["layers_verified"] == [1] and s["graph_error_max"] < 1e-2
    assert first["fp16"].verify_summary()["compression_error_max"] is None
    assert first["int8"].verify_summary()["compression_error_max"] > first["fp16"].verify_summary()["graph_error_max"]
    assert first["int8"].cost.logits_diff > first["fp16"].cost.logits_diff
    assert third["int8"].cost.decode == DECODE + 1
