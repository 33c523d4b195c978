"""The CLI imports only what a command uses: ``import anelab.cli`` pulls no NumPy, Core ML tools or study
code, and ``anelab evaluate`` none of the modules other commands need (checked in a fresh interpreter,
with a negative control that adds an unneeded import on purpose)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import TINY_GEOMETRIES

from anelab import cli
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core.masks import causal
from anelab.sidecar.export import export_sidecars

CHUNK = 8
# what `anelab evaluate` never needs: plotting / notebook / data-frame libraries, SciPy, and every anelab
# layer or sidecar module other than the saved-program evaluator (a module name or a package prefix)
NOT_FOR_EVALUATE = (
    "matplotlib",
    "papermill",
    "nbformat",
    "nbconvert",
    "pandas",
    "scipy",
    "safetensors",
    "anelab.checkpoints",
    "anelab.runtimes",
    "anelab.planner",
    "anelab.arms",
    "anelab.decide",
    "anelab.studies",
    "anelab.publish",
    "anelab.core.decoder",
    "anelab.core.selection",
    "anelab.sidecar.checks.comparison",
    "anelab.sidecar.export",
    "anelab.sidecar.checks.foldcheck",
    "anelab.sidecar.graphs",
    "anelab.sidecar.inspection",
    "anelab.sidecar.prompt",
    "anelab.sidecar.quantize",
    "anelab.sidecar.checks.verify",
)


def modules_after(code: str) -> set[str]:
    """The module names loaded in a fresh interpreter after running ``code``."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def unneeded(modules: set[str], names=NOT_FOR_EVALUATE) -> list[str]:
    """The loaded modules that are, or lie inside, one of ``names``."""
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))


@pytest.fixture(scope="module")
def evaluate_command(tiny_checkpoint, tmp_path_factory) -> str:
    """Python code running ``anelab evaluate`` on a tiny package (h8) through ``anelab.cli.main``."""
    g = TINY_GEOMETRIES["qwen3_next"]
    work = tmp_path_factory.mktemp("cli-imports")
    [result] = export_sidecars(load_checkpoint(tiny_checkpoint("qwen3_next")), work, CHUNK, [0, 8], [3])
    rng = np.random.default_rng(0)
    inputs = {
        "hidden": rng.standard_normal((CHUNK, g.hidden_size)).astype(np.float16),
        "k_history": rng.standard_normal((8, g.num_kv_heads, g.head_dim)).astype(np.float16),
        "v_history": rng.standard_normal((8, g.num_kv_heads, g.head_dim)).astype(np.float16),
        "mask": causal(CHUNK, 8),
    }
    np.savez(work / "in.npz", **inputs)
    argv = ["evaluate", str(result.package), "--function", "h8", "--inputs", str(work / "in.npz")]
    argv += ["--out", str(work / "out.npz")]
    return f"from anelab.cli import main\nassert main({argv!r}) == 0"


def test_importing_the_cli_loads_no_numpy_coremltools_or_commands():
    modules = modules_after("import anelab.cli")
    assert {m for m in modules if m.startswith("anelab")} == {
        "anelab",
        "anelab.cli",
        "anelab.core",
        "anelab.core.errors",
    }
    assert unneeded(modules, ("numpy", "coremltools", "sympy", "tqdm", *NOT_FOR_EVALUATE)) == []
    # negative control: a heavy import at the CLI's top would show
    assert unneeded(modules_after("import anelab.cli, anelab.sidecar.mil.evaluate"), ("numpy", "coremltools")) != []


def test_evaluate_loads_only_what_it_needs(evaluate_command):
    modules = modules_after(evaluate_command)
    assert "anelab.sidecar.mil.evaluate" in modules and "coremltools" in modules  # the command did run
    assert unneeded(modules) == []
    # negative control: an unneeded import on the path is caught, by module and by package prefix
    caught = unneeded(modules_after(f"import anelab.sidecar.checks.verify, matplotlib\n{evaluate_command}"))
    assert {
        "anelab.sidecar.checks.verify",
        "anelab.sidecar.checks.comparison",
        "anelab.checkpoints.checkpoint",
        "matplotlib",
    } <= set(caught)


def test_a_command_builds_and_imports_only_its_own_module():
    """The table lists every command; the parser of one command imports that command's module alone."""
    modules = modules_after("from anelab.cli import build_parser\nbuild_parser('size')")
    assert {m for m in modules if m.startswith("anelab.commands.")} == {
        "anelab.commands.size_command",
        "anelab.commands.arguments",
    }
    # negative control: the whole parser (the tests' and the runbook's) imports every command's module
    every = modules_after("from anelab.cli import build_parser\nbuild_parser()")
    assert {f"anelab.commands.{module}" for _, module, _ in cli.COMMANDS} <= every


def test_a_gate_refusal_exits_1_and_other_errors_still_raise(monkeypatch, capsys):
    """The CLI recognises the gate's refusal without importing the gate at its top."""
    from anelab.runtimes.coreml.gate import AneGateError

    def refuse(args):
        raise AneGateError("h0: ANECCompile() FAILED")

    doctor = cli.command_module("doctor_command")
    monkeypatch.setattr(doctor, "main", refuse)
    assert cli.main(["doctor"]) == 1
    assert capsys.readouterr().err.strip() == "anelab: export refused: h0: ANECCompile() FAILED"

    def crash(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(doctor, "main", crash)
    with pytest.raises(RuntimeError, match="a bug"):  # negative control: not every RuntimeError is a refusal
        cli.main(["doctor"])
