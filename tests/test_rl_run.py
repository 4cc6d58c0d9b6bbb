"""`fullband rl`: a run end to end, a resume after SIGKILL that equals the uninterrupted run bit for bit, and
one-line errors for bad recipes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_model
from fullband import ByteTokenizer

CLI = [sys.executable, "-m", "fullband.cli"]
RECIPE = """[rl]
init_from = "{model}"
data = "arithmetic:300"
group = 2
prompts_per_step = 2
max_new_tokens = 8
steps = {steps}
eval_every = 3
eval_prompts = 4
ckpt_every = 2
run_dir = "{run}"
lr = 1e-3
reward = "{reward}"
"""
# a learnable reward: the share of reply characters that are digits
REWARD = ("def digits(prompt, response, example):\n"
          "    return sum(c.isdigit() for c in response) / max(1, len(response))\n")


def run(*args: str, timeout: float = 120, threads: str = "1") -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": threads})


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    chat = ByteTokenizer(chat=True)
    return tiny_model(vocab_size=chat.vocab_size, max_seq_len=256).save(tmp_path_factory.mktemp("rl") / "m",
                                                                        tokenizer=chat)


def recipe(tmp_path: Path, model: Path, run_dir: str, *, steps: int = 6, extra: str = "") -> Path:
    (tmp_path / "reward.py").write_text(REWARD)
    path = tmp_path / f"{run_dir}.toml"
    path.write_text(RECIPE.format(model=model, steps=steps, run=tmp_path / run_dir,
                                  reward=f"{tmp_path / 'reward.py'}:digits") + extra)
    return path


def test_a_run_logs_evaluates_checkpoints_and_plots(tmp_path, model):
    done = run("rl", str(recipe(tmp_path, model, "a")))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]  # step 0: the starting model, evaluated
    assert all(0 <= r["reward"] <= 1 and 1 <= r["length"] <= 8 and r["tokens"] > 0 for r in rows[1:])
    assert [r["step"] for r in rows if "eval" in r] == [0, 3, 6] and "held-out reward" in done.stdout
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["metrics.jsonl", "rl.png", "run.json",
                                                                   "step_000002", "step_000004", "step_000006"]
    assert run("doctor", str(tmp_path / "a" / "step_000006")).returncode == 0  # a checkpoint like train's


def test_a_resume_after_sigkill_equals_the_uninterrupted_run(tmp_path, model):
    """Run with on-policy distillation towards the frozen start, the STANDARD read held (rl.hold; the resumed process
    builds the reference again from rl.init_from; the loop, its checkpoints and the clipped loss are GRPO's)."""
    extra = 'algorithm = "distill"\nhold = 0.5\n'
    assert run("rl", str(recipe(tmp_path, model, "whole", extra=extra))).returncode == 0
    config = recipe(tmp_path, model, "cut", extra=extra)
    proc = subprocess.Popen([*CLI, "rl", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not (tmp_path / "cut" / "step_000002").is_dir() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    done = run("rl", str(config), "--resume", str(tmp_path / "cut"))
    assert done.returncode == 0, done.stderr[-2000:]
    a, b = (load_file(tmp_path / name / "step_000006" / "model.safetensors") for name in ("whole", "cut"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [(tmp_path / name / "metrics.jsonl").read_text().splitlines() for name in ("whole", "cut")]
    timing = ("seconds", "time", "tok_per_s")
    strip = [[{k: v for k, v in json.loads(line).items() if k not in timing} for line in r] for r in rows]
    assert strip[0] == strip[1]
    assert "teacher_kl" in json.loads(rows[0][1]) and json.loads(rows[0][2])["hold_kl"] > 0
    # the run's thread count is part of the run: recorded at its start, another one refused on resume
    assert json.loads((tmp_path / "cut" / "run.json").read_text())["rl"]["threads"] == 1
    other = run("rl", str(config), "--resume", str(tmp_path / "cut"), threads="2")
    assert other.returncode == 2 and "OMP_NUM_THREADS=2, but the run started with 1 thread(s) (rl.threads" in other.stderr


def test_sigterm_stops_after_the_step_with_a_checkpoint(tmp_path, model):
    """SIGTERM (a scheduler's preemption, torchrun's shutdown) to a running `fullband rl`: the step it lands in
    finishes, its checkpoint is written even where ckpt_every would not write one, and the process exits with the
    shell's status for SIGTERM (143). (A resume from such a checkpoint equals the run that never stopped:
    tests/test_train.py, for both signals.)"""
    config = recipe(tmp_path, model, "cut")
    proc = subprocess.Popen([*CLI, "rl", str(config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not (tmp_path / "cut" / "step_000002").is_dir() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert "SIGTERM: stopping after this step, with a checkpoint (SIGTERM again stops now, without one)" in err
    kept = sorted(p.name for p in (tmp_path / "cut").glob("step_*"))
    assert kept[0] == "step_000002" and kept[-1] in {"step_000003", "step_000004", "step_000005"}, kept
    assert f"interrupted after step {int(kept[-1][5:])}: checkpoint {tmp_path / 'cut' / kept[-1]}" in out + err
    assert run("doctor", str(tmp_path / "cut" / kept[-1])).returncode == 0


@pytest.mark.parametrize("override,words", [
    ("rl.group=1", "rl.group=1 is invalid"),
    ("rl.teacher='self'", "rl.teacher='self' is unknown; accepted: standard, reference"),
    ("rl.logprob='jacobi'", "logprob path 'jacobi' is unknown"),
    ("rl.reward='no_such_module:f'", "cannot import 'no_such_module'"),
    ("rl.max_new_tokens=250", "leaves room for rl.max_new_tokens=250"),
    ("rl.mode='exact'", "cannot be trained on-policy"),
    ("rl.grup=2", "unknown key 'rl.grup' (did you mean 'group'?)"),
    ("rl.device='tpu'", "rl.device='tpu' is invalid; accepted: 'cpu', 'cuda' or 'cuda:N'"),
    pytest.param("rl.device='cuda'", "rl.device='cuda': CUDA is not available on this machine; accepted: cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    ("rl.group=100000000", "an RL step of 200,000,000 rows (rl.prompts_per_step x rl.group) of up to"),
    ("rl.data='{prompts}'", "no 'answer' key, and no assistant turn whose final 'Answer: ...' could be the reference"),
])
def test_bad_recipes_are_one_line(tmp_path, model, override, words, capsys):
    from fullband.cli import main

    (tmp_path / "prompts.jsonl").write_text('{"messages": [{"role": "user", "content": "2 + 2?"}]}\n')
    code = main(["rl", str(recipe(tmp_path, model, "bad")), "--set", override.format(prompts=tmp_path / "prompts.jsonl")])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if "cores are busy" not in line]
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert words in lines[0], lines[0]
    assert not (tmp_path / "bad").exists()  # nothing of the run was written


def test_prompt_files_with_an_answer_field_are_split_like_training(tmp_path):
    from fullband.data.chat.sources import chat_conversations
    from fullband.errors import DataError
    from fullband.eval.chat import held_out_items

    lines = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": i + 1} for i in range(40)]
    lines.append({"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "four"}],
                  "answer": " 4 "})  # a reply after the last user turn is left out of the prompt
    lines.append({"messages": [{"role": "user", "content": "3 + 3?"}, {"role": "assistant",
                                                                      "content": "So. Answer: 6"}]})
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    whole = held_out_items(data)  # eval chat: a file is read whole
    assert len(whole) == 42 and whole[0][1] == "1" and [m.role for m in whole[0][0]] == ["user"]
    assert [m.content for m in whole[40][0]] == ["2 + 2?"] and whole[40][1] == "4" and whole[41][1] == "6"
    train, val = (held_out_items(data, split=s, val_percent=20) for s in ("train", "val"))
    assert len(train) + len(val) == 42 and val and sorted(map(str, train + val)) == sorted(map(str, whole))
    # the split is the one training uses: an SFT run on the corpus holds out the conversations RL evaluates on
    held = chat_conversations("arithmetic:300", "val", 20)
    assert [p for p, _ in held_out_items("arithmetic:300", split="val", val_percent=20)] == \
        [c[: max(i for i, m in enumerate(c) if m.role == "assistant")] for c in held]
    for bad, words in [({"messages": [{"role": "user", "content": "x"}], "answer": True}, "'answer' must be"),
                       ({"messages": [{"role": "system", "content": "x"}], "answer": 1}, "no user turn to answer"),
                       ({"messages": "x", "answer": 1}, "'messages' must be a list")]:
        data.write_text(json.dumps(bad) + "\n")
        with pytest.raises(DataError, match=words):
            held_out_items(data)


def test_rejection_sft_on_a_prompt_file_runs_from_the_cli(tmp_path, model, capsys):
    from fullband.cli import main

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i} + {i}?"}], "answer": 2 * i})
                            + "\n" for i in range(60)))
    code = main(["rl", str(recipe(tmp_path, model, "rs", steps=2)), "--set", f"rl.data='{data}'", "--set",
                 "rl.algorithm='rejection-sft'", "--set", "rl.accept=0.01", "--set", "rl.val_percent=20"])
    assert code == 0, capsys.readouterr().err[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "rs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all(0 <= r["kept"] <= 4 for r in rows[1:])
    assert rows[0]["eval"]["accuracy"] == 0.0  # an untrained model answers none of the held-out sums


def test_a_step_whose_rewards_are_all_equal_is_said(model, tmp_path, capsys):
    """A reward the model never earns (the tiny model never writes 'Answer: N'): every group's rewards are equal,
    every advantage is 0, and each such step says so in one line; rejection-sft says it kept nothing."""
    from fullband.rl.run import load_rl_recipe, metric_rows, rl_train

    path = tmp_path / "flat.toml"
    path.write_text(RECIPE.format(model=model, steps=2, run=tmp_path / "flat", reward="answer"))
    rl_train(load_rl_recipe(path), progress=False)
    said = [line for line in capsys.readouterr().out.splitlines() if "changed nothing" in line]
    assert [line.split(":")[0] for line in said] == ["step 1", "step 2"]
    assert "every reply to each of the 2 prompts scored the same (mean reward 0)" in said[0]
    assert all(row["flat_groups"] == 2 for row in metric_rows(tmp_path / "flat" / "metrics.jsonl") if "reward" in row)
    rl_train(load_rl_recipe(path, ["rl.algorithm=rejection-sft", f"rl.run_dir={tmp_path / 'sft'}"]), progress=False)
    assert "step 1: no reply reached rl.accept=1 (mean reward 0), so this step trained on nothing" in \
        capsys.readouterr().out


def test_contains_reward_finds_the_answer_as_a_word():
    from fullband.rl.rewards import load_reward

    contains = load_reward("contains")
    assert contains("q", "The capital of France is Paris.", {"answer": "Paris"}) == 1.0
    assert contains("q", "paris, of course", {"answer": "Paris"}) == 1.0
    assert contains("q", "Parisian food", {"answer": "Paris"}) == 0.0
    assert contains("q", "It is 12.", {"answer": "2"}) == 0.0 and contains("q", "2 + 3 = 5", {"answer": "5"}) == 1.0


OVERFLOW = ("calls = [0]\n"
            "def huge(prompt, response, example):  # finite rewards whose group sums overflow float64\n"
            "    calls[0] += 1\n"
            "    return 1.7e308 if calls[0] % 2 else 1e308\n")


@pytest.mark.parametrize("override,words", [
    ("rl.reward='{huge}'", "step 1: the rewards (1e+308 to 1.7e+308) overflow their groups' mean or standard "
                           "deviation, so the advantages are not finite; stopped before the update"),
    ("rl.lr=1e30", "step 2: the "),  # step 1's update takes the weights to ~1e30; step 2's loss or update overflows
])
def test_nothing_non_finite_is_written(tmp_path, model, override, words, capsys):
    """An RL step whose rewards overflow the group statistics, or whose update overflows the weights, stops the run
    in one line before anything non-finite is logged or saved; the last good checkpoint stays the newest."""
    from fullband.cli import main

    (tmp_path / "huge.py").write_text(OVERFLOW)
    config = recipe(tmp_path, model, "run")
    code = main(["rl", str(config), "--set", override.format(huge=f"{tmp_path / 'huge.py'}:huge"), "--set",
                 "rl.eval_every=0", "--set", "rl.ckpt_every=1"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1 and words in lines[0] and "Traceback" not in err, err[-2000:]
    saved = sorted(p for p in (tmp_path / "run").iterdir() if p.name.startswith("step_"))
    assert f"Last good checkpoint: {saved[-1] if saved else 'none yet'}" in lines[0]
    for step in saved:  # whatever was written is finite
        assert all(torch.isfinite(t).all() for t in load_file(step / "model.safetensors").values())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [int(p.name[5:]) for p in saved] and all(
        v == v and abs(v) != float("inf") for r in rows for v in r.values() if isinstance(v, float))


def test_a_learning_rate_the_optimizer_cannot_hold_is_refused(tmp_path, model, capsys):
    from fullband.cli import main

    assert main(["rl", str(recipe(tmp_path, model, "run")), "--set", "rl.lr=1e39"]) == 2
    assert "rl.lr=1e+39 is invalid; accepted: 0 < rl.lr <= 3.40282e+38" in capsys.readouterr().err


def test_rl_names_its_own_settings_and_a_train_run_is_not_resumed_as_rl(tmp_path, model, corpus, cache, capsys):
    """fullband rl's messages name rl.run_dir (not train's log.run_dir); --resume of a `fullband train` run says
    what it is and how to resume it."""
    from conftest import write_config

    from fullband.cli import main

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert main(["rl", str(recipe(tmp_path, model, "x")), "--set", f"rl.run_dir='{tmp_path / 'busy'}'"]) == 2
    err = capsys.readouterr().err
    assert "rl.run_dir" in err and "log.run_dir" not in err and (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    trained = write_config(tmp_path, corpus, cache, "trained", steps=2, ckpt_every=2)
    assert main(["train", str(trained)]) == 0
    capsys.readouterr()
    assert main(["rl", str(recipe(tmp_path, model, "x")), "--resume", str(tmp_path / "trained")]) == 2
    err = capsys.readouterr().err
    assert "is a `fullband train` run" in err and f"fullband train RECIPE --resume {tmp_path / 'trained'}" in err


def test_a_run_recorded_before_rl_teacher_resumes_with_its_default():
    """rl.teacher came with on-policy distillation, rl.hold after it: a run.json without them holds the defaults, any
    other value is named."""
    from fullband.rl.run import MUST_MATCH, RLConfig
    from fullband.train.rundir import resume_differences

    now = {"rl": {k: v for k, v in vars(RLConfig(init_from="m")).items()}}
    old = {"rl": {k: v for k, v in now["rl"].items() if k not in ("teacher", "hold")}}
    assert {"rl.teacher", "rl.hold"} <= set(MUST_MATCH) and resume_differences(old, now, MUST_MATCH) == []
    assert resume_differences({"rl": {**now["rl"], "hold": 0.5}}, now, MUST_MATCH) == [
        "rl.hold: run has 0.5, config has 0.0"]
    other = {"rl": {**now["rl"], "teacher": "standard"}}
    assert resume_differences(other, now, MUST_MATCH) == ['rl.teacher: run has "standard", config has "reference"']


def test_the_memory_check_counts_the_reference_and_the_hold_s_logits(monkeypatch):
    """rl.hold reads the starting model and keeps float32 logits at every response token (the start's, the
    policy's, its softmax and gradients): a step that cannot fit them is refused before anything is allocated,
    each part named."""
    from fullband.errors import ConfigError
    from fullband.model.config import ModelConfig
    from fullband.rl.run import RLConfig, check_step_memory

    monkeypatch.setattr("fullband.train.memory.available_memory", lambda device: 1.0)
    cfg = ModelConfig(vocab_size=1000, d_model=32, n_layers=1, n_heads=2, max_seq_len=64)
    with pytest.raises(ConfigError, match=r"reference model .* the hold's logits \(rl.hold\) 0.0 GB") as err:
        check_step_memory(RLConfig(init_from="m", hold=0.5, group=2, prompts_per_step=2, max_new_tokens=8), cfg, 10,
                          "cpu")
    assert "nothing was allocated" in str(err.value)
    with pytest.raises(ConfigError) as err:
        check_step_memory(RLConfig(init_from="m", group=2, prompts_per_step=2, max_new_tokens=8), cfg, 10, "cpu")
    assert "hold" not in str(err.value) and "reference model" not in str(err.value)
