"""The per-request side of fullband's vLLM model, on vLLM's hook for per-request arguments: a logits processor
(it changes no logits) that

  * checks each request's mode when vLLM admits it (`validate_params`, run by the frontend: a bad mode is an
    HTTP 400 with our message and never reaches the engine), and
  * follows vLLM's persistent batch in the worker (`update_state`: requests added with their SamplingParams and
    prompt, removed, moved between rows), keeping each row's mode, prompt length, fed prompt spans and (FUSED)
    prompt tokens and kept passes, and moving the rows of the model's fed-back state buffer with them.

vLLM builds the processor itself from its name (TRACKER), so what it shares with the served model in a process
lives in one object, SERVED: the folder's rules (set by the engine hook and the model), the worker's tracker and
the model's state buffer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor, MoveDirectionality

from fullband.errors import InputError
from fullband.model.mode import DecodeMode
from fullband.vllm.requests import MAX_PASSES, STATES, fed_runs, request_mode

TRACKER = "fullband.vllm.tracker:RequestTracker"
STANDARD, SOFT, FUSED = 0, 1, 2
CODES = {"standard": STANDARD, "soft": SOFT, "fused": FUSED}


@dataclass
class Served:
    """What the served model and the request tracker of one process share."""

    has_feedback: bool = True  # the folder's rules: set by the engine hook (frontend) and the model (worker)
    default: DecodeMode = field(default_factory=lambda: DecodeMode("soft"))
    max_passes: int = MAX_PASSES
    tracker: RequestTracker | None = None  # the worker's tracker, read by the model's forward
    state: torch.Tensor | None = None  # the model's fed-back states, one row per batch row (set by the model)
    # requests' fed states by their fullband_states key: {position: the state read by the token sampled there}
    kept_states: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    # the fullband_states keys generate_with_states handed out in this process and has not collected yet (the
    # frontend admits no other: nothing is kept that no one collects)
    issued: set[str] = field(default_factory=set)

    def configure(self, *, has_feedback: bool, default: DecodeMode, max_passes: int) -> None:
        self.has_feedback, self.default, self.max_passes = has_feedback, default, max_passes

    def mode_of(self, sampling_params, *, admit: bool = False) -> DecodeMode:
        """A request's decode mode; `admit`: as the frontend admits it (a fullband_states key only where this process
        issued it)."""
        extra = getattr(sampling_params, "extra_args", None)
        return request_mode(extra, self.default, has_feedback=self.has_feedback, max_passes=self.max_passes,
                            issued=self.issued if admit else None)


SERVED = Served()


class RequestTracker(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params) -> None:
        try:
            SERVED.mode_of(sampling_params, admit=True)
        except InputError as err:
            raise ValueError(str(err)) from None

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        n = vllm_config.scheduler_config.max_num_seqs
        self.mode = np.zeros(n, dtype=np.int64)
        self.passes = np.ones(n, dtype=np.int64)
        self.prompt_len = np.zeros(n, dtype=np.int64)
        self.prompts: list[list[int] | None] = [None] * n
        self.fused: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n  # a FUSED prompt's kept passes
        self.states_key: list[str | None] = [None] * n  # where a row's fed states go (SERVED.kept_states)
        self.keeps_states = np.zeros(n, dtype=bool)  # the rows that have a states_key (read every step)
        self.fed: list[tuple[tuple[int, int], ...]] = [()] * n  # prompt spans read fed (a SOFT request's fed_spans)
        self.has_fed = np.zeros(n, dtype=bool)
        self.fresh = np.zeros(n, dtype=bool)  # added since its last step: its state row holds nothing of its own
        self.batch_size = 0
        SERVED.tracker = self

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self.batch_size = batch_update.batch_size
        for index in batch_update.removed:  # what a finished or aborted request kept goes with it
            self.prompts[index], self.fused[index], self.states_key[index] = None, None, None
            self.keeps_states[index] = False
        for index, params, prompt, _ in batch_update.added:
            mode = SERVED.mode_of(params)  # admitted by validate_params, so this cannot fail
            self.mode[index] = CODES[mode.name]
            self.passes[index] = mode.passes
            self.prompt_len[index] = len(prompt or ())
            self.prompts[index] = list(prompt) if mode.name == "fused" and mode.passes > 1 else None
            self.fused[index] = None
            self.states_key[index] = (getattr(params, "extra_args", None) or {}).get(STATES)
            self.keeps_states[index] = self.states_key[index] is not None
            runs = fed_runs(mode, getattr(params, "extra_args", None), self.prompt_len[index])
            self.fed[index] = tuple(run for run in runs if run[0] < self.prompt_len[index])  # the prompt's
            self.has_fed[index] = bool(self.fed[index])
            self.fresh[index] = True
        for a, b, direction in batch_update.moved:
            rows = [a, b] if direction == MoveDirectionality.SWAP else [a]
            to = [b, a] if direction == MoveDirectionality.SWAP else [b]
            for arr in (self.mode, self.passes, self.prompt_len, self.keeps_states, self.has_fed, self.fresh):
                arr[to] = arr[rows]
            moving = [(self.prompts[r], self.fused[r], self.states_key[r], self.fed[r]) for r in rows]
            for r, (p, f, k, fed) in zip(to, moving):
                self.prompts[r], self.fused[r], self.states_key[r], self.fed[r] = p, f, k, fed
            if SERVED.state is not None:
                SERVED.state[to] = SERVED.state[rows]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
