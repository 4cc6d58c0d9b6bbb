"""Serial state tracking (issue 14): the task generators against direct computations, training on a tracking
task, and `eval tracking` (exact prefill vs adaptive prefill to the fixed point, batched vs one by one)."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
import torch

from fullband.data.tracking import (COUNTER_P, QUERY, S5_GENERATORS, TASKS, examples, labels, make_example,
                                    parse_spec, length_sets)
from fullband.errors import ConfigError, InputError


def _direct(task: str, text: str) -> str:
    """The label computed from the text alone, independently of the generator's own bookkeeping."""
    body = text[:-1]
    if task == "parity":
        return "eo"[body.count("1") % 2]
    if task == "counter":
        return str(sum(ord(c) - ord("a") for c in body) % COUNTER_P)
    if task == "s5":
        x = 0
        for g in reversed(body):  # F(0) = g1(g2(...gn(0))): apply the last generator first
            x = S5_GENERATORS[g][x]
        return str(x)
    writes = re.findall(r"([A-H])(\d)", body[:-1])
    return "abcdefghij"[int(dict(writes)[body[-1]])]


@pytest.mark.parametrize("task", TASKS)
def test_labels_are_right_balanced_and_never_in_the_input(task):
    exs = examples(task, 2000, min_length=8, max_length=24, seed=3)
    assert all(_direct(task, e.text) == e.label for e in exs)
    assert all(e.text.endswith(QUERY) and 8 <= e.length <= 24 for e in exs)
    inputs = set("".join(e.text for e in exs))
    assert not inputs & set(labels(task))  # nothing to copy
    counts = Counter(e.label for e in exs)
    assert set(counts) <= set(labels(task))
    expected = len(exs) / len(labels(task))
    assert all(abs(counts[c] - expected) < 0.25 * expected for c in labels(task)), counts
    assert examples(task, 5, max_length=10, seed=3) == examples(task, 5, max_length=10, seed=3)


def test_the_length_split_holds():
    train = examples("parity", 500, max_length=16, seed=0)
    assert max(e.length for e in train) == 16 and min(e.length for e in train) == 1
    sets = length_sets("parity", 16, 50)
    assert list(sets) == [16, 32, 64, 128]
    assert all(e.length == n and len(e.text) == n + 1 for n, exs in sets.items() for e in exs)
    assert parse_spec("s5:12") == ("s5", 12)
    for bad in ("s5", "s5:0", "bogus:4", "parity:x"):
        with pytest.raises(InputError, match="accepted: TASK:L"):
            parse_spec(bad)
    with pytest.raises(InputError, match="task='x' is unknown"):
        make_example("x", 3, __import__("random").Random(0))



# The training data of every task as a run drew it before data.repeat existed (300 examples up to 12 steps, seed 0):
# repeat = 0 must draw exactly these, or a recorded run would no longer be its recipe's
DRAWN = {"parity": "c20840ded42c9176", "counter": "500b4124d16cd658", "s5": "6b7c157a010ffb99",
         "registers": "5634ea4a1a60b465"}


def _digest(exs) -> str:
    import hashlib

    return hashlib.sha256(repr([(e.text, e.label) for e in exs]).encode()).hexdigest()[:16]


@pytest.mark.parametrize("task", TASKS)
def test_repeat_holds_runs_of_one_step_and_zero_draws_as_before(task):
    """data.repeat: each step repeats the one before with that probability (so a symbol's runs grow: the share of
    steps equal to the one before is repeat + (1 - repeat) / alphabet), labels still right; 0 draws as before."""
    assert _digest(examples(task, 300, max_length=12, seed=0)) == DRAWN[task]
    assert _digest(examples(task, 300, max_length=12, seed=0, repeat=0.0)) == DRAWN[task]
    exs = examples(task, 2000, min_length=8, max_length=24, seed=3, repeat=0.5)
    assert all(_direct(task, e.text) == e.label and 8 <= e.length <= 24 for e in exs)
    step = (lambda e: re.findall(r"[A-H]\d", e.text[:-2])) if task == "registers" else (lambda e: list(e.text[:-1]))
    alphabet = {"parity": 2, "counter": COUNTER_P, "s5": 2, "registers": 80}[task]
    for repeat in (0.0, 0.5):
        pairs = [(a, b) for e in examples(task, 2000, min_length=8, max_length=24, seed=3, repeat=repeat)
                 for a, b in zip(step(e), step(e)[1:])]
        same = sum(a == b for a, b in pairs) / len(pairs)
        assert abs(same - (repeat + (1 - repeat) / alphabet)) < 0.02, (repeat, same)
    for bad in (-0.1, 1.0, float("nan"), True):
        with pytest.raises(InputError, match="repeat="):
            examples(task, 3, max_length=4, repeat=bad)


def test_data_repeat_is_a_tracking_setting():
    from fullband.train.config import DataConfig

    assert DataConfig(format="tracking", corpus="parity:8", repeat=0.5).repeat == 0.5
    with pytest.raises(ConfigError, match=r"data.repeat=0.5 shapes a tracking task's inputs; accepted for "
                                          r"data.format='text': 0"):
        DataConfig(repeat=0.5)
    with pytest.raises(ConfigError, match=r"data.repeat=1 is invalid; accepted: "):
        DataConfig(format="tracking", corpus="parity:8", repeat=1)


