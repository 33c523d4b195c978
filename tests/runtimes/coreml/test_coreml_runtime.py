"""The runtime interface: fd-level capture of fd 1 and fd 2, compute-units names, off-Mac refusals, doctor."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from anelab.cli import build_parser, main
from anelab.core.errors import AnelabInputError
from anelab.publish.doctor import diagnose, format_report
from anelab.publish.studies import get_study
from anelab.runtimes.coreml.coreml_fake import FakeRuntime
from anelab.runtimes.coreml.coreml_runtime import MacRuntime, default_runtime
from anelab.runtimes.interface import COMPUTE_UNITS, RuntimeUnavailableError, capture_native_output, check_compute_units

ALL_UNITS = ["all", "cpu_and_gpu", "cpu_and_ne", "cpu_only"]
STUDY_NAMES = [
    "dense_offload", "mask_fold", "gather_sizing", "setup_cost", "tiled_stateful", "one_function", "whole_model_arms",
    "offload_split",
]  # fmt: skip


# ---- native output capture -------------------------------------------------------------------------


def test_capture_sees_a_raw_fd2_write_that_sys_stderr_redirection_misses():
    sys_level = io.StringIO()
    with contextlib.redirect_stderr(sys_level):  # negative control: Python-level redirection
        with capture_native_output() as captured:
            os.write(2, b"E5RT: MILCompilerForANE error: raw fd write\n")
    assert "MILCompilerForANE error" in captured.text
    assert sys_level.getvalue() == ""  # sys.stderr never saw it: only fd-level capture does


def test_capture_sees_libc_and_child_process_writes():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    message = b"ANECCompile() FAILED from libc\n"
    with capture_native_output() as captured:
        libc.write(2, message, len(message))
        subprocess.run([sys.executable, "-c", "import os; os.write(2, b'child says ANECF error\\n')"], check=True)
    assert "ANECCompile() FAILED from libc" in captured.text
    assert "child says ANECF error" in captured.text


def test_capture_takes_only_the_block_and_restores_fd2(capfd):
    os.write(2, b"before\n")
    with capture_native_output() as captured:
        os.write(2, b"during\n")
    os.write(2, b"after\n")
    assert captured.stderr == "during\n"
    err = capfd.readouterr().err
    assert "before" in err and "after" in err and "during" not in err


def test_capture_restores_fd2_when_the_block_raises(capfd):
    with pytest.raises(ValueError):
        with capture_native_output() as captured:
            os.write(2, b"inside\n")
            raise ValueError("boom")
    os.write(2, b"restored\n")
    assert captured.stderr == "inside\n"
    assert "restored" in capfd.readouterr().err


def test_capture_sees_fd1_too_and_keeps_the_streams_apart(capfd):
    """Defect 6: at 6b7ba86 only fd 2 was captured; Core ML's ANE compiler also reports on stdout."""
    with capture_native_output() as captured:
        os.write(1, b"MILCompilerForANE error on stdout\n")
        os.write(2, b"ANECF error on stderr\n")
    assert captured.stdout == "MILCompilerForANE error on stdout\n"
    assert captured.stderr == "ANECF error on stderr\n"
    assert "MILCompilerForANE" not in capfd.readouterr().out  # taken, not passed through


