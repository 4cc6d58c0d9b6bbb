"""The WSD learning-rate factor and the pass schedule: shapes, reproducible draws, stage limits, parsing, errors."""

from __future__ import annotations

import math
import tomllib
from collections import Counter

import pytest

from fullband.errors import ConfigError
from fullband.train.schedule import PRESETS, PassSchedule, cooldown_steps, in_cooldown, wsd_factor

# ---------------------------------------------------------------- WSD


def test_wsd_shape():
    total, warmup = 100, 10
    f = [wsd_factor(s, total, warmup, 0.25) for s in range(total + 1)]
    assert f[0] == pytest.approx(0.1) and f[9] == 1.0  # step 0 already moves; the ramp ends at warmup - 1
    assert all(a < b for a, b in zip(f[:10], f[1:10]))  # strictly increasing warmup
    assert all(x == 1.0 for x in f[10:76])  # flat, including the cooldown's first step (75)
    assert f[99] == pytest.approx(1 / 25) and f[99] > 0 and f[100] == 0.0  # last step small but > 0; 0 after it
    steps = [b - a for a, b in zip(f[75:100], f[76:101])]
    assert all(d == pytest.approx(-1 / 25) for d in steps)  # a linear decay
    assert [in_cooldown(s, total, 0.25) for s in (74, 75, 99)] == [False, True, True]
    assert wsd_factor(250, total, warmup, 0.25) == 0.0  # past the end


def test_wsd_edges():
    assert wsd_factor(0, 50, 0, 0.25) == 1.0  # no warmup
    assert [wsd_factor(s, 50, 5, 0.0) for s in (10, 49)] == [1.0, 1.0]  # no cooldown
    assert not in_cooldown(49, 50, 0.0)
    assert cooldown_steps(10, 0.01) == 1  # any positive fraction decays over at least one step
    assert cooldown_steps(1000, 0.25) == 250
    # warmup and cooldown overlap on a short run: the smaller factor wins
    assert wsd_factor(3, 10, 8, 0.5) == pytest.approx(min(4 / 8, 1.0))
    assert wsd_factor(7, 10, 8, 0.5) == pytest.approx(min(8 / 8, 3 / 5))
    assert wsd_factor(0, 1, 1, 1.0) == 1.0  # a one-step run takes one full step


@pytest.mark.parametrize(
    "args, field",
    [
        ((-1, 100, 10, 0.25), "step"),
        ((1.5, 100, 10, 0.25), "step"),
        ((0, 0, 0, 0.25), "total_steps"),
        ((0, 100, -1, 0.25), "warmup_steps"),
        ((0, 100, 101, 0.25), "warmup_steps"),
        ((0, 100, 10, 1.5), "cooldown_fraction"),
        ((0, 100, 10, -0.1), "cooldown_fraction"),
    ],
)
def test_wsd_rejects_bad_arguments(args, field):
    with pytest.raises(ConfigError, match=field):
        wsd_factor(*args)


# ---------------------------------------------------------------- sampling


def _draws(schedule: PassSchedule, total: int, seed: int, steps=None) -> list[int]:
    return [schedule.sample(s, total, seed) for s in (range(total) if steps is None else steps)]


@pytest.mark.parametrize("name", ["paper-100b", "one-two-three", "one-two"])
def test_frequencies_match_probabilities(name):
    schedule = PassSchedule.preset(name)
    n = 4000
    counts = Counter(_draws(schedule, n, seed=7))
    for k, p in schedule.stages[0].probs.items():
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(counts[k] / n - p) < 4 * sigma + 1e-9, (k, counts[k] / n, p)
    assert set(counts) <= set(schedule.stages[0].probs)


