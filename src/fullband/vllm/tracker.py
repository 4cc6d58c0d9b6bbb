"""The per-request side of fullband's vLLM model on the V1 model runner (on Model Runner V2 the model's own state
keeps it: fullband.vllm.runner_v2), on vLLM's hook for per-request arguments: a logits processor (it changes no
logits) that

  * checks each request's mode when vLLM admits it (`validate_params`, run by the frontend: a bad mode is an
    HTTP 400 with our message and never reaches the engine), and
  * follows vLLM's persistent batch in the worker (`update_state`: requests added with their SamplingParams and
    prompt, removed, moved between rows), keeping each row's Read (fullband.vllm.plan.Rows: passes, prompt
    length, fed prompt spans, a FUSED prompt's tokens and kept passes), and moving the rows of the model's fed-back
    state buffer with them.

vLLM builds the processor itself from its name (TRACKER), so what it shares with the served model in a process
lives in one object, SERVED: the folder's rules (set by the engine hook and the model), the worker's tracker and
the model's state buffer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor, MoveDirectionality

from fullband.errors import InputError
from fullband.model.mode import DecodeMode
from fullband.vllm.plan import Rows
from fullband.vllm.requests import MAX_PASSES, STATES, fed_runs, request_mode

TRACKER = "fullband.vllm.tracker:RequestTracker"


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


def admit(sampling_params) -> None:
    """A request's arguments as the frontend admits them (a logits processor's validate_params: RequestTracker's on
    V1, fullband.vllm.admission's on Model Runner V2): ValueError with fullband's message, an HTTP 400."""
    try:
        SERVED.mode_of(sampling_params, admit=True)
    except InputError as err:
        raise ValueError(str(err)) from None


def request_rows(params, prompt) -> tuple:
    """An admitted request's Rows.add arguments after its row: (mode, prompt, fed runs, fullband_states key), read
    from its SamplingParams' extra args (admitted already, so this cannot fail)."""
    mode = SERVED.mode_of(params)
    extra = getattr(params, "extra_args", None) or {}
    return mode, prompt, fed_runs(mode, extra, len(prompt or ())), extra.get(STATES)


class RequestTracker(LogitsProcessor, Rows):
    """vLLM's view of the batch rows (a logits processor that changes no logits) kept as the step plan reads them."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        admit(sampling_params)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        Rows.__init__(self, vllm_config.scheduler_config.max_num_seqs)
        SERVED.tracker = self

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self.batch_size = batch_update.batch_size
        for index in batch_update.removed:
            self.remove(index)
        for index, params, prompt, _ in batch_update.added:
            self.add(index, *request_rows(params, prompt))
        for a, b, direction in batch_update.moved:
            rows, to = ([a, b], [b, a]) if direction == MoveDirectionality.SWAP else ([a], [b])
            self.move(rows, to)
            if SERVED.state is not None:
                SERVED.state[to] = SERVED.state[rows]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
