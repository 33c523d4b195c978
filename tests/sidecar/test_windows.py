"""Sliding windows in the contract: the mask, the fold, the metadata, verify, the prompt driver, the fold check."""

from __future__ import annotations

import numpy as np
import pytest
from test_families import CHUNK, FAMILIES, WINDOW, write_family_checkpoint

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.core.masks import MASKED, causal, fold_with_causal
from anelab.core.selection import Selection
from anelab.sidecar.checks import foldcheck
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD, relative_error
from anelab.sidecar.checks.verify import verify_package
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.format import read_raw_metadata, read_sidecar_metadata, write_package_metadata
from anelab.sidecar.prompt import prefill_prompt, prompt_reference

MISTRAL = next(f for f in FAMILIES if f.name == "mistral-window")


def test_causal_window_hand_computed():
    """Chunk of 3 at history 2, W = 2: row p sees keys p-1 and p (transformers: kv > q - W, kv <= q)."""
    o, x = 0.0, float(MASKED)
    expected = np.array(
        [
            [x, o, o, x, x],  # p = 2: keys 1, 2
            [x, x, o, o, x],  # p = 3: keys 2, 3
            [x, x, x, o, o],  # p = 4: keys 3, 4
        ],
        np.float16,
    )
    np.testing.assert_array_equal(causal(3, 2, window=2), expected)
    assert causal(3, 2, window=1).astype(bool).sum() == 3 * 5 - 3  # W = 1: only itself
    np.testing.assert_array_equal(causal(3, 2, window=5), causal(3, 2))  # the window reaches key 0: plain causal
    assert not np.array_equal(causal(3, 2, window=4), causal(3, 2))  # row 4 loses key 0
    with pytest.raises(AnelabInputError, match="window"):
        causal(3, 2, window=0)


def test_fold_composes_with_the_window():
    """A kept key outside the row's window is dropped; kept keys inside stay."""
    keep = np.array([[0, 3, 4]])  # row 0 at position 4 keeps keys 0, 3, 4
    mask = fold_with_causal(keep, np.array([3]), history=4, chunk=1, window=2)
    assert list(np.flatnonzero(mask[0] == 0)) == [3, 4]
    assert list(np.flatnonzero(fold_with_causal(keep, np.array([3]), history=4, chunk=1)[0] == 0)) == [0, 3, 4]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    root = tmp_path_factory.mktemp("mistral")
    ckpt = write_family_checkpoint(root / "ckpt", MISTRAL)
    [result] = export_sidecars(load_checkpoint(ckpt), root / "out", CHUNK, [0, CHUNK, 2 * CHUNK], [1])
    return ckpt, result.package


def test_windowed_layer_metadata_and_verify(mistral):
    _, package = mistral
    assert read_raw_metadata(package)["slidingWindow"] == str(WINDOW)
    report = verify_package(package)
    assert report.passed, report.table()
    assert any(c.case == "control: window dropped" and c.passed for c in report.comparisons)


def test_verify_fails_when_the_metadata_drops_the_window(mistral, tmp_path):
    _, package = mistral
    meta = read_sidecar_metadata(package)
    meta.sliding_window = None
    dropped = tmp_path / "layer_1.mlpackage"
    write_package_metadata(package, dropped, meta.to_strings())
    assert read_raw_metadata(dropped)["slidingWindow"] == "null"
    report = verify_package(dropped)
    assert not report.passed
    full = [c for c in report.comparisons if c.case == "full chunk"]
    assert all(c.worst > RELATIVE_ERROR_THRESHOLD for c in full), report.table()


def test_prompt_driver_uses_the_window(mistral):
    ckpt, package = mistral
    from anelab.checkpoints.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(ckpt)
    g, w = checkpoint.geometry, checkpoint.layer(1)
    hidden = np.random.default_rng(3).standard_normal((3 * CHUNK - 1, g.hidden_size)).astype(np.float16)
    out = prefill_prompt(package, hidden)
    windowed = prompt_reference(hidden, w, g, window=WINDOW).attn_out
    plain = prompt_reference(hidden, w, g).attn_out
    assert relative_error(out, windowed) < RELATIVE_ERROR_THRESHOLD
    assert relative_error(out, plain) > RELATIVE_ERROR_THRESHOLD  # negative control: no window


