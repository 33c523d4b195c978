"""Studies 3-4 helpers: break-even search, offload shares, sweeps, package sizes, Mac measurements on a fake runtime.

Expected values are hand-computed from the planner's documented cost model, typed from the seed
(shared/seeds/ane-prefill-research.txt), or produced by an independent brute force (planning every
prompt length); each check has a negative control.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.core.masks import MASKED
from anelab.core.records import read_record
from anelab.planner import format_plan
from anelab.planner.plan import plan
from anelab.publish.provenance import compact_provenance
from anelab.runtimes.coreml.block_ab import ab_table, block_inputs, time_attention_ab
from anelab.runtimes.coreml.coreml_fake import FakeClock, FakeFunction, FakeRuntime
from anelab.runtimes.coreml.coreml_runtime import default_runtime
from anelab.runtimes.interface import RuntimeUnavailableError
from anelab.sidecar.format import read_sidecar_metadata
from anelab.studies.dense_offload import amdahl_ratio, offload_shares, ratio_sweep, recorded_ab_rows
from anelab.studies.setup_cost import (
    break_even,
    break_even_setup,
    export_function_sweep,
    load_memory_isolated,
    measure_load_memory,
    memory_vs_functions,
    package_size,
    package_size_record,
)

SEED_TOKENS = 4333
SEED_LOADS_38 = (6.7, 13.6, 37.5)  # h0, h4096, h8192 on Qwen 3.8
SEED_RATIOS = {
    "qwen3.5-2b-4bit": 1.38,
    "qwen3.5-2b-8bit": 1.14,
    "qwen3.5-4b-4bit": 1.38,
    "qwen3.5-4b-8bit": 1.26,
    "qwen3.5-9b-4bit": 1.25,
    "qwen3.5-9b-8bit": 1.13,
    "agentworld-35b-a3b-4bit": 1.68,
    "qwen3.8-125b-a6b-4bit": 0.72,
    "qwen3.8-125b-a6b-8bit": 0.87,
}
# A one-layer, one-head model at chunk 4 with rates of 1 (GPU) and 0.25 (ANE) s per score entry:
# gpu/ane_attention_seconds are for one full chunk at history 0 = 1 x 4 x 4 = 16 entries.
HAND = dict(
    chunk=4,
    num_layers=1,
    full_attention_layers=[0],
    num_heads=1,
    gpu_attention_seconds=16.0,
    ane_attention_seconds=4.0,
    non_attention_seconds=0.0,
)
MAX_SEARCH_PLANS = 200  # the bisection must need far fewer planner calls than one per prompt length


def brute_force_intervals(family, max_tokens, **plan_args):
    """Winning prompt lengths by planning every one of 1..max_tokens (the reference for the search)."""
    runs, start = [], None
    for n in range(1, max_tokens + 1):
        win = plan(n, family=family, allow_past_coverage=True, **plan_args).decision == "ane"
        if win and start is None:
            start = n
        if not win and start is not None:
            runs.append((start, n - 1))
            start = None
    if start is not None:
        runs.append((start, max_tokens))
    return tuple(runs)


# ---- break-even ---------------------------------------------------------------------------------
def test_break_even_by_hand():
    # 5 s per load. P=4: GPU 16 vs ANE 4 + setup 5 -> win. P=5: GPU 16 + 1x5 = 21 vs ANE 4 + 4x8x0.25 = 12
    # + setup 10 -> 22, lose. P=6: GPU 16 + 2x6 = 28 > 22, win; every longer prompt wins too.
    b = break_even(max_tokens=12, load_seconds=5.0, **HAND)
    assert b.win_intervals == ((4, 4), (6, 12))
    assert (b.first_win, b.wins_from, b.searched_up_to) == (4, 6, 12)
    # negative control: 3 s loads make P=5 a win (21 > 12 + 6), so one unbroken interval
    cheap = break_even(max_tokens=12, load_seconds=3.0, **HAND)
    assert cheap.win_intervals == ((4, 12),) and cheap.wins_from == 4


@pytest.mark.parametrize(
    "family, max_tokens, plan_args",
    [
        (None, 160, dict(HAND, chunk=16, gpu_attention_seconds=256.0, ane_attention_seconds=64.0, load_seconds=150.0)),
        ("qwen3.8-125b-a6b-4bit", 12288, {}),
        ("qwen3.8-125b-a6b-4bit", 12288, dict(max_history=8192, load_seconds=[0.6 * s for s in SEED_LOADS_38])),
        ("qwen3.5-2b-4bit", 16384, dict(load_seconds=4.0)),
    ],
)
def test_break_even_matches_planning_every_prompt(family, max_tokens, plan_args):
    b = break_even(family, max_tokens=max_tokens, **plan_args)
    expected = brute_force_intervals(family, max_tokens, **{"chunk": b.chunk, **plan_args})
    assert b.win_intervals == expected
    assert len(expected) >= 2 or family == "qwen3.5-2b-4bit"  # the saw-tooth cases really have gaps
    assert b.plans < MAX_SEARCH_PLANS


def test_break_even_brute_force_control():
    # negative control for the comparison above: different loads give different intervals
    base = break_even("qwen3.5-2b-4bit", max_tokens=16384, load_seconds=4.0)
    assert base.win_intervals != brute_force_intervals("qwen3.5-2b-4bit", 16384, chunk=4096, load_seconds=2.0)


def test_break_even_reproduces_the_seeds_verdicts():
    loses = break_even("qwen3.8-125b-a6b-4bit")
    assert loses.searched_up_to == 12288  # the recorded cap: max-history 8192 + chunk
    assert not any(lo <= SEED_TOKENS <= hi for lo, hi in loses.win_intervals)  # 0.72x: stays on the GPU
    assert loses.wins_from is None
    wins = break_even("qwen3.5-2b-4bit", max_tokens=8192, loads_in_arm=False)  # the rows' warm protocol
    assert any(lo <= SEED_TOKENS <= hi for lo, hi in wins.win_intervals)  # 1.38x: offload
    assert wins.first_win == 4096  # a shorter prompt is one partial chunk


def test_break_even_setup_is_the_tie():
    p = plan(SEED_TOKENS, family="qwen3.8-125b-a6b-4bit")
    tie = break_even_setup(p)
    assert p.variants_visited == 24
    below = plan(SEED_TOKENS, family="qwen3.8-125b-a6b-4bit", load_seconds=tie * 0.99)
    above = plan(SEED_TOKENS, family="qwen3.8-125b-a6b-4bit", load_seconds=tie * 1.01)
    assert (below.decision, above.decision) == ("ane", "gpu")
    assert break_even_setup(plan(2000, family="qwen3.8-125b-a6b-4bit")) is None  # nothing offloaded


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(max_tokens=0, chunk=4), "max_tokens"),
        (dict(max_tokens=10), "chunk"),
        (dict(family="qwen9", max_tokens=10), "unknown family"),
    ],
)
def test_break_even_bad_input(kwargs, needle):
    with pytest.raises(AnelabInputError, match=needle):
        break_even(**kwargs)


# ---- the two explanations ------------------------------------------------------------------------
def test_amdahl_ratio_by_hand():
    assert amdahl_ratio(0.5, 2.0) == pytest.approx(4 / 3)
    assert amdahl_ratio(0.0, 7.0) == pytest.approx(1.0)
    assert amdahl_ratio(1.0, 3.0) == pytest.approx(3.0)
    assert amdahl_ratio(0.5, 0.5) == pytest.approx(2 / 3)  # a slower offloaded part loses
    for share, speedup in ((1.5, 2.0), (0.5, 0.0)):
        with pytest.raises(AnelabInputError):
            amdahl_ratio(share, speedup)


def test_offload_shares():
    shares = {s["family"]: s for s in offload_shares()}
    assert set(shares) == set(SEED_RATIOS)
    assert {f: s["recorded_ratio"] for f, s in shares.items()} == SEED_RATIOS
    # the seed's counts: "the 35B offloads 10 of 40 layers, the dense 2B only 6 of 24"
    assert (
        shares["agentworld-35b-a3b-4bit"]["full_attention_layers"],
        shares["agentworld-35b-a3b-4bit"]["layers"],
    ) == (10, 40)
    assert (shares["qwen3.5-2b-4bit"]["full_attention_layers"], shares["qwen3.5-2b-4bit"]["layers"]) == (6, 24)
    assert {s["layer_share"] for s in shares.values()} == {0.25}
    for s in shares.values():  # the shares and the speed-up recompose the planner's ratio (setup included in k)
        assert amdahl_ratio(s["time_share"], s["speedup"]) == pytest.approx(s["predicted_ratio"], rel=1e-9)
    # "ratios fall at 8-bit because the non-attention prefill ... is heavier there"
    for size in ("2b", "4b", "9b"):
        assert shares[f"qwen3.5-{size}-8bit"]["time_share"] < shares[f"qwen3.5-{size}-4bit"]["time_share"]
    # negative control: without the setup, the 35B's offloaded part would look faster than it is
    s = shares["agentworld-35b-a3b-4bit"]
    p = plan(SEED_TOKENS, family=s["family"])
    assert (
        amdahl_ratio(s["time_share"], p.gpu_attention_seconds / p.ane_attention_seconds) > s["predicted_ratio"] * 1.05
    )


def test_recorded_ab_rows():
    rows = recorded_ab_rows()
    assert len(rows) == 11  # 8 rows of v5.5 (one GPU-only), the chunk-1024 point, two v5.6 rows
    narrow = [r for r in rows if r["chunk"] == 1024]
    assert [(r["gpu_seconds"], r["ane_seconds"], r["ratio"], r["prompt_tokens"]) for r in narrow] == [
        (23.33, 17.88, 1.30, 2500)
    ]
    gpu_only = [r for r in rows if r["ane_seconds"] is None]
    assert [(r["family"], r["gpu_seconds"], r["record"]) for r in gpu_only] == [
        ("qwen3.8-125b-a6b-4bit", 175.1, "v5.5-ane-matrix-3.json")
    ]
    assert {r["bits"] for r in rows} == {4, 8}


def test_ratio_sweep():
    rows = ratio_sweep("qwen3.8-125b-a6b-4bit", [2000, SEED_TOKENS, 13000])
    short, seed, past = rows
    assert (short["decision"], short["variants_visited"], short["predicted_ratio"]) == ("gpu", 0, 1.0)
    assert (seed["variants_visited"], seed["fits"], seed["decision"]) == (24, True, "gpu")
    assert seed["setup_seconds"] == pytest.approx(12 * (6.7 + 13.6))  # the seed's ~245 s
    assert (past["fits"], past["decision"], past["variants_visited"], past["predicted_ratio"]) == (False, "gpu", 0, 1.0)
    with pytest.raises(AnelabInputError):
        ratio_sweep("qwen3.5-2b-4bit", [])


def test_format_plan():
    text = format_plan(plan(SEED_TOKENS, family="qwen3.8-125b-a6b-4bit").to_dict())
    assert "decision: gpu" in text and "variants visited: 24" in text and "4,333 tokens" in text
    assert "decision: ane" in format_plan(plan(SEED_TOKENS, family="qwen3.5-2b-4bit", loads_in_arm=False).to_dict())


def test_compact_provenance():
    prov = {"machine_model": "Mac15,3", "chip": "Apple M3", "os_version": "macOS 27.0"}
    recs = [{"origin": "recorded", "provenance": prov, "_file": f"{name}.json"} for name in ("a" * 30, "b" * 30, "c")]
    assert compact_provenance(recs) == (
        "recorded on Mac15,3 (M3), macOS 27.0 — replayed, not measured here\n"
        f"source: {'a' * 30}.json,\n{'b' * 30}.json, c.json"
    )
    here = {
        "origin": "measured",
        "provenance": {"machine_model": "Linux x86_64", "chip": "x86_64", "os_version": "Linux 6.18.44-fc-v595"},
        "_file": "m.json",
    }
    assert compact_provenance([here], planner=True) == (
        "measured here: Linux x86_64\nlines: planner (anelab.planner) fitted on these records"
    )  # the kind of machine (no kernel build string); no source line for this run's own record
    assert compact_provenance([here, recs[2]]).endswith("source: c.json")
    with pytest.raises(AnelabInputError):
        compact_provenance([{**here, "origin": "guessed"}])


# ---- measured here: package sizes -----------------------------------------------------------------
def _handmade_package(path, source: str):
    from coremltools import proto

    (path / "Data/com.apple.CoreML/weights").mkdir(parents=True)
    (path / "Manifest.json").write_bytes(b"{}")
    (path / "Data/com.apple.CoreML/weights/weight.bin").write_bytes(b"w" * 100)
    spec = proto.Model_pb2.Model(specificationVersion=9)
    spec.description.metadata.shortDescription = "a program"
    spec.description.metadata.userDefined["anelab.source"] = source
    (path / "Data/com.apple.CoreML/model.mlmodel").write_bytes(spec.SerializeToString())
    return path


def test_package_size_of_a_handmade_package(tmp_path):
    from coremltools import proto

    pkg = _handmade_package(tmp_path / "x.mlpackage", "/a/checkout/build/checkpoints/model")
    bare = proto.Model_pb2.Model(specificationVersion=9)
    bare.description.metadata.shortDescription = "a program"
    spec_bytes = len(bare.SerializeToString())
    assert package_size(pkg) == {"weight_bytes": 100, "spec_bytes": spec_bytes, "total_bytes": 102 + spec_bytes}
    with pytest.raises(AnelabInputError, match="not an .mlpackage"):
        package_size(tmp_path)


def test_package_size_does_not_depend_on_where_the_checkout_lies(tmp_path):
    """The same program exported from a checkout elsewhere records a longer checkpoint path: same sizes
    (control: the spec files themselves differ in size)."""
    here = _handmade_package(tmp_path / "a.mlpackage", "/work/main/build/checkpoints/model")
    there = _handmade_package(tmp_path / "b.mlpackage", "/home/someone/src/anelab-clone/build/checkpoints/model")
    spec = "Data/com.apple.CoreML/model.mlmodel"
    assert (here / spec).stat().st_size != (there / spec).stat().st_size
    assert package_size(here) == package_size(there)


@pytest.fixture(scope="module")
def swept(tiny_checkpoint, tmp_path_factory):
    """Packages of the tiny checkpoint's layer 1 with 1 and 2 functions (chunk 8)."""
    checkpoint = tiny_checkpoint("qwen3_next", "F32")
    return checkpoint, export_function_sweep(
        checkpoint, tmp_path_factory.mktemp("sweep"), layer=1, chunk=8, counts=[2, 1]
    )


