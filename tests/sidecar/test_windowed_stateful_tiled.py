"""Windowed layers in the stateful tiled design (a ring of W + C cache slots), and the selection contract
through its additive mask mode."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import TINY_SEED

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.config import geometry_from_config
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.weights import random_attention_weights
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD, relative_error
from anelab.sidecar.checks.verify import verify_package
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.format import read_sidecar_metadata
from anelab.sidecar.graphs import stateful_tiled
from anelab.sidecar.inspection import inspect_package
from anelab.sidecar.mil.evaluate import SavedPackage
from anelab.sidecar.prompt import prompt_reference, run_stateful_tiled
from anelab.studies.one_function import gemma3_style_geometry, write_gemma3_style_checkpoint

WINDOW, CHUNK, KEY_TILE = 8, 4, 4
GEMMA3 = gemma3_style_geometry(WINDOW)  # five sliding layers, then one full (Gemma 3's pattern)


def _gemma3_checkpoint(directory, geometry: AttentionGeometry = GEMMA3):
    return write_gemma3_style_checkpoint(directory, geometry, TINY_SEED)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """Every attention layer of the Gemma 3-style model as one stateful-tiled function at capacity 4W."""
    root = tmp_path_factory.mktemp("gemma3")
    ckpt = _gemma3_checkpoint(root / "ckpt")
    results = export_sidecars(
        load_checkpoint(ckpt), root / "out", CHUNK, None, graph="stateful-tiled", capacity=4 * WINDOW
    )
    return ckpt, results


def test_gemma3_checkpoint_round_trips_through_config_json(tmp_path):
    ck = load_checkpoint(_gemma3_checkpoint(tmp_path / "m"))
    assert replace(ck.geometry, after_o_proj="") == GEMMA3
    # the keys transformers' Gemma3TextConfig reads (configuration_gemma3.py), as literal values
    assert ck.config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (ck.config["sliding_window"], ck.config["query_pre_attn_scalar"]) == (WINDOW, 32.0)
    assert (ck.config["rope_theta"], ck.config["rope_local_base_freq"]) == (1e6, 1e4)
    # negative control: a soft-cap is not a Gemma 3 option, so the writer refuses it (one line)
    with pytest.raises(AnelabInputError, match="no logit soft-cap"):
        _gemma3_checkpoint(tmp_path / "capped", replace(GEMMA3, logit_softcap=30.0))
    assert geometry_from_config(ck.config).sliding_layers == (0, 1, 2, 3, 4)


def test_every_layer_is_one_function_and_verifies_a_prompt_of_four_windows(gemma3):
    ckpt, results = gemma3
    assert [r.functions for r in results] == [[f"c{CHUNK}"]] * 6
    rings = [r.metadata.ring_slots for r in results]
    assert rings == [WINDOW + CHUNK] * 5 + [None]  # the full layer keeps one slot per position
    for r in results:
        inputs = SavedPackage(r.package).function(f"c{CHUNK}").inputs  # no mask input: the window is in-graph
        assert [s.name for s in inputs] == ["hidden", "start"]
        report = verify_package(r.package, load_checkpoint(ckpt))
        assert report.passed, report.table()
        [run] = [c for c in report.comparisons if not c.control]
        assert run.rows == 4 * WINDOW - CHUNK + 3  # 4W positions: the last chunk partial (3 of 4 rows)
        controls = {c.case: c.worst for c in report.comparisons if c.control}
        expected = {"control: wrong position (start + 1)", "control: state carried"}
        if r.metadata.sliding_window is not None:
            expected.add("control: window dropped (ref.)")
        assert set(controls) == expected
        assert all(v > 10 * RELATIVE_ERROR_THRESHOLD for v in controls.values()), controls


def test_windowed_largest_intermediate_does_not_grow_with_the_prompt(gemma3, tmp_path):
    ckpt, results = gemma3
    long = export_sidecars(
        load_checkpoint(ckpt), tmp_path, CHUNK, None, [0, 5], graph="stateful-tiled", capacity=16 * WINDOW
    )
    short = {r.metadata.layer: inspect_package(r.package)["functions"][f"c{CHUNK}"] for r in results}
    longer = {r.metadata.layer: inspect_package(r.package)["functions"][f"c{CHUNK}"] for r in long}
    # windowed layer: the same program shape at prompt lengths 4W and 16W
    assert short[0]["largest_intermediate_bytes"] == longer[0]["largest_intermediate_bytes"]
    assert short[0]["op_counts"] == longer[0]["op_counts"]
    # negative control: the full layer's cache and score tile (one key tile of the capacity here) grow with it
    assert longer[5]["largest_intermediate_bytes"] > short[5]["largest_intermediate_bytes"]


@pytest.fixture(scope="module")
def windowed_decode(tmp_path_factory):
    """One windowed layer with several key tiles in its ring (wrapped writes) and a decode function."""
    root = tmp_path_factory.mktemp("windowed")
    ckpt = _gemma3_checkpoint(root / "ckpt", replace(GEMMA3, sliding_window=10))
    [r] = export_sidecars(
        load_checkpoint(ckpt), root / "out", 8, None, [1], graph="stateful-tiled", capacity=48, key_tile=KEY_TILE, query_tile=4,
        decode=True,
    )  # fmt: skip
    return ckpt, r


def test_ring_wraps_and_decodes_past_the_window(windowed_decode):
    ckpt, r = windowed_decode
    assert r.metadata.ring_slots == 20 and r.metadata.key_tile == KEY_TILE  # 10 + 8 rounded up to whole tiles
    report = verify_package(r.package, load_checkpoint(ckpt))
    assert report.passed, report.table()
    [run] = [c for c in report.comparisons if not c.control]
    assert run.rows == 5 * 8 + 5 + 2  # five whole chunks, a partial one, two decode steps: 4.7 windows
    assert 1e-5 < run.worst < RELATIVE_ERROR_THRESHOLD


def test_a_window_limit_that_keeps_stale_slots_is_caught(tmp_path, monkeypatch):
    """The in-graph limit with the window's lower bound dropped (every slot of the ring kept once written):
    verification must fail on attn_out and not call itself vacuous."""
    ckpt = _gemma3_checkpoint(tmp_path / "ckpt")
    real = stateful_tiled._window_tile_mask
    monkeypatch.setattr(stateful_tiled, "_window_tile_mask", lambda window, slots, chunk: real(10**6, slots, chunk))
    [r] = export_sidecars(
        load_checkpoint(ckpt), tmp_path / "out", CHUNK, None, [0], graph="stateful-tiled", capacity=4 * WINDOW
    )
    report = verify_package(r.package, load_checkpoint(ckpt))
    assert not report.passed and not report.vacuous
    [run] = [c for c in report.comparisons if not c.control]
    assert run.errors["attn_out"] > 10 * RELATIVE_ERROR_THRESHOLD


def test_positions_past_32768_in_a_windowed_ring(tmp_path):
    """A ring of 24 slots serving 65,536 positions: chunks at 39,992 .. 40,015 and a decode step at
    40,016 against the fp64 reference over the window's rows; one position late must fail."""
    g = replace(
        GEMMA3, hidden_size=32, num_heads=2, num_kv_heads=1, num_layers=1, full_attention_layers=(0,),
        sliding_window=16, sliding_layers=(0,),
    )  # fmt: skip
    ck = load_checkpoint(_gemma3_checkpoint(tmp_path / "m", g))
    ckpt = ck.path
    assert ck.geometry.window_of(0) == 16
    [r] = export_sidecars(
        load_checkpoint(ckpt), tmp_path, 8, None, [0], graph="stateful-tiled", capacity=65536, decode=True
    )
    assert r.metadata.ring_slots == 24
    saved = SavedPackage(r.package)
    first = 39992
    rows = np.random.default_rng(5).standard_normal((25, g.hidden_size)).astype(np.float16)
    out, state = run_stateful_tiled(saved, rows, 8, 65536, first_start=first, decode_steps=1)
    ref = prompt_reference(rows, ck.layer(0), ck.geometry, start=first, window=16)
    tail = slice(16, 25)  # rows whose whole window lies inside the rows given (positions >= first + 15)
    assert relative_error(out[tail], ref.attn_out[tail]) < RELATIVE_ERROR_THRESHOLD
    live = np.arange(first + 9, first + 25)  # the last W positions, in slots p mod 24
    assert relative_error(state["k_cache"][:, live % 24], ref.k_chunk[:, live - first]) < RELATIVE_ERROR_THRESHOLD
    # one position late everywhere: attention only sees relative positions, the rotated keys do not
    _, late = run_stateful_tiled(saved, rows, 8, 65536, first_start=first, decode_steps=1, start_offset=1)
    moved = relative_error(late["k_cache"][:, (live + 1) % 24], ref.k_chunk[:, live - first])
    assert moved > 10 * RELATIVE_ERROR_THRESHOLD


