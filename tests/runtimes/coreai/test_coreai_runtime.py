"""The Core AI runtime behind ``runtimes.interface.CoreAIRuntime``: one-line refusals off macOS 27, a fake
that charges and refuses what Core AI does, the timing protocols (cold / warm / fresh process / per
entrypoint count / compiled / predict), and ``anelab measure`` recording them on the fake Mac beside Core
ML's loads of the same layer."""

from __future__ import annotations

import numpy as np
import pytest

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.core.records import read_records
from anelab.publish.measure import MeasureConfig, measure
from anelab.runtimes.coreai import coreai_timing
from anelab.runtimes.coreai.coreai_fake import FakeCoreAICosts, FakeCoreAIRuntime, fake_asset_signatures
from anelab.runtimes.coreai.coreai_runtime import CoreAIMacRuntime, default_coreai_runtime
from anelab.runtimes.coreml.coreml_fake import FakeClock, FakeFunction, FakeRuntime
from anelab.runtimes.interface import RuntimePredictError, RuntimeUnavailableError
from anelab.sidecar.export import export_sidecars

CHUNK = 8


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"platform_name": "linux"}, "it needs macOS 27.0+ on Apple silicon"),
        ({"platform_name": "darwin", "machine": "arm64", "macos_version": lambda: (26, 4)}, "runs macOS 26.4"),
        ({"platform_name": "darwin", "machine": "x86_64", "macos_version": lambda: (27, 0)}, "this Mac is x86_64"),
    ],
)
def test_off_macos_27_the_runtime_refuses_in_one_line(kwargs, words):
    runtime = CoreAIMacRuntime(**kwargs)
    reason = runtime.unavailable_reason()
    assert words in reason and "\n" not in reason and not runtime.available()
    with pytest.raises(RuntimeUnavailableError, match="the Core AI runtime is unavailable"):
        runtime.specialize("x.aimodel", "neural_engine")


def test_this_linux_machine_cannot_measure_core_ai():
    assert not default_coreai_runtime().available()
    assert "export, verify and inspect .aimodel sidecars run here" in default_coreai_runtime().unavailable_reason()


