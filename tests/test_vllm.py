"""fullband's vLLM model (fullband.vllm) against the native model, token for token, on vLLM's CPU build.

Runs in the environment `make test` builds for vLLM (.venv-vllm); skipped where vLLM is not installed. Every
engine runs in float32, eager, greedy, on tiny random models with peaked logits (init_std 0.1), and is compared
with `fullband.generate` on the same weights.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm (make test builds it)")

from vllm.platforms import current_platform  # noqa: E402

from fullband.decode.generate import generate  # noqa: E402
from fullband.hf.modeling import FullbandForCausalLM  # noqa: E402
from fullband.model.config import ModelConfig  # noqa: E402
from fullband.model.decoder import FullbandLM  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Model Runner V2 asked for by whoever runs these tests (benchmarks/gpu_check.py on a GPU), read before an engine
# hook sets the variable for the workers
ASKED_V2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1"
pytestmark = pytest.mark.timeout(600)

VOCAB, BOS = 300, 299
BASE = dict(vocab_size=VOCAB, d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=256, init_std=0.1,
            bos_token_id=BOS)
# every option the native model has, at once: per-head output gates, sliding window with a global layer every
# second one, raw-embedding inputs (converted Llamas), an untied head, the residual state fed back, concat fusion
VARIANTS = dict(BASE, n_layers=4, n_heads=4, n_kv_heads=2, d_model=256, attn_gate=True, qk_norm=False,
                sliding_window=8, global_every=2, input_norm=False, tie_embeddings=False, feedback="residual",
                fusion="concat")
ADDITIVE = dict(BASE, fusion="additive")
MODES = [("standard", 1), ("soft", 1), ("fused", 1), ("fused", 3)]


def make_folder(path, seed: int = 0, feedback_mode: str = "soft", prefill_passes: int = 1, **cfg) -> FullbandLM:
    torch.manual_seed(seed)
    model = FullbandLM(ModelConfig(**cfg)).eval()
    FullbandForCausalLM.from_native(model, feedback_mode=feedback_mode, prefill_passes=prefill_passes) \
        .save_pretrained(path)
    return model


def prompts(lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, BOS, (n,), generator=g).tolist() for n in lengths]


def engine(path, **kwargs):
    settings = dict(skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256,
                    max_num_seqs=16, seed=0)
    settings.update(kwargs)
    return vllm.LLM(str(path), **settings)


def shut(llm) -> None:
    import psutil

    # vLLM's kill_process_tree may name a worker that exited meanwhile: gone, as asked
    with contextlib.suppress(psutil.NoSuchProcess):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def params(mode: str | None = None, passes: int | None = None, max_tokens: int = 12, **kw):
    extra = {}
    if mode is not None:
        extra["feedback_mode"] = mode
    if passes is not None:
        extra["prefill_passes"] = passes
    return vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra or None, **kw)


def run(llm, batch, sampling) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], sampling, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def reference(model, batch, mode: str, passes: int, max_tokens: int = 12) -> list[list[int]]:
    return generate(model, batch, max_tokens, mode=mode, prefill_passes=passes)


def mode_params(mode: str, passes: int, **kw):
    return params(mode, passes if mode == "fused" else None, **kw)


# ---------------------------------------------------------------------------------------------------- one engine
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    model = make_folder(path, **BASE)
    llm = engine(path, enable_prefix_caching=True, block_size=32)
    yield model, llm
    shut(llm)


RAGGED = [1, 5, 17, 9, 30, 2, 41, 12]


@pytest.mark.parametrize("mode,passes", MODES)
def test_every_mode_equals_fullband_generate_on_a_ragged_batch(base, mode, passes):
    model, llm = base
    batch = prompts(RAGGED)
    assert run(llm, batch, mode_params(mode, passes)) == reference(model, batch, mode, passes)


def test_the_modes_really_differ(base):
    """The comparisons above have teeth: on these weights the modes give different tokens."""
    model, llm = base
    batch = prompts(RAGGED)
    got = {m: run(llm, batch, mode_params(m, k)) for m, k in MODES}
    assert got["standard"] != got["soft"]
    assert got["soft"] != got["fused"]
    assert all(a[0] == b[0] for a, b in zip(got["standard"], got["soft"]))  # same prefill: same first token


def test_one_batch_mixes_modes_per_request(base):
    model, llm = base
    batch = prompts(RAGGED, seed=3)
    modes = [MODES[i % len(MODES)] for i in range(len(batch))]
    got = run(llm, batch, [mode_params(m, k) for m, k in modes])
    want = [reference(model, [p], m, k)[0] for p, (m, k) in zip(batch, modes)]
    assert got == want


def test_default_mode_comes_from_the_folder(base):
    model, llm = base  # saved with feedback_mode="soft"
    batch = prompts([7, 19])
    assert run(llm, batch, params()) == reference(model, batch, "soft", 1)
    assert run(llm, batch, params("fused")) == reference(model, batch, "fused", 1)


def cached(llm, batch, sampling) -> tuple[list[list[int]], list[int]]:
    """Tokens and prefix-cache hits (tokens read from cached blocks) of each request, run one after the other so
    that each can find the blocks of those before it."""
    outs = [llm.generate([{"prompt_token_ids": p}], s, use_tqdm=False)[0] for p, s in zip(batch, sampling)]
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens or 0 for o in outs]


def test_prefix_caching_reuses_a_block_only_where_it_is_exact(base):
    """Blocks of 32 (the CPU attention's smallest): plain prompt blocks are shared by STANDARD and SOFT, FUSED-k ones by FUSED-k with the same
    prefix, never one by the other; a block holding fed (generated) positions is never matched by a later prompt,
    while STANDARD's generated blocks are plain and are. Every request's tokens equal fullband.generate's."""
    model, llm = base
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is True
    a, b = prompts([65, 9], seed=11)
    steps = [("soft", 1, a, 0), ("standard", 1, a, 64), ("fused", 2, a, 0), ("fused", 2, a, 64), ("fused", 1, a, 0),
             ("soft", 1, a + b, 64), ("fused", 2, a + b, 64), ("standard", 1, a + [5] * 20, 64)]
    modes = [(m, k) for m, k, _, _ in steps]
    got, hits = cached(llm, [p for *_, p, _ in steps], [mode_params(m, k) for m, k in modes])
    assert got == [reference(model, [p], m, k)[0] for m, k, p, _ in steps]
    assert hits == [h for *_, h in steps]
    # a conversation re-sent whole: an 80-token prompt and a 20-token reply fill the block of positions 64..95
    # (half prompt, half reply); the reply was fed under SOFT (no hit past position 64), plain under STANDARD
    c = prompts([80], seed=12)[0]
    for mode in ("soft", "standard"):
        (reply,), (hit,) = cached(llm, [c], [mode_params(mode, 1, max_tokens=20)])
        turn = c + reply + b  # 80 + 20 + 9 tokens
        (tokens,), (again,) = cached(llm, [turn], [mode_params(mode, 1)])
        assert reply == reference(model, [c], mode, 1, max_tokens=20)[0]
        assert tokens == reference(model, [turn], mode, 1)[0]
        assert (hit, again) == ((0, 64) if mode == "soft" else (64, 96)), mode


def fed(spans, max_tokens: int = 12, **kw):
    """SOFT sampling that reads the prompt positions in `spans` fed (a conversation's earlier replies)."""
    sampling = params("soft", max_tokens=max_tokens, **kw)
    sampling.extra_args["fed_spans"] = spans
    return sampling


def test_a_conversation_reads_its_replies_fed_and_reuses_their_blocks(base):
    """Turn 2 re-sends turn 1's prompt (20 tokens) and 30-token reply with a new message, the reply declared fed:
    tokens equal fullband.generate(fed=...) with the cache read or not (skip_reading_prefix_cache); turn 2 reads
    turn 1's first block of 32 (the reply's positions 20..31, generated fed) and computes on from position 32, fed
    the state the block's last position left (kept by block id); re-sent, it reads its own two blocks; the same
    tokens read plainly match none of them."""
    model, llm = base
    p1, u2 = prompts([20, 15], seed=31)
    (r1,), _ = cached(llm, [p1], [params("soft", max_tokens=30)])
    turn, spans = p1 + r1 + u2, [[20, 50]]
    want = generate(model, [turn], 12, mode="soft", fed=[spans])[0]
    got, hits = cached(llm, [turn] * 4, [fed(spans), fed(spans), fed(spans, skip_reading_prefix_cache=True),
                                         params("soft")])
    assert got[:3] == [want] * 3 and hits[:3] == [32, 64, 0]
    assert got[3] == reference(model, [turn], "soft", 1)[0] != want and hits[3] == 0
    # two requests for one new 72-token conversation (positions 44..69 fed): the second reads the first one's
    # blocks and its position 64 the state position 63 left (from the block store, or, when both are scheduled in
    # one step, from the first one's row: test_a_cached_block_s_state_comes_from_the_store_or_this_step). (A
    # longer fed run would compare float32 rounding, which the recurrence amplifies, not the engine.)
    conv, spans = prompts([72], seed=32)[0], [[44, 70]]
    outs = llm.generate([{"prompt_token_ids": conv}] * 2, [fed(spans)] * 2, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == generate(model, [conv] * 2, 12, fed=[spans] * 2)
    assert [o.num_cached_tokens or 0 for o in outs] == [0, 64]


def test_fed_states_are_returned_equal_to_the_native_engine_s(base):
    """generate_with_states: each generated token's fed state, as fullband.rl.logprob.rollout records it (the
    state the token reads at its position), in SOFT and FUSED, with the same tokens; the states differ from one
    position to the next by O(1), so an off-by-one would fail."""
    from fullband.model.mode import DecodeMode
    from fullband.rl.logprob import rollout
    from fullband.vllm import generate_with_states

    model, llm = base
    batch = prompts([7, 23, 40], seed=21)
    for mode, passes in (("soft", 1), ("fused", 2)):
        outs, states = generate_with_states(llm, [{"prompt_token_ids": p} for p in batch], mode_params(mode, passes))
        native = rollout(model, batch, 12, mode=DecodeMode(mode, passes))
        assert [list(o.outputs[0].token_ids) for o in outs] == native.responses
        for got, want in zip(states, native.states):
            assert got.shape == want.shape == (12, model.config.d_model)
            assert (got - want).abs().max() < 1e-3, mode  # float32 rounding, grown along the recurrence
    with pytest.raises(Exception, match="feeds none"):
        generate_with_states(llm, [{"prompt_token_ids": batch[0]}], mode_params("standard", 1))
    # collected and freed whatever became of the requests; their keys admitted no more
    from fullband.vllm.tracker import SERVED

    assert llm.collective_rpc("fullband_states_kept") == [0] and not SERVED.issued


def test_n_samples_max_tokens_stop_tokens_and_logprobs(base):
    model, llm = base
    batch = prompts([11, 23])
    want = reference(model, batch, "soft", 1, max_tokens=9)
    # n > 1 needs sampling; top_k=1 samples the argmax, so every sample is the greedy reference
    sampling = vllm.SamplingParams(n=3, max_tokens=9, temperature=1.0, top_k=1, logprobs=2,
                                   extra_args={"feedback_mode": "soft"})
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], sampling, use_tqdm=False)
    for out, ref in zip(outs, want):
        assert len(out.outputs) == 3
        for sample in out.outputs:
            assert list(sample.token_ids) == ref
            for tok, lp in zip(sample.token_ids, sample.logprobs):
                assert tok in lp and lp[tok].rank == 1
    stop = want[0][4]
    got = run(llm, batch[:1], params("soft", max_tokens=9, stop_token_ids=[stop]))[0]
    assert got == want[0][:want[0].index(stop) + 1]


