"""The package's layout: no import cycles (module level, inside functions, or for type checking),
and every concept in its folder."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "specrouter"


def _module(path: Path) -> str:
    mod = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
    return mod.removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its body (functions included)."""
    modules = {_module(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parent = ".".join(base[: len(base) - node.level + 1])
                    src = f"{parent}.{node.module}" if node.module else parent
                else:
                    src = node.module or ""
                # `from pkg import submodule` imports the submodule
                names = [f"{src}.{a.name}" if f"{src}.{a.name}" in modules else src for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    graph[mod].add(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        color[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if color.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in color and (c := visit(n)):
                return c
        stack.pop()
        color[m] = 2
        return None

    for m in sorted(graph):
        if m not in color and (c := visit(m)):
            return c
    return None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_pillars_are_folders():
    for folder in ("router", "decoding", "state", "engine", "models", "server", "bench", "distill", "cli"):
        assert (PKG / folder / "__init__.py").is_file(), folder
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert top == ["__init__.py", "api.py", "config.py", "errors.py"], top
