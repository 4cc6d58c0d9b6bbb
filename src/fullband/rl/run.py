"""`fullband rl RECIPE.toml`: on-policy reinforcement learning with verifiable rewards from a chat model.

A recipe's [rl] table (RLConfig, `--set rl.KEY=VALUE` overrides) names the starting model, the chat corpus (each
conversation up to its last assistant turn is a prompt, that turn's final 'Answer: ...' the reference), the reward,
the decoding mode, G and the log-probability path. Each step samples G responses to `prompts_per_step` prompts
drawn by (seed, step), takes one policy-gradient step (fullband.rl.step) and logs a metrics.jsonl row; every
`eval_every` steps the held-out prompts are answered greedily in the mode (fullband.eval.chat: exact match, reply
length). Checkpoints hold the weights, the optimiser and the step: as everything random is a function of (seed,
step), a resumed run (`--resume RUN_DIR`) computes what the uninterrupted one would have, bit for bit."""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from fullband.configio import apply_overrides, from_dict, read_settings_file, to_dict
from fullband.errors import ConfigError, DataError, InputError, TrainingDiverged
from fullband.presets import recipe_path
from fullband.train import checkpoint as ckpt
from fullband.machine import MAX_THREADS
from fullband.train.metrics import METRICS_FILE, MetricsLog, metric_rows
from fullband.train.parallel import Dist
from fullband.train.rundir import RunDir, stop_after_step
from fullband.rl.step import RLSettings
from fullband.validate import MAX_LR, available_device, integer, number

# settings a resumed run may change (how often it logs and evaluates); every other one must match run.json
MAY_CHANGE = ("eval_every", "eval_prompts", "ckpt_every", "keep_last", "device", "reward_timeout",
              "threads")  # threads: the run's own count, checked on its own (fullband.machine.run_threads)


@dataclass
class RLConfig(RLSettings):
    """A recipe's [rl] table: the step's settings (RLSettings) and the run's."""

    init_from: str = ""  # the starting model: a model folder or checkpoint holding a chat tokenizer
    data: str = "arithmetic"  # a chat corpus (as data.corpus for chat training); train / val split by hash
    val_percent: float = 2.0  # held-out share of the conversations (answered greedily every eval_every steps)
    reward: str = "answer"  # "answer" (final 'Answer: ...' exact match), "contains" (the reference answer in the
    # reply as a word) or "module:function" / "file.py:function"
    reward_timeout: float = 60.0  # seconds one reward call may take (0: no limit)
    prompts_per_step: int = 8  # prompts sampled per step (each gets `group` replies)
    steps: int = 100  # optimizer steps
    lr: float = 1e-5  # AdamW, no weight decay
    seed: int = 0  # the run's seed: prompts, samples and every step are functions of (seed, step)
    eval_every: int = 25  # answer the held-out prompts greedily every N steps (0: only at the end)
    eval_prompts: int = 64  # held-out prompts per evaluation
    ckpt_every: int = 25  # checkpoint every N steps (0: only at the end)
    keep_last: int = 3  # checkpoints kept
    run_dir: str = "runs/rl"  # the run directory: run.json, metrics.jsonl, checkpoints, rl.png
    device: str = "cpu"  # cpu, cuda or cuda:N
    threads: int = 0  # torch's threads; 0: chosen at the run's start (the free cores), recorded, used by every resume

    def __post_init__(self) -> None:
        if not self.init_from:
            raise ConfigError("rl.init_from is empty; accepted: the folder of a chat model (e.g. a step of "
                              "`fullband train configs/sft-tiny.toml`)")
        super().__post_init__()
        for name in ("prompts_per_step", "steps", "eval_prompts", "keep_last"):
            integer(f"rl.{name}", getattr(self, name), 1)
        for name in ("eval_every", "ckpt_every", "seed"):
            integer(f"rl.{name}", getattr(self, name), 0)
        integer("rl.threads", self.threads, 0, below=MAX_THREADS + 1)
        number("rl.val_percent", self.val_percent, low=0, high=100, low_open=True, high_open=True)
        number("rl.lr", self.lr, low=0, high=MAX_LR, low_open=True)
        number("rl.reward_timeout", self.reward_timeout, low=0, high=86400)
        if not isinstance(self.device, str) or not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"rl.device={self.device!r} is invalid; accepted: 'cpu', 'cuda' or 'cuda:N'")


