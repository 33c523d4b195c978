"""The runtime interface: fd-level stderr capture, compute-units names, off-Mac refusals, doctor."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import io
import json
import os
import subprocess
import sys

import pytest

from anelab.cli import main
from anelab.coreml_runtime import (
    COMPUTE_UNITS,
    MacRuntime,
    RuntimeUnavailableError,
    capture_native_stderr,
    check_compute_units,
    default_runtime,
)
from anelab.doctor import STUDIES, diagnose
from anelab.errors import AnelabInputError
from anelab.fake_runtime import FakeRuntime

ALL_UNITS = ["all", "cpu_and_gpu", "cpu_and_ne", "cpu_only"]
STUDY_NAMES = ["dense_offload", "mask_fold", "gather_sizing", "setup_cost", "tiled_stateful"]


# ---- native stderr capture -------------------------------------------------------------------------


def test_capture_sees_a_raw_fd2_write_that_sys_stderr_redirection_misses():
    sys_level = io.StringIO()
    with contextlib.redirect_stderr(sys_level):  # negative control: Python-level redirection
        with capture_native_stderr() as captured:
            os.write(2, b"E5RT: MILCompilerForANE error: raw fd write\n")
    assert "MILCompilerForANE error" in captured.text
    assert sys_level.getvalue() == ""  # sys.stderr never saw it: only fd-level capture does


def test_capture_sees_libc_and_child_process_writes():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    message = b"ANECCompile() FAILED from libc\n"
    with capture_native_stderr() as captured:
        libc.write(2, message, len(message))
        subprocess.run([sys.executable, "-c", "import os; os.write(2, b'child says ANECF error\\n')"], check=True)
    assert "ANECCompile() FAILED from libc" in captured.text
    assert "child says ANECF error" in captured.text


def test_capture_takes_only_the_block_and_restores_fd2(capfd):
    os.write(2, b"before\n")
    with capture_native_stderr() as captured:
        os.write(2, b"during\n")
    os.write(2, b"after\n")
    assert captured.text == "during\n"
    err = capfd.readouterr().err
    assert "before" in err and "after" in err and "during" not in err


def test_capture_restores_fd2_when_the_block_raises(capfd):
    with pytest.raises(ValueError):
        with capture_native_stderr() as captured:
            os.write(2, b"inside\n")
            raise ValueError("boom")
    os.write(2, b"restored\n")
    assert captured.text == "inside\n"
    assert "restored" in capfd.readouterr().err


# ---- compute units ---------------------------------------------------------------------------------


def test_compute_units_names():
    assert sorted(COMPUTE_UNITS) == ALL_UNITS
    for name in ALL_UNITS:
        assert check_compute_units(name) == name


@pytest.mark.parametrize("bad", ["ane", "CPU_AND_NE", "cpu_and_neural_engine", ""])
def test_unknown_compute_units_is_refused_listing_the_valid_ones(bad):
    with pytest.raises(AnelabInputError) as e:
        check_compute_units(bad)
    message = str(e.value)
    assert "\n" not in message
    for name in ALL_UNITS:
        assert name in message


def test_unknown_compute_units_is_refused_by_the_fake_runtime_too(tmp_path):
    with pytest.raises(AnelabInputError, match="cpu_and_ne"):
        FakeRuntime().load(tmp_path / "h0.mlpackage", None, "neural_engine")


# ---- availability ----------------------------------------------------------------------------------


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the off-Mac refusals (CI runs on Linux)")
def test_off_mac_every_entry_refuses_with_one_clear_error(tmp_path):
    runtime = default_runtime()
    assert isinstance(runtime, MacRuntime)
    assert runtime.available() is False
    reason = runtime.unavailable_reason()
    assert "Core ML runtime" in reason and "macOS 15" in reason and "\n" not in reason
    entries = [
        lambda: runtime.load(tmp_path / "layer_0.mlpackage", "h0", "cpu_and_ne"),
        lambda: runtime.predict(object(), {}),
        lambda: runtime.compute_plan_assignment(tmp_path / "layer_0.mlpackage", "cpu_and_ne"),
        runtime.require_available,
    ]
    for entry in entries:
        with pytest.raises(RuntimeUnavailableError) as e:
            entry()
        assert str(e.value) == reason
        assert isinstance(e.value, AnelabInputError)  # the CLI exits 2 on it


def _never_imported():
    raise AssertionError("the native module must not be imported once an earlier check failed")


def test_an_old_macos_is_named_in_the_reason():
    runtime = MacRuntime(platform_name="darwin", macos_version=lambda: (14, 6), import_native=_never_imported)
    assert not runtime.available()
    assert "macOS 14.6" in runtime.unavailable_reason() and "15+" in runtime.unavailable_reason()


def test_missing_native_module_is_named_in_the_reason():
    def missing():
        raise ImportError("No module named 'coremltools.libcoremlpython'")

    runtime = MacRuntime(platform_name="darwin", macos_version=lambda: (15, 1), import_native=missing)
    assert not runtime.available()
    assert "libcoremlpython" in runtime.unavailable_reason()
    with pytest.raises(RuntimeUnavailableError, match="libcoremlpython"):
        runtime.compute_plan_assignment("x.mlpackage", "all")


def test_a_mac_with_macos_15_and_the_native_module_is_available():
    # control for the two refusals above: the same checks pass when every requirement holds
    runtime = MacRuntime(platform_name="darwin", macos_version=lambda: (15, 0), import_native=lambda: None)
    assert runtime.available() and runtime.unavailable_reason() == ""


def test_linux_never_reaches_the_version_or_import_checks():
    runtime = MacRuntime(platform_name="linux", macos_version=lambda: (99,), import_native=_never_imported)
    assert not runtime.available()


# ---- doctor ----------------------------------------------------------------------------------------


def test_doctor_json_off_mac_says_what_runs_and_what_is_replayed(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    import numpy

    assert report["versions"]["numpy"] == numpy.__version__
    assert report["versions"]["coremltools"] == "9.0"
    assert set(report["machine"]) == {"machine_model", "chip", "os_version"}
    assert sorted(report["studies"]) == sorted(STUDY_NAMES)
    if sys.platform != "darwin":
        assert report["runtime"]["available"] is False
        assert "macOS 15" in report["runtime"]["reason"]
        for study in report["studies"].values():
            assert study["mode"] == "replay"
            assert len(study["runs_here"]) == 1 and len(study["replayed_here"]) == 1


def test_doctor_with_an_available_runtime_runs_every_study_fresh():
    report = diagnose(FakeRuntime())
    assert report["runtime"] == {"name": "fake", "available": True, "reason": ""}
    for name, study in report["studies"].items():
        assert study["mode"] == "fresh" and study["replayed_here"] == []
        assert study["runs_here"] == [STUDIES[name][1], STUDIES[name][2]]


def test_doctor_text_report(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Core ML runtime: ")
    for name in STUDY_NAMES:
        assert name in out
    assert "numpy" in out and "coremltools" in out
