"""Decoding: the engine (one prefill and one decode step for every mode), sampling, teacher-forced scoring."""

from fullband.decode.generate import DecodeState, Step, generate, stream
from fullband.decode.sampling import Sampling
from fullband.model.cache import KVCache
from fullband.model.mode import MODES, DecodeMode

__all__ = ["DecodeMode", "DecodeState", "KVCache", "MODES", "Sampling", "Step", "generate", "stream"]
