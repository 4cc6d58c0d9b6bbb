"""Hugging Face interoperability (the `hf` extra): full-bandwidth models as transformers classes
(FullbandConfig, FullbandForCausalLM, registered with the Auto classes), Llama checkpoints as native
full-bandwidth models, and latent feedback wrapped around any HF decoder-only LM.

With transformers installed, importing this package registers "fullband" with AutoConfig and
AutoModelForCausalLM; without it the transformers classes raise a FullbandError that says how to install it."""

import importlib.util

from fullband.hf.feedback import LatentFeedback, add_latent_feedback
from fullband.hf.llama import config_from_llama, from_llama

_MODELING = ("FeedbackCache", "FullbandConfig", "FullbandForCausalLM")

__all__ = ["LatentFeedback", "add_latent_feedback", "config_from_llama", "from_llama", *_MODELING]


if importlib.util.find_spec("transformers") is not None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from fullband.hf.modeling import FeedbackCache, FullbandConfig, FullbandForCausalLM  # noqa: F401

    AutoConfig.register(FullbandConfig.model_type, FullbandConfig, exist_ok=True)
    AutoModelForCausalLM.register(FullbandConfig, FullbandForCausalLM, exist_ok=True)


def __getattr__(name: str):
    if name in _MODELING:  # only reached without transformers: say how to install it
        from fullband.hf.llama import _transformers

        _transformers()
    raise AttributeError(f"module 'fullband.hf' has no attribute {name!r}")
