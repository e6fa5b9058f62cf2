"""The house's rules that import-linter cannot state: no import circle between any two modules, no
module importing another module's private (`_name`) definitions, no private attribute of another
object used (only `self`, `cls`, or another instance of the same class)."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp

PACKAGE = "servekeeper"
SOURCE = Path(__file__).resolve().parents[2] / "src" / PACKAGE


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """Tarjan's algorithm over the module graph: every group of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return groups


def test_no_import_circle_between_modules() -> None:
    graph = grimp.build_graph(PACKAGE)
    circles = strongly_connected(graph)
    assert circles == [], "modules that import each other (lazy and TYPE_CHECKING imports count):\n" + "\n".join(
        " <-> ".join(group) for group in circles
    )


def private_imports(path: Path, root: Path = SOURCE.parent) -> list[str]:
    """`from servekeeper.x import _name` lines of one file (dunder names are not private)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE:
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {node.module}.{alias.name}")
    return found


def test_no_private_name_imported_across_modules() -> None:
    found = [line for path in sorted(SOURCE.rglob("*.py")) for line in private_imports(path)]
    assert found == [], "private names imported from another module:\n" + "\n".join(found)


def private_attribute_uses(path: Path, root: Path = SOURCE.parent) -> list[str]:
    """`thing._name` where `thing` is not `self`, `cls`, or a parameter of the class's own type
    (another instance of the same class may touch its privates): how `p._do` on another module's
    class would show."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []

    def visit(node: ast.AST, own: set[str], class_name: str | None) -> None:
        if isinstance(node, ast.ClassDef):
            class_name = node.name
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            own = {"self", "cls"}
            for argument in node.args.args + node.args.kwonlyargs:
                annotation = argument.annotation
                name = annotation.id if isinstance(annotation, ast.Name) else getattr(annotation, "value", None)
                if class_name is not None and name == class_name:
                    own.add(argument.arg)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in own):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, own, class_name)

    visit(tree, {"self", "cls"}, None)
    return found


def test_no_private_attribute_of_another_object_is_used() -> None:
    found = [line for path in sorted(SOURCE.rglob("*.py")) for line in private_attribute_uses(path)]
    assert found == [], "private attributes of other objects used:\n" + "\n".join(found)


def test_the_private_attribute_check_sees_one(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "class Planner:\n"
        "    def _do(self) -> None: ...\n"
        "    def adopt(self, old: Planner) -> None:\n"
        "        old._do()\n"
        "        self._do()\n"
        "def step(p: Planner) -> None:\n"
        "    p._do()\n"
    )
    assert private_attribute_uses(sample, root=tmp_path) == ["sample.py:7: p._do"]


def test_the_private_import_check_sees_one(tmp_path: Path) -> None:
    # The check itself must catch what it is for (a check that cannot fail proves nothing).
    sample = tmp_path / "sample.py"
    sample.write_text("from servekeeper.providers.local import _param_args, __all__\nfrom os import _exit\n")
    assert private_imports(sample, root=tmp_path) == ["sample.py:1: servekeeper.providers.local._param_args"]


def test_the_circle_check_sees_one() -> None:
    graph = grimp.ImportGraph()
    for module in ("pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(module)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")
    graph.add_import(importer="pkg.b", imported="pkg.c")
    assert strongly_connected(graph) == [["pkg.a", "pkg.b"]]
