"""What every experiment of `fullband reproduce` shares: its runs (trained from configs/tiny.toml plus overrides,
finished ones reused, interrupted ones resumed), its registry entry, the settings, and the reports' common lines."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


from fullband.files import replace_file, save_figure
from fullband.machine import hardware  # noqa: F401 (the reports' machine line, re-exported)
from fullband.reproduce.seeds import Findings, shown  # noqa: F401 (shown: re-exported for the reports)

BASE = "configs/tiny.toml"


@dataclass
class Run:
    name: str
    overrides: list[str] = field(default_factory=list)
    config: str = ""  # the recipe when it is not the experiment's base (configs/tiny.toml)


@dataclass(frozen=True)
class Experiment:
    """One experiment of `fullband reproduce`: its name, its runs (a fresh list each call: a report may add a run's
    warm start to its overrides) and its report, which trains and evaluates them and returns the report's lines
    (called as report(runs, root, figs, settings, **options))."""

    name: str
    runs: Callable[[], list[Run]]
    report: Callable[..., list[str]]
    check: Callable[..., None] | None = None  # the options checked before anything is written (InputError)
    seeds: int = 3  # training seeds `fullband reproduce` runs by default (--seeds)
    seeds_option: bool = False  # True: the report takes the seeds itself (report(..., seeds=N)), run once


@dataclass(frozen=True)
class Settings:
    """What every run of an experiment starts from: the base recipe and overrides applied after each run's own
    (tests shrink the runs with them), the training seed of this pass over the runs (0: the recipes as written;
    N: train.seed / rl.seed = N, after everything else) and the findings the report records for it."""

    base: str = BASE
    extra: tuple[str, ...] = ()
    seed: int = 0
    findings: Findings = field(default_factory=Findings, compare=False)

    def seeded(self, table: str = "train") -> list[str]:
        """The override that sets this pass's seed in a recipe's `table` (train, or rl for `fullband rl`)."""
        return [f"{table}.seed={self.seed}"] if self.seed else []


def train_run(root: Path, run: Run, settings: Settings, extra: list[str] | None = None,
              eval_every: int = 0, train_more: bool = True) -> tuple[Path, float]:
    """Train (or reuse / resume) runs under root/<name>; returns the final checkpoint and the wall time spent.
    `eval_every` > 0 logs held-out losses every so many steps (metrics.jsonl, for curves); train_more=False: the run's
    latest checkpoint as it is (its recipe checked as for a resume; InputError when it has none), nothing trained."""
    from fullband.errors import InputError
    from fullband.train.checkpoint import list_checkpoints
    from fullband.train.config import load_run_config
    from fullband.train.trainer import train

    run_dir = root / run.name
    overrides = [*run.overrides, *(extra or []), *settings.extra, *settings.seeded(), f'log.run_dir="{run_dir}"',
                 f"log.eval_every={eval_every}"]
    cfg = load_run_config(run.config or settings.base, overrides)
    _same_recipe(run_dir, cfg)
    if not train_more and not list_checkpoints(run_dir):
        raise InputError(f"the run {run_dir} has no checkpoint to read, and this invocation trains nothing")
    # train_more=False: any checkpoint has reached step 0, so the latest is returned as it stands
    return _reused(run, run_dir, cfg.train.steps if train_more else 0, lambda resume: train(cfg, resume=resume))


def _same_recipe(run_dir: Path, cfg) -> None:
    """Refuse to reuse or resume a run trained with another recipe (the settings a resume must keep, resolved as
    the trainer resolves them, against run.json's; a setting one side does not have, from another version of
    fullband, is not a difference): its results would be reported as this recipe's."""
    from fullband.errors import ConfigError
    from fullband.files import read_json
    from fullband.train.build import resolve
    from fullband.train.parallel import Dist
    from fullband.train.rundir import MUST_MATCH, RUN_FILE, resume_differences

    saved = read_json(run_dir / RUN_FILE)
    if not isinstance(saved, dict):
        return
    now = resolve(cfg, Dist(), run_dir=run_dir)[0].to_dict()
    diffs = [d for d in resume_differences(saved, now, MUST_MATCH) if "(not set)" not in d]
    if diffs:
        raise ConfigError(f"{run_dir} was trained with another recipe than this experiment's ({'; '.join(diffs[:3])}"
                          f"{f'; and {len(diffs) - 3} more' if len(diffs) > 3 else ''}): its results would be "
                          "reported as this recipe's; move it away to train it again, or pass another --root")