MUST_MATCH = tuple(f"rl.{f.name}" for f in fields(RLConfig) if f.name not in MAY_CHANGE)


@dataclass
class RLRecipe:
    rl: RLConfig = field(default_factory=RLConfig)

    def to_dict(self) -> dict:
        return to_dict(self)


def load_rl_recipe(path: str | Path, overrides: list[str] | None = None) -> RLRecipe:
    """An [rl] recipe (configs/NAME: also the one shipped with the package, see presets.recipe_path) with
    `rl.key=value` overrides, validated."""
    path = recipe_path(path)
    data = apply_overrides(read_settings_file(path, "TOML" if path.suffix != ".json" else "JSON"), overrides)
    try:
        return from_dict(RLRecipe, data)
    except (ConfigError, InputError) as err:  # the step's settings are checked as rl_step checks them
        raise ConfigError(f"{path}: {err}") from None


@dataclass
class Items:
    prompts: list[list[int]]
    texts: list[str]  # each prompt's last user turn, as the reward reads it
    answers: list[str]


def check_step_memory(cfg: RLConfig, model, longest_prompt: int, device) -> None:
    """Refuse, before anything is allocated, a step whose rows (prompts_per_step x group) of the longest prompt plus
    max_new_tokens do not fit in memory: the log-probability passes' activations with gradients (as a training
    step's, train.memory.step_memory), AdamW's state, the reference model (kl_coef > 0, rl.hold > 0, or
    distillation towards it), the hold's logits and the sampling caches."""
    from fullband.model.flops import kv_bytes_per_token
    from fullband.rl.logprob import parse_path
    from fullband.train.memory import check_fits, model_bytes, step_memory

    rows = cfg.prompts_per_step * cfg.group
    tokens = rows * min(longest_prompt + cfg.max_new_tokens, model.max_seq_len)
    name, k = parse_path(cfg.logprob)
    passes = 1 if cfg.mode == "standard" else (k if name == "jacobi" else 2)
    step = step_memory(model, passes=passes, tokens=tokens, optimizer="adamw")
    parts = {"weights, gradients and AdamW state": step.weights + step.gradients + step.optimizer,
             f"activations of {rows:,} rows": step.activations, "sampling caches": tokens * kv_bytes_per_token(model)}
    if cfg.needs_reference:
        parts["reference model"] = model_bytes(model)
    if cfg.hold > 0:  # float32 logits at each response token: the start's, the policy's, its softmax and gradients
        parts["the hold's logits (rl.hold)"] = 4 * 4 * rows * cfg.max_new_tokens * model.vocab_size
    check_fits(parts, f"an RL step of {rows:,} rows (rl.prompts_per_step x rl.group) of up to {tokens // rows:,} "
               "tokens", device, smaller="rl.group, rl.prompts_per_step or rl.max_new_tokens", error=ConfigError)


def _items(cfg: RLConfig, tokenizer, room: int) -> Items:
    """The training prompts: the train split's conversations up to their last assistant turn, rendered."""
    from fullband.data.chat.templates import chat_prompt, chat_template
    from fullband.eval.chat import held_out_items

    template = chat_template(tokenizer)
    out = Items([], [], [])
    for messages, answer in held_out_items(cfg.data, val_percent=cfg.val_percent, split="train"):
        ids = chat_prompt(tokenizer, messages, template=template)
        if len(ids) + cfg.max_new_tokens <= room:  # a prompt that leaves no room for the reply is left out
            out.prompts.append(ids)
            out.texts.append(messages[-1].content)
            out.answers.append(answer)
    if not out.prompts:
        raise DataError(f"no training prompt of {cfg.data!r} leaves room for rl.max_new_tokens={cfg.max_new_tokens} "
                        f"in max_seq_len={room}; lower rl.max_new_tokens")
    return out


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % 2**63


@dataclass
class _Run:
    """What a run holds while it trains (`reference`: the frozen starting model, when a step reads it)."""

    recipe: RLRecipe
    d: Dist
    model: torch.nn.Module
    tokenizer: object
    reward: object
    train_items: Items
    val_items: list
    reference: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    mode: object = None
    bar: object = None

    @property
    def cfg(self) -> RLConfig:
        return self.recipe.rl


