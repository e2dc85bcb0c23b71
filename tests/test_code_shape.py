"""The code stays readable: short functions, a short trainer, a small plug-in interface."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lbt"
MAX_FUNCTION_LINES = 50
MAX_TRAINER_LINES = 250
MAX_HOOKS = 15


def functions(tree: ast.AST):
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def length(node: ast.AST) -> int:
    """Lines from the `def` (decorators excluded) to the last line of the body."""
    return node.end_lineno - node.lineno + 1


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in functions(ast.parse(path.read_text())):
            if length(node) > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({length(node)} lines)")
    assert not long, "\n".join(long)


def test_the_trainer_is_short():
    tree = ast.parse((PACKAGE / "engine" / "trainer.py").read_text())
    trainer = next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == "Trainer")
    assert length(trainer) < MAX_TRAINER_LINES


def test_the_plugin_interface_has_few_hooks():
    tree = ast.parse((PACKAGE / "techniques" / "base.py").read_text())
    technique = next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == "Technique")
    hooks = [node.name for node in technique.body if isinstance(node, ast.FunctionDef)]
    assert "after_backward" in hooks and len(hooks) < MAX_HOOKS, hooks


def test_the_checks_can_fail():
    tree = ast.parse("def f():\n" + "    x = 1\n" * 60)
    assert length(functions(tree)[0]) == 61
