"""The transformers code a saved folder carries, so it loads where fullband is not installed:
AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).

`save_pretrained` writes the modules the transformers class needs beside the weights, one file each, related by
relative imports, which is what trust_remote_code loads: `modeling_fullband.py` (fullband.hf.modeling, the file
`auto_map` names) and `fullband_<name>.py` for the others (SHIPPED). Each file is its module's source as it is,
except that its imports of other shipped modules become relative ones, read from the syntax tree (for example
fullband.model.layers's names come from `.fullband_layers`). A shipped module that imports any other fullband
module is refused when the files are written (and by the tests), so nothing is silently left out. A model loaded
from such a folder re-saves by copying the files beside this one.

Shipped as source with every transformers folder (it is in SHIPPED): it imports only the standard library."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

ENTRY = "fullband.hf.modeling"
SHIPPED = ("fullband.errors", "fullband.validate", "fullband.model.config", "fullband.model.layers",
           "fullband.model.attention", "fullband.model.fusion", "fullband.model.cache", "fullband.model.mode",
           "fullband.model.weights", "fullband.model.core", "fullband.model.decoder", "fullband.decode.sampling",
           "fullband.decode.generate", "fullband.model.objective", "fullband.hf.remote", ENTRY)


def file_name(module: str) -> str:
    """The file a shipped module is written to."""
    return "modeling_fullband.py" if module == ENTRY else f"fullband_{module.rsplit('.', 1)[-1]}.py"


def shipped_source(module: str) -> str:
    """The text of a shipped module's file: its source, with its imports of shipped modules made relative."""
    source = inspect.getsource(importlib.import_module(module))
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(ast.parse(source)):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        ours = [n for n in names if n.split(".")[0] == "fullband"]
        if not ours:
            continue
        if isinstance(node, ast.Import) or node.level or ours[0] not in SHIPPED:
            raise RuntimeError(f"{module} (shipped with every transformers folder) imports {ours[0]!r}, which is "
                               f"not shipped; import only {', '.join(SHIPPED)} as `from MODULE import NAMES`")
        if lines[node.end_lineno - 1][node.end_col_offset:].split("#")[0].strip():
            raise RuntimeError(f"{module}:{node.lineno}: an import of a shipped module must stand on its own line(s)")
        edits.append(node)
    for node in sorted(edits, key=lambda n: n.lineno, reverse=True):
        indent = lines[node.lineno - 1][: node.col_offset]
        imported = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
        lines[node.lineno - 1 : node.end_lineno] = [f"{indent}from .{file_name(node.module)[:-3]} import {imported}\n"]
    path = module.replace(".", "/") + ".py"
    return f"# {path} of the fullband package, shipped for trust_remote_code (fullband.hf.remote)\n" + "".join(lines)


def shipped_files() -> dict[str, str]:
    """{file name: text} of every file a saved folder carries."""
    if __name__ == "fullband.hf.remote":  # the installed package: generated from its modules
        return {file_name(m): shipped_source(m) for m in SHIPPED}
    here = Path(__file__).parent  # a shipped copy, loaded by trust_remote_code: the files beside this one
    return {name: (here / name).read_text(encoding="utf-8") for name in map(file_name, SHIPPED)}


def write_shipped(directory: str | Path) -> None:
    """Write the shipped files into a saved folder."""
    for name, text in shipped_files().items():
        (Path(directory) / name).write_text(text, encoding="utf-8")
