"""The model: Jacobi passes vs the exact recurrence, pass-1 = ordinary transformer, fusion, gradients, init."""

from __future__ import annotations

import pytest
import torch

from conftest import random_ids, tiny_config, tiny_model
from fullband import DecodeMode, FullbandLM, ModelConfig
from fullband.model.core import plain_positions
from fullband.model.objective import ntp, objective, prefix_mixin, training_feed


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"fusion": "additive"},
        {"fusion": "concat"},
        {"feedback": "residual"},
        {"qk_norm": False, "n_kv_heads": 4},
        {"sliding_window": 8, "global_every": 2, "attn_gate": True},
    ],
    ids=["gated", "additive", "concat", "residual-state", "no-qk-norm-mha", "window-gate"],
)
def test_jacobi_fixed_point_equals_exact_recurrence(changes):
    model = tiny_model(**changes)
    T = 64
    ids = random_ids(2, T)
    with torch.no_grad():
        jacobi = model(ids, passes=T + 1)
        exact = model.recurrent_forward(ids)
    assert (jacobi.hidden - exact.hidden).abs().max().item() <= 1e-4
    assert (jacobi.logits - exact.logits).abs().max().item() <= 1e-4


def test_position_t_is_final_after_t_plus_one_passes():
    model = tiny_model()
    ids = random_ids(2, 24)
    with torch.no_grad():
        hidden = [model(ids, passes=k).hidden for k in range(1, 12)]
    for k in range(1, len(hidden)):
        diff = (hidden[k] - hidden[k - 1]).abs().amax(dim=(0, 2))  # passes k+1 vs k, per position
        assert torch.all(diff[:k] == 0), f"passes {k} and {k + 1} differ before position {k}"
        assert diff[k] > 0, f"position {k} should still change between passes {k} and {k + 1}"


def test_bos_positions_are_plain_and_cut_the_feedback():
    """A BOS mid-sequence starts a new document: its input is the plain embedding in every pass."""
    model = tiny_model()
    ids = random_ids(1, 30)
    ids[0, 12] = model.config.bos_token_id
    with torch.no_grad():
        jacobi = model(ids, passes=31).hidden
        exact = model.recurrent_forward(ids).hidden
        one_pass = model(ids, passes=1).hidden
        # with feedback cut at 12, position 12 reads no state: its plain input equals the one-pass input
        x_multi = model.pass_inputs(model.norm_in(model.embed(ids)), torch.randn(1, 30, 64), model.plain_of(ids))
        x_plain = model.norm_in(model.embed(ids))
    assert (jacobi - exact).abs().max() <= 1e-4
    assert torch.equal(x_multi[0, 12], x_plain[0, 12]) and torch.equal(x_multi[0, 0], x_plain[0, 0])
    assert not torch.equal(x_multi[0, 13], x_plain[0, 13])
    assert not torch.allclose(jacobi[0, 13], one_pass[0, 13])


def test_plain_prefix_recurrence_matches_jacobi_with_plain_mask():
    model = tiny_model()
    ids = random_ids(2, 20)
    mask = torch.arange(20) < 7
    with torch.no_grad():
        exact = model.recurrent_forward(ids, plain_prefix=7)
        jacobi = model(ids, passes=21, plain_mask=mask.expand(2, 20))
        plain = model(ids, passes=1)
    assert (exact.hidden - jacobi.hidden).abs().max() <= 1e-4
    # the plain prefix is exactly the one-pass transformer
    assert (exact.hidden[:, :7] - plain.hidden[:, :7]).abs().max() <= 1e-5


def test_one_pass_is_the_network_without_fusion_weights():
    model = tiny_model()
    plain = FullbandLM(model.config.replace(fusion="none")).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("fusion.")}
    plain.load_state_dict(state, strict=True)
    ids = random_ids(3, 40)
    with torch.no_grad():
        a, b = model(ids, passes=1), plain(ids, passes=1)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
    with pytest.raises(ValueError, match="passes=2 needs feedback weights"):
        plain(ids, passes=2)


@pytest.mark.parametrize("fusion, weights", [("gated", 2), ("concat", 2), ("additive", 1)])
def test_fusion_parameter_count(fusion, weights):
    model = tiny_model(fusion=fusion)
    D = model.config.d_model
    fusion_params = {n: p.numel() for n, p in model.named_parameters() if n.startswith("fusion.")}
    assert sum(fusion_params.values()) == weights * D * D
    extra = model.num_params() - FullbandLM(model.config.replace(fusion="none")).num_params()
    assert extra == weights * D * D  # norm_in's gain is shared with the plain path: no other new parameter


