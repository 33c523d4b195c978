"""Stateful tiled sidecars: one function per layer, K/V in state, online softmax over key and query tiles."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY_GEOMETRIES, TINY_MODEL_TYPES, TINY_SEED

from anelab.checkpoints.checkpoint import load_checkpoint, write_checkpoint
from anelab.cli import main
from anelab.core import reference
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.masks import causal
from anelab.core.weights import random_attention_weights
from anelab.planner.design_plans import compare_designs
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD, relative_error
from anelab.sidecar.checks.verify import verify_package
from anelab.sidecar.designs import OPS_PER_TILE_PAIR, stateful_tiled_ops
from anelab.sidecar.export import export_sidecars, function_builds
from anelab.sidecar.format import MASK_MODE_META, read_raw_metadata, read_sidecar_metadata
from anelab.sidecar.graphs import common as graphs_common
from anelab.sidecar.graphs import stateful_tiled
from anelab.sidecar.mil import evaluate as evaluate_module
from anelab.sidecar.mil import online_step
from anelab.sidecar.mil.evaluate import SavedPackage, evaluate_with_state, new_state
from anelab.sidecar.prompt import prefill_prompt, prompt_reference, run_stateful_tiled
from anelab.studies.one_function import intermediate_profile, tile_error_table

CHUNK, CAPACITY, KEY_TILE, QUERY_TILE = 8, 32, 8, 4
VARIANT = "qwen3_next"
LAYER = TINY_GEOMETRIES[VARIANT].full_attention_layers[-1]


def _export(ckpt, out, **kw):
    options = {"capacity": CAPACITY, "key_tile": KEY_TILE, "query_tile": QUERY_TILE, **kw}
    [r] = export_sidecars(load_checkpoint(ckpt), out, CHUNK, None, [LAYER], graph="stateful-tiled", **options)
    return r.package


@pytest.fixture(scope="module")
def package(tiny_checkpoint, tmp_path_factory):
    ckpt = tiny_checkpoint(VARIANT)
    out = tmp_path_factory.mktemp("stateful_tiled")
    args = ["export", str(ckpt), "--chunk", str(CHUNK), "--layers", str(LAYER), "--graph", "stateful-tiled"]
    args += ["--capacity", str(CAPACITY), "--tile", str(KEY_TILE), "--query-tile", str(QUERY_TILE), "--decode"]
    assert main([*args, "--out", str(out)]) == 0
    return ckpt, out / f"layer_{LAYER}.mlpackage"


def test_whole_prompt_and_decode_pass_with_both_controls_failing(package):
    ckpt, pkg = package
    meta = read_sidecar_metadata(pkg)
    assert (meta.graph, meta.functions, meta.key_tile, meta.query_tile) == ("stateful-tiled", ["c8", "c1"], 8, 4)
    assert read_raw_metadata(pkg)[MASK_MODE_META] == "causal"
    assert [s.name for s in SavedPackage(pkg).function("c8").inputs] == ["hidden", "start"]  # no [C, capacity] mask
    report = verify_package(pkg, load_checkpoint(ckpt))
    assert report.passed, report.table()
    [run] = [c for c in report.comparisons if not c.control]
    assert "partial" in run.case and run.rows == 3 * CHUNK + 5 + 2  # 3 full chunks, a partial one, 2 decode rows
    assert 1e-5 < run.worst < RELATIVE_ERROR_THRESHOLD
    controls = {c.case: c.worst for c in report.comparisons if c.control}
    assert set(controls) == {"control: wrong position (start + 1)", "control: state carried"}
    assert all(v > 10 * RELATIVE_ERROR_THRESHOLD for v in controls.values()), controls


def test_prefill_prompt_matches_the_reference(package):
    ckpt, pkg = package
    ck = load_checkpoint(ckpt)
    hidden = np.random.default_rng(3).standard_normal((27, ck.geometry.hidden_size)).astype(np.float16)
    ref = prompt_reference(hidden, ck.layer(LAYER), ck.geometry).attn_out
    tiled = prefill_prompt(pkg, hidden)
    assert relative_error(tiled, ref) < RELATIVE_ERROR_THRESHOLD
    # a reference that forgets the earlier chunks is far from the last chunk's rows: the comparison can fail
    alone = prompt_reference(hidden[16:], ck.layer(LAYER), ck.geometry, start=16).attn_out
    assert relative_error(tiled[16:], alone) > 10 * RELATIVE_ERROR_THRESHOLD
    assert relative_error(tiled[16:], ref[16:]) < RELATIVE_ERROR_THRESHOLD


def test_second_read_state_hazard_is_caught(tiny_checkpoint, tmp_path, monkeypatch):
    """Tiles read from a second read_state: coremltools merges it with the first, so attention sees the
    cache as it was before this chunk. Verification must fail on attn_out (and not call itself vacuous)."""
    monkeypatch.setattr(graphs_common, "cache_for_attention", lambda mb, state, updated: mb.read_state(input=state))
    ckpt = tiny_checkpoint(VARIANT)
    pkg = _export(ckpt, tmp_path)
    fn = SavedPackage(pkg).mil_function("c8")
    assert sum(op.op_type == "read_state" for op in fn.operations) == 2  # the re-reads were merged away
    report = verify_package(pkg, load_checkpoint(ckpt))
    assert not report.passed and not report.vacuous
    [run] = [c for c in report.comparisons if not c.control]
    assert run.errors["attn_out"] > 10 * RELATIVE_ERROR_THRESHOLD
    assert run.errors["k_chunk"] < RELATIVE_ERROR_THRESHOLD  # the cache itself is right


def _prefill_with_tile_counts(saved, hidden, monkeypatch, **options):
    """run_stateful_tiled over ``hidden`` (2 decode steps), counting the online-softmax tiles scored and skipped."""
    counts = {"scored": 0, "skipped": 0}
    real = evaluate_module.run_online_step

    def counted(it, step):
        before = dict(it.tile_counts)
        result = real(it, step)
        for key in counts:
            counts[key] += it.tile_counts[key] - before[key]
        return result

    monkeypatch.setattr(evaluate_module, "run_online_step", counted)
    fp16, fuse = options.get("fp16", True), options.get("fuse", True)
    run = lambda function, inputs, state: evaluate_with_state(saved, function, inputs, state, fp16=fp16, fuse=fuse)  # noqa: E731
    out, state = run_stateful_tiled(saved, hidden, CHUNK, CAPACITY, decode_steps=2, evaluate=run)
    return out, state, counts


@pytest.mark.parametrize("fp16", [True, False])
def test_online_steps_run_fused_and_skip_future_tiles_with_the_same_bits(package, monkeypatch, fp16):
    _, pkg = package
    saved = SavedPackage(pkg)
    hidden = np.random.default_rng(5).standard_normal((21, TINY_GEOMETRIES[VARIANT].hidden_size)).astype(np.float16)
    fused, fused_state, counts = _prefill_with_tile_counts(saved, hidden, monkeypatch, fp16=fp16)
    plain, plain_state, plain_counts = _prefill_with_tile_counts(saved, hidden, monkeypatch, fp16=fp16, fuse=False)
    # chunks at 0, 8 and 16 (+ 2 decode rows) over 4 key tiles of 8: the tiles past each call's rows are skipped
    assert counts["skipped"] > 0 and counts["scored"] > 0 and plain_counts == {"scored": 0, "skipped": 0}
    np.testing.assert_array_equal(fused, plain)
    for name in plain_state:
        np.testing.assert_array_equal(fused_state[name], plain_state[name])
    # negative control: skipping a tile that still carries weight is caught by the same comparison
    monkeypatch.setattr(online_step, "SKIP_MARGIN", -1e9)
    wrong, _, _ = _prefill_with_tile_counts(saved, hidden, monkeypatch, fp16=fp16)
    assert relative_error(wrong, plain) > 10 * RELATIVE_ERROR_THRESHOLD


def test_state_is_updated_in_place_as_an_mlstate_is(package):
    _, pkg = package
    saved = SavedPackage(pkg)
    state = new_state(saved, "c8")
    keys = state["k_cache"]
    hidden = np.random.default_rng(6).standard_normal((CHUNK, TINY_GEOMETRIES[VARIANT].hidden_size)).astype(np.float16)
    evaluate_with_state(saved, "c8", {"hidden": hidden, "start": np.array([0], np.int32)}, state)
    assert state["k_cache"] is keys and keys.dtype == np.float16
    assert np.abs(keys[:, :CHUNK]).max() > 0 and not keys[:, CHUNK:].any()  # written where the chunk goes only


def test_additive_mask_mode_reaches_the_graph(tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint("llama")
    [r] = export_sidecars(
        load_checkpoint(ckpt),
        tmp_path,
        CHUNK,
        None,
        [1],
        graph="stateful-tiled",
        capacity=24,
        key_tile=8,
        mask_mode="additive",
    )
    assert [s.name for s in SavedPackage(r.package).function("c8").inputs] == ["hidden", "start", "mask"]
    report = verify_package(r.package, load_checkpoint(ckpt))
    assert report.passed, report.table()
    controls = {c.case: c.worst for c in report.comparisons if c.control}
    assert controls["control: mask reaches graph"] > 10 * RELATIVE_ERROR_THRESHOLD


def test_largest_working_intermediate_is_independent_of_capacity(tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint(VARIANT)
    tiled = {n: intermediate_profile(_export(ckpt, tmp_path / f"t{n}", capacity=n))["c8"] for n in (32, 128)}
    assert tiled[32]["largest_working_bytes"] == tiled[128]["largest_working_bytes"]
    # wasted arithmetic, measured from the saved program: every call scores heads x C x capacity entries
    g = TINY_GEOMETRIES[VARIANT]
    assert tiled[128]["score_entries"] == g.num_heads * CHUNK * 128
    prompt = 27  # 4 calls of 8 rows
    used = g.num_heads * prompt * (prompt + 1) // 2
    measured = 1 - used / (4 * tiled[128]["score_entries"])
    assert measured == pytest.approx(stateful_tiled.wasted_score_fraction(prompt, CHUNK, 128))
    assert stateful_tiled.wasted_score_fraction(prompt, CHUNK, 32) < measured  # a tighter capacity wastes less
    assert tiled[128]["ops"] > tiled[32]["ops"]  # more key tiles, more ops: the price of a static loop
    # negative control: the untiled stateful design's working set grows with the capacity
    untiled = {}
    for n in (32, 128):
        [r] = export_sidecars(
            load_checkpoint(ckpt), tmp_path / f"s{n}", CHUNK, None, [LAYER], graph="stateful", capacity=n
        )
        untiled[n] = intermediate_profile(r.package)["c8"]["largest_working_bytes"]
    assert untiled[128] > tiled[128]["largest_working_bytes"] and untiled[128] > untiled[32]


def test_capacity_65536_with_a_chunk_past_40000(tmp_path):
    """A small-head geometry with 65,536 cache slots: a synthetic cache of 40,008 positions, then one
    chunk and one decode step past 40,000 against the fp64 reference (and the start one late fails)."""
    g = AttentionGeometry(
        variant="llama", hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=10000.0,
        num_layers=1, full_attention_layers=(0,),
    )  # fmt: skip
    w = random_attention_weights(g, 0, TINY_SEED)
    ckpt = write_checkpoint(tmp_path / "m", g, {0: w}, dtype="F32", shards=1, model_type=TINY_MODEL_TYPES["llama"])
    [r] = export_sidecars(
        load_checkpoint(ckpt),
        tmp_path,
        CHUNK,
        None,
        [0],
        graph="stateful-tiled",
        capacity=65536,
        key_tile=2048,
        decode=True,
    )
    saved = SavedPackage(r.package)
    casts = [op for op in saved.mil_function("c8").operations if op.op_type == "cast"]
    assert any(op.inputs["dtype"].val == "int16" or op.inputs["dtype"].val == "uint16" for op in casts)
    start = 40008
    rng = np.random.default_rng(5)
    ck = load_checkpoint(ckpt)
    w = ck.layer(0)
    past = rng.standard_normal((start, g.hidden_size))
    k_hist, v_hist = reference.history_kv(past, w, g, "fp64")  # [start, Hkv, d]
    state = new_state(saved, "c8")
    state["k_cache"][:, :start] = k_hist.transpose(1, 0, 2).astype(np.float16)
    state["v_cache"][:, :start] = v_hist.transpose(1, 0, 2).astype(np.float16)
    rows = rng.standard_normal((CHUNK + 1, g.hidden_size)).astype(np.float16)
    wrong = {k: v.copy() for k, v in state.items()}
    out = evaluate_with_state(saved, "c8", {"hidden": rows[:CHUNK], "start": np.array([start], np.int32)}, state)
    dec = evaluate_with_state(
        saved, "c1", {"hidden": rows[CHUNK:], "start": np.array([start + CHUNK], np.int32)}, state
    )
    k16, v16 = (x.astype(np.float64) for x in (k_hist.astype(np.float16), v_hist.astype(np.float16)))
    ref = reference.attention_block(
        rows.astype(np.float64), k16, v16, causal(CHUNK + 1, start).astype(np.float64), w, g, precision="fp64"
    )
    got = np.concatenate([out["attn_out"], dec["attn_out"]])
    assert relative_error(got, ref.attn_out) < RELATIVE_ERROR_THRESHOLD
    off = evaluate_with_state(saved, "c8", {"hidden": rows[:CHUNK], "start": np.array([start + 1], np.int32)}, wrong)
    assert relative_error(off["attn_out"], ref.attn_out[:CHUNK]) > 10 * RELATIVE_ERROR_THRESHOLD
    # the untiled stateful graph cannot hold this capacity (its positions pass through int16)
    with pytest.raises(AnelabInputError, match="exceeds 32768.*stateful-tiled"):
        export_sidecars(load_checkpoint(ckpt), tmp_path, CHUNK, None, [0], graph="stateful", capacity=65536)


def test_online_softmax_error_stays_small_and_grows_sanely_with_tile_count(tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint("qwen3")
    rows = tile_error_table(ckpt, tmp_path, layer=1, chunk=16, capacity=64, key_tiles=[64, 16, 4], query_tile=16)
    errors = [r["attn_out_error"] for r in rows]
    assert [r["tiles"] for r in rows] == [1, 4, 16]
    assert all(1e-5 < e < RELATIVE_ERROR_THRESHOLD for e in errors), errors
    assert errors[-1] < 4 * errors[0], errors  # 16 rescalings cost at most a few single-tile roundings


def test_bad_requests_are_refused(tiny_checkpoint, tmp_path, capsys):
    ckpt = tiny_checkpoint(VARIANT)
    with pytest.raises(AnelabInputError, match="--tile 12 does not divide the state capacity 32"):
        _export(ckpt, tmp_path, key_tile=12)
    with pytest.raises(AnelabInputError, match="--query-tile 3 does not divide the chunk 8"):
        _export(ckpt, tmp_path, query_tile=3)
    with pytest.raises(AnelabInputError, match="unknown mask mode"):
        _export(ckpt, tmp_path, mask_mode="window")
    with pytest.raises(AnelabInputError, match="--query-tile applies to --graph stateful-tiled"):
        export_sidecars(load_checkpoint(ckpt), tmp_path, CHUNK, [0], [LAYER], query_tile=4)
    with pytest.raises(AnelabInputError, match="selection contract"):
        export_sidecars(
            load_checkpoint(ckpt), tmp_path, CHUNK, None, [LAYER], graph="stateful-tiled", capacity=32,
            selection={"kept_blocks": 4, "compress_ratio": 4},
        )  # fmt: skip
    code = main(["export", str(ckpt), "--chunk", "8", "--graph", "stateful-tiled", "--capacity", "32",
                 "--query-tile", "5", "--out", str(tmp_path)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--query-tile 5" in err[0]
    assert not any(tmp_path.glob("*.mlpackage"))


def test_planner_op_count_formula_matches_built_programs(tiny_checkpoint):
    ck = load_checkpoint(tiny_checkpoint(VARIANT))
    counts = {}
    for capacity, kt, qt in ((32, 8, 4), (64, 8, 8), (64, 16, 2)):
        build = function_builds(
            ck.geometry, ck.layer(LAYER), "stateful-tiled", CHUNK, None, key_tile=kt, capacity=capacity,
            query_tile=qt,
        )["c8"]  # fmt: skip
        ops = [op for op in build().functions["main"].operations if op.op_type != "const"]
        counts[(capacity, kt, qt)] = len(ops)
        predicted = stateful_tiled_ops(CHUNK, capacity, kt, qt)
        assert abs(predicted - len(ops)) <= 0.1 * len(ops), (capacity, kt, qt, predicted, len(ops))
    # each extra tile pair costs about OPS_PER_TILE_PAIR ops
    assert abs((counts[(64, 16, 2)] - counts[(32, 8, 4)]) / 8 - OPS_PER_TILE_PAIR) < 3


def test_planner_prints_three_designs_for_qwen38(capsys):
    designs = {d.design: d for d in compare_designs(4333, "qwen3.8-125b-a6b-4bit", 4096)}
    assert designs["dense"].loads == 24 and designs["stateful"].loads == designs["stateful-tiled"].loads == 12
    assert designs["dense"].decision == "gpu" and round(designs["dense"].predicted_ratio, 2) == 0.72
    assert designs["stateful-tiled"].per_call_arena_bytes == 24 * 256 * 1024 * 2
    assert designs["stateful"].per_call_arena_bytes == 24 * 4096 * 8192 * 2
    # 2 calls x 4096 rows x 8192 slots scored; P(P+1)/2 used
    assert designs["stateful"].wasted_fraction == pytest.approx(1 - 4333 * 4334 / 2 / (2 * 4096 * 8192))
    code = main(["plan", "--prompt-tokens", "4333", "--family", "qwen3.8-125b-a6b-4bit", "--design", "all"])
    out = capsys.readouterr().out
    assert code == 0
    lines = [x for x in out.splitlines() if x.startswith("qwen3.8-125b-a6b-4bit")]
    assert [x.split()[1] for x in lines] == ["dense", "stateful", "stateful-tiled"]
    assert "0.72x  gpu" in lines[0] and "assumptions (stateful-tiled)" in out
    assert main(["plan", "--prompt-tokens", "4333", "--design", "sideways"]) == 2


def test_a_tile_is_skipped_only_when_every_weight_is_provably_zero():
    """online_step._skippable: the skip needs a finite running max far above anything the tile can reach."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((4, 8)).astype(np.float32) for _ in range(3))
    masked = [np.full(4, -30000.0)]  # every key of the tile dropped, for every row
    m = np.full((4, 1), 2.0, np.float32)
    assert online_step._skippable(q, k, v, masked, m)
    assert not online_step._skippable(q, k, v, masked, None)  # the first tile: no running max yet
    assert not online_step._skippable(q, k, v, [np.full(4, 0.0)], m)  # a visible key
    assert not online_step._skippable(q, k, v, [np.full(4, -30000.0 + 200)], np.full((4, 1), -29700.0, np.float32))
    assert not online_step._skippable(q, k, v, masked, np.array([[2.0], [np.nan], [2.0], [2.0]], np.float32))
    assert not online_step._skippable(q * 1e3, k * 1e3, v, masked, m)  # |q.k| could overflow fp16
    assert not online_step._skippable(q, k, np.where(np.eye(4, 8) > 0, np.inf, v).astype(np.float32), masked, m)


def test_fp32_with_a_callers_runner_is_refused_not_ignored(package):
    _, pkg = package
    saved = SavedPackage(pkg)
    hidden = np.zeros((CHUNK, TINY_GEOMETRIES[VARIANT].hidden_size), np.float16)
    calls = []
    run = lambda function, inputs, state: calls.append(function) or evaluate_with_state(saved, function, inputs, state)  # noqa: E731
    with pytest.raises(AnelabInputError, match="fp16=False applies to NumPy evaluation only"):
        run_stateful_tiled(saved, hidden, CHUNK, CAPACITY, evaluate=run, fp16=False)
    assert not calls
    run_stateful_tiled(saved, hidden, CHUNK, CAPACITY, evaluate=run)  # the runner alone is used
    assert calls == ["c8"]