def test_fold_check_on_a_windowed_layer(mistral):
    ckpt, package = mistral
    history = 2 * CHUNK
    case = foldcheck.make_case(package, load_checkpoint(ckpt), history=history, seed=0)
    assert case.window == WINDOW
    # each row p keeps key 0 (outside its window: the composition drops it), p - 1 and p (inside)
    p = history + np.arange(CHUNK)
    keep = np.stack([np.zeros(CHUNK, int), p - 1, p], axis=1).astype(np.int32)
    selection = Selection(keep, np.full(CHUNK, 3, np.int32), kept_blocks=1, compress_ratio=2, start=history)
    check = foldcheck.fold_check(case, selection)
    assert check.passed and check.fold_error < RELATIVE_ERROR_THRESHOLD, check
    assert check.causal_off > RELATIVE_ERROR_THRESHOLD  # the window-only mask misses: the selection reaches the graph
    # a selection that keeps nothing inside a row's window is refused, not averaged
    far = Selection(np.zeros((CHUNK, 1), np.int32), np.ones(CHUNK, np.int32), 1, 2, start=history)
    with pytest.raises(AnelabInputError, match="sliding window"):
        foldcheck.fold_check(case, far)


def test_stateful_windowed_verify(tmp_path):
    ckpt = write_family_checkpoint(tmp_path / "ckpt", MISTRAL)
    [result] = export_sidecars(
        load_checkpoint(ckpt), tmp_path / "out", CHUNK, [0, CHUNK], [0], graph="stateful", capacity=2 * CHUNK
    )
    report = verify_package(result.package)
    assert report.passed, report.table()
    assert any(c.case == "control: window dropped" and c.passed for c in report.comparisons)


# ---- the CLI: inspect says the window; plan --checkpoint; export --list-families ----------------


def test_inspect_states_the_window_contract(mistral, capsys):
    from anelab.cli import main

    _, package = mistral
    assert main(["inspect", str(package)]) == 0
    out = capsys.readouterr().out
    assert f"masks.causal(C, H, window={WINDOW})" in out
    assert "needs the same functions as a full-attention one" in out


@pytest.fixture(scope="module")
def gemma2_checkpoint(tmp_path_factory):
    from dataclasses import replace

    fam = next(f for f in FAMILIES if f.name == "gemma2")
    fam = replace(fam, config={**fam.config, "num_hidden_layers": 6})
    return write_family_checkpoint(tmp_path_factory.mktemp("g2") / "ckpt", fam)


def test_plan_checkpoint_counts_windowed_layers(gemma2_checkpoint, capsys):
    from anelab.cli import main

    assert main(["plan", "--checkpoint", str(gemma2_checkpoint), "--prompt-tokens", "4333", "--json"]) == 0
    import json

    d = json.loads(capsys.readouterr().out)
    assert (d["full_layers"], d["windowed_layers"], d["sliding_window"]) == ([1, 3, 5], [0, 2, 4], WINDOW)
    assert (d["num_heads"], d["num_kv_heads"], d["head_dim"]) == (4, 2, 8)
    assert d["cost_family"] and "closest recorded dense family" in d["cost_family_reason"]
    full, windowed = d["parts"]["full"], d["parts"]["windowed"]
    # the GPU scores at most W keys per query on a windowed layer; the ANE scores the whole coverage either way
    assert windowed["gpu_attention_seconds"] < full["gpu_attention_seconds"]
    assert windowed["ane_attention_seconds"] == pytest.approx(full["ane_attention_seconds"])
    assert d["gpu_prefill_seconds"] == pytest.approx(
        full["non_attention_seconds"] + full["gpu_attention_seconds"] + windowed["gpu_attention_seconds"]
    )


def test_plan_checkpoint_default_and_refusals(capsys, tmp_path):
    from anelab.checkpoints.default import default_checkpoint_dir
    from anelab.cli import main

    ckpt = default_checkpoint_dir(tmp_path)
    assert main(["plan", "--checkpoint", str(ckpt), "--prompt-tokens", "4333"]) == 0
    out = capsys.readouterr().out
    assert "2 full attention" in out and "combined:" in out and "closest recorded dense family" in out
    assert main(["plan", "--checkpoint", str(ckpt), "--prompt-tokens", "4333", "--heads", "8"]) == 2
    assert "drop --heads" in capsys.readouterr().err
    assert (
        main(["plan", "--checkpoint", str(ckpt), "--prompt-tokens", "4333", "--family", "qwen3.8-125b-a6b-4bit"]) == 2
    )
    assert "sparse GPU path" in capsys.readouterr().err


