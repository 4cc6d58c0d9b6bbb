"""Hugging Face interoperability: a tiny random Llama (built from a config, nothing downloaded) loaded into the
native model gives the same logits and greedy tokens in STANDARD mode, and decodes in every mode."""

from __future__ import annotations

import pytest
import torch

from fullband import generate

transformers = pytest.importorskip("transformers")
from fullband.errors import ConfigError  # noqa: E402
from fullband.hf import from_llama  # noqa: E402


def tiny_llama(tie: bool, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=tie, bos_token_id=1)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms at 1; random gains make the parity check mean something
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_llama_logits_match_in_standard_mode(tie):
    hf = tiny_llama(tie)
    native = from_llama(hf).eval()
    assert native.config.tie_embeddings == tie and not native.config.qk_norm and not native.config.input_norm
    ids = torch.randint(2, 101, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = native(ids, passes=1).logits
    diff = (got - ref).abs().max().item()
    print(f"max |native - HF Llama| logits: {diff:.2e}")
    assert diff <= 1e-4


def test_llama_greedy_generation_matches_and_every_mode_runs():
    hf = tiny_llama(False, seed=3)
    native = from_llama(hf).eval()
    prompt = [1, 17, 42, 5, 88, 23]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                      pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(native, [prompt], 12, mode="standard")[0] == ref
    for mode in ("soft", "fused", "exact"):
        assert len(generate(native, [prompt], 6, mode=mode, prefill_passes=2)[0]) == 6
    # the converted model is a full-bandwidth model: its Jacobi fixed point is the exact recurrence
    ids = torch.tensor([prompt * 3])
    with torch.no_grad():
        jac = native(ids, passes=ids.shape[1] + 1).hidden
        rec = native.recurrent_forward(ids).hidden
    assert (jac - rec).abs().max().item() <= 1e-4


def test_fused_inputs_start_at_the_plain_inputs_scale():
    native = from_llama(tiny_llama(True))
    rms = native.embed.weight.pow(2).mean(-1).sqrt().mean()
    assert torch.allclose(native.norm_in.weight, rms.expand(64))


def test_unsupported_llama_variants_are_named():
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, attention_bias=True)
    with pytest.raises(ConfigError, match="attention_bias=True"):
        from_llama(transformers.LlamaForCausalLM(cfg))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50,
                                                                  bos_token_id=0, eos_token_id=0))
    with pytest.raises(ConfigError, match="model_type='gpt2'"):
        from_llama(gpt2)


