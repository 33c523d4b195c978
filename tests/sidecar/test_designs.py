"""One registry of sidecar designs (``anelab.sidecar.designs``): nothing else names a design, and every
design is served by ``open_sidecar`` and the whole-model arms — or refused in one line before anything loads.

Issue 19's bug: ``runtime/open.py`` asked only ``graph == "stateful"``, so a stateful-tiled package was opened
as a per-history one (function ``h0``, which it lacks; a ``mask`` input it does not declare), and the arms
refused it for a misleading reason after evaluating it. Here each design x (open, predict through the fake
runtime, a prompt through the arms) runs; the per-design prompt through ``open_sidecar`` must match the fp64
reference, and a control (the second chunk served without what came before) must miss it.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import random_whole_model

from anelab.arms.arm_comparison import NOISE, compare_arms
from anelab.arms.arm_runs import Arm, run_arm
from anelab.arms.sidecars import open_sidecars
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.whole_model import load_model
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.runtimes.coreml.coreml_fake import FakeRuntime
from anelab.runtimes.open import open_sidecar
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD, relative_error
from anelab.sidecar.designs import ATTENTION_DESIGNS, DESIGNS, RENAMED, get_design
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.prompt import prompt_reference

PACKAGE = Path(__file__).resolve().parents[2] / "anelab"
REGISTRY = PACKAGE / "sidecar" / "designs.py"
NAMES = set(DESIGNS) | set(RENAMED)
# the one other word that spells a design name: the full-scores probe graph as records written before its
# rename call it (sidecar.graphs.probe_graphs.RECORDED_PROBE_NAMES) — a record's word, read under the new name, not a design
# and the MLP's name in other code: the decoder layer's norm slot (checkpoints.whole_model.NormSlots.mlp) and mlx-lm's
# decoder layer attribute the hybrid swaps (runtimes.mlx.hybrid) — a tensor slot's and a module's name, not a design
# and the offload split's part names (planner.offload_split: ATTENTION, MLP, PROJECTIONS), a block kind a split moves
RECORD_WORDS = {("anelab/sidecar/graphs/probe_graphs.py", "dense"), ("anelab/checkpoints/whole_model.py", "mlp"),
                ("anelab/runtimes/mlx/hybrid.py", "mlp"), ("anelab/planner/offload_split.py", "mlp")}  # fmt: skip
CHUNK, PROMPT = 8, 13  # two chunk starts (0, 8); the second chunk is partial (5 rows)
GEOMETRY = AttentionGeometry(
    variant="qwen3", hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, num_layers=2,
    full_attention_layers=(0, 1),
)  # fmt: skip


# ---- nobody outside the registry names a design ------------------------------------------------------------
def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions (prose may name a design)."""
    bodies = (n.body for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)))
    return {id(b[0].value) for b in bodies if b and isinstance(b[0], ast.Expr) and isinstance(b[0].value, ast.Constant)}