def test_gradients_flow_through_passes_unless_detached():
    for detach in (False, True):
        model = tiny_model(detach_between_passes=detach, jitter=0.0, prefix_mixin_prob=0.0).train()
        ids, targets = random_ids(2, 16), random_ids(2, 16, seed=5)
        out = model(ids, passes=3, feed=training_feed(model.config, noise=True, generator=None),
                    each_pass=lambda j, h, top: (h, ntp(model.head(top), targets)))
        first, last_loss = out.per_pass[0][0], out.per_pass[-1][1]
        if detach:
            assert torch.autograd.grad(last_loss, first, allow_unused=True, retain_graph=True)[0] is None
        else:
            (grad,) = torch.autograd.grad(last_loss, first, retain_graph=True)
            assert grad.abs().sum() > 0
        objective(model, ids, targets, 3).loss.backward()
        assert all(p.grad is not None for p in model.fusion.parameters())


def test_loss_composition():
    model = tiny_model(jitter=0.0, prefix_mixin_prob=0.0)
    ids, targets = random_ids(2, 16), random_ids(2, 16, seed=9)
    targets[0, :3] = -100
    model.train()
    out = objective(model, ids, targets, 3)
    assert len(out.pass_losses) == 3
    expected = out.pass_losses[0] + (out.pass_losses[1] + out.pass_losses[2]) / 2
    assert torch.allclose(out.loss, expected)
    with torch.no_grad():  # each pass's NTP is the cross-entropy of that many eval-mode passes
        for k, loss in enumerate(out.pass_losses, 1):
            assert torch.allclose(loss, ntp(model.eval()(ids, passes=k).logits, targets), atol=1e-6)
    # with zero noise the training-mode objective equals the eval-mode one
    with torch.no_grad():
        ev = objective(model.eval(), ids, targets, 3)
    assert torch.allclose(ev.loss, out.loss.detach(), atol=1e-6)
    weighted = tiny_model(jitter=0.0, prefix_mixin_prob=0.0, pass_loss_weight=0.5)
    o = objective(weighted, ids, targets, 2)
    assert torch.allclose(o.loss, o.pass_losses[0] + 0.5 * o.pass_losses[1])
    z = objective(model, ids, targets, 2, z_loss=1e-2)
    lse = [model(ids, passes=k).logits.float().logsumexp(-1).pow(2).mean() for k in (1, 2)]
    zterms = [ce + 1e-2 * lz for ce, lz in zip(z.pass_losses, lse)]
    assert torch.allclose(z.loss, zterms[0] + zterms[1], atol=1e-5)


def test_passes_beyond_the_fixed_point_cost_nothing_and_change_nothing():
    """A T-token sequence is exact after T passes: reading it with more, or an objective of more passes without noise,
    runs T passes and gives the same numbers (each later pass's term is the T-th's)."""
    model = tiny_model()
    T = 10
    ids, targets = random_ids(2, T), random_ids(2, T, seed=4)
    calls = []
    stack = model.stack
    model.stack = lambda x, cache=None: calls.append(1) or stack(x, cache)
    with torch.no_grad():
        long = model.read(ids, DecodeMode("fused", 40), return_logits=True)
        assert long.passes_used == T and len(calls) == T
        assert torch.equal(long.logits, model.read(ids, DecodeMode("fused", T - 1), return_logits=True).logits)
        calls.clear()
        obj = objective(model, ids, targets, 41)
        assert len(calls) == T and len(obj.pass_losses) == 41
        terms = [ntp(model(ids, passes=k).logits, targets) for k in range(1, T + 1)]
        want = terms[0] + torch.stack(terms[1:] + [terms[-1]] * (41 - T)).mean()
        assert torch.allclose(obj.loss, want, atol=1e-6)


def test_the_pass_loop_keeps_two_states_alive():
    """Adaptive prefill of 32 passes holds the current and the previous pass's state, not every pass's."""
    import weakref

    model = tiny_model()
    ids = random_ids(2, 48)
    refs: list = []
    alive: list[int] = []

    def each_pass(j, h, top):
        refs.append(weakref.ref(h))
        alive.append(sum(r() is not None for r in refs))

    with torch.no_grad():
        out = model(ids, passes=32, tol=1e-30, each_pass=each_pass)
    assert out.passes_used == 32 and max(alive) == 1, alive


