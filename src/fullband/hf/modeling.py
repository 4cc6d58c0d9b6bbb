"""Hugging Face transformers classes for full-bandwidth models: FullbandConfig and FullbandForCausalLM.

FullbandForCausalLM is a thin adapter: it holds a native FullbandLM (`.model`, the source of truth) and maps
the transformers calling convention onto it, in every feedback mode (usage: docs/transformers.md).
The fed-back state of each sequence lives in the cache (FeedbackCache) next to its keys and values, so beam
search reordering and num_return_sequences expansion move both together. Prompts of different lengths are
left-padded (transformers' convention, `attention_mask`); each row is run from its first real token, at its
own positions, exactly as `fullband.generate` runs a ragged batch.

Importing fullband.hf registers these classes with the Auto classes. Shipped as source with every transformers
folder, as modeling_fullband.py (fullband.hf.remote): it imports only other shipped modules."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from fullband.decode.generate import DecodeState, advance, prefill
from fullband.errors import CheckpointError, ConfigError, InputError
from fullband.hf.remote import write_shipped
from fullband.model.config import ModelConfig, require_one_slot
from fullband.model.decoder import FullbandLM
from fullband.model.layers import Rotary
from fullband.model.mode import DecodeMode, default_mode
from fullband.model.weights import init_parameter_
from fullband.model.objective import objective
from fullband.validate import integer

MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
# transformers 5 names the output's cache field `cache`, 4.x `past_key_values`
_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
# save_pretrained writes the shipped modules (fullband.hf.remote) and points the Auto classes at them
AUTO_MAP = {"AutoConfig": "modeling_fullband.FullbandConfig",
            "AutoModelForCausalLM": "modeling_fullband.FullbandForCausalLM"}


CONVERT = "`fullband convert SRC OUT --to hf` writes one from a native folder, a Llama folder or a GGUF file"


def check_pretrained(path: Any, who: str) -> None:
    """Raise CheckpointError, in one line, unless `path` names a transformers folder of ours (config.json of
    model_type "fullband") or could be a Hugging Face Hub repo id (not found here, and no local folder holds it);
    anything else than a str or path is left to transformers. transformers' own errors for a native folder, a
    missing path or a file do not say what to do."""
    if not isinstance(path, str | os.PathLike):
        return
    folder, accepted = Path(path), f"accepted: a transformers folder of ours ({CONVERT}) or a Hub repo id"
    if not folder.exists():
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(str(path))
        except HFValidationError:
            local = True
        else:
            local = str(folder.parent) != "." and folder.parent.exists()
        if local:
            raise CheckpointError(f"{who}: {str(path)!r} does not exist; {accepted}")
        return
    if not folder.is_dir():
        raise CheckpointError(f"{who}: {str(path)!r} is a file, not a folder; {accepted}")
    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{who}: {str(path)!r} has no readable config.json ({type(err).__name__}); "
                              f"{accepted}") from None
    data = data if isinstance(data, dict) else {}
    if data.get("format") == "fullband":  # fullband.folder.FORMAT: a native folder
        raise CheckpointError(f"{who}: {str(path)!r} is a native fullband folder, which transformers cannot read; "
                              f"convert it first with `fullband convert {path} OUT --to hf` and pass OUT")
    if data.get("model_type") != FullbandConfig.model_type:
        raise CheckpointError(f"{who}: {str(path)!r} holds model_type={data.get('model_type')!r}, not "
                              f"{FullbandConfig.model_type!r}; {accepted}")


class FullbandConfig(PretrainedConfig):
    """A ModelConfig as a transformers config, plus the default decoding mode of `generate`.

    Every ModelConfig field is an attribute of the same name (standard aliases such as `hidden_size` map to
    them); `feedback_mode` ("standard" | "soft" | "fused" | "exact"; default the model's, as `fullband.generate`:
    "soft", or "standard" when its feedback weights are untrained or absent) and
    `prefill_passes` (fused passes over the prompt, default 1, or "auto"; or spelled in the mode: "fused:2") are what
    `generate` and `forward` use unless given per call. They are stored as a name and passes ("fused", 2)."""

    model_type = "fullband"
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                     "num_key_value_heads": "n_kv_heads", "intermediate_size": "d_ff",
                     "max_position_embeddings": "max_seq_len", "initializer_range": "init_std"}

    def __init__(self, feedback_mode: str | None = None, prefill_passes: int | str | None = None, use_cache: bool = True,
                 **kwargs: Any) -> None:
        fields = {k: kwargs.pop(k) for k in list(kwargs) if k in MODEL_FIELDS}
        for alias, name in self.attribute_map.items():
            if alias in kwargs:
                fields.setdefault(name, kwargs.pop(alias))
        resolved = ModelConfig(**fields)  # validates every field, with errors naming it
        require_one_slot(resolved, "the transformers class (FullbandForCausalLM)")
        for name, value in resolved.to_dict().items():
            if name != "bos_token_id":
                setattr(self, name, value)
        feedback_mode = default_mode(resolved).name if feedback_mode is None else feedback_mode
        mode = DecodeMode.parse(feedback_mode, prefill_passes, error=ConfigError, field="feedback_mode")
        mode.check(resolved, ConfigError, weights=False)
        self.feedback_mode, self.prefill_passes = mode.name, "auto" if mode.adaptive else mode.prefill_passes
        self.use_cache = bool(use_cache)
        kwargs["bos_token_id"] = resolved.bos_token_id
        # the native model ties (or not) its own head; transformers must not tie anything
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> "FullbandConfig":
        """transformers' from_pretrained, for a transformers folder of ours (check_pretrained)."""
        check_pretrained(pretrained_model_name_or_path, f"{cls.__name__}.from_pretrained")
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def to_model_config(self) -> ModelConfig:
        return ModelConfig(**{name: getattr(self, name) for name in MODEL_FIELDS})

    def decode_mode(self, feedback_mode: str | None = None, prefill_passes: int | str | None = None) -> DecodeMode:
        """The mode of a call: its feedback_mode / prefill_passes over this config's (the config's passes go with a
        bare "fused", not with "fused:3")."""
        return DecodeMode.parse(self.feedback_mode if feedback_mode is None else feedback_mode, prefill_passes,
                                default_passes=self.prefill_passes, error=ConfigError, field="feedback_mode")

    @classmethod
    def from_model_config(cls, config: ModelConfig, **kwargs: Any) -> "FullbandConfig":
        return cls(**config.to_dict(), **kwargs)


