"""Hugging Face interoperability (the `hf` extra): Llama checkpoints as native full-bandwidth models, and latent
feedback wrapped around any HF decoder-only LM.

transformers is imported lazily; without it these functions raise a FullbandError that says how to install it.
"""

from fullband.hf.feedback import LatentFeedback, add_latent_feedback
from fullband.hf.llama import config_from_llama, from_llama

__all__ = ["LatentFeedback", "add_latent_feedback", "config_from_llama", "from_llama"]