def test_draws_depend_only_on_seed_and_step():
    n = 300
    a = _draws(PassSchedule.preset("one-two-three"), n, seed=3)
    b = _draws(PassSchedule.parse("one-two-three"), n, seed=3)  # a fresh object, as in another process
    backwards = _draws(PassSchedule.preset("one-two-three"), n, seed=3, steps=range(n - 1, -1, -1))[::-1]
    assert a == b == backwards  # call order and object identity do not matter (a resume draws the same k)
    assert _draws(PassSchedule.preset("one-two-three"), n, seed=4) != a


def test_stage_boundaries_are_respected():
    schedule = PassSchedule.preset("paper-200b")
    for total in (1000, 1001):
        draws = _draws(schedule, total, seed=0)
        half = math.ceil(total / 2)
        assert all(k == 1 for k in draws[:half])  # single-pass first half
        assert max(draws[half:]) > 1  # feedback passes from mid training
        assert schedule.stage_index(half - 1, total) == 0 and schedule.stage_index(half, total) == 1
    assert PassSchedule.preset("three-pass").sample(5, 10, 0) == 3


def test_mean_and_max_passes():
    s = PassSchedule.preset("paper-200b")
    assert s.mean_passes() == pytest.approx(0.5 * 1 + 0.5 * 1.28)
    assert s.mean_passes(1001) == pytest.approx((501 * 1 + 500 * 1.28) / 1001)
    assert PassSchedule.preset("one-two-three").mean_passes(10) == pytest.approx(1.28)
    assert s.max_passes == 3 and PassSchedule.preset("none").max_passes == 1
    assert PassSchedule([(1.0, {1: 0.5, 4: 0.5, 9: 0.0})]).max_passes == 4  # zero-probability k never drawn


def test_sample_rejects_bad_arguments():
    s = PassSchedule.preset("paper-100b")
    with pytest.raises(ConfigError, match="seed"):
        s.sample(0, 10, -1)
    with pytest.raises(ConfigError, match="step"):
        s.sample(-1, 10, 0)
    with pytest.raises(ConfigError, match="total_steps"):
        s.sample(0, 0, 0)


# ---------------------------------------------------------------- presets and parsing


def test_presets_parse_and_round_trip():
    for name in PRESETS:
        s = PassSchedule.parse(name)
        assert s.name == name and PassSchedule.parse(s.to_data()).stages == s.stages
    assert PassSchedule.preset("paper-200b").stages[1].probs == {1: 0.75, 2: 0.22, 3: 0.03}


def test_parse_toml_data():
    text = """
    passes = [
      {until = 0.25, probs = {"1" = 1.0}},
      {until = 1.0, probs = {"1" = 0.75, "3" = 0.25}},
    ]
    """
    s = PassSchedule.parse(tomllib.loads(text)["passes"])
    assert [(st.until, st.probs) for st in s.stages] == [(0.25, {1: 1.0}), (1.0, {1: 0.75, 3: 0.25})]
    assert s.to_data()[1] == {"until": 1.0, "probs": {"1": 0.75, "3": 0.25}}
    assert PassSchedule.parse(s) is s
    assert PassSchedule.parse([[1.0, {2: 1}]]).sample(0, 5, 0) == 2  # (until, probs) pairs also work


@pytest.mark.parametrize(
    "stages, message",
    [
        ([(1.0, {1: 0.75, 2: 0.15})], "sum to 0.9"),
        ([(1.0, {0: 1.0})], "k >= 1"),
        ([(1.0, {"two": 1.0})], "k >= 1"),
        ([(0.5, {1: 1.0}), (0.9, {2: 1.0})], "last until is 1.0"),
        ([(0.6, {1: 1.0}), (0.5, {2: 1.0}), (1.0, {3: 1.0})], "increasing"),
        ([(1.0, {1: 1.2, 2: -0.2})], "0 <= p <= 1"),
        ([(0.0, {1: 1.0}), (1.0, {1: 1.0})], "0 < until"),
        ([(1.0, {})], "non-empty"),
        ([], "no stages"),
        ([{"until": 1.0, "prob": {"1": 1.0}}], "did you mean 'probs'"),
    ],
)
def test_invalid_stages_are_explained(stages, message):
    with pytest.raises(ConfigError, match=message):
        PassSchedule.parse(stages)


