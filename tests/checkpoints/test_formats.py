"""The table of checkpoint formats: one entry each, read by load_checkpoint; no command has a code path per format.

Every path is opened by the first ``FORMATS`` entry that recognises it; what none recognises, or a format
refuses, gets one line. Outside ``anelab/checkpoints/`` nothing imports a format's module (a structural test
with its own negative control), so export, verify, plan, decide and the arms cannot grow one.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.formats import FORMATS, format_of, is_checkpoint, supported_formats
from anelab.cli import main
from anelab.core.errors import AnelabInputError

PACKAGE = Path(__file__).resolve().parents[2] / "anelab"
FORMAT_MODULES = {"anelab.checkpoints.gguf_file", "anelab.checkpoints.mlx_quantized", "anelab.checkpoints.hf_directory"}


def modules_importing_a_format(root: Path = PACKAGE) -> list[str]:
    """``path: module`` for every import of a format's own module outside ``checkpoints/``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.parent.name == "checkpoints":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            found += [f"{path.relative_to(root.parent)}: {n}" for n in names if n in FORMAT_MODULES]
    return found


def test_no_module_outside_checkpoints_reaches_past_the_table():
    assert modules_importing_a_format() == []


def test_a_command_that_imports_a_format_is_caught(tmp_path):
    copy = tmp_path / "anelab"
    shutil.copytree(PACKAGE, copy)
    verify = copy / "sidecar" / "checks" / "verify.py"
    verify.write_text(verify.read_text() + "\n\ndef _late():\n    from anelab.checkpoints import gguf_file  # noqa\n")
    assert modules_importing_a_format(copy) == ["anelab/sidecar/checks/verify.py: anelab.checkpoints.gguf_file"]


def test_each_path_is_opened_by_its_format(tiny_checkpoint, tmp_path):
    directory = tiny_checkpoint("llama")
    assert format_of(directory).name == "safetensors" and load_checkpoint(directory).format == "safetensors"
    assert list(FORMATS) == ["gguf", "mlx", "safetensors"]  # an MLX directory is also a safetensors one
    mlx = shutil.copytree(directory, tmp_path / "mlx")
    config = json.loads((mlx / "config.json").read_text())
    (mlx / "config.json").write_text(json.dumps({**config, "quantization": {"bits": 4, "group_size": 64}}))
    assert format_of(mlx).name == "mlx"
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF" + bytes(8))
    assert format_of(fake).name == "gguf" and is_checkpoint(fake)


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda d: d / "nope", "does not exist"),
        (lambda d: d, "has no config.json"),
        (lambda d: _file(d / "x.bin", b"PK\x03\x04"), "neither a GGUF file nor a model directory"),
        (lambda d: _file(d / "t.gguf", b"GGUF\x03"), "not a readable GGUF file"),
    ],
)
def test_what_no_format_reads_is_refused_in_one_line(tmp_path, make, match):
    with pytest.raises(AnelabInputError, match=match) as refused:
        load_checkpoint(make(tmp_path))
    assert "\n" not in str(refused.value)


def test_a_quantized_hugging_face_directory_is_refused(tiny_checkpoint, tmp_path):
    gptq = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "gptq")
    config = json.loads((gptq / "config.json").read_text())
    (gptq / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(AnelabInputError, match="quant_method gptq"):
        load_checkpoint(gptq)


def test_list_formats_names_every_format_and_the_named_checkpoints(capsys):
    assert main(["export", "--list-formats", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["format"] for r in listed["formats"]] == list(FORMATS) == [r["format"] for r in supported_formats()]
    assert set(listed["named"]) == {"default-dense", "default-real", "default-real-windowed"}
    assert main(["export", "--list-formats"]) == 0
    assert "gguf" in capsys.readouterr().out
