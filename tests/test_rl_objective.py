"""Policy-gradient pieces (fullband.rl.objective, rewards, step) against direct computations, and a micro run whose
reward is trivially learnable."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_model
from fullband.errors import ConfigError, DataError, InputError
from fullband.rl.objective import group_advantages, policy_loss
from fullband.rl.rewards import exact_answer, load_reward
from fullband.rl.step import RLSettings, rl_step


def test_advantages_are_standardised_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 3.0, 1.0, 2.0, 2.0])
    got = group_advantages(rewards, 4)
    for g in range(3):
        r = rewards[4 * g: 4 * g + 4].tolist()
        mean = sum(r) / 4
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / 3)  # the unbiased estimate, as torch.std
        for i, x in enumerate(r):
            assert got[4 * g + i] == pytest.approx((x - mean) / (std + 1e-6), abs=1e-6)
    assert (got[4:8] == 0).all()  # equal rewards: nothing to learn from that group
    with pytest.raises(InputError, match="G >= 2"):
        group_advantages(rewards, 1)
    with pytest.raises(InputError, match="G >= 2"):
        group_advantages(rewards, 5)


def test_the_clipped_token_level_loss_equals_a_direct_computation():
    torch.manual_seed(0)
    B, R = 4, 5
    logp = torch.randn(B, R, requires_grad=True)
    old = logp.detach() + 0.4 * torch.randn(B, R)
    ref = logp.detach() + 0.3 * torch.randn(B, R)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    out = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, ref=ref, kl_coef=0.1)
    total, clipped, n = 0.0, 0, 0
    for b in range(B):
        for t in range(R):
            if not mask[b, t]:
                continue
            ratio = math.exp(float(logp[b, t].detach() - old[b, t]))
            c = min(max(ratio, 0.8), 1.28)
            d = float(ref[b, t] - logp[b, t].detach())
            total += min(ratio * float(adv[b]), c * float(adv[b])) - 0.1 * (math.exp(d) - d - 1)
            clipped += c != ratio
            n += 1
    assert float(out.loss.detach()) == pytest.approx(-total / n, rel=1e-5)
    assert out.clip_fraction == pytest.approx(clipped / n) and 0 < out.clip_fraction < 1
    out.loss.backward()
    assert (logp.grad[~mask] == 0).all() and logp.grad[mask].abs().sum() > 0  # padding gets no gradient


def test_the_built_in_reward_and_user_functions(tmp_path):
    assert exact_answer("q", "so 3 + 4 = 7. Answer: 7", {"answer": 7}) == 1.0
    assert exact_answer("q", "Answer: 8", {"answer": "7"}) == 0.0 and exact_answer("q", "7", {"answer": 7}) == 0.0
    (tmp_path / "mine.py").write_text("def r(p, y, e): return len(y) / 10\n"
                                      "def nan(p, y, e): return float('nan')\n"
                                      "def boom(p, y, e): raise KeyError('answer')\n"
                                      "def text(p, y, e): return 'yes'\n")
    mine = str(tmp_path / "mine.py")
    assert load_reward(f"{mine}:r")("p", "abcde", {}) == 0.5
    with pytest.raises(DataError, match=r"returned nan \(prompt 'p', response 'y'\); accepted: a finite number"):
        load_reward(f"{mine}:nan")("p", "y", {})
    with pytest.raises(DataError, match=r"raised KeyError: 'answer'"):
        load_reward(f"{mine}:boom")("p", "y", {})
    with pytest.raises(DataError, match=r"returned 'yes'"):
        load_reward(f"{mine}:text")("p", "y", {})
    with pytest.raises(ConfigError, match="has no function 'missing'"):
        load_reward(f"{mine}:missing")
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_here'"):
        load_reward("no_such_module_here:f")
    with pytest.raises(ConfigError, match="accepted: answer, contains, or 'module:function'"):
        load_reward("answr")


def test_a_reward_that_hangs_or_exits_is_one_line_naming_it_and_the_prompt(tmp_path):
    """A call that never returns ends at rl.reward_timeout, a sys.exit() inside it is an error (not a silent end of
    the run), each naming the reward and the prompt; a slow call within the limit is fine; Ctrl-C still stops."""
    import time

    (tmp_path / "bad.py").write_text("import sys, time\n"
                                     "def hang(p, y, e):\n    while True: pass\n"
                                     "def sleepy(p, y, e):\n    time.sleep(0.05); return 1\n"
                                     "def leave(p, y, e):\n    sys.exit(3)\n"
                                     "def interrupted(p, y, e):\n    raise KeyboardInterrupt\n")
    bad = str(tmp_path / "bad.py")
    t0 = time.perf_counter()
    with pytest.raises(DataError, match=r"the reward '.*bad.py:hang' did not return within rl.reward_timeout=0.2 s "
                                        r"\(prompt 'What is 2 \+ 2\?', response 'four'\)"):
        load_reward(f"{bad}:hang", timeout=0.2)("What is 2 + 2?", "four", {})
    assert time.perf_counter() - t0 < 5
    assert load_reward(f"{bad}:sleepy", timeout=5)("p", "y", {}) == 1.0
    import signal

    outer = signal.getitimer(signal.ITIMER_REAL)[0]  # pytest-timeout's own alarm, where it uses one: kept
    assert outer == 0 or 800 < outer <= 900

    class Outer(Exception):
        pass

    def outer_alarm(signum, frame):
        raise Outer

    before = signal.signal(signal.SIGALRM, outer_alarm)  # someone else's alarm, due before the reward's: it fires
    saved = signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        with pytest.raises(Outer):
            load_reward(f"{bad}:hang", timeout=30)("p", "y", {})
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # it went off: not set again to go off twice
    finally:
        signal.signal(signal.SIGALRM, before)
        signal.setitimer(signal.ITIMER_REAL, *saved)
    with pytest.raises(DataError, match=r"called sys.exit\(3\) \(prompt 'p', response 'y'\)"):
        load_reward(f"{bad}:leave")("p", "y", {})
    with pytest.raises(KeyboardInterrupt):
        load_reward(f"{bad}:interrupted", timeout=5)("p", "y", {})


def test_bad_settings_are_named():
    with pytest.raises(InputError, match="rl.group=1 is invalid"):
        RLSettings(group=1)
    with pytest.raises(InputError, match="logprob path 'jacobi' is unknown"):
        RLSettings(logprob="jacobi")
    # a second update on the same samples scores a moved policy: the recorded states are stale
    with pytest.raises(InputError, match=r"rl.logprob='replay' with rl.updates=2: .* stale .* accepted with updates "
                                         r"> 1: logprob = 'exact' or 'jacobi:K'"):
        RLSettings(logprob="replay", updates=2)
    assert RLSettings(logprob="jacobi:4", updates=2).updates == 2


@pytest.mark.parametrize("changes", [dict(logprob="exact"), dict(logprob="replay"),
                                     dict(algorithm="rejection-sft", accept=1 / 3),
                                     dict(algorithm="rejection-sft", accept=1 / 3, mode="fused:1")])
def test_a_trivially_learnable_reward_is_learned(changes):
    """Reward: the share of a reply's tokens that are id 3, of 16. From ~1/16 to > 0.9 within 20 steps, by policy
    gradient (each log-prob path) and by on-policy SFT on the replies holding a 3 (SOFT and FUSED)."""
    torch.manual_seed(0)
    model = tiny_model(seed=1, vocab_size=16, bos_token_id=15)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    settings = RLSettings(**{"mode": "soft", "group": 8, "max_new_tokens": 3, **changes})
    prompts = [[15, 4], [15, 7, 9], [15, 1], [15, 12, 2, 5]]
    rows = [rl_step(model, optimizer, prompts, lambda i, y: sum(t == 3 for t in y) / len(y), settings, seed=step)
            for step in range(20)]
    rewards = [r["reward"] for r in rows]
    assert rewards[0] < 0.2 and min(rewards[-5:]) > 0.9, [round(r, 2) for r in rewards]
    if settings.algorithm == "rejection-sft":
        assert rows[0]["kept"] < rows[-1]["kept"] <= 32, [r["kept"] for r in rows]


def test_rejection_sampling_keeps_what_a_direct_computation_keeps():
    from fullband.rl.step import kept_rows

    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    lengths = [9, 3, 4, 2, 5, 5, 7, 7]
    assert kept_rows(rewards, lengths, 2, 1.0, "correct") == [0, 2, 6, 7]
    assert kept_rows(rewards, lengths, 2, 0.5, "correct") == [0, 2, 3, 6, 7]
    # each group of 4's shortest reply at reward >= accept (the first on a tie)
    assert kept_rows(rewards, lengths, 4, 1.0, "shortest") == [2, 6]
    assert kept_rows(rewards, lengths, 4, 0.5, "shortest") == [3, 6]
    assert kept_rows(rewards, lengths, 4, 2.0, "shortest") == []
    with pytest.raises(InputError, match="rl.keep='longest' is unknown; accepted: correct, shortest"):
        RLSettings(keep="longest")
    with pytest.raises(InputError, match="rl.algorithm='ppo' is unknown; accepted: grpo, rejection-sft"):
        RLSettings(algorithm="ppo")


def test_later_updates_on_one_batch_move_the_ratio_and_the_clip_acts():
    def clip(updates: int) -> float:
        torch.manual_seed(0)
        model = tiny_model(seed=1, vocab_size=16, bos_token_id=15)
        optimizer = torch.optim.Adam(model.parameters(), lr=5e-2)
        settings = RLSettings(mode="soft", group=4, max_new_tokens=4, updates=updates, clip_low=0.05, clip_high=0.05)
        return rl_step(model, optimizer, [[15, 4], [15, 7, 9]], lambda i, y: float(3 in y), settings,
                       seed=1)["clip_fraction"]

    assert clip(1) == 0.0  # one update: the ratio is 1 everywhere
    assert clip(4) > 0.0


def test_per_token_advantages_give_each_token_its_own_term():
    """On-policy distillation's advantages, one per token (teacher - old, 0 past each response), in the clipped
    loss against a direct computation; one per response is the same loss as that number on each of its tokens."""
    from fullband.rl.objective import distill_advantages

    torch.manual_seed(1)
    B, R = 3, 4
    logp = torch.randn(B, R, requires_grad=True)
    old = logp.detach() + 0.3 * torch.randn(B, R)
    teacher = old + torch.randn(B, R)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    adv = distill_advantages(teacher, old, mask)
    assert adv.shape == (B, R) and (adv[~mask] == 0).all() and torch.equal(adv[mask], (teacher - old)[mask])
    out = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    total = 0.0
    for b, t in mask.nonzero().tolist():
        ratio = math.exp(float(logp[b, t].detach() - old[b, t]))
        a = float(teacher[b, t] - old[b, t])
        total += min(ratio * a, min(max(ratio, 0.8), 1.28) * a)
    assert float(out.loss.detach()) == pytest.approx(-total / int(mask.sum()), rel=1e-5)
    per_row = torch.tensor([0.5, -1.0, 2.0])
    assert torch.equal(policy_loss(logp, old, per_row, mask).loss,
                       policy_loss(logp, old, per_row[:, None].expand(B, R), mask).loss)


def test_the_teacher_is_the_standard_read_of_the_sampled_tokens():
    """standard_logprobs (one plain pass over prompt + response) equals the decode engine's STANDARD log-probs of the
    same tokens, teacher-forced step by step; a SOFT rollout's own log-probs differ from it (the fed read)."""
    from dataclasses import replace

    from fullband.model.mode import DecodeMode
    from fullband.rl.logprob import logprobs, rollout, standard_logprobs
    from fullband.decode.sampling import Sampling

    model = tiny_model(seed=2, vocab_size=16, bos_token_id=15).double()
    r = rollout(model, [[15, 4], [15, 7, 9, 1]], 5, mode="soft", sampling=Sampling(temperature=1.0, seed=3))
    got = standard_logprobs(model, r)
    want = logprobs(model, replace(r, mode=DecodeMode.parse("standard")), "exact").detach()
    assert not got.requires_grad and torch.allclose(got, want, atol=1e-12, rtol=0)
    assert (got[~r.mask] == 0).all() and (got - r.logprobs.double()).abs()[r.mask].max() > 1e-3
    # rl.hold's distributions: the STANDARD read's logits at exactly the response tokens, in the rollout's order
    from fullband.rl.logprob import response_targets, standard_response_logits

    inputs, targets, _ = response_targets(model, r)
    logits = standard_response_logits(model, inputs, targets)
    assert logits.shape == (int(r.mask.sum()), 16) and logits.requires_grad
    picked = torch.log_softmax(logits, -1).gather(-1, targets[targets != -100][:, None])[:, 0]
    assert torch.allclose(picked, got[r.mask], atol=1e-12, rtol=0)