def test_export_list_families(capsys):
    from anelab.cli import main

    assert main(["export", "--list-families"]) == 0
    out = capsys.readouterr().out
    for model_type in ("gemma2", "gemma3_text", "phi3", "olmo2", "granite", "glm4", "smollm3", "starcoder2"):
        assert model_type in out
    assert "refused:" in out and "llama3" in out
    assert main(["export", "--chunk", "4"]) == 2
    assert "pass CHECKPOINT" in capsys.readouterr().err


def test_geometry_options_round_trip():
    """Every option survives to_dict / from_dict (the package metadata stores the geometry)."""
    from anelab.checkpoints.config import geometry_from_config
    from anelab.core.geometry import AttentionGeometry

    for fam in FAMILIES:
        g = geometry_from_config(
            fam.config if fam.nested is None else {"model_type": fam.nested, "text_config": fam.config}
        )
        d = g.to_dict()
        assert AttentionGeometry.from_dict(d) == g, fam.name
        import json

        assert AttentionGeometry.from_dict(json.loads(json.dumps(d))) == g, fam.name
    plain = geometry_from_config(FAMILIES[0].config).to_dict()
    assert "sliding_window" not in plain and "rope_scaling" not in plain  # defaults omitted: old dicts unchanged


def test_open_sidecar_feeds_the_window_and_refuses_a_mask_outside_it(mistral):
    """At use time the package's window reaches the runtime: without a mask the chunk is fed the
    windowed causal mask; a plain causal mask that shows keys outside the window is refused."""
    from anelab.runtimes.coreml.coreml_fake import FakeRuntime
    from anelab.runtimes.interface import zero_inputs
    from anelab.runtimes.open import open_sidecar

    _, package = mistral
    runtime = FakeRuntime(numerics=True)
    sidecar = open_sidecar(package, compute_units="cpu_only", chunk=CHUNK, runtime=runtime)  # not ANE-gated here
    assert sidecar.sliding_window == WINDOW
    start = 2 * CHUNK
    expected = causal(CHUNK, start, window=WINDOW)
    np.testing.assert_array_equal(sidecar.mask_for(start), expected)
    inputs = zero_inputs(runtime.signature(package, f"h{start}"))
    inputs.pop("mask")
    sidecar.predict(start, inputs)  # the windowed mask is filled in
    with pytest.raises(AnelabInputError, match=f"outside the layer's sliding window of {WINDOW} tokens"):
        sidecar.predict(start, {**inputs, "mask": causal(CHUNK, start)})  # negative control: no window


def test_plan_checkpoint_compares_the_designs(capsys, tmp_path):
    """plan --checkpoint --design all: the three designs for the checkpoint's own full-attention
    layers, with its per-history plan as the baseline (one load per layer for the stateful ones)."""
    import json

    from anelab.checkpoints.default import default_checkpoint_dir
    from anelab.cli import main

    ckpt = default_checkpoint_dir(tmp_path)
    argv = ["plan", "--checkpoint", str(ckpt), "--prompt-tokens", "4333", "--design", "all", "--chunk", "1024"]
    assert main([*argv, "--json"]) == 0
    [rows] = json.loads(capsys.readouterr().out).values()
    by_design = {r["design"]: r for r in rows}
    assert set(by_design) == {"dense", "stateful", "stateful-tiled"}
    # 2 full-attention layers x 5 chunk starts of a 4,333-token prompt at chunk 1,024, against one load per layer
    assert by_design["dense"]["loads"] == 2 * 5
    assert by_design["stateful"]["loads"] == by_design["stateful-tiled"]["loads"] == 2
    assert by_design["stateful-tiled"]["per_call_arena_bytes"] < by_design["stateful"]["per_call_arena_bytes"]
    assert all(r["gpu_prefill_seconds"] == rows[0]["gpu_prefill_seconds"] for r in rows)  # one GPU arm
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "closest recorded dense family" in out and "stateful-tiled" in out
