"""The build step of a run, in one place: resolve the model config (a pretrained model's sizes, the tokenizer's
vocabulary and BOS) -> build the model (native, or a Hugging Face model wrapped with latent feedback; a warm
start) -> its optimizer routing table and optimizer -> the parallel wrapping (DDP / FSDP2, activation
checkpointing, compile)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from fullband.errors import ConfigError
from fullband.model.config import ModelConfig
from fullband.model.decoder import FullbandLM
from fullband.train.config import RunConfig
from fullband.train.data import fit_model_config, run_tokenizer
from fullband.train.optim import HF_ROUTE_TABLES, build_optimizer
from fullband.train.parallel import Dist, parallelize, unwrap


@dataclass
class Built:
    model: torch.nn.Module  # on the run's device, wrapped for parallelism
    optimizer: Any
    warm_started: dict | None  # what a warm start copied (init_from), or the HF model it wrapped (hf_path)


def resolve(cfg: RunConfig, d: Dist, *, run_dir: Path | None = None) -> tuple[RunConfig, tuple]:
    """The run config with its model config resolved — a pretrained model's sizes (model.hf_path, checked first),
    then the tokenizer's BOS (the vocabulary checked) — and the run's (corpus, tokenizer) (the run's own when
    resuming from run_dir). The resolved config is what run.json and every checkpoint record."""
    if cfg.model.hf_path:
        model = hf_model_config(cfg)
    elif pretrained_source(cfg.train.init_from):
        model = llama_model_config(cfg)
    else:
        model = cfg.model
    source = run_tokenizer(cfg, d, run_dir=run_dir)
    model = model.replace(feedback_trained=feedback_trained(cfg, model))
    return replace(cfg, model=fit_model_config(model, source[1])), source


def feedback_trained(cfg: RunConfig, model: ModelConfig) -> bool:
    """Whether the run's checkpoints hold trained feedback weights (ModelConfig.feedback_trained: decoders default
    to SOFT on them): a schedule with several passes trains them; a one-pass run keeps what it started from (a
    pretrained model's fusion is fresh; a folder of ours says)."""
    if cfg.train.schedule.max_passes > 1:
        return True
    if pretrained_source(cfg.train.init_from):
        return False
    if cfg.train.init_from:
        from fullband.folder import read_config

        return read_config(cfg.train.init_from).feedback_trained
    return model.feedback_trained


# the recipe's [model] fields a warm start from a pretrained Llama keeps (how feedback is added and trained); every
# size comes from the pretrained model
FEEDBACK_FIELDS = ("fusion", "fusion_init", "fusion_gate_scale", "feedback", "feedback_source", "feedback_target",
                   "jitter", "prefix_mixin_prob", "detach_between_passes", "pass_loss_weight")


def llama_model_config(cfg: RunConfig) -> ModelConfig:
    """The model of a warm start from a pretrained Llama (train.init_from: a GGUF file or a transformers folder): its
    sizes, with the recipe's feedback fields."""
    from fullband.gguf_file import is_gguf
    from fullband.hf.gguf import pretrained_config, require_native
    from fullband.hf.llama import config_from_llama

    path = cfg.train.init_from
    if is_gguf(path):
        require_native(path, use="train.init_from")
    try:
        hf_config = pretrained_config(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"train.init_from={path!r} could not be read as a Llama model: {err}") from None
    model = config_from_llama(hf_config, **{f: getattr(cfg.model, f) for f in FEEDBACK_FIELDS})
    if cfg.train.seq_len > model.max_seq_len:
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} exceeds the context of {path} ({model.max_seq_len} "
                          "positions); lower train.seq_len")
    return model


def build(cfg: RunConfig, d: Dist, *, warm: bool = True) -> Built:
    """Model, optimizer and parallel wrapping of a resolved config; `warm` applies train.init_from (not when
    resuming: the checkpoint's weights replace everything)."""
    torch.manual_seed(cfg.train.seed)
    model, warm_started = build_model(cfg, warm=warm)
    trained, total = freeze(model, cfg.train.trainable, passes=cfg.train.schedule.max_passes)
    if d.main and trained < total:
        print(f"training {trained:,} of {total:,} weights (train.trainable = {cfg.train.trainable}); the rest are "
              "frozen", flush=True)
    model = parallelize(model.to(d.device), d=d, mode=cfg.train.parallel,
                        activation_checkpointing=cfg.train.activation_checkpointing, compile=cfg.train.compile)
    routes = HF_ROUTE_TABLES[cfg.optim.name] if cfg.model.hf_path else None  # HF weights on AdamW
    return Built(model, build_optimizer(unwrap(model), cfg.optim, routes=routes), warm_started)


