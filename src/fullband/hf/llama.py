"""Load a Hugging Face `LlamaForCausalLM` into the native model.

The native model with `qk_norm=False`, `input_norm=False` and the Llama's own sizes is the same network as the
Llama in STANDARD mode (passes=1): q/k/v and gate/up are stored fused (`wqkv`, `w_in`), RoPE uses the same
rotate-half pairing, RMSNorm is the same function. The fusion weights are new; they are initialised as for a
fresh model, and `norm_in`'s gain is set to the embedding rows' RMS so a fused input starts at the scale of a
plain one (DECISION: the warm-start then perturbs the Llama's input distribution as little as possible)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fullband.errors import ConfigError, FullbandError, MissingPackage
from fullband.model.config import ModelConfig
from fullband.model.decoder import FullbandLM
from fullband.model.fusion import embedding_rms
from fullband.model.weights import lookup, named, split

# LlamaConfig field -> the value the native block computes
_REQUIRED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "rope_scaling": None}


def _transformers():
    try:
        import transformers
    except ImportError:
        raise MissingPackage("Hugging Face support needs transformers: pip install 'fullband[hf]'") from None
    return transformers


def dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """from_pretrained's dtype keyword: `dtype` from transformers 4.56, `torch_dtype` before."""
    from packaging.version import Version

    name = "dtype" if Version(_transformers().__version__) >= Version("4.56") else "torch_dtype"
    return {name: dtype}