@dataclass
class Tuned:
    """A run trained from another's final checkpoint (instruction tuning from its base model)."""

    checkpoint: Path
    wall: float  # seconds, its own training
    start_wall: float  # its start's
    tokens: int  # training tokens of the start and the run together
    compute_tokens: int  # tokens x passes, both together


def train_tuned(root: Path, pairs, settings: Settings, extra: tuple[str, ...] = ()) -> dict[str, Tuned]:
    """Each (tuned, start) pair of runs: the start trained (or reused), then the tuned one from its final checkpoint
    (train.init_from, added to the tuned run's overrides) with `extra`; -> the tuned runs by name."""
    from fullband.train.checkpoint import read_trainer_state

    out = {}
    for tuned, start in pairs:
        start_ckpt, start_wall = train_run(root, start, settings)
        tuned.overrides = [*tuned.overrides, f'train.init_from="{start_ckpt}"']
        ckpt, wall = train_run(root, tuned, settings, list(extra))
        states = [read_trainer_state(c) for c in (start_ckpt, ckpt)]
        out[tuned.name] = Tuned(ckpt, wall, start_wall, *(sum(s[k] for s in states) for k in ("tokens",
                                                                                              "compute_tokens")))
    return out


def held_out_chat(root: Path, cfg, n: int) -> Path:
    """The first n conversations of a chat recipe's (`cfg`) validation split, never trained on, written to
    root/held_out.jsonl."""
    from itertools import islice

    from fullband.data.chat.arithmetic import write_chat_jsonl
    from fullband.data.chat.sources import chat_conversations

    data_file = root / "held_out.jsonl"
    conversations = islice(chat_conversations(cfg.data.corpus, "val", cfg.data.val_percent), n)
    write_chat_jsonl([{"messages": [{"role": m.role, "content": m.content} for m in c]} for c in conversations],
                     data_file)
    return data_file


def rl_run(root: Path, run: Run, extra: list[str] | None = None, settings: Settings | None = None
           ) -> tuple[Path, float]:
    """`fullband rl` (or reuse / resume) for a run whose config is an [rl] recipe, under root/<name>; returns the
    final checkpoint and the wall time spent. `settings` gives its seed (rl.seed)."""
    from fullband.rl.run import load_rl_recipe, rl_train

    run_dir = root / run.name
    seeded = settings.seeded("rl") if settings is not None else []
    recipe = load_rl_recipe(run.config, [*run.overrides, *(extra or []), *seeded, f'rl.run_dir="{run_dir}"'])
    return _reused(run, run_dir, recipe.rl.steps, lambda resume: rl_train(recipe, resume=resume))


def _reused(run: Run, run_dir: Path, steps: int, start: Callable[[Path | None], object]) -> tuple[Path, float]:
    """The run's final checkpoint, after start(resume) when it has not reached `steps` (resume: run_dir when it
    was begun, with or without a checkpoint), and the wall time its training took (kept in wall.json)."""
    from fullband.train.checkpoint import list_checkpoints, read_trainer_state
    from fullband.train.rundir import RUN_FILE

    done = list_checkpoints(run_dir)
    t0 = time.perf_counter()
    if not (done and read_trainer_state(done[-1])["step"] >= steps):
        print(f"== training {run.name}: {' '.join(run.overrides)}", flush=True)
        started = bool(done) or (run_dir / RUN_FILE).is_file()
        start(run_dir if started else None)
    wall = time.perf_counter() - t0
    meta = run_dir / "wall.json"
    if wall > 5 or not meta.exists():
        import torch

        replace_file(meta, json.dumps({"train_seconds": wall, "threads": torch.get_num_threads()}))
    return list_checkpoints(run_dir)[-1], json.loads(meta.read_text())["train_seconds"]


