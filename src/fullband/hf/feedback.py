"""Latent feedback around any Hugging Face decoder-only LM: only the input construction changes.

`add_latent_feedback(model)` wraps e.g. a LlamaForCausalLM, Qwen2ForCausalLM or GPT2LMHeadModel. Pass 1 is the
unchanged model; each later pass builds `inputs_embeds` by fusing every position's token embedding with the
previous position's top hidden state (the base model's `last_hidden_state`, after its final norm) through the
fusion operator, and the exact recurrence runs token by token through the model's own KV cache. The wrapped
model's weights are not touched; the new ones are the fusion and `norm_in`, whose gain starts at the
embedding RMS so fused inputs begin at the scale of plain ones.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from fullband.errors import ConfigError, InputError
from fullband.model.decoder import ModelOutput, plain_positions, shift_right
from fullband.model.fusion import FUSION_TYPES, build_fusion, embedding_rms, fused_input, init_fusion_weight_
from fullband.model.layers import RMSNorm


class LatentFeedback(nn.Module):
    """A HF causal LM with latent feedback: `forward(ids, passes=k)` (Jacobi passes) and `recurrent_forward`."""

    def __init__(self, model: nn.Module, fusion: str = "gated", bos_token_id: int | None = None) -> None:
        super().__init__()
        name = type(model).__name__
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(model, "get_input_embeddings") or not hasattr(model, "base_model"):
            raise ConfigError(f"add_latent_feedback needs a Hugging Face PreTrainedModel; got {name}")
        if getattr(cfg, "is_encoder_decoder", False):
            raise ConfigError(f"add_latent_feedback wraps decoder-only causal LMs; {name} is an encoder-decoder")
        head = model.get_output_embeddings()
        emb = model.get_input_embeddings()
        if head is None or emb is None or model.base_model is model:
            raise ConfigError(f"{name} has no separate base model, input embedding and LM head; add_latent_feedback "
                              "needs a *ForCausalLM / *LMHeadModel whose base model accepts inputs_embeds")
        if fusion not in FUSION_TYPES:
            raise ConfigError(f"fusion={fusion!r} is unknown; accepted: {', '.join(FUSION_TYPES)}")
        self.hf = model
        d_model = emb.weight.shape[1]
        self.fusion = build_fusion(fusion, d_model)
        self.norm_in = RMSNorm(d_model, getattr(cfg, "rms_norm_eps", None) or getattr(cfg, "layer_norm_epsilon", 1e-6))
        self.bos_token_id = bos_token_id if bos_token_id is not None else getattr(cfg, "bos_token_id", None)
        for p in self.fusion.parameters():
            init_fusion_weight_(p)
        with torch.no_grad():
            self.norm_in.weight.fill_(embedding_rms(emb.weight))
        # the base model's KV-cache keyword: `cache` in newer transformers, else past_key_values
        self._cache_arg = "cache" if "cache" in inspect.signature(model.base_model.forward).parameters else "past_key_values"
        dtype = emb.weight.dtype
        self.fusion.to(dtype)
        self.norm_in.to(dtype)

    # ---------------------------------------------------------------- pieces
    def _plain(self, input_ids: Tensor, plain_prefix: int = 0, plain_mask: Tensor | None = None) -> Tensor:
        return plain_positions(input_ids, self.bos_token_id, plain_mask, plain_prefix)

    def _fuse(self, e: Tensor, prev: Tensor, plain: Tensor) -> Tensor:
        return fused_input(self.fusion, self.norm_in, e, prev, plain, normalise_gate=True)

    def _check(self, input_ids: Tensor) -> None:
        if not isinstance(input_ids, Tensor) or input_ids.ndim != 2 or input_ids.dtype.is_floating_point:
            raise InputError("input_ids must be an integer tensor of shape (B, T)")
        if input_ids.numel() == 0:
            raise InputError(f"input_ids is empty (shape {tuple(input_ids.shape)})")

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: Tensor, passes: int = 1, *, plain_mask: Tensor | None = None) -> ModelOutput:
        """k Jacobi passes over the sequence; pass 1 is exactly the wrapped model."""
        self._check(input_ids)
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise InputError(f"passes={passes!r} is invalid; accepted: an integer >= 1")
        e = self.hf.get_input_embeddings()(input_ids)
        plain = self._plain(input_ids, plain_mask=plain_mask)
        state = None
        x = e
        for j in range(passes):
            if j > 0:
                x = self._fuse(e, shift_right(state), plain)
            state = self.hf.base_model(inputs_embeds=x, use_cache=False).last_hidden_state
        return ModelOutput(logits=self.hf.get_output_embeddings()(state), hidden=state, top=state, passes_used=passes)

    @torch.no_grad()
    def recurrent_forward(self, input_ids: Tensor, plain_prefix: int = 0) -> ModelOutput:
        """The exact recurrence, one position at a time through the wrapped model's own KV cache."""
        self._check(input_ids)
        _, hidden = self._recur(input_ids, plain_prefix, keep=True)
        return ModelOutput(logits=self.hf.get_output_embeddings()(hidden), hidden=hidden, top=hidden)

    def _recur(self, input_ids: Tensor, plain_prefix: int, keep: bool = False):
        """(cache, last state (B, 1, D)), or every state (B, T, D) with keep=True."""
        plain = self._plain(input_ids, plain_prefix)
        e = self.hf.get_input_embeddings()(input_ids)
        past, state, states = None, None, []
        for t in range(input_ids.shape[1]):
            x = e[:, t : t + 1]
            if state is not None:
                x = self._fuse(x, state, plain[:, t : t + 1])
            out = self.hf.base_model(inputs_embeds=x, use_cache=True, **{self._cache_arg: past})
            past, state = self._past(out), out.last_hidden_state
            states.append(state)
        return past, (torch.cat(states, dim=1) if keep else state)

    @staticmethod
    def _past(out):
        return getattr(out, "past_key_values", None) or getattr(out, "cache", None)

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, *, mode: str = "soft",
                 prefill_passes: int = 1) -> Tensor:
        """Greedy decoding in a feedback mode through the wrapped model's KV cache: (B, T) prompts of one length
        -> (B, max_new_tokens) new tokens. STANDARD is the wrapped model's own greedy decoding; SOFT feeds each
        position's top state into the next; FUSED first runs 1 + prefill_passes Jacobi passes over the prompt;
        EXACT processes the prompt by the recurrence."""
        from fullband.decode.generate import MODES

        self._check(input_ids)
        if mode not in MODES:
            raise InputError(f"mode={mode!r} is not a decoding mode; accepted: {', '.join(MODES)}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens={max_new_tokens!r} is invalid; accepted: an integer >= 1")
        if isinstance(prefill_passes, bool) or not isinstance(prefill_passes, int) or prefill_passes < 0:
            raise InputError(f"prefill_passes={prefill_passes!r} is invalid; accepted: an integer >= 0")
        emb, head = self.hf.get_input_embeddings(), self.hf.get_output_embeddings()
        if mode == "exact":
            past, state = self._recur(input_ids, 0)
        else:
            x = emb(input_ids)
            if mode == "fused" and prefill_passes > 0:
                x = self._fuse(x, shift_right(self.forward(input_ids, passes=prefill_passes).hidden),
                               self._plain(input_ids))
            out = self.hf.base_model(inputs_embeds=x, use_cache=True)
            past, state = self._past(out), out.last_hidden_state[:, -1:]
        new = []
        for s in range(max_new_tokens):
            token = head(state).argmax(-1)  # (B, 1)
            new.append(token)
            if s == max_new_tokens - 1:
                break
            x = emb(token)
            if mode != "standard":
                plain = token == self.bos_token_id if self.bos_token_id is not None else torch.zeros_like(token, dtype=torch.bool)
                x = self._fuse(x, state, plain)
            out = self.hf.base_model(inputs_embeds=x, use_cache=True, **{self._cache_arg: past})
            past, state = self._past(out), out.last_hidden_state
        return torch.cat(new, dim=1)


def add_latent_feedback(model: nn.Module, fusion: str = "gated", bos_token_id: int | None = None) -> LatentFeedback:
    """Wrap a Hugging Face decoder-only LM with latent feedback (see LatentFeedback)."""
    return LatentFeedback(model, fusion=fusion, bos_token_id=bos_token_id)
