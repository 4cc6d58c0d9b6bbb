"""The manual's shell blocks, as a new user runs them: the ```bash blocks of README.md and of every page of the
documentation site (docs/, in mkdocs.yml's nav order), read as one walk-through. Every `fullband` command parses;
every checkpoint a command reads is one an earlier step writes with the manual's own settings; and the walk-through
runs in order in a fresh folder, with small settings (the demo --quick, two training steps, a few windows), where
nothing is missing and nothing is refused. A command the manual shows twice runs once. ```console and ```text
blocks are shown, not run (docs/contributing/docs.md)."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from fullband.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER = re.compile(r"\b(CKPT|DIR|TASKS|OUT|LLAMA_FOLDER)\b|path/to/|data/\*\*|prompts\.jsonl|DIR_WITH")


def manual_pages() -> list[Path]:
    """README.md, then the site's pages in mkdocs.yml's nav order (its home page, docs/index.md, is the README)."""
    nav = re.findall(r"^\s*-\s+(?:[^:\n]+:\s+)?([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    return [ROOT / "README.md", *(ROOT / "docs" / page for page in nav if page != "index.md")]


def shell_lines(text: str) -> list[list[str]]:
    """Each command line of a page's ```bash blocks, in order, split as a shell splits it (comments dropped,
    continuation lines joined); a block indented in a list counts too."""
    lines = []
    for block in re.findall(r"^[ \t]*```bash\n(.*?)^[ \t]*```", text, re.S | re.M):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            pending += line + "\n"
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:  # a quote that closes on a later line
                continue
            pending = ""
            if words:
                lines.append(words)
    return lines


def manual_commands() -> list[tuple[str, list[str]]]:
    """(page, command) for each command line of the manual's ```bash blocks, in reading order; a command shown
    again on a later page (the same words) is listed once, where it first appears."""
    seen, found = set(), []
    for page in manual_pages():
        for words in shell_lines(page.read_text(encoding="utf-8")):
            if tuple(words) not in seen:
                seen.add(tuple(words))
                found.append((str(page.relative_to(ROOT)), words))
    return found


def fullband_args(words: list[str]) -> list[str] | None:
    """The arguments of a `fullband ...` command (also `.venv/bin/fullband`, `make demo`), else None."""
    if words[0].endswith("fullband"):
        return words[1:]
    return ["demo"] if words == ["make", "demo"] else None


def test_every_fullband_command_in_the_manual_parses():
    parser = build_parser()
    seen = 0
    for page, words in manual_commands():
        args = fullband_args(words)
        if args is None:
            continue
        try:
            parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"{page}: command does not parse: {shlex.join(words)}")
        seen += 1
    assert seen > 20


def writes(args: list[str]) -> list[Path]:
    """The checkpoints a command writes with the manual's settings (the last step of each run it trains)."""
    from fullband.demo import CODE_STEPS
    from fullband.train.config import load_run_config

    if args[:1] == ["demo"]:
        return [Path("runs/demo/code") / f"step_{CODE_STEPS:06d}"]
    if args[:1] == ["train"] and "--resume" not in args:
        sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
        cfg = load_run_config(ROOT / args[1], sets)
        return [Path(cfg.log.run_dir) / f"step_{cfg.train.steps:06d}"]
    if args[:1] == ["rl"] and "--resume" not in args:
        from fullband.rl.run import load_rl_recipe

        rl = load_rl_recipe(ROOT / args[1]).rl
        return [Path(rl.run_dir) / f"step_{rl.steps:06d}"]
    return []


def test_every_checkpoint_the_manual_reads_is_written_before_it():
    """`--checkpoint runs/X/step_N` (and convert's source, lm-eval's checkpoint=) names a step an earlier command
    (on its page or an earlier one) writes: a step the manual's own settings never reach is the first thing a new
    user trips on."""
    written: set[Path] = set()
    for page, words in manual_commands():
        args = fullband_args(words) or []
        text = " ".join(words)
        for ref in re.findall(r"runs/[\w./-]*step_\d{6}", text):
            assert Path(ref) in written, f"{page}: {text!r} reads {ref}, which no command before it writes; " \
                                         f"written: {sorted(map(str, written))}"
        written.update(writes(args))
    for recipe in ("sft-tiny", "rl-tiny"):
        init_from = re.search(r'init_from = "([^"]+)"', (ROOT / "configs" / f"{recipe}.toml").read_text()).group(1)
        assert Path(init_from) in written, f"configs/{recipe}.toml starts from {init_from}, which no manual step writes"


