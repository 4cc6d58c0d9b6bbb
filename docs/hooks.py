"""MkDocs hooks of fullband's site (mkdocs.yml `hooks:`): the README becomes the home page, and the recipe-key
reference is generated from the config dataclasses, so it cannot drift from the code.

A key's row comes from its dataclass field: the default, what its checks in `__post_init__` (fullband.validate's
integer / number / choice / boolean, read from the syntax) accept, and its comment in the code (the comment on the
field's line and the comment lines right below it). `python docs/hooks.py` prints the reference."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import logging
import re
import sys
import textwrap
import tokenize
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS_MARK = "<!-- recipe-keys -->"
README_MARK = "<!-- readme -->"
CHECKS = ("integer", "number", "choice", "boolean")
log = logging.getLogger("mkdocs.hooks.fullband")


@dataclasses.dataclass
class Key:
    section: str
    name: str
    default: str
    accepted: str
    what: str


def sections() -> dict[str, type]:
    """A recipe's sections and their dataclasses: `fullband train`'s ([model] [data] [train] [optim] [log]) and
    `fullband rl`'s ([rl])."""
    from fullband.rl.run import RLRecipe
    from fullband.train.config import RunConfig

    return {name: cls for recipe in (RunConfig, RLRecipe) for name, cls in typing.get_type_hints(recipe).items()}


def recipe_keys() -> list[Key]:
    """Every key a recipe accepts, in the order of its dataclass."""
    from fullband.configio import _type_name

    keys = []
    for section, cls in sections().items():
        comments, checks, hints = {}, {}, typing.get_type_hints(cls)
        for klass in reversed(cls.__mro__):  # a base's fields first (RLSettings under RLConfig)
            if dataclasses.is_dataclass(klass):
                comments |= field_comments(klass)
                checks |= field_checks(klass)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            accepted = checks.get(f.name) or _words(_type_name(hints[f.name]))
            keys.append(Key(section, f.name, json.dumps(default), accepted, comments.get(f.name, "")))
    return keys


def _words(type_name: str) -> str:
    """An unchecked field's annotation in TOML's words ("list of str" -> "list of string")."""
    words = {"bool": "true or false", "str": "string", "int": "integer", "float": "number",
             "Any": "see what it does"}
    return re.sub(r"\w+", lambda m: words.get(m.group(), m.group()), type_name)


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment: the one on its line, and the comment lines right below it."""
    lines, _ = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))
    comments = {tok.start[0]: (tok.string.lstrip("#").strip(), tok.line.strip().startswith("#"))
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    found = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text, line = [], node.end_lineno
            if line in comments and not comments[line][1]:
                text.append(comments[line][0])
            while line + 1 in comments and comments[line + 1][1]:
                line += 1
                text.append(comments[line][0])
            found[node.target.id] = " ".join(text)
    return found


def field_checks(cls: type) -> dict[str, str]:
    """What each field's checks accept, read from `__post_init__` and the methods it calls on self, in the words of
    fullband.validate's errors; a bound that depends on another field is named (`< n_layers`)."""
    source = textwrap.dedent(inspect.getsource(cls))
    methods = {n.name: n for n in ast.parse(source).body[0].body if isinstance(n, ast.FunctionDef)}
    found: dict[str, list[str]] = {}
    if "__post_init__" in methods:
        _visit(methods["__post_init__"], {}, methods, vars(sys.modules[cls.__module__]), found)
    return {name: "; ".join(dict.fromkeys(texts)) for name, texts in found.items()}


def _visit(node: ast.AST, env: dict[str, str], methods: dict, names: dict, found: dict[str, list[str]]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.For) and isinstance(child.target, ast.Name) and isinstance(child.iter, ast.Tuple):
            for item in child.iter.elts:  # `for name in ("steps", "seq_len"): integer(..., getattr(self, name))`
                for stmt in child.body:
                    _visit(ast.Module([stmt], []), {**env, child.target.id: ast.literal_eval(item)}, methods, names,
                           found)
            continue
        if isinstance(child, ast.Call):
            func = child.func
            if isinstance(func, ast.Name) and func.id in CHECKS and len(child.args) >= 2:
                field, each = _field(child.args, env)
                if field:
                    text = _accepts(func.id, child, names, field)
                    found.setdefault(field, []).append(f"each item: {text}" if each else text)
            elif (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"
                  and func.attr in methods):
                _visit(methods.pop(func.attr), env, methods, names, found)
        _visit(child, env, methods, names, found)


