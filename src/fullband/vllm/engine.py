"""Engine rules for fullband folders, run when vLLM builds its config (registered by fullband.vllm.register):
what is refused, what is turned off and why, which model runner keeps the fed-back state (model_runner), and the
logits processor that follows the requests (V1's request tracker) or checks them (on Model Runner V2)."""

from __future__ import annotations

import importlib.util
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
        if getattr(vllm_config.parallel_config, "prefill_context_parallel_size", 1) > 1:
            raise ConfigError("prefill_context_parallel_size > 1 is not supported with latent feedback: it splits a "
                              "prompt's positions over ranks, and each fed position reads the one before it")
        v2 = model_runner(vllm_config)
        _no_full_cuda_graphs(vllm_config)
        from fullband.vllm.tracker import SERVED, TRACKER

        SERVED.configure(has_feedback=cfg.has_feedback, default=default, max_passes=cfg.max_seq_len)
        if v2:  # the requests' Reads live in the model state (fullband.vllm.runner_v2); admission is checked here
            from fullband.vllm.admission import CHECK

            ours, other = CHECK, TRACKER
        else:
            ours, other = TRACKER, "fullband.vllm.admission:RequestCheck"
        procs = [p for p in vllm_config.model_config.logits_processors or [] if p != other]
        vllm_config.model_config.logits_processors = procs if ours in procs else [*procs, ours]


V2_STATES = "vllm.v1.worker.gpu.model_states"  # Model Runner V2's per-model states (vLLM >= 0.32)


def model_runner(vllm_config: VllmConfig) -> bool:
    """Whether the fed-back state lives on Model Runner V2 (fullband.vllm.runner_v2: a model state indexed by V2's
    request index) rather than in V1's persistent batch (fullband.vllm.tracker). V2 where this vLLM has it, the
    platform is CUDA (V2 needs Triton: vLLM's CPU build runs V1) and V2 is asked for (VLLM_USE_V2_MODEL_RUNNER=1)
    or is vLLM's default; V1 otherwise. Chosen before the workers start (they read the variable), said once."""
    from vllm import envs
    from vllm.platforms import current_platform

    asked = envs.VLLM_USE_V2_MODEL_RUNNER
    if importlib.util.find_spec(V2_STATES) is None:
        v2, why = False, "this vLLM has no Model Runner V2 model states"
    elif not current_platform.is_cuda():
        v2, why = False, (f"on {current_platform.device_type}: fullband runs Model Runner V2 on CUDA only, and V2 "
                          "needs Triton, which vLLM's CPU build lacks")
    elif asked is not None:
        v2, why = bool(asked), f"VLLM_USE_V2_MODEL_RUNNER={int(asked)}"
    else:
        v2, why = vllm_config.use_v2_model_runner, "vLLM's default here"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if v2 else "0"
    if vllm_config.use_v2_model_runner != v2:  # vLLM overrides the variable (watermarking, HiSparse need V2)
        v2, why = not v2, "vLLM requires it for this configuration"
    where = "a model state by request index" if v2 else "its persistent batch"
    logger.info_once("fullband: model runner %s (%s; the fed-back state lives in %s: docs/vllm-v2.md)",
                     "V2" if v2 else "V1", why, where)
    return v2


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