def test_logprobs_equal_the_native_model(base):
    model, llm = base
    batch = prompts([13])
    out = llm.generate([{"prompt_token_ids": batch[0]}], params("soft", max_tokens=6, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    ids = torch.tensor([batch[0] + list(out.token_ids)])
    # the native exact recurrence with a plain prompt is SOFT decoding's computation
    logits = model.recurrent_forward(ids, plain_prefix=len(batch[0])).logits[0].log_softmax(-1)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp[tok].logprob == pytest.approx(float(logits[len(batch[0]) - 1 + i, tok]), abs=1e-3)


@pytest.mark.parametrize("extra,message", [
    ({"feedback_mode": "bogus"}, "feedback_mode='bogus' is not a serving mode"),
    ({"feedback_mode": "fused", "prefill_passes": -1}, "prefill_passes=-1 is invalid"),
    ({"feedback_mode": "fused", "prefill_passes": "two"}, "prefill_passes='two' is invalid"),
    ({"feedback_mod": "fused"}, "unknown request key 'feedback_mod' (did you mean 'feedback_mode'?)"),
    ({"feedback_mode": "soft", "prefill_passes": 2}, "applies to feedback_mode='fused' only"),
    ({"feedback_mode": "exact"}, "not a serving mode"),
    # a key generate_with_states did not hand out: its states would be kept with no one to collect them
    ({"fullband_states": "abc"}, "fullband_states='abc' was not set by fullband.vllm.generate_with_states"),
])
def test_bad_request_arguments_are_refused_by_name(base, extra, message):
    _, llm = base
    with pytest.raises(vllm.exceptions.VLLMValidationError, match=re.escape(message)):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                     vllm.SamplingParams(max_tokens=2, extra_args=extra), use_tqdm=False)
    assert run(llm, [[1, 2, 3]], params("soft", max_tokens=2))  # and the engine still serves


def test_a_removed_request_leaves_nothing_in_its_row(monkeypatch):
    """The tracker (no engine): a request that finishes or is aborted mid-prefill takes its FUSED prompt, kept
    passes and states key with it, rather than leaving them in its row until another request takes the row."""
    from types import SimpleNamespace

    from vllm.v1.sample.logits_processor.interface import BatchUpdate

    from fullband.model.mode import DecodeMode
    from fullband.vllm.tracker import SERVED, RequestTracker

    for name, value in (("tracker", None), ("has_feedback", True), ("default", DecodeMode("soft"))):
        monkeypatch.setattr(SERVED, name, value)
    tracker = RequestTracker(SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4)), torch.device("cpu"),
                             False)
    sampling = vllm.SamplingParams(extra_args={"feedback_mode": "fused", "prefill_passes": 2, "fullband_states": "k"})
    tracker.update_state(BatchUpdate(batch_size=2, removed=[], added=[(1, sampling, [5, 6, 7], [])], moved=[]))
    tracker.fused[1] = (torch.zeros(3, 8), torch.zeros(3, 8))  # the prompt's passes, as the model keeps them
    assert tracker.prompts[1] == [5, 6, 7] and tracker.states_key[1] == "k" and tracker.keeps_states[1]
    tracker.update_state(BatchUpdate(batch_size=1, removed=[1], added=[], moved=[]))
    assert (tracker.prompts[1], tracker.fused[1], tracker.states_key[1], tracker.keeps_states[1]) == \
        (None, None, None, False)


