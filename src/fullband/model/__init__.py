"""The full-bandwidth model: config, layers, attention, fusion operator, the method's core, the native decoder."""

from fullband.model.config import ModelConfig
from fullband.model.core import FeedbackModel, ModelOutput
from fullband.model.decoder import FullbandLM
from fullband.model.mode import MODES, DecodeMode

__all__ = ["DecodeMode", "FeedbackModel", "FullbandLM", "MODES", "ModelConfig", "ModelOutput"]
