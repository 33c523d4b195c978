"""First contact on a Mac for Core AI and the macOS version (issue 41 items 1, 5, 6, 7, 16): coreai-core missing is
one line; the version is sw_vers's, not a compat-mode Python's; a fresh process's priced load holds the load only;
a child that aborts after answering is still read; a timed predict copies nothing in."""

from __future__ import annotations

import builtins
import platform
import subprocess

import numpy as np
import pytest

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core import macos
from anelab.core.errors import AnelabInputError
from anelab.runtimes.coreai import coreai_timing
from anelab.runtimes.coreai.coreai_fake import FakeCoreAIRuntime
from anelab.runtimes.coreai.coreai_runtime import CoreAIMacRuntime
from anelab.runtimes.coreml.coreml_runtime import MacRuntime
from anelab.sidecar.coreai.coreai_import import coreai_modules
from anelab.sidecar.export import export_sidecars

CHUNK = 8


@pytest.fixture(scope="module")
def asset(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("coreai-contact")
    [result] = export_sidecars(
        load_checkpoint(tiny_checkpoint("llama")), root, CHUNK, [0, CHUNK], [0], backend="coreai", jobs=1
    )
    return result.package


# ---- items 1 and 7: the macOS version as coremltools reads it; coreai-core absent is one line ---------------------
def _sw_vers(monkeypatch, answer: str, mac_ver: str = "16.0"):
    """A Mac whose sw_vers says ``answer`` while a compat-mode Python's platform.mac_ver() says ``mac_ver``."""
    macos.macos_version.cache_clear()
    monkeypatch.setattr(macos.sys, "platform", "darwin")
    monkeypatch.setattr(platform, "mac_ver", lambda *a: (mac_ver, ("", "", ""), "arm64"))
    seen = []

    def run(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=f"{answer}\n", stderr="")

    monkeypatch.setattr(macos.subprocess, "run", run)
    return seen


def test_the_macos_version_is_sw_vers_not_a_compat_mode_pythons_16(monkeypatch):
    seen = _sw_vers(monkeypatch, "27.0.1")
    try:
        assert macos.macos_version() == (27, 0, 1) and macos.macos_version() == (27, 0, 1)
        assert seen == [list(macos.SW_VERS)] or seen == [macos.SW_VERS]  # one spawn per process
        # both runtimes read this one definition: Core AI is not refused on a macOS 27 Mac for "16.0"
        coreai = CoreAIMacRuntime(platform_name="darwin", machine="arm64")
        assert "runs macOS" not in coreai.unavailable_reason()
        assert MacRuntime(platform_name="darwin", machine="arm64")._macos_version() == (27, 0, 1)
    finally:
        macos.macos_version.cache_clear()


def test_a_mac_older_than_core_ais_is_still_refused_by_version(monkeypatch):
    _sw_vers(monkeypatch, "26.3", mac_ver="26.3")  # control: the version read is what refuses
    try:
        assert "runs macOS 26.3" in CoreAIMacRuntime(platform_name="darwin", machine="arm64").unavailable_reason()
    finally:
        macos.macos_version.cache_clear()


def test_without_coreai_core_the_core_ai_commands_refuse_in_one_line_naming_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_coreai(name, *a, **k):
        if name == "coreai" or name.startswith("coreai."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_coreai)
    with pytest.raises(AnelabInputError) as refused:
        coreai_modules()
    assert "[coreai]" in str(refused.value) and "macOS 15" in str(refused.value) and "\n" not in str(refused.value)
    monkeypatch.setattr(macos, "macos_version", lambda: (27, 0))
    reason = CoreAIMacRuntime(
        platform_name="darwin", machine="arm64", macos_version=lambda: (27, 0)
    ).unavailable_reason()
    assert "[coreai]" in reason and "\n" not in reason


# ---- item 5: the fresh process's priced load does not hold the coreai import -------------------------------------
def test_a_fresh_process_cold_load_pays_the_coreai_import_before_its_clock(asset):
    fake = FakeCoreAIRuntime()
    record = coreai_timing.time_fresh_process(fake, asset, repeats=2, clock=fake.clock)
    assert record["results"]["samples_s"] == pytest.approx([fake.costs.cache_hit_s] * 2)
    assert any("import" in step for step in record["parameters"]["before_clock"])
    # control: a fresh fake that was not prepared pays the import inside its first load
    cold = FakeCoreAIRuntime(cache_file=fake.cache_file)
    t = cold.clock()
    cold.specialize(asset, "neural_engine")
    assert cold.clock() - t == pytest.approx(fake.costs.cache_hit_s + fake.costs.import_s)


# ---- item 6: a child that aborts at exit after answering is read -------------------------------------------------
def test_a_child_that_aborts_after_its_answer_is_read_and_its_exit_recorded(asset):
    fake = FakeCoreAIRuntime(abort_at_exit=True)
    record = coreai_timing.time_fresh_process(fake, asset, repeats=2, clock=fake.clock)
    assert record["results"]["samples_s"] == pytest.approx([fake.costs.cache_hit_s] * 2)
    assert record["parameters"]["child_exits"] == ["was killed by SIGABRT"] * 2
    assert any("ended abnormally" in u for u in record["unknown"])


def test_a_child_that_dies_before_answering_is_refused_in_one_line(asset, monkeypatch):
    fake = FakeCoreAIRuntime()
    spec = {**fake.child_spec(), "args": {**fake.child_spec()["args"], "costs": {"no_such_cost": 1}}}
    monkeypatch.setattr(fake, "child_spec", lambda: spec)
    with pytest.raises(RuntimeError, match="no answer line") as failed:
        coreai_timing.time_fresh_process(fake, asset, repeats=1, clock=fake.clock)
    assert "\n" not in str(failed.value)


# ---- item 16: a timed predict copies nothing in ------------------------------------------------------------------
def test_a_timed_predict_takes_arrays_made_before_its_clock(asset):
    fake = FakeCoreAIRuntime()
    records = coreai_timing.time_predictions(fake, asset, repeats=3, clock=fake.clock)
    assert all(r["results"]["median_s"] == pytest.approx(fake.costs.predict_s) for r in records)
    assert all("made once" in r["parameters"]["timed"] for r in records)
    # control: NumPy inputs given to each predict are copied in, on the clock
    model = fake.specialize(asset, "neural_engine")
    function = fake.load_function(model, "h0")
    sig = function.signature
    inputs = {n: np.zeros(shape, dtype) for n, (shape, dtype) in sig["inputs"].items()}
    t = fake.clock()
    fake.predict(function, inputs)
    assert fake.clock() - t > fake.costs.predict_s


def test_measure_goes_on_past_a_core_ai_failure(monkeypatch, tmp_path):
    """A Core AI step that fails (a fresh-process child that died before answering) is one line in ``unavailable``;
    the Core ML steps after it (block_ab, the gather probe) still run."""
    from types import SimpleNamespace

    from anelab.publish import measure, measure_coreai

    def dies(*a, **k):
        raise RuntimeError("a fresh-process Core AI load of layer_0.aimodel was killed by SIGABRT: no answer line")

    monkeypatch.setattr(measure_coreai, "coreai_records", dies)
    run = SimpleNamespace(config=SimpleNamespace(chunk=8, build=str(tmp_path), repeats=1), clock=None,
                          unavailable={}, recorded=lambda *a: False, skipped=[], keep=lambda *a: None)  # fmt: skip
    said = []
    measure._coreai(run, FakeCoreAIRuntime(), tmp_path, 0, [0], "key", said.append, False)
    assert run.unavailable["coreai"].startswith("failed: a fresh-process") and "\n" not in run.unavailable["coreai"]
    assert said == [f"coreai: not measured — {run.unavailable['coreai']}"]
