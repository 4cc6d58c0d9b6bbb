"""Decoding: static KV cache, sampling, and the STANDARD / SOFT / FUSED / EXACT generation modes."""

from fullband.model.cache import KVCache
from fullband.decode.generate import MODES, Step, generate, stream

__all__ = ["KVCache", "MODES", "Step", "generate", "stream"]