def test_folded_selection_verifies_through_the_stateful_tiled_graph(tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint("qwen3")
    selection = {"kept_blocks": 2, "compress_ratio": 4}
    [r] = export_sidecars(
        load_checkpoint(ckpt), tmp_path, 8, None, [1], graph="stateful-tiled", capacity=64, key_tile=16, mask_mode="additive",
        selection=selection,
    )  # fmt: skip
    assert read_sidecar_metadata(r.package).selection_folded
    report = verify_package(r.package, load_checkpoint(ckpt))
    assert report.passed, report.table()
    fold = {c.case: c for c in report.comparisons if "fold" in c.case or "causal-only" in c.case or "moves" in c.case}
    assert len(fold) == 3, report.table()
    [folded] = [c for c in fold.values() if not c.control]
    assert folded.worst < RELATIVE_ERROR_THRESHOLD
    causal_only = fold["control: causal-only mask"]
    assert causal_only.worst > 10 * RELATIVE_ERROR_THRESHOLD  # the package ignoring the selection is caught


def test_windowed_and_selection_refusals(tmp_path, tiny_checkpoint):
    ckpt = _gemma3_checkpoint(tmp_path / "ckpt")
    with pytest.raises(AnelabInputError, match="--mask-mode additive is for full-attention layers"):
        export_sidecars(
            load_checkpoint(ckpt), tmp_path, CHUNK, None, [0], graph="stateful-tiled", capacity=32, mask_mode="additive"
        )
    with pytest.raises(AnelabInputError, match="needs its mask input: add --mask-mode additive"):
        export_sidecars(
            load_checkpoint(tiny_checkpoint("qwen3")), tmp_path, 8, None, [1], graph="stateful-tiled", capacity=32,
            selection={"kept_blocks": 2, "compress_ratio": 4},
        )  # fmt: skip
    g, w = GEMMA3, random_attention_weights(GEMMA3, 0, TINY_SEED)
    with pytest.raises(AnelabInputError, match="ring of 10 slots cannot serve"):
        stateful_tiled.build_stateful_tiled_program(g, w, CHUNK, 32, 1, CHUNK, slots=10)  # W + C - 1 = 11 is the floor
    with pytest.raises(AnelabInputError, match="needs its ring size"):
        stateful_tiled.build_stateful_tiled_program(g, w, CHUNK, 32, 4, CHUNK)
    assert not any(tmp_path.glob("*.mlpackage"))


def test_planner_prices_the_windowed_layers_as_built(tmp_path, capsys):
    """plan --checkpoint --design all on a Gemma 3-style model with a 1,024-token window: the windowed
    layers' stateful-tiled row is one function over a ring of W + C slots whatever the prompt."""
    import json

    from anelab.cli import main

    ckpt = _gemma3_checkpoint(tmp_path / "m", replace(GEMMA3, sliding_window=1024))
    rows = {}
    for prompt in (4096, 16384):
        argv = ["plan", "--checkpoint", str(ckpt), "--prompt-tokens", str(prompt), "--design", "all"]
        assert main([*argv, "--chunk", "512", "--json"]) == 0
        rows[prompt] = {
            name.rsplit(" ", 1)[-1]: {r["design"]: r for r in plans}
            for name, plans in json.loads(capsys.readouterr().out).items()
        }
    small, large = rows[4096], rows[16384]
    assert set(small) == {"(full)", "(windowed)"}
    tiled = small["(windowed)"]["stateful-tiled"]
    assert (tiled["ring_slots"], tiled["functions_per_layer"], tiled["loads"]) == (1024 + 512, 1, 5)
    assert tiled["score_entries_computed"] == (4096 // 512) * GEMMA3.num_heads * 512 * 1536  # calls x heads x C x ring
    assert small["(windowed)"]["dense"]["loads"] == 5 * (4096 // 512)  # one function per history, as built
    for key in ("per_call_arena_bytes", "ops_per_function", "ring_slots"):
        assert large["(windowed)"]["stateful-tiled"][key] == tiled[key]
    # negative controls: the windowed layers' other designs and the full layer grow with the prompt
    untiled = small["(windowed)"]["stateful"]
    assert large["(windowed)"]["stateful"]["per_call_arena_bytes"] > untiled["per_call_arena_bytes"]
    assert untiled["score_entries_computed"] > tiled["score_entries_computed"]
    assert large["(full)"]["stateful-tiled"]["ops_per_function"] > small["(full)"]["stateful-tiled"]["ops_per_function"]
    assert main(["plan", "--checkpoint", str(ckpt), "--prompt-tokens", "4096", "--design", "all"]) == 0
    assert "(windowed)" in capsys.readouterr().out


def test_export_says_per_windowed_layer_why_its_functions(tmp_path, capsys):
    from anelab.cli import main

    ckpt = _gemma3_checkpoint(tmp_path / "m")
    args = ["export", str(ckpt), "--chunk", str(CHUNK), "--layers", "0,5", "--out", str(tmp_path / "o")]
    assert main([*args, "--histories", f"0,{CHUNK}"]) == 0
    out = capsys.readouterr().out
    assert f"layer 0 slides over {WINDOW} tokens, but needs one function per history (2)" in out
    assert "layer 5 slides" not in out  # the full layer needs no note (negative control)
    assert main([*args, "--graph", "stateful-tiled", "--capacity", str(4 * WINDOW)]) == 0
    out = capsys.readouterr().out
    assert f"one function per chunk width over a ring of {WINDOW + CHUNK} cache slots" in out


def test_inspection_states_the_ring_contract(gemma3):
    _, results = gemma3
    notes = {r.metadata.layer: " ".join(inspect_package(r.package)["contract"]) for r in results}
    assert f"ring of {WINDOW + CHUNK} slots" in notes[0] and "h<H>" not in notes[0]
    assert "full attention" in notes[5] and "ring" not in notes[5]


def test_windowed_tiles_run_fused_with_the_same_bits(windowed_decode, monkeypatch):
    """The fused online-softmax step recognises the windowed tile (its mask is one add) and skips the
    ring's tiles wholly outside every row's window, bit for bit as op-by-op evaluation."""
    from anelab.sidecar.mil import evaluate as evaluate_module
    from anelab.sidecar.mil import online_step
    from anelab.sidecar.mil.evaluate import evaluate_with_state

    _, r = windowed_decode
    saved = SavedPackage(r.package)
    hidden = np.random.default_rng(7).standard_normal((37, GEMMA3.hidden_size)).astype(np.float16)
    counts = {"scored": 0, "skipped": 0}
    real = evaluate_module.run_online_step

    def counted(it, step):
        before = dict(it.tile_counts)
        result = real(it, step)
        for key in counts:
            counts[key] += it.tile_counts[key] - before[key]
        return result

    monkeypatch.setattr(evaluate_module, "run_online_step", counted)

    def prefill(fuse: bool):
        run = lambda f, inputs, state: evaluate_with_state(saved, f, inputs, state, fuse=fuse)  # noqa: E731
        return run_stateful_tiled(saved, hidden, 8, 48, decode_steps=2, evaluate=run)

    fused, fused_state = prefill(True)
    assert counts["scored"] > 0 and counts["skipped"] > 0, counts
    seen = dict(counts)
    plain, plain_state = prefill(False)
    assert counts == seen  # op by op: no fused step ran
    np.testing.assert_array_equal(fused, plain)
    for name in plain_state:
        np.testing.assert_array_equal(fused_state[name], plain_state[name])
    # negative control: skipping tiles that still carry weight is caught by the same comparison
    monkeypatch.setattr(online_step, "SKIP_MARGIN", -1e9)
    wrong, _ = prefill(True)
    assert relative_error(wrong, plain) > 10 * RELATIVE_ERROR_THRESHOLD
