"""Hostile input, round two (issue 44): the entrances added since the first table — ``ab``, the output path of
every command that writes, Core AI assets, BF16 weights past fp16, a package's layer, a symlink loop.

Each row runs through ``tests/commands/test_hostile.py``'s runner and keeps its promise: exit 2, one ``anelab: error:``
line that names the cause, no traceback, nothing written, no hang. Every row failed on main at a615004 (a
traceback, a refusal naming something else, or work done and written before the refusal).
"""

from __future__ import annotations

import contextlib
import io
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_hostile import CHUNK, Lab, Sources, _metadata, _poison, _says, make_sources, run_case

AB_REFUSAL_S = 2.0  # issue 44: ab --prompt-tokens 1e12 refused within this, before anything is built


def _a_file(lab: Lab, name: str = "a-file") -> Path:
    path = lab.root / name
    path.write_text("a file, not a directory\n")
    return path


def _config_loop(lab: Lab) -> Path:
    ck = lab.checkpoint()
    (ck / "config.json").unlink()
    (ck / "config.json").symlink_to("config.json")
    return ck


def _asset(lab: Lab, change: Callable[[bytes], bytes]) -> Path:
    """A copy of the Core AI export's layer 0 with its program (``main.mlirb``) changed."""
    dest = lab.root / "assets" / "layer_0.aimodel"
    shutil.copytree(lab.sources.export.parent / "coreai" / "layer_0.aimodel", dest)
    program = dest / "main.mlirb"
    program.write_bytes(change(program.read_bytes()))
    return dest


def _flip(blob: bytes) -> bytes:
    middle = len(blob) // 2
    return blob[:middle] + bytes([blob[middle] ^ 0x01]) + blob[middle + 1 :]


def _ab(lab: Lab, *extra: str) -> list[str]:
    return ["ab", str(lab.checkpoint()), "--sidecars", str(lab.sources.export), *extra]


def _decide(lab: Lab, out: Path) -> list[str]:
    return ["decide", str(lab.checkpoint()), "--prompt-tokens", "64", "--chunk", str(CHUNK), "--out", str(out)]


