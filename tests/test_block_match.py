"""The block match (train.block_match, train.block_match_until): every block's output in a fed pass drawn towards the
first pass's. The term against its definition, nothing changed when it is off, a split stack and activation
checkpointing, its gradient against finite differences in float64, training logs, an older run's settings and the
config errors (a resume after SIGKILL: test_warmstart.py; on a wrapped transformers model: test_hf_train.py)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import objective_term, random_ids, tiny_model, write_config
from fullband.errors import ConfigError
from fullband.model.objective import objective
from test_distill import SMALL, _targets  # the same small model and targets


def _outputs_by_pass(model, ids, passes: int, weights: dict | None = None) -> list[list[torch.Tensor]]:
    """Every block's output in every pass (with `weights` in place of the model's), recorded by the test's own hooks
    (a block below the fed block runs once, before the first pass: it lands in the first pass's list)."""
    per_pass, current = [], []
    handles = [b.register_forward_hook(lambda m, a, out: current.append(out)) for b in model.blocks]

    def each_pass(j, state, top):
        per_pass.append(list(current))
        current.clear()

    try:
        torch.func.functional_call(model, weights or {}, (ids,),
                                   {"passes": passes, "return_logits": False, "each_pass": each_pass})
    finally:
        for h in handles:
            h.remove()
    return per_pass


def _want(per_pass: list[list[torch.Tensor]]) -> torch.Tensor:
    first = per_pass[0]
    terms = []
    for outs in per_pass[1:]:
        paired = first[len(first) - len(outs):]
        terms.append(torch.stack([(y - y1).pow(2).mean() / y1.pow(2).mean() for y, y1 in zip(outs, paired)]).mean())
    return torch.stack(terms).mean()


@pytest.mark.parametrize("changes", [{}, {"n_layers": 3, "feedback_target": 1}])
def test_the_term_is_the_mean_relative_distance_of_every_fed_block_from_the_first_pass(changes):
    model = tiny_model(3, **SMALL, **changes).double()
    ids = random_ids(2, 7, seed=4)
    targets = _targets(ids)
    out = objective(model, ids, targets, 3, block_match=0.5, noise=False)
    base = objective(model, ids, targets, 3, noise=False)
    assert base.block_match is None and torch.equal(out.loss, base.loss + 0.5 * out.block_match)
    per_pass = _outputs_by_pass(model, ids, 3)
    if changes:  # the block below the fed one ran once, so only the two above are paired
        assert [len(p) for p in per_pass] == [3, 2, 2]
    want = _want(per_pass)
    assert torch.allclose(out.block_match, want, rtol=1e-12, atol=0) and float(want.detach()) > 1e-4
    one = objective(model, ids, targets, 1, block_match=0.5, noise=False)  # one pass: nothing to match
    assert one.block_match is None and torch.equal(one.loss, objective(model, ids, targets, 1, noise=False).loss)
    assert all(not b._forward_hooks for b in model.blocks)  # the hooks are gone


def test_off_is_bitwise_the_objective_and_its_gradients():
    model = tiny_model(2, **SMALL).double().train()
    ids = random_ids(2, 9, seed=6)
    targets = _targets(ids)
    grads = []
    for kw in ({}, {"block_match": 0.0}):
        model.zero_grad()
        out = objective(model, ids, targets, 2, generator=torch.Generator().manual_seed(1), **kw)
        out.loss.backward()
        grads.append((out.loss.detach(), [p.grad.clone() for p in model.parameters()]))
        assert out.block_match is None
    assert torch.equal(grads[0][0], grads[1][0]) and all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1]))


