"""vLLM's step plan (fullband.vllm.plan, no vLLM import) against the native model's reading of each request
(FeedbackModel.read): the rows a step feeds, its passes and what it computes, for fed spans, FUSED prompts (whole
and in chunks), chain links through the prefix cache. A drift of the method's rules between the runtimes shows
here in seconds, not in the slow vLLM suite."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_model
from fullband.model.mode import DecodeMode
from fullband.vllm.plan import Blocks, Rows, plan_step, run_step
from fullband.vllm.requests import fed_runs

CPU = torch.device("cpu")
SOFT = DecodeMode("soft")
# (mode, prompt length, fed spans): every way a request reads its prompt
REQUESTS = [(SOFT, 12, [(3, 6), (8, 10)]), (DecodeMode("fused", 2), 10, []), (DecodeMode("standard"), 7, []),
            (SOFT, 9, []), (DecodeMode("fused", 5), 4, []), (DecodeMode("fused", 0), 6, []), (SOFT, 11, [(1, 11)])]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3).eval()


def admitted(requests, prompts) -> Rows:
    """Rows as the tracker admits the requests (their Read)."""
    rows = Rows(len(requests))
    for i, ((mode, n, spans), prompt) in enumerate(zip(requests, prompts)):
        rows.add(i, mode, prompt, fed_runs(mode, {"fed_spans": spans} if spans else None, n))
    return rows


def packed_stack(model, qsl):
    """The native stack over packed rows whose chunks each start at position 0: one sequence per request."""
    def stack(x):
        outs = [model.stack(x[None, a:b]) for a, b in zip(qsl, qsl[1:])]
        return torch.cat([s[0] for s, _ in outs]), torch.cat([t[0] for _, t in outs])
    return stack


def prompts_of(requests, model, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(0, 256, (n,), generator=g).tolist() for _, n, _ in requests]
    out[0][4] = out[1][5] = model.config.bos_token_id  # a document starts mid-prompt: plain, whatever the mode
    return out


def test_a_packed_prefill_step_reads_every_prompt_as_the_native_model(model):
    prompts = prompts_of(REQUESTS, model)
    rows = admitted(REQUESTS, prompts)
    qsl = np.concatenate([[0], np.cumsum([len(p) for p in prompts])]).tolist()
    ids = np.concatenate([np.asarray(p) for p in prompts])
    plan = plan_step(rows, qsl, [0] * len(prompts), ids, model.config.bos_token_id, CPU)
    plain = torch.cat([model.embed_inputs(torch.tensor([p]))[0] for p in prompts])
    with torch.no_grad():
        state, top = run_step(plan, model, packed_stack(model, qsl), plain, torch.zeros(len(prompts), 64), rows)
    assert [job.passes for job in plan.dense] == [3, 4]  # FUSED k=2; k=5 over 4 tokens: capped at the fixed point
    for i, ((mode, n, spans), prompt) in enumerate(zip(REQUESTS, prompts)):
        fed = torch.zeros(1, n, dtype=torch.bool)
        for a, b in spans:
            fed[0, a:b] = True
        read = mode.read(n, int(fed.sum()), fixed_point=model.exact_passes(n))
        assert rows.passes[i] == read.passes and 1 + plan.iterate >= (1 if rows.dense[i] else read.passes)
        with torch.no_grad():
            want = model.read(torch.tensor([prompt]), mode, fed=fed if spans else None)
        rows_i = slice(qsl[i], qsl[i + 1])
        assert torch.allclose(top[rows_i], want.top[0], atol=1e-5), (i, mode.label)
        assert torch.allclose(state[rows_i], want.hidden[0], atol=1e-5), (i, mode.label)
    # the rows fed in the step's last pass are the positions the native read feeds
    feeds = plan.token_feed.tolist()
    assert feeds[qsl[0]:qsl[1]] == [t in (3, 5, 8, 9) for t in range(12)]  # the spans but the BOS at 4
    assert not any(feeds[qsl[2]:qsl[4]]) and not any(feeds[qsl[5]:qsl[6]])  # plain prompts (and fused:0's)
    assert [(job.first_row, job.rows) for job in plan.dense] == [(qsl[1], 10), (qsl[4], 4)]  # fed by the job


def test_a_fused_prompt_in_chunks_runs_its_passes_once_and_drops_them_after(model):
    requests = [(DecodeMode("fused", 2), 10, [])]
    prompts = [torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(5)).tolist()]
    rows = admitted(requests, prompts)
    first = plan_step(rows, [0, 4], [0], np.asarray(prompts[0][:4]), model.config.bos_token_id, CPU)
    [job] = first.dense
    assert (job.passes, job.start, job.rows, job.last) == (3, 0, 4, False)
    plain = model.embed_inputs(torch.tensor([prompts[0][:4]]))[0]
    with torch.no_grad():
        _, top = run_step(first, model, packed_stack(model, [0, 4]), plain, torch.zeros(1, 64), rows)
        want = model.read(torch.tensor(prompts), DecodeMode("fused", 2))
    assert torch.allclose(top, want.top[0, :4], atol=1e-5)  # causal: the chunk is the prompt's first 4 positions
    assert rows.fused[0] is not None  # kept for the next chunk
    second = plan_step(rows, [0, 6], [4], np.asarray(prompts[0][4:]), model.config.bos_token_id, CPU)
    [job] = second.dense
    assert (job.passes, job.start, job.first_row, job.rows, job.last) == (3, 4, 0, 6, True)
    prev, feed = torch.zeros(6, 64), torch.zeros(6, dtype=torch.bool)
    from fullband.vllm.plan import _dense_prefill

    _dense_prefill(job, model, rows, prev, feed)
    assert rows.fused[0] is None and bool(feed.all())  # dropped after the last chunk; every position fed
    with torch.no_grad():  # pass 3's inputs read pass 2's states, shifted by one
        two = model.read(torch.tensor(prompts), DecodeMode("fused", 1))
    assert torch.allclose(prev, two.hidden[0, 3:9], atol=1e-5)


def test_a_cached_block_s_state_comes_from_the_store_or_this_step():
    """The step plan for a request B that read blocks 3 and 4 from the cache and starts at position 64, fed (a
    span 44..69): alone, its state row takes block 4's kept state; beside request A, which computes those blocks
    in the same step (vLLM caches a block when its last token is scheduled), its first row reads A's row of
    position 63, and the chain's passes add up across the two requests."""
    def rows(n):
        return admitted([(SOFT, 72, [(44, 70)])] * n, [[1] * 72] * n)

    def slots(blocks, positions):
        return np.array([blocks[p // 32] * 32 + p % 32 for p in positions])

    tables = {"A": [3, 4, 5], "B": [3, 4, 6]}
    alone = plan_step(rows(1), [0, 8], [64], None, None, CPU,
                      Blocks(slots(tables["B"], range(64, 72)), 32, lambda i, j: tables["B"][j]))
    assert alone.restore_reqs.tolist() == [0] and alone.restore_blocks.tolist() == [4]
    assert alone.iterate == 5 and alone.chain_from.tolist() == list(range(0, 5))  # positions 65..69 read 64..68
    both = plan_step(rows(2), [0, 72, 80], [0, 64], None, None, CPU,
                     Blocks(np.concatenate([slots(tables["A"], range(72)), slots(tables["B"], range(64, 72))]), 32,
                            lambda i, j: tables["AB"[i]][j]))
    assert both.restore_reqs is None and (72, 63) in zip(both.chain_rows.tolist(), both.chain_from.tolist())
    assert both.iterate == 26 + 5 + 1  # A's chain (positions 44..69), B's own, the link
    assert both.store_blocks.tolist() == [3, 4]  # the rows that end a block: A's 31 and 63
