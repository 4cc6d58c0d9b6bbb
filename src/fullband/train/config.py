"""The run config: [model], [data], [train], [optim], [log] sections of a recipe TOML, each a validated
dataclass; the resolved config is saved in every run directory and checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fullband.configio import apply_overrides, from_dict, read_settings_file, to_dict
from fullband.errors import ConfigError
from fullband.machine import MAX_THREADS
from fullband.validate import boolean, choice, integer, number
from fullband.model.config import ModelConfig
from fullband.presets import recipe_path
from fullband.train.optim import OptimConfig
from fullband.train.schedule import AdaptiveSchedule, PassSchedule, parse_schedule

DTYPES = ("auto", "float32", "bfloat16")
MAX_SEED = 2**63  # seeds are signed 64-bit integers (TOML's range)
PARALLEL = ("ddp", "fsdp")
FORMATS = ("text", "chat", "tracking")


@dataclass
class DataConfig:
    corpus: str | list[str] = "stdlib"  # "stdlib", files / dirs / globs, *.jsonl, "hf:<dataset>"
    text_field: str = "text"  # JSONL / datasets column holding the text
    val_percent: float = 1.0  # held-out share, split by file (or row)
    tokenizer: str = "byte"  # "byte", "bpe" (trained on the corpus), or a folder holding a tokenizer.json
    bpe_vocab_size: int = 8192  # tokenizer = "bpe": the vocabulary size it trains to
    cache_dir: str = ""  # token shards; default $FULLBAND_CACHE or ~/.cache/fullband
    format: str = "text"  # "text": packed documents; "chat": conversations (JSONL `messages`), loss on replies;
    #                       "tracking": a state-tracking task (corpus "TASK:L", fullband.data.tracking)
    chat_too_long: str = "drop"  # chat: a conversation longer than seq_len is dropped or truncated (counts printed)
    fused_prompts: float = 0.5  # chat: share of windows whose prompts are fed in passes > 1 (as FUSED prefill
    #                             reads them); the others read prompts plainly (as SOFT does)
    train_tokens: int = 0  # text: > 0 trains on the training split's first N tokens only, repeated for as many
    #                        epochs as the steps need (a data-constrained run); 0: the whole split. Held-out: unchanged
    repeat: float = 0.0  # tracking: each input step repeats the one before it with this probability (longer runs of
    #                      one symbol, in both splits; the test sets draw every step independently); 0: independent
    shares: list[float] = field(default_factory=list)  # text: one share per data.corpus entry (summing to 1), each
    #                     entry its own token stream sampled at that share of the windows (and of the held-out ones);
    #                     empty: the entries are one stream, read in proportion to their sizes

    def __post_init__(self) -> None:
        number("data.val_percent", self.val_percent, low=0, high=100, low_open=True, high_open=True)
        integer("data.bpe_vocab_size", self.bpe_vocab_size, 260)
        choice("data.format", self.format, FORMATS)
        choice("data.chat_too_long", self.chat_too_long, ("drop", "truncate"))
        number("data.fused_prompts", self.fused_prompts, low=0, high=1)
        integer("data.train_tokens", self.train_tokens, 0)
        number("data.repeat", self.repeat, low=0, high=1, high_open=True)
        if self.repeat and self.format != "tracking":
            raise ConfigError(f"data.repeat={self.repeat} shapes a tracking task's inputs; accepted for "
                              f"data.format={self.format!r}: 0")
        if self.train_tokens and self.format != "text":
            raise ConfigError(f"data.train_tokens={self.train_tokens} limits a text corpus; accepted for "
                              f"data.format={self.format!r}: 0 (the whole split)")
        if self.format != "text" and self.tokenizer == "bpe":
            raise ConfigError(f"data.tokenizer='bpe' trains a tokenizer on text, not on {self.format} data; accepted "
                              f"for data.format={self.format!r}: 'byte' or the folder of the base model's tokenizer "
                              "(its checkpoint)")
        if not self.corpus:
            raise ConfigError("data.corpus is empty; accepted: 'stdlib', a path, a glob, a .jsonl file or 'hf:<name>'")
        if self.shares:
            self._check_shares()

    def _check_shares(self) -> None:
        shares = self.shares
        if not isinstance(shares, list):
            raise ConfigError(f"data.shares={shares!r} must be a list of numbers, one per data.corpus entry")
        for i, x in enumerate(shares):
            number(f"data.shares[{i}]", x, low=0, low_open=True)
        entries = self.corpus if isinstance(self.corpus, list) else [self.corpus]
        if len(shares) != len(entries):
            raise ConfigError(f"data.shares has {len(shares)} share(s) for {len(entries)} data.corpus entr"
                              f"{'y' if len(entries) == 1 else 'ies'} ({entries!r}); accepted: one share per entry")
        twice = sorted({str(e) for e in entries if entries.count(e) > 1})
        if twice:
            raise ConfigError(f"data.corpus lists {', '.join(map(repr, twice))} more than once; accepted with "
                              "data.shares: each entry once (its share says how often it is read)")
        if abs(sum(shares) - 1) > 1e-6:
            raise ConfigError(f"data.shares={shares!r} sums to {sum(shares):.6g}; accepted: shares summing to 1, e.g. "
                              f"{[round(x / sum(shares), 4) for x in shares]!r}")
        if self.format != "text":
            raise ConfigError(f"data.shares mixes text corpora; accepted for data.format={self.format!r}: [] (none)")
        if self.train_tokens:
            raise ConfigError(f"data.train_tokens={self.train_tokens} limits one stream, data.shares mixes several; "
                              "accepted: one of them")


@dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps
    seq_len: int = 256  # tokens per training window
    global_batch_tokens: int = 16384  # tokens per optimizer step across all ranks (seq_len x windows)
    micro_batch: int = 8  # windows per forward on one rank; gradient accumulation fills the global batch
    seed: int = 0  # the run's seed: initialisation, data order, each step's pass count and noise
    passes: Any = "paper-200b"  # pass schedule: a preset name, a list of {until, probs} stages, or "adaptive" (or
    # a table {schedule = "adaptive", every = 25, ...}: the mix steered by the measured contraction)
    warmup_steps: int = 200  # WSD: steps of linear warmup of the learning rate
    cooldown_fraction: float = 0.25  # WSD: the last fraction decays linearly to zero
    z_loss: float = 1e-5  # applied during the cooldown only, as the paper does
    decay_wd_in_cooldown: bool = True  # weight decay scaled with the LR during the cooldown (AdamC)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto: bfloat16 autocast on GPU, float32 on CPU
    compile: bool = False  # torch.compile each block (GPU)
    activation_checkpointing: bool = False  # recompute each block's activations in the backward (less memory)
    parallel: str = "ddp"  # under torchrun: ddp or fsdp (FSDP2 fully_shard)
    init_from: str = ""  # warm start: a model folder whose matching weights replace the fresh initialisation
    threads: int = 0  # torch's threads per process; 0: chosen at the run's start (the free cores). run.json records
    # the count and every resume uses it (the last bits of a step depend on it)
    blend_until: float = 0.0  # the blend curriculum (docs/method.md, section 6): fed inputs are (1 - a) * plain +
    # a * fused, a rising from 0 to 1 over this fraction of the steps, so a warm start begins at the pretrained model;
    # 0: off (the paper's input)
    latent_loss: float = 0.0  # the next-latent term's weight (docs/method.md, section 6): latent_loss * the mean over
    # passes of the normalised error of model.latent_head predicting the next position's fed-back state; 0: off
    distill: float = 0.0  # self-distillation (docs/method.md, section 6): distill * the mean over passes 2..k of
    # KL(pass 1's next-token distribution, not differentiated || the pass's), the weight falling linearly to 0 at
    # distill_until x steps (the paper's pure next-token loss after); 0: off (nothing computed)
    distill_until: float = 1.0  # the fraction of the steps at which train.distill's weight reaches 0 (> 0; above 1:
    # still above 0 at the last step, falling as in a run that much longer)
    anchor: float = 0.0  # the anchor (docs/method.md, section 6): anchor * the mean over every pass of KL(the run's
    # starting model read STANDARD, frozen || the pass's next-token distribution), the weight falling linearly to 0
    # at anchor_until x steps; needs a starting model (train.init_from or model.hf_path) or train.anchor_from; 0: off
    # (nothing computed)
    anchor_from: str = ""  # the model train.anchor holds the passes to: '' the run's start (train.init_from or
    # model.hf_path); else a model folder, GGUF file (shipped:NAME) or transformers Llama folder of this model's sizes
    # (e.g. the pretrained model, when a run starts from a fed checkpoint of it)
    anchor_until: float = 1.0  # the fraction of the steps at which train.anchor's weight reaches 0 (> 0; above 1:
    # still above 0 at the last step, falling as in a run that much longer)
    block_match: float = 0.0  # the block match (docs/method.md, section 6): block_match * the mean over passes 2..k
    # and over blocks of the block's output's squared distance from the first pass's (not differentiated), relative to
    # the latter's mean square; the weight falling linearly to 0 at block_match_until x steps; 0: off
    block_match_until: float = 1.0  # the fraction of the steps at which train.block_match's weight reaches 0 (> 0,
    # as distill_until)
    trainable: list[str] = field(default_factory=lambda: ["*"])  # the weights trained, as name patterns (fnmatch,
    # e.g. ["fusion.*", "norm_in.*", "blocks.[0-3].*"]); the rest stay frozen (no gradients, no optimizer state)
    memory_check: bool = True  # refuse to start when the largest step's memory estimate exceeds what is available
    # (false: warn and go on)
    stop_after_minutes: float = 0.0  # end this invocation after the step in which so many minutes of wall time have
    # passed, with a checkpoint (a job's time limit); --resume goes on. 0: train to train.steps

    def __post_init__(self) -> None:
        for name in ("steps", "seq_len", "global_batch_tokens", "micro_batch"):
            integer(f"train.{name}", getattr(self, name), 1)
        integer("train.seed", self.seed, 0, below=MAX_SEED)
        integer("train.threads", self.threads, 0, below=MAX_THREADS + 1)
        boolean("train.memory_check", self.memory_check)
        if not isinstance(self.trainable, list) or not self.trainable or not all(
                isinstance(p, str) and p.strip() for p in self.trainable):
            raise ConfigError(f"train.trainable={self.trainable!r} is invalid; accepted: a non-empty list of weight "
                              'name patterns, e.g. ["*"] (everything) or ["fusion.*", "norm_in.*"]')
        integer("train.warmup_steps", self.warmup_steps, 0, below=self.steps + 1)
        number("train.cooldown_fraction", self.cooldown_fraction, low=0, high=1)
        number("train.z_loss", self.z_loss, low=0)
        number("train.blend_until", self.blend_until, low=0, high=1, high_open=True)
        number("train.latent_loss", self.latent_loss, low=0)
        number("train.distill", self.distill, low=0)
        number("train.distill_until", self.distill_until, low=0, low_open=True)
        number("train.anchor", self.anchor, low=0)
        number("train.anchor_until", self.anchor_until, low=0, low_open=True)
        number("train.block_match", self.block_match, low=0)
        number("train.block_match_until", self.block_match_until, low=0, low_open=True)
        number("train.stop_after_minutes", self.stop_after_minutes, low=0)
        if self.global_batch_tokens % self.seq_len:
            raise ConfigError(f"train.global_batch_tokens={self.global_batch_tokens} is not a multiple of "
                              f"train.seq_len={self.seq_len}; accepted: a whole number of windows (e.g. "
                              f"{self.seq_len * max(1, self.global_batch_tokens // self.seq_len)})")
        choice("train.dtype", self.dtype, DTYPES)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"train.device={self.device!r} is invalid; accepted: auto, cpu, cuda, cuda:N")
        choice("train.parallel", self.parallel, PARALLEL)
        self.schedule  # validates the pass schedule now

    @property
    def schedule(self) -> PassSchedule | AdaptiveSchedule:
        return parse_schedule(self.passes)

    @property
    def global_windows(self) -> int:
        return self.global_batch_tokens // self.seq_len


@dataclass
class LogConfig:
    run_dir: str = "runs/run"  # the run directory: run.json, metrics.jsonl, checkpoints, loss.png
    log_every: int = 10  # metrics lines (every step is logged to metrics.jsonl; this is the console cadence)
    eval_every: int = 200  # validation loss every N steps (0: only at the end)
    eval_windows: int = 32  # validation windows per evaluation
    eval_passes: list[int] = field(default_factory=lambda: [1, 2])  # pass counts the validation loss is read at
    gate_windows: int = 4  # validation windows the stability gate reads at every eval (0: no gate)
    eval_chats: str = ""  # a chat set (a data.corpus spec of conversations) whose assistant tokens are also read at
    # every eval, at log.eval_passes (metrics.jsonl's eval_chats: what training does to chat, as a curve); "" off
    ckpt_every: int = 200  # checkpoint every N steps (0: only at the end)
    keep_last: int = 3  # checkpoints kept
    progress: bool = True  # a progress bar on the console
    tensorboard: bool = False  # also log to TensorBoard (the `log` extra)
    wandb: bool = False  # also log to Weights & Biases (the `log` extra; WANDB_MODE=offline works without a network)
    wandb_project: str = "fullband"  # the Weights & Biases project

    def __post_init__(self) -> None:
        for name in ("log_every", "eval_every", "eval_windows", "gate_windows", "ckpt_every"):
            integer(f"log.{name}", getattr(self, name), 0)
        integer("log.keep_last", self.keep_last, 1)
        if not self.eval_passes:
            raise ConfigError("log.eval_passes=[] is empty; accepted: a non-empty list of integers >= 1")
        for i, k in enumerate(self.eval_passes):
            integer(f"log.eval_passes[{i}]", k, 1)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        from fullband.hf.convert import pretrained_source  # brings transformers when called, not at import

        from_pretrained = self.model.hf_path or pretrained_source(self.train.init_from)
        if self.train.seq_len > self.model.max_seq_len and not from_pretrained:  # checked against that model's context
            raise ConfigError(f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; "
                              f"lower train.seq_len or raise model.max_seq_len")
        if self.model.has_loop and not self.model.has_feedback and self.train.schedule.max_passes > 1:
            raise ConfigError(f"train.passes={self.train.passes!r} draws up to {self.train.schedule.max_passes} "
                              "passes, but a looped model with model.fusion='none' has no state to feed; accepted: "
                              'train.passes = "none" (one pass; its depth is model.loops / model.loop_train)')
        if self.train.blend_until > 0 and (self.model.fusion in ("none", "t2mlr")
                                           or self.train.schedule.max_passes < 2):
            why = (f"model.fusion={self.model.fusion!r} has no fused input that replaces the plain one"
                   if self.model.fusion in ("none", "t2mlr")
                   else f"train.passes={self.train.passes!r} never feeds a state (one pass)")
            raise ConfigError(f"train.blend_until={self.train.blend_until} has nothing to blend: {why}; "
                              "accepted: train.blend_until = 0, or a gated / additive / concat fusion trained with "
                              "several passes")
        if isinstance(self.train.schedule, AdaptiveSchedule):
            why = ("model.fusion='none' has no pass map to measure" if not self.model.has_feedback else
                   "the contraction is measured with forward-mode derivatives, which FSDP's sharded weights do not "
                   "support" if self.train.parallel == "fsdp" else "")
            if why:
                raise ConfigError(f"train.passes='adaptive': {why}; accepted: a fixed schedule (a preset name or "
                                  "stages)" + (", or train.parallel = 'ddp'" if self.model.has_feedback else ""))
        if self.train.latent_loss > 0 and self.model.latent_head == "none":
            raise ConfigError(f"train.latent_loss={self.train.latent_loss} trains a next-latent head, but "
                              'model.latent_head = "none"; accepted: model.latent_head = "linear", or '
                              "train.latent_loss = 0")
        for key, weight, what in (("distill", self.train.distill, "distribution"),
                                  ("block_match", self.train.block_match, "block outputs")):
            if weight > 0 and (not self.model.has_feedback or self.model.ponder or self.train.schedule.max_passes < 2):
                why = ("model.fusion='none' feeds nothing" if not self.model.has_feedback else
                       "a ponder model trains its last pass alone" if self.model.ponder else
                       f"train.passes={self.train.passes!r} runs one pass, the teacher itself")
                raise ConfigError(f"train.{key}={weight} draws fed passes towards the first pass's {what}, but {why}; "
                                  f"accepted: train.{key} = 0, or a model with feedback trained with several passes")
        t = self.train
        if t.anchor > 0 and not (t.init_from or self.model.hf_path or t.anchor_from):
            raise ConfigError(f"train.anchor={t.anchor} draws every pass towards the model the run starts "
                              "from, but this run starts from a random initialisation; accepted: train.anchor = 0, "
                              "or a warm start (train.init_from or model.hf_path), or train.anchor_from")
        if t.anchor_from and t.anchor == 0:
            raise ConfigError(f"train.anchor_from={t.anchor_from!r} names the anchor's model, but train.anchor = 0 "
                              "computes no anchor; accepted: train.anchor > 0, or train.anchor_from = ''")
        if t.anchor_from and self.model.hf_path:
            raise ConfigError(f"train.anchor_from={t.anchor_from!r} with model.hf_path={self.model.hf_path!r}: a "
                              "wrapped transformers model is anchored to its own start; accepted: one of them")
        deepest = self.train.schedule.max_passes
        horizon = getattr(self.train.schedule, "horizon", 0)
        if max(deepest, horizon) > self.train.seq_len + 1:
            what = (f"draws up to {deepest} passes" if deepest >= horizon else
                    f"measures the pass map over horizon = {horizon} passes")
            raise ConfigError(f"train.passes {what}, but a window of train.seq_len={self.train.seq_len} positions "
                              f"reaches its fixed point after {self.train.seq_len + 1}: passes beyond it compute "
                              f"nothing new; accepted: at most {self.train.seq_len + 1}")
        if self.train.micro_batch > self.train.global_windows:
            raise ConfigError(f"train.micro_batch={self.train.micro_batch} windows exceeds the global batch of "
                              f"{self.train.global_windows} windows (global_batch_tokens / seq_len)")

    def to_dict(self) -> dict:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RunConfig":
        return from_dict(cls, data)


def load_run_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a recipe TOML (or a saved run.json; configs/NAME: also the recipe shipped with the package, see
    presets.recipe_path), apply `section.key=value` overrides, validate everything."""
    path = recipe_path(path)
    data = read_settings_file(path, "TOML" if path.suffix != ".json" else "JSON")
    data = apply_overrides(data, overrides)
    try:
        return RunConfig.from_dict(data)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
