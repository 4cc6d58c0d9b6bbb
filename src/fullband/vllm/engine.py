"""Engine rules for fullband folders, run when vLLM builds its config (registered by fullband.vllm.register):
what is refused, what is turned off and why, and the request tracker added to the model's logits processors."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.models.config import VerifyAndUpdateConfig

from fullband.model.mode import DecodeMode
from fullband.errors import ConfigError
from fullband.model.config import ModelConfig, require_default_layers
from fullband.version import check_tested
from fullband.vllm.requests import served_default

if TYPE_CHECKING:
    from fullband.hf.modeling import FullbandConfig

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: its handlers print it

def model_config_of(hf_config: "FullbandConfig") -> ModelConfig:
    """The native ModelConfig a served folder describes; a latent-feedback wrapper of another HF model is refused."""
    cfg = hf_config.to_model_config()  # a FullbandConfig (fullband.vllm.register registers it with transformers)
    if cfg.hf_path:
        raise ConfigError(f"hf_path={cfg.hf_path!r}: a latent-feedback wrapper around another Hugging Face model is "
                          "not served by fullband's vLLM model (only native full-bandwidth models, converted Llamas "
                          "included)")
    require_default_layers(cfg, "fullband's vLLM model")
    return cfg


def default_mode_of(hf_config) -> DecodeMode:
    cfg = model_config_of(hf_config)
    return served_default(getattr(hf_config, "feedback_mode", "soft"), getattr(hf_config, "prefill_passes", 1),
                          has_feedback=cfg.has_feedback)


class FullbandEngineConfig(VerifyAndUpdateConfig):
    """Run when vLLM builds its config for a fullband folder (registered in fullband.vllm.register)."""

    @staticmethod
    def verify_and_update_config(vllm_config: VllmConfig) -> None:
        import vllm

        check_tested("vllm", vllm.__version__, "fullband's vLLM plugin")
        hf_config = vllm_config.model_config.hf_config
        cfg = model_config_of(hf_config)
        default = default_mode_of(hf_config)  # a bad default in config.json is an error at start, not per request
        if vllm_config.speculative_config is not None:
            raise ConfigError("speculative decoding is not supported with latent feedback: a drafted token's fed-back "
                              "state is not known until it is verified")
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ConfigError("pipeline_parallel_size > 1 is not supported: the fed-back state leaves the last stage "
                              "and enters the first every step (use tensor parallelism)")
        if cfg.has_feedback and vllm_config.cache_config.enable_prefix_caching:
            _feedback_caching(vllm_config)
        if cfg.has_feedback and not vllm_config.parallel_config.worker_extension_cls:
            from fullband.vllm.states import WORKER_EXTENSION

            vllm_config.parallel_config.worker_extension_cls = WORKER_EXTENSION  # fed states handed over on request
        _model_runner_v1()
        _no_full_cuda_graphs(vllm_config)
        from fullband.vllm.tracker import SERVED, TRACKER

        SERVED.configure(has_feedback=cfg.has_feedback, default=default, max_passes=cfg.max_seq_len)
        procs = list(vllm_config.model_config.logits_processors or [])
        if TRACKER not in procs:
            vllm_config.model_config.logits_processors = [*procs, TRACKER]


def _model_runner_v1() -> None:
    """The per-request fed state follows the V1 model runner's persistent batch (fullband.vllm.tracker): V1 is
    chosen before the workers start, said once. Model Runner V2 keeps requests in its own state, with no hook yet
    for a per-request tensor carried between steps (docs/vllm-v2.md)."""
    asked = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    logger.info("fullband: model runner V1%s (the fed-back state lives in its persistent batch; Model Runner V2 is "
                "not supported yet: docs/vllm-v2.md)", " instead of the V2 runner asked for" if asked == "1" else "")


def _feedback_caching(vllm_config: VllmConfig) -> None:
    """Prefix caching for a model with latent feedback runs on fullband's scheduler (fullband.vllm.scheduler: a
    cached block is also keyed by how its positions were read); with a scheduler of the user's own it is off."""
    sched = vllm_config.scheduler_config
    if sched.scheduler_cls is not None and not str(sched.scheduler_cls).startswith("fullband."):
        logger.info("fullband: prefix caching is off: scheduler_cls=%s is set, and a model with latent feedback "
                    "caches exactly only with fullband's scheduler (its blocks' keys and values depend on how their "
                    "positions were fed)", sched.scheduler_cls)
        vllm_config.cache_config.enable_prefix_caching = False
        return
    sched.scheduler_cls = "fullband.vllm.scheduler.scheduler"


def _no_full_cuda_graphs(vllm_config: VllmConfig) -> None:
    """Full CUDA graphs would freeze the step plan the forward builds on the host each step; piecewise graphs of
    the transformer stack (the compiled FeedbackStack) stay."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return
    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is None or mode.has_full_cudagraphs():
        logger.info("fullband: cudagraph_mode %s -> PIECEWISE (the fed-back state's step plan is built on the host)",
                    getattr(mode, "name", mode))
        vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