def test_a_run_recorded_before_data_repeat_resumes_and_another_repeat_is_refused(tmp_path):
    import json

    from fullband.train.config import load_run_config
    from fullband.train.rundir import resume_differences

    (tmp_path / "r.toml").write_text(RECIPE.format(corpus="parity:8", run_dir=tmp_path / "run"))
    now = load_run_config(tmp_path / "r.toml").to_dict()
    old = json.loads(json.dumps(now))
    del old["data"]["repeat"]
    assert resume_differences(old, now) == []
    assert resume_differences({**old, "data": {**old["data"], "repeat": 0.5}}, now) == [
        "data: run has repeat=0.5, config has repeat=0.0"]

# ---------------------------------------------------------------------- training and eval tracking
RECIPE = """
[model]
vocab_size = 259
d_model = 32
n_layers = 2
n_heads = 2
max_seq_len = 128
init_std = 0.05

[data]
format = "tracking"
corpus = "{corpus}"

[train]
steps = 4
seq_len = 64
global_batch_tokens = 512
micro_batch = 4
passes = [{{until = 0.5, probs = {{"1" = 1.0}}}}, {{until = 1.0, probs = {{"3" = 1.0}}}}]
warmup_steps = 1

[log]
run_dir = "{run_dir}"
eval_every = 0
eval_windows = 4
ckpt_every = 0
progress = false
"""


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    from fullband.train.config import load_run_config
    from fullband.train.trainer import train

    root = tmp_path_factory.mktemp("tracking")
    (root / "r.toml").write_text(RECIPE.format(corpus="counter:8", run_dir=root / "run"))
    train(load_run_config(root / "r.toml"))
    return root / "run" / "step_000004"


def test_a_tracking_run_learns_on_the_answer_only(tracked, capsys):
    from fullband.data.chat.templates import IGNORE
    from fullband.data.tokenizer import ByteTokenizer
    from fullband.data.tracking import training_sequences

    seqs = list(training_sequences("counter:8", "val", ByteTokenizer()))
    assert all(sum(t != IGNORE for t in s.targets) == 1 for s in seqs)
    assert all(s.targets[-2] == s.ids[-1] and chr(s.ids[-2]) == QUERY for s in seqs)
    assert (tracked / "model.safetensors").is_file()


def test_eval_tracking_reports_every_length_and_mode(tracked, tmp_path):
    from fullband.eval.commands import eval_tracking

    res = eval_tracking(tracked, n=16, modes=["standard", "fused:2", "exact"], out=tmp_path, progress=False)
    assert res["task"] == "counter" and res["train_length"] == 8 and res["lengths"] == [8, 16, 32, 64]
    assert [r["mode"] for r in res["rows"]] == ["standard", "fused k=2", "exact"]
    assert all(0 <= a <= 1 for r in res["rows"] for a in r["accuracy"])
    assert (tmp_path / "tracking_counter.png").is_file() and (tmp_path / "tracking_counter.json").is_file()


def test_eval_tracking_reads_a_converted_transformers_folder_as_the_native_model(tracked, tmp_path):
    pytest.importorskip("transformers")
    from fullband.eval.commands import eval_tracking
    from fullband.hf.convert import convert

    convert(tracked, tmp_path / "hf", to="hf")
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    modes = ["standard", "fused:1", "exact"]
    native = eval_tracking(tracked, n=24, modes=modes, out=tmp_path / "a", progress=False)
    with pytest.raises(ConfigError, match="not from a tracking run"):  # no run.json beside a converted folder
        eval_tracking(tmp_path / "hf", n=24, modes=modes, out=tmp_path / "b", progress=False)
    hf = eval_tracking(tmp_path / "hf", "counter", train_length=8, n=24, modes=modes, out=tmp_path / "b",
                       progress=False)
    assert hf["rows"] == native["rows"] and hf["lengths"] == native["lengths"]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == files  # the user's folder is left as it was


def test_exact_prefill_equals_adaptive_prefill_to_the_fixed_point_and_batches_equal_a_loop():
    from fullband import ByteTokenizer, DecodeMode, FullbandLM, ModelConfig
    from fullband.eval.tracking import label_ids, predictions

    torch.manual_seed(0)
    model = FullbandLM(ModelConfig(vocab_size=259, d_model=64, n_layers=2, n_heads=4, max_seq_len=128,
                                   bos_token_id=256, init_std=0.2)).eval()
    tok = ByteTokenizer()
    exs = examples("s5", 40, min_length=6, max_length=20, seed=5)  # ragged batches
    exact, _ = predictions(model, tok, exs, DecodeMode("exact"), "s5", batch_size=16)
    adaptive, used = predictions(model, tok, exs, DecodeMode("fused", "auto", tol=1e-7, max_passes=40), "s5",
                                 batch_size=16)
    assert np.array_equal(exact, adaptive) and max(used) >= 5
    fused1, _ = predictions(model, tok, exs, DecodeMode("fused", 1), "s5", batch_size=16)
    assert not np.array_equal(fused1, exact)  # the check can tell a short prefill from the fixed point
    # one example at a time, by hand: logits at the query position over the label tokens
    ids = label_ids(tok, "s5")
    loop = []
    for e in exs:
        x = torch.tensor([tok.encode(e.text)])
        with torch.no_grad():
            logits = model.recurrent_forward(x).logits[0, -1, ids]
        loop.append(int(logits.argmax()))
    assert loop == exact.tolist()