def _field(args: list[ast.expr], env: dict[str, str]) -> tuple[str | None, bool]:
    """The field a check reads (self.X, getattr(self, name)), else the one its label names ("log.eval_passes[{i}]":
    each item of log.eval_passes)."""
    value = args[1]
    if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "self":
        return value.attr, False
    if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "getattr":
        return env.get(getattr(value.args[1], "id", ""), None), False
    label = args[0]
    head = label.values[0] if isinstance(label, ast.JoinedStr) and label.values else label
    if isinstance(head, ast.Constant) and isinstance(head.value, str):
        name = head.value.rpartition(".")[2]
        return name.partition("[")[0], "[" in name
    return None, False


def _accepts(check: str, call: ast.Call, names: dict, field: str) -> str:
    from fullband.validate import MAX_LR, _float_range, _int_range

    kw = {k.arg: k.value for k in call.keywords}
    if check == "boolean":
        return "true or false"
    if check == "choice":
        return ", ".join(f'`"{c}"`' for c in _value(call.args[2], names))
    if check == "integer":
        low = _value(call.args[2], names) if len(call.args) > 2 else _value(kw.get("minimum"), names)
        return _int_range(field, low, _value(kw.get("below"), names))
    low, high = _value(kw.get("low"), names), _value(kw.get("high"), names)
    opens = [_value(kw.get(k), names) or False for k in ("low_open", "high_open")]
    if high == MAX_LR:  # float32's largest: what torch's optimizers take
        return _float_range(field, low, None, opens[0], False)
    return _float_range(field, low, high, *opens)


def _value(expr: ast.expr | None, names: dict):
    """A bound's value from the module's names (MAX_SEED, MAX_THREADS + 1), or its source without `self.` when it
    depends on another field (n_layers, steps + 1)."""
    if expr is None:
        return None
    try:
        return eval(compile(ast.Expression(expr), "<bound>", "eval"), dict(names))
    except NameError:
        return ast.unparse(expr).replace("self.", "")


def _markdown(text: str) -> str:
    """A comment as table-cell Markdown: code spans kept, the rest escaped."""
    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append(part.replace("|", "\\|"))
        else:
            out.append(re.sub(r"([\\*_|\[\]])", r"\\\1", part).replace("<", "&lt;").replace(">", "&gt;"))
    return "".join(out)


def keys_markdown() -> str:
    """The reference: one table per section."""
    lines = []
    for section in sections():
        lines += [f"## [{section}]", "", "| key | default | accepted | what it does |", "|---|---|---|---|"]
        lines += [f"| `{k.section}.{k.name}` | `{k.default}` | {_markdown(k.accepted)} | {_markdown(k.what)} |"
                  for k in recipe_keys() if k.section == section]
        lines.append("")
    return "\n".join(lines)


def readme_markdown() -> str:
    """README.md as a page of the site: its links into docs/ made relative to docs/."""
    return re.sub(r"\]\(docs/", "](", (ROOT / "README.md").read_text(encoding="utf-8"))


def missing_figures(markdown: str, page_path: str, docs_dir: Path) -> tuple[str, list[str]]:
    """A report's figures that are not in this checkout, each replaced by a line saying so (a report in docs/results/
    is written by `fullband reproduce` with its figures beside it; one that was never committed would otherwise fail
    the strict build). Hand-written pages get no such leniency."""
    if not page_path.startswith("results/"):
        return markdown, []
    here, exp, missing = (docs_dir / page_path).parent, Path(page_path).stem, []

    def note(m: re.Match) -> str:
        if (here / m.group(1)).exists():
            return m.group(0)
        missing.append(m.group(1))
        return f"*(figure not in this checkout: `{m.group(1)}`; `fullband reproduce {exp}` writes it)*"

    return re.sub(r"!\[[^\]]*\]\(([^)\s]+)\)", note, markdown), missing


def on_page_markdown(markdown: str, page, config, files) -> str:
    if README_MARK in markdown:
        markdown = markdown.replace(README_MARK, readme_markdown())
    if KEYS_MARK in markdown:
        markdown = markdown.replace(KEYS_MARK, keys_markdown())
    markdown, missing = missing_figures(markdown, page.file.src_uri, Path(config["docs_dir"]))
    for path in missing:
        log.info("%s: figure %s is not in this checkout (shown as a note)", page.file.src_uri, path)
    return markdown


if __name__ == "__main__":
    print(keys_markdown())
