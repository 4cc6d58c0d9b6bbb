"""Decoding: every mode against an uncached reference, the paper's equalities, ragged batches, sampling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import random_ids, tiny_model
from fullband import MODES, generate, stream

PROMPT_LEN, NEW = 11, 9


def _steps(model, prompt, mode, k=1, **kw):
    steps = list(stream(model, [prompt], NEW, mode=mode, prefill_passes=k, **kw))
    tokens = [int(s.tokens[0]) for s in steps]
    logits = torch.stack([s.logits[0] for s in steps])  # (NEW, V)
    return tokens, logits


def _uncached_logits(model, prompt: list[int], new: list[int], mode: str, k: int) -> torch.Tensor:
    """Logits at each generated step recomputed from scratch with full-sequence (Jacobi) forwards, no cache."""
    P, n = len(prompt), len(new)
    seq = torch.tensor([prompt + new])
    with torch.no_grad():
        if mode == "standard":
            logits = model(seq, passes=1).logits
        elif mode == "soft":
            plain = (torch.arange(P + n) < P)[None]
            logits = model(seq, passes=P + n + 1, plain_mask=plain).logits
        elif mode == "exact":
            logits = model(seq, passes=P + n + 1).logits
        else:  # fused: prompt inputs from k Jacobi passes, generated positions iterated to their fixed point
            e = model.embed_inputs(seq)  # the target block's plain inputs
            prompt_state = model(seq[:, :P], passes=k).hidden if k else None
            shift = lambda h: F.pad(h, (0, 0, 1, 0))[:, : h.shape[1]]  # noqa: E731
            plain = model.plain_of(seq)
            x_prompt = model.pass_inputs(e[:, :P], None if k == 0 else shift(prompt_state), plain[:, :P])
            state = torch.zeros_like(e)
            for _ in range(n + 1):
                x_gen = model.pass_inputs(e[:, P:], shift(state)[:, P:], plain[:, P:])
                state, top = model.stack(torch.cat([x_prompt, x_gen], 1))
            logits = model.head(top)
    return logits[0, P - 1 : P + n - 1]


@pytest.mark.parametrize("mode", MODES)
def test_cached_decode_equals_uncached_recompute(mode):
    model = tiny_model()
    prompt = random_ids(1, PROMPT_LEN)[0].tolist()
    for k in ([0, 1, 3] if mode == "fused" else [1]):
        tokens, logits = _steps(model, prompt, mode, k)
        ref = _uncached_logits(model, prompt, tokens, mode, k)
        assert (logits - ref).abs().max().item() <= 1e-4, (mode, k)


def test_soft_and_exact_greedy_equal_the_recurrence():
    model = tiny_model()
    prompt = random_ids(1, PROMPT_LEN, seed=4)[0].tolist()
    for mode, plain_prefix in (("soft", PROMPT_LEN), ("exact", 0)):
        new = generate(model, [prompt], NEW, mode=mode)[0]
        seq = torch.tensor([prompt + new])
        logits = model.recurrent_forward(seq, plain_prefix=plain_prefix).logits[0]
        assert new == logits[PROMPT_LEN - 1 : -1].argmax(-1).tolist(), mode


def test_fused_first_logits_equal_k_plus_one_passes():
    model = tiny_model()
    prompt = random_ids(1, PROMPT_LEN, seed=6)
    for k in (0, 1, 2, 5):
        first = next(stream(model, prompt, 1, mode="fused", prefill_passes=k)).logits[0]
        with torch.no_grad():
            ref = model(prompt, passes=k + 1).logits[0, -1]
        assert torch.allclose(first, ref, atol=1e-5), k


def test_standard_and_soft_share_the_first_token_and_differ_later():
    model = tiny_model()
    prompt = random_ids(1, PROMPT_LEN, seed=8)
    std = generate(model, prompt, 12, mode="standard")[0]
    soft = generate(model, prompt, 12, mode="soft")[0]
    assert std[0] == soft[0]
    a = next(stream(model, prompt, 1, mode="standard")).logits
    b = next(stream(model, prompt, 1, mode="soft")).logits
    assert torch.equal(a, b)
    assert std != soft  # the feedback changes the continuation of a random model


def test_standard_mode_is_the_network_without_fusion():
    model = tiny_model()
    plain = tiny_model(fusion="none")
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("fusion.")})
    prompt = random_ids(2, PROMPT_LEN, seed=3)
    a = list(stream(model, prompt, 6, mode="standard"))
    b = list(stream(plain, prompt, 6, mode="standard"))
    assert all(torch.equal(x.logits, y.logits) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="fusion='none'"):
        generate(plain, prompt, 2, mode="soft")


@pytest.mark.parametrize("mode", MODES)
def test_cached_decode_with_sliding_window_and_head_gates(mode):
    model = tiny_model(sliding_window=6, global_every=2, attn_gate=True)
    prompt = random_ids(1, PROMPT_LEN, seed=12)[0].tolist()
    tokens, logits = _steps(model, prompt, mode, 2)
    ref = _uncached_logits(model, prompt, tokens, mode, 2)
    assert (logits - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("mode", MODES)
def test_ragged_batch_equals_one_prompt_at_a_time(mode):
    model = tiny_model(sliding_window=5, global_every=2)
    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (3, 17, 9, 1)]
    batch = generate(model, prompts, 8, mode=mode, prefill_passes=2)
    alone = [generate(model, [p], 8, mode=mode, prefill_passes=2)[0] for p in prompts]
    assert batch == alone
    steps = list(stream(model, prompts, 8, mode=mode, prefill_passes=2))
    for row, p in enumerate(prompts):
        solo = list(stream(model, [p], 8, mode=mode, prefill_passes=2))
        for s_batch, s_solo in zip(steps, solo):
            assert torch.allclose(s_batch.logits[row], s_solo.logits[0], atol=1e-5)


def test_stop_tokens_end_rows_and_are_kept():
    model = tiny_model()
    prompts = [random_ids(1, 5, seed=s)[0].tolist() for s in (1, 2)]
    free = generate(model, prompts, 10, mode="soft")
    stop = free[0][3]
    out = generate(model, prompts, 10, mode="soft", stop_tokens=[stop])
    assert out[0] == free[0][: free[0].index(stop) + 1]
    second = free[1][: free[1].index(stop) + 1] if stop in free[1] else free[1]
    assert out[1] == second


def test_sampling_is_reproducible_from_seed_and_respects_top_k():
    model = tiny_model()
    prompt = random_ids(2, 6, seed=2)
    a = generate(model, prompt, 10, mode="soft", temperature=1.0, seed=7)
    b = generate(model, prompt, 10, mode="soft", temperature=1.0, seed=7)
    c = generate(model, prompt, 10, mode="soft", temperature=1.0, seed=8)
    assert a == b and a != c
    greedy = generate(model, prompt, 10, mode="soft")
    assert generate(model, prompt, 10, mode="soft", temperature=1.0, top_k=1, seed=3) == greedy
    assert generate(model, prompt, 10, mode="soft", temperature=0.7, top_p=1e-6, seed=3) == greedy


def test_top_k_and_top_p_filtering():
    from fullband.decode.sampling import sample

    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).log_softmax(-1)  # probs rise with the index
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, temperature=1.0, top_k=2, generator=g) for _ in range(300)])
    assert set(draws.flatten().tolist()) == {2, 3}
    p = logits.softmax(-1)[0]  # ~[0.03, 0.09, 0.24, 0.64]
    draws = torch.stack([sample(logits, temperature=1.0, top_p=float(p[3] + 0.01), generator=g) for _ in range(300)])
    assert set(draws.flatten().tolist()) == {2, 3}
    draws = torch.stack([sample(logits, temperature=1.0, top_p=float(p[3] - 0.01), generator=g) for _ in range(300)])
    assert set(draws.flatten().tolist()) == {3}


def test_generate_restores_training_mode_and_accepts_tensor_prompts():
    model = tiny_model().train()
    out = generate(model, torch.tensor([1, 2, 3]), 3, mode="fused")
    assert model.training and len(out) == 1 and len(out[0]) == 3


@pytest.mark.parametrize("grad", [False, True])
def test_the_callers_grad_mode_and_train_flag_hold_between_steps(grad):
    """stream computes its steps in inference mode (grad=True: with gradients) and eval mode, and gives the caller
    its own back while it holds a step: a training step's backward() inside the loop works (it used to fail:
    inference mode was left on across the yield), and a caller's no_grad holds around a grad=True stream."""
    model, ids = tiny_model().train(), random_ids(1, 6)
    seen = []
    with torch.no_grad() if grad else torch.enable_grad():
        for step in stream(model, [[1, 2, 3]], 3, mode="fused", grad=grad):
            seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled(), model.training,
                         step.logits.requires_grad))
            if not grad:
                model.zero_grad()
                model(ids).logits.sum().backward()
                assert model.embed.weight.grad is not None
    assert seen == [(not grad, False, True, grad)] * 3 and model.training


