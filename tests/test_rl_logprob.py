"""The log-probability of sampled responses, three ways (fullband.rl.logprob), against what the decode engine itself
computed while sampling them: exact and replay within 1e-5, Jacobi once K reaches the response length (+ k), the
exact gradient against finite differences."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from fullband import generate
from fullband.decode.sampling import Sampling
from fullband.errors import InputError
from fullband.model.mode import DecodeMode
from fullband.rl.logprob import logprobs, rollout, scores

PROMPTS = [[256, 5, 9, 12, 7], [256, 40], [256, 3, 3, 8, 1, 2, 90, 14]]  # ragged; 256 = BOS
NEW = 7
MODES = ["standard", "soft", "fused:1", "fused:3"]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, jitter=0.0).double()  # float64: the paths agree to rounding, far below 1e-5


@pytest.fixture(scope="module")
def rollouts(model):
    # stop at id 7 for one row at least: ragged responses too
    return {m: rollout(model, PROMPTS, NEW, mode=m, sampling=Sampling(temperature=1.0, seed=11), stop_tokens=[7])
            for m in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_a_rollout_is_what_generate_samples(model, rollouts, mode):
    r = rollouts[mode]
    assert r.responses == generate(model, PROMPTS, NEW, mode=DecodeMode.parse(mode), temperature=1.0, seed=11,
                                   stop_tokens=[7])
    assert all(1 <= len(y) <= NEW for y in r.responses) and r.logprobs.shape == (3, NEW)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", ["exact", "replay"])
def test_exact_and_replay_equal_the_engines_own_logprobs(model, rollouts, mode, path):
    r = rollouts[mode]
    got = logprobs(model, r, path).detach()
    assert torch.allclose(got, r.logprobs.to(got.dtype), atol=1e-5, rtol=0), (got - r.logprobs).abs().max()
    assert (got[~r.mask] == 0).all()


@pytest.mark.parametrize("mode", ["soft", "fused:1", "fused:3"])
def test_jacobi_converges_to_exact_at_the_response_length(model, rollouts, mode):
    r = rollouts[mode]
    k = r.mode.fused_passes
    longest = max(len(y) for y in r.responses)
    errors = [float((logprobs(model, r, f"jacobi:{K}").detach() - r.logprobs).abs().max())
              for K in range(1, longest + k + 1)]
    assert errors[-1] < 1e-5, errors  # K = R + k passes: exact
    assert errors[0] > 1e-4, errors  # one pass is not: the responses read fed states


def _finite_difference_check(model, r, names: tuple[str, ...]) -> None:
    """The exact path's gradient along a random direction in the parameters `names` against a central difference."""
    params = {n: p for n, p in model.named_parameters() if n in names}
    assert len(params) == len(names), [n for n, _ in model.named_parameters()][:12]
    torch.manual_seed(0)
    direction = {n: torch.randn_like(p) for n, p in params.items()}
    model.zero_grad()
    logprobs(model, r, "exact").sum().backward()
    analytic = sum(float((params[n].grad * direction[n]).sum()) for n in params)
    eps = 1e-6
    with torch.no_grad():
        values = []
        for sign in (1, -1):
            for n, p in params.items():
                p.add_(sign * eps * direction[n])
            values.append(float(logprobs(model, r, "exact").sum()))
            for n, p in params.items():
                p.sub_(sign * eps * direction[n])
    numeric = (values[0] - values[1]) / (2 * eps)
    assert abs(numeric) > 1e-3 and abs(analytic - numeric) < 1e-5 * max(1.0, abs(numeric)), (analytic, numeric)


def test_the_exact_gradient_matches_finite_differences(model, rollouts):
    _finite_difference_check(model, rollouts["fused:1"], ("fusion.w_g.weight", "blocks.0.attn.wqkv.weight"))


def test_jacobi_at_the_fixed_point_has_the_exact_gradient_and_replay_a_cut_one(model, rollouts):
    r = rollouts["soft"]

    def grad(path: str) -> torch.Tensor:
        model.zero_grad()
        logprobs(model, r, path).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    exact = grad("exact")
    assert torch.allclose(grad(f"jacobi:{NEW}"), exact, atol=1e-8, rtol=1e-6)
    cos = torch.nn.functional.cosine_similarity(grad("replay"), exact, dim=0)
    assert 0.0 < float(cos) < 1 - 1e-6  # the states are constants: a different gradient


@pytest.mark.parametrize("path,words", [("jacobi", "jacobi:K"), ("jacobi:0", ">= 1"), ("jacobi:²", "jacobi passes K"),
                                        ("replay:2", "unknown"), ("exactly", "accepted: exact, jacobi:K")])
def test_bad_paths_are_named(model, rollouts, path, words):
    with pytest.raises(InputError, match=words):
        logprobs(model, rollouts["soft"], path)


@pytest.mark.parametrize("mode", ["exact", "fused:auto"])
def test_modes_that_cannot_be_trained_on_policy_are_refused(model, mode):
    with pytest.raises(InputError, match="cannot be trained on-policy"):
        rollout(model, PROMPTS, 2, mode=mode)


