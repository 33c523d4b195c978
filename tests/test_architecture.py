"""The folder tree is the architecture: imports point one way (core <- checkpoints <- sidecar <- runtimes <-
planner, arms, decide <- studies <- publish <- cli and its commands), no module imports another's private name, every module
states its job."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "anelab"
# (layer, the top-level folders it holds): a folder may import its own layer and those listed before it
LAYERS = (
    ("core", ("core",)),
    ("checkpoints", ("checkpoints",)),
    ("sidecar", ("sidecar",)),
    ("runtimes", ("runtimes",)),
    ("product", ("planner", "arms", "decide")),
    ("studies", ("studies",)),
    ("publish", ("publish",)),
    ("cli", ("cli", "__main__", "commands")),
)
LAYER_NAMES = [name for name, _ in LAYERS]
FOLDER_LAYER = {folder: name for name, folders in LAYERS for folder in folders}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    """The layer of an ``anelab`` module: the layer of its first sub-package (the package itself is core)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "core"
    if parts[1] not in FOLDER_LAYER:
        raise AssertionError(f"{module}: anelab/{parts[1]} is in no layer; add it to LAYERS")
    return FOLDER_LAYER[parts[1]]


def anelab_imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str, list[str]]]:
    """Every import of an anelab module in a file, module-level or inside functions:
    (line, imported module, imported names)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.level == 0
            and node.module.split(".")[0] == "anelab"
        ):
            names = [a.name for a in node.names]
            # ``from anelab.studies import planner``: a sub-module import names the sub-module
            stems = [(n, root.parent / f"{node.module}.{n}".replace(".", "/")) for n in names]
            sub = [f"{node.module}.{n}" for n, stem in stems if stem.is_dir() or stem.with_suffix(".py").is_file()]
            for target in sub or [node.module]:
                found.append((node.lineno, target, names))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "anelab":
                    found.append((node.lineno, alias.name, []))
    return found


def violations(root: Path = PACKAGE) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        me = module_name(path, root)
        mine = LAYER_NAMES.index(layer_of(me))
        for line, target, names in anelab_imports(path, root):
            if target == "anelab":
                continue  # the package's __version__
            theirs = LAYER_NAMES.index(layer_of(target))
            if theirs > mine:
                bad.append(
                    f"{path.relative_to(root.parent)}:{line}: {layer_of(me)} imports {layer_of(target)} ({target})"
                )
            for name in names:
                if name.startswith("_") and not name.startswith("__") and target != me:
                    bad.append(f"{path.relative_to(root.parent)}:{line}: imports private name {name} from {target}")
    return bad


def test_imports_point_one_way_and_no_private_names_cross_modules():
    assert violations() == []


def test_a_backward_import_is_caught(tmp_path):
    """Negative control: the same walk over a copy where the graph module imports the planner, a study back-end
    imports publishing, and a module outside every layer appears."""
    import shutil

    copy = tmp_path / "anelab"
    shutil.copytree(PACKAGE, copy)
    graph = copy / "sidecar" / "graphs" / "dense.py"
    graph.write_text(graph.read_text() + "\n\ndef _late():\n    from anelab.planner import plan  # noqa\n")
    private = copy / "studies" / "tiled_stateful.py"
    private.write_text(private.read_text() + "\nfrom anelab.sidecar.mil.evaluate import _signature  # noqa\n")
    study = copy / "studies" / "mask_fold.py"
    study.write_text(study.read_text() + "\n\ndef _late():\n    from anelab.publish import figures  # noqa\n")
    request = copy / "planner" / "plan_request.py"
    request.write_text(request.read_text() + "\nfrom anelab.commands.arguments import int_list  # noqa\n")
    found = violations(copy)
    assert any("sidecar imports product" in v and "dense.py" in v for v in found), found
    assert any("product imports cli" in v and "plan_request.py" in v for v in found), found
    assert any("studies imports publish" in v and "mask_fold.py" in v for v in found), found
    assert any("private name _signature" in v for v in found), found


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_states_its_job_in_its_first_docstring_line(path):
    if path.name == "__main__.py":
        return
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and doc.splitlines()[0].strip(), f"{path} has no one-line docstring stating its job"


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the anelab modules it imports (module-level or inside functions), this tree's only."""
    modules = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    return {
        me: {target for _, target, _ in anelab_imports(path, root) if target in modules and target != me}
        for me, path in modules.items()
    }


def import_circles(root: Path = PACKAGE) -> list[list[str]]:
    """Every set of modules that import each other round a circle (strongly connected, more than one
    module), inside a layer too: Tarjan's algorithm over ``import_graph``."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == module:
                    break
            if len(members) > 1:
                circles.append(sorted(members))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_no_import_circle_anywhere():
    assert import_circles() == []


def test_an_import_circle_inside_a_layer_is_caught(tmp_path):
    """Negative control: the circle issue 19 broke (batch <-> notebooks, now in publish), put back by a
    function-level import, is found; so is a three-module circle."""
    import shutil

    copy = tmp_path / "anelab"
    shutil.copytree(PACKAGE, copy)
    notebooks = copy / "publish" / "notebooks.py"
    notebooks.write_text(
        notebooks.read_text() + "\n\ndef _late():\n    from anelab.publish.batch import read_grid  # noqa\n"
    )
    verify = copy / "sidecar" / "checks" / "verify_cases.py"
    verify.write_text(
        verify.read_text() + "\n\ndef _late():\n    from anelab.sidecar.designs import get_design  # noqa\n"
    )
    circles = import_circles(copy)
    assert ["anelab.publish.batch", "anelab.publish.notebooks"] in circles, circles
    assert any({"anelab.sidecar.designs", "anelab.sidecar.checks.verify_cases"} <= set(c) for c in circles), circles


MAX_FUNCTION_LINES = 80


def long_functions(root: Path = PACKAGE, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (n lines)`` for every function (methods and nested ones too) longer than ``limit``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_over_80_lines():
    assert long_functions() == []


def test_a_long_function_is_caught(tmp_path):
    """Negative control: an 81-line function (a docstring and 79 statements) is found, an 80-line one is not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(79))
    (tmp_path / "anelab").mkdir()
    (tmp_path / "anelab" / "long.py").write_text(f'def long():\n    """81 lines."""\n{body}\n')
    (tmp_path / "anelab" / "fits.py").write_text(f"def fits():\n{body}\n")
    root = tmp_path / "anelab"
    assert long_functions(root) == [f"{root.name}/long.py:1 long (81 lines)"]


def test_a_folder_in_no_layer_is_refused():
    """Negative control for ``layer_of``: a new top-level folder must be placed in a layer, not default to one."""
    assert layer_of("anelab.planner.plan") == "product" and layer_of("anelab.core.geometry") == "core"
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of(".".join(("anelab", "nowhere", "module")))
