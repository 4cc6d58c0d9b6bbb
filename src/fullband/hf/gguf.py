"""GGUF files in (llama.cpp's single-file format): the header checked first (fullband.gguf_file), then the model and
its tokenizer read by transformers' GGUF reader, dequantized to float32.

A `.gguf` path is accepted wherever a transformers folder is (`fullband convert`, `model.hf_path`,
`train.init_from`): `pretrained_args` turns it into the (folder, gguf_file=NAME) pair transformers' readers take."""

from __future__ import annotations

import contextlib
import copy
import functools
from pathlib import Path
from typing import Any

import torch

from fullband.errors import ConfigError
from fullband.gguf_file import file_version, gguf_args, gguf_path, inspect_gguf, parsed_once
from fullband.hf.llama import _transformers, dtype_kwarg, load_checked

# general.architecture values fullband converts into its native model (the Llama family: Llama 1-3, SmolLM, ...);
# other architectures transformers reads can still be wrapped with latent feedback (model.hf_path)
NATIVE_ARCHITECTURES = ("llama",)


def pretrained_args(path: str | Path, *, config: bool = False) -> tuple[str, dict[str, Any]]:
    """gguf_args, with `config=` a GGUF file's model config when asked (a model reader then parses it once)."""
    name, extra = gguf_args(path)
    return name, {**extra, "config": pretrained_config(path)} if config and extra else extra


def pretrained_config(path: str | Path):
    """transformers' config of a folder or GGUF file. A GGUF file's is read once per file version (its reader parses
    every metadata field, the whole vocabulary included: seconds for each read); each caller gets its own copy.
    OSError / ValueError as transformers raises them."""
    name, extra = pretrained_args(path)
    if not extra:
        return _transformers().AutoConfig.from_pretrained(name)
    return copy.deepcopy(_gguf_config(*file_version(gguf_path(path))))


@functools.lru_cache(maxsize=8)
def _gguf_config(path: Path, size: int, mtime: int):  # size, mtime: the cache key of a file version
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
        with contextlib.suppress(AttributeError):  # a read-only property in some versions: derived from hf_quantizer
            model.is_quantized = False
    return model


@parsed_once()
def load_causal_lm(path: str | Path, dtype=None):
    """The transformers causal LM of a folder or GGUF file (dequantized to float32 by default), unquantized."""
    try:
        name, extra = pretrained_args(path, config=True)
        model = load_checked(_transformers().AutoModelForCausalLM, name, str(path),
                             **dtype_kwarg(dtype or torch.float32), **extra)
    except (OSError, ValueError, ImportError) as err:  # a missing reader package, an architecture it does not map
        raise ConfigError(f"{path} could not be loaded by transformers: {err}") from None
    return unquantized(model)