def test_export_function_sweep_stores_weights_once(swept, tmp_path):
    checkpoint, packages = swept
    assert sorted(packages) == [1, 2]
    assert read_sidecar_metadata(packages[2]).histories == [0, 8]
    weights = load_checkpoint(checkpoint).layer(1)
    fp16_bytes = 2 * sum(np.asarray(v).size for v in vars(weights).values() if isinstance(v, np.ndarray))
    one, two = package_size(packages[1]), package_size(packages[2])
    assert one["weight_bytes"] == two["weight_bytes"]
    # stored once: at least the layer's fp16 weights, and less than two copies of them (negative
    # control: a package holding the weights once per function would exceed 2 x fp16_bytes)
    assert fp16_bytes <= two["weight_bytes"] < 2 * fp16_bytes
    assert two["spec_bytes"] > one["spec_bytes"]  # one more function's program
    record = package_size_record(packages, layer=1, chunk=8, checkpoint="tiny", out_dir=tmp_path)
    saved = read_record(tmp_path / record["_file"])
    assert saved["origin"] == "measured" and saved["kind"] == "package_size"
    assert [r["functions"] for r in saved["results"]["rows"]] == [1, 2]
    assert saved["results"]["rows"][1]["weight_bytes"] == two["weight_bytes"]


def test_export_function_sweep_bad_counts(swept, tmp_path):
    with pytest.raises(AnelabInputError, match="function counts"):
        export_function_sweep(swept[0], tmp_path, layer=1, chunk=8, counts=[0, 2])


