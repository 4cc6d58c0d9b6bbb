"""fullband's request arguments checked at admission on vLLM's Model Runner V2, which loads logits processors of
its own interface only (V1's RequestTracker does the same check there): a bad mode is an HTTP 400 with fullband's
message. The processor changes no logits and keeps nothing: on V2 the requests' Reads and fed-back states live in
fullband.vllm.runner_v2's model state. Import-light, as V2 asks of what its frontend loads."""

from __future__ import annotations

from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor

from fullband.vllm.tracker import admit

CHECK = "fullband.vllm.admission:RequestCheck"


class RequestCheck(LogitsProcessor):
    """A V2 logits processor that only checks each request's fullband arguments when vLLM admits it."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        admit(sampling_params)

    def add_request(self, req_idx: int, sampling_params) -> bool:
        return False  # changes no request's logits

    def apply(self, logits, ctx):
        return logits