def design_names_outside_the_registry(root: Path = PACKAGE) -> list[str]:
    """``path:line: 'name'`` for every string constant spelling a design name (a comparison, a dict key, an
    argument, a default...) outside ``sidecar/designs.py``; docstrings and longer text are prose."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root) == REGISTRY.relative_to(PACKAGE):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        prose = _docstrings(tree)
        for node in ast.walk(tree):
            where = str(path.relative_to(root.parent))
            if isinstance(node, ast.Constant) and node.value in NAMES and id(node) not in prose:
                if (where, node.value) in RECORD_WORDS:
                    continue
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.value!r}")
    return found


def test_only_the_registry_names_a_design():
    assert design_names_outside_the_registry() == []


def test_a_design_name_outside_the_registry_is_caught(tmp_path):
    """Negative control: issue 19's check put back into runtimes/open.py, a planner-style tuple test and a
    design passed by name; a docstring naming a design is prose and is not flagged."""
    copy = tmp_path / "anelab"
    shutil.copytree(PACKAGE, copy)
    opened = copy / "runtimes" / "open.py"
    opened.write_text(opened.read_text() + '\n\ndef _stateful(meta):\n    return meta.graph == "stateful"\n')
    plan = copy / "planner" / "design_plans.py"
    plan.write_text(
        plan.read_text() + '\n\ndef _per(d):\n    """Per-history: "dense"."""\n    return d in ("per-history", "x")\n'
    )
    sweep = copy / "studies" / "tiled_stateful.py"
    sweep.write_text(sweep.read_text() + '\n\ndef _export(f):\n    return f(graph="stateful-tiled")\n')
    found = design_names_outside_the_registry(copy)
    assert any("open.py" in f and "'stateful'" in f for f in found), found
    assert any("design_plans.py" in f and "'per-history'" in f for f in found), found
    assert any("tiled_stateful.py" in f and "'stateful-tiled'" in f for f in found), found
    assert not any("design_plans.py" in f and "'dense'" in f for f in found), found  # the docstring


def test_an_old_or_unknown_design_name_is_refused_in_one_line():
    with pytest.raises(AnelabInputError, match="'per-history' is now called 'dense'"):
        get_design("per-history", "--design")
    with pytest.raises(AnelabInputError, match="unknown --graph 'flash'; supported: dense, tiled, stateful"):
        get_design("flash")


def test_an_option_the_design_does_not_take_is_refused_even_when_falsy():
    """A key tile of 0 given to the dense design is refused, not read as "not given"; None is not given."""
    dense = get_design("dense")
    with pytest.raises(AnelabInputError, match="--tile applies to --graph tiled or stateful-tiled, not dense"):
        dense.options(GEOMETRY, CHUNK, [0], key_tile=0)
    assert dense.options(GEOMETRY, CHUNK, [0, CHUNK], key_tile=None).histories == (0, CHUNK)


# ---- every design x (open, predict through the fake, a prompt through the arms) ------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("designs")
    return random_whole_model(root / "model", GEOMETRY, intermediate=48, vocab=64)


@pytest.fixture(scope="module")
def exported(model_dir, tmp_path_factory):
    """design -> the directory of its packages (every layer; covering the PROMPT-token prompt)."""
    root = tmp_path_factory.mktemp("design-packages")
    out = {}
    for name in ATTENTION_DESIGNS:  # the block designs' own tests: tests/sidecar/test_block_sidecars.py
        design = DESIGNS[name]
        histories = None if design.stateful else [0, CHUNK]
        options = {"capacity": 2 * CHUNK} if design.stateful else {}
        export_sidecars(load_checkpoint(model_dir), root / name, CHUNK, histories, graph=name, **options)
        out[name] = root / name
    return out


def _prompt_through_open_sidecar(sidecar, hidden: np.ndarray, *, carry: bool = True) -> np.ndarray:
    """attn_out [P, D] of ``hidden`` [P, D] served chunk by chunk through ``sidecar.predict``: a per-history
    design gets the K/V history of the calls before (zeros with ``carry=False``), a stateful one its state
    (a fresh one for the second chunk with ``carry=False``)."""
    P, D = hidden.shape
    outs, k_hist, v_hist = [], [], []
    for start in range(0, P, CHUNK):
        rows = min(CHUNK, P - start)
        chunk = np.zeros((CHUNK, D), np.float16)
        chunk[:rows] = hidden[start : start + rows]
        inputs = {"hidden": chunk}
        if sidecar.stateful and not carry and start > 0:
            sidecar.reset_state()
        if not sidecar.stateful and start > 0:
            k, v = np.concatenate(k_hist), np.concatenate(v_hist)
            inputs.update(k_history=k if carry else np.zeros_like(k), v_history=v if carry else np.zeros_like(v))
        out = sidecar.predict(start, inputs, rows)
        outs.append(np.asarray(out["attn_out"]).reshape(CHUNK, D)[:rows])
        if not sidecar.stateful:
            k_hist.append(np.asarray(out["k_chunk"], np.float16).transpose(1, 0, 2))  # [Hkv, C, d] -> [C, Hkv, d]
            v_hist.append(np.asarray(out["v_chunk"], np.float16).transpose(1, 0, 2))
    return np.concatenate(outs)


@pytest.mark.parametrize("name", ATTENTION_DESIGNS)
def test_open_sidecar_serves_every_design_through_the_fake(name, exported, model_dir):
    model = load_model(model_dir)
    package = exported[name] / "layer_0.mlpackage"
    runtime = FakeRuntime(numerics=True)  # predict computes the saved program
    sidecar = open_sidecar(package, compute_units="cpu_only", chunk=CHUNK, prompt_tokens=PROMPT, runtime=runtime)
    assert runtime.loads == []  # opening loads nothing
    hidden = np.random.default_rng(5).standard_normal((PROMPT, GEOMETRY.hidden_size)).astype(np.float16)
    ref = prompt_reference(hidden, model.attention(0), GEOMETRY).attn_out
    out = _prompt_through_open_sidecar(sidecar, hidden)
    served = {function for _, function, _ in runtime.loads}
    assert served == ({f"c{CHUNK}"} if get_design(name).stateful else {"h0", f"h{CHUNK}"})
    assert relative_error(out, ref) < RELATIVE_ERROR_THRESHOLD
    # control: the second chunk served without what came before it (no history / a fresh state) misses
    fresh = open_sidecar(package, compute_units="cpu_only", chunk=CHUNK, runtime=runtime)
    cut = _prompt_through_open_sidecar(fresh, hidden, carry=False)
    assert relative_error(cut[CHUNK:], ref[CHUNK:]) > RELATIVE_ERROR_THRESHOLD


def test_a_mask_given_to_a_package_without_a_mask_input_is_refused(exported):
    runtime = FakeRuntime(numerics=True)
    sidecar = open_sidecar(
        exported["stateful-tiled"] / "layer_0.mlpackage", compute_units="cpu_only", chunk=CHUNK, runtime=runtime
    )
    assert not sidecar.takes_mask
    hidden = np.zeros((CHUNK, GEOMETRY.hidden_size), np.float16)
    with pytest.raises(AnelabInputError, match="takes no mask input"):
        sidecar.predict(0, {"hidden": hidden, "mask": np.zeros((CHUNK, 2 * CHUNK), np.float16)})
    assert runtime.loads == []


@pytest.mark.parametrize("name", ATTENTION_DESIGNS)
def test_the_arms_serve_every_design_or_refuse_it_before_anything_loads(name, exported, model_dir, monkeypatch):
    model = load_model(model_dir)
    design = get_design(name)
    if design.served_by_arms:
        prompt = np.random.default_rng(3).integers(0, model.vocab_size, PROMPT)
        reference = run_arm(model, prompt, Arm("reference"), decode=2, chunk=CHUNK)
        sidecars = open_sidecars(exported[name], model, PROMPT)
        run = run_arm(model, prompt, Arm("sidecar", "sidecar"), decode=2, sidecars=sidecars)
        assert max(relative_error(run.hidden[i], reference.hidden[i]) for i in range(2)) < NOISE
        return
    from anelab.sidecar.mil import evaluate

    opened = []
    monkeypatch.setattr(evaluate.SavedPackage, "__init__", lambda self, *a, **k: opened.append(a))
    runtime = FakeRuntime()
    with pytest.raises(AnelabInputError) as refused:
        compare_arms(load_model(model_dir), exported[name], PROMPT, decode=2, compute_units="cpu_only", runtime=runtime)
    message = str(refused.value)
    assert "\n" not in message and f"--graph {name} package" in message and "re-export with --graph dense" in message
    assert opened == [] and runtime.loads == []  # refused before any program was read or loaded


# ---- what a design declares, verify enforces ----------------------------------------------------------------
# the function that runs each design's controls, patched to run none (the mutation issue 19 found caught by
# only three tests, through a report that passed with its controls silently missing)
CONTROL_RUNNERS = {"dense": "negative_controls", "tiled": "negative_controls", "stateful": "stateful_controls",
                   "stateful-tiled": "stateful_tiled_controls"}  # fmt: skip


@pytest.mark.parametrize("name", ATTENTION_DESIGNS)
def test_verify_passes_only_when_every_declared_control_ran(name, exported, model_dir, monkeypatch):
    from anelab.core.geometry import AttentionGeometry as Geometry
    from anelab.sidecar.checks import stateful_cases, verify_cases
    from anelab.sidecar.checks.verify import verify_package
    from anelab.sidecar.format import read_sidecar_metadata

    package = exported[name] / "layer_1.mlpackage"
    meta = read_sidecar_metadata(package)
    report = verify_package(package, load_checkpoint(model_dir))
    declared = get_design(name).controls(meta, Geometry.from_dict(meta.geometry))
    assert report.passed and report.declared_controls == declared, report.table()
    assert {"control: state carried" if get_design(name).stateful else "control: mask reaches graph"} <= {
        case for _, case in declared
    }
    runners = stateful_cases if get_design(name).stateful else verify_cases  # the module that runs the controls
    monkeypatch.setattr(runners, CONTROL_RUNNERS[name], lambda *a, **k: [])
    mutated = verify_package(package, load_checkpoint(model_dir))
    assert not mutated.vacuous and all(c.passed for c in mutated.comparisons)  # nothing else is wrong ...
    assert not mutated.passed and mutated.missing_controls == [f"{f}: {c}" for f, c in declared]  # ... but this
    assert "declared controls that did not run" in mutated.table()


def test_a_report_that_declares_no_control_does_not_pass():
    from anelab.sidecar.checks.comparison import Comparison
    from anelab.sidecar.checks.verify import VerifyReport

    report = VerifyReport(
        "p", "c", 0, RELATIVE_ERROR_THRESHOLD, "e", [Comparison("h0", "full chunk", 8, {"attn_out": 0.0})]
    )
    assert not report.passed and report.missing_controls == ["(no control declared)"]
    report.declared_controls = [("h0", "control: mask reaches graph")]
    report.comparisons.append(Comparison("h0", "control: mask reaches graph", 8, {"attn_out": 1.0}, control=True))
    assert report.passed  # the same report once its declared control ran and failed as it must