ROWS: dict[str, Callable[[Lab], list[str]]] = {
    # item 2: ab's prompt lengths bounded before anything proportional is built
    "ab --prompt-tokens 10**12": lambda lab: _ab(lab, "--prompt-tokens", str(10**12)),
    # item 4: every command that writes checks its output path before it works
    "decide --out a file": lambda lab: _decide(lab, _a_file(lab)),
    "decide --out under a file": lambda lab: _decide(lab, _a_file(lab) / "sub"),
    "evaluate --out a directory": lambda lab: [
        "evaluate",
        str(lab.package()),
        "--function",
        "h0",
        "--inputs",
        str(lab.root / "inputs.npz"),
        "--out",
        str(lab.root),
    ],  # fmt: skip
    "probe --out a file": lambda lab: ["probe", "--chunk", "16", "--repeats", "1", "--out", str(_a_file(lab))],
    "probe --records a file": lambda lab: [
        "probe",
        "--chunk",
        "16",
        "--repeats",
        "1",
        "--out",
        str(lab.out),
        "--records",
        str(_a_file(lab)),
    ],  # fmt: skip
    "docs --out a file": lambda lab: ["docs", "--out", str(_a_file(lab))],
    "ab --out a file": lambda lab: _ab(lab, "--prompt-tokens", "16", "--out", str(_a_file(lab))),
    "ab --out under a file": lambda lab: _ab(lab, "--prompt-tokens", "16", "--out", str(_a_file(lab) / "records")),
    # item 6: a symlink loop where a checkpoint's file should be
    "config.json a symlink loop": lambda lab: lab.export_argv(_config_loop(lab)),
    # item 7: a Core AI asset against its own main.hash
    "Core AI main.mlirb truncated": lambda lab: [
        "verify",
        str(_asset(lab, lambda b: b[: len(b) // 2])),
        "--checkpoint",
        str(lab.checkpoint()),
    ],  # fmt: skip
    "Core AI main.mlirb one byte flipped": lambda lab: [
        "verify",
        str(_asset(lab, _flip)),
        "--checkpoint",
        str(lab.checkpoint()),
    ],  # fmt: skip
    # item 8: a finite BF16 weight that fp16 cannot hold
    "weights BF16 1e30 in layer 2": lambda lab: lab.export_argv(lab.header(data=_poison(1e30))),
    # item 9: a package whose metadata names another layer than its tensors'
    "package metadata names layer 3 (built from 0)": lambda lab: [
        "verify",
        str(_metadata("anelab.layer", "3")(lab)),
        "--checkpoint",
        str(lab.checkpoint()),
    ],  # fmt: skip
    "package metadata names layer 7 of 4": lambda lab: [
        "verify",
        str(_metadata("anelab.layer", "7")(lab)),
        "--checkpoint",
        str(lab.checkpoint()),
    ],  # fmt: skip
}

EXPECT = {
    "ab --prompt-tokens 10**12": "--prompt-tokens is 1,000,000,000,000; the limit is 2,097,152",
    "decide --out a file": "is a regular file, not a directory",
    "decide --out under a file": "which is a regular file, not a directory",
    "evaluate --out a directory": "is a directory, not a file",
    "probe --out a file": "is a regular file, not a directory",
    "probe --records a file": "--records",
    "docs --out a file": "is a regular file, not a directory",
    "ab --out a file": "is a regular file, not a directory",
    "ab --out under a file": "which is a regular file, not a directory",
    "config.json a symlink loop": "is a symlink loop",
    "Core AI main.mlirb truncated": "does not match the SHA-256 in main.hash",
    "Core AI main.mlirb one byte flipped": "does not match the SHA-256 in main.hash",
    "weights BF16 1e30 in layer 2": "model.layers.2.self_attn.k_proj.weight holds 1 values beyond fp16's range",
    "package metadata names layer 3 (built from 0)": "names layer 3, but the tensors it was built from",
    "package metadata names layer 7 of 4": "names layer 7, but the tensors it was built from",
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Sources:
    """test_hostile's sources, and a Core AI export of the dense layer 0 beside them (``coreai/``)."""
    from anelab.cli import main

    built = make_sources(tmp_path_factory.mktemp("entrances"))
    argv = ["export", str(built.dense), "--chunk", str(CHUNK), "--histories", f"0,{CHUNK}", "--layers", "0",
            "--backend", "coreai", "--jobs", "1", "--out", str(built.export.parent / "coreai")]  # fmt: skip
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    return built


@pytest.mark.parametrize("name", list(ROWS))
def test_one_line_exit_2_nothing_written(name, sources, tmp_path):
    started = time.monotonic()
    outcome = run_case(name, tmp_path, sources, ROWS)
    assert not outcome.problems(), (name, outcome.problems())
    assert _says(EXPECT[name], outcome.lines[0]), (name, outcome.lines[0])
    if name.startswith("ab --prompt-tokens"):
        assert time.monotonic() - started < AB_REFUSAL_S


def test_every_row_says_what_its_line_must_name():
    assert set(EXPECT) == set(ROWS)


def test_the_core_ai_asset_as_exported_verifies(sources, tmp_path, capsys):
    """The negative control of the Core AI rows: the same copy, unchanged, is read and verified."""
    from anelab.cli import main

    asset = _asset(Lab(tmp_path, sources), lambda b: b)
    assert main(["verify", str(asset), "--checkpoint", str(sources.dense)]) == 0, capsys.readouterr().err


def test_weights_fp16_holds_are_exported(sources, tmp_path):
    """Control of the 1e30 row: 6e4 (inside fp16's range) in the same cell exports."""
    from anelab.cli import main

    lab = Lab(tmp_path, sources)
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert main([*lab.export_argv(lab.header(data=_poison(6e4)))[:-2], "--layers", "2", "--jobs", "1"]) == 0