SMALL = {  # small settings per command: what the walk-through appends (or, for the demo, runs instead)
    "demo": ["--quick"],
    "train": ["--set", "train.steps=2", "--set", "train.warmup_steps=1", "--set", "log.ckpt_every=2",
              "--set", "log.eval_every=0", "--set", "log.eval_windows=2", "--set", "train.global_batch_tokens=2048",
              "--set", "train.micro_batch=4"],
    "chat": None,  # interactive: tests/test_chat_cli.py drives it in a terminal
    "reproduce": None,  # hours of training: tests/test_eval.py and others run each experiment small
    "bench": None,  # minutes of timing: tests/test_cli.py runs a smoke test
    "serve": None,  # vLLM's server: tests/test_vllm.py
    "eval loss": ["--windows", "4", "--seq-len", "32", "--batch-size", "4"],
    "eval stability": ["--windows", "2", "--seq-len", "16", "--ks", "1", "2", "3"],
    "eval chat": ["--limit", "3", "--max-new-tokens", "8"],
    "generate": ["--max-new-tokens", "8"],
    "rl": ["--set", "rl.steps=2", "--set", "rl.eval_every=0", "--set", "rl.eval_prompts=2", "--set", "rl.group=2",
           "--set", "rl.prompts_per_step=2", "--set", "rl.max_new_tokens=8", "--set", "rl.ckpt_every=2"],
}


def _small(args: list[str]) -> list[str] | None:
    key = " ".join(args[:2]) if args[0] == "eval" else args[0]
    if key not in SMALL:
        return args
    extra = SMALL[key]
    return None if extra is None else [*args, *extra]


def _latest(ref: str) -> str:
    """A checkpoint the small walk-through wrote in place of the manual's (same run, fewer steps)."""
    path = Path(ref)
    if path.exists() or not re.fullmatch(r"step_\d{6}", path.name):
        return ref
    found = sorted(path.parent.glob("step_*"))
    return str(found[-1]) if found else ref


def test_the_manual_walk_through_runs_in_order(tmp_path, monkeypatch, corpus, cache):
    """In a fresh folder: every runnable `fullband` command of the manual (README.md, then the site's pages), in
    order, small, each once; each exits 0."""
    from fullband import demo

    monkeypatch.chdir(tmp_path)
    # the demo's --quick, smaller still (tests/test_train.py runs --quick as it is): 4 race steps, 4 code windows
    monkeypatch.setitem(demo.QUICK, "race", ["train.steps=4", "train.warmup_steps=1"])
    monkeypatch.setitem(demo.QUICK, "code", [*demo.QUICK["code"], "train.global_batch_tokens=1024",
                                             "train.micro_batch=4"])
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    for name in ("tiny", "demo-parity", "sft-tiny", "small"):  # small data, and the test's own token cache
        recipe = tmp_path / "configs" / f"{name}.toml"
        text = recipe.read_text().replace('corpus = "stdlib"', f'corpus = "{corpus}"')
        recipe.write_text(text.replace("[data]\n", f'[data]\ncache_dir = "{cache}"\n', 1))
    ran = []
    for page, words in manual_commands():
        args = fullband_args(words)
        text = " ".join(words)
        if args is None or PLACEHOLDER.search(text) or "torchrun" in text or "tokenizer" in args[:1]:
            continue
        args = _small([_latest(a) for a in args])
        if args is None:
            continue
        if args[0] == "train" and "configs/small.toml" in args:
            continue  # its BPE tokenizer trains on the corpus: tests/test_data.py covers it
        if "smollm2" in text:
            continue
        if "llamacpp" in args:
            continue  # .venv-llama's engine: tests/test_llamacpp.py runs it  # the real model's steps: each is run, and checked against transformers, by test_real_model.py
        if args[0] in ("train", "rl"):  # a warm start from a manual's checkpoint: the small walk-through's
            found = re.search(r'init_from = "([^"]+)"', (tmp_path / args[1]).read_text())
            if found:
                args += ["--set", f'{args[0]}.init_from="{_latest(found.group(1))}"']
        assert main(args) == 0, f"{page}: step failed: {shlex.join(args)}"
        ran.append(args[0] if args[0] != "eval" else " ".join(args[:2]))
    assert {"demo", "train", "rl", "eval chat", "doctor", "eval loss", "generate", "init", "convert"} <= set(ran), ran
