"""Decoding: static KV cache, sampling, and the STANDARD / SOFT / FUSED / EXACT generation modes."""

from fullband.decode.generate import DecodeState, Step, generate, stream
from fullband.decode.mode import MODES, DecodeMode
from fullband.model.cache import KVCache

__all__ = ["DecodeMode", "DecodeState", "KVCache", "MODES", "Step", "generate", "stream"]