@pytest.mark.parametrize("teacher,hold", [("standard", 0.0), ("reference", 0.0), ("standard", 1.0)])
def test_on_policy_distillation_pulls_the_fed_read_towards_the_standard_read(teacher, hold):
    """rl.algorithm = "distill": SOFT samples, each token advantaged by the teacher's STANDARD log-prob minus the
    sampler's. The first update's loss is the sampled KL(policy || teacher) itself (ratio 1, nothing clipped). After
    25 steps, on 64 fresh SOFT samples: towards the frozen start (teacher 'reference'), the fed read has met the
    start's STANDARD read and the model's own STANDARD read stayed where it was; towards its own STANDARD read
    (teacher 'standard') the two reads meet too, but the STANDARD read moved away from the start (docs/method.md:
    why the frozen teacher is the default), unless rl.hold holds it (KL to the start's STANDARD read, logged as
    hold_kl)."""
    import copy

    from fullband.decode.sampling import Sampling
    from fullband.rl.logprob import logprobs, rollout, standard_logprobs

    torch.manual_seed(0)
    model = tiny_model(seed=4, vocab_size=16, bos_token_id=15)
    start = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    settings = RLSettings(algorithm="distill", teacher=teacher, mode="soft", group=8, max_new_tokens=6, hold=hold)
    prompts = [[15, 4, 2], [15, 7, 9], [15, 1, 1, 3], [15, 12, 5]]

    def kls() -> tuple[float, float, float]:
        """Sampled KL per token of the fed read to the start's STANDARD read, to its own, and own to start's."""
        r = rollout(model, [p for p in prompts for _ in range(16)], 6, mode="soft",
                    sampling=Sampling(temperature=1.0, seed=99))
        fed, own, first = logprobs(model, r, "exact").detach(), standard_logprobs(model, r), standard_logprobs(start, r)
        n = r.mask.sum()
        return float((fed - first).sum() / n), float((fed - own).sum() / n), float((own - first).sum() / n)

    before = kls()
    rows = [rl_step(model, optimizer, prompts, lambda i, y: 0.0, settings, seed=step, reference=start)
            for step in range(25)]
    assert rows[0]["loss"] == pytest.approx(rows[0]["teacher_kl"], rel=1e-5) and rows[0]["clip_fraction"] == 0
    to_start, to_own, moved = kls()
    assert before[0] > 0.05 and before[2] == 0
    assert to_own < before[1] / 5, (before, to_own)
    if teacher == "reference":
        assert to_start < before[0] / 5 and abs(moved) < 0.01, (before, to_start, moved)
    elif not hold:
        assert moved > 0.1 and "hold_kl" not in rows[0], (before, moved)
    else:
        assert rows[0]["hold_kl"] == 0 and all(r["hold_kl"] > 0 for r in rows[1:])  # the policy was the start
        assert abs(moved) < 0.03, (before, moved)