# ---------------------------------------------------------------------------------------------------- vLLM's machinery
def test_chunked_prefill_is_exact_in_every_mode(tmp_path):
    """Prompts of up to 90 tokens through a 16-token step budget: FUSED prompts arrive in chunks; with prefix
    caching on, the second round finds the first round's blocks (of 32) and reads on from them."""
    model = make_folder(tmp_path, **BASE)
    llm = engine(tmp_path, max_num_batched_tokens=16, max_num_seqs=4, enable_chunked_prefill=True,
                 enable_prefix_caching=True, block_size=32)
    try:
        batch = prompts([90, 33, 5, 61, 17])
        for mode, passes in MODES + [("fused", 7)]:
            want = reference(model, batch, mode, passes)
            assert run(llm, batch, mode_params(mode, passes)) == want, (mode, passes)
            again, hits = cached(llm, batch, [mode_params(mode, passes)] * len(batch))
            assert again == want and hits == [64, 32, 0, 32, 0], (mode, passes, hits)
        # fed spans across chunk boundaries (chunks of 16 end at 32 and 64 inside them): the recurrence carried from
        # chunk to chunk; re-sent, its two blocks read from the cache and position 64, fed, reads the state the
        # second block's last position left
        conv, spans = prompts([70], seed=5)[0], [[20, 40], [56, 68]]
        got, hits = cached(llm, [conv, conv], [fed(spans)] * 2)
        assert got == [generate(model, [conv], 12, mode="soft", fed=[spans])[0]] * 2 and hits == [0, 64]
    finally:
        shut(llm)