def freeze(model: torch.nn.Module, patterns: list[str], *, passes: int = 2) -> tuple[int, int]:
    """Train only the weights whose names match one of `patterns` (train.trainable, fnmatch); the rest get no
    gradient (and so no optimizer state). A pattern that matches no weight is a ConfigError naming the model's
    weights; so is a selection that only fed passes read when no step runs more than one pass (`passes`: the
    schedule's most): nothing would train. -> (weights trained, weights in all)."""
    trained = total = 0
    kept = []
    for name, p in _matched(model, patterns):
        keep = name is not None
        p.requires_grad_(keep)
        trained += p.numel() if keep else 0
        total += p.numel()
        kept += [name] if keep else []
    config = getattr(model, "config", None)
    fed_only = ("fusion.", "latent_head.") + (("norm_in.",) if not getattr(config, "input_norm", True) else ())
    if passes < 2 and kept and all(name.startswith(fed_only) for name in kept):
        raise ConfigError(f"train.trainable = {patterns} trains only weights a fed pass reads ({', '.join(kept[:3])}"
                          f"{' ...' if len(kept) > 3 else ''}), but train.passes never runs more than one pass: nothing "
                          "would train; accepted: a schedule with several passes (e.g. \"two-pass\"), or trainable "
                          "weights of the stack")
    return trained, total


def trained_weights(cfg: RunConfig) -> int | None:
    """How many weights train.trainable trains in the run's (resolved) native model, counted on the meta device
    (nothing allocated); None when it trains everything or wraps a Hugging Face model."""
    if cfg.train.trainable == ["*"] or cfg.model.hf_path:
        return None
    with torch.device("meta"):
        model = FullbandLM(cfg.model)
    return sum(p.numel() for name, p in _matched(model, cfg.train.trainable) if name is not None)


def _matched(model: torch.nn.Module, patterns: list[str]):
    """(name or None when no pattern matches it, parameter) for every parameter; a pattern matching none is a
    ConfigError naming the model's weights."""
    import fnmatch

    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            tops = sorted({name.split(".")[0] + (".*" if "." in name else "") for name in names})
            raise ConfigError(f"train.trainable pattern {pattern!r} matches no weight of this model; its weights: "
                              f"{', '.join(tops)} (e.g. blocks.0.*, fusion.*)")
    return [(name if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns) else None, p)
            for name, p in model.named_parameters()]


def build_model(cfg: RunConfig, *, warm: bool = True, say: bool = True) -> tuple[torch.nn.Module, dict | None]:
    if cfg.model.hf_path:
        from fullband.hf.feedback import from_pretrained

        model = from_pretrained(cfg.model.hf_path, cfg.model)
        # DECISION: no dropout, as in the paper's recipe; it would also make the loss depend on each rank's
        # RNG, so a run would no longer replay the same way at any world size or after a resume
        dropped = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        for m in dropped:
            m.p = 0.0
        return model, {"hf_path": cfg.model.hf_path, "dropout_disabled": len(dropped)}
    model = FullbandLM(cfg.model)
    return model, (warm_start(model, cfg.train.init_from, say=say) if cfg.train.init_from and warm else None)


def anchor_model(cfg: RunConfig, device: torch.device) -> torch.nn.Module:
    """The frozen model train.anchor draws every pass towards: train.anchor_from, else the run's starting point
    (train.init_from or model.hf_path, warm-started as the run was, before any step), without gradients, in eval mode;
    read STANDARD, its fusion is never used. Built in a forked random stream: the run's own draws are untouched, and a
    resumed run builds the same one."""
    source = cfg.train.anchor_from
    with torch.random.fork_rng(devices=[]):
        model = FullbandLM(cfg.model) if source else build_model(cfg, warm=True, say=False)[0]
    if source:
        fresh = warm_start(model, source, say=False, key="train.anchor_from")["fresh"]
        missing = [k for k in fresh if not k.startswith(UNREAD_BY_STANDARD)]
        if missing:
            raise ConfigError(f"train.anchor_from={source!r} lacks weights a STANDARD read of this model needs (name "
                              f"and shape): {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}; accepted: a "
                              "model of the run's sizes")
    return model.requires_grad_(False).eval().to(device)


