"""Notebooks 05 and 07's shared request for a real model's weight modes (``anelab.arms.weight_modes``): one
computation, the second notebook served from the cache, activations included. Fast: a tiny two-layer model."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_whole_model

from anelab.arms import real_text, weight_modes
from anelab.checkpoints.checkpoint import Checkpoint
from anelab.checkpoints.whole_model import load_model
from anelab.core.geometry import AttentionGeometry
from anelab.sidecar.checks.evidence_cache import CACHE_DIR

VOCAB = 64
GEOMETRY = AttentionGeometry(variant="qwen3", hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                             num_layers=2, full_attention_layers=(0, 1))  # fmt: skip
REQUEST = weight_modes.EvidenceRequest(prompt_tokens=24, chunk=8, decode=2, modes=("fp16", "int8"))


class Words:
    """A stand-in tokenizer: one id per word (the test model has none)."""

    def encode(self, text):
        return np.array([sum(map(ord, w)) % VOCAB for w in text.split()], dtype=np.int64)

    def decode(self, ids):
        return " ".join(f"w{int(i)}" for i in ids)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return random_whole_model(tmp_path_factory.mktemp("weight_modes") / "model", GEOMETRY, intermediate=48, vocab=VOCAB)


def test_the_second_notebook_is_served_from_the_cache(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(Checkpoint, "tokenizer", lambda self: Words())
    first = weight_modes.real_mode_evidence(load_model(checkpoint), tmp_path, REQUEST, label="tiny")
    second = weight_modes.real_mode_evidence(load_model(checkpoint), tmp_path, REQUEST, label="tiny")
    assert not first.use.reused and first.use.computed["activations"] == 1
    assert not second.use.computed
    assert second.use.reused == {"activations": 1, "export": 2, "verify": 8, "whole-model cost": 2}
    assert second.to_dict() == first.to_dict() and first.layers == [0, 1] and (tmp_path / CACHE_DIR).is_dir()
    model = load_model(checkpoint)
    fresh = real_text.attention_inputs(model, first.prompt, [0, 1], chunk=REQUEST.chunk)
    for layer in (0, 1):
        assert np.array_equal(second.activations[layer], fresh[layer])
    rows = weight_modes.cost_rows(first)
    assert [r["mode"] for r in rows] == ["fp16", "int8"] and all(r["passed"] for r in rows)
    assert rows[1]["logits_diff"] > rows[0]["logits_diff"]  # control: the compression shows in the cost
    table = weight_modes.cost_table(first).splitlines()
    assert table[1].startswith("fp16") and table[2].startswith("int8") and "ok" in table[2]
    # control: another prompt length is another computation
    other = weight_modes.real_mode_evidence(load_model(checkpoint), tmp_path, weight_modes.EvidenceRequest(
        prompt_tokens=16, chunk=8, decode=2, modes=("int8",)))  # fmt: skip
    assert other.use.computed["activations"] == 1 and other.use.computed["whole-model cost"] == 1


def test_the_requests_and_the_sampled_layers():
    assert weight_modes.sampled_layers(30) == [0, 15, 29] and weight_modes.sampled_layers(2) == [0, 1]
    quick = weight_modes.EvidenceRequest.for_run(True)
    assert quick.modes == ("int8",) and quick.last_layer_only and quick.histories == [0]
    full = weight_modes.EvidenceRequest.for_run(False, full=True)
    assert full.modes == ("fp16", "int8", "palettize4", "int4-block") and full.histories == [0, 32]
    assert weight_modes.EvidenceRequest.for_run(False).to_dict()["histories"] == [0]