def test_unknown_preset_lists_presets_and_suggests():
    with pytest.raises(ConfigError, match=r"did you mean 'paper-200b'\?.*one-two-three") as err:
        PassSchedule.parse("paper-200")
    assert all(name in str(err.value) for name in PRESETS)
    with pytest.raises(ConfigError, match="preset name"):
        PassSchedule.parse(3)


def test_growing_schedule_reaches_the_fixed_point_depth():
    grow = PassSchedule.parse("grow:11")
    assert grow.name == "grow:11" and [s.until for s in grow.stages] == [0.25, 0.5, 0.75, 1.0]
    assert [s.probs for s in grow.stages] == [{1: 1.0}, {2: 0.5, 4: 0.5}, {4: 0.5, 8: 0.5}, {8: 0.5, 11: 0.5}]
    assert [s.probs for s in PassSchedule.parse("grow:3").stages] == [{1: 1.0}, {2: 0.5, 3: 0.5}, {3: 1.0}, {3: 1.0}]
    assert PassSchedule.parse(grow.to_data()).stages == grow.stages
    for bad in ("grow:", "grow:0", "grow:x", "grow:\u00b2"):
        with pytest.raises(ConfigError, match="grow:N needs an integer N >= 1"):
            PassSchedule.parse(bad)


# ---------------------------------------------------------------- the adaptive schedule
def test_adaptive_starts_at_the_papers_mix_and_draws_from_seed_and_step():
    from fullband.train.schedule import AdaptiveSchedule, PassMix, parse_schedule

    sched = parse_schedule("adaptive")
    assert isinstance(sched, AdaptiveSchedule) and sched.start() == PassMix(0.25, 3)
    assert sched.probs(sched.start()) == pytest.approx({1: 0.75, 2: 0.22, 3: 0.03})
    assert sched.mean_passes() == pytest.approx(1.28)
    assert sched.probs(PassMix(0.4, 2)) == pytest.approx({1: 0.6, 2: 0.4})
    wide = sched.probs(PassMix(0.5, 5))
    assert sum(wide.values()) == pytest.approx(1) and wide[5] == pytest.approx(0.06) and wide[3] == pytest.approx(0.44 / 3)
    mix = PassMix(0.5, 4)
    draws = [sched.sample(s, 100, 7, mix) for s in range(4000)]
    assert draws == [sched.sample(s, 100, 7, mix) for s in range(4000)]  # a function of (seed, step, mix)
    freq = Counter(draws)
    assert set(freq) == {1, 2, 3, 4} and abs(freq[1] / 4000 - 0.5) < 0.03 and abs(freq[4] / 4000 - 0.06) < 0.015
    assert sched.max_passes == 8 and parse_schedule({"schedule": "adaptive", "cap": 5}).max_passes == 5


