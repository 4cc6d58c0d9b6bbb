"""Where the state leaves and enters the stack (model.feedback_source, model.feedback_target) and the mixer
(model.fusion), in the one Jacobi machinery: for our model, T2MLR-like and LRT-like settings and combinations none
of the papers ran, the Jacobi fixed point equals the exact recurrence, cached decoding equals a full recompute in
every feeding mode, the recurrence equals one written by hand from the block modules, folders round-trip, training
resumes bitwise, and the default model is unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import assert_resume_is_bitwise, losses, random_ids, tiny_model, write_config
from fullband import FullbandLM, stream
from fullband.errors import ConfigError
from fullband.model.config import ModelConfig
from fullband.model.layers import rms_norm
from test_decode import _steps, _uncached_logits

SETTINGS = {
    "ours": dict(),
    "t2mlr-like": dict(feedback_target=1, feedback_source=2, feedback="residual", fusion="t2mlr"),
    "top-into-1": dict(feedback_target=1, fusion="gated"),
    "lrt-like": dict(feedback_source=2, feedback="residual", fusion="additive"),
    "source-is-target": dict(feedback_target=2, feedback_source=2, feedback="residual", fusion="concat"),
    "into-the-top-raw": dict(feedback_target=3, fusion="t2mlr", input_norm=False, tie_embeddings=False),
}


def _model(name: str, seed: int = 0) -> FullbandLM:
    """A 4-block float64 model with the setting `name`; biases and ReZero scales moved off 0, so that T2MLR's mixer
    does not start as the identity (at 0 every test would pass with the state ignored)."""
    model = tiny_model(seed, n_layers=4, d_model=32, n_heads=4, n_kv_heads=2, **SETTINGS[name]).double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias") or ".scale_" in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _ids(T: int = 10, seed: int = 1) -> torch.Tensor:
    ids = random_ids(2, T, seed=seed)
    ids[1, 4] = 256  # a document starts mid-row: plain there
    return ids


def _by_hand(model: FullbandLM, ids: torch.Tensor, plain_prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact recurrence without the core, its cache or the runtime's stack: the embedding through the blocks below
    the target once, then for each t the blocks from the target up over positions 0..t, position u > 0 fused with the
    state of u - 1, each fusion written out -> (states, logits), (B, T, D) and (B, T, V)."""
    cfg, blocks = model.config, model.blocks
    B, T = ids.shape
    m, s, top = cfg.feedback_target, cfg.source_layer, cfg.n_layers - 1
    e = model.embed(ids)
    x = model.norm_in(e) if cfg.input_norm else e
    cos, sin = model.rotary.prefix(T, x.dtype)
    for i in range(m):
        x = blocks[i](x, cos, sin)
    plain = (torch.arange(T) < max(plain_prefix, 1))[None] | (ids == cfg.bos_token_id)
    states, logits = torch.zeros_like(x), torch.zeros(B, T, cfg.vocab_size, dtype=x.dtype)
    f = model.fusion
    for t in range(T):
        inputs = []
        for u in range(t + 1):
            xu, h = x[:, u], states[:, u - 1]
            g = xu if (cfg.input_norm and m == 0) else rms_norm(xu, None, model.norm_in.eps)
            if cfg.fusion == "gated":
                fused = model.norm_in((h @ f.w_u.weight.T) * torch.sigmoid(g @ f.w_g.weight.T))
            elif cfg.fusion == "additive":
                fused = model.norm_in(g + h @ f.w_h.weight.T)
            elif cfg.fusion == "concat":
                fused = model.norm_in(torch.cat([g, h], -1) @ f.w_cat.weight.T)
            else:  # t2mlr: the raw stream plus two gated terms, no norm around it
                both = torch.cat([xu, h], -1)
                fed = torch.sigmoid(both @ f.w_gh.weight.T + f.w_gh.bias) * (h @ f.w_p.weight.T)
                kept = torch.sigmoid(both @ f.w_gx.weight.T + f.w_gx.bias) * xu
                fused = xu + torch.tanh(f.scale_h) * fed + torch.tanh(f.scale_x) * kept
            inputs.append(torch.where(plain[:, u, None], xu, fused))
        y = torch.stack(inputs, 1)
        for i in range(m, cfg.n_layers):
            y = blocks[i](y, cos[:, : t + 1], sin[:, : t + 1])
            if i == s:
                source = y[:, t]
        final = model.norm_out(y[:, t])
        states[:, t] = final if (s == top and cfg.feedback == "final") else source
        logits[:, t] = model.head(final)
    return states, logits


