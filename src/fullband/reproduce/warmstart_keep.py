"""`fullband reproduce warmstart-keep`: the long warm start with a replay, to keep what the pretrained model does in
chat while its fed reads learn. The pretrained model's own replies to a set of chat prompts (`fullband generate
--replies-to`, sampled at temperature 1: arithmetic word problems none of the report's questions, and questions about
the standard library's functions) are a corpus of conversations mixed into the training corpus at a share of the
windows (`data.shares`), with the anchor (`train.anchor`: every pass drawn towards the pretrained model's STANDARD read)
held over the run. Otherwise the shipped recipe trained long, invocation by invocation, and reported as `fullband
reproduce warmstart-long` reports it (its curve and reads on the training corpus's held-out windows, comparable with
that run's)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from fullband.errors import InputError
from fullband.reproduce import warmstart, warmstart_long as long
from fullband.reproduce.runner import Experiment, Run, Settings
from fullband.validate import integer, number

NAME = "keep-replay"
SHARE = 0.2  # of the training windows, the replayed conversations'
ANCHOR = 1.0  # train.anchor, held over the run (anchor_until far past its end: the weight barely falls)
ANCHOR_UNTIL = 100.0
PROMPTS_FILE, REPLAY_FILE = "replay-prompts.jsonl", "replay.jsonl"
PROMPT_SEED = 4242  # the replay's arithmetic questions; the report's are drawn with warmstart's seed, and dropped here
FORMS = ("What does Python's `{}` do?", "Explain `{}` in Python with a short example.",
         "When would I use `{}` in Python?")


@dataclass(frozen=True)
class Replay:
    arithmetic: int  # word problems
    python: int  # questions about the standard library's functions
    new_tokens: int  # at most, a reply
    batch: int = 20


REPLAYS = {"micro": Replay(2, 2, 8, 4), "cpu": Replay(200, 100, 128)}
MAX_REPLIES = 100_000


def replay_spec(scale: str, replies: int | None) -> Replay:
    """The scale's replay, or `replies` prompts in its proportions: a third (at most one per documented function)
    questions about the standard library, the rest word problems."""
    spec = REPLAYS[scale]
    if replies is None:
        return spec
    python = min(replies // 3, len(_documented_functions()))
    return Replay(replies - python, python, spec.new_tokens, spec.batch)


def runs() -> list[Run]:
    shipped = long.runs()[0]
    return [Run(NAME, shipped.overrides, shipped.config)]


def check(*, scale: str = "cpu", model: str = "", budget: float = 90.0, corpus: str = "stdlib",
          replies: int | None = None, cooldown: int | None = None, cooldown_replay: float | None = None,
          cooldown_anchor: float | None = None) -> None:
    long.check(scale=scale, model=model, budget=budget, cooldown=cooldown)
    if replies is not None:
        integer("--replies", replies, 2, below=MAX_REPLIES + 1, error=InputError)
    if cooldown_replay is not None:
        number("--cooldown-replay", cooldown_replay, low=0, high=1, low_open=True, high_open=True, error=InputError)
    if cooldown_anchor is not None:
        if cooldown_replay is None:
            raise InputError(f"--cooldown-anchor {cooldown_anchor:g} weighs the anchor of a cooldown on another mix; "
                             "accepted: with --cooldown-replay SHARE (the default cooldown keeps the run's recipe)")
        number("--cooldown-anchor", cooldown_anchor, low=0, error=InputError)
    if not isinstance(corpus, str) or not corpus.strip():
        raise InputError(f"corpus {corpus!r}: accepted: a corpus spec (data.corpus), a name or a path")


def report(runs: list[Run], root: Path, figs: Path, settings: Settings, *, scale: str = "cpu", model: str = "",
           budget: float = 90.0, corpus: str = "stdlib", replies: int | None = None,
           cooldown: int | None = None, cooldown_replay: float | None = None,
           cooldown_anchor: float | None = None) -> list[str]:
    """`corpus` (tests): the training corpus the replay is mixed into; `replies`: the count of the replay's prompts
    (default the scale's); `budget` and `cooldown` as warmstart-long's; `cooldown_replay`: the cooldown is a run of
    its own on a mix with the replay at this share, its anchor (`cooldown_anchor`, default COOL_ANCHOR) held to the
    pretrained model (settled); None: the branch of the run's own recipe."""
    from fullband.gguf_file import SHIPPED

    check(scale=scale, model=model, budget=budget, corpus=corpus, replies=replies, cooldown=cooldown,
          cooldown_replay=cooldown_replay, cooldown_anchor=cooldown_anchor)
    long.need_checkpoint(root / runs[0].name, budget)  # before the replay is sampled
    sc, model = long.SCALES[scale], model or SHIPPED
    spec = replay_spec(scale, replies)
    replay = written_replies(root, warmstart._base(root, model), spec)
    held = math.ceil(sc.eval_windows / (1 - SHARE))  # the training corpus keeps the long run's count of windows
    extra = [*long._overrides(sc, model, budget), f"data.corpus={json.dumps([corpus, str(replay)])}",
             f"data.shares=[{1 - SHARE:g}, {SHARE:g}]", f"train.anchor={ANCHOR:g}",
             f"train.anchor_until={ANCHOR_UNTIL:g}", f"log.eval_windows={held}"]
    recipe = (f"The shipped warm-start recipe with a replay and the anchor: the pretrained model's own replies to "
              f"{spec.arithmetic + spec.python:,} chat prompts (`{REPLAY_FILE}` beside the run) "
              f"mixed in at {SHARE:.0%} of the windows (`data.shares`), `train.anchor = {ANCHOR:g}` held over the "
              "run, the rest as shipped")
    cool = long.cooled_steps(scale, cooldown)
    cooler = None
    if cooldown_replay is not None:
        weight = COOL_ANCHOR if cooldown_anchor is None else cooldown_anchor
        cooler = lambda ckpt: settled(root, runs[0], ckpt, sc, model, *cool, cooldown_replay, weight)  # noqa: E731
    return long.trained_long(runs[0], root, figs, settings, sc, model, budget, extra, cool, recipe, curve_corpus=corpus,
                             cooler=cooler)


COOL_ANCHOR = 2.0  # --cooldown-anchor's default: the anchor's weight in a cooldown on another mix


def settled(root: Path, run: Run, ckpt: Path, sc, model: str, steps: int, tag: str, share: float,
            anchor: float) -> dict:
    """The latest checkpoint `ckpt` (step S) cooled over `steps` steps on another mix: a run of its own that starts
    from its weights (train.init_from; the optimizer's state fresh, with the recipe's warm-up) and reads its tokenizer,
    its model's settings kept, the replay at `share` of the windows and the anchor at `anchor` held to the pretrained
    `model` (train.anchor_from: the run's start would be the fed checkpoint itself); the learning rate falls linearly to
    0 over its steps, and each weight that falls over the long run (train.X_until) goes on from its value at S to 0
    where the long run's would reach it. The checkpoint's files are kept (hard links) in a folder beside it,
    <name>-start, which the long run's later invocations do not remove. -> as _cooled returns, with "how" and "made"
    for the report; run None (and "why") while S is inside the blend curriculum. Its folder:
    <run>-cooled<tag>-replay<share>-anchor<anchor>-<S>."""
    from fullband.errors import ConfigError
    from fullband.files import Kind, atomic_folder, read_json_file
    from fullband.train.checkpoint import read_trainer_state
    from fullband.train.config import TrainConfig
    from fullband.train.rundir import RUN_FILE
    from fullband.train.schedule import blend_end, falling_end

    at = read_trainer_state(ckpt)
    start = at["step"]
    saved = read_json_file(ckpt.parent / RUN_FILE, "the long run's settings", error=ConfigError)
    train, total = saved["train"], saved["train"]["steps"]
    if blend_end(total, train.get("blend_until", 0.0)) > start:
        return {"run": None, "steps": steps, "why": f"the latest checkpoint (step {start:,}) is inside the blend "
                                                    "curriculum, which a cooldown on another mix cannot end"}
    name = f"{run.name}-{long.COOLED}{tag}-replay{share:g}-anchor{anchor:g}-{start}"
    origin = root / f"{name}-start"
    if not origin.exists():
        with atomic_folder(origin, Kind("checkpoint copy", frozenset()), action="keep the cooldown's start") as tmp:
            long.linked_files(ckpt, tmp)
    falling = []
    for key in ("distill", "block_match"):  # anchor: set anew; blend: ended
        weight, until = train.get(key, 0.0), train.get(f"{key}_until", getattr(TrainConfig, f"{key}_until"))
        end = falling_end(total, until)
        left = max(end - start, 0) if weight > 0 else 0
        falling += ([f"train.{key}={round(weight * left / end, 6)!r}", f"train.{key}_until={round(left / steps, 6)!r}"]
                    if left else [f"train.{key}=0.0"])
    sets = [*(f"model.{k}={json.dumps(v)}" for k, v in saved["model"].items() if v is not None),
            f"train.init_from={json.dumps(str(origin))}", f"data.tokenizer={json.dumps(str(origin))}",
            f"data.shares=[{1 - share:g}, {share:g}]", f"log.eval_windows={math.ceil(sc.eval_windows / (1 - share))}",
            f"train.anchor={anchor:g}", f"train.anchor_until={ANCHOR_UNTIL:g}",
            f"train.anchor_from={json.dumps(model)}",
            f"train.steps={steps}", "train.cooldown_fraction=1.0", "train.blend_until=0.0", *falling,
            "train.stop_after_minutes=0.0"]
    how = (f"a run of its own from the checkpoint's weights (`train.init_from`, the optimizer's state fresh) on "
           f"another mix: the replay at **{share:.0%}** of the windows and the anchor at **{anchor:g}** held to the "
           "pretrained model (`train.anchor_from`)")
    made = (f"The cooled run: it starts from the long run's weights at step {start:,}, kept in `{origin.name}` beside "
            "it (`--set` settings after the long run's):")
    return {"run": Run(name, run.overrides, run.config), "sets": sets, "steps": steps, "how": how, "made": made,
            "before": at["tokens"]}


def prompts(spec: Replay) -> list[dict]:
    """The replay's prompts: `spec.arithmetic` word problems (none of the report's held-out questions) and
    `spec.python` questions about the standard library's documented functions, in a fixed order."""
    import random

    from fullband.data.chat.arithmetic import arithmetic_chats

    def asked(chats):
        return [c["messages"][0]["content"] for c in chats]

    held = set(asked(warmstart.held_out_chats(256)))
    extra = spec.arithmetic + len(held)  # drawn beyond the count: the held-out ones are dropped
    arith = [q for q in asked(arithmetic_chats(extra, seed=PROMPT_SEED, follow_up=0.0, styles=("partial",)))
             if q not in held][: spec.arithmetic]
    rng = random.Random(0)
    names = _documented_functions()
    rng.shuffle(names)
    python = [rng.choice(FORMS).format(n) for n in names[: spec.python]]
    return [{"messages": [{"role": "user", "content": q}]} for q in arith + python]


def _documented_functions() -> list[str]:
    """module.name of every public callable with a docstring in a few standard library modules, sorted."""
    import importlib
    import inspect

    names = []
    for module in ("os", "string", "textwrap", "json", "collections", "itertools", "functools", "re", "pathlib",
                   "shutil", "math", "random"):
        mod = importlib.import_module(module)
        names += [f"{module}.{n}" for n, v in vars(mod).items()
                  if not n.startswith("_") and callable(v) and inspect.getdoc(v)]
    return sorted(names)


def written_replies(root: Path, base: Path, spec: Replay) -> Path:
    """root/replay.jsonl: the pretrained model `base`'s replies (STANDARD, temperature 1) to the replay's prompts,
    written once (a rerun reuses it: the run's corpus must not change under it, so a rerun that asks for other
    prompts is refused)."""
    from fullband.files import replace_file

    out, asked = root / REPLAY_FILE, root / PROMPTS_FILE
    wanted = prompts(spec)
    if out.is_file():
        had = [json.loads(line) for line in asked.read_text().splitlines()] if asked.is_file() else None
        if had is not None and had != wanted:
            raise InputError(f"{out} holds the replies to {len(had):,} prompts ({asked}), and this invocation asks for "
                             f"{len(wanted):,} other ones: the run's corpus must not change under it; accepted: "
                             f"--replies {len(had)} to go on with this run, or another --root for a new one")
        return out
    import torch

    from fullband.data.tokenizer import load_tokenizer
    from fullband.decode.replies import write_replies
    from fullband.model.decoder import FullbandLM
    from fullband.model.mode import DecodeMode

    replace_file(asked, "".join(json.dumps(p) + "\n" for p in wanted))
    model = FullbandLM.load(base).eval()
    with torch.no_grad():
        done = write_replies(model, load_tokenizer(base), str(asked), out, mode=DecodeMode("standard"),
                             max_new_tokens=spec.new_tokens, temperature=1.0, seed=0, batch_size=spec.batch)
    print(f"replay: {done['conversations']} conversations ({done['tokens']:,} tokens, {done['stopped']} ended at a "
          f"stop token, {done['empty']} empty left out) -> {out}", flush=True)
    return out


EXPERIMENT = Experiment("warmstart-keep", runs, report, check, seeds=1)  # 90 min an invocation on 2 cores
