"""Self-distillation (train.distill, train.distill_until): the fed passes drawn towards the first pass's next-token
distribution. The term against its definition and its gradient against finite differences, nothing changed when it
is off, the weight's schedule, training logs, a resume bit for bit, an older run's settings, and the config errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_resume_is_bitwise, random_ids, tiny_model, write_config
from fullband.errors import ConfigError
from fullband.model.objective import distill_kl, objective

SMALL = dict(d_model=16, n_heads=2, n_kv_heads=1, max_seq_len=32, init_std=0.3)  # large weights: large gradients


def _targets(ids: torch.Tensor) -> torch.Tensor:
    targets = torch.roll(ids, -1, 1)
    targets[:, -1] = -100
    targets[0, 3] = -100
    return targets


def _pass_logits(model, ids, passes: int) -> list[torch.Tensor]:
    tops = []
    model(ids, passes=passes, return_logits=False, each_pass=lambda j, s, t: tops.append(t))
    return [model.head(t) for t in tops]


def test_the_term_is_the_kl_from_the_first_pass_to_each_fed_pass():
    model = tiny_model(3, **SMALL).double()
    ids = random_ids(2, 7, seed=4)
    targets = _targets(ids)
    out = objective(model, ids, targets, 3, distill=0.5, noise=False)
    base = objective(model, ids, targets, 3, noise=False)
    assert base.distill is None and torch.equal(out.loss, base.loss + 0.5 * out.distill)
    logits = _pass_logits(model, ids, 3)
    scored = targets != -100
    p1 = F.softmax(logits[0][scored], -1)
    want = torch.stack([(p1 * (p1.log() - F.log_softmax(lg[scored], -1))).sum(-1).mean() for lg in logits[1:]]).mean()
    assert torch.allclose(out.distill, want, rtol=1e-12, atol=0) and float(want.detach()) > 1e-4
    one = objective(model, ids, targets, 1, distill=0.5, noise=False)  # one pass: no fed pass, no term
    assert one.distill is None and torch.equal(one.loss, objective(model, ids, targets, 1, noise=False).loss)


def test_the_gradient_reaches_the_fed_pass_only_and_matches_finite_differences():
    """distill_kl's gradient in float64 against central differences (torch.autograd.gradcheck); the teacher is not
    differentiated, so the first pass's logits get no gradient from the term."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    targets[1, 2] = -100
    teacher_logits = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    teacher = F.log_softmax(teacher_logits.detach()[targets != -100], -1)
    assert torch.autograd.gradcheck(lambda x: distill_kl(teacher, x, targets), (logits,), eps=1e-6, atol=1e-8)
    model = tiny_model(1, **SMALL).double()
    ids = random_ids(2, 7, seed=5)
    out = objective(model, ids, _targets(ids), 2, distill=1.0, noise=False)
    grads = torch.autograd.grad(out.distill, [model.fusion.w_u.weight, model.blocks[0].mlp.w_in.weight])
    assert all(float(g.abs().sum()) > 0 for g in grads)  # it reaches the fusion and the trunk through the fed pass