def test_reproduce_tracking_writes_a_report(tmp_path):
    from fullband.reproduce import reproduce

    small = ["train.steps=4", "train.warmup_steps=1", "train.seq_len=64", "train.global_batch_tokens=256",
             "train.micro_batch=4", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "log.eval_windows=2"]
    out = reproduce("tracking", root=tmp_path / "runs", docs=tmp_path / "docs", extra=small, seeds=1,
                    tasks=("registers",), n=8)
    text = out.read_text()
    assert text.startswith("# Reproduction: tracking") and "## registers" in text
    assert "**Outcome.** registers (accuracy at L / 2L / 4L / 8L, L = 8): best standard (registers-standard" in text
    for run in ("registers-standard", "registers-standard-3x", "registers-fbt-paper", "registers-fbt-three",
                "registers-fbt-grow"):
        assert f"| {run} |" in text and (tmp_path / "docs" / "tracking" / run / "tracking_registers.png").is_file()
    assert "| registers-fbt-grow | " in text and "| exact |" in text
    assert "Scoring in this invocation: 5 models in " in text and "; 0 evaluations reused" in text
    # a second invocation reuses the runs and their evaluations: the same tables, nothing scored again
    saved = tmp_path / "docs" / "tracking" / "registers-fbt-three" / "tracking_registers.json"
    stamp = saved.stat().st_mtime_ns
    again = reproduce("tracking", root=tmp_path / "runs", docs=tmp_path / "docs", extra=small, seeds=1,
                      tasks=("registers",), n=8).read_text()
    assert "Scoring in this invocation: 0 models in 0.0 min; 5 evaluations reused" in again
    assert saved.stat().st_mtime_ns == stamp
    tables = [line for line in text.splitlines() if line.startswith("| registers-")]
    assert tables == [line for line in again.splitlines() if line.startswith("| registers-")]
    # a missing figure is drawn again (the evaluation with it)
    (saved.with_suffix(".png")).unlink()
    reproduce("tracking", root=tmp_path / "runs", docs=tmp_path / "docs", extra=small, seeds=1,
                    tasks=("registers",), n=8)
    assert saved.with_suffix(".png").is_file() and saved.stat().st_mtime_ns > stamp
    # another number of examples per length is scored afresh
    third = reproduce("tracking", root=tmp_path / "runs", docs=tmp_path / "docs", extra=small, seeds=1,
                      tasks=("registers",), n=6).read_text()
    assert "Scoring in this invocation: 5 models in " in third and "over 6 examples per length" in third


def test_tracking_accuracy_runs_on_a_wrapped_hugging_face_model(tmp_path):
    """The same prefill engine reads prompts for a Llama wrapped with latent feedback: EXACT equals adaptive
    prefill to the fixed point there too."""
    transformers = pytest.importorskip("transformers")
    from fullband import DecodeMode
    from fullband.data.tokenizer import PretrainedTokenizer, train_bpe
    from fullband.eval.tracking import accuracy_table, predictions
    from fullband.hf.feedback import from_pretrained

    tok = train_bpe(["0110 1001 eo abcde xy = " * 50], 300, show_progress=False)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf_tokenizer, bos_token="<bos>",
                                                eos_token="<eos>", pad_token="<pad>")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1))
    llama.save_pretrained(tmp_path / "llama")
    fast.save_pretrained(tmp_path / "llama")
    model = from_pretrained(str(tmp_path / "llama")).eval()
    tokenizer = PretrainedTokenizer.from_pretrained(tmp_path / "llama")
    exs = examples("parity", 12, min_length=4, max_length=9, seed=2)
    exact, _ = predictions(model, tokenizer, exs, DecodeMode("exact"), "parity", batch_size=5)
    adaptive, _ = predictions(model, tokenizer, exs, DecodeMode("fused", "auto", tol=1e-7, max_passes=16), "parity",
                              batch_size=5)
    assert np.array_equal(exact, adaptive)
    res = accuracy_table(model, tokenizer, "parity", 4, n=6, modes=["standard", "fused:1", "exact"], progress=False)
    assert res["lengths"] == [4, 8, 16, 32] and len(res["rows"]) == 3
    # the command on the saved wrapped model (a model.hf_path run's folder) scores the same
    from fullband.eval.commands import eval_tracking

    model.save(tmp_path / "wrapped", tokenizer=tokenizer)
    cmd = eval_tracking(tmp_path / "wrapped", "parity", train_length=4, n=6, modes=["standard", "fused:1", "exact"],
                        out=tmp_path / "eval", progress=False)
    assert cmd["rows"] == res["rows"]
