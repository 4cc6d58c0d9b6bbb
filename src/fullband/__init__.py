"""fullband: the Full-bandwidth Transformer (latent feedback decoding, multi-pass Jacobi training)."""

from fullband.version import __version__  # noqa: E402, F401

from fullband.loader import load_model  # noqa: E402  (also installs FullbandLM.save / load)
from fullband.data.chat.templates import chat_prompt as apply_chat_template, fed_chat_prompt  # noqa: E402
from fullband.data.tokenizer import ByteTokenizer, load_tokenizer  # noqa: E402
from fullband.decode import MODES, DecodeMode, KVCache, Sampling, Step, generate, stream  # noqa: E402
from fullband.errors import CheckpointError, ConfigError, FullbandError, InputError  # noqa: E402
from fullband.model import FeedbackModel, FullbandLM, ModelConfig, ModelOutput  # noqa: E402

__all__ = ["ByteTokenizer", "CheckpointError", "ConfigError", "DecodeMode", "FeedbackModel", "FullbandError",
           "FullbandLM", "InputError", "KVCache", "MODES", "ModelConfig", "ModelOutput", "Sampling", "Step",
           "__version__", "apply_chat_template", "fed_chat_prompt", "generate", "load_model", "load_tokenizer",
           "stream"]