class FeedbackCache(DecodeState):
    """The decode engine's state as a transformers cache: keys/values of every layer (a growing native KVCache),
    each row's next position, and each row's fed-back state h (B, D) from its last position; beam search and
    num_return_sequences reorder all of it together."""

    is_compileable = False
    is_croppable = False

    @property
    def kv(self):
        return self.cache

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.kv.k)

    is_sliding = is_linear

    def __len__(self) -> int:
        return len(self.kv.k)

    @property
    def batch_size(self) -> int:
        return self.kv.batch

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held by the longest row."""
        return self.longest

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Beam search: row i continues the sequence of row beam_idx[i], with its keys, values and state."""
        rows = beam_idx.to(self.state.device)
        self.kv.select(rows)
        self.positions = self.positions.index_select(0, rows)
        self.state = self.state.index_select(0, rows)

    batch_select_indices = reorder_cache

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(torch.arange(self.kv.batch, device=self.state.device).repeat_interleave(repeats))

    def crop(self, max_length: int) -> None:
        raise InputError("FeedbackCache cannot be cropped: the fed-back state of a dropped position is gone "
                         "(assisted / speculative decoding is not supported with latent feedback)")


class FullbandForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = FullbandConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]

    def __init__(self, config: FullbandConfig) -> None:
        super().__init__(config)
        self.model = FullbandLM(config.to_model_config())
        for name, module in self.model.named_modules():
            module._fullband_name = name
        self.post_init()

    # ---------------------------------------------------------------- transformers plumbing
    @torch.no_grad()
    def _init_weights(self, module: torch.nn.Module) -> None:
        """The native initialisation for parameters a checkpoint did not provide; RoPE tables recomputed."""
        if isinstance(module, Rotary):
            module.reset_tables()
            return
        prefix = getattr(module, "_fullband_name", None)
        if prefix is None:
            return
        for name, p in module.named_parameters(recurse=False):
            init_parameter_(f"{prefix}.{name}" if prefix else name, p, self.model.config)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is a FeedbackCache, built by the first forward

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> torch.nn.Module | None:
        return self.model.lm_head

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> "FullbandForCausalLM":
        """transformers' from_pretrained, for a transformers folder of ours (check_pretrained)."""
        check_pretrained(pretrained_model_name_or_path, f"{cls.__name__}.from_pretrained")
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any):
        """transformers' generate; the feedback modes need the cache (it carries each sequence's state), so
        use_cache=False is refused for them (without it every step would re-read the text as a prompt)."""
        config = kwargs.get("generation_config") or self.generation_config
        use_cache = kwargs.get("use_cache", getattr(config, "use_cache", True))
        mode = kwargs.get("feedback_mode", self.config.feedback_mode)
        if use_cache is False and self.config.decode_mode(mode).feeds_state:
            raise InputError(f"generate(use_cache=False) cannot decode in feedback_mode={mode!r}: the fed-back state "
                             "lives in the cache; use the cache, or feedback_mode='standard'")
        return super().generate(*args, **kwargs)

    def save_pretrained(self, save_directory, *args: Any, **kwargs: Any) -> None:
        """transformers' save_pretrained, plus the model's code (fullband.hf.remote) and `auto_map`, so the folder also
        loads where fullband is not installed: AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)."""
        self.config.auto_map = dict(AUTO_MAP)
        super().save_pretrained(save_directory, *args, **kwargs)
        write_shipped(save_directory)

    @classmethod
    def from_native(cls, model: FullbandLM, **config_kwargs: Any) -> "FullbandForCausalLM":
        """Wrap a native model's weights (copied, in its dtype) in the transformers class, in eval mode (as
        from_pretrained returns it: in training mode the fused passes add the training-time jitter)."""
        hf = cls(FullbandConfig.from_model_config(model.config, **config_kwargs))
        dtype = next(model.parameters()).dtype
        hf.model.load_state_dict(model.state_dict())
        return hf.to(dtype).eval()

    def to_native(self) -> FullbandLM:
        """A native FullbandLM with these weights (copied)."""
        native = FullbandLM(self.config.to_model_config()).to(self.dtype)  # in float32 first, float64 would round
        native.load_state_dict(self.model.state_dict())
        return native

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, cache: FeedbackCache | None = None,
                past_key_values: FeedbackCache | None = None, inputs_embeds: Tensor | None = None,
                labels: Tensor | None = None, use_cache: bool | None = None, return_dict: bool | None = None,
                logits_to_keep: int = 0, feedback_mode: str | None = None, prefill_passes: int | None = None,
                passes: int | None = None, **kwargs: Any) -> CausalLMOutputWithPast:
        """Logits of `input_ids` (B, T) as `feedback_mode` reads them.

        Without a cache: "standard" / "soft" run one pass, "fused" 1 + prefill_passes Jacobi passes, "exact" the
        exact recurrence; `passes=k` asks for k Jacobi passes directly. `labels` (B, T) (-100 = ignore; shifted
        inside, as transformers does) give the loss, for passes > 1 the multi-pass objective NTP(1) +
        pass_loss_weight * mean(NTP(2..k)). `attention_mask` marks each row's real tokens (one contiguous run;
        left or right padding); padded positions get zero logits. With use_cache, the returned FeedbackCache
        continues the rows; given one, every new token is one decode step (the state of the previous position
        is fed back unless the mode is "standard"). `position_ids` are ignored: positions count real tokens."""
        if inputs_embeds is not None:
            raise InputError("FullbandForCausalLM needs input_ids: latent feedback fuses each token's embedding "
                             "with the previous state, so inputs_embeds cannot be used")
        if input_ids is None:
            raise InputError("input_ids is required")
        cache = cache if cache is not None else past_key_values
        mode = self.config.decode_mode(feedback_mode, prefill_passes)
        model = self.model
        mode.check(model.config)
        if cache is not None:
            if not isinstance(cache, FeedbackCache):
                raise InputError(f"FullbandForCausalLM continues only its own FeedbackCache; got "
                                 f"{type(cache).__name__} (let generate build the cache)")
            if labels is not None:
                raise InputError("labels cannot be combined with a cache; score whole sequences without one")
            logits = self._decode(input_ids, cache, mode)
            return self._output(None, logits[:, -logits_to_keep:] if logits_to_keep else logits, cache)

        model.check_ids(input_ids)
        ids, starts, lengths = _left_align(input_ids, attention_mask)
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        B, T = ids.shape
        if passes is not None:
            mode = DecodeMode.from_passes(integer("passes", passes, 1, error=ConfigError))
        targets = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise InputError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}; "
                                 f"got {tuple(labels.shape)}")
            aligned = _gather_rows(labels.to(ids.device), starts, lengths, fill=-100)
            targets = F.pad(aligned[:, 1:], (0, 1), value=-100)
        longest = int(lengths.max())
        if use_cache and longest >= model.config.max_seq_len:
            raise InputError(f"prompt length {longest} leaves no room to generate within "
                             f"max_seq_len={model.config.max_seq_len}")
        room = min(max(2 * T, T + 64), model.config.max_seq_len) - longest
        new_cache, loss = None, None
        if targets is not None:
            if mode.exact:
                raise InputError("labels with feedback_mode='exact' are not supported; train with passes=k")
            kv = model.new_cache(B, longest + room) if use_cache else None
            out = objective(model, ids, targets, mode.passes, cache=kv)
            loss = out.loss
            if kv is not None:
                rows = torch.arange(B, device=ids.device)
                new_cache = FeedbackCache(kv, lengths.clone(), out.state[rows, lengths - 1], longest,
                                          ragged=bool((lengths != longest).any()))
        elif use_cache:
            state, out = prefill(model, ids, lengths, mode, room=room, longest=longest)
            new_cache = FeedbackCache(**vars(state))
        else:
            out = model.read(ids, mode)
        top = _scatter_rows(out.top, starts, lengths, input_ids.shape[1])
        return self._output(loss, self.model.head(top[:, -logits_to_keep:] if logits_to_keep else top), new_cache)

    def _decode(self, input_ids: Tensor, cache: FeedbackCache, mode: DecodeMode) -> Tensor:
        """One decode step per new column of input_ids (B, n) -> logits (B, n, V); advances the cache."""
        # token ids are not range-checked here (two device reads per token): they come from generate's own logits
        if input_ids.ndim != 2 or input_ids.shape[0] != cache.kv.batch:
            raise InputError(f"input_ids for a cached step must be (B={cache.kv.batch}, n); got "
                             f"{tuple(input_ids.shape)}")
        return torch.stack([advance(self.model, cache, input_ids[:, t], feed=mode.feeds_state)
                            for t in range(input_ids.shape[1])], 1)

    @staticmethod
    def _output(loss: Tensor | None, logits: Tensor, cache: FeedbackCache | None) -> CausalLMOutputWithPast:
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})


