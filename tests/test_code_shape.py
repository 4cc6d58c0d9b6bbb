"""The shape of the source: no function over 80 lines, and none over 10 parameters but the public keyword APIs
(a public function whose settings are keywords, such as `generate` / `stream`, `run_cost_bench`, or a signature a
framework fixes, such as transformers' `forward`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "fullband"
MOST_LINES, MOST_PARAMETERS = 80, 10


def functions(root: Path = ROOT):
    """(file:line, name, lines, parameters, public) of every function and method, nested ones included."""
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        nested = {id(inner) for outer in ast.walk(tree) if isinstance(outer, ast.FunctionDef | ast.AsyncFunctionDef)
                  for inner in ast.walk(outer) if inner is not outer}
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [p.arg for p in (a.vararg, a.kwarg) if p]
            count = len([n for n in names if n not in ("self", "cls")])
            public = not node.name.startswith("_") and id(node) not in nested
            yield (f"{path.relative_to(root.parent)}:{node.lineno}", node.name, node.end_lineno - node.lineno + 1,
                   count, public)


def test_no_function_is_over_80_lines():
    long = [f"{where} {name}: {lines} lines" for where, name, lines, _, _ in functions() if lines > MOST_LINES]
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


def test_only_public_keyword_apis_take_over_10_parameters():
    wide = [f"{where} {name}: {n} parameters" for where, name, _, n, public in functions()
            if n > MOST_PARAMETERS and not public]
    assert not wide, "private functions over 10 parameters:\n" + "\n".join(wide)


def test_the_checks_see_the_source(tmp_path):
    """The walk reads every module, and finds a long or wide function where there is one."""
    assert len(list(functions())) > 1000
    (tmp_path / "pkg").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MOST_LINES))
    (tmp_path / "pkg" / "m.py").write_text(f"def long():\n{body}\n\n\ndef _wide(a, b, c, d, e, f, g, h, i, j, k):\n"
                                           "    def inner(a, b, c, d, e, f, g, h, i, j, k):\n        pass\n")
    found = {name: (lines, n, public) for _, name, lines, n, public in functions(tmp_path / "pkg")}
    assert found == {"long": (MOST_LINES + 1, 0, True), "_wide": (3, 11, False), "inner": (2, 11, False)}
