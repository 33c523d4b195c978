"""The public CLI forms of issue 2, end to end, and their one-line refusals (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import TINY_GEOMETRIES

from anelab.cli import main
from anelab.core.masks import causal

CHUNK = 8


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(capsys, *argv, match: str):
    code, out, err = _run(capsys, *argv)
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert match in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def package(tiny_checkpoint, tmp_path_factory):
    ckpt = tiny_checkpoint("qwen3_next")
    out = tmp_path_factory.mktemp("cli-export")
    assert (
        main(["export", str(ckpt), "--chunk", str(CHUNK), "--histories", "0,8", "--layers", "3", "--out", str(out)])
        == 0
    )
    return ckpt, out / "layer_3.mlpackage"


def test_export_inspect_evaluate_verify(package, capsys, tmp_path):
    ckpt, pkg = package
    code, out, _ = _run(capsys, "inspect", str(pkg), "--json")
    assert code == 0
    info = json.loads(out)
    assert set(info["functions"]) == {"h0", "h8"}
    h8 = info["functions"]["h8"]
    assert h8["inputs"]["mask"] == {"shape": [CHUNK, 16], "dtype": "float16"}
    assert h8["outputs"]["k_chunk"]["shape"] == [2, CHUNK, 16]
    assert h8["op_counts"]["softmax"] == 1 and h8["op_counts"]["linear"] == 4
    assert info["weight_bytes"] > 0 and info["metadata"]["aneCompileVerified"] == "false"

    g = TINY_GEOMETRIES["qwen3_next"]
    rng = np.random.default_rng(0)
    inputs = {
        "hidden": rng.standard_normal((CHUNK, g.hidden_size)).astype(np.float16),
        "k_history": rng.standard_normal((8, 2, 16)).astype(np.float16),
        "v_history": rng.standard_normal((8, 2, 16)).astype(np.float16),
        "mask": causal(CHUNK, 8),
    }
    np.savez(tmp_path / "in.npz", **inputs)
    code, out, _ = _run(
        capsys,
        "evaluate",
        str(pkg),
        "--function",
        "h8",
        "--inputs",
        str(tmp_path / "in.npz"),
        "--out",
        str(tmp_path / "out.npz"),
    )
    assert code == 0
    with np.load(tmp_path / "out.npz") as res:
        assert set(res.files) == {"attn_out", "k_chunk", "v_chunk"}
        assert res["attn_out"].shape == (CHUNK, g.hidden_size) and res["attn_out"].dtype == np.float16
        fp16_out = res["attn_out"].astype(np.float32)
    code, _, _ = _run(
        capsys,
        "evaluate",
        str(pkg),
        "--function",
        "h8",
        "--inputs",
        str(tmp_path / "in.npz"),
        "--out",
        str(tmp_path / "o32.npz"),
        "--fp32",
    )
    with np.load(tmp_path / "o32.npz") as res:
        assert res["attn_out"].dtype == np.float32
        diff = np.abs(res["attn_out"] - fp16_out).max()
    assert 0 < diff < 0.05  # fp16 emulation is on by default and changes the numbers a little

    code, out, _ = _run(capsys, "verify", str(pkg), "--json")
    assert code == 0
    report = json.loads(out)
    assert report["passed"] and not report["vacuous"]
    code, out, _ = _run(capsys, "verify", str(pkg), "--checkpoint", str(ckpt))
    assert code == 0 and "PASSED" in out


def test_bad_paths(package, capsys, tmp_path):
    ckpt, pkg = package
    _one_line_error(capsys, "inspect", str(tmp_path / "nope.mlpackage"), match="no such package")
    (tmp_path / "plain").mkdir()
    _one_line_error(capsys, "inspect", str(tmp_path / "plain"), match="not an .mlpackage")
    _one_line_error(capsys, "verify", str(tmp_path / "plain"), match="not an .mlpackage")
    _one_line_error(
        capsys,
        "export",
        str(tmp_path / "plain"),
        "--chunk",
        "8",
        "--histories",
        "0",
        "--out",
        str(tmp_path / "o"),
        match="config.json",
    )
    _one_line_error(capsys, "verify", str(pkg), "--checkpoint", str(tmp_path / "plain"), match="config.json")


@pytest.mark.parametrize(
    "args, match",
    [
        (["--chunk", "8", "--histories", "0", "--layers", "0"], "not a full-attention layer"),
        (["--chunk", "0", "--histories", "0"], "positive"),
        (["--chunk", "-8", "--histories", "0"], "positive"),
        (["--chunk", "8", "--histories", "0,12"], "multiple of the chunk"),
        (["--chunk", "8", "--histories", "0,8,8"], "duplicate histories"),
        (["--chunk", "8", "--histories", "0,x"], "comma-separated integers"),
        (["--histories", "0"], "--chunk"),
    ],
)
def test_export_refusals(tiny_checkpoint, capsys, tmp_path, args, match):
    ckpt = tiny_checkpoint("qwen3_next")
    _one_line_error(capsys, "export", str(ckpt), *args, "--out", str(tmp_path / "o"), match=match)
    assert not list((tmp_path).glob("o/*.mlpackage"))


def test_evaluate_refusals(package, capsys, tmp_path):
    _, pkg = package
    g = TINY_GEOMETRIES["qwen3_next"]
    good = {"hidden": np.zeros((CHUNK, g.hidden_size), np.float16), "mask": causal(CHUNK, 0)}
    cases = {
        "missing": ({"hidden": good["hidden"]}, "'mask' of h0 is missing"),
        "shape": ({**good, "mask": causal(CHUNK, 8)}, "has shape [8, 16]; expected [8, 8]"),
        "dtype": ({**good, "hidden": good["hidden"].astype(np.float64)}, "dtype float64; expected float16"),
    }
    for name, (arrays, match) in cases.items():
        np.savez(tmp_path / f"{name}.npz", **arrays)
        _one_line_error(
            capsys,
            "evaluate",
            str(pkg),
            "--function",
            "h0",
            "--inputs",
            str(tmp_path / f"{name}.npz"),
            "--out",
            str(tmp_path / "o.npz"),
            match=match,
        )
    np.savez(tmp_path / "good.npz", **good)
    _one_line_error(
        capsys,
        "evaluate",
        str(pkg),
        "--function",
        "h4096",
        "--inputs",
        str(tmp_path / "good.npz"),
        "--out",
        str(tmp_path / "o.npz"),
        match="no function 'h4096'",
    )
    _one_line_error(
        capsys,
        "evaluate",
        str(pkg),
        "--function",
        "h0",
        "--inputs",
        str(tmp_path / "absent.npz"),
        "--out",
        str(tmp_path / "o.npz"),
        match="no such file",
    )
    (tmp_path / "junk.npz").write_text("not a zip")
    _one_line_error(
        capsys,
        "evaluate",
        str(pkg),
        "--function",
        "h0",
        "--inputs",
        str(tmp_path / "junk.npz"),
        "--out",
        str(tmp_path / "o.npz"),
        match="not a readable .npz",
    )
    assert not (tmp_path / "o.npz").exists()


def test_console_script_exit_code_and_single_line(tmp_path):
    """Through a real process: exit status 2 and no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "anelab", "inspect", str(tmp_path / "missing.mlpackage")], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert [l for l in proc.stderr.splitlines() if l.startswith("anelab:")] == [
        f"anelab: error: {tmp_path / 'missing.mlpackage'}: no such package; give the path of a .mlpackage written by 'anelab export'"
    ]