@pytest.mark.parametrize("name", SETTINGS)
def test_the_jacobi_fixed_point_is_the_exact_recurrence_and_the_recurrence_by_hand(name):
    model, ids = _model(name), _ids()
    with torch.no_grad():
        exact = model.recurrent_forward(ids)
        jacobi = model(ids, passes=ids.shape[1])
        states, logits = _by_hand(model, ids)
        fewer = model(ids, passes=3)
    assert (jacobi.hidden - exact.hidden).abs().max() < 1e-10 and (jacobi.logits - exact.logits).abs().max() < 1e-10
    assert (exact.hidden - states).abs().max() < 1e-10 and (exact.logits - logits).abs().max() < 1e-10
    # the state is really read: three passes are exact on positions < 3 only
    assert (fewer.logits[:, :3] - exact.logits[:, :3]).abs().max() < 1e-10
    assert (fewer.logits[:, 3:] - exact.logits[:, 3:]).abs().max() > 1e-6


@pytest.mark.parametrize("name", ["t2mlr-like", "lrt-like", "source-is-target", "into-the-top-raw"])
def test_cached_decoding_equals_an_uncached_recompute(name):
    model = _model(name)
    prompt = random_ids(1, 7, seed=3)[0].tolist()
    for mode, ks in (("soft", [1]), ("exact", [1]), ("fused", [0, 2])):
        for k in ks:
            tokens, logits = _steps(model, prompt, mode, k)
            ref = _uncached_logits(model, prompt, tokens, mode, k)
            assert (logits - ref).abs().max().item() < 1e-9, (mode, k)


@pytest.mark.parametrize("name", ["t2mlr-like", "top-into-1", "lrt-like"])
def test_each_decode_step_equals_the_recurrence_by_hand(name):
    model = _model(name)
    prompt = random_ids(1, 6, seed=5)[0].tolist()
    for mode, prefix in (("exact", 0), ("soft", 6)):
        steps = list(stream(model, [prompt], 5, mode=mode))
        seq = torch.tensor([prompt + [int(s.tokens[0]) for s in steps]])
        with torch.no_grad():
            states, logits = _by_hand(model, seq, plain_prefix=prefix)
        got = torch.stack([s.logits[0] for s in steps])
        assert (got - logits[0, 5:-1]).abs().max() < 1e-10, mode


def test_folders_round_trip_and_old_folders_load_unchanged(tmp_path):
    from fullband.hf.convert import convert

    model, ids = _model("t2mlr-like").float(), _ids()
    model.save(tmp_path / "native")
    back = FullbandLM.load(tmp_path / "native")
    assert back.config == model.config
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the transformers class holds the native model: every setting converts and computes the same
    transformers = pytest.importorskip("transformers")
    convert(tmp_path / "native", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(hf(ids, feedback_mode="fused", prefill_passes=2).logits, model(ids, passes=3).logits)
    # a folder written before these keys existed (no feedback_source / feedback_target) is the default model
    ours = tiny_model(seed=2)
    ours.save(tmp_path / "old")
    path = tmp_path / "old" / "config.json"
    data = json.loads(path.read_text())
    section = data.get("model", data)
    assert section.pop("feedback_source") is None and section.pop("feedback_target") == 0
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="feedback_source=None, feedback_target=0"):
        old = FullbandLM.load(tmp_path / "old")
    assert old.config == ours.config
    with torch.no_grad():
        assert torch.equal(old(ids, passes=3).logits, ours(ids, passes=3).logits)