@pytest.mark.parametrize("noise", [False, True])
def test_distill_or_anchor_zero_is_todays_objective_bitwise(noise):
    """train.distill = 0 and train.anchor = 0 (test_anchor.py) compute nothing: the loss and gradients are bitwise."""
    model = tiny_model(0).train()
    ids = random_ids(2, 12, seed=2)
    targets = _targets(ids)
    results = []
    for kw in ({}, {"distill": 0.0}, {"anchor": 0.0}, {"anchor": 0.0, "anchor_logp": torch.zeros(1)}):
        model.zero_grad(set_to_none=True)
        out = objective(model, ids, targets, 3, generator=torch.Generator().manual_seed(7), z_loss=1e-4, noise=noise,
                        **kw)
        out.loss.backward()
        assert out.distill is None and out.anchor is None
        results.append((out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    loss0, grads0 = results[0]
    for loss, grads in results[1:]:
        assert torch.equal(loss0, loss) and all(torch.equal(grads[n], g) for n, g in grads0.items())


def test_the_weight_falls_linearly_to_zero_at_distill_until():
    from fullband.train.schedule import distill_weight

    assert [distill_weight(s, 10, 0.5, 0.4) for s in range(6)] == [0.5, 0.375, 0.25, 0.125, 0.0, 0.0]
    assert distill_weight(0, 10, 0.0, 1.0) == 0.0 and distill_weight(9, 10, 1.0, 1.0) == pytest.approx(0.1)
    # past 1: the weight of a run that much longer, still above 0 at the last step
    assert [distill_weight(s, 10, 4.0, 4.0) for s in (0, 9, 39, 40)] == pytest.approx([4.0, 3.1, 0.1, 0.0])


def test_training_logs_the_term_and_its_weight_and_resumes_bitwise(tmp_path, corpus, cache, monkeypatch):
    from fullband.train.config import load_run_config
    from fullband.train.trainer import train

    cfg = load_run_config(write_config(tmp_path, corpus, cache, name="logged", steps=4), ["train.distill=0.5"])
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "logged" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss_pass" in r]
    assert [r["distill_weight"] for r in rows] == [0.5, 0.375, 0.25, 0.125]
    assert all((r["distill"] > 0) == (r["k"] > 1) for r in rows) and any(r["k"] > 1 for r in rows)
    whole = write_config(tmp_path, corpus, cache, "whole", steps=9)
    part = write_config(tmp_path, corpus, cache, "part", steps=9)
    for path in (whole, part):
        path.write_text(path.read_text().replace("[train]\n", "[train]\ndistill = 0.3\n"))
    assert_resume_is_bitwise(whole, part, monkeypatch, stop_before=6, last="step_000009")


def test_a_run_recorded_before_the_setting_existed_resumes_and_a_changed_weight_is_refused(tmp_path, corpus, cache):
    from fullband.train.config import load_run_config
    from fullband.train.rundir import resume_differences

    now = load_run_config(write_config(tmp_path, corpus, cache, steps=2)).to_dict()
    old = json.loads(json.dumps(now))
    for key in ("distill", "distill_until", "latent_loss", "blend_until", "anchor", "anchor_until"):
        del old["train"][key]
    assert resume_differences(old, now) == []
    changed = json.loads(json.dumps(now))
    changed["train"]["distill"] = 0.2
    changed["train"]["anchor_until"] = 0.5
    assert resume_differences(changed, now) == ["train.distill: run has 0.2, config has 0.0",
                                                "train.anchor_until: run has 0.5, config has 1.0"]


def test_config_errors():
    from fullband.model.config import ModelConfig
    from fullband.train.config import RunConfig, TrainConfig

    three = dict(passes="three-pass", warmup_steps=0)
    cases = [(lambda: TrainConfig(distill=-0.1), r"train\.distill=-0\.1 is invalid; accepted: a finite number >= 0"),
             (lambda: TrainConfig(distill_until=0.0), r"train\.distill_until=0\.0 is invalid; accepted: a finite number > 0"),
             (lambda: TrainConfig(distill_until=-1.5), r"train\.distill_until=-1\.5 is invalid"),
             (lambda: RunConfig(model=ModelConfig(fusion="none"), train=TrainConfig(distill=0.1, **three)),
              r"train\.distill=0\.1 .* model\.fusion='none' feeds nothing; accepted: train\.distill = 0"),
             (lambda: RunConfig(train=TrainConfig(distill=0.1, passes="none")), r"runs one pass, the teacher itself")]
    for make, match in cases:
        with pytest.raises(ConfigError, match=match) as err:
            make()
        assert "\n" not in str(err.value)
    RunConfig(train=TrainConfig(distill=0.1, **three))  # accepted