def config_from_llama(hf_config: Any, *, fusion: str = "gated", max_seq_len: int | None = None,
                      **overrides: Any) -> ModelConfig:
    """The ModelConfig that computes what a LlamaConfig describes (plus a feedback fusion of kind `fusion`)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type != "llama":
        raise ConfigError(f"from_llama reads Llama configs; got model_type={model_type!r} "
                          f"({type(hf_config).__name__}); accepted: 'llama'")
    for field, want in _REQUIRED.items():
        got = getattr(hf_config, field, want)
        if field == "rope_scaling" and isinstance(got, dict) and got.get("rope_type", "default") == "default":
            got = None
        if got != want:
            raise ConfigError(f"LlamaConfig.{field}={got!r} is not supported; accepted: {want!r}")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if head_dim * hf_config.num_attention_heads != hf_config.hidden_size:
        raise ConfigError(f"LlamaConfig.head_dim={head_dim} with {hf_config.num_attention_heads} heads does not "
                          f"make hidden_size={hf_config.hidden_size}; accepted: head_dim = hidden_size / heads")
    rope_theta = getattr(hf_config, "rope_theta", None)
    if rope_theta is None:  # newer transformers keep it in rope_parameters
        rope_theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    values = dict(vocab_size=hf_config.vocab_size, d_model=hf_config.hidden_size, n_layers=hf_config.num_hidden_layers,
                  n_heads=hf_config.num_attention_heads, d_ff=hf_config.intermediate_size,
                  n_kv_heads=hf_config.num_key_value_heads or hf_config.num_attention_heads,
                  max_seq_len=min(max_seq_len or hf_config.max_position_embeddings, hf_config.max_position_embeddings),
                  rope_theta=float(rope_theta), norm_eps=float(hf_config.rms_norm_eps), qk_norm=False,
                  input_norm=False, tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
                  bos_token_id=getattr(hf_config, "bos_token_id", None), fusion=fusion,
                  feedback_trained=False)  # the fusion is initialised here: decoders default to STANDARD
    values.update(overrides)
    return ModelConfig(**values)


def check_llama_files(folder: Path, cfg: ModelConfig) -> None:
    """The Llama tensors the weight table reads for `cfg`, against the shapes in the folder's safetensors headers
    (no tensor is read): ConfigError naming the first that is missing or has another shape."""
    from safetensors import SafetensorError, safe_open

    shapes = {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(file, "pt") as f:
                shapes.update((k, tuple(f.get_slice(k).get_shape())) for k in f.keys())
        except SafetensorError as err:
            raise ConfigError(f"{file}: not a readable safetensors file ({err})") from None
    if not shapes:
        return  # weights in another format: transformers checks them as it loads
    with torch.device("meta"):
        native = FullbandLM(cfg)
    for name, param in native.state_dict().items():
        w, layer = lookup(name)
        for source, part in zip((named(w, layer, n) for n in w.llama), split(w, param, cfg)):
            got = shapes.get(source)
            if got != tuple(part.shape):
                raise ConfigError(f"{folder}: config.json implies {source} of shape {tuple(part.shape)}; the weights "
                                  f"{'hold ' + str(got) if got else 'have no such tensor'}: config.json does not "
                                  "describe these weights")


def load_checked(cls, name: str, what: str, **kwargs: Any):
    """`cls.from_pretrained(name, **kwargs)` (a transformers model class), refused in one line when transformers
    reports weights it did not find in the files (it would initialise them fresh), weights of another shape, or
    files it could not read, and when a weight it read is not finite. `what` names the source in the message."""
    model, info = cls.from_pretrained(name, output_loading_info=True, **kwargs)
    for key, said in (("missing_keys", "has no weight for"), ("mismatched_keys", "has weights of another shape for"),
                      ("error_msgs", "could not be read:")):
        found = [k if isinstance(k, str) else k[0] for k in info.get(key) or []]
        if found:
            more = f" and {len(found) - 3} more" if len(found) > 3 else ""
            raise ConfigError(f"{what} {said} {', '.join(map(str, found[:3]))}{more} (transformers' loading report: "
                              "it would start them fresh); accepted: a model whose files hold every weight its config "
                              "describes")
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                bad = int((~torch.isfinite(tensor)).sum())
                raise ConfigError(f"{what}: weight {key} holds {bad:,} non-finite value{'s' * (bad > 1)} (NaN or "
                                  "infinity); accepted: finite weights")
    return model


FRESH_SEED = 0  # the seed of the weights no Llama has (the fusion, a latent head): a conversion is reproducible


@torch.no_grad()
def from_llama(model: Any, *, fusion: str = "gated", max_seq_len: int | None = None, **overrides: Any) -> FullbandLM:
    """A FullbandLM holding the weights of `model`: a LlamaForCausalLM instance or a local folder / hub id for
    `LlamaForCausalLM.from_pretrained`. In STANDARD mode it reproduces the Llama's logits."""
    tf = _transformers()
    if isinstance(model, str):
        if Path(model).is_dir():  # a config that does not describe its weights: refused before its size is allocated
            cfg = config_from_llama(tf.AutoConfig.from_pretrained(model), fusion=fusion, max_seq_len=max_seq_len,
                                    **overrides)
            check_llama_files(Path(model), cfg)
        model = load_checked(tf.LlamaForCausalLM, model, repr(model), **dtype_kwarg(torch.float32))
    if not isinstance(model, tf.PreTrainedModel) or not hasattr(model, "config"):
        raise FullbandError(f"from_llama expects a LlamaForCausalLM or a path to one; got {type(model).__name__}")
    cfg = config_from_llama(model.config, fusion=fusion, max_seq_len=max_seq_len, **overrides)
    sd = model.state_dict()
    with torch.random.fork_rng(devices=[]):  # the fresh weights are the same at every conversion; the caller's
        torch.manual_seed(FRESH_SEED)        # random stream is left as it was
        native = FullbandLM(cfg)
    dtype = sd["model.embed_tokens.weight"].dtype
    out: dict[str, torch.Tensor] = {}
    for name in native.state_dict():  # each native weight from the Llama tensors the weight table names
        w, layer = lookup(name)
        sources = [named(w, layer, n) for n in w.llama]
        if sources and all(n in sd for n in sources):
            out[name] = torch.cat([sd[n] for n in sources])
    out["norm_in.weight"] = torch.full((cfg.d_model,), embedding_rms(out["embed.weight"]))
    own = native.state_dict()
    fresh = ("fusion.", "latent_head.")  # no Llama has them
    missing = [k for k in own if k not in out and not k.startswith(fresh)]
    if missing:
        raise FullbandError(f"from_llama: no Llama weight for {missing[:4]}; this converter does not cover the model")
    for name, tensor in out.items():
        if own[name].shape != tensor.shape:
            raise FullbandError(f"from_llama: {name} has shape {tuple(tensor.shape)} in the Llama, "
                                f"{tuple(own[name].shape)} in the native model")
        own[name].copy_(tensor.float())
    return native.to(dtype)
