"""The one loader: the model any folder fullband writes holds, whichever it is: a native model folder or training
checkpoint (a FullbandLM, or the Hugging Face model a model.hf_path run wrapped with latent feedback), or a
transformers folder of ours (`fullband convert --to hf`, `save_pretrained`: its native FullbandLM). The folder formats
are fullband.folder's; FullbandLM.save / load reach these functions through the hook installed here."""

from __future__ import annotations

from pathlib import Path

import torch

from fullband.errors import CheckpointError
from fullband.folder import (HF_CONFIG_KEY, _model_config, check_layer_count, is_transformers_folder, load_native_model,
                             load_transformers_folder, read_config_file, read_header, save_model)
from fullband.model.core import FeedbackModel
from fullband.model.decoder import FolderIO, FullbandLM


def load_model(directory: str | Path, *, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> FeedbackModel:
    """Rebuild the model a folder describes and load its weights, in eval mode. Every size is checked against the
    weights file's header before anything is allocated; the weights must be floating point and finite."""
    if is_transformers_folder(directory):
        return load_transformers_folder(directory, device=device, dtype=dtype)
    data = read_config_file(directory)
    config = _model_config(directory, data)
    header = read_header(directory, data)
    check_layer_count(directory, config.n_layers, header)
    if HF_CONFIG_KEY in data:  # a Hugging Face model wrapped with latent feedback (a model.hf_path run)
        from fullband.hf.feedback import load_feedback

        return load_feedback(directory, config, data[HF_CONFIG_KEY], header=header, device=device, dtype=dtype).eval()
    return load_native_model(directory, config, header, device=device, dtype=dtype)


def load_native(directory: str | Path, *, device: str | torch.device = "cpu",
                dtype: torch.dtype | None = None) -> FullbandLM:
    """FullbandLM.load: load_model for a folder that holds a native model (a folder of a wrapped Hugging Face model
    is refused with what to call instead)."""
    model = load_model(directory, device=device, dtype=dtype)
    if not isinstance(model, FullbandLM):
        raise CheckpointError(f"{str(directory)!r} holds a Hugging Face model wrapped with latent feedback (a "
                              "model.hf_path run), not a FullbandLM; load it with fullband.load_model")
    return model


FullbandLM.folder_io = FolderIO(save=save_model, load=load_native)
