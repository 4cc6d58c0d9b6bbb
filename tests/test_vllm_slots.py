"""The fed state by request index (fullband.vllm.plan.Slots / SlotBatch: what Model Runner V2's model state,
fullband.vllm.runner_v2, keeps), no vLLM import: admission and release, the gather and scatter of a step whose packed
order is not the index order, an index taken by a new request, and whole runs of chunked, batched steps, with a
request preempted and resumed and another taking a freed index, against `fullband.generate` and against each
request run alone on V1's layout (BatchRows). vLLM's own V2 base class is tested in tests/test_vllm.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from conftest import tiny_model
from fullband.decode.generate import generate
from fullband.model.mode import DecodeMode
from fullband.vllm.plan import BatchRows, Rows, Slots, plan_step, run_step
from fullband.vllm.requests import fed_runs

CPU = torch.device("cpu")
SOFT, STANDARD = DecodeMode("soft"), DecodeMode("standard")
CHUNK = 5  # a step's token budget per request: prompts arrive in chunks, FUSED ones included


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=4, init_std=0.1).eval()  # peaked logits: greedy tokens do not hinge on rounding


def runs(mode: DecodeMode, prompt, spans=()):
    return fed_runs(mode, {"fed_spans": [list(s) for s in spans]} if spans else None, len(prompt))


# ---------------------------------------------------------------------------------------------------- the bookkeeping
def test_admission_zeroes_the_row_and_release_frees_what_the_request_kept():
    slots = Slots(4, 8)
    slots.state[2] = 7.0  # a previous holder's state
    slots.admit("a", 2, DecodeMode("fused", 2), [5, 6, 7], runs(DecodeMode("fused", 2), [5, 6, 7]), "key")
    assert slots.index == {"a": 2} and not slots.state[2].any()
    assert slots.prompts[2] == [5, 6, 7] and slots.states_key[2] == "key" and slots.fresh[2] and slots.dense[2]
    slots.fused[2] = (torch.zeros(3, 8), torch.zeros(3, dtype=torch.bool))  # the prompt's kept passes
    slots.release("a")
    assert slots.index == {} and (slots.prompts[2], slots.fused[2], slots.states_key[2]) == (None, None, None)
    slots.release("a")  # twice (a preempted request V2 also finishes): nothing left to free


def test_a_step_gathers_and_scatters_by_request_index_not_by_packed_row():
    """Requests at indices 3, 0, 5 packed as 5, 3, 0: each packed row reads its own request's state, and each new
    state goes back to that request's index; the other indices keep theirs."""
    slots = Slots(6, 4)
    for name, index in (("a", 3), ("b", 0), ("c", 5)):
        slots.admit(name, index, SOFT, [1, 2], runs(SOFT, [1, 2]))
        slots.state[index] = float(index)
    slots.state[1] = -1.0  # a free index: untouched by the step
    assert slots.batch(["c", "a"], [5, 0]) is None  # not the admitted requests at those indices (a dummy run)
    batch = slots.batch(["c", "a", "b"], [5, 3, 0])
    assert batch.state()[:, 0].tolist() == [5.0, 3.0, 0.0]
    assert batch.rows.prompt_len.tolist() == [2, 2, 2] and batch.rows.batch_size == 3
    plan = plan_step(batch.rows, [0, 1, 3, 4], [2, 2, 2], None, None, CPU)
    new = torch.arange(4.0)[:, None].expand(4, 4) + 10  # packed rows' new states: 10, 11, 12, 13
    batch.write(plan, new)  # the last rows: 0 (c), 2 (a), 3 (b)
    assert slots.state[:, 0].tolist() == [13.0, -1.0, 0.0, 12.0, 0.0, 10.0]
    assert not slots.fresh[[0, 3, 5]].any()


def test_a_freed_index_taken_by_a_new_request_reads_nothing_of_the_last_one():
    slots = Slots(2, 4)
    slots.admit("old", 1, SOFT, [1, 2, 3], runs(SOFT, [1, 2, 3]), "k")
    slots.state[1] = 9.0
    slots.release("old")
    slots.admit("new", 1, STANDARD, [4], runs(STANDARD, [4]))
    assert not slots.state[1].any() and slots.states_key[1] is None and not slots.keeps_states[1]
    assert slots.batch(["old"], [1]) is None and slots.batch(["new"], [1]) is not None


