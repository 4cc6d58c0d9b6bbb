"""NorMuon against a slow float64 reference, row-block splits, the routing table, weight decay, resume, configs."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from conftest import random_ids, tiny_model
from fullband.errors import ConfigError
from fullband.model.objective import objective
from fullband.train.optim import (
    NORMUON_ROUTES,
    CompositeOptimizer,
    NorMuon,
    OptimConfig,
    Route,
    _check_disjoint,
    build_optimizer,
    neuron_normalize,
    newton_schulz5,
    normuon_update,
    routing_report,
)


# ---------------------------------------------------------------- a slow reference


def reference_step(w, g, m, v, *, lr, wd, beta1, beta2, eps, nesterov, steps=5):
    """One NorMuon step in float64 with explicit loops over rows: returns (new W, new M, new v)."""
    w, g, m, v = (t.double().clone() for t in (w, g, m, v))
    rows, cols = w.shape
    m = beta1 * m + (1 - beta1) * g
    u = (1 - beta1) * g + beta1 * m if nesterov else m
    x = u.T if rows > cols else u
    x = x / (math.sqrt(float((x * x).sum())) + 1e-7)
    a, b, c = 3.4445, -4.7750, 2.0315
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    o = x.T if rows > cols else x
    o_hat = torch.empty_like(o)
    for i in range(rows):
        v[i] = beta2 * v[i] + (1 - beta2) * sum(float(o[i, j]) ** 2 for j in range(cols)) / cols
        for j in range(cols):
            o_hat[i, j] = o[i, j] / (math.sqrt(float(v[i])) + eps)
    fro = math.sqrt(sum(float(o_hat[i, j]) ** 2 for i in range(rows) for j in range(cols)))
    eta = 0.2 * lr * math.sqrt(rows * cols) / fro
    return w - lr * wd * w - eta * o_hat, m, v


@pytest.mark.parametrize("shape", [(6, 10), (12, 5)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_normuon_matches_reference(shape, nesterov):
    torch.manual_seed(0)
    w0 = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(3)]
    p = nn.Parameter(w0.clone())
    opt = NorMuon([p], lr=0.05, weight_decay=0.1, momentum=0.9, beta2=0.95, eps=1e-8, nesterov=nesterov)
    w, m, v = w0.double(), torch.zeros(shape, dtype=torch.double), torch.zeros(shape[0], 1, dtype=torch.double)
    for g in grads:  # several steps, so momentum and v carry state
        p.grad = g.clone()
        opt.step()
        w, m, v = reference_step(w, g, m, v, lr=0.05, wd=0.1, beta1=0.9, beta2=0.95, eps=1e-8, nesterov=nesterov)
        assert torch.allclose(p.detach().double(), w, atol=1e-5, rtol=0)
    assert torch.allclose(opt.state[p]["second_moment"].double(), v, atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------- pieces


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (48, 48)])
def test_newton_schulz_singular_values_near_one(shape):
    torch.manual_seed(1)
    s = torch.linalg.svdvals(newton_schulz5(torch.randn(shape)))
    assert s.min() > 0.5 and s.max() < 1.5
    assert s.quantile(0.1) > 0.65 and s.quantile(0.9) < 1.2  # the bulk sits near 1


def test_rows_have_equal_rms_after_neuron_normalisation():
    torch.manual_seed(2)
    g = torch.randn(32, 48) * torch.linspace(0.1, 10, 32)[:, None]  # very unequal row scales
    o = newton_schulz5(g)
    muon_rms = o.square().mean(1).sqrt()
    assert muon_rms.max() > 1.3 * muon_rms.min()  # Muon leaves row norms unequal...
    beta2 = 0.95
    v = torch.zeros(32, 1)
    o_hat = neuron_normalize(o, v, beta2, eps=1e-8)
    row_rms = o_hat.square().mean(1).sqrt() * math.sqrt(1 - beta2)  # undo v's (1 - beta2) start from zero
    assert torch.allclose(row_rms, torch.ones(32), atol=1e-4)  # ...NorMuon equalises them
    assert torch.allclose(v[:, 0], (1 - beta2) * o.square().mean(1))


def test_update_rms_matches_adam_scale():
    torch.manual_seed(3)
    lr = 0.02
    update = normuon_update(torch.randn(40, 24), torch.zeros(40, 1), lr=lr, beta2=0.95, eps=1e-8, ns_steps=5)
    assert math.isclose(update.square().mean().sqrt().item(), 0.2 * lr, rel_tol=1e-5)


def test_fused_matrix_is_orthogonalised_per_row_block():
    """A (8+4+4, 12) wqkv-like matrix with splits == three separate NorMuons with separate state."""
    torch.manual_seed(4)
    sizes = (8, 4, 4)
    w0 = torch.randn(16, 12)
    fused = nn.Parameter(w0.clone())
    parts = [nn.Parameter(b.clone()) for b in w0.split(sizes)]
    kw = dict(lr=0.05, weight_decay=0.1)
    opt_fused = NorMuon([{"params": [fused], "splits": sizes}], **kw)
    opt_parts = [NorMuon([q], **kw) for q in parts]
    plain = nn.Parameter(w0.clone())
    opt_plain = NorMuon([plain], **kw)
    for _ in range(3):
        g = torch.randn(16, 12)
        fused.grad, plain.grad = g.clone(), g.clone()
        for q, gb in zip(parts, g.split(sizes)):
            q.grad = gb.clone()
        for o in [opt_fused, opt_plain, *opt_parts]:
            o.step()
    assert torch.allclose(fused.detach(), torch.cat([q.detach() for q in parts]), atol=1e-6, rtol=0)
    assert not torch.allclose(fused.detach(), plain.detach(), atol=1e-4)  # splitting changes the update


def test_bad_splits_are_rejected():
    with pytest.raises(ConfigError, match="splits"):
        NorMuon([{"params": [nn.Parameter(torch.zeros(10, 4))], "splits": (4, 4)}])
    with pytest.raises(ConfigError, match="2-D"):
        NorMuon([nn.Parameter(torch.zeros(10))])


# ---------------------------------------------------------------- routing


def _expected_optimizer(name: str, p: torch.Tensor) -> str:
    gain = p.ndim == 1 or name.endswith("qk_gain")
    return "adam" if gain or name == "embed.weight" else "normuon"


@pytest.mark.parametrize(
    "changes",
    [dict(fusion="gated"), dict(fusion="additive"), dict(fusion="concat"), dict(fusion="none"), dict(qk_norm=False)],
)
def test_every_parameter_lands_in_exactly_one_group(changes):
    model = tiny_model(**changes)
    opt = build_optimizer(model, OptimConfig())
    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(seen) == len(set(seen)) == len(list(model.parameters()))
    kinds = {name: kind for name, kind, _, _ in routing_report(model, OptimConfig())}
    assert kinds == {name: _expected_optimizer(name, p) for name, p in model.named_parameters()}
    for group in opt.normuon.param_groups:
        assert all(p.ndim == 2 for p in group["params"])


def test_fused_matrices_get_their_splits():
    model = tiny_model()
    cfg = model.config
    groups = {g["route"]: g for g in build_optimizer(model, OptimConfig()).normuon.param_groups}
    qkv = next(g for r, g in groups.items() if "wqkv" in r)
    gate_up = next(g for r, g in groups.items() if "w_in" in r)
    hd = cfg.head_dim
    assert qkv["splits"] == (cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd)
    assert gate_up["splits"] == (cfg.d_ff, cfg.d_ff)
    assert all(g["splits"] is None for r, g in groups.items() if "wqkv" not in r and "w_in" not in r)


def test_wrapped_model_routes_like_the_bare_one():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_model()
    bare = routing_report(model, OptimConfig())

    class Wrapper(nn.Module):  # what DDP does to names: "module." in front
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    wrapped = copy.deepcopy(model)
    for i, block in enumerate(wrapped.blocks):
        wrapped.blocks[i] = checkpoint_wrapper(block)
    assert routing_report(Wrapper(wrapped), OptimConfig()) == bare


def test_unrouted_parameter_is_an_error_naming_it():
    model = tiny_model()
    model.extra = nn.Linear(4, 4, bias=False)
    with pytest.raises(ConfigError, match=r"'extra\.weight'.*matches no optimizer route"):
        build_optimizer(model, OptimConfig())


def test_frozen_parameters_are_left_out():
    model = tiny_model()
    model.embed.weight.requires_grad_(False)
    names = [row[0] for row in routing_report(model, OptimConfig())]
    assert "embed.weight" not in names and len(names) == len(list(model.parameters())) - 1


def test_duplicate_membership_is_caught():
    p = nn.Parameter(torch.zeros(2))
    with pytest.raises(ConfigError, match="two optimizer groups"):
        _check_disjoint([{"names": ["a"], "params": [p]}, {"names": ["b"], "params": [p]}])


def test_custom_route_multipliers():
    routes = (Route(r"^embed\.weight$", "adam", lr_mult=2.0), *NORMUON_ROUTES)
    rows = {name: (lr, wd) for name, _, lr, wd in routing_report(tiny_model(), OptimConfig(adam_lr=1e-3), routes)}
    assert rows["embed.weight"] == (2e-3, 0.0)
    with pytest.raises(ConfigError, match="optimizer"):
        Route("x", "sgd")


# ---------------------------------------------------------------- weight decay, adamw mode


def _zero_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


def test_weight_decay_applies_only_to_normuon_matrices():
    model = tiny_model()
    cfg = OptimConfig(lr=0.02, weight_decay=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, cfg)
    _zero_grads(model)  # a zero gradient leaves only the decay
    opt.step()
    for name, p in model.named_parameters():
        expected = before[name] * (1 - 0.02 * 0.5) if _expected_optimizer(name, p) == "normuon" else before[name]
        assert torch.allclose(p.detach(), expected, atol=1e-7, rtol=0), name
    for group in opt.param_groups:
        assert group["base_lr"] == group["lr"] and group["base_wd"] == group["weight_decay"]


def test_adamw_mode_routes_everything_to_adamw():
    model = tiny_model()
    cfg = OptimConfig(name="adamw", adam_lr=1e-3, weight_decay=0.1, adam_weight_decay=0.05)
    opt = build_optimizer(model, cfg)
    assert opt.normuon is None and isinstance(opt.adam, torch.optim.AdamW)
    for name, kind, lr, wd in routing_report(model, cfg):
        p = model.get_parameter(name)
        assert kind == "adam" and lr == 1e-3
        is_gain = p.ndim == 1 or name.endswith("qk_gain")
        assert wd == (0.0 if is_gain else 0.05 if name == "embed.weight" else 0.1), name
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _zero_grads(model)
    opt.step()
    w = "blocks.0.attn.wo.weight"
    assert torch.allclose(model.get_parameter(w).detach(), before[w] * (1 - 1e-3 * 0.1), atol=1e-8)


# ---------------------------------------------------------------- resume and training


def _random_grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("name", ["normuon", "adamw"])
def test_state_dict_round_trip_gives_identical_steps(name):
    cfg = OptimConfig(name=name)
    model = tiny_model()
    opt = build_optimizer(model, cfg)
    for step in range(3):
        for group in opt.param_groups:  # a schedule in the middle of a run
            group["lr"] = group["base_lr"] * (step + 1) / 4
        _random_grads(model, step)
        opt.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)

    resumed = tiny_model(seed=123)  # different init, overwritten by the checkpoint
    resumed.load_state_dict(saved["model"])
    opt2 = build_optimizer(resumed, cfg)
    opt2.load_state_dict(saved["optim"])
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    for step in range(3, 5):
        _random_grads(model, step)
        _random_grads(resumed, step)
        opt.step()
        opt2.step()
    for (n, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n


def test_load_state_dict_from_another_mode_is_an_error():
    model = tiny_model()
    state = build_optimizer(model, OptimConfig(name="adamw")).state_dict()
    with pytest.raises(ConfigError, match="optim.name"):
        build_optimizer(model, OptimConfig()).load_state_dict(state)


def test_zero_grad_and_composite_api():
    model = tiny_model()
    opt = build_optimizer(model, OptimConfig())
    assert isinstance(opt, CompositeOptimizer)
    _random_grads(model, 0)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert len(opt.param_groups) == len(opt.normuon.param_groups) + len(opt.adam.param_groups)


def test_a_few_dozen_steps_reduce_the_loss():
    torch.manual_seed(0)
    model = tiny_model().train()
    ids = random_ids(4, 33, seed=5)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    opt = build_optimizer(model, OptimConfig(lr=0.02, adam_lr=3e-3))
    losses = []
    for _ in range(30):
        loss = objective(model, inputs, targets, 1).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.8 * losses[0]


# ---------------------------------------------------------------- configs


@pytest.mark.parametrize(
    "field, value",
    [
        ("name", "muon"), ("lr", 0.0), ("lr", -1e-3), ("weight_decay", -0.1), ("momentum", 1.0), ("beta2", 1.5),
        ("ns_steps", 0), ("ns_steps", 2.5), ("eps", 0.0), ("adam_lr", "fast"), ("adam_betas", (0.9,)),
        ("adam_betas", (0.9, 1.0)), ("adam_eps", -1.0), ("adam_weight_decay", float("nan")), ("nesterov", "yes"),
        ("grad_clip", -1.0),
    ],
)
def test_bad_config_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field) as err:
        OptimConfig(**{field: value})
    assert "accepted" in str(err.value) or "must be" in str(err.value)


def test_config_suggests_and_normalises():
    with pytest.raises(ConfigError, match="did you mean 'normuon'"):
        OptimConfig(name="normuom")
    assert OptimConfig(adam_betas=[0.8, 0.99]).adam_betas == (0.8, 0.99)  # TOML arrays become tuples


# ---------------------------------------------------------------- DTensor (FSDP2 layout), one CPU process


def test_dtensor_parameter_matches_plain_tensor():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group yet")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(6)
        w, sizes = torch.randn(24, 8), (8, 8, 8)
        plain = nn.Parameter(w.clone())
        sharded = nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
        opts = [NorMuon([{"params": [q], "splits": sizes}], lr=0.05, weight_decay=0.1) for q in (plain, sharded)]
        for _ in range(2):
            g = torch.randn(24, 8)
            plain.grad, sharded.grad = g.clone(), distribute_tensor(g.clone(), mesh, [Shard(0)])
            for o in opts:
                o.step()
        assert torch.allclose(plain.detach(), sharded.detach().full_tensor(), atol=1e-7, rtol=0)
    finally:
        dist.destroy_process_group()