def kept(path: Path, key: dict, checkpoint: Path | None, compute: Callable[[], dict], *,
         valid: Callable[[dict], bool] | None = None, save: bool = True) -> dict:
    """An evaluation kept beside the report at `path`: reused while it holds every field of `key` with its value
    (and `valid`, a report's further conditions, holds) and was computed from the checkpoint's weights as they are now
    (their size and modification time, recorded with it; or there is no checkpoint, or its weights are gone: a run
    reused from its record); else compute()'s result, kept there as {**key, **result} (save=False: compute() writes
    `path` itself, as fullband eval does, and the weights' stamp is added to it)."""
    from fullband.files import read_json

    old = read_json(path)
    weights = checkpoint / "model.safetensors" if checkpoint is not None else None
    stamp = _stamp(weights) if weights is not None and weights.is_file() else None
    if (old and (stamp is None or old.get("weights") == stamp) and all(old.get(k) == v for k, v in key.items())
            and (valid is None or valid(old))):
        return old
    result = compute()
    if save:
        result = {**key, **result, **({"weights": stamp} if stamp else {})}
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, json.dumps(result))
    elif stamp is not None and (written := read_json(path)):
        replace_file(path, json.dumps({**written, "weights": stamp}))
    return result


def _stamp(weights: Path) -> str:
    """The weights' identity for a kept evaluation: a retrained or rewritten checkpoint at the same path differs."""
    st = weights.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def run_threads(run_dir: Path) -> int | None:
    """The CPU threads a finished run under run_dir trained with (None: not recorded)."""
    meta = run_dir / "wall.json"
    return json.loads(meta.read_text()).get("threads") if meta.is_file() else None


COMMANDS = ("Commands (each run also gets `--set log.run_dir=runs/repro/<experiment>/<run>` and "
            "`--set log.eval_every=0`):")


def saved_figure(fig, figs: Path, png: str, alt: str) -> list[str]:
    """Write the report's figure to figs/png (figs: the experiment's folder beside its report); returns the report's
    figure line and the header of its command list."""
    save_figure(fig, figs / png)
    return [f"![{alt}]({figs.name}/{png})", "", COMMANDS, ""]


def paired(a, b) -> tuple[float, float]:
    """Mean and standard error of the item-by-item differences a - b (s.e. nan under two items)."""
    import numpy as np

    from fullband.eval.chat import _mean_se

    return _mean_se(np.subtract(a, b, dtype=np.float64))


def verdict(diff: float, se: float, up: str = "higher", down: str = "lower") -> str:
    """A paired difference in words: its direction and size in standard errors, or none shown."""
    if not shown(diff, se):
        return "within 2 standard errors, no difference shown"
    return (up if diff > 0 else down) + (f", {abs(diff) / se:.1f} standard errors" if se > 0 else "")


def config_line(run: Run, *extra: str) -> str:
    """The `fullband train` command of a run: each key set once, at its last place with its last value (a later
    override of a key replaces an earlier one, as the config loader reads them)."""
    last: dict[str, str] = {}
    for o in [*run.overrides, *extra]:
        key = o.split("=", 1)[0].strip()
        last.pop(key, None)  # re-inserted: the key's place is its last one
        last[key] = o
    sets = " ".join(f"--set '{o}'" if " " in o or "{" in o else f"--set {o}" for o in last.values())
    return f"`fullband train {run.config or BASE}{' ' + sets if sets else ''}`"


def val_batches(checkpoint: Path, windows: int = 128, seq_len: int = 256, batch: int = 16, *,
                corpus: str | None = None):
    """The first `windows` held-out windows of the checkpoint's run (its corpus's validation split; `corpus`: that
    corpus's split alone, e.g. one entry of a data.shares mix), in batches."""
    from fullband.folder import read_config
    from fullband.data.tokenizer import load_tokenizer
    from fullband.eval.commands import held_out_stream, window_batches

    seq_len = min(seq_len, read_config(checkpoint).max_seq_len)
    stream = held_out_stream(checkpoint, load_tokenizer(checkpoint), corpus=corpus, val_percent=None)
    return list(window_batches(stream, seq_len, windows, batch))

