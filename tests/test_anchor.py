"""The anchor (train.anchor, train.anchor_until): every pass drawn towards the frozen starting model's STANDARD read.
The term against its definition and its gradient against finite differences, the frozen model the trainer builds,
training logs and FLOPs, a resume bit for bit, and the config errors (nothing changed when it is off, and an older
run's settings: test_distill.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import (MICRO_MODEL, assert_resume_is_bitwise, losses, micro_start, objective_term, random_ids,
                      tiny_model, write_config)
from fullband.errors import ConfigError, InputError
from fullband.model.objective import objective
from test_distill import SMALL, _pass_logits, _targets  # the same small model, targets and per-pass logits


def _frozen_logp(ids: torch.Tensor, targets: torch.Tensor, seed: int = 9) -> torch.Tensor:
    """Another model's STANDARD read over the scored positions: the distribution the anchor holds the passes to."""
    other = tiny_model(seed, **SMALL).double().eval()
    with torch.no_grad():
        return F.log_softmax(other(ids, passes=1).logits[targets != -100], -1)


def test_the_term_is_the_mean_kl_from_the_frozen_model_to_every_pass():
    model = tiny_model(3, **SMALL).double()
    ids = random_ids(2, 7, seed=4)
    targets = _targets(ids)
    frozen = _frozen_logp(ids, targets)
    out = objective(model, ids, targets, 3, anchor=0.5, anchor_logp=frozen, noise=False)
    base = objective(model, ids, targets, 3, noise=False)
    assert base.anchor is None and torch.equal(out.loss, base.loss + 0.5 * out.anchor)
    q = frozen.exp()
    scored = targets != -100
    want = torch.stack([(q * (frozen - F.log_softmax(lg[scored], -1))).sum(-1).mean()
                        for lg in _pass_logits(model, ids, 3)]).mean()
    assert torch.allclose(out.anchor, want, rtol=1e-12, atol=0) and float(want.detach()) > 1e-3
    one = objective(model, ids, targets, 1, anchor=0.5, anchor_logp=frozen, noise=False)  # pass 1 alone: its KL
    assert torch.allclose(one.anchor, (q * (frozen - F.log_softmax(_pass_logits(model, ids, 1)[0][scored], -1)))
                          .sum(-1).mean(), rtol=1e-12, atol=0)
    with pytest.raises(InputError, match=r"anchor=0\.5 .* anchor_logp .* was not given"):
        objective(model, ids, targets, 2, anchor=0.5, noise=False)


