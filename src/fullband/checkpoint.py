"""Loading a model folder, whichever model it holds: a native FullbandLM, or a Hugging Face model wrapped with
latent feedback (a model.hf_path run, whose config.json carries the HF config). The folder format itself is
fullband.folder; FullbandLM.save / load reach these functions through the hook installed here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fullband.errors import CheckpointError
from fullband.folder import (
    HF_CONFIG_KEY, _model_config, check_layer_count, load_native_model, read_config_file, read_header, save_model,
)
from fullband.model.decoder import FolderIO, FullbandLM


def load_model(directory: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Rebuild the model a folder describes and load its weights. Every size is checked against the weights
    file's header before anything is allocated; the weights must be floating point and finite."""
    data = read_config_file(directory)
    config = _model_config(directory, data)
    header = read_header(directory, data)
    check_layer_count(directory, config.n_layers, header)
    if HF_CONFIG_KEY in data:  # a Hugging Face model wrapped with latent feedback (a model.hf_path run)
        from fullband.hf.feedback import load_feedback

        return load_feedback(directory, config, data[HF_CONFIG_KEY], header=header, device=device, dtype=dtype)
    return load_native_model(directory, data, config, header, device=device, dtype=dtype)


def load_native(directory: str | Path, purpose: str, **kwargs) -> FullbandLM:
    """load_model for tools that run the native engine (KV cache, decode step): a folder holding a wrapped HF
    model (model.hf_path runs) is refused with what to use instead."""
    model = load_model(directory, **kwargs)
    if not isinstance(model, FullbandLM):
        raise CheckpointError(
            f"{str(directory)!r} holds a Hugging Face model wrapped with latent feedback (a model.hf_path run); "
            f"{purpose} needs a native FullbandLM. Decode it with `fullband generate` or its .generate(); a Llama "
            f"can be converted to a native model first (`fullband convert LLAMA_FOLDER OUT`)"
        )
    return model


FullbandLM.folder_io = FolderIO(save=save_model, load=load_model)
