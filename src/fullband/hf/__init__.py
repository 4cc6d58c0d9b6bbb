"""Hugging Face interoperability (the `hf` extra): Llama checkpoints as full-bandwidth models.

transformers is imported lazily; without it these functions raise a FullbandError that says how to install it.
"""

from fullband.hf.llama import config_from_llama, from_llama

__all__ = ["config_from_llama", "from_llama"]
