"""Config keys as transformers reads them: both spellings of an ``attribute_map`` key, transformers' defaults.

transformers 5.24 stores Qwen3-MoE's ``num_experts`` under ``num_local_experts``
(models/qwen3_moe/configuration_qwen3_moe.py:50-52 with configuration_utils.py:653-656), moves
``rope_theta`` into ``rope_parameters`` and writes ``dtype``; a checkpoint saved that way must run
exactly as the same model saved with the legacy keys.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from anelab.arms.arm_runs import Arm, run_arm
from anelab.checkpoints.config import text_config
from anelab.checkpoints.whole_model import load_model, write_model_checkpoint
from anelab.core.decoder import MoeWeights, random_head_weights, random_layer_weights
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.weights import random_attention_weights

EXPERTS = 4


@pytest.fixture(scope="module")
def legacy_moe(tmp_path_factory):
    """A 2-layer Qwen3-MoE (layer 0 routed over 4 experts, layer 1 dense) in the legacy spelling."""
    g = AttentionGeometry("qwen3", 16, 2, 1, 8, num_layers=2, full_attention_layers=(0, 1), rope_theta=5000.0)
    layers = {0: random_layer_weights(0, 16, 12, 3, experts=EXPERTS, top_k=2, norm_topk_prob=True)}
    layers[1] = random_layer_weights(1, 16, 20, 3)
    head = random_head_weights(24, 16, 3, tied=False)
    attention = {i: random_attention_weights(g, i, 3) for i in (0, 1)}
    root = tmp_path_factory.mktemp("keys")
    return write_model_checkpoint(root / "legacy", g, attention, layers, head, model_type="qwen3_moe")


def _rewritten(src, dest, change) -> object:
    shutil.copytree(src, dest)
    config = json.loads((src / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(change(config)))
    return dest


def _transformers_5(config: dict) -> dict:
    config = dict(config)
    config["num_local_experts"] = config.pop("num_experts")
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    config["dtype"] = config.pop("torch_dtype")
    return config


def test_a_qwen3_moe_checkpoint_saved_by_transformers_5_runs_as_the_legacy_one(legacy_moe, tmp_path):
    assert "num_experts" in json.loads((legacy_moe / "config.json").read_text())
    modern = _rewritten(legacy_moe, tmp_path / "modern", _transformers_5)
    model = load_model(modern)
    assert model.experts == EXPERTS and isinstance(model.layer(0).mlp, MoeWeights)
    prompt = np.arange(9) % 24
    a = run_arm(load_model(legacy_moe), prompt, Arm("reference"), decode=3, chunk=4)
    b = run_arm(model, prompt, Arm("reference"), decode=3, chunk=4)
    assert np.array_equal(a.logits, b.logits) and np.array_equal(a.hidden, b.hidden)


def test_without_either_spelling_transformers_default_of_128_experts_applies(legacy_moe, tmp_path):
    """Negative control: the key is what makes the model routed over 4 experts; absent, transformers' default
    (128, configuration_qwen3_moe.py:100) applies and the router's shape is refused — not read as a dense MLP."""
    bare = _rewritten(legacy_moe, tmp_path / "bare", lambda c: {k: v for k, v in c.items() if k != "num_experts"})
    model = load_model(bare)
    assert model.experts == 128
    with pytest.raises(AnelabInputError, match=r"mlp\.gate\.weight has shape \[4, 16\], expected \[128, 16\]"):
        model.layer(0)


def test_both_spellings_must_agree(legacy_moe, tmp_path):
    agree = _rewritten(legacy_moe, tmp_path / "agree", lambda c: {**c, "num_local_experts": c["num_experts"]})
    assert load_model(agree).experts == EXPERTS
    clash = _rewritten(legacy_moe, tmp_path / "clash", lambda c: {**c, "num_local_experts": 8})
    with pytest.raises(AnelabInputError, match="keep only num_local_experts") as e:
        load_model(clash)
    assert "\n" not in str(e.value)


def test_aliases_apply_only_to_the_family_that_declares_them():
    """llama has no attribute_map: its num_local_experts stays a foreign key (and a nested text config is read)."""
    llama = {"model_type": "llama", "num_local_experts": 8}
    assert text_config(llama) == llama
    nested = {"model_type": "x", "text_config": {"model_type": "qwen3_moe", "num_local_experts": 8}}
    assert text_config(nested) == {"model_type": "qwen3_moe", "num_experts": 8}