# ---------------------------------------------------------------------- latent feedback around HF models
def _tiny_hf(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        return tiny_llama(False)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return transformers.Qwen2ForCausalLM(cfg).eval()
    cfg = transformers.GPT2Config(vocab_size=101, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_latent_feedback_on_hf_models(kind):
    from fullband.hf import add_latent_feedback

    hf = _tiny_hf(kind)
    attn = getattr(hf.config, "_attn_implementation", None)
    wrapped = add_latent_feedback(hf, bos_token_id=None).eval()
    ids = torch.randint(1, 101, (2, 14), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids).logits
        one = wrapped(ids, passes=1).logits
        assert (one - ref).abs().max().item() <= 1e-5  # pass 1 is the unwrapped model
        two = wrapped(ids, passes=2)
        assert (two.logits - ref).abs().max().item() > 1e-3  # the feedback changes later positions
        assert torch.allclose(two.logits[:, 0], ref[:, 0], atol=1e-5)  # position 0 stays plain
        jacobi = wrapped(ids, passes=ids.shape[1] + 1).hidden
    exact = wrapped.recurrent_forward(ids)  # through the HF KV cache, one token at a time
    diff = (jacobi - exact.hidden).abs().max().item()
    print(f"{kind} ({attn}): Jacobi fixed point vs cached recurrence {diff:.1e}")
    assert diff <= 1e-4
    # soft-style: a plain prompt, then the recurrence; its prompt positions equal the plain model
    soft = wrapped.recurrent_forward(ids, plain_prefix=6)
    assert torch.allclose(soft.logits[:, :6], ref[:, :6], atol=1e-4)
    # gradients reach the fusion from a multi-pass loss; the HF weights are shared, not copied
    wrapped.train()
    loss = wrapped(ids, passes=2).logits.logsumexp(-1).mean()
    loss.backward()
    assert wrapped.fusion.w_u.weight.grad is not None and wrapped.fusion.w_u.weight.grad.abs().sum() > 0
    assert wrapped.hf is hf


def test_latent_feedback_rejects_what_it_cannot_wrap():
    from fullband.hf import add_latent_feedback

    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=50, d_model=32, d_kv=8, d_ff=64,
                                                                       num_layers=1, num_heads=2))
    with pytest.raises(ConfigError, match="T5ForConditionalGeneration is an encoder-decoder"):
        add_latent_feedback(t5)
    with pytest.raises(ConfigError, match="needs a Hugging Face PreTrainedModel; got Linear"):
        add_latent_feedback(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="fusion='gate'"):
        add_latent_feedback(_tiny_hf("gpt2"), fusion="gate")

    class IdsOnly(torch.nn.Module):  # a base model that cannot take inputs_embeds
        def forward(self, input_ids):
            return input_ids

    class Custom(torch.nn.Module):
        config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)
        base_model = IdsOnly()

        def get_input_embeddings(self):
            return torch.nn.Embedding(50, 32)

        def get_output_embeddings(self):
            return torch.nn.Linear(32, 50)

    with pytest.raises(ConfigError, match="IdsOnly.forward takes no inputs_embeds"):
        add_latent_feedback(Custom())


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_latent_feedback_generate_matches_the_references(kind):
    from fullband.errors import InputError
    from fullband.hf import add_latent_feedback

    hf = _tiny_hf(kind)
    fb = add_latent_feedback(hf, bos_token_id=None).eval()
    prompt = torch.randint(1, 101, (2, 7), generator=torch.Generator().manual_seed(9))
    n, T = 6, prompt.shape[1]
    std = fb.generate(prompt, n, mode="standard")
    ref = hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)[:, T:]
    assert torch.equal(std, ref)
    for mode, plain_prefix in (("soft", T), ("exact", 0)):
        toks = fb.generate(prompt, n, mode=mode)
        full = torch.cat([prompt, toks], dim=1)
        rec = fb.recurrent_forward(full, plain_prefix=plain_prefix).logits
        assert torch.equal(toks, rec[:, T - 1 : -1].argmax(-1)), mode
    # uncached reference for SOFT: the Jacobi fixed point over prompt + generated tokens, the prompt kept plain
    soft = fb.generate(prompt, n, mode="soft")
    full = torch.cat([prompt, soft], dim=1)
    plain = torch.zeros_like(full, dtype=torch.bool)
    plain[:, :T] = True
    with torch.no_grad():
        jacobi = fb(full, passes=n + 2, plain_mask=plain).logits
    assert torch.equal(soft, jacobi[:, T - 1 : -1].argmax(-1))
    # sampling: reproducible with a seed, top_k=1 is greedy at any temperature
    a = fb.generate(prompt, n, mode="fused", temperature=1.0, seed=3)
    assert torch.equal(a, fb.generate(prompt, n, mode="fused", temperature=1.0, seed=3))
    assert torch.equal(fb.generate(prompt, n, mode="soft", temperature=2.0, top_k=1, seed=1), soft)
    # fullband.generate takes the wrapped model as it takes a native one; a bare HF model is refused by name
    assert generate(fb, prompt.tolist(), n, mode="soft") == soft.tolist()
    with pytest.raises(InputError, match="is not a fullband model"):
        generate(hf, prompt.tolist(), 2)
    with torch.no_grad():
        first = fb(prompt, passes=3).logits[:, -1].argmax(-1)
    fused = fb.generate(prompt, n, mode="fused", prefill_passes=2)
    assert fused.shape == (2, n) and torch.equal(fused[:, 0], first)
    assert torch.equal(fb.generate(prompt, n, mode="fused", prefill_passes=0), fb.generate(prompt, n, mode="soft"))
    with pytest.raises(InputError, match="mode='sof'"):
        fb.generate(prompt, 2, mode="sof")


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_latent_feedback_generate_runs_on_the_engine_ragged_and_stopping(kind):
    """The wrapper decodes through fullband's engine: a ragged batch (right-padded, masked, each row at its own
    positions) gives each row the tokens it gets alone, in every mode; stop tokens end rows; auto prefill runs."""
    from fullband.hf import add_latent_feedback

    fb = add_latent_feedback(_tiny_hf(kind), bos_token_id=None).eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 101, (n,), generator=g).tolist() for n in (7, 3, 11)]
    for mode, k in (("standard", 0), ("soft", 0), ("fused", 2), ("fused", "auto"), ("exact", 0)):
        together = fb.generate(prompts, 5, mode=mode, prefill_passes=k)
        alone = [fb.generate([p], 5, mode=mode, prefill_passes=k)[0] for p in prompts]
        assert together == alone, mode
    first = fb.generate([prompts[0]], 5, mode="soft")[0]
    stopped = fb.generate([prompts[0]], 5, mode="soft", stop_tokens=[first[1]])[0]
    assert stopped == first[:2]
    padded = fb.generate(torch.tensor([prompts[0]]), 5, mode="soft", stop_tokens=[first[1]])
    assert padded.tolist() == [first[:2] + [first[1]] * 3]  # a stopped row repeats its stop token


def test_latent_feedback_generate_compiled_equals_eager():
    """compile=True comes from the engine for the wrapper too (its step through torch.compile; ~30 s on a CPU)."""
    from fullband.hf import add_latent_feedback

    fb = add_latent_feedback(_tiny_hf("gpt2"), bos_token_id=None).eval()
    prompts = [[5, 6, 7, 8], [9, 10]]
    assert fb.generate(prompts, 6, mode="soft", compile=True) == fb.generate(prompts, 6, mode="soft")