def test_the_terms_gradient_matches_finite_differences_in_float64():
    """The anchor term of a two-pass objective as a function of the fusion's W_U and a trunk norm's weight, against
    central differences (torch.autograd.gradcheck): it reaches the trunk through both passes and the fusion through
    the fed one."""
    model = tiny_model(1, **SMALL).double()
    ids = random_ids(2, 7, seed=5)
    targets = _targets(ids)
    frozen = _frozen_logp(ids, targets)
    names = ["fusion.w_u.weight", "blocks.0.mlp_norm.weight"]
    params = dict(model.named_parameters())

    of = objective_term(model, "anchor", ids, targets, 2, anchor=1.0, anchor_logp=frozen, noise=False)

    def term(w_u, w_in):
        return of({names[0]: w_u, names[1]: w_in})

    inputs = tuple(params[n].detach().clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradcheck(term, inputs, eps=1e-6, atol=1e-7)
    grads = torch.autograd.grad(term(*inputs), inputs)
    assert all(float(g.abs().sum()) > 0 for g in grads)


def _anchored(tmp_path, corpus, cache, name, anchor_from: str = "", **kw):
    path = write_config(tmp_path, corpus, cache, name, **kw)
    start = micro_start(tmp_path)
    held = f'anchor_from = "{anchor_from}"\n' if anchor_from else ""
    path.write_text(path.read_text().replace("[train]\n", f'[train]\nanchor = 0.5\nanchor_until = 0.5\n'
                                                           f'init_from = "{start}"\n{held}'))
    return path


def _other_model(tmp_path, name: str, seed: int, **sizes):
    """A model folder of the micro recipe's model (other sizes where given), drawn with another seed."""
    import tomllib

    from fullband.data.tokenizer import ByteTokenizer
    from fullband.model.config import ModelConfig
    from fullband.model.decoder import FullbandLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        FullbandLM(ModelConfig(**{**tomllib.loads(MICRO_MODEL), **sizes})).save(tmp_path / name,
                                                                                  tokenizer=ByteTokenizer())
    return tmp_path / name


def test_training_holds_a_frozen_copy_of_the_start_and_logs_the_term_its_weight_and_flops(tmp_path, corpus, cache):
    from safetensors.torch import load_file

    from fullband.model.flops import train_flops
    from fullband.train.config import load_run_config
    from fullband.train.trainer import Trainer

    cfg = load_run_config(_anchored(tmp_path, corpus, cache, "logged", steps=4))
    trainer = Trainer(cfg)
    start = load_file(str(micro_start(tmp_path) / "model.safetensors"))
    frozen = trainer.anchor.state_dict()
    assert not any(p.requires_grad for p in trainer.anchor.parameters()) and not trainer.anchor.training
    assert all(torch.equal(frozen[k], v) for k, v in start.items() if not k.startswith("fusion."))
    try:
        trainer.run()
    finally:
        trainer.close()
    after = trainer.anchor.state_dict()
    assert all(torch.equal(frozen[k], after[k]) for k in frozen)  # frozen: no step moved it
    rows = [json.loads(line) for line in (tmp_path / "logged" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss_pass" in r]
    assert [r["anchor_weight"] for r in rows] == [0.5, 0.25, 0.0, 0.0]
    # step 1: the trained model is the start, so only its fed passes differ from it (a one-pass step's KL is 0)
    assert rows[0]["anchor"] == pytest.approx(0.0, abs=1e-6) if rows[0]["k"] == 1 else rows[0]["anchor"] > 0
    assert rows[1]["anchor"] > 0
    per_step = [cfg.train.global_batch_tokens * train_flops(cfg.model, r["k"], seq_len=32, anchor=True) for r in rows]
    assert [r["flops"] for r in rows] == pytest.approx(list(torch.tensor(per_step).cumsum(0).tolist()), rel=1e-9)
    assert per_step[0] > cfg.train.global_batch_tokens * train_flops(cfg.model, rows[0]["k"], seq_len=32)


def test_an_anchored_run_resumes_bitwise(tmp_path, corpus, cache, monkeypatch):
    whole = _anchored(tmp_path, corpus, cache, "whole", steps=9)
    part = _anchored(tmp_path, corpus, cache, "part", steps=9)
    assert_resume_is_bitwise(whole, part, monkeypatch, stop_before=6, last="step_000009")


def test_anchor_from_names_the_model_the_passes_are_held_to(tmp_path, corpus, cache):
    """train.anchor_from: the run's own start named there trains bit for bit as the default; another model of the
    run's sizes is the frozen one (its weights, not the start's), and the term moves with it; a model that lacks
    weights a STANDARD read needs is refused before a step."""
    from safetensors.torch import load_file

    from fullband.train.build import anchor_model
    from fullband.train.config import load_run_config
    from fullband.train.trainer import Trainer

    def trained(name, anchor_from=""):
        trainer = Trainer(load_run_config(_anchored(tmp_path, corpus, cache, name, anchor_from, steps=3)))
        frozen = {k: v.clone() for k, v in trainer.anchor.state_dict().items()}
        try:
            trainer.run()
        finally:
            trainer.close()
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return frozen, losses(tmp_path / name), [r["anchor"] for r in rows if "loss_pass" in r]

    own, own_losses, own_terms = trained("own")
    named, named_losses, named_terms = trained("named", str(micro_start(tmp_path)))
    assert named_losses == own_losses and named_terms == own_terms
    assert all(torch.equal(own[k], named[k]) for k in own if not k.startswith("fusion."))
    other = _other_model(tmp_path, "other", seed=12)
    held, _, held_terms = trained("held", str(other))
    weights = load_file(str(other / "model.safetensors"))
    assert all(torch.equal(held[k], v) for k, v in weights.items() if not k.startswith("fusion."))
    assert not torch.equal(held["embed.weight"], own["embed.weight"])
    # step 1 runs one pass of the start itself: held to the start its KL is 0, held to another model it is not
    assert own_terms[0] == 0.0 < held_terms[0]
    small = _other_model(tmp_path, "small", seed=12, n_layers=1)
    cfg = load_run_config(_anchored(tmp_path, corpus, cache, "small-run", str(small), steps=3))
    with pytest.raises(ConfigError, match=r"train\.anchor_from='.*small' lacks weights a STANDARD read of this model "
                                          r"needs \(name and shape\): blocks\.1\..*; accepted: a model of the run's "
                                          r"sizes"):
        anchor_model(cfg, torch.device("cpu"))


def test_config_errors():
    from fullband.train.config import RunConfig, TrainConfig

    cases = [(lambda: TrainConfig(anchor=-0.1), r"train\.anchor=-0\.1 is invalid; accepted: a finite number >= 0"),
             (lambda: TrainConfig(anchor=float("nan")),
              r"train\.anchor=nan is not a finite number; accepted: a finite number >= 0"),
             (lambda: TrainConfig(anchor_until=0.0), r"train\.anchor_until=0\.0 is invalid; accepted: a finite number > 0"),
             (lambda: TrainConfig(anchor_until=-1.5), r"train\.anchor_until=-1\.5 is invalid; accepted: a finite number > 0"),
             (lambda: RunConfig(train=TrainConfig(anchor=0.1)),
              r"train\.anchor=0\.1 draws every pass towards the model the run starts from, but this run starts from "
              r"a random initialisation; accepted: train\.anchor = 0, or a warm start")]
    for make, match in cases:
        with pytest.raises(ConfigError, match=match) as err:
            make()
        assert "\n" not in str(err.value)
    RunConfig(train=TrainConfig(anchor=0.1, init_from="somewhere"))  # accepted (the folder is read at the start)
    RunConfig(train=TrainConfig(anchor=0.1, anchor_from="somewhere"))  # a random start held to a named model
    from fullband.model.config import ModelConfig

    for make, match in [
            (lambda: RunConfig(train=TrainConfig(anchor=0.0, init_from="a", anchor_from="b")),
             r"train\.anchor_from='b' names the anchor's model, but train\.anchor = 0 computes no anchor; accepted: "
             r"train\.anchor > 0, or train\.anchor_from = ''"),
            (lambda: RunConfig(model=ModelConfig(hf_path="h"), train=TrainConfig(anchor=0.1, anchor_from="b")),
             r"train\.anchor_from='b' with model\.hf_path='h': a wrapped transformers model is anchored to its own "
             r"start; accepted: one of them")]:
        with pytest.raises(ConfigError, match=match):
            make()
