"""``anelab plan --checkpoint`` prints the offload split per chip: the best split and the runner-up with their ratios,
intervals and the part that decides it, for a Qwen 3.5 hybrid written by mlx-lm and for default-real (SmolLM2-135M:
hidden 576, intermediate 1,536, 30 layers, 9 heads / 3 KV heads of 64, its public config)."""

from __future__ import annotations

import json

import pytest
from test_block_sidecars import CONFIGS

from anelab.cli import main
from anelab.planner.chips import CHIPS
from anelab.runtimes.mlx.checkpoints import write_mlx_lm_checkpoint

HEADER = "--- offload split per chip"


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return write_mlx_lm_checkpoint(tmp_path_factory.mktemp("split") / "qwen3_5", CONFIGS["qwen3_5"], seed=11)


def _run(argv, capsys) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_plan_checkpoint_prints_the_best_split_and_the_runner_up_per_chip(hybrid, capsys):
    argv = ["plan", "--checkpoint", str(hybrid), "--prompt-tokens", "8192"]
    text = _run(argv, capsys)
    section = text[text.index(HEADER) :].split("--- three-way verdict")[0].splitlines()
    by_chip = {line.split(":")[0]: line for line in section[2:]}
    assert set(by_chip) == set(CHIPS)
    for chip, line in by_chip.items():
        assert (" best " in line and "runner-up" in line) or "cannot be priced" in line, line
    payload = json.loads(_run([*argv, "--json"], capsys))["offload_split"]
    for c in payload["chips"]:
        if c["refused"]:
            continue
        # fastest first: the best is the split of fewest seconds, and the text names it with its interval
        best = min(c["splits"], key=lambda s: (s["seconds"], len(s["parts"])))
        assert c["splits"][0]["name"] == best["name"]
        assert best["ratio_low"] <= best["ratio"] <= best["ratio_high"]
        line = by_chip[c["chip"]]
        assert f"best {best['name']} {best['ratio']:.2f}x [{best['ratio_low']:.2f} .. {best['ratio_high']:.2f}]" in line
        assert f"runner-up {c['splits'][1]['name']}" in line
        assert {s["name"] for s in c["splits"]} >= {"none", "mlp", "projections", "mlp + projections"}
    assert payload["absent"] == []  # a hybrid has all three parts
    # control: a recorded family's plan has no checkpoint, so no split section
    assert HEADER not in _run(["plan", "--family", "qwen3.5-2b-4bit", "--prompt-tokens", "4333"], capsys)


def test_default_real_splits_are_sized_from_its_config(capsys):
    payload = json.loads(_run(["plan", "--checkpoint", "default-real", "--prompt-tokens", "4096", "--json"], capsys))
    split = payload["offload_split"]
    assert split["absent"] == ["projections: no Gated DeltaNet layers (not a hybrid)"]
    m3 = next(c for c in split["chips"] if c["chip"] == "M3")
    mlp = next(s for s in m3["splits"] if s["name"] == "mlp")
    assert mlp["resident_bytes"] == 30 * 3 * 576 * 1536 * 2  # 159 MB of fp16: one program
    assert mlp["programs"] == 1
    attention = next(s for s in m3["splits"] if s["name"] == "attention")
    assert attention["resident_bytes"] == 0  # the attention plan prices its own loads per prompt
    # a 135M model's 4,096-token prefill is well under a second on the GPU; the attention sidecar's reloads lose
    assert 0.05 < payload["gpu_prefill_seconds"] < 5.0
    assert attention["ratio"] < 1.0 and "attention" not in m3["splits"][0]["name"]