@pytest.mark.parametrize("mode", ["soft", "fused:2"])
def test_the_paths_agree_in_float32_too(mode):
    model = tiny_model(seed=3)
    r = rollout(model, PROMPTS, NEW, mode=mode, sampling=Sampling(temperature=1.0, seed=5))
    longest = max(len(y) for y in r.responses)
    for path in ("exact", "replay", f"jacobi:{longest + r.mode.fused_passes}"):
        assert float((logprobs(model, r, path).detach() - r.logprobs).abs().max()) < 1e-5, path


def test_the_study_measures_each_path_against_exact():
    from fullband.rl.study import logprob_study

    model = tiny_model(seed=3)
    rows = logprob_study(model, PROMPTS, 5, modes=["soft"], paths=["jacobi:1", "jacobi:5", "replay"],
                         sampling=Sampling(temperature=1.0, seed=2), repeats=1)
    by = {r["path"]: r for r in rows}
    assert by["jacobi:5"]["max_error"] < 1e-5 and abs(by["jacobi:5"]["grad_cosine"] - 1) < 1e-5
    assert by["replay"]["max_error"] < 1e-5 and by["replay"]["grad_cosine"] < 1 - 1e-6
    assert by["jacobi:1"]["mean_error"] > 1e-3 and all(r["saved_mib"] > 0 and r["tokens"] == 15 for r in rows)
    assert by["jacobi:5"]["saved_mib"] > by["jacobi:1"]["saved_mib"]  # five passes' graphs against one


@pytest.mark.parametrize("mode", ["soft", "fused:1"])
def test_scores_at_a_temperature_agree_between_paths(model, rollouts, mode):
    """scores (what TRL reads): at temperature 1 the log-probs are logprobs'; at another temperature exact and
    jacobi:R+k still agree, log-probs and entropies, and the log-probs are not those at 1."""
    r = rollouts[mode]
    assert torch.equal(scores(model, r, "exact")[0], logprobs(model, r, "exact"))
    K = max(len(y) for y in r.responses) + r.mode.fused_passes
    (lp, ent), (lp_j, ent_j) = (scores(model, r, p, temperature=0.5) for p in ("exact", f"jacobi:{K}"))
    torch.testing.assert_close(lp_j, lp, rtol=0, atol=1e-10)
    torch.testing.assert_close(ent_j, ent, rtol=0, atol=1e-10)
    assert (ent[r.mask] > 0).all() and (ent[~r.mask] == 0).all() and (lp - logprobs(model, r)).abs().max() > 1e-2
    with pytest.raises(InputError, match="temperature"):
        scores(model, r, temperature=0)


@pytest.fixture(scope="module")
def ponder():
    """A float64 PonderLM-2 model: its ponder slot t reads token t's own state (state_lag 0), not t - 1's."""
    model = tiny_model(3, d_model=32, n_heads=4, n_kv_heads=2, ponder=True, fusion="none", jitter=0.0,
                       prefix_mixin_prob=0.0).double()
    return model, {m: rollout(model, PROMPTS, NEW, mode=m, sampling=Sampling(temperature=1.0, seed=11),
                              stop_tokens=[7]) for m in ("fused:1", "fused:3")}


def test_a_ponder_models_exact_gradient_matches_finite_differences(ponder):
    """A ponder token's two decode steps write the cache twice: the exact path's backward needs the first write's
    keys and values as they were."""
    model, rollouts = ponder
    _finite_difference_check(model, rollouts["fused:1"], ("blocks.0.attn.wqkv.weight", "blocks.1.mlp.w_down.weight"))


@pytest.mark.parametrize("mode", ["fused:1", "fused:3"])
def test_a_ponder_models_jacobi_logprobs_and_gradient_are_exact(ponder, mode):
    """The freeze mask holds the states the prompt's ponder slots read, the last prompt position's included (which
    the first response token's logits come from): values and gradient equal exact's at K = R + k."""
    model, rollouts = ponder
    r = rollouts[mode]
    K = max(len(y) for y in r.responses) + r.mode.fused_passes

    def grad(path: str) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad()
        lp = logprobs(model, r, path)
        lp.sum().backward()
        return lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    (lp, g), (lp_exact, g_exact) = grad(f"jacobi:{K}"), grad("exact")
    assert (lp - r.logprobs).abs().max() < 1e-12 and (lp_exact - r.logprobs).abs().max() < 1e-12
    assert torch.allclose(g, g_exact, atol=1e-10, rtol=1e-8)



@pytest.mark.parametrize("mode", ["fused:1", "fused:3"])
def test_a_ponder_models_replay_is_exact(ponder, mode):
    """Replay runs the model's own pass (a ponder pass: no fusion weights) fed the recorded states, the prompt's
    ponder slots the states they read while prefilling."""
    model, rollouts = ponder
    r = rollouts[mode]
    got = logprobs(model, r, "replay").detach()
    assert (got - r.logprobs).abs().max() < 1e-12 and (got[~r.mask] == 0).all()
    assert (got[r.mask] < 0).all()