def test_distillation_settings_are_checked():
    with pytest.raises(InputError, match="rl.teacher='pretrained' is unknown; accepted: standard, reference"):
        RLSettings(algorithm="distill", teacher="pretrained")
    with pytest.raises(InputError, match=r"rl.algorithm='distill' with rl.mode='standard' and rl.teacher='standard': "
                                         r"the policy would be its own teacher .* accepted: a fed mode"):
        RLSettings(algorithm="distill", mode="standard", teacher="standard")
    assert RLSettings(algorithm="distill", mode="standard").needs_reference  # the default teacher: the frozen start
    assert not RLSettings(algorithm="distill", teacher="standard").needs_reference
    assert RLSettings(kl_coef=0.1).needs_reference and not RLSettings().needs_reference
    assert RLSettings(hold=0.5).needs_reference
    with pytest.raises(InputError, match=r"rl.hold=-1 is invalid"):
        RLSettings(hold=-1)
    with pytest.raises(InputError, match=r"rl.hold=0.5 with rl.algorithm='rejection-sft': .* accepted: rl.hold = 0"):
        RLSettings(algorithm="rejection-sft", hold=0.5)
    model = tiny_model(seed=1, vocab_size=16, bos_token_id=15)
    with pytest.raises(InputError, match="rl.teacher='reference' needs the starting model"):
        rl_step(model, torch.optim.Adam(model.parameters()), [[15, 4]], lambda i, y: 0.0,
                RLSettings(algorithm="distill", max_new_tokens=2), seed=0)
