"""The import graph of the package, read from the source (module-level and function-level imports alike): no
circle anywhere, and model/ imports nothing above it."""

from __future__ import annotations

import ast
from pathlib import Path

import fullband

ROOT = Path(fullband.__file__).parent
BASE = {"fullband.errors", "fullband.validate"}  # what every layer may use


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the fullband modules it imports anywhere in its source; an import of a package counts as an import
    of what the package's __init__ imports."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    raw: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fullband"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("fullband")}
        raw[name] = {t for t in targets if t in modules and t != name}
    packages = {n for n, p in modules.items() if p.name == "__init__.py"}

    def expand(targets: set[str], seen: frozenset = frozenset()) -> set[str]:
        out = set()
        for t in targets:
            if t in packages and t not in seen:
                out |= expand(raw[t], seen | {t})
            elif t not in packages:
                out.add(t)
        return out

    return {n: expand(t) for n, t in raw.items() if n not in packages}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_circle():
    cycle = _cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_model_imports_nothing_above_it():
    for name, targets in import_graph().items():
        if name.startswith("fullband.model."):
            above = sorted(t for t in targets if not t.startswith("fullband.model.") and t not in BASE)
            assert not above, f"{name} imports {above}"
