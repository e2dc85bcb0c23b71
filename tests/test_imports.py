"""lbt's imports only go down its layers, and nothing imports in a circle.

    0  lbt.errors, lbt.paths, lbt.rng, lbt.stop             plain helpers every layer uses (stop: signals)
    1  lbt.spec                                             the typed spec, batching, LR, result.json
    2  lbt.optim, data, models, nn, metrics, parallel, cost  building blocks (may use each other, not in a circle)
    3  lbt.techniques                                       plug-ins
    4  lbt.engine                                           builds and runs a spec
    5  lbt.apps                                             commands; the only importers of hydra, omegaconf,
                                                            argparse, matplotlib and optuna
    6  lbt.__main__

A function-level import counts (it is a cycle postponed); an import under `if TYPE_CHECKING:` does not
(it never runs).
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lbt"
LAYERS = {
    "lbt.errors": 0, "lbt.paths": 0, "lbt.rng": 0, "lbt.stop": 0, "lbt": 0,
    "lbt.spec": 1,
    "lbt.optim": 2, "lbt.data": 2, "lbt.models": 2, "lbt.nn": 2, "lbt.metrics": 2, "lbt.parallel": 2, "lbt.cost": 2,
    "lbt.techniques": 3,
    "lbt.engine": 4,
    "lbt.apps": 5,
    "lbt.__main__": 6,
}
APP_ONLY = ("hydra", "omegaconf", "argparse", "matplotlib", "optuna")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    """The layer unit a module belongs to: `lbt.engine.step` -> `lbt.engine`, `lbt.errors` -> `lbt.errors`."""
    parts = module.split(".")
    return ".".join(parts[:2])


def layer(module: str) -> int:
    return LAYERS[room(module)]


def runtime_nodes(tree: ast.AST):
    """Every node of the module but those under `if TYPE_CHECKING:`."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            skip |= {id(child) for stmt in node.body for child in ast.walk(stmt)}
    return [node for node in ast.walk(tree) if id(node) not in skip]


def imported_names(path: Path, modules: set[str]) -> set[str]:
    """The modules `path` imports anywhere in its body (`from lbt.x import y` names lbt.x.y if it is a module),
    lbt's and others' (top-level names for the latter)."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return found


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(lbt module -> the lbt modules it imports, lbt module -> the outside top-level packages it imports)."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph, outside = {}, {}
    for path in paths:
        names = imported_names(path, modules)
        graph[module_name(path)] = {n for n in names if n in modules and n != module_name(path)}
        outside[module_name(path)] = {n.split(".")[0] for n in names if not n.startswith("lbt")}
    return graph, outside


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


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for each import from a lower layer into a higher one."""
    return sorted(f"{a} -> {b}" for a, imported in graph.items() for b in imported if layer(b) > layer(a))


def rooms_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between layer units (lbt.engine, lbt.data, ...): two packages of one layer may use
    each other, but not both ways."""
    rooms: dict[str, set[str]] = {}
    for a, imported in graph.items():
        rooms.setdefault(room(a), set()).update(room(b) for b in imported if room(b) != room(a))
    return rooms


def test_every_module_has_a_layer():
    graph, _ = import_graph()
    assert {"lbt.apps.cli", "lbt.engine.worker", "lbt.engine.trainer", "lbt.spec.lr"} <= set(graph)
    unplaced = sorted(m for m in graph if room(m) not in LAYERS)
    assert not unplaced, f"modules outside the layers: {unplaced}"


def test_imports_only_go_down_the_layers():
    graph, _ = import_graph()
    assert "lbt.engine.worker" in graph["lbt.apps.train"]  # the graph is read: the train app imports the engine
    assert not upward_arrows(graph), "\n".join(upward_arrows(graph))


def test_no_module_or_package_imports_in_a_circle():
    graph, _ = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)
    cycle = find_cycle(rooms_graph(graph))
    assert cycle is None, " -> ".join(cycle)


def test_only_the_apps_import_config_plotting_and_tuning_libraries():
    _, outside = import_graph()
    offenders = sorted(f"{m} imports {p}" for m, packages in outside.items() if layer(m) < LAYERS["lbt.apps"]
                       for p in packages & set(APP_ONLY))
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("graph, arrow", [
    ({"lbt.spec.run": {"lbt.engine.build"}, "lbt.engine.build": set()}, "lbt.spec.run -> lbt.engine.build"),
    ({"lbt.techniques.gns": {"lbt.apps.tune.trials"}, "lbt.apps.tune.trials": set()},
     "lbt.techniques.gns -> lbt.apps.tune.trials"),
])
def test_an_upward_arrow_is_found_when_there_is_one(graph, arrow):
    assert upward_arrows(graph) == [arrow]
    assert upward_arrows({"lbt.engine.build": {"lbt.spec.run"}, "lbt.spec.run": set()}) == []


def test_a_cycle_is_found_when_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    rooms = rooms_graph({"lbt.data.batches": {"lbt.metrics.window"}, "lbt.metrics.window": {"lbt.data.base"},
                         "lbt.data.base": set()})
    assert find_cycle(rooms) is not None  # data -> metrics -> data: a circle between packages