def rl_train(recipe: RLRecipe, *, resume: str | Path | None = None, progress: bool = True) -> Path:
    """Run (or resume) the recipe; returns the run directory. The run sets torch's threads (rl.threads) and gives
    the caller its count back."""
    from tqdm.auto import tqdm

    from fullband.rl.logprob import rl_mode

    with RunDir(recipe.rl.run_dir, resume=resume, key="rl.run_dir") as rundir:
        s = _prepare(recipe)  # everything that can fail on the user's input, before the run directory is written to
        threads = rundir.check(recipe.to_dict(), MUST_MATCH, "rl.threads", recipe.rl.threads)
        s.recipe = replace(recipe, rl=replace(recipe.rl, threads=threads))  # what run.json and the checkpoints record
        state = rundir.load(s.model, s.optimizer, s.d) or {"step": 0, "elapsed": 0.0, "tokens": 0}
        if rundir.checkpoint is not None:
            print(f"resumed from {rundir.checkpoint} at step {state['step']}", flush=True)
        rundir.begin(s.recipe.to_dict(), state["step"])
        s.mode = rl_mode(s.cfg.mode)
        s.bar = tqdm(total=s.cfg.steps, initial=state["step"], desc="rl", disable=not progress, dynamic_ncols=True)
        try:
            if s.mode.feeds_state and not s.model.config.feedback_ready:
                s.bar.write(f"rl.mode={s.cfg.mode!r} on {s.cfg.init_from}, whose feedback weights are untrained (a "
                            "converted model): its replies read an untrained state; rl.mode = \"standard\" samples "
                            "the model as it is")
            _train_loop(s, rundir, state)
        finally:
            s.bar.close()  # an error's line starts a line of its own
        plot_rl(rundir.path / METRICS_FILE, rundir.path / "rl.png")
        return rundir.path


def _prepare(recipe: RLRecipe) -> _Run:
    """The starting model, its optimizer, the reward and the prompts, each checked."""
    from fullband.chat import check_chat_model
    from fullband.data.tokenizer import load_tokenizer
    from fullband.eval.chat import held_out_items
    from fullband.loader import load_model
    from fullband.rl.rewards import load_reward

    cfg = recipe.rl
    d = Dist(device=torch.device(available_device("rl.device", cfg.device)))
    model = load_model(cfg.init_from, device=d.device)
    tokenizer = load_tokenizer(cfg.init_from)
    check_chat_model(model, tokenizer)
    reward = load_reward(cfg.reward, timeout=cfg.reward_timeout)
    train_items = _items(cfg, tokenizer, model.config.max_seq_len)
    check_step_memory(cfg, model.config, max(len(p) for p in train_items.prompts), d.device)
    val_items = held_out_items(cfg.data, limit=cfg.eval_prompts, val_percent=cfg.val_percent, split="val")
    reference = copy.deepcopy(model).requires_grad_(False) if cfg.needs_reference else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    return _Run(recipe, d, model, tokenizer, reward, train_items, val_items, reference, optimizer)


def _train_loop(s: _Run, rundir: RunDir, state: dict) -> None:
    """Steps from the one `state` holds to rl.steps: each logged, evaluated and checkpointed when due; a Ctrl-C or
    SIGTERM stops after the step it is in, with a checkpoint."""
    from fullband.rl.step import rl_step

    cfg, stops = s.cfg, list(s.tokenizer.stop_ids)
    step, elapsed, tokens = state["step"], state["elapsed"], state["tokens"]
    with MetricsLog(rundir.path) as log, stop_after_step() as stop:
        if step == 0 and cfg.eval_every:  # the starting model, for the curve to start from
            log.log(_evaluate(s, {"step": 0}))
        while step < cfg.steps:
            t0 = time.perf_counter()
            rng = random.Random(step_seed(cfg.seed, step))
            idx = rng.sample(range(len(s.train_items.prompts)), min(cfg.prompts_per_step, len(s.train_items.prompts)))
            try:
                row = rl_step(s.model, s.optimizer, [s.train_items.prompts[i] for i in idx], _score(s, idx), cfg,
                              seed=step_seed(cfg.seed, step), stop_tokens=stops, reference=s.reference)
            except TrainingDiverged as err:  # nothing of this step is written; the last checkpoint stays
                raise TrainingDiverged(f"step {step + 1}: {err}. {rundir.last_good()}") from None
            step += 1
            elapsed += time.perf_counter() - t0
            tokens += row["tokens"]
            row = {"step": step, **row, "time": elapsed}
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                _evaluate(s, row)
            log.log(row)
            s.bar.set_postfix(reward=f"{row['reward']:.3f}", length=f"{row['length']:.1f}")
            s.bar.update(1)
            said = _nothing_learned(cfg, row, len(idx))
            if said:
                s.bar.write(said)
            interrupted = step < cfg.steps and stop.agreed(s.d)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.steps or interrupted:
                state = {"tokens": tokens, "compute_tokens": tokens, "elapsed": elapsed, "sampler": {},
                         "config": s.recipe.to_dict()}
                path = ckpt.save_checkpoint(rundir.path, step, s.model, s.optimizer, state, d=s.d,
                                            tokenizer=s.tokenizer, keep_last=cfg.keep_last)
            if interrupted:  # Ctrl-C or SIGTERM: the step is whole and kept; stop here
                s.bar.write(rundir.interrupted(step, path, "rl"))
                raise stop.stopped()


