"""The import graph of a package's modules, read from their source (every import: at the top, inside
functions, under TYPE_CHECKING), and a cycle finder: what the architecture tests of runtime/ and builder/
check their layering with."""
from __future__ import annotations

import ast
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """root/batching/executor.py -> 'batching.executor'; a package's __init__ is the package."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"


def package_imports(path: Path, root: Path) -> set[str]:
    """The modules of the package at `root` (named as module_name does) that `path` imports anywhere."""
    package = root.name
    names = {module_name(p, root) for p in root.rglob("*.py")}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == package:
            base = node.module.removeprefix(package).removeprefix(".")
            for alias in node.names:  # from package.x import y: y may be a module of package x
                full = f"{base}.{alias.name}" if base else alias.name
                found.add(full if full in names else base)
        elif isinstance(node, ast.Import):
            found |= {alias.name.removeprefix(package + ".") for alias in node.names
                      if alias.name.startswith(package + ".")}
    return (found & names) - {module_name(path, root)}


def import_graph(root: Path) -> dict[str, set[str]]:
    return {module_name(p, root): package_imports(p, root) for p in sorted(root.rglob("*.py"))}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None when the graph is acyclic (depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None