# ---------------------------------------------------------------------------------------------------- whole runs
@dataclass
class Req:
    name: str
    mode: DecodeMode
    prompt: list[int]
    max_tokens: int
    spans: tuple = ()
    tokens: list[int] = field(default_factory=list)  # the prompt and what was generated
    done: int = 0  # positions computed (0 again after a preemption: recomputed)
    tops: dict = field(default_factory=dict)  # position -> the final-norm output computed there (the latest)

    def __post_init__(self):
        self.tokens = list(self.prompt)

    @property
    def finished(self) -> bool:
        return len(self.tokens) - len(self.prompt) >= self.max_tokens


def step(model, reqs: list[Req], batch, memory: dict) -> None:
    """One engine step over `reqs` in packed order, read and written through `batch` (SlotBatch or BatchRows: row
    i is reqs[i]) as the served model's forward does. Each request's stack inputs so far (`memory`) stand in for
    its KV cache: the stack is causal, so a position's keys and values are a function of the inputs up to it."""
    ends = [min(r.done + CHUNK, len(r.tokens)) for r in reqs]
    qsl = np.concatenate([[0], np.cumsum([e - r.done for r, e in zip(reqs, ends)])]).tolist()
    ids = np.concatenate([r.tokens[r.done:e] for r, e in zip(reqs, ends)])
    plan = plan_step(batch.rows, qsl, [r.done for r in reqs], ids, model.config.bos_token_id, CPU)
    inputs = []

    def stack(x):
        inputs.append(x)
        outs = [model.stack(torch.cat([memory[r.name], x[a:b]])[None]) for r, a, b in zip(reqs, qsl, qsl[1:])]
        return (torch.cat([s[0, -(b - a):] for (s, _), a, b in zip(outs, qsl, qsl[1:])]),
                torch.cat([t[0, -(b - a):] for (_, t), a, b in zip(outs, qsl, qsl[1:])]))

    with torch.no_grad():
        new, top = run_step(plan, model, stack, model.embed_inputs(torch.from_numpy(ids)), batch.state(), batch.rows)
        batch.write(plan, new)
        for r, a, b, end in zip(reqs, qsl, qsl[1:], ends):
            memory[r.name] = torch.cat([memory[r.name], inputs[-1][a:b]])  # the last pass's keys and values
            r.tops.update({r.done + j: top[a + j] for j in range(b - a)})
            r.done = end
            if end == len(r.tokens) and not r.finished:
                r.tokens.append(int(model.head(top[b - 1]).argmax()))


def solo(model, req: Req) -> Req:
    """`req` alone on V1's layout: one batch row, the model's state buffer (BatchRows)."""
    D = model.config.d_model
    rows, state, memory = Rows(1), torch.zeros(1, D), {req.name: torch.zeros(0, D)}
    rows.add(0, req.mode, req.prompt, runs(req.mode, req.prompt, req.spans))
    rows.batch_size = 1
    while not (req.finished and req.done == len(req.tokens)):
        step(model, [req], BatchRows(rows, state), memory)
    return req


def requests():
    g = torch.Generator().manual_seed(9)
    prompt = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (13, 9, 7, 11, 6)]
    return [Req("soft", SOFT, prompt[0], 8), Req("fused2", DecodeMode("fused", 2), prompt[1], 8),
            Req("standard", STANDARD, prompt[2], 4), Req("spans", SOFT, prompt[3], 7, spans=((2, 6), (8, 10))),
            Req("late", DecodeMode("fused", 1), prompt[4], 6)]


def reference(model, req: Req) -> list[int]:
    passes = req.mode.prefill_passes if req.mode.name == "fused" else None
    return generate(model, [req.prompt], req.max_tokens, mode=req.mode.name, prefill_passes=passes,
                    fed=[[list(s) for s in req.spans]] if req.spans else None)[0]


