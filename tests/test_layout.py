"""The package's shape: no import cycles, the runtime free of offline code, no reaching into private state, and a
small public surface. Built from the source with `ast`, so a new module is checked without being listed here."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import fluxion_lite

PACKAGE = Path(fluxion_lite.__file__).parent
RUNTIME = ("engine", "model", "plan", "sparse", "hostkv", "server", "hub")  # what serving a request may import
# Private attributes of objects from other libraries that we must touch (none of ours): (module, expression)
FOREIGN_PRIVATE = {
    ("fluxion_lite.offline.llamacpp_peer", "peer._ctx"),  # llama_cpp.Llama's context: the peer times llama_decode
}


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Nodes under `if TYPE_CHECKING:`: annotations only, never executed, so not import edges."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skip.update(id(n) for n in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports, at the top or inside functions (function-local imports count)."""
    mods = modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(modules()):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"fluxion_lite.a": {"fluxion_lite.b"}, "fluxion_lite.b": {"fluxion_lite.a"}}) == []  # not modules
    graph = import_graph()
    graph["fluxion_lite.errors"] = graph["fluxion_lite.errors"] | {"fluxion_lite.cli"}  # cli imports errors
    assert any("fluxion_lite.errors" in c and "fluxion_lite.cli" in c for c in cycles(graph))


def test_the_runtime_imports_nothing_offline() -> None:
    graph = import_graph()
    roots = [m for m in modules() if m.split(".")[1:2] and m.split(".")[1] in RUNTIME]
    seen, todo = set(roots), list(roots)
    while todo:  # everything the runtime reaches, directly or not
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    assert sorted(m for m in seen if m.startswith("fluxion_lite.offline")) == []
    assert all(not m.startswith("research") for m in seen)


def test_no_module_touches_another_objects_private_attributes() -> None:
    hits = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue  # an object's own state
            expr = ast.unparse(node)
            if expr.startswith("torch.") or (name, expr) in FOREIGN_PRIVATE:
                continue  # torch's private ops are its API for them; listed foreign internals
            hits.append(f"{name}: {expr}")
    assert hits == []


def test_public_surface() -> None:
    from fluxion_lite import LLM, Engine, SamplingParams
    from fluxion_lite.engine.engine import Engine as EngineImpl
    from fluxion_lite.engine.llm import LLM as LLMImpl
    from fluxion_lite.engine.sampling import SamplingParams as ParamsImpl

    assert (LLM, Engine, SamplingParams) == (LLMImpl, EngineImpl, ParamsImpl)
    assert {"LLM", "Engine", "SamplingParams"} <= set(fluxion_lite.__all__)