# the seed-0 tiny model's logits (three passes) as the code before feedback_source / feedback_target computed them
REFERENCE = [0.1122668475, 0.060849751, -0.1050768665, 10.9582331741, 336.6901600714]


def test_the_default_model_is_unchanged():
    model = tiny_model(seed=0).double()
    with torch.no_grad():
        out = model(_ids(), passes=3).logits
    got = [round(float(v), 10) for v in (out[0, -1, :3].tolist() + [out.sum(), out[1].abs().sum()])]
    assert got == pytest.approx(REFERENCE, abs=1e-9)


def test_settings_are_checked_by_name_and_other_runtimes_refuse_them():
    for bad, match in ((dict(feedback_target=4), "feedback_target=4"),
                       (dict(feedback_target=2, feedback_source=1, feedback="residual"), "feedback_source=1"),
                       (dict(feedback_source=2), 'feedback = "residual"'),
                       (dict(feedback_source=-1, feedback="residual"), "feedback_source=-1")):
        with pytest.raises(ConfigError, match=match):
            ModelConfig(n_layers=4, **bad)
    assert ModelConfig(n_layers=4, feedback_source=3).default_layers  # the top, named
    transformers = pytest.importorskip("transformers")
    from fullband.hf import add_latent_feedback

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50,
                                                                     bos_token_id=0, eos_token_id=0))
    with pytest.raises(ConfigError, match="add_latent_feedback .*feedback_target=1"):
        add_latent_feedback(gpt2, config=ModelConfig(feedback_target=1))
    wrapped = add_latent_feedback(gpt2, fusion="t2mlr").eval()  # the mixer alone it runs
    ids = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # untrained, T2MLR's mixer passes its input through: every pass is the plain one
        assert torch.allclose(wrapped(ids, passes=3).logits, wrapped(ids).logits, atol=1e-6)


T2MLR_MODEL = """vocab_size = 259
d_model = 32
n_layers = 3
n_heads = 2
max_seq_len = 128
fusion = "t2mlr"
feedback = "residual"
feedback_target = 1
feedback_source = 1"""


def test_training_a_rival_setting_resumes_bitwise(tmp_path, corpus, cache, monkeypatch):
    from safetensors.torch import load_file

    whole, part = (write_config(tmp_path, corpus, cache, name, steps=7, ckpt_every=3, keep_last=3, model=T2MLR_MODEL)
                   for name in ("whole", "part"))
    assert_resume_is_bitwise(whole, part, monkeypatch, stop_before=4, last="step_000007")  # resumes at step 3
    assert max(len(row) for row in losses(tmp_path / "whole")) > 1  # multi-pass steps ran
    weights = load_file(str(tmp_path / "whole" / "step_000007" / "model.safetensors"))
    assert any(weights[k].abs().max() > 0 for k in ("fusion.scale_h", "fusion.scale_x"))  # the mixer trained


def test_probes_read_every_depth_when_the_state_enters_above_block_0():
    pytest.importorskip("sklearn")
    from fullband import ByteTokenizer
    from fullband.data.synthetic import completion_tracking
    from fullband.eval.probe import final_streams

    model = tiny_model(n_layers=4, max_seq_len=512, feedback_target=2)
    examples = completion_tracking(groups=2, scratch=(0,))
    std, one, full = (final_streams(model, ByteTokenizer(), examples, m) for m in ("standard", "one-step", "full"))
    # the inputs of blocks 0 and 1 (below the target) are functions of the tokens only: the same in every mode
    assert np.allclose(std[:, :2], one[:, :2], atol=1e-6) and np.allclose(std[:, :2], full[:, :2], atol=1e-6)
    # the target block's input is fused: it carries the previous position's state
    assert not np.allclose(std[:, 2], one[:, 2], atol=1e-4) and not np.allclose(one[:, 2:], full[:, 2:], atol=1e-4)
