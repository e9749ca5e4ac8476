"""The client's house drawing has no circle: no module of `mmcache.client`
imports, at module level or inside a function, one that imports it back
(through any path). Read from the source with `ast`: nothing is imported, so
no vLLM, Dynamo or torch is needed. Imports under `if TYPE_CHECKING:` are
left out: they are never run."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "client"
PACKAGE = "mmcache.client"


def _modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its __init__)."""
    found: dict[str, Path] = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join([PACKAGE, *parts])] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run: everywhere but `if TYPE_CHECKING:` bodies."""
    if isinstance(tree, ast.If) and _is_type_checking(tree.test):
        for node in tree.orelse:
            yield from _imports(node)
        return
    if isinstance(tree, ast.Import | ast.ImportFrom):
        yield tree
    for child in ast.iter_child_nodes(tree):
        yield from _imports(child)


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names `node`, in `module`, imports (a name that is a
    submodule counts as that module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [source] + [f"{source}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        is_package = path.name == "__init__.py"
        for node in _imports(tree):
            graph[name].update(
                t for t in _targets(name, is_package, node) if t in modules and t != name
            )
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` (its modules, the first repeated last), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        path.append(name)
        for target in sorted(graph[name]):
            if (found := visit(target)) is not None:
                return found
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        if (found := visit(name)) is not None:
            return found
    return None


def test_the_client_has_no_import_circle() -> None:
    cycle = _cycle(import_graph())
    assert cycle is None, "an import circle: " + " -> ".join(cycle or [])


def test_a_circle_is_found() -> None:
    """The check itself: a circle through a function-level import is one,
    and an import under TYPE_CHECKING is none."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from . import c\n"
        "def f():\n    from . import b\n"
    )
    tree = ast.parse(source)
    edges = {t for node in _imports(tree) for t in _targets("p.a", False, node)}
    assert "p.b" in edges
    assert "p.c" not in edges
    assert _cycle({"p.a": {"p.b"}, "p.b": {"p.a"}}) == ["p.a", "p.b", "p.a"]
    assert _cycle({"p.a": {"p.b"}, "p.b": set()}) is None
