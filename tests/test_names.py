"""Every dotted ``anelab.…`` name and every ``anelab/….py`` path written in the code, its docstrings, the docs,
the notebooks, the captions and the figure text resolves: a module that exists (and, when the name goes on, a
name defined at that module's top level). Package metadata keys (``anelab.chunk``, ``anelab.keyTile``, …) are
keys, not modules: they are taken from ``anelab.sidecar.format``. Generated figure files (``figures/``) are
left out: they are rewritten from this text when the figures are drawn again."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from anelab.sidecar import format as package_format

REPO = Path(__file__).resolve().parent.parent
DOTTED = re.compile(r"\banelab(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
PATH = re.compile(r"\banelab/[A-Za-z0-9_/]+\.py\b")
METADATA_KEYS = {
    value
    for value in [*package_format.META.values(), *vars(package_format).values()]
    if isinstance(value, str) and value.startswith("anelab.")
}


def written_files(repo: Path = REPO) -> list[Path]:
    """The text a reader meets: code and docstrings, captions, docs, notebooks, tests and benchmarks."""
    patterns = ("anelab/**/*.py", "anelab/**/*.toml", "docs/**/*.md", "*.md", "notebooks/*.ipynb", "tests/**/*.py",
                "benchmarks/**/*.py")  # fmt: skip
    here = Path(__file__).resolve()  # this file spells stale names on purpose (its negative control)
    frozen = set(repo.glob("docs/prompt/*"))  # the README frozen at a615004 as a real-text prompt: never edited
    return sorted({p for pattern in patterns for p in repo.glob(pattern)} - {here} - frozen)


@cache
def top_level_names(module: Path) -> frozenset[str]:
    """Names a module defines or imports at its top level (functions, classes, assignments, imports)."""
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


def resolves(name: str, repo: Path = REPO) -> bool:
    """A dotted anelab name (a module, then perhaps an attribute): its longest module prefix exists and the
    next part is defined there."""
    if name in METADATA_KEYS:
        return True
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        stem = repo.joinpath(*parts[:k])
        module = stem.with_suffix(".py") if stem.with_suffix(".py").is_file() else stem / "__init__.py"
        if module.is_file():
            rest = parts[k:]
            if not rest or rest[0].startswith("__"):
                return True
            return rest[0] in top_level_names(module)
    return False


def stale_names(files: list[Path], repo: Path = REPO) -> list[str]:
    """``file:line: name`` for each dotted name or path that does not resolve."""
    bad = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            names = [n for n in DOTTED.findall(line) if not resolves(n, repo)]
            names += [p for p in PATH.findall(line) if not (repo / p).is_file()]
            bad += [f"{path.name}:{number}: {n}" for n in names]
    return bad


def test_every_written_anelab_name_resolves():
    assert stale_names(written_files()) == []


def test_a_stale_name_is_caught(tmp_path):
    """Negative control: the names issue 19 found (a module gone, a path moved, a function that is not there)."""
    note = tmp_path / "note.md"
    note.write_text(
        "evaluated with anelab.mil_eval; see `anelab/checkpoint.py`\n"
        "calls anelab.sidecar.checks.verify.no_such_function and anelab.plan.fit_costs\n"
        "fine: anelab.sidecar.checks.verify.verify_package, anelab.keyTile, anelab.__version__, `anelab/checkpoints/checkpoint.py`\n"
    )
    found = stale_names([note], repo=REPO)
    assert [f.split(": ")[1] for f in found] == [
        "anelab.mil_eval",
        "anelab/checkpoint.py",
        "anelab.sidecar.checks.verify.no_such_function",
        "anelab.plan.fit_costs",
    ], found