UNREAD_BY_STANDARD = ("fusion.", "latent_head.")  # weights a STANDARD (one-pass) read never touches


def hf_model_config(cfg: RunConfig) -> ModelConfig:
    """cfg.model with the sizes of the pretrained model at model.hf_path (its feedback and multi-pass fields kept)."""
    from fullband.hf.feedback import config_for
    from fullband.hf.gguf import pretrained_config

    model = cfg.model
    if cfg.train.init_from:
        raise ConfigError(f"model.hf_path={model.hf_path!r} and train.init_from={cfg.train.init_from!r} both name a "
                          "warm start; accepted: one of them")
    try:
        hf_config = pretrained_config(model.hf_path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.hf_path={model.hf_path!r} is not a Hugging Face model folder (or reachable hub id): "
                          f"{err}") from None
    filled = config_for(hf_config, model, bos_token_id=model.bos_token_id)
    if cfg.train.seq_len > filled.max_seq_len:
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} exceeds the context of {model.hf_path} "
                          f"({filled.max_seq_len} positions); lower train.seq_len")
    return filled


def warm_start(model: FullbandLM, path: str, *, say: bool = True, key: str = "train.init_from") -> dict:
    """Copy every weight of the model folder `path` whose name and shape match (e.g. a standard checkpoint into
    a full-bandwidth model: the fusion weights keep their fresh initialisation), or of a pretrained Llama (a GGUF
    file or transformers folder, converted as `fullband convert` converts it; its fusion weights are not copied:
    the run's own initialisation stays). Returns what was copied/kept."""
    from fullband.folder import load_state, read_config

    if pretrained_source(path):
        from fullband.gguf_file import is_gguf
        from fullband.hf.gguf import load_causal_lm
        from fullband.hf.llama import from_llama

        converted = from_llama(load_causal_lm(path) if is_gguf(path) else path, fusion=model.config.fusion)
        source = {k: v for k, v in converted.state_dict().items() if not k.startswith("fusion.")}
        del converted
    else:
        read_config(path)  # a clear error for a missing or broken folder
        source = load_state(path)
    own = model.state_dict()
    copied = {k: v for k, v in source.items() if k in own and own[k].shape == v.shape}
    grown = {}
    for k in VOCAB_ROWS:  # a vocabulary grown by new ids (chat markers): the old rows, new ones at their mean
        if k in own and k in source and k not in copied and _grows(source[k], own[k]):
            rows = own[k].clone()
            old = source[k].to(rows.dtype)
            rows[: old.shape[0]] = old
            rows[old.shape[0]:] = old.mean(dim=0)
            copied[k] = rows
            grown[k] = [old.shape[0], rows.shape[0]]
    if not copied:
        raise ConfigError(f"{key}={path!r} shares no weight (name and shape) with this model")
    model.load_state_dict(copied, strict=False)
    fresh = sorted(k for k in own if k not in copied)
    grew = "".join(f"; {k} grown {a} -> {b} rows (new rows: the mean of the old)" for k, (a, b) in grown.items())
    if say:
        print(f"warm start from {path}: {len(copied)} tensors copied{grew}; fresh: {', '.join(fresh) or 'none'}",
              flush=True)
    return {"copied": sorted(copied), "fresh": fresh, "grown": grown}


VOCAB_ROWS = ("embed.weight", "lm_head.weight")  # one row per token id


def _grows(old: torch.Tensor, new: torch.Tensor) -> bool:
    return old.ndim == 2 and new.ndim == 2 and old.shape[1] == new.shape[1] and old.shape[0] < new.shape[0]


def pretrained_source(path: str) -> bool:
    """fullband.hf.convert.pretrained_source, imported when asked (fullband.hf brings transformers)."""
    from fullband.hf.convert import pretrained_source as is_pretrained

    return is_pretrained(path)