def test_adaptive_decisions():
    from fullband.train.schedule import AdaptiveSchedule, PassMix

    assert AdaptiveSchedule().decide(PassMix(0.25, 3), 0.3, 0.01) == (PassMix(0.25, 3), "lower")  # the paper's: the floor
    assert AdaptiveSchedule().decide(PassMix(0.3, 4), 0.3, 0.01) == (PassMix(0.25, 4), "lower")
    s = AdaptiveSchedule(min_share=0.05, min_top=2)  # a floor below the paper's mix
    start = PassMix(0.25, 3)
    assert s.decide(start, 0.7, 0.01) == (start, "hold")  # between margin and expand
    assert s.decide(start, 0.92, 0.01) == (PassMix(0.3, 3), "raise")  # barely contracting: more multi-pass steps
    assert s.decide(start, 0.7, 0.4) == (PassMix(0.3, 3), "raise")  # the residual has not settled by the horizon
    assert s.decide(start, 1.05, 0.5) == (PassMix(0.3, 4), "raise")  # expanding: one pass deeper too
    assert s.decide(start, float("nan"), 0.0) == (PassMix(0.3, 4), "raise")
    assert s.decide(PassMix(0.75, 3), 0.95, 0.0) == (PassMix(0.75, 4), "raise")  # the share at its maximum
    assert s.decide(PassMix(0.75, 8), 1.5, 1.0) == (PassMix(0.75, 8), "raise")  # capped
    assert s.decide(start, 0.3, 0.01) == (PassMix(0.2, 3), "lower")  # contracting with margin
    assert s.decide(PassMix(0.05, 3), 0.3, 0.01) == (PassMix(0.05, 2), "lower")  # the share at its minimum
    assert s.decide(PassMix(0.05, 2), 0.3, 0.01) == (PassMix(0.05, 2), "lower")
    mix = start
    for _ in range(3):  # 0.25 + 3 x 0.05, with no float drift
        mix, _ = s.decide(mix, 0.95, 0.0)
    assert mix.share == 0.4


@pytest.mark.parametrize("value, message", [
    ({"schedule": "adaptive", "evrey": 5}, r"unknown key 'train.passes.evrey' \(did you mean 'every'\?\)"),
    ({"schedule": "adaptive", "every": 0}, r"train.passes.every=0"),
    ({"schedule": "adaptive", "share": 0.9}, r"share=0.9 lies outside \[min_share, max_share\] = \[0.25, 0.75\]"),
    ({"schedule": "adaptive", "top": 9}, r"top=9 lies outside \[min_top, cap\] = \[3, 8\]"),
    ({"schedule": "adaptive", "margin": 0.95}, r"margin=0.95 is not below train.passes.expand=0.9"),
    ({"every": 5}, r'a table without schedule = "adaptive"'),
    ("adaptve", r"did you mean 'adaptive'"),
])
def test_adaptive_settings_errors(value, message):
    from fullband.train.schedule import parse_schedule

    with pytest.raises(ConfigError, match=message):
        parse_schedule(value)


def test_adaptive_refused_where_nothing_can_be_measured():
    from fullband.train.config import RunConfig

    with pytest.raises(ConfigError, match="model.fusion='none' has no pass map to measure"):
        RunConfig.from_dict({"model": {"fusion": "none"}, "train": {"passes": "adaptive"}})
    with pytest.raises(ConfigError, match="FSDP's sharded weights"):
        RunConfig.from_dict({"train": {"passes": "adaptive", "parallel": "fsdp"}})
    saved = RunConfig.from_dict({"train": {"passes": {"schedule": "adaptive", "every": 5}}}).to_dict()
    assert RunConfig.from_dict(saved).train.schedule.every == 5  # run.json round trip


def test_training_measures_what_eval_stability_reports(tmp_path, corpus, cache):
    """The growth the adaptive schedule acts on at a step equals `fullband eval stability`'s at that horizon on the
    checkpoint of that step (the same held-out windows, directions and linearisation point)."""
    import json

    from conftest import write_config
    from fullband.eval.commands import eval_stability
    from fullband.train.config import load_run_config
    from fullband.train.trainer import train

    passes = '{schedule = "adaptive", every = 4, horizon = 8, windows = 2, vectors = 3}'
    train(load_run_config(write_config(tmp_path, corpus, cache, steps=9, ckpt_every=4, keep_last=3, passes=passes)))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    measured = {r["step"]: r["adapt"] for r in rows if "adapt" in r}
    assert set(measured) == {4, 8}
    for step in (4, 8):
        result = eval_stability(tmp_path / "run" / f"step_{step:06d}", ks=(1, 9), seq_len=32, windows=4, batch_size=4,
                                contraction_windows=2, progress=False, out=tmp_path / f"eval{step}")
        con = result["contraction"]
        assert con["growth"][con["horizons"].index(8)] == pytest.approx(measured[step]["growth"], rel=1e-6)
