"""Each generated token's fed state out of vLLM (`generate_with_states`), for on-policy post-training that replays
or checks them (fullband.rl.logprob's `replay` reads the same states from the native engine).

A request asks with its key under `fullband_states` (SamplingParams.extra_args); the worker keeps, for each token
it samples for that request, the state that token reads back at its own position (the top state of the position
whose logits sampled it), in the tracker's shared object. `StatesWorker` is mixed into vLLM's workers (the
engine hook sets parallel_config.worker_extension_cls): `LLM.collective_rpc("fullband_states", ...)` hands the
kept states over and forgets them. Offline API only: the frontend admits only the keys generate_with_states hands
out in its own process (fullband.vllm.tracker), and it collects them whatever becomes of its requests, so a
server, which hands out none, keeps no states."""

from __future__ import annotations

import contextlib
import copy
import uuid
from collections.abc import Sequence

import torch

from fullband.errors import InputError
from fullband.vllm.plan import Slots
from fullband.vllm.requests import STATES
from fullband.vllm.tracker import SERVED

WORKER_EXTENSION = "fullband.vllm.states.StatesWorker"


class StatesWorker:
    """Mixed into each vLLM worker: hands over (and forgets) the states kept under the given keys."""

    def fullband_states(self, keys: Sequence[str]) -> dict[str, tuple[list[int], bytes, str, int]]:
        """key -> (positions, the states as raw bytes in position order, their dtype, D): plain values, which vLLM's
        RPC carries as they are (tensors would arrive as nested lists)."""
        out = {}
        for key in keys:
            kept = SERVED.kept_states.pop(key, {})
            pos = sorted(kept)
            rows = torch.stack([kept[p] for p in pos]) if pos else torch.zeros(0, 0)
            out[key] = (pos, rows.contiguous().view(torch.uint8).numpy().tobytes(), str(rows.dtype).split(".")[-1],
                        rows.shape[-1])
        return out

    def fullband_runner(self) -> str:
        """The model runner this worker runs the model on: "V2" where fullband's model state keeps the fed-back
        states (fullband.vllm.runner_v2), "V1" where the request tracker does."""
        state = getattr(self.model_runner, "model_state", None)  # V2's runner has one; V1's none
        if state is None:
            return "V1"
        if isinstance(getattr(state, "slots", None), Slots):  # fullband.vllm.runner_v2's
            return "V2"
        return f"V2 without fullband's state ({type(state).__name__})"

    def fullband_states_kept(self) -> int:
        """How many requests' fed states this worker keeps, not yet handed over (0 whenever no
        generate_with_states call is running)."""
        return len(SERVED.kept_states)


def generate_with_states(llm, prompts: Sequence, sampling_params) -> tuple[list, list[torch.Tensor]]:
    """`llm.generate(prompts, sampling_params)` (one SamplingParams, or one per prompt) and, for each request, the
    fed state each generated token read: a (tokens generated, D) tensor in the model's dtype, row j the state token
    j of the output read at its position (equal to fullband.rl.logprob.rollout's states for the same tokens). Every
    request must feed states (SOFT or FUSED) and sample one output (n = 1)."""
    params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
    if len(params) != len(prompts):
        raise InputError(f"{len(params)} sampling params for {len(prompts)} prompts; accepted: one, or one per prompt")
    keys, asked = [], []
    for sp in params:
        if sp.n != 1:
            raise InputError(f"n={sp.n}: fed states are returned for one output per request; accepted: n = 1 (send "
                             "the prompt several times instead)")
        sp = copy.copy(sp)
        keys.append(uuid.uuid4().hex)
        sp.extra_args = {**(sp.extra_args or {}), STATES: keys[-1]}
        asked.append(sp)
    if llm.llm_engine.vllm_config.parallel_config.worker_extension_cls != WORKER_EXTENSION:
        raise InputError("this engine's workers cannot hand over fed states: parallel_config.worker_extension_cls is "
                         f"{llm.llm_engine.vllm_config.parallel_config.worker_extension_cls!r}; accepted: unset (the "
                         f"fullband plugin sets {WORKER_EXTENSION!r})")
    SERVED.issued.update(keys)  # the frontend admits these keys, and no others (fullband.vllm.tracker)
    try:
        outputs = llm.generate(prompts, asked, use_tqdm=False)
    except BaseException:
        with contextlib.suppress(Exception):  # free what the requests kept before they failed
            llm.collective_rpc("fullband_states", args=(keys,))
        raise
    finally:
        SERVED.issued.difference_update(keys)
    kept = llm.collective_rpc("fullband_states", args=(keys,))[0]  # every rank keeps the same states
    states = []
    for out, key in zip(outputs, keys):
        pos, raw, dtype, width = kept[key]
        rows = torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).view(-1, width) if pos else None
        by_pos = {p: rows[i] for i, p in enumerate(pos)}
        first = len(out.prompt_token_ids) - 1
        n = len(out.outputs[0].token_ids)
        missing = [first + j for j in range(n) if first + j not in by_pos]
        if missing:
            raise RuntimeError(f"request {out.request_id}: no state kept at positions {missing[:4]}")
        states.append(torch.stack([by_pos[first + j] for j in range(n)]) if n else torch.zeros(0))
    return outputs, states