def _score(s: _Run, idx: list[int]):
    """The reward of the i-th sampled prompt's response (the prompts `idx` of the training items)."""
    stops = set(s.tokenizer.stop_ids)

    def one(i: int, response: list[int]) -> float:
        j = idx[i]
        text = s.tokenizer.decode([t for t in response if t not in stops])
        return s.reward(s.train_items.texts[j], text, {"answer": s.train_items.answers[j]})
    return one


def _evaluate(s: _Run, row: dict) -> dict:
    """The held-out prompts answered greedily in the run's mode and scored by its own reward, into `row`."""
    from fullband.eval.chat import chat_eval

    def held_out(messages, text: str, answer: str) -> float:
        return s.reward(messages[-1].content, text, {"answer": answer})

    result = chat_eval(s.model, s.tokenizer, s.val_items, [s.mode], max_new_tokens=s.cfg.max_new_tokens,
                       progress=False, score=held_out)["rows"][0]
    row["eval"] = {"accuracy": result["accuracy"], "length": result["tokens"]}
    s.bar.write(f"step {row['step']}: held-out reward {result['accuracy']:.3f} ({s.cfg.reward}), reply length "
                f"{result['tokens']:.1f} tokens ({s.mode.label}, greedy)")
    return row


def _nothing_learned(cfg: RLConfig, row: dict, groups: int) -> str | None:
    """What to tell the user when a step's samples (`groups` prompts) cannot move the model."""
    if cfg.algorithm == "grpo" and row["flat_groups"] == groups:
        return (f"step {row['step']}: every reply to each of the {groups} prompts scored the same (mean reward "
                f"{row['reward']:.3g}), so every advantage is 0 and this step changed nothing; rl.reward "
                f"{cfg.reward!r} needs replies that this model earns sometimes, not always or never (docs/rl.md)")
    if cfg.algorithm == "rejection-sft" and row.get("kept") == 0:
        return (f"step {row['step']}: no reply reached rl.accept={cfg.accept:g} (mean reward "
                f"{row['reward']:.3g}), so this step trained on nothing")
    return None


def plot_rl(metrics: Path, out: Path) -> Path | None:
    """Reward and reply length per step (and the held-out reward, greedy, where it was measured), as a PNG."""
    from fullband.files import plt, save_figure

    rows = metric_rows(metrics)
    if not rows:
        return None
    fig, (top, bottom) = plt().subplots(2, 1, figsize=(8, 6), sharex=True)
    sampled = [r for r in rows if "reward" in r]  # step 0: the starting model's evaluation only
    steps = [r["step"] for r in sampled]
    top.plot(steps, [r["reward"] for r in sampled], label="reward (sampled)", lw=1)
    evals = [r for r in rows if "eval" in r]
    if evals:
        top.plot([r["step"] for r in evals], [r["eval"]["accuracy"] for r in evals], "o--",
                 label="held-out reward (greedy)")
    top.set(ylabel="reward / accuracy")
    top.legend(fontsize=8)
    bottom.plot(steps, [r["length"] for r in sampled], label="sampled replies", lw=1)
    if evals:
        bottom.plot([r["step"] for r in evals], [r["eval"]["length"] for r in evals], "o--", label="held-out (greedy)")
    bottom.set(xlabel="step", ylabel="reply length (tokens)")
    bottom.legend(fontsize=8)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    save_figure(fig, out)
    return out
