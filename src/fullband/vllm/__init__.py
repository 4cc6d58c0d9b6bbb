"""fullband inside vLLM: `vllm serve FOLDER` and `vllm.LLM(FOLDER)` for a transformers folder of a full-bandwidth
model (`fullband convert --to hf`, `save_pretrained`), in every decoding mode. See fullband.vllm.model.

`register` is vLLM's plugin entry point (`vllm.general_plugins` in pyproject.toml): vLLM calls it in each of its
processes after `pip install 'fullband[vllm]'`; nothing else is set up by hand."""

from __future__ import annotations

ARCHITECTURE = "FullbandForCausalLM"


def register() -> None:
    """Register fullband's config with transformers and its model and engine rules with vLLM (idempotent)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from fullband.hf.modeling import FullbandConfig

    AutoConfig.register(FullbandConfig.model_type, FullbandConfig, exist_ok=True)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "fullband.vllm.model:FullbandForCausalLM")
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    if ARCHITECTURE not in MODELS_CONFIG_MAP:
        from fullband.vllm.engine import FullbandEngineConfig

        MODELS_CONFIG_MAP[ARCHITECTURE] = FullbandEngineConfig


def generate_with_states(llm, prompts, sampling_params):
    """`llm.generate` and each generated token's fed state (fullband.vllm.states.generate_with_states)."""
    from fullband.vllm.states import generate_with_states as run

    return run(llm, prompts, sampling_params)