def test_preemption_by_recompute_gives_the_same_tokens(tmp_path):
    """A KV cache of 5 blocks of 32 tokens for 8 requests of 30-60 tokens: vLLM preempts running requests and
    later recomputes them from their tokens (generated ones included). 20 new tokens: on random weights the
    recurrence amplifies float rounding (1e-3 in the state after ~25 fed positions), so longer runs would compare
    rounding, not the engine."""
    model = make_folder(tmp_path, **BASE)
    llm = engine(tmp_path, block_size=32, num_gpu_blocks_override=5, max_model_len=128, max_num_seqs=8,
                 disable_log_stats=False, enable_prefix_caching=True)
    try:
        batch = prompts([30, 12, 25, 40, 18, 33, 19, 27], seed=7)
        modes = [("soft", 1), ("fused", 2), ("standard", 1), ("soft", 1)] * 2
        got = run(llm, batch, [mode_params(m, k, max_tokens=20) for m, k in modes])
        want = [reference(model, [p], m, k, max_tokens=20)[0] for p, (m, k) in zip(batch, modes)]
        assert got == want
        metrics = {m.name: m for m in llm.get_metrics()}
        assert metrics["vllm:num_preemptions"].value > 0
    finally:
        shut(llm)


@pytest.mark.parametrize("name,cfg", [("variants", VARIANTS), ("additive", ADDITIVE)])
def test_every_architecture_option_in_every_mode_with_chunks(tmp_path, name, cfg):
    model = make_folder(tmp_path, feedback_mode="fused", prefill_passes=3, **cfg)
    llm = engine(tmp_path, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        batch = prompts([3, 29, 50, 11])
        assert run(llm, batch, params()) == reference(model, batch, "fused", 3)  # the folder's default mode
        for mode, passes in MODES:
            assert run(llm, batch, mode_params(mode, passes)) == reference(model, batch, mode, passes), (mode, passes)
    finally:
        shut(llm)


def test_tensor_parallel_over_two_processes_in_every_mode(tmp_path, monkeypatch):
    """--tensor-parallel-size 2 on the CPU: heads split over two workers, the single key/value head and the
    per-head gains and gates sharded; FUSED prompts in chunks (their dense passes run on both ranks)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("two CPU cores are needed for two tensor-parallel workers")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1]}")  # one core per worker
    cfg = dict(BASE, n_heads=4, n_kv_heads=1, d_model=256, attn_gate=True)
    model = make_folder(tmp_path, **cfg)
    llm = engine(tmp_path, tensor_parallel_size=2, max_num_seqs=4, max_num_batched_tokens=16)
    try:
        batch = prompts([5, 37, 12])
        for mode, passes in MODES:
            assert run(llm, batch, mode_params(mode, passes)) == reference(model, batch, mode, passes), (mode, passes)
    finally:
        shut(llm)


def test_unsupported_folders_are_refused_by_name(tmp_path):
    make_folder(tmp_path, **dict(BASE, hf_path="/somewhere/llama"))
    with pytest.raises(Exception, match="hf_path='/somewhere/llama'"):
        engine(tmp_path)


def test_an_untested_vllm_is_refused_with_the_range(monkeypatch):
    """The plugin reaches into vLLM's runner and scheduler: another release is refused when a fullband folder is
    served (before its config is touched), with the tested range."""
    import vllm

    from fullband.errors import FullbandError
    from fullband.vllm import engine as rules

    monkeypatch.delenv("FULLBAND_ALLOW_UNTESTED", raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(FullbandError, match=re.escape("fullband's vLLM plugin is tested with vllm >=0.32,<0.33; "
                                                      "0.34.0 is installed")):
        rules.FullbandEngineConfig.verify_and_update_config(None)


@pytest.mark.skipif(not current_platform.is_cpu(), reason="the CPU attention's head sizes")
def test_a_head_size_the_attention_cannot_run_is_refused_at_load(tmp_path, capfd):
    make_folder(tmp_path, **dict(BASE, d_model=64, n_heads=4, n_kv_heads=2))  # head_dim 16: CPU_ATTN has no kernel
    with pytest.raises(Exception):
        engine(tmp_path)
    printed = capfd.readouterr()  # the worker process's log: its stdout and stderr
    assert "head_dim=16 (d_model / n_heads) is not supported by vLLM's CPU_ATTN attention" in printed.out + printed.err


# ---------------------------------------------------------------------------------------------------- Model Runner V2
# V2 needs Triton, which the CPU build lacks: its engine runs on a GPU only (benchmarks/gpu_check.py runs this file
# there with VLLM_USE_V2_MODEL_RUNNER=1). Here: vLLM's own V2 base class, request data and input batch around
# fullband's model state, and the runner choice. The steps themselves are tested in tests/test_vllm_slots.py.
def test_the_workers_run_the_model_runner_the_plugin_chose(base):
    """V1 on the CPU build; V2 on CUDA when asked for (what makes the GPU check's run of this file a V2 run)."""
    _, llm = base
    want = "V2" if ASKED_V2 and current_platform.is_cuda() else "V1"
    assert llm.collective_rpc("fullband_runner") == [want]


@pytest.fixture(scope="module")
def v2_config(tmp_path_factory):
    """A real VllmConfig for a fullband folder (built on the CPU: its engine hook chooses V1 here)."""
    from vllm.engine.arg_utils import EngineArgs

    path = tmp_path_factory.mktemp("v2")
    make_folder(path, **BASE)
    return EngineArgs(model=str(path), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                      max_model_len=256, max_num_seqs=6).create_engine_config()


def new_request(req_id, prompt, generated=(), computed=0, **extra):
    """V2's NewRequestData as the scheduler sends it: a resumed request carries its prompt and, to recompute, its
    prompt and generated tokens (prefill_token_ids)."""
    from vllm.v1.core.sched.output import NewRequestData

    return NewRequestData(req_id=req_id, prompt_token_ids=list(prompt), mm_features=[],
                          sampling_params=vllm.SamplingParams(extra_args=extra or None), pooling_params=None,
                          block_ids=([],), num_computed_tokens=computed, lora_request=None,
                          prefill_token_ids=[*prompt, *generated])


def input_batch(req_ids, index):
    """A real V2 InputBatch of these requests at these request indices (one token each)."""
    import dataclasses

    import numpy as np
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    dummy = InputBatch.make_dummy(len(req_ids), len(req_ids), InputBuffers(8, 16, torch.device("cpu")))
    return dataclasses.replace(dummy, req_ids=list(req_ids), idx_mapping_np=np.asarray(index, dtype=np.intp),
                               idx_mapping=torch.tensor(index, dtype=torch.int64))


def test_v2_model_state_is_the_model_s_and_keeps_requests_by_index(v2_config):
    """vLLM's resolve_model_state_cls finds fullband's state on the served model (V1's runner never asks: the V1
    tests here all run with the method in place), and on vLLM's own base class it admits a request by index with a
    zeroed state row, reads a resumed request's prompt, not its recomputed tokens, as its prompt, and frees it."""
    import inspect

    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu.model_states import resolve_model_state_cls
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from fullband.vllm.model import FullbandForCausalLM
    from fullband.vllm.runner_v2 import FeedbackModelState

    assert resolve_model_state_cls(v2_config, FullbandForCausalLM) is FeedbackModelState
    assert "get_model_state_cls" not in inspect.getsource(gpu_model_runner)
    state = FeedbackModelState(v2_config, torch.nn.Module(), None, torch.device("cpu"))
    assert isinstance(state, DefaultModelState) and state.slots.state.shape == (6, BASE["d_model"])
    slots = state.slots
    slots.state[4] = 1.0  # what an earlier request left at index 4
    state.add_request(4, new_request("a", [1, 2, 3, 4], generated=[7, 8], feedback_mode="fused", prefill_passes=2))
    assert slots.index == {"a": 4} and not slots.state[4].any() and slots.fresh[4]
    assert (slots.prompt_len[4], slots.passes[4], slots.prompts[4]) == (4, 3, [1, 2, 3, 4]) and slots.feeds[4]
    state.add_request(1, new_request("b", [5, 6, 7, 8, 9], feedback_mode="soft", fed_spans=[[1, 3]]))
    assert slots.fed[1] == ((1, 3),) and slots.index == {"a": 4, "b": 1}
    state.remove_request("a")
    assert slots.index == {"b": 1} and slots.prompts[4] is None


def test_v2_prepare_inputs_hands_the_forward_the_step_s_requests_by_index(v2_config):
    """prepare_inputs's result is the forward's keyword arguments: fullband_batch, the packed requests' Reads and
    states gathered by V2's idx_mapping; a dummy run's batch (requests not admitted) gets none, so it keeps no
    state."""
    from fullband.vllm.runner_v2 import FeedbackModelState

    state = FeedbackModelState(v2_config, torch.nn.Module(), None, torch.device("cpu"))
    for req_id, index, mode in (("a", 3, "soft"), ("b", 0, "standard"), ("c", 5, "fused")):
        state.add_request(index, new_request(req_id, [1] * (index + 2), feedback_mode=mode))
        state.slots.state[index] = float(index)
    assert "fullband_batch" not in state.prepare_inputs(input_batch(["x", "y"], [0, 1]), None)  # a dummy run
    batch = state.prepare_inputs(input_batch(["c", "a", "b"], [5, 3, 0]), None)["fullband_batch"]
    assert batch.rows.prompt_len.tolist() == [7, 5, 2] and batch.rows.feeds.tolist() == [True, True, False]
    assert batch.state()[:, 0].tolist() == [5.0, 3.0, 0.0]


def test_v2_admission_refuses_a_bad_request_by_name_through_vllm_s_v2_loader():
    """On V2 the request tracker (a V1 logits processor) is not loaded; fullband.vllm.admission's V2 processor
    checks the arguments at admission instead, loaded and run by vLLM's own V2 validator."""
    from vllm.v1.worker.gpu.sample.logits_processor.loader import build_custom_logits_processors_params_validator

    from fullband.vllm.admission import CHECK

    validate = build_custom_logits_processors_params_validator([CHECK])
    validate(vllm.SamplingParams(extra_args={"feedback_mode": "fused", "prefill_passes": 2}))
    with pytest.raises(vllm.exceptions.VLLMValidationError, match="feedback_mode='bogus' is not a serving mode"):
        validate(vllm.SamplingParams(extra_args={"feedback_mode": "bogus"}))


@pytest.mark.parametrize("cuda,asked,default,want", [
    (False, "1", True, "V1 (on cpu: fullband runs Model Runner V2 on CUDA only, and V2 needs Triton, which vLLM's CPU "
                       "build lacks; the fed-back state lives in its persistent batch"),
    (True, "1", False, "V2 (VLLM_USE_V2_MODEL_RUNNER=1; the fed-back state lives in a model state by request index"),
    (True, "0", True, "V1 (VLLM_USE_V2_MODEL_RUNNER=0; the fed-back state lives in its persistent batch"),
    (True, None, True, "V2 (vLLM's default here; the fed-back state lives in a model state by request index"),
    (True, None, False, "V1 (vLLM's default here; the fed-back state lives in its persistent batch"),
])
def test_the_model_runner_is_chosen_and_said_in_one_line(monkeypatch, cuda, asked, default, want):
    """V2 where it runs (CUDA) and is asked for or vLLM's default; the workers are told through the variable."""
    from vllm.platforms import current_platform as platform

    from fullband.vllm import engine as rules

    said = []
    monkeypatch.setattr(rules.logger, "info_once", lambda msg, *a, **k: said.append(msg % a))
    monkeypatch.setattr(platform, "is_cuda", lambda: cuda)
    if asked is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", asked)

    class Config:  # vLLM's property reads the variable as it is when asked
        @property
        def use_v2_model_runner(self):
            value = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
            return default if value is None else value == "1"

    v2 = rules.model_runner(Config())
    assert said == [f"fullband: model runner {want}: docs/vllm-v2.md)"]
    assert v2 == want.startswith("V2") and os.environ["VLLM_USE_V2_MODEL_RUNNER"] == ("1" if v2 else "0")


def test_the_chosen_runner_gets_its_logits_processor(v2_config, monkeypatch):
    """V1: the request tracker; V2: the admission check (V2 refuses V1's processors), never both."""
    from fullband.vllm import engine as rules
    from fullband.vllm.admission import CHECK
    from fullband.vllm.tracker import TRACKER

    assert v2_config.model_config.logits_processors == [TRACKER]  # the CPU build: V1
    monkeypatch.setattr(rules, "model_runner", lambda config: True)
    rules.FullbandEngineConfig.verify_and_update_config(v2_config)
    assert v2_config.model_config.logits_processors == [CHECK]
    monkeypatch.setattr(rules, "model_runner", lambda config: False)
    rules.FullbandEngineConfig.verify_and_update_config(v2_config)
    assert v2_config.model_config.logits_processors == [TRACKER]


def test_prefill_context_parallelism_is_refused_by_name(v2_config, monkeypatch):
    """V2's prefill context parallelism splits a prompt's positions over ranks: a fed position would read a state
    another rank computes."""
    from fullband.errors import ConfigError
    from fullband.vllm import engine as rules

    monkeypatch.setattr(v2_config.parallel_config, "prefill_context_parallel_size", 2)
    with pytest.raises(ConfigError, match="prefill_context_parallel_size > 1 is not supported with latent feedback"):
        rules.FullbandEngineConfig.verify_and_update_config(v2_config)


# ---------------------------------------------------------------------------------------------------- a converted Llama
def test_converted_llama_in_standard_mode_equals_vllms_own_llama(tmp_path):
    """Converted without fusion weights (fusion="none"), so also what a model without feedback weights is served
    as: STANDARD by default, a feedback mode refused by name, prefix caching on (a repeated prompt's blocks)."""
    import transformers

    from fullband.hf.convert import convert

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                   initializer_range=0.1, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    convert(tmp_path / "llama", tmp_path / "native", to="native", fusion="none")
    convert(tmp_path / "native", tmp_path / "fb", to="hf")
    batch = prompts(RAGGED)
    theirs = engine(tmp_path / "llama")
    try:
        want = run(theirs, batch, vllm.SamplingParams(max_tokens=12, temperature=0.0))
    finally:
        shut(theirs)
    ours = engine(tmp_path / "fb", enable_prefix_caching=True, block_size=32)
    try:
        assert ours.llm_engine.vllm_config.cache_config.enable_prefix_caching is True
        assert run(ours, batch, params("standard")) == run(ours, batch, params()) == want
        again, hits = cached(ours, [batch[6]] * 2, [params()] * 2)  # 41 tokens: one block of 32 from the cache
        assert again == [want[6]] * 2 and hits == [32, 32]
        with pytest.raises(vllm.exceptions.VLLMValidationError, match="needs feedback weights"):
            run(ours, batch, params("soft"))
    finally:
        shut(ours)


# ---------------------------------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def smollm2_folders(smollm2_gguf, tmp_path_factory):
    """SmolLM2-135M-Instruct (make install's GGUF file) as a transformers Llama folder (vLLM's own model reads it)
    and through `fullband convert` as a native and a served folder (its fusion untrained: STANDARD by default)."""
    from transformers import AutoTokenizer

    from fullband.hf.convert import convert
    from fullband.hf.gguf import load_causal_lm

    root = tmp_path_factory.mktemp("smollm2")
    load_causal_lm(smollm2_gguf).save_pretrained(root / "llama")
    AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name).save_pretrained(root / "llama")
    convert(root / "llama", root / "native")
    convert(root / "native", root / "hf")
    return root


def test_real_model_plugin_equals_vllms_llama_and_fullband_generate(smollm2_folders):
    """On SmolLM2-135M: the plugin's default (STANDARD: the fusion is untrained) equals vLLM's own
    LlamaForCausalLM on the same weights, token for token; every mode equals fullband.generate; vLLM's chat API
    renders the model's ChatML template from the served folder and stops at <|im_end|>."""
    from fullband.data.chat.templates import chat_prompt
    from fullband.data.tokenizer import load_tokenizer
    from fullband.loader import load_model

    root = smollm2_folders
    tok = load_tokenizer(root / "native")
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    batch = [chat_prompt(tok, chat), tok.encode("The Python standard library is"), tok.encode("def fibonacci(n):"),
             chat_prompt(tok, [{"role": "user", "content": "Name three colors."}])]
    settings = dict(dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=16, seed=0)
    theirs = vllm.LLM(str(root / "llama"), **settings)
    try:
        want = run(theirs, batch, vllm.SamplingParams(max_tokens=16, temperature=0.0))
    finally:
        shut(theirs)
    native = load_model(root / "native")
    im_end = tok.stop_ids[0]
    ours = vllm.LLM(str(root / "hf"), enable_prefix_caching=True, block_size=32, **settings)
    try:
        assert run(ours, batch, vllm.SamplingParams(max_tokens=16, temperature=0.0)) == want
        assert want[0][-1] == im_end  # the reply ended its turn
        for mode, k in (("standard", 1), ("soft", 1), ("fused", 1), ("fused", 2)):
            got = run(ours, batch, mode_params(mode, k, max_tokens=16))
            assert got == generate(native, batch, 16, mode=mode, prefill_passes=k, stop_tokens=[im_end]), mode
        out = ours.chat(chat, vllm.SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
        assert list(out[0].prompt_token_ids) == batch[0] and list(out[0].outputs[0].token_ids) == want[0]
    finally:
        shut(ours)


# ---------------------------------------------------------------------------------------------------- the server
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`fullband serve` (vLLM's OpenAI server) on a converted chat folder (the byte vocabulary with fullband's chat
    markers and template), on a loopback port. The model writes printable ASCII, newlines and <|end|> only (the
    head's other rows are 0, below the best of those on these weights), so every reply reads back as the ids it
    was sampled as and a conversation keeps its turns (ChatSession reads the conversation again otherwise)."""
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    from fullband.data.tokenizer import ByteTokenizer
    from fullband.hf.convert import convert

    root = tmp_path_factory.mktemp("served")
    tokenizer = ByteTokenizer(chat=True)
    torch.manual_seed(0)
    model = FullbandLM(ModelConfig(**dict(BASE, vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                                          tie_embeddings=False))).eval()
    writes = [10, *range(32, 127), tokenizer.chat_ids["<|end|>"]]
    with torch.no_grad():
        keep = model.lm_head.weight[writes].clone()
        model.lm_head.weight.zero_()
        model.lm_head.weight[writes] = keep
    model.save(root / "native", tokenizer=tokenizer)
    convert(root / "native", root / "hf", to="hf")
    port = _free_port()
    cmd = [str(Path(sys.executable).parent / "fullband"), "serve", str(root / "hf"), "--host", "127.0.0.1", "--port",
           str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "32",
           "--seed", "0", "--served-model-name", "fb"]
    log = open(root / "server.log", "w")
    # no VLLM_CPU_KVCACHE_SPACE: fullband serve sizes the KV cache to the memory free (--kv-cache-memory-bytes)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc: the tests read what the workers keep
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"vllm serve did not start: {(root / 'server.log').read_text()[-3000:]}")
        time.sleep(1)
    assert "fullband serve: KV cache " in (root / "server.log").read_text()
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120, max_retries=0)
    yield model, client, url, tokenizer, root
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _xargs(mode: str, passes: int | None = None) -> dict:
    extra = {"feedback_mode": mode}
    if passes is not None:
        extra["prefill_passes"] = passes
    return {"vllm_xargs": extra, "return_token_ids": True, "ignore_eos": True}


def test_server_completions_in_every_mode(server):
    model, client, *_ = server
    batch = prompts([5, 23, 14], seed=11)
    batch = [[t % 255 + 1 for t in p] for p in batch]  # byte ids, no BOS (id 256)
    for mode, passes in MODES:
        want = reference(model, batch, mode, passes, max_tokens=10)
        got = []
        for p in batch:
            r = client.completions.create(model="fb", prompt=p, max_tokens=10, temperature=0,
                                          extra_body=_xargs(mode, passes if mode == "fused" else None))
            got.append(list(r.choices[0].token_ids))
        assert got == want, (mode, passes)


def test_server_streaming_and_chat(server):
    model, client, *_ = server
    prompt = "def load(fp):"
    r = client.completions.create(model="fb", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body=_xargs("fused", 2))
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="fb", prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body=_xargs("fused", 2)))
    assert streamed == r.choices[0].text and r.choices[0].text
    ids = r.choices[0].prompt_token_ids
    assert list(r.choices[0].token_ids) == reference(model, [ids], "fused", 2, max_tokens=12)[0]
    messages = [{"role": "user", "content": "import json"}]
    chat = client.chat.completions.create(model="fb", messages=messages, max_tokens=10, temperature=0,
                                          extra_body=_xargs("soft"))
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="fb", messages=messages, max_tokens=10, temperature=0, stream=True, extra_body=_xargs("soft")))
    assert streamed == chat.choices[0].message.content
    assert list(chat.choices[0].token_ids) == reference(model, [chat.prompt_token_ids], "soft", 1, max_tokens=10)[0]


def test_server_stop_strings_and_max_tokens(server):
    _, client, *_ = server
    full = client.completions.create(model="fb", prompt="import json\n", max_tokens=16, temperature=0,
                                     extra_body=_xargs("soft"))
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 16
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop
    cut = client.completions.create(model="fb", prompt="import json\n", max_tokens=16, temperature=0, stop=[stop],
                                    extra_body=_xargs("soft"))
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_server_answers_32_concurrent_requests_like_offline(server):
    from concurrent.futures import ThreadPoolExecutor

    model, client, *_ = server
    batch = [[t % 255 + 1 for t in p] for p in prompts([3 + (7 * i) % 40 for i in range(32)], seed=13)]
    modes = [MODES[i % len(MODES)] for i in range(32)]

    def ask(i):
        mode, passes = modes[i]
        r = client.completions.create(model="fb", prompt=batch[i], max_tokens=8, temperature=0,
                                      extra_body=_xargs(mode, passes if mode == "fused" else None))
        return list(r.choices[0].token_ids)

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(ask, range(32), timeout=300))
    assert got == [reference(model, [p], m, k, max_tokens=8)[0] for p, (m, k) in zip(batch, modes)]


def _post(url: str, path: str, body) -> tuple[int, str]:
    """POST `body` (a JSON value, or raw text) to the server: (HTTP status, the body of the answer)."""
    import json
    import urllib.error
    import urllib.request

    data = body if isinstance(body, str) else json.dumps({"model": "fb", **body})
    req = urllib.request.Request(url + path, data=data.encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("path,body,message", [
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "vllm_xargs": {"feedback_mode": "bogus"}},
     "feedback_mode='bogus'"),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2,
                         "vllm_xargs": {"feedback_mode": "fused", "prefill_passes": -1}},
     "prefill_passes=-1 is invalid"),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "vllm_xargs": {"prefil_passes": 2}},
     "did you mean 'prefill_passes'?"),
    ("/v1/completions", {"prompt": [5] * 299, "max_tokens": 2}, "maximum context length"),
    ("/v1/completions", "{not json", ""),
    # fullband's sentence where vLLM's schema would answer with its own errors (or read true as 1)
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "vllm_xargs": {"fed_spans": {"a": 1}}},
     "fed_spans={'a': 1} is invalid at 'a'; accepted: a list of [start, end) pairs"),
    ("/v1/chat/completions", {"messages": [USER], "max_tokens": 2, "vllm_xargs": {"fed_spans": None}},
     "fed_spans=None is invalid; accepted: a list of [start, end) pairs"),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2,
                         "vllm_xargs": {"feedback_mode": "fused", "prefill_passes": True}},
     "prefill_passes=True must be an integer (got bool)"),
    # a chat message as chat data and `fullband chat` take them; text that is not Unicode (not the tokenizer's error)
    ("/v1/chat/completions", {"messages": [USER, {"role": "wizard", "content": "x"}], "max_tokens": 2},
     "messages[1]: unknown role 'wizard'; accepted: system, user, assistant"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 2},
     "lone surrogate"),
    ("/v1/completions", {"prompt": "a\udc80", "max_tokens": 2}, "lone surrogate"),
])
def test_server_refuses_bad_requests_and_keeps_serving(server, path, body, message):
    import json

    model, client, url, *_ = server
    status, text = _post(url, path, body)
    assert 400 <= status < 500
    assert message in text
    if message and not message.startswith("maximum"):  # fullband's: its sentence, whole
        assert status == 400 and message in json.loads(text)["error"]["message"]
    r = client.completions.create(model="fb", prompt=[5, 6, 7], max_tokens=3, temperature=0, extra_body=_xargs("soft"))
    assert list(r.choices[0].token_ids) == reference(model, [[5, 6, 7]], "soft", 1, max_tokens=3)[0]


def test_server_keeps_no_state_for_a_keyed_request(server):
    """1,000 requests asking the workers to keep their fed states (`fullband_states`, completions and chat) are each
    refused with fullband's sentence, and the workers keep nothing: a server hands fed states to no one, so none
    may be kept (offline, generate_with_states collects what it asks for)."""
    import json

    model, client, url, *_ = server
    for i in range(1000):
        path, body = (("/v1/completions", {"prompt": [5, 6, 7]}) if i % 2 else
                      ("/v1/chat/completions", {"messages": [USER]}))
        status, text = _post(url, path, {**body, "max_tokens": 200, "vllm_xargs": {"fullband_states": f"k{i}"}})
        assert status == 400 and f"fullband_states='k{i}' was not set by fullband.vllm.generate_with_states" in \
            json.loads(text)["error"]["message"], (i, status, text[:300])
    status, text = _post(url, "/collective_rpc", {"method": "fullband_states_kept"})
    assert status == 200 and json.loads(text)["results"] == ["0"]


def test_server_chat_conversation_equals_fullband_chat(server):
    """Three turns of greedy chat through /v1/chat/completions, each re-sending the conversation, equal to
    ChatSession's (`fullband chat`) on the same model, turn by turn. SOFT: the session keeps its cache (its replies
    fed) and the server reads the earlier replies fed (the fed spans it adds to a SOFT chat request by default);
    FUSED k=2: both read the whole conversation with 3 passes each turn. A conversation read plainly (fed_spans [])
    answers otherwise than read fed: the comparison has teeth."""
    from fullband.chat import ChatSession

    model, client, _, tokenizer, root = server
    for mode, passes in (("soft", None), ("fused", 2)):
        session = ChatSession(model, tokenizer, mode=mode, prefill_passes=passes, max_new_tokens=12)
        xargs = {"feedback_mode": mode, **({"prefill_passes": passes} if passes else {})}
        messages = []
        for text in ("hello", "tell me more", "and then?"):
            want = "".join(session.reply(text))
            assert session.last.reread is (mode == "fused" or text == "hello")  # SOFT kept its cache: fed replies
            messages.append({"role": "user", "content": text})
            r = client.chat.completions.create(model="fb", messages=messages, max_tokens=12, temperature=0,
                                               extra_body={"return_token_ids": True, "vllm_xargs": xargs})
            got = r.choices[0].message.content
            assert (got, list(r.choices[0].token_ids)) == (want, session.last.ids), (mode, text)
            messages.append({"role": "assistant", "content": got})
    plain = client.chat.completions.create(model="fb", messages=messages[:-1], max_tokens=12, temperature=0,
                                           extra_body={"vllm_xargs": {"feedback_mode": "soft", "fed_spans": []}})
    soft = client.chat.completions.create(model="fb", messages=messages[:-1], max_tokens=12, temperature=0,
                                          extra_body={"vllm_xargs": {"feedback_mode": "soft"}})
    assert plain.choices[0].message.content != soft.choices[0].message.content
    # the same spans sent as [[start, end), ...] (what the offline API takes; vLLM's schema alone refuses them)
    from fullband import fed_chat_prompt

    spans = [list(span) for span in fed_chat_prompt(tokenizer, messages[:-1])[1]]
    nested = client.chat.completions.create(model="fb", messages=messages[:-1], max_tokens=12, temperature=0,
                                            extra_body={"vllm_xargs": {"feedback_mode": "soft", "fed_spans": spans}})
    assert len(spans) == 2 and nested.choices[0].message.content == soft.choices[0].message.content
    # a prompt vLLM renders otherwise than fullband's template (no generation prompt here): read plainly, said once
    for _ in range(2):
        odd = client.chat.completions.create(model="fb", messages=messages[:-1], max_tokens=12, temperature=0,
                                             extra_body={"return_token_ids": True, "add_generation_prompt": False,
                                                         "vllm_xargs": {"feedback_mode": "soft"}})
        assert list(odd.choices[0].token_ids) == generate(model, [odd.prompt_token_ids], 12,
                                                          stop_tokens=tokenizer.stop_ids)[0]
    assert (root / "server.log").read_text().count("read plainly, not as they were generated") == 1

