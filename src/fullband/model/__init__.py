"""The full-bandwidth model: config, layers, attention, fusion operator, decoder."""

from fullband.model.config import ModelConfig
from fullband.model.decoder import FullbandLM, ModelOutput

__all__ = ["FullbandLM", "ModelConfig", "ModelOutput"]