def test_activation_checkpointing_gives_the_same_term_and_gradients():
    """A block wrapped for activation checkpointing reports its output once: the term and its gradients are the
    unwrapped model's (its backward's recompute does not add outputs)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    ids = random_ids(2, 7, seed=4)
    targets = _targets(ids)
    results = []
    for wrap in (False, True):
        model = tiny_model(5, **SMALL).double()
        if wrap:
            for i, block in enumerate(model.blocks):
                model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)
        out = objective(model, ids, targets, 3, block_match=1.0, noise=False)
        out.block_match.backward()
        results.append((out.block_match.detach(), model.fusion.w_u.weight.grad.clone()))
    assert torch.allclose(results[0][0], results[1][0], rtol=1e-12, atol=0)
    assert torch.allclose(results[0][1], results[1][1], rtol=1e-10, atol=1e-14)


def test_the_terms_gradient_matches_finite_differences_in_float64():
    """The term's gradient against central differences (torch.autograd.gradcheck) in float64. The fusion's W_U moves
    the fed passes alone, so the whole two-pass term is differentiated; a trunk weight moves the first pass too, whose
    outputs are the goal and not differentiated: its gradient is that of the distance to the first pass's outputs at
    the unperturbed weight, which the finite differences check, and the objective's gradient equals it."""
    model = tiny_model(1, **SMALL).double()
    ids = random_ids(2, 7, seed=5)
    targets = _targets(ids)
    params = dict(model.named_parameters())

    of = objective_term(model, "block_match", ids, targets, 2, block_match=1.0, noise=False)

    def whole(w_u):
        return of({"fusion.w_u.weight": w_u})

    w_u = params["fusion.w_u.weight"].detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(whole, (w_u,), eps=1e-6, atol=1e-7)

    name = "blocks.0.mlp_norm.weight"
    goal = [y.detach() for y in _outputs_by_pass(model, ids, 2)[0]]

    def to_goal(w):
        return _want([goal, _outputs_by_pass(model, ids, 2, {name: w})[1]])

    w = params[name].detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(to_goal, (w,), eps=1e-6, atol=1e-7)
    (want,) = torch.autograd.grad(to_goal(w), (w,))
    (got,) = torch.autograd.grad(of({}), (params[name],))
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-14) and float(got.abs().sum()) > 0


def test_training_logs_the_term_and_its_falling_weight(tmp_path, corpus, cache):
    from fullband.train.config import load_run_config
    from fullband.train.trainer import train

    path = write_config(tmp_path, corpus, cache, "logged", steps=4, passes='"two-pass"')
    path.write_text(path.read_text().replace("[train]\n", "[train]\nblock_match = 2.0\nblock_match_until = 0.5\n"))
    train(load_run_config(path))
    rows = [json.loads(line) for line in (tmp_path / "logged" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss_pass" in r]
    assert [r["block_match_weight"] for r in rows] == [2.0, 1.0, 0.0, 0.0]
    assert [r["block_match"] > 0 for r in rows] == [True, True, False, False]  # nothing computed at weight 0


def test_an_older_run_resumes_and_a_changed_weight_is_refused(tmp_path, corpus, cache):
    from fullband.train.config import load_run_config
    from fullband.train.rundir import resume_differences

    now = load_run_config(write_config(tmp_path, corpus, cache, steps=2)).to_dict()
    old = json.loads(json.dumps(now))
    for key in ("block_match", "block_match_until"):
        del old["train"][key]
    assert resume_differences(old, now) == []
    changed = json.loads(json.dumps(now))
    changed["train"]["block_match"] = 3.0
    changed["train"]["block_match_until"] = 0.5
    assert resume_differences(changed, now) == ["train.block_match: run has 3.0, config has 0.0",
                                                "train.block_match_until: run has 0.5, config has 1.0"]


def test_config_errors():
    from fullband.model.config import ModelConfig
    from fullband.train.config import RunConfig, TrainConfig

    three = dict(passes="three-pass", warmup_steps=0)
    cases = [(lambda: TrainConfig(block_match=-1.0),
              r"train\.block_match=-1\.0 is invalid; accepted: a finite number >= 0"),
             (lambda: TrainConfig(block_match=float("inf")), r"train\.block_match=inf is not a finite number"),
             (lambda: TrainConfig(block_match_until=0.0), r"train\.block_match_until=0\.0 is invalid; accepted: a finite number > 0"),
             (lambda: TrainConfig(block_match_until=float("inf")), r"train\.block_match_until=inf is not a finite"),
             (lambda: RunConfig(model=ModelConfig(fusion="none"), train=TrainConfig(block_match=1.0, **three)),
              r"train\.block_match=1\.0 draws fed passes towards the first pass's block outputs, but "
              r"model\.fusion='none' feeds nothing; accepted: train\.block_match = 0"),
             (lambda: RunConfig(train=TrainConfig(block_match=1.0, passes="none")), r"runs one pass, the teacher")]
    for make, match in cases:
        with pytest.raises(ConfigError, match=match) as err:
            make()
        assert "\n" not in str(err.value)
    RunConfig(train=TrainConfig(block_match=1.0, **three))  # accepted