def test_capture_flushes_c_stdio_buffers_before_restoring(capfd):
    """A C library's printf to a redirected stdout sits in stdio's buffer: without libc fflush before
    the fds are restored, the text would land after the capture (in capfd here), not in it."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    with capture_native_output() as captured:
        libc.printf(b"E5RT: MILCompilerForANE error via printf, no newline")
    assert "via printf" in captured.stdout
    assert "via printf" not in capfd.readouterr().out


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
        for name, study in report["studies"].items():
            if get_study(name).needs_mac is None:  # nothing of it needs the runtime (02)
                assert study["mode"] == "runs here" and study["replayed_here"] == []
            else:
                assert study["mode"] == "partly"
                assert len(study["runs_here"]) == 1 and len(study["replayed_here"]) == 1


def test_doctor_with_an_available_runtime_runs_every_study_fresh():
    report = diagnose(FakeRuntime())
    assert report["runtime"] == {
        "name": "fake",
        "available": True,
        "reason": "",
        "neural_engine": True,
        "neural_engine_reason": "",
    }
    for name, study in report["studies"].items():
        assert study["mode"] == "runs here" and study["replayed_here"] == []
        s = get_study(name)
        assert study["runs_here"] == [p for p in (s.runs_here, s.needs_mac) if p is not None]


def test_doctor_names_a_missing_neural_engine():
    """Defect 8: at 6b7ba86 an Intel Mac on macOS 15 passed the doctor; nothing asked for an ANE."""
    report = diagnose(FakeRuntime(machine="x86_64"))
    assert report["runtime"]["available"] is True and report["runtime"]["neural_engine"] is False
    assert "not Apple silicon (arm64)" in report["runtime"]["neural_engine_reason"]
    assert "Neural Engine:   unavailable — no Neural Engine" in format_report(report)


def test_doctor_text_report(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Core ML runtime: ")
    for name in STUDY_NAMES:
        assert name in out
    assert "numpy" in out and "coremltools" in out


# ---- the Mac runbook matches the CLI and the API ----------------------------------------------------

RUNBOOK = Path(__file__).resolve().parents[3] / "docs" / "mac-runbook.md"


def _fenced_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", RUNBOOK.read_text(), flags=re.S)


def _runbook_commands() -> list[list[str]]:
    commands = []
    for block in _fenced_blocks("sh"):
        for line in block.splitlines():
            if line.startswith(".venv/bin/anelab "):
                commands.append(shlex.split(line.replace('"$CKPT"', "/tmp/ckpt"))[1:])
    return commands


def test_every_runbook_command_parses_with_the_real_cli():
    commands = _runbook_commands()
    used = {argv[0] for argv in commands}
    assert {"doctor", "measure", "verify", "export", "inspect"} <= used
    parser = build_parser()
    for argv in commands:
        parser.parse_args(argv)  # raises AnelabInputError on an unknown command or flag
    export = next(a for a in commands if a[0] == "export")
    assert parser.parse_args(export).histories == [0, 64, 128]
    on_device = [parser.parse_args(a).compute_units for a in commands if a[0] == "verify"]
    assert "cpu_and_ne" in on_device and "cpu_and_gpu" in on_device


def test_a_wrong_flag_in_the_runbook_would_be_caught():
    # negative control for the test above: the seed's exporter flag does not exist in anelab
    with pytest.raises(AnelabInputError, match="max-history"):
        build_parser().parse_args(
            ["export", "/tmp/ckpt", "--chunk", "4096", "--histories", "0", "--max-history", "8192", "--out", "x"]
        )


def _undefined_variables(blocks: list[str]) -> list[str]:
    """Shell variables used before any line of the runbook assigns them."""
    defined, missing = set(), []
    for block in blocks:
        for line in block.splitlines():
            for name in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", line):
                if name not in defined:
                    missing.append(name)
            defined |= set(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*)=", line))
    return missing


def test_the_runbook_is_copy_pasteable():
    """Issue 11, defect 10: the runbook used CKPT_DIR and UNLOADABLE_HISTORY without defining them and
    asked the user to paste Python scripts."""
    assert _fenced_blocks("python") == []
    assert _undefined_variables(_fenced_blocks("sh")) == []
    assert _undefined_variables(["X=1\necho $X $Y"]) == ["Y"]  # control: an undefined one is caught
    makefile = (RUNBOOK.parents[1] / "Makefile").read_text()
    for block in _fenced_blocks("sh"):
        for line in block.splitlines():
            if line.startswith("make "):
                target = line.split()[1]
                assert re.search(rf"^{target}:", makefile, flags=re.M), f"make {target} is not a Makefile target"
    text = RUNBOOK.read_text()
    for step in ("make install", "anelab doctor", "make measure", "make reproduce"):
        assert step in text
