"""Exact prefix caching for models with latent feedback, on vLLM's scheduler extension point (`scheduler_cls`,
set by the engine hook, fullband.vllm.engine, when prefix caching is on).

vLLM keys a cached KV block by a hash chained over the request's tokens block by block, with extra keys (LoRA,
multimodal items, the request's cache_salt). Here a block's keys and values also depend on how its positions were
read, so the scheduler gives each request a block hasher that adds fullband's keys (requests.block_keys) to
vLLM's own: the prompt's read on the first block, and on blocks holding fed positions which ones they are (the
state a block's last position feeds forward is the model's to keep: requests.block_keys)."""

from __future__ import annotations

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from fullband.vllm.engine import default_mode_of, model_config_of
from fullband.vllm.requests import block_keys, fed_runs, request_mode


class FeedbackCaching:
    """What the two schedulers below add to vLLM's: each request's block hasher."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        hf_config = self.vllm_config.model_config.hf_config
        cfg = model_config_of(hf_config)
        self._fb_default, self._fb_feedback, self._fb_max = default_mode_of(hf_config), cfg.has_feedback, cfg.max_seq_len
        self._fb_hash = get_hash_fn_by_name(self.cache_config.prefix_caching_hash_algo)

    def _hasher(self, mode, runs):
        size, hash_fn = self.hash_block_size, self._fb_hash

        def hasher(request) -> list:
            """vLLM's block hasher (kv_cache_utils.get_request_block_hasher, text only) plus fullband's keys."""
            start = len(request.block_hashes) * size
            parent = request.block_hashes[-1] if request.block_hashes else None
            out = []
            while start + size <= request.num_tokens:
                extra, _ = generate_block_hash_extra_keys(request, start, start + size, 0)
                keys = (*(extra or ()), *block_keys(mode, runs, start, start + size))
                parent = hash_block_tokens(hash_fn, parent, request.all_token_ids[start:start + size], keys or None)
                out.append(parent)
                start += size
            return out

        return hasher

    def add_request(self, request) -> None:
        if request.request_id not in self.requests:  # (a known id is a streaming session's next input)
            extra = getattr(request.sampling_params, "extra_args", None)
            mode = request_mode(extra, self._fb_default, has_feedback=self._fb_feedback, max_passes=self._fb_max)
            request._block_hasher = self._hasher(mode, fed_runs(mode, extra, request.num_prompt_tokens))
            del request.block_hashes[:]
            request.update_block_hashes()
        super().add_request(request)


class FeedbackScheduler(FeedbackCaching, Scheduler):
    """vLLM's Scheduler with fullband's block hashers."""


class FeedbackAsyncScheduler(FeedbackCaching, AsyncScheduler):
    """vLLM's AsyncScheduler with fullband's block hashers."""


def scheduler(*, vllm_config, **kwargs):
    """What vLLM's engine builds from `scheduler_cls` (it calls it with the scheduler's keywords): vLLM decides
    async scheduling after the engine hook has run, so the choice of base is made here."""
    cls = FeedbackAsyncScheduler if vllm_config.scheduler_config.async_scheduling else FeedbackScheduler
    return cls(vllm_config=vllm_config, **kwargs)
