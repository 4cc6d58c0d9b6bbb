"""Ponder slots (model.ponder; the PonderLM-2 rival): the Jacobi fixed point over the interleaved sequence equals the
exact sequential computation and a reimplementation written here from the block modules, it needs exactly T + 1
passes, cached decoding (two steps per token, a KV cache of 2 T slots) equals an uncached recompute, only the last
pass is trained, training resumes bitwise, folders round-trip, and the other runtimes and one-pass modes refuse."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_resume_is_bitwise, random_ids, tiny_model, write_config
from fullband import FullbandLM, generate
from fullband.errors import ConfigError, InputError
from fullband.model.config import ModelConfig, require_default_layers
from fullband.model.objective import objective
from test_decode import _steps

PONDER = dict(ponder=True, fusion="none", jitter=0.0, prefix_mixin_prob=0.0)


def _model(seed: int = 0, **changes) -> FullbandLM:
    """A 2-block float64 model with ponder slots."""
    return tiny_model(seed, d_model=32, n_heads=4, n_kv_heads=2, **{**PONDER, **changes}).double()


def _by_hand(model: FullbandLM, ids: torch.Tensor, prompt_states: torch.Tensor | None = None) -> torch.Tensor:
    """PonderLM-2 token by token, without the core, _blocks or a cache: each token appends its slot (norm_in of its
    embedding), the whole sequence so far runs through the blocks (slot s at rotary s // 2), the last slot's
    final-norm output is appended as the ponder slot, and the sequence runs again; the ponder slot's output gives
    the logits. `prompt_states` (B, P, D) replace the ponder inputs of the first P tokens (a Jacobi-read prompt).
    -> logits (B, T, V)."""
    def run(slots: list[torch.Tensor]) -> torch.Tensor:
        x = torch.stack(slots, 1)  # (B, S, D)
        rope = torch.arange(x.shape[1]) // 2
        cos, sin = model.rotary.cos[rope][None, :, None].to(x.dtype), model.rotary.sin[rope][None, :, None].to(x.dtype)
        for block in model.blocks:
            x = block(x, cos, sin)
        return model.norm_out(x[:, -1])

    slots, logits = [], []
    for t in range(ids.shape[1]):
        slots.append(model.norm_in(model.embed(ids[:, t])))
        state = run(slots)
        slots.append(state if prompt_states is None or t >= prompt_states.shape[1] else prompt_states[:, t])
        logits.append(model.head(run(slots)))
    return torch.stack(logits, 1)


def test_the_jacobi_fixed_point_is_the_sequential_computation():
    model, ids = _model(), random_ids(2, 7)
    T = ids.shape[1]
    with torch.no_grad():
        hand = _by_hand(model, ids)
        exact = model.recurrent_forward(ids)  # the cached two-step decode, token by token
        jacobi = model(ids, passes=T + 1)
        far = model(ids, passes=T + 4)
        short, head = model(ids[:, :3], passes=3), exact.logits[:, :3]
    assert model.exact_passes(T) == T + 1
    assert (exact.logits - hand).abs().max() < 1e-12
    assert (jacobi.logits - exact.logits).abs().max() < 1e-12 and (jacobi.hidden - exact.hidden).abs().max() < 1e-12
    assert (far.logits - exact.logits).abs().max() < 1e-12
    # pass j's ponder slots are exact up to position j - 2: T passes leave the last position short (on 3 tokens: the
    # error shrinks about 1000x a pass in this micro model, below float64's resolution after 7)
    assert (short.logits[:, :2] - head[:, :2]).abs().max() < 1e-12
    assert (short.logits[:, 2] - head[:, 2]).abs().max() > 1e-9


def test_one_pass_is_the_plain_model_with_no_new_weights():
    ids = random_ids(2, 6)
    plain, ponder = tiny_model(0, d_model=32, n_heads=4, n_kv_heads=2, fusion="none").double(), _model()
    a, b = plain.state_dict(), ponder.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(ponder(ids).logits, plain(ids).logits)
    assert not ModelConfig().ponder and ModelConfig().fusion == "gated"  # the default model is untouched


@pytest.mark.parametrize("mode, k", [("exact", 1), ("fused", 2), ("fused", 8)])
def test_cached_decoding_equals_an_uncached_recompute(mode, k):
    model = _model()
    prompt = random_ids(1, 6, seed=3)[0].tolist()
    tokens, logits = _steps(model, prompt, mode, k)
    seq = torch.tensor([prompt + tokens])
    P, n = len(prompt), len(tokens)
    with torch.no_grad():  # fused k: 1 + k passes over the prompt, whose last reads pass k's states
        states = None if mode == "exact" else model(seq[:, :P], passes=min(k, P + 1)).hidden
        ref = _by_hand(model, seq, states)[0, P - 1 : P + n - 1]
    assert (logits - ref).abs().max() < 1e-10
    if k == 8:  # past the fixed point the prompt read is the exact one
        assert tokens == _steps(model, prompt, "exact")[0]
    rows = [prompt, prompt[:3]]  # a ragged batch decodes each row as it decodes alone
    assert generate(model, rows, 5, mode=mode, prefill_passes=k) == [
        generate(model, [r], 5, mode=mode, prefill_passes=k)[0] for r in rows]


def test_the_kv_cache_holds_two_slots_per_token():
    model = _model()
    cache = model.new_cache(2, 5)
    assert cache.max_len == 10 and len(cache.k) == model.config.n_layers
    assert tiny_model(0).new_cache(2, 5).max_len == 5
    ids = random_ids(1, 5)
    with torch.no_grad():
        model(ids, passes=3, cache=cache)
    assert cache.k[0][0].abs().sum(-1).sum(-1).ne(0).sum() == 10  # every slot of the 5 tokens written


def test_one_pass_modes_are_refused():
    model, prompt = _model(), [[1, 2, 3]]
    for mode, k in (("standard", None), ("soft", None), ("fused", 0)):
        with pytest.raises(InputError, match="ponder model .*accepted: fused with prefill_passes >= 1.*or exact"):
            generate(model, prompt, 2, mode=mode, prefill_passes=k)


def test_only_the_last_pass_is_trained():
    model, ids = _model().train(), random_ids(2, 8)
    targets = torch.roll(ids, -1, 1)
    out = objective(model, ids, targets, 3)
    assert len(out.pass_losses) == 3 and torch.equal(out.loss, out.pass_losses[-1])
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    with torch.no_grad():  # eval: passes past the fixed point are not run again
        assert torch.equal(objective(model.eval(), ids[:, :2], targets[:, :2], 6).loss,
                           objective(model, ids[:, :2], targets[:, :2], 3).loss)


PONDER_MODEL = """vocab_size = 259
d_model = 32
n_layers = 2
n_heads = 2
max_seq_len = 128
fusion = "none"
ponder = true
jitter = 0.0
prefix_mixin_prob = 0.0"""


def test_training_resumes_bitwise_and_folders_round_trip(tmp_path, corpus, cache, monkeypatch):
    passes = '[{until = 1.0, probs = {"2" = 0.5, "3" = 0.5}}]'
    whole, part = (write_config(tmp_path, corpus, cache, name, steps=5, ckpt_every=2, keep_last=3,
                                model=PONDER_MODEL, passes=passes) for name in ("whole", "part"))
    assert_resume_is_bitwise(whole, part, monkeypatch, stop_before=3, last="step_000005")
    back = FullbandLM.load(tmp_path / "whole" / "step_000005")
    assert back.config.ponder
    back.save(tmp_path / "native")
    again, ids = FullbandLM.load(tmp_path / "native"), random_ids(1, 6)
    with torch.no_grad():
        assert torch.equal(again(ids, passes=3).logits, back(ids, passes=3).logits)
    from fullband.hf.convert import convert

    with pytest.raises(ConfigError, match=r"a transformers folder \(convert to='hf'\) runs one position per token; "
                                          "got ponder=true"):
        convert(tmp_path / "native", tmp_path / "hf")


def test_other_runtimes_refuse_ponder_by_name():
    cfg = ModelConfig(n_layers=2, **PONDER)
    with pytest.raises(ConfigError, match="fullband's vLLM model runs one position per token; got ponder=true"):
        require_default_layers(cfg, "fullband's vLLM model")
    transformers = pytest.importorskip("transformers")
    from fullband.hf import add_latent_feedback
    from fullband.hf.modeling import FullbandConfig

    with pytest.raises(ConfigError, match=r"the transformers class \(FullbandForCausalLM\) runs one position"):
        FullbandConfig.from_model_config(cfg, feedback_mode="exact")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50,
                                                                     bos_token_id=0, eos_token_id=0))
    with pytest.raises(ConfigError, match=r"ponder=true \(PonderLM-2's ponder slots\) is its own mechanism; got fus"):
        add_latent_feedback(gpt2, config=cfg)  # it always fuses (no fusion = "none"): refused by the config


@pytest.mark.parametrize("bad, match", [
    (dict(ponder=True), 'ponder=true .* got fusion="gated", jitter=0.02, prefix_mixin_prob=0.5; accepted with it: '
                        'fusion = "none", feedback_source = null, feedback_target = 0'),
    (dict(PONDER, loop_start=0, loop_stop=1), "got loop_start=0;"),
    (dict(PONDER, sliding_window=4), "got sliding_window=4;"),
    (dict(PONDER, feedback_target=1, feedback="residual"), "got feedback_target=1;"),
    (dict(PONDER, pass_loss_weight=0.5), "got pass_loss_weight=0.5;"),
    (dict(ponder="yes"), "ponder"),
])
def test_ponder_settings_are_checked_by_name(bad, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(n_layers=2, **bad)
