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
