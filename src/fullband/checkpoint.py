"""Model checkpoints: a folder with `config.json` (the resolved ModelConfig) and `model.safetensors`.

Written atomically (a temporary sibling folder renamed into place) so a crash never leaves half a
checkpoint; the loader checks every file and says which one is missing, corrupted or inconsistent.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from fullband.errors import CheckpointError, ConfigError
from fullband.model.config import ModelConfig

CONFIG_FILE = "config.json"
HF_CONFIG_KEY = "hf_config"  # in config.json of a wrapped Hugging Face model: its transformers config
WEIGHTS_FILE = "model.safetensors"
FORMAT = "fullband"
FORMAT_VERSION = 1


def _version() -> str:
    from fullband import __version__

    return __version__


def write_model_files(directory: Path, config: Any, state: dict[str, torch.Tensor], *, tokenizer: Any = None,
                      metadata: dict | None = None) -> None:
    """config.json + model.safetensors (+ tokenizer.json) into an existing folder (no atomicity here)."""
    from safetensors.torch import save_file

    data = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "fullband_version": _version(),
        "model": config.to_dict(),
        **(metadata or {}),
    }
    (directory / CONFIG_FILE).write_text(json.dumps(data, indent=2) + "\n")
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():  # tied weights (one storage, two names) are written as two tensors
        tensor = tensor.detach().to("cpu").contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    state = out
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(directory)


def save_model(model: torch.nn.Module, directory: str | Path, *, tokenizer: Any = None, metadata: dict | None = None) -> Path:
    """Write model (and tokenizer) into `directory`, replacing what was there only once all is written."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory.parent))
    try:
        metadata = {**model_metadata(model), **(metadata or {})}
        write_model_files(tmp, model.config, model.state_dict(), tokenizer=tokenizer, metadata=metadata)
        _replace_dir(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def model_metadata(model: torch.nn.Module) -> dict:
    """What a model adds to its config.json beyond the ModelConfig (a wrapped HF model: its HF config)."""
    hook = getattr(model, "checkpoint_metadata", None)
    return hook() if callable(hook) else {}


def _replace_dir(src: Path, dst: Path) -> None:
    if not dst.exists():
        os.replace(src, dst)
        return
    old = dst.with_name(f".{dst.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def read_config(directory: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint folder, with an error naming the folder and file on any problem."""
    return _model_config(directory, read_config_file(directory))


def read_config_file(directory: str | Path) -> dict:
    """The checked contents of a checkpoint folder's config.json."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint folder {str(directory)!r} does not exist (or is not a folder)")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{str(directory)!r} is not a fullband checkpoint: {CONFIG_FILE} is missing "
            f"(a checkpoint holds {CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is corrupted (not valid JSON): {err}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or "model" not in data:
        raise CheckpointError(f"{path} is not a fullband config (expected format={FORMAT!r} and a 'model' section)")
    if data.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format_version={data['format_version']}, newer than this fullband reads "
            f"({FORMAT_VERSION}); upgrade fullband"
        )
    return data


def _model_config(directory: str | Path, data: dict) -> ModelConfig:
    path = Path(directory) / CONFIG_FILE
    try:
        return ModelConfig.from_dict(data["model"], source=str(path))
    except (ConfigError, TypeError) as err:
        raise CheckpointError(f"{path}: invalid model config: {err}") from None


def load_state(directory: str | Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"{str(directory)!r} is incomplete: {WEIGHTS_FILE} is missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path} is corrupted or truncated: {err}") from None


def load_model(directory: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Rebuild the model a folder describes and load its weights, checking names and shapes first."""
    from fullband.model.decoder import FullbandLM

    data = read_config_file(directory)
    config = _model_config(directory, data)
    if HF_CONFIG_KEY in data:  # a Hugging Face model wrapped with latent feedback (a model.hf_path run)
        from fullband.hf.feedback import load_feedback

        return load_feedback(directory, config, data[HF_CONFIG_KEY], device=device, dtype=dtype)
    state = load_state(directory)
    with torch.device("meta"):
        model = FullbandLM(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems = _compare(expected, {k: tuple(v.shape) for k, v in state.items()})
    if problems:
        raise CheckpointError(
            f"{Path(directory) / WEIGHTS_FILE} does not match {CONFIG_FILE} "
            f"(d_model={config.d_model}, n_layers={config.n_layers}, fusion={config.fusion!r}): " + "; ".join(problems)
        )
    model = model.to_empty(device=device)
    model.rotary.reset_tables()  # non-persistent buffers: to_empty left them uninitialised
    model.load_state_dict(state, strict=True)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def _compare(expected: dict[str, tuple], found: dict[str, tuple]) -> list[str]:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = [f"{k}: {found[k]} in file, {expected[k]} expected" for k in expected if k in found and found[k] != expected[k]]
    problems = []
    if missing:
        problems.append(f"missing tensors {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {_few(unexpected)}")
    if shapes:
        problems.append(f"shape mismatch {_few(shapes)}")
    return problems


def _few(items: list[str], n: int = 4) -> str:
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def load_native(directory: str | Path, purpose: str, **kwargs):
    """load_model for tools that run the native engine (KV cache, decode step): a folder holding a wrapped HF
    model (model.hf_path runs) is refused with what to use instead."""
    from fullband.model.decoder import FullbandLM

    model = load_model(directory, **kwargs)
    if not isinstance(model, FullbandLM):
        raise CheckpointError(
            f"{str(directory)!r} holds a Hugging Face model wrapped with latent feedback (a model.hf_path run); "
            f"{purpose} needs a native FullbandLM. Decode it with `fullband generate` or its .generate(); a Llama "
            f"can be converted to a native model first (`fullband convert LLAMA_FOLDER OUT`)"
        )
    return model