def test_the_forward_adds_no_training_noise_the_objective_does():
    model = tiny_model(jitter=0.5, prefix_mixin_prob=1.0)
    ids, targets = random_ids(2, 32), random_ids(2, 32, seed=3)
    with torch.no_grad():
        a = model(ids, passes=3).hidden
        b = model.train()(ids, passes=3).hidden
        assert torch.equal(a, b)  # the model's forward is the same in both modes
        c = objective(model, ids, targets, 3, generator=torch.Generator().manual_seed(0)).state
        d = objective(model, ids, targets, 3, generator=torch.Generator().manual_seed(0)).state
        e = objective(model, ids, targets, 3, generator=torch.Generator().manual_seed(1)).state
        f = objective(model.eval(), ids, targets, 3, generator=torch.Generator().manual_seed(1)).state
    assert torch.equal(c, d) and not torch.equal(c, e)  # reproducible from the generator
    assert not torch.allclose(a, c) and torch.equal(a, f)  # noise in training mode only


def test_the_plain_rule_is_elementwise():
    """One rule for a batch, a decode step and vLLM's packed rows (torch or numpy)."""
    import numpy as np

    ids = torch.tensor([[256, 5, 7, 256, 9]])
    batch = plain_positions(ids, torch.arange(5), 256, prefix=2)
    assert batch.tolist() == [[True, True, False, True, False]]
    step = plain_positions(torch.tensor([256, 4, 4]), torch.tensor([7, 0, 3]), 256)
    assert step.tolist() == [True, True, False]
    packed = plain_positions(np.array([3, 3, 256]), np.array([2, 5, 6]), 256, prefix=np.array([4, 4, 1]))
    assert packed.tolist() == [True, False, True]
    mask = torch.tensor([[False, True, False, False, False]])
    assert plain_positions(ids, torch.arange(5), None, mask=mask).tolist() == [[True, True, False, False, False]]


def test_prefix_mixin_reverts_a_prefix_to_plain():
    g = torch.Generator().manual_seed(3)
    masks = torch.stack([prefix_mixin(4, 50, 1.0, torch.device("cpu"), g) for _ in range(200)])  # (200, 4, 50)
    # each row is a prefix: once False, stays False
    assert torch.all(masks[..., 1:] <= masks[..., :-1])
    lengths = masks.sum(-1).flatten().float()  # p + 1 with p ~ U[0, T)
    assert lengths.min() >= 1 and lengths.max() <= 50
    assert abs(lengths.mean().item() - 25.5) < 2.0
    used = torch.stack([prefix_mixin(8, 50, 0.5, torch.device("cpu"), g).any(-1) for _ in range(200)]).float().mean()
    assert abs(used.item() - 0.5) < 0.06


def test_top_state_norm_stays_order_one_with_depth():
    ids = random_ids(4, 64)
    rms = {}
    for layers in (2, 8, 32):
        model = tiny_model(n_layers=layers, feedback="residual")
        with torch.no_grad():
            rms[layers] = model(ids).hidden.pow(2).mean().sqrt().item()
    assert rms[32] < 2 * rms[2], rms
    assert 0.5 < rms[32] < 3, rms


def test_eval_forward_computes_only_what_is_asked():
    model = tiny_model()
    ids = random_ids(1, 10)
    out = model(ids, passes=2, return_logits=False)
    assert out.logits is None and out.hidden.shape == (1, 10, 64) and out.per_pass == []
    assert model(ids).logits.shape == (1, 10, 259)


def test_config_defaults_and_roundtrip():
    cfg = ModelConfig(d_model=768, n_heads=12)
    assert cfg.n_kv_heads == 12 and cfg.d_ff == 2048 and cfg.head_dim == 64
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert tiny_config().replace(fusion="concat").fusion == "concat"


def test_sliding_window_limits_what_local_layers_see():
    """Changing a token more than `window` positions back changes nothing in an all-local one-layer model."""
    model = tiny_model(n_layers=1, sliding_window=4)
    ids = random_ids(1, 20)
    other = ids.clone()
    other[0, 3] = (other[0, 3] + 1) % 256
    with torch.no_grad():
        a, b = model(ids).hidden, model(other).hidden
    assert torch.equal(a[0, :3], b[0, :3]) and not torch.allclose(a[0, 3:7], b[0, 3:7])
    assert torch.equal(a[0, 7:], b[0, 7:])  # positions >= 3 + 4 no longer see position 3
    glob = tiny_model(n_layers=2, sliding_window=4, global_every=2)
    assert [blk.attn.window for blk in glob.blocks] == [4, None]
