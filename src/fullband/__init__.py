"""fullband: the Full-bandwidth Transformer (latent feedback decoding, multi-pass Jacobi training)."""

__version__ = "0.1.0"

from fullband.data.tokenizer import ByteTokenizer, load_tokenizer  # noqa: E402
from fullband.decode import MODES, KVCache, Step, generate, stream  # noqa: E402
from fullband.errors import CheckpointError, ConfigError, FullbandError, InputError  # noqa: E402
from fullband.model import FullbandLM, ModelConfig, ModelOutput  # noqa: E402

__all__ = [
    "ByteTokenizer", "CheckpointError", "ConfigError", "FullbandError", "FullbandLM", "InputError",
    "KVCache", "MODES", "ModelConfig", "ModelOutput", "Step", "__version__", "generate", "load_tokenizer", "stream",
]
