"""The fed-back state on vLLM's Model Runner V2 (docs/vllm-v2.md): a per-model state (V2's ModelState, returned by
FullbandForCausalLM.get_model_state_cls) that keeps each request's Read and latest state at V2's request index,
which is the request's for its whole life, so nothing follows rows about (V1's RequestTracker does).

V2 calls `add_request` when a request enters (new, resumed after preemption, or a streaming session's next input:
each reads its prompt again, with a zeroed state), `remove_request` when it finishes, is aborted or is preempted,
and `prepare_inputs` before each forward, whose result goes to the model's forward as keyword arguments: here
`fullband_batch`, this step's requests in packed order (fullband.vllm.plan.SlotBatch). The forward gathers their
states, runs the step plan (the same as on V1) and scatters the new states back. Imported only by V2."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.v1.worker.gpu.model_states.default import DefaultModelState

from fullband.vllm.engine import model_config_of
from fullband.vllm.plan import Slots
from fullband.vllm.tracker import SERVED, request_rows


class FeedbackModelState(DefaultModelState):
    """vLLM's default model state (positions, prompt embeddings) and fullband's requests (`slots`)."""

    def __init__(self, vllm_config: VllmConfig, model: nn.Module, encoder_cache, device: torch.device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        cfg = model_config_of(self.model_config.hf_config)
        self.slots = Slots(self.max_num_reqs, cfg.d_model, dtype=self.dtype, device=device)
        SERVED.tracker = None  # a V1 engine's tracker earlier in this process must not steer V2's dummy runs

    def add_request(self, req_index: int, new_req_data) -> None:
        super().add_request(req_index, new_req_data)
        # the prompt alone: a resumed request's outputs are generated runs
        self.slots.admit(new_req_data.req_id, req_index,
                         *request_rows(new_req_data.sampling_params, new_req_data.prompt_token_ids))

    def remove_request(self, req_id: str) -> None:
        super().remove_request(req_id)
        self.slots.release(req_id)

    def prepare_inputs(self, input_batch, req_states) -> dict[str, Any]:
        inputs = super().prepare_inputs(input_batch, req_states)
        batch = self.slots.batch(input_batch.req_ids, input_batch.idx_mapping_np, input_batch.idx_mapping)
        if batch is not None:  # None: a dummy run, which keeps no state
            inputs["fullband_batch"] = batch
        return inputs
