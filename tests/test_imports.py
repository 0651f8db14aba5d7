"""The layers hold: no import cycle among the project's modules, and methods/ (engine, trees, drafters) never
imports evaluation/ (runs, analysis, calibration). Imports inside functions count too: a lazy import that
closes a cycle is still a cycle."""

from __future__ import annotations

import ast

from methods.paths import PROJECT_ROOT


def import_graph() -> dict[str, set[str]]:
    """Each module of methods/ and evaluation/ with the project modules it imports (anywhere in its body)."""
    files = [*(PROJECT_ROOT / "methods").rglob("*.py"), *(PROJECT_ROOT / "evaluation").rglob("*.py")]
    names = {".".join(p.relative_to(PROJECT_ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in files}
    graph = {}
    for name, path in names.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a list of modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_methods_never_import_evaluation():
    upward = sorted(f"{m} imports {d}" for m, deps in import_graph().items() if m.startswith("methods")
                    for d in deps if d.startswith("evaluation"))
    assert not upward, "methods/ is the layer below evaluation/: " + "; ".join(upward)
