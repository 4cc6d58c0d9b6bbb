"""Latent feedback around any Hugging Face decoder-only LM: only the input construction changes.

`add_latent_feedback(model)` wraps e.g. a LlamaForCausalLM, Qwen2ForCausalLM or GPT2LMHeadModel. Pass 1 is the
unchanged model; each later pass builds `inputs_embeds` by fusing every position's token embedding with the
previous position's top hidden state (the base model's `last_hidden_state`, after its final norm) through the
fusion operator, and the exact recurrence runs token by token through the model's own KV cache. The wrapped
model's weights are not touched; the new ones are the fusion and `norm_in`, whose gain starts at the
embedding RMS so fused inputs begin at the scale of plain ones.

The wrapper is a FeedbackModel (fullband.model.core) whose stack is the HF model, so the Jacobi passes, the
recurrence, every decoding mode and the training objective are the native model's own (docs/transformers.md); its
`config` is a ModelConfig (the multi-pass knobs, plus the HF model's sizes), `blocks` are the HF model's layers
(activation checkpointing, FSDP); a saved folder (the HF config inside config.json) loads back with
`fullband.load_model`."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fullband.folder import CONFIG_FILE, HF_CONFIG_KEY, check_shapes, read_header, read_tensors, save_model
from fullband.errors import CheckpointError, ConfigError
from fullband.gguf_file import parsed_once
from fullband.hf.gguf import pretrained_args, unquantized
from fullband.hf.llama import _transformers, dtype_kwarg, load_checked
from fullband.model.config import ModelConfig, require_default_layers
from fullband.decode.generate import generate as generate_ids
from fullband.model.core import FeedbackModel
from fullband.model.fusion import FUSION_TYPES, build_fusion, embedding_rms
from fullband.model.layers import RMSNorm, build_latent_head
from fullband.model.weights import init_parameter_

def config_for(hf_config: Any, base: ModelConfig | None = None, **changes: Any) -> ModelConfig:
    """A ModelConfig describing a HF model: its vocabulary, width, depth, heads and context from `hf_config`,
    the feedback and multi-pass fields from `base` (defaults when None) and `changes`."""
    get = lambda *names, default=None: next((getattr(hf_config, n) for n in names  # noqa: E731
                                            if getattr(hf_config, n, None) is not None), default)
    d_model = get("hidden_size", "n_embd", "d_model")
    sizes = dict(vocab_size=get("vocab_size"), d_model=d_model,
                 n_layers=get("num_hidden_layers", "n_layer", "num_layers"),
                 max_seq_len=get("max_position_embeddings", "n_positions", "max_seq_len", default=2048),
                 d_ff=get("intermediate_size", "n_inner"),
                 tie_embeddings=bool(get("tie_word_embeddings", default=False)), input_norm=False)
    heads = get("num_attention_heads", "n_head")
    kv = get("num_key_value_heads", default=heads)
    head_ok = heads and d_model % heads == 0 and (d_model // heads) % 2 == 0 and heads % (kv or heads) == 0
    sizes.update(n_heads=heads if head_ok else 1, n_kv_heads=(kv or heads) if head_ok else 1)
    if "bos_token_id" not in changes and (base is None or base.bos_token_id is None):
        sizes["bos_token_id"] = get("bos_token_id", "eos_token_id")
    values = {**(base.to_dict() if base is not None else {}), **sizes, **changes}
    return ModelConfig.from_dict(values)


class HFCache:
    """The wrapped model's own KV cache (a transformers Cache, appended to one slot per call of the stack) for the
    decode engine. A prefill fills the first slots; right-padded prompts leave their padding there, which `visible`
    masks out."""

    def __init__(self, batch: int, max_len: int) -> None:
        self.past = None
        self.batch, self.max_len = batch, max_len
        self.filled = 0  # slots written
        self.prompt: int | None = None  # slots the prefill wrote (known at the first decode step)

    def visible(self, positions: Tensor, kv_len: int) -> Tensor:
        """attention_mask (B, prompt + steps + 1) for the next step, steps = decode steps taken so far: a row's
        prompt slots count up to its prompt length (its next position minus the steps), the rest all count."""
        if self.prompt is None:
            self.prompt = self.filled
        steps = kv_len - 1 - self.prompt
        prompt_len = positions - steps
        slots = torch.arange(self.prompt, device=positions.device)
        head = slots[None, :] < prompt_len[:, None]
        return torch.cat([head, head.new_ones(positions.shape[0], steps + 1)], dim=1).long()

    def grow(self, max_len: int) -> None:
        self.max_len = max(self.max_len, max_len)  # the transformers cache grows by itself


class LatentFeedback(FeedbackModel):
    """A HF causal LM with latent feedback: it supplies the wrapped model's stack (its base model on inputs_embeds,
    through its own KV cache) to the method's core, which runs the Jacobi passes (`forward`), the exact recurrence
    (`recurrent_forward`) and every decoding mode (`generate`, fullband.generate)."""

    def __init__(self, model: nn.Module, fusion: str | None = None, bos_token_id: int | None = None, *,
                 config: ModelConfig | None = None) -> None:
        super().__init__()
        name = type(model).__name__
        hf_cfg = getattr(model, "config", None)
        if hf_cfg is None or not hasattr(model, "get_input_embeddings") or not hasattr(model, "base_model"):
            raise ConfigError(f"add_latent_feedback needs a Hugging Face PreTrainedModel; got {name}")
        if getattr(hf_cfg, "is_encoder_decoder", False):
            raise ConfigError(f"add_latent_feedback wraps decoder-only causal LMs; {name} is an encoder-decoder")
        head = model.get_output_embeddings()
        emb = model.get_input_embeddings()
        if head is None or emb is None or model.base_model is model:
            raise ConfigError(f"{name} has no separate base model, input embedding and LM head; add_latent_feedback "
                              "needs a *ForCausalLM / *LMHeadModel whose base model accepts inputs_embeds")
        if "inputs_embeds" not in inspect.signature(model.base_model.forward).parameters:
            raise ConfigError(f"{type(model.base_model).__name__}.forward takes no inputs_embeds; add_latent_feedback "
                              "feeds the fused inputs as inputs_embeds")
        changes = {k: v for k, v in (("fusion", fusion), ("bos_token_id", bos_token_id)) if v is not None}
        self.config = config_for(hf_cfg, config, **changes)
        require_default_layers(self.config, "add_latent_feedback (a wrapped Hugging Face model)")
        if not self.config.has_feedback:
            raise ConfigError("add_latent_feedback needs a fusion; accepted: " + ", ".join(FUSION_TYPES))
        self.hf = model
        d_model = emb.weight.shape[1]
        self.fusion = build_fusion(self.config.fusion, d_model)
        self.norm_in = RMSNorm(d_model, getattr(hf_cfg, "rms_norm_eps", None) or getattr(hf_cfg, "layer_norm_epsilon", 1e-6))
        self.latent_head = build_latent_head(self.config.latent_head, d_model)
        for name, p in self.named_parameters():
            if not name.startswith("hf."):  # the new weights: the fusion's, a latent head's
                init_parameter_(name, p, self.config)
        with torch.no_grad():
            self.norm_in.weight.fill_(embedding_rms(emb.weight))
        # the base model's KV-cache keyword: `cache` in newer transformers, else past_key_values
        self._cache_arg = "cache" if "cache" in inspect.signature(model.base_model.forward).parameters else "past_key_values"
        for module in (self.fusion, self.norm_in, self.latent_head):
            if module is not None:
                module.to(emb.weight.dtype)

    @property
    def blocks(self) -> nn.ModuleList:
        """The wrapped model's decoder layers (for activation checkpointing, compile and FSDP)."""
        n = self.config.n_layers
        for module in self.hf.base_model.modules():
            if isinstance(module, nn.ModuleList) and len(module) == n:
                return module
        raise ConfigError(f"{type(self.hf).__name__}: no list of {n} layers found in its base model")

    # ---------------------------------------------------------------- the stack (FeedbackModel's interface)
    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        return self.hf.get_input_embeddings()(input_ids)

    def stack(self, x: Tensor, cache: HFCache | None = None) -> tuple[Tensor, Tensor]:
        """The base model on inputs_embeds x; its fed-back state is its top state (after its final norm)."""
        if cache is None:
            state = self.hf.base_model(inputs_embeds=x, use_cache=False).last_hidden_state
        else:
            cache.past, state = self._run(x, None)
            cache.filled, cache.prompt = x.shape[1], None
        return state, state

    def stack_step(self, x: Tensor, positions: Tensor, cache: HFCache, kv_len: int,
                   mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x (B, 1, D) appended to the base model's cache; `mask` (from cache.visible, rows at different positions)
        also sets each row's position."""
        extra = {} if mask is None else {"attention_mask": mask, "position_ids": positions[:, None]}
        cache.past, state = self._run(x, cache.past, **extra)
        cache.filled += 1
        return state, state

    def head(self, top: Tensor) -> Tensor:
        return self.hf.get_output_embeddings()(top)

    def new_cache(self, batch: int, max_len: int) -> HFCache:
        return HFCache(batch, max_len)

    def _run(self, x: Tensor, past, **extra):
        out = self.hf.base_model(inputs_embeds=x, use_cache=True, **{self._cache_arg: past}, **extra)
        # transformers 5 returns `cache` (reading the old name warns), 4.x `past_key_values`
        past = out["cache"] if "cache" in out else out["past_key_values"]
        return past, out.last_hidden_state

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, **options):
        """fullband.generate on this model: any mode, sampling, stop tokens, adaptive prefill, compile (options as
        for fullband.stream). STANDARD is the wrapped model's own decoding. `input_ids` (B, T) -> (B, max_new_tokens)
        new tokens (a row that hit a stop token repeats it), or a list of token-id lists of any lengths -> a list of
        each row's new tokens (up to its stop token)."""
        rows = generate_ids(self, input_ids, max_new_tokens, **options)
        if not isinstance(input_ids, Tensor):
            return rows
        padded = [row + row[-1:] * (max_new_tokens - len(row)) for row in rows]
        return torch.tensor(padded, dtype=torch.long, device=input_ids.device)

    # ---------------------------------------------------------------- checkpoints
    def checkpoint_metadata(self) -> dict:
        """Written into config.json beside the ModelConfig, so the folder rebuilds the wrapped model."""
        return {HF_CONFIG_KEY: self.hf.config.to_dict()}

    def save(self, directory: str | Path, **extra) -> Path:
        return save_model(self, directory, **extra)


