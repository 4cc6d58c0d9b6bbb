"""Next-latent supervision (model.latent_head, train.latent_loss): the term's gradient against finite differences,
nothing changed when it is off, the head's weights through every folder format, training logs and FLOPs, and the
config errors."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import MICRO_MODEL, random_ids, tiny_model, write_config
from fullband import FullbandLM, ModelConfig
from fullband.errors import ConfigError, InputError
from fullband.model.objective import objective

SMALL = dict(d_model=16, n_heads=2, n_kv_heads=1, max_seq_len=32, init_std=0.3)  # large weights: large gradients


def _targets(ids: torch.Tensor) -> torch.Tensor:
    targets = torch.roll(ids, -1, 1)
    targets[:, -1] = -100
    targets[0, 3] = -100  # the pair (2, 3) is not scored
    return targets


def _fixed_goal_latent(model, ids, targets, passes, goals):
    """The next-latent term with its goals h_{t+1} held at `goals` (the stop-gradient as a function of the weights)."""
    states = []
    model(ids, passes=passes, return_logits=False, each_pass=lambda j, s, t: states.append(s))
    scored = (targets[:, 1:] != -100).double()
    errs = [((model.latent_head(s[:, :-1]) - g).pow(2).sum(-1) * scored).sum() / (g.pow(2).sum(-1) * scored).sum()
            for s, g in zip(states, goals)]
    return torch.stack(errs).mean()


def test_the_latent_gradient_matches_finite_differences():
    model = tiny_model(3, latent_head="linear", **SMALL).double()
    ids = random_ids(2, 7, seed=4)
    targets = _targets(ids)
    out = objective(model, ids, targets, 3, latent_loss=0.5, noise=False)
    base = objective(model, ids, targets, 3, noise=False)
    assert out.latent is not None and base.latent is None
    assert torch.equal(out.loss, base.loss + 0.5 * out.latent)
    goals = []
    model(ids, passes=3, return_logits=False, each_pass=lambda j, s, t: goals.append(s[:, 1:].detach()))
    ref = _fixed_goal_latent(model, ids, targets, 3, goals)
    assert torch.allclose(ref, out.latent, rtol=1e-12, atol=0)
    params = dict(model.named_parameters())
    picks = [("latent_head.weight", (0, 1)), ("latent_head.weight", (5, 9)), ("blocks.0.mlp.w_in.weight", (2, 3)),
             ("blocks.1.attn.wqkv.weight", (7, 0)), ("fusion.w_u.weight", (1, 4))]
    grads = torch.autograd.grad(out.latent, [params[name] for name, _ in picks])
    eps = 1e-6
    for (name, at), grad in zip(picks, grads):
        p = params[name]
        with torch.no_grad():
            p[at] += eps
            up = _fixed_goal_latent(model, ids, targets, 3, goals)
            p[at] -= 2 * eps
            down = _fixed_goal_latent(model, ids, targets, 3, goals)
            p[at] += eps
        numeric = (up - down) / (2 * eps)
        assert abs(float(grad[at]) - float(numeric)) <= 1e-6 * abs(float(numeric)), (name, at)
    assert min(abs(float(g[at])) for (_, at), g in zip(picks, grads)) > 1e-3  # the term reaches every weight picked


@pytest.mark.parametrize("noise", [False, True])
def test_latent_loss_zero_is_todays_objective_bitwise(noise):
    plain = tiny_model(0).train()
    headed = FullbandLM(plain.config.replace(latent_head="linear")).train()
    missing, unexpected = headed.load_state_dict(plain.state_dict(), strict=False)
    assert missing == ["latent_head.weight"] and unexpected == []
    ids = random_ids(2, 12, seed=2)
    targets = _targets(ids)
    results = []
    for model, kw in ((plain, {}), (plain, {"latent_loss": 0.0}), (headed, {"latent_loss": 0.0})):
        model.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(7)
        out = objective(model, ids, targets, 3, generator=gen, z_loss=1e-4, noise=noise, **kw)
        out.loss.backward()
        assert out.latent is None
        grads = {n: p.grad for n, p in model.named_parameters()}
        results.append((out.loss.detach(), grads))
    (loss0, grads0), *others = results
    for loss, grads in others:
        assert torch.equal(loss, loss0)
        assert all(torch.equal(grads[n], g) for n, g in grads0.items())
    assert results[2][1]["latent_head.weight"] is None  # no gradient: nothing read it
    # decoding never reads the head
    with torch.no_grad():
        assert torch.equal(plain.eval()(ids, passes=3).logits, headed.eval()(ids, passes=3).logits)


def test_the_head_is_kept_by_folders_transformers_and_gguf(tmp_path):
    from fullband.data.tokenizer import ByteTokenizer
    from fullband.hf.convert import convert
    from fullband.model.flops import param_count

    model = tiny_model(1, latent_head="linear")
    assert model.num_params() == param_count(model.config)
    assert param_count(model.config) - param_count(model.config.replace(latent_head="none")) == 64 * 64
    model.save(tmp_path / "native", tokenizer=ByteTokenizer())
    convert(tmp_path / "native", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "back")
    want = model.state_dict()["latent_head.weight"]
    for folder in ("native", "back"):
        loaded = FullbandLM.load(tmp_path / folder)
        assert loaded.config.latent_head == "linear"
        assert torch.equal(loaded.state_dict()["latent_head.weight"], want)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model.latent_head.weight"), want)


def test_the_gguf_sidecar_keeps_the_head(tmp_path):
    pytest.importorskip("gguf", reason="GGUF files need the gguf package")
    from fullband import load_model
    from fullband.data.tokenizer import ByteTokenizer
    from fullband.hf.convert import convert
    from fullband.hf.gguf_out import read_sidecar
    from fullband.llamacpp import export_gguf

    model = tiny_model(2, latent_head="linear", qk_norm=False, input_norm=False, tie_embeddings=False)
    out = export_gguf(model, tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    side, _ = read_sidecar(out)
    assert torch.equal(side["latent_head.weight"], model.latent_head.weight)
    convert(out, tmp_path / "back")
    back = load_model(tmp_path / "back")
    assert torch.equal(back.latent_head.weight, model.latent_head.weight) and back.config == model.config


def test_training_logs_the_latent_loss_and_counts_its_flops(tmp_path, corpus, cache):
    from fullband.train.config import load_run_config
    from fullband.train.trainer import train

    model = MICRO_MODEL + '\nlatent_head = "linear"'
    runs = {}
    for name, weight in (("on", 0.5), ("off", 0.0)):
        cfg = load_run_config(write_config(tmp_path, corpus, cache, name=name, steps=3, model=model),
                              [f"train.latent_loss={weight}"])
        train(cfg)
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [r for r in rows if "loss_pass" in r]
    on, off = runs["on"], runs["off"]
    assert len(on) == 3 and all(r["latent_loss"] > 0 for r in on) and all("latent_loss" not in r for r in off)
    assert [r["k"] for r in on] == [r["k"] for r in off]
    # the head: 2 D^2 FLOPs per token per pass forward, 3x with the backward; 256 tokens a step
    head = 256 * 3 * 2 * 32 * 32 * sum(r["k"] for r in on)
    assert on[-1]["flops"] - off[-1]["flops"] == pytest.approx(head, rel=1e-12, abs=0)
    saved = FullbandLM.load(tmp_path / "on" / "step_000003")
    assert saved.latent_head is not None


def test_config_errors():
    from fullband.train.config import RunConfig, TrainConfig

    cases = [(lambda: RunConfig(train=TrainConfig(latent_loss=0.1)),
              r'train\.latent_loss=0\.1 .*model\.latent_head = "none"; accepted: model\.latent_head = "linear"'),
             (lambda: ModelConfig(latent_head="mlp"), r"latent_head='mlp' is invalid.*; accepted: none, linear"),
             (lambda: TrainConfig(latent_loss=-1.0), r"train\.latent_loss")]
    for make, match in cases:
        with pytest.raises(ConfigError, match=match) as err:
            make()
        assert "\n" not in str(err.value)
    RunConfig(model=ModelConfig(latent_head="linear"), train=TrainConfig(latent_loss=0.1))  # accepted
    model = tiny_model(0)
    with pytest.raises(InputError, match='model.latent_head = "linear"'):
        objective(model, random_ids(1, 4), random_ids(1, 4), 2, latent_loss=1.0)


def test_a_wrapped_hugging_face_model_trains_and_keeps_its_head(tmp_path):
    transformers = pytest.importorskip("transformers")
    from fullband import load_model
    from fullband.hf import add_latent_feedback

    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    wrapped = add_latent_feedback(llama, config=ModelConfig(latent_head="linear")).train()
    ids = random_ids(2, 8, vocab=50)
    out = objective(wrapped, ids, _targets(ids), 2, latent_loss=1.0)
    out.loss.backward()
    assert out.latent is not None and float(wrapped.latent_head.weight.grad.abs().sum()) > 0
    wrapped.save(tmp_path / "wrapped")
    back = load_model(tmp_path / "wrapped")
    assert torch.equal(back.latent_head.weight, wrapped.latent_head.weight)
