"""The package ladder: every import in src/fullband (module-level and function-level alike, read from the syntax
tree) goes down the package order or stays inside one package, and no imports form a circle.

The order, lowest first (names on one rung, such as "eval / lmeval", share it and must not import each other):

    base < model < presets < data < decode < folder < hf < loader < fullband < chat < vllm / llamacpp < eval / lmeval
         < train < rl / bench < demo / doctor < reproduce < cli

"base" is every top-level module not named elsewhere (errors, validate, files, configio, machine, version,
gguf_file). presets (model shapes by name) reads a ModelConfig; loader loads any folder, a wrapped Hugging Face
model's (fullband.hf.feedback) included. A package's `__init__` has its package's rank; "fullband" is the package's
own `__init__` (the public API, which re-exports model, decode, data and loader). An import of `fullband.a.b`
counts as an import of that module alone, not of the parents whose `__init__` Python runs first."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "fullband"

LADDER = ("base", "model", "presets", "data", "decode", "folder", "hf", "loader", "fullband", "chat", "vllm/llamacpp",
          "eval/lmeval", "train", "rl/bench", "demo/doctor", "reproduce", "cli")
RUNG = {name: i for i, rung in enumerate(LADDER) for name in rung.split("/")}

Edge = tuple[str, str, str, int, bool]  # importer, imported, file, line, at module level


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = ("fullband", *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def place(module: str) -> str:
    """The name of a module's rung: its top-level package or module, or "base"."""
    parts = module.split(".")
    if len(parts) == 1:
        return "fullband"
    return parts[1] if parts[1] in RUNG else "base"


def _top_level(tree: ast.Module) -> set[int]:
    """ids of the import nodes that run when the module is imported (not inside a function or class body's def)."""
    found: set[int] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.add(id(child))
            visit(child)

    visit(tree)
    return found


def import_edges(root: Path = ROOT) -> list[Edge]:
    """Every import of a fullband module by a fullband module: `import fullband.x`, `from fullband.x import y`
    (y's module when y is a submodule, else x) and relative imports, wherever they stand."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    edges = []
    for importer, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = _top_level(tree)
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            else:
                continue
            for target in dict.fromkeys(t for t in targets if t.split(".")[0] == "fullband"):
                if target != importer:
                    edges.append((importer, target, str(path.relative_to(root.parent)), node.lineno, id(node) in top))
    return edges


def modules(root: Path = ROOT) -> set[str]:
    return {module_name(p, root) for p in root.rglob("*.py")}


def arrows_up(edges: list[Edge]) -> list[str]:
    """Each import of a higher rung, or of another name on the same rung, as `file:line  a -> b (rank x -> rank y)`."""
    bad = []
    for importer, imported, file, line, _ in edges:
        a, b = place(importer), place(imported)
        if RUNG[b] > RUNG[a] or (RUNG[b] == RUNG[a] and a != b):
            bad.append(f"{file}:{line}  {importer} -> {imported} (rank {a} -> rank {b})")
    return bad


def cycle(edges: list[Edge], *, module_level_only: bool) -> list[str] | None:
    """One circle of imports, as the list of its modules (first = last), or None."""
    graph: dict[str, set[str]] = {}
    for importer, imported, _, _, top in edges:
        if top or not module_level_only:
            graph.setdefault(importer, set()).add(imported)
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


def test_the_graph_read_is_the_whole_package():
    edges = import_edges()
    assert len(edges) > 100, f"only {len(edges)} imports read from {ROOT}"
    places = {place(m) for e in edges for m in e[:2]}
    assert places == set(RUNG), f"rungs with no module read: {sorted(set(RUNG) - places)}"
    assert any(not top for *_, top in edges), "no function-level import read"


def test_every_import_names_a_module():
    names = modules()
    missing = [f"{file}:{line}  {a} -> {b}" for a, b, file, line, _ in import_edges() if b not in names]
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)


def test_the_rules_catch_a_violation(tmp_path):
    pkg = tmp_path / "fullband"
    for name, text in {"__init__.py": "", "errors.py": "", "model/__init__.py": "",
                       "model/core.py": "from fullband.errors import X\n\ndef f():\n    from ..train import y\n",
                       "train/__init__.py": "from .trainer import go\n", "train/trainer.py": "from . import y\n",
                       "train/y.py": "import fullband.model.core\nfrom .trainer import go\n"}.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    edges = import_edges(pkg)
    assert arrows_up(edges) == [
        "fullband/model/core.py:4  fullband.model.core -> fullband.train.y (rank model -> rank train)"]
    assert cycle(edges, module_level_only=True) == ["fullband.train.trainer", "fullband.train.y",
                                                    "fullband.train.trainer"]
    assert cycle(edges, module_level_only=False)[0] == "fullband.model.core"
    assert arrows_up([("fullband.rl.run", "fullband.bench.real", "f", 1, True)])  # same rung, another name
    assert not arrows_up([("fullband.files", "fullband.errors", "f", 1, True)])  # base within itself


def test_no_arrow_up():
    bad = arrows_up(import_edges())
    assert not bad, f"{len(bad)} imports go up the ladder ({' < '.join(LADDER)}):\n" + "\n".join(bad)


def test_no_import_circle():
    edges = import_edges()
    for module_level_only in (True, False):
        found = cycle(edges, module_level_only=module_level_only)
        assert found is None, f"import circle ({'module level' if module_level_only else 'any level'}): " + \
            " -> ".join(found)


def test_model_imports_only_the_errors_and_the_checks():
    """model/ is the method: of the base modules it reads errors and validate alone (no files, no machine)."""
    above = [f"{file}:{line} {a} -> {b}" for a, b, file, line, _ in import_edges()
             if a.startswith("fullband.model.") and not b.startswith("fullband.model.")
             and b not in ("fullband.errors", "fullband.validate")]
    assert not above, "\n".join(above)