def add_latent_feedback(model: nn.Module, fusion: str = "gated", bos_token_id: int | None = None,
                        config: ModelConfig | None = None) -> LatentFeedback:
    """Wrap a Hugging Face decoder-only LM with latent feedback (see LatentFeedback). `config` sets the
    multi-pass training knobs (jitter, prefix_mixin_prob, ...); its architecture fields are taken from `model`."""
    return LatentFeedback(model, fusion=fusion, bos_token_id=bos_token_id, config=config)


@parsed_once()
def from_pretrained(path: str, config: ModelConfig | None = None, *, dtype: torch.dtype = torch.float32,
                    **kwargs: Any) -> LatentFeedback:
    """Load the causal LM at `path` (a local folder, a GGUF file, or a hub id when online) and wrap it with latent
    feedback."""
    tf = _transformers()
    try:
        name, extra = pretrained_args(path, config="config" not in kwargs)
        model = load_checked(tf.AutoModelForCausalLM, name, f"model.hf_path={path!r}", **dtype_kwarg(dtype), **extra,
                             **kwargs)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.hf_path={path!r} could not be loaded as a causal LM: {err}") from None
    return LatentFeedback(unquantized(model), config=config)


SIZE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len")


def load_feedback(directory: str | Path, config: ModelConfig, hf_config: dict, *, header: dict | None = None,
                  device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> LatentFeedback:
    """Rebuild a saved LatentFeedback from its folder's ModelConfig and HF config (config.json, read by
    fullband.checkpoint.load_model) and its model.safetensors. The HF config must describe the same sizes as
    the ModelConfig, and the model it builds (on the meta device first) the tensors of the weights file's
    header: nothing full-size is allocated for a folder whose files disagree."""
    tf = _transformers()
    directory = Path(directory)
    if not isinstance(hf_config, dict):
        raise CheckpointError(f"{directory / CONFIG_FILE}: {HF_CONFIG_KEY!r} is not a table of transformers settings")
    hf_dict = dict(hf_config)
    model_type = hf_dict.pop("model_type", None)
    try:
        hf_model_config = tf.AutoConfig.for_model(model_type, **hf_dict)
        described = config_for(hf_model_config, config)
    except (KeyError, ValueError, TypeError, ConfigError) as err:
        raise CheckpointError(f"{directory / CONFIG_FILE}: cannot rebuild the wrapped model "
                              f"(model_type={model_type!r}): {err}") from None
    differ = [f"{f}: {getattr(described, f)} in {HF_CONFIG_KEY}, {getattr(config, f)} in model"
              for f in SIZE_FIELDS if getattr(described, f) != getattr(config, f)]
    if differ:
        raise CheckpointError(f"{directory / CONFIG_FILE}: its {HF_CONFIG_KEY!r} and 'model' sections describe "
                              f"different models ({'; '.join(differ)})")
    header = header if header is not None else read_header(directory)
    with torch.device("meta"):
        shell = tf.AutoModelForCausalLM.from_config(hf_model_config)
        fusion = build_fusion(config.fusion, config.d_model)
        latent = build_latent_head(config.latent_head, config.d_model)
    expected = {f"hf.{k}": tuple(v.shape) for k, v in shell.state_dict().items()}
    for prefix, module in (("fusion", fusion), ("latent_head", latent)):
        if module is not None:
            expected.update({f"{prefix}.{k}": tuple(v.shape) for k, v in module.state_dict().items()})
    expected["norm_in.weight"] = (config.d_model,)
    del shell, fusion, latent
    check_shapes(directory, config, expected, header)
    state = read_tensors(directory)
    hf_model = tf.AutoModelForCausalLM.from_config(hf_model_config)
    wrapper = LatentFeedback(hf_model, config=config)
    try:
        wrapper.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"{directory}: weights do not match the wrapped {type(hf_model).__name__}: {err}") from None
    wrapper = wrapper.to(device)
    return wrapper.to(dtype) if dtype is not None else wrapper