@pytest.fixture(scope="module")
def asset(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("coreai-rt")
    [result] = export_sidecars(
        load_checkpoint(tiny_checkpoint("llama")), root, CHUNK, [0, CHUNK], [0], backend="coreai", jobs=1
    )
    return result.package


def test_specialization_is_cached_per_path_and_options_and_a_python_clear_does_not_reach_the_system_cache(asset):
    fake = FakeCoreAIRuntime()
    cost = fake.costs
    fake.specialize(asset, "neural_engine")
    first = fake.calls[-1][-1]
    fake.specialize(asset, "neural_engine")
    assert fake.calls[-1][-1] == cost.cache_hit_s < first  # a hit
    fake.specialize(asset, "gpu")
    assert fake.calls[-1][-1] == first  # other options: another specialization
    fake.clear_cache(asset)
    fake.specialize(asset, "neural_engine")
    assert fake.calls[-1][-1] == cost.cache_hit_s  # never kinder: the system entry survived the clear


def test_cold_protocol_pays_the_specialization_and_a_naive_one_would_not(asset, tmp_path):
    """Negative control of the cold protocol: clearing and reloading the same path measures a cache hit."""
    fake = FakeCoreAIRuntime()
    cold = coreai_timing.time_specialization(fake, asset, cold=True, repeats=2, work=tmp_path, clock=fake.clock)
    warm = coreai_timing.time_specialization(fake, asset, cold=False, repeats=2, work=tmp_path, clock=fake.clock)
    c = fake.costs
    arena = sum(s["score_arena_bytes"] for s in fake_asset_signatures(asset).values()) / 1e9
    expected = c.specialize_base_s + 2 * c.specialize_per_entrypoint_s + c.specialize_per_gb_s * arena
    assert cold["results"]["median_s"] == pytest.approx(expected)
    assert warm["results"]["median_s"] == pytest.approx(c.cache_hit_s)
    assert set(cold["results"]["load_function_s"]) == {"h0", f"h{CHUNK}"}
    assert coreai_timing.COLD_CAVEAT in cold["unknown"]
    fake.clear_cache(asset)
    naive = coreai_timing._load_once(fake, asset, "neural_engine", fake.clock, ["h0"])[0]
    assert naive == pytest.approx(c.cache_hit_s)  # what a same-path "cold" load would have recorded
    flagged = coreai_timing.flag_uncleared([cold, warm])
    assert flagged[0]["results"]["cold_not_above_warm"] is False


def test_a_fresh_process_finds_the_cached_entry(asset, tmp_path, monkeypatch):
    fake = FakeCoreAIRuntime()
    record = coreai_timing.time_fresh_process(fake, asset, repeats=2, clock=fake.clock)
    assert record["parameters"]["mode"] == "fresh_process"
    assert record["results"]["samples_s"] == pytest.approx([fake.costs.cache_hit_s] * 2)
    # negative control: a child that cannot see this process's cache (another cache file) specializes again
    elsewhere = FakeCoreAIRuntime()
    spec = {**fake.child_spec(), "args": {**fake.child_spec()["args"], "cache_file": str(tmp_path / "other.json")}}
    monkeypatch.setattr(elsewhere, "child_spec", lambda: spec)
    unshared = coreai_timing.time_fresh_process(elsewhere, asset, repeats=1, clock=elsewhere.clock)
    assert unshared["results"]["median_s"] > 10 * fake.costs.cache_hit_s


def test_the_compiled_asset_loads_at_a_fraction_of_the_specialization(asset, tmp_path):
    fake = FakeCoreAIRuntime(costs=FakeCoreAICosts(compiled_fraction=0.25))
    cold, warm = coreai_timing.time_compiled(fake, asset, repeats=1, work=tmp_path, clock=fake.clock)
    source = coreai_timing.time_specialization(fake, asset, cold=True, repeats=1, work=tmp_path / "s", clock=fake.clock)
    assert cold["parameters"]["mode"] == "compiled_cold" and cold["parameters"]["asset"].endswith(".aimodelc")
    assert cold["results"]["median_s"] == pytest.approx(0.25 * source["results"]["median_s"])
    assert warm["results"]["median_s"] == pytest.approx(fake.costs.cache_hit_s)
    assert cold["parameters"]["compile_s"] == pytest.approx(fake.costs.compile_s)


def test_the_fake_refuses_what_core_ai_refuses(asset, tmp_path):
    fake = FakeCoreAIRuntime()
    with pytest.raises(AnelabInputError, match="unknown Core AI compute unit 'ane'"):
        fake.specialize(asset, "ane")
    model = fake.specialize(asset, "neural_engine")
    with pytest.raises(KeyError, match="No function named 'h99'"):
        fake.load_function(model, "h99")
    function = fake.load_function(model, "h0")
    sig = fake_asset_signatures(asset)["h0"]["inputs"]
    good = {n: np.zeros(shape, dtype) for n, (shape, dtype) in sig.items()}
    assert set(fake.predict(function, good)) == {"attn_out", "k_chunk", "v_chunk"}
    with pytest.raises(RuntimePredictError, match="invalid scalar type: float32, expected: float16"):
        fake.predict(function, {**good, "hidden": good["hidden"].astype(np.float32)})
    with pytest.raises(RuntimePredictError, match="missing input 'mask'"):
        fake.predict(function, {"hidden": good["hidden"]})
    not_an_asset = tmp_path / "layer_0.mlpackage"
    not_an_asset.mkdir()
    with pytest.raises(Exception, match="not a Core AI model asset"):
        fake.specialize(not_an_asset, "neural_engine")


def test_predictions_are_timed_per_entrypoint_on_the_neural_engine(asset):
    fake = FakeCoreAIRuntime()
    records = coreai_timing.time_predictions(fake, asset, repeats=3, clock=fake.clock)
    assert [r["parameters"]["entrypoint"] for r in records] == ["h0", f"h{CHUNK}"]
    assert all(r["results"]["median_s"] == pytest.approx(fake.costs.predict_s) for r in records)
    assert records[1]["parameters"]["score_arena_bytes"] > records[0]["parameters"]["score_arena_bytes"]


@pytest.fixture(scope="module")
def measured(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("measure-coreai")
    config = MeasureConfig(
        checkpoint=tiny_checkpoint("llama"), chunk=CHUNK, histories=[0, CHUNK], repeats=1, probe_chunk=8,
        build=root / "build", records=root / "records", split_models=(),  # the real model's splits: not this test's
    )  # fmt: skip
    runtime = FakeRuntime(numerics=True, default=FakeFunction(cold_load_s=2.0, warm_load_s=0.5))
    coreai = FakeCoreAIRuntime(clock=runtime.clock)
    with pytest.MonkeyPatch.context() as patch:  # the sweep cut short of 30 entrypoints (a 30-function export)
        patch.setattr(coreai_timing, "ENTRYPOINT_COUNTS", (1, 3, 9))
        result = measure(config, runtime=runtime, clock=runtime.clock, echo=lambda _: None, coreai_runtime=coreai)
    return config, result


def test_measure_records_core_ai_beside_core_mls_loads_of_the_same_layer(measured):
    config, result = measured
    records = read_records(config.records)
    core_ai = [r for r in records if r["parameters"]["measure"]["step"] == "coreai"]
    modes = sorted({r["parameters"]["mode"] for r in core_ai if r["kind"] == "coreai_specialization"})
    assert modes == ["cold", "compiled_cold", "compiled_warm", "fresh_process", "warm"]
    counts = sorted(
        r["parameters"]["entrypoints"] for r in core_ai if r["parameters"].get("sweep") == "entrypoint_count"
    )
    assert counts == [1, 3, 9]  # the fixture's sweep (one lowering per count; 30 costs a 30-function export)
    loads = [r for r in records if r["kind"] == "load_timing"]
    key = loads[0]["parameters"]["measure"]["package_sha256"]
    assert all(r["parameters"]["coreml_package_sha256"] == key for r in core_ai)  # the same layer's Core ML package
    assert all(r["parameters"]["layer"] == 0 and r["parameters"]["chunk"] == CHUNK for r in core_ai)
    predicts = [r for r in core_ai if r["kind"] == "coreai_predict"]
    assert [r["parameters"]["entrypoint"] for r in predicts] == ["h0", f"h{CHUNK}"]
    cold = next(r for r in core_ai if r["parameters"].get("mode") == "cold" and "sweep" not in r["parameters"])
    per_count = {
        r["parameters"]["entrypoints"]: r["results"]["median_s"] for r in core_ai if "sweep" in r["parameters"]
    }
    assert per_count[9] > per_count[3] > per_count[1]  # the fake charges per entrypoint
    assert cold["results"]["cold_not_above_warm"] is False
    assert result["unavailable"] == {"split_ab": "no model given (--split-models)"}  # the fixture gives none


def test_measure_off_macos_27_leaves_core_ai_out_in_one_line(tiny_checkpoint, tmp_path):
    config = MeasureConfig(
        checkpoint=tiny_checkpoint("llama"), chunk=CHUNK, histories=[0], repeats=1, probe_chunk=8,
        build=tmp_path / "build", records=tmp_path / "records", split_models=(),
    )  # fmt: skip
    runtime = FakeRuntime(numerics=True, default=FakeFunction(cold_load_s=2.0, warm_load_s=0.5))
    lines = []
    result = measure(config, runtime=runtime, clock=runtime.clock, echo=lines.append,
                     coreai_runtime=CoreAIMacRuntime(platform_name="darwin", machine="arm64", macos_version=lambda: (26, 0)))  # fmt: skip
    assert "runs macOS 26.0" in result["unavailable"]["coreai"]
    assert [line for line in lines if line.startswith("coreai:")] == [
        f"coreai: not measured — {result['unavailable']['coreai']}"
    ]
    assert not [r for r in read_records(config.records) if r["kind"].startswith("coreai")]


def test_clock_moves_only_when_the_fake_works():
    clock = FakeClock()
    fake = FakeCoreAIRuntime(clock=clock)
    assert clock() == 1000.0 and fake.unavailable_reason() == ""


def test_doctor_says_which_formats_can_measure_here(capsys):
    from anelab.publish.doctor import diagnose, format_report
    from anelab.runtimes.coreml.coreml_fake import FakeRuntime

    off = diagnose(FakeRuntime(), CoreAIMacRuntime(platform_name="linux"))["backends"]
    assert off["coreml"]["measures_here"] and not off["coreai"]["measures_here"]
    assert "needs macOS 27.0+" in off["coreai"]["reason"]
    on = diagnose(FakeRuntime(), FakeCoreAIRuntime())
    assert all(b["measures_here"] and b["exports_here"] for b in on["backends"].values())
    text = format_report(diagnose(FakeRuntime(), CoreAIMacRuntime(platform_name="linux")))
    assert "coreai  .aimodel    exports and verifies here; measures on a Mac only" in text
    assert "coreai-core 1.0.0b3" in text
