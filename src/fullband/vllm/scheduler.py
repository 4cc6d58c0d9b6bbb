"""Exact prefix caching for models with latent feedback, on vLLM's scheduler extension point (`scheduler_cls`,
set by the engine hook, fullband.vllm.engine, when prefix caching is on).

vLLM keys a cached KV block by a hash chained over the request's tokens block by block, with extra keys (LoRA,
multimodal items, the request's cache_salt). Here a block's keys and values also depend on how its positions were
read, so the scheduler gives each request a block hasher that adds fullband's keys (requests.block_keys) to
vLLM's own: the prompt's read on the first block, and on blocks holding fed generated positions a key no other
request has. A preempted request drops the fed states those blocks were computed with, so its hashes from the
first fed block on are recomputed under a new epoch: it recomputes them (fed again, as the model does after
preemption) instead of reading blocks whose next position it could not feed."""

from __future__ import annotations

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from fullband.vllm.engine import default_mode_of, model_config_of
from fullband.vllm.requests import block_keys, request_mode


class FeedbackCaching:
    """What the two schedulers below add to vLLM's: each request's block hasher, and its reset on preemption."""

    def _init_feedback(self) -> None:
        hf_config = self.vllm_config.model_config.hf_config
        cfg = model_config_of(hf_config)
        self._fb_default, self._fb_feedback, self._fb_max = default_mode_of(hf_config), cfg.has_feedback, cfg.max_seq_len
        self._fb_hash = get_hash_fn_by_name(self.cache_config.prefix_caching_hash_algo)

    def _mode(self, request):
        extra = getattr(request.sampling_params, "extra_args", None)
        return request_mode(extra, self._fb_default, has_feedback=self._fb_feedback, max_passes=self._fb_max)

    def _hasher(self, mode):
        size, hash_fn = self.hash_block_size, self._fb_hash

        def hasher(request) -> list:
            """vLLM's block hasher (kv_cache_utils.get_request_block_hasher, text only) plus fullband's keys."""
            start = len(request.block_hashes) * size
            parent = request.block_hashes[-1] if request.block_hashes else None
            epoch = f"{request.request_id}/{request.num_preemptions}"
            out = []
            while start + size <= request.num_tokens:
                extra, _ = generate_block_hash_extra_keys(request, start, start + size, 0)
                ours = block_keys(mode, request.num_prompt_tokens, start, start + size, epoch)
                keys = (*(extra or ()), *ours)
                parent = hash_block_tokens(hash_fn, parent, request.all_token_ids[start:start + size], keys or None)
                out.append(parent)
                start += size
            return out

        return hasher

    def _rehash(self, request, keep: int) -> None:
        del request.block_hashes[keep:]
        request.update_block_hashes()

    def add_request(self, request) -> None:
        if request.request_id not in self.requests:  # (a known id is a streaming session's next input)
            request._block_hasher = self._hasher(self._mode(request))
            self._rehash(request, 0)
        super().add_request(request)

    def _preempt_request(self, request, timestamp: float, drop_stale_output: bool = False) -> None:
        super()._preempt_request(request, timestamp, drop_stale_output)
        if self._mode(request).feeds_state and request._block_hasher is not None:
            self._rehash(request, request.num_prompt_tokens // self.hash_block_size)  # every block with fed positions


class FeedbackScheduler(FeedbackCaching, Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_feedback()


class FeedbackAsyncScheduler(FeedbackCaching, AsyncScheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_feedback()


def scheduler(*, vllm_config, **kwargs):
    """What vLLM's engine builds from `scheduler_cls` (it calls it with the scheduler's keywords): vLLM decides
    async scheduling after the engine hook has run, so the choice of base is made here."""
    cls = FeedbackAsyncScheduler if vllm_config.scheduler_config.async_scheduling else FeedbackScheduler
    return cls(vllm_config=vllm_config, **kwargs)