# ---- measured on a Mac (fake runtime here) ------------------------------------------------------------
def test_block_inputs(tiny_checkpoint):
    g = load_checkpoint(tiny_checkpoint("qwen3_next", "F32")).geometry
    first = block_inputs(g, 8, 0)
    assert set(first) == {"hidden", "mask"} and first["hidden"].shape == (8, 48)
    later = block_inputs(g, 8, 16)
    assert later["k_history"].shape == later["v_history"].shape == (16, 2, 16)
    assert later["mask"].shape == (8, 24) and later["hidden"].dtype == np.float16
    assert (later["mask"][0, :17] == 0).all() and (later["mask"][0, 17:] == MASKED).all()  # row 0 sits at position 16


def _package(tmp_path: Path, name: str = "layer_1.mlpackage") -> Path:
    pkg = tmp_path / name
    pkg.mkdir(parents=True)
    (pkg / "Manifest.json").write_text("{}")
    return pkg


def test_time_attention_ab_and_table(tiny_checkpoint, tmp_path):
    g = load_checkpoint(tiny_checkpoint("qwen3_next", "F32")).geometry
    clock = FakeClock()
    # output_convert_s=0: the wall time is Core ML's alone, so the table's seconds are the scripted ones
    fast_ne = FakeFunction(predict_s={"cpu_and_gpu": 0.020, "cpu_and_ne": 0.005}, output_convert_s=0.0)
    no_ne = FakeFunction(
        predict_s={"cpu_and_gpu": 0.030}, unloadable_units=frozenset({"cpu_and_ne"}), output_convert_s=0.0
    )
    runtime = FakeRuntime({"h0": fast_ne, "h8": no_ne}, clock=clock)
    records = time_attention_ab(
        runtime, _package(tmp_path), g, chunk=8, histories=[0, 8], repeats=2, clock=clock, out_dir=tmp_path / "records"
    )
    assert [r["parameters"]["input_shapes"] for r in records] == [
        {"hidden": [8, 48], "mask": [8, 8]},
        {"hidden": [8, 48], "mask": [8, 16], "k_history": [8, 2, 16], "v_history": [8, 2, 16]},
    ]
    assert all((tmp_path / "records" / r["_file"]).is_file() for r in records)
    table = ab_table(records)
    assert [(r["function"], r["prompt_tokens"]) for r in table] == [("h0", 8), ("h8", 16)]
    assert table[0]["cpu_and_gpu_s"] == pytest.approx(0.020) and table[0]["cpu_and_ne_s"] == pytest.approx(0.005)
    assert table[0]["ane_over_gpu"] == pytest.approx(4.0)
    assert table[1]["cpu_and_ne_s"] is None and table[1]["ane_over_gpu"] is None  # did not load under cpu_and_ne
    with pytest.raises(AnelabInputError, match="predict_timing"):
        ab_table([{"kind": "load_timing"}])


