"""The package's import graph has no cycle: the library never reaches back into the CLI, and no
two modules need each other (a function-level import counts: it is a cycle postponed)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lbt"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The lbt modules `path` imports anywhere in its body (`from lbt.x import y` names lbt.x.y if it is a module)."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in found if name in modules and name != module_name(path)}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}  # "visiting" or "done"

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "visiting"
        for child in sorted(graph[node]):
            if state.get(child) == "visiting":
                return path[path.index(child):] + [child] if child in path else [node, child]
            if child not in state:
                cycle = visit(child, path + [child])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [start])
            if cycle:
                return cycle
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert {"lbt.cli", "lbt.train", "lbt.trainer", "lbt.lr"} <= set(graph)
    assert "lbt.train" in graph["lbt.cli"]  # the graph is read: the entry module imports the library
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_library_does_not_import_the_cli():
    graph = import_graph()
    assert not [name for name, imported in graph.items() if "lbt.cli" in imported and name != "lbt.__main__"]


def test_a_cycle_is_found_when_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
