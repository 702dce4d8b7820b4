"""The package's layout: no import cycles (module level, inside functions, or for type checking)
between modules or between packages, every import follows the declared layer order, and every
concept in its folder."""

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


# The layers, bottom first: a package may import its own layer and the layers below it, never one
# above (`specrouter` itself is the lazy top-level namespace: it may be imported for `__version__`).
LAYERS: list[set[str]] = [
    {"errors", "records"},  # shared records: plain dataclasses, nothing of the package
    {"config"},
    {"drafters"},  # model-free drafters and the drafter contract
    {"models"},  # runners, tokenizer, run-time heads, the pool
    {"state"},
    {"decoding"},
    {"router"},
    {"engine"},
    {"api"},
    {"distill", "server", "bench"},
    {"heads"},  # head training (reads distill's corpus)
    {"cli"},
]


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """package -> the packages its modules import (`specrouter.x.y` belongs to `x`)."""
    packages: dict[str, set[str]] = {package_of(m): set() for m in graph}
    for mod, deps in graph.items():
        packages[package_of(mod)] |= {package_of(d) for d in deps} - {package_of(mod)}
    return packages


def layer_violations(graph: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    """`module -> import` for every import of a package in a higher layer (or in none)."""
    rank = {pkg: i for i, layer in enumerate(layers) for pkg in layer}
    bad = []
    for mod, deps in sorted(graph.items()):
        src = package_of(mod)
        for dep in sorted(deps):
            dst = package_of(dep)
            if dst == src or dst == "specrouter":
                continue
            if src not in rank or dst not in rank or rank[dst] > rank[src]:
                bad.append(f"{mod} -> {dep}")
    return bad


def test_no_package_cycles():
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, "package import cycle: " + " -> ".join(cycle)


def test_package_graph_finds_a_package_cycle():
    # positive control: two modules of different packages importing each other's package
    graph = {"specrouter.a.x": {"specrouter.b.y"}, "specrouter.b.y": set(),
             "specrouter.b.z": {"specrouter.a.w"}, "specrouter.a.w": set()}
    assert find_cycle(graph) is None  # no module cycle...
    assert find_cycle(package_graph(graph)) == ["a", "b", "a"]  # ...but a package cycle


def test_imports_follow_the_layer_order():
    graph = import_graph()
    assert {package_of(m) for m in graph} - {"specrouter"} <= set().union(*LAYERS), \
        "a package missing from LAYERS"
    bad = layer_violations(graph, LAYERS)
    assert not bad, "imports against the layer order: " + "; ".join(bad)


def test_the_layer_check_catches_an_upward_import():
    # positive control: the engine's statistics imported from the engine by decoding (the old layout)
    graph = {"specrouter.decoding.executor": {"specrouter.engine.stats"},
             "specrouter.engine.stats": set()}
    assert layer_violations(graph, LAYERS) == ["specrouter.decoding.executor -> specrouter.engine.stats"]
    assert layer_violations({"specrouter.engine.e": {"specrouter.decoding.d"}}, LAYERS) == []


def test_pillars_are_folders():
    for folder in ("records", "drafters", "router", "decoding", "state", "engine", "models", "server",
                   "bench", "distill", "heads", "cli"):
        assert (PKG / folder / "__init__.py").is_file(), folder
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert top == ["__init__.py", "api.py", "config.py", "errors.py"], top


MAX_METHODS = 25  # a class with more is two concepts (issue 27: Router had 46)


def big_classes(source: str, limit: int = MAX_METHODS) -> list[str]:
    """Classes of `source` with more than `limit` methods (nested functions not counted)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            n = sum(isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef)) for x in node.body)
            if n > limit:
                out.append(f"{node.name} ({n} methods)")
    return out


def test_no_class_has_more_than_25_methods():
    bad = [f"{p.relative_to(PKG)}: {c}" for p in PKG.rglob("*.py") for c in big_classes(p.read_text())]
    assert not bad, bad
    # positive control
    assert big_classes("class Big:\n" + "".join(f"    def m{i}(self): pass\n" for i in range(26))) == ["Big (26 methods)"]


def probes(source: str) -> list[str]:
    """getattr / hasattr calls of `source` (optional members probed instead of declared)."""
    return [f"{node.func.id} line {node.lineno}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")]


def test_the_engine_never_probes_the_router_or_the_drafters():
    """The engine and the executor call what RouterProtocol / DrafterProtocol declare
    (router/protocol.py, drafters/base.py): no getattr / hasattr."""
    for name in ("engine/engine.py", "engine/drafts.py", "engine/isolation.py", "decoding/executor.py",
                 "decoding/head_drafting.py"):
        assert probes((PKG / name).read_text()) == [], name
    assert probes("x = getattr(router, 'plan_batch', None)") == ["getattr line 1"]  # positive control
