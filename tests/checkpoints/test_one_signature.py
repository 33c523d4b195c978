"""One signature per checkpoint-taking function (issue 39): a function takes a path (and opens it: an edge) or an
opened ``Checkpoint`` / ``ModelCheckpoint``, never either. The rule read from the source: no function tests one of
its parameters for being a path (``isinstance(x, (str, os.PathLike))``, ``isinstance(x, Path)``), nor for being an
opened checkpoint when it also opens one (``x if isinstance(x, Checkpoint) else load_checkpoint(x)``); telling two
opened models apart (anelab's ``ModelCheckpoint`` or mlx-lm's) is neither. The openers take a path only.
Negative control: the patterns the package used before are caught.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import anelab
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.whole_model import load_model

PACKAGE = Path(anelab.__file__).resolve().parent
PATH_TYPES = {"Path", "PathLike", "os.PathLike"}
OPENED_TYPES = {"Checkpoint", "ModelCheckpoint"}
OPENERS = {"load_checkpoint", "load_model", "load_mlp_model", "whole_model", "mlp_model", "open_package_checkpoint"}

BEFORE = """
def cached_export(checkpoint, cache_root):
    checkpoint = checkpoint if isinstance(checkpoint, Checkpoint) else load_checkpoint(checkpoint)

def weight_mode_evidence(checkpoint):
    model = load_model(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else checkpoint

def docs_activations(checkpoint, tokens):
    model = checkpoint if isinstance(checkpoint, ModelCheckpoint) else load_model(checkpoint)

def engine_of(model):  # two opened models told apart: not a path or a checkpoint
    return "numpy" if isinstance(model, ModelCheckpoint) else "mlx"

def chat(messages):  # a string or a list of messages: not a path
    return [messages] if isinstance(messages, str) else list(messages)
"""  # the patterns of df85c67 (evidence_cache, compression_cost, real_text) and two that are not the rule's


def _tested_types(node: ast.expr) -> set[str]:
    items = node.elts if isinstance(node, ast.Tuple) else [node]
    return {ast.unparse(t) for t in items}


def path_or_opened(source: str) -> list[str]:
    """``function: parameter`` for each function that asks whether a parameter is a path or an opened checkpoint."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs}
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
        opens = any((getattr(c.func, "id", None) or getattr(c.func, "attr", None)) in OPENERS for c in calls)
        for node in calls:
            if getattr(node.func, "id", None) != "isinstance" or len(node.args) != 2:
                continue
            subject, types = node.args[0], _tested_types(node.args[1])
            either = types & PATH_TYPES or (opens and types & OPENED_TYPES)
            if isinstance(subject, ast.Name) and subject.id in params and either:
                found.append(f"{fn.name}: {subject.id}")
    return found


def test_no_function_takes_a_path_or_an_opened_checkpoint():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += [f"{path.relative_to(PACKAGE)} {hit}" for hit in path_or_opened(path.read_text())]
    assert found == []


def test_the_rule_catches_the_patterns_it_replaced():
    assert path_or_opened(BEFORE) == [
        "cached_export: checkpoint",
        "weight_mode_evidence: checkpoint",
        "docs_activations: checkpoint",
    ]


def test_the_openers_take_a_path_only(tiny_checkpoint):
    opened = load_checkpoint(tiny_checkpoint("llama"))
    assert opened.geometry.num_layers == 2  # control: a path opens
    with pytest.raises(TypeError):
        load_checkpoint(opened)  # an opened checkpoint is not opened again: its holder passes it on
    with pytest.raises(TypeError):
        load_model(opened)