def _left_align(input_ids: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Move each row's real tokens (one contiguous run of attention_mask == 1) to start at position 0:
    -> ids (B, T) right-padded, starts (B,), lengths (B,)."""
    B, T = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        zeros = torch.zeros(B, dtype=torch.long, device=device)
        return input_ids, zeros, torch.full((B,), T, dtype=torch.long, device=device)
    mask = attention_mask.to(device=device).bool()
    if mask.shape != (B, T):
        raise InputError(f"attention_mask must have the shape of input_ids {(B, T)}; got {tuple(mask.shape)}")
    lengths = mask.sum(1)
    if bool((lengths == 0).any()):
        raise InputError(f"attention_mask row {int((lengths == 0).nonzero()[0])} has no real token")
    starts = mask.long().argmax(1)
    span = torch.arange(T, device=device)[None, :]
    if not torch.equal(mask, (span >= starts[:, None]) & (span < (starts + lengths)[:, None])):
        raise InputError("attention_mask must mark one contiguous run of real tokens per row (left or right "
                         "padding); got a row with a gap")
    if bool((starts == 0).all()):
        return input_ids, starts, lengths
    return _gather_rows(input_ids, starts, lengths, fill=0), starts, lengths


def _gather_rows(x: Tensor, starts: Tensor, lengths: Tensor, fill: int) -> Tensor:
    """(B, T) -> (B, T): row b's entries [starts[b], starts[b] + lengths[b]) moved to the front, `fill` after."""
    T = x.shape[1]
    span = torch.arange(T, device=x.device)[None, :]
    index = (starts[:, None] + span).clamp(max=T - 1)
    return torch.where(span < lengths[:, None], x.gather(1, index), torch.full_like(x, fill))


def _scatter_rows(top: Tensor, starts: Tensor, lengths: Tensor, T: int) -> Tensor:
    """Inverse of _left_align for outputs (B, T, D): row b's first lengths[b] back at starts[b]; zeros elsewhere."""
    if bool((starts == 0).all()):
        span = torch.arange(T, device=top.device)[None, :, None]
        return top.masked_fill(span >= lengths[:, None, None], 0.0)
    span = torch.arange(T, device=top.device)[None, :]
    src = (span - starts[:, None]).clamp(min=0)
    keep = (span >= starts[:, None]) & (span < (starts + lengths)[:, None])
    moved = top.gather(1, src[..., None].expand(-1, -1, top.shape[-1]))
    return moved.masked_fill(~keep[..., None], 0.0)