def test_steps_by_request_index_equal_fullband_generate_and_each_request_alone(model):
    """Four requests admitted at scattered indices of 6, packed in a new order every step, prompts in chunks of 5;
    at step 4 "soft" is preempted (its index freed) and resumed 2 steps later at another index, recomputing its
    prompt and the tokens it had generated; "standard" finishes first and "late" takes its index. Every request's
    tokens equal fullband.generate's, and its top at every position the same request's run alone on V1's layout
    (float tolerance: the batches differ)."""
    slots, memory = Slots(6, model.config.d_model), {}
    soft, fused2, standard, spans, late = reqs = requests()
    running: list[Req] = []
    g = np.random.default_rng(0)

    def admit(req, index):
        slots.admit(req.name, index, req.mode, req.prompt, runs(req.mode, req.prompt, req.spans))
        memory[req.name], req.done = torch.zeros(0, model.config.d_model), 0
        running.append(req)

    for req, index in ((soft, 4), (fused2, 1), (standard, 5), (spans, 0)):
        admit(req, index)
    for n in range(60):
        if n == 4:  # preempted: freed, forgotten; its tokens so far stay the request's
            slots.release("soft")
            running.remove(soft)
        if n == 6:
            admit(soft, 2)
        for req in [r for r in running if r.finished and r.done == len(r.tokens)]:
            slots.release(req.name)
            running.remove(req)
            if req is standard:
                admit(late, 5)  # the finished request's index
        if not running:
            break
        order = [running[i] for i in g.permutation(len(running))]
        step(model, order, slots.batch([r.name for r in order], [slots.index[r.name] for r in order]), memory)
    assert not running and standard.finished and late.tokens[len(late.prompt):]
    for req in reqs:
        assert req.tokens[len(req.prompt):] == reference(model, req), req.name
        alone = solo(model, Req(req.name, req.mode, req.prompt, req.max_tokens, req.spans))
        assert alone.tokens == req.tokens, req.name
        for pos, top in alone.tops.items():
            assert torch.allclose(req.tops[pos], top, atol=1e-5), (req.name, pos)


def test_a_soft_run_by_request_index_reads_as_the_native_model(model):
    """The tops of a SOFT request decoded in steps beside another equal FeedbackModel.read of its whole sequence
    with the generated positions fed (and its fed spans)."""
    slots, memory = Slots(3, model.config.d_model), {}
    reqs = [r for r in requests() if r.name in ("spans", "fused2")]
    for req, index in zip(reqs, (2, 0)):
        slots.admit(req.name, index, req.mode, req.prompt, runs(req.mode, req.prompt, req.spans))
        memory[req.name] = torch.zeros(0, model.config.d_model)
    while not all(r.finished and r.done == len(r.tokens) for r in reqs):
        live = [r for r in reqs if not (r.finished and r.done == len(r.tokens))][::-1]
        step(model, live, slots.batch([r.name for r in live], [slots.index[r.name] for r in live]), memory)
    req = next(r for r in reqs if r.name == "spans")
    T, P = len(req.tokens) - 1, len(req.prompt)  # the last token was sampled, not computed
    fed = torch.zeros(1, T, dtype=torch.bool)
    fed[0, P:] = True
    for a, b in req.spans:
        fed[0, a:b] = True
    with torch.no_grad():
        want = model.read(torch.tensor([req.tokens[:T]]), SOFT, fed=fed)
    assert torch.allclose(torch.stack([req.tops[t] for t in range(T)]), want.top[0], atol=1e-5)


def test_a_fused_prompt_in_chunks_keeps_its_passes_at_its_index_between_steps(model):
    """The kept passes a FUSED prompt's first chunk computes go back to the request's index with the step, are
    read by its next chunk there, and are dropped after its last (SlotBatch.write)."""
    slots = Slots(3, model.config.d_model)
    req = Req("f", DecodeMode("fused", 2), requests()[1].prompt, 2)
    slots.admit("f", 2, req.mode, req.prompt, runs(req.mode, req.prompt))
    memory = {"f": torch.zeros(0, model.config.d_model)}
    step(model, [req], slots.batch(["f"], [2]), memory)
    kept = slots.fused[2]
    assert req.done == CHUNK and kept is not None and slots.fused[0] is None
    batch = slots.batch(["f"], [2])
    assert batch.rows.fused[0] is kept  # the next chunk reads them, not recomputes them
    step(model, [req], batch, memory)
    assert req.done == len(req.prompt) and slots.fused[2] is None