def test_compiled_decode_equals_eager():
    model = tiny_model()
    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (4, 9)]
    for mode in ("standard", "soft"):
        assert generate(model, prompts, 6, mode=mode, compile=True) == generate(model, prompts, 6, mode=mode)


def test_decode_mode_owns_the_passes_rule():
    from fullband import DecodeMode, InputError, ModelConfig

    assert [DecodeMode(m).passes for m in ("standard", "soft", "exact")] == [1, 1, 1]
    assert DecodeMode("fused", 2).passes == 3 and DecodeMode("fused", 0).passes == 1
    auto = DecodeMode("fused", 5, tol=1e-4)  # until the update is below 1e-4, at most 5 fused passes
    assert auto.passes == 6 and auto.tolerance == 1e-4 and auto.adaptive and DecodeMode("soft", tol=1e-4).tolerance is None
    # the older spelling with the word "auto" means the same
    assert DecodeMode("fused", "auto", tol=1e-4, max_passes=5) == auto == DecodeMode.of("fused", "auto", tol=1e-4, max_passes=5)
    assert DecodeMode("fused", "auto") == DecodeMode("fused", 32, tol=1e-3) == DecodeMode.parse("fused:auto")
    assert DecodeMode("fused", 2).tolerance is None and not DecodeMode("fused", 2).adaptive
    assert DecodeMode.parse("fused:2") == DecodeMode("fused", 2)
    assert DecodeMode.parse("soft").feeds_state and not DecodeMode.parse("standard").feeds_state
    assert DecodeMode.from_passes(1) == DecodeMode("standard") and DecodeMode.from_passes(3) == DecodeMode("fused", 2)
    assert [DecodeMode("fused", 2).label, auto.label] == ["fused k=2", "fused auto tol=0.0001"]
    for bad, match in ((lambda: DecodeMode("fast"), "mode='fast'"), (lambda: DecodeMode("fused", -1), ">= 0"),
                       (lambda: DecodeMode.parse("soft:2"), "only fused"), (lambda: DecodeMode("fused", "x"), "'auto'"),
                       (lambda: DecodeMode.parse("fused:\u00b2"), "fused:K"),
                       (lambda: DecodeMode("fused", 3, max_passes=4), "max_passes goes with"),
                       (lambda: DecodeMode("fused", 2, tol=0.0), "prefill_tol"),
                       (lambda: DecodeMode("fused", 200).check(ModelConfig(max_seq_len=128)), "cap of max_seq_len=128"),
                       (lambda: DecodeMode("soft").check(ModelConfig(fusion="none")), "fusion='none'")):
        with pytest.raises(InputError, match=match):
            bad()


def test_a_prompt_is_never_read_with_more_passes_than_it_is_long():
    from fullband import DecodeMode

    model = tiny_model()
    prompt = random_ids(1, 4, seed=2)
    with torch.no_grad():
        assert model.read(prompt, DecodeMode("fused", 9)).passes_used == 4
    assert next(stream(model, prompt, 1, mode="fused", prefill_passes=9)).prefill_passes == 4


def test_generate_takes_a_sampling_object_and_the_separate_settings():
    from fullband import Sampling

    model = tiny_model()
    prompt = random_ids(2, 6, seed=2)
    a = generate(model, prompt, 8, mode="soft", sampling=Sampling(temperature=1.0, top_k=5, seed=4))
    assert a == generate(model, prompt, 8, mode="soft", temperature=1.0, top_k=5, seed=4)
    assert a == generate(model, prompt, 8, mode="soft", sampling=Sampling(temperature=1.0, top_k=5), seed=4)
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-1)