def test_measure_load_memory_with_a_scripted_rss(tmp_path):
    readings = iter([1000, 1500, 1800])
    result = measure_load_memory(FakeRuntime(), _package(tmp_path), ["h0", "h8"], rss=lambda: next(readings))
    assert result == {
        "rss_before_bytes": 1000,
        "loads": [
            {"function": "h0", "rss_bytes": 1500, "delta_bytes": 500},
            {"function": "h8", "rss_bytes": 1800, "delta_bytes": 800},
        ],
        "read": "after the package was compiled and coremltools imported, before the first load",
    }
    with pytest.raises(RuntimeUnavailableError):
        measure_load_memory(FakeRuntime(available=False), _package(tmp_path, "b.mlpackage"), ["h0"], rss=lambda: 0)


def test_memory_vs_functions_record(swept, tmp_path):
    _, packages = swept
    seen = []

    def fake_measure(pkg, functions, *, compute_units):
        seen.append((Path(pkg).parent.name, list(functions), compute_units))
        return {
            "rss_before_bytes": 0,
            "loads": [
                {"function": f, "rss_bytes": 10 * (i + 1), "delta_bytes": 10 * (i + 1)} for i, f in enumerate(functions)
            ],
        }

    record = memory_vs_functions(packages, measure=fake_measure, out_dir=tmp_path)
    assert seen == [("n1", ["h0"], "cpu_and_ne"), ("n2", ["h0", "h8"], "cpu_and_ne")]
    rows = read_record(tmp_path / record["_file"])["results"]["rows"]
    assert [(r["functions"], r["first_function_delta_bytes"], r["all_functions_delta_bytes"]) for r in rows] == [
        (1, 10, 10),
        (2, 10, 20),
    ]
    assert record["origin"] == "measured" and record["parameters"]["isolated"] is False


def test_load_memory_isolated_reports_a_missing_runtime(tmp_path):
    if default_runtime().available():
        pytest.skip("macOS with the Core ML runtime: the refusal path is for machines without it")
    with pytest.raises(AnelabInputError, match="Core ML runtime is unavailable"):
        load_memory_isolated(_package(tmp_path), ["h0"])
