"""The newer surfaces tried as a careless or hostile user would (issue 21): chat data and `fullband chat`,
tracking, `eval chat`, hostile folders for doctor / convert / init, lm-eval's CLI, hostile sizes. Each case ends,
quickly, in a one-line error naming what was wrong (or is simply handled): nothing hangs, nothing runs out of
memory, nothing prints a traceback."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_model
from fullband import ByteTokenizer
from fullband.cli import main

CLI = [sys.executable, "-m", "fullband.cli"]
CHAT = {"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "Answer: 4"}]}


def run(*args: str, timeout: float = 60, child: bool = False) -> subprocess.CompletedProcess:
    """The CLI in this process (its exit status and what it printed), or with child=True in a child process bounded
    in time, for the cases that once hung (FIFOs): a hang then fails the test instead of blocking the suite."""
    if child:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)
    return in_process(main, list(args))


def in_process(entry, argv: list[str]) -> subprocess.CompletedProcess:
    """entry(argv) with stdout and stderr captured; SystemExit (argparse, sys.exit) read as the exit status."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = entry(argv)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def one_line_error(done: subprocess.CompletedProcess, *words: str) -> None:
    err = done.stderr
    lines = [line for line in err.strip().splitlines() if "warning:" not in line and "cores are busy" not in line]
    assert done.returncode in (1, 2) and "Traceback" not in err, err[-2000:]
    assert len(lines) == 1 and "error:" in lines[0], err[-2000:]
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    chat = ByteTokenizer(chat=True)
    return tiny_model(vocab_size=chat.vocab_size).save(tmp_path_factory.mktemp("m") / "ckpt", tokenizer=chat)


@pytest.fixture
def chats(tmp_path) -> Path:
    path = tmp_path / "held.jsonl"
    path.write_text(json.dumps(CHAT) + "\n")
    return path


# ---------------------------------------------------------------------- hangs
def test_a_fifo_given_as_chat_data_is_refused(tmp_path, ckpt):
    os.mkfifo(tmp_path / "chats.jsonl")
    one_line_error(run("eval", "chat", "--checkpoint", str(ckpt), "--data", str(tmp_path / "chats.jsonl"),
                       "--out", str(tmp_path / "out"), child=True), "is a FIFO, not a regular file")


def test_a_fifo_named_like_an_output_is_refused_before_the_work(tmp_path, ckpt, chats):
    (tmp_path / "out").mkdir()
    os.mkfifo(tmp_path / "out" / "chat.json")
    one_line_error(run("eval", "chat", "--checkpoint", str(ckpt), "--data", str(chats), "--out", str(tmp_path / "out"),
                       child=True),
                   "chat.json", "not written by fullband eval")


def test_a_chat_folder_skips_a_fifo_named_like_jsonl(tmp_path):
    import warnings

    from fullband.data.chat.sources import chat_conversations
    from fullband.errors import FullbandWarning

    (tmp_path / "a.jsonl").write_text(json.dumps(CHAT) + "\n")
    os.mkfifo(tmp_path / "b.jsonl")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = list(chat_conversations(str(tmp_path), "train", 0.0))
    assert len(got) == 1 and any(issubclass(w.category, FullbandWarning) and "b.jsonl (a FIFO)" in str(w.message)
                                 for w in seen)


@pytest.mark.parametrize("args, words", [
    (["--task", "parity", "--train-length", "1000000"], ["--train-length 1000000", "accepted: at most"]),
    (["--task", "parity", "--train-length", "4", "--n", "100000000"], ["n=100,000,000", "n <= 100,000"]),
])
def test_tracking_sizes_beyond_what_fits_are_refused_at_once(ckpt, tmp_path, args, words):
    one_line_error(run("eval", "tracking", "--checkpoint", str(ckpt), *args, "--out", str(tmp_path / "e"), timeout=30),
                   *words)


def test_a_tracking_corpus_longer_than_the_window_is_refused_at_once():
    from fullband.data.tracking import training_sequences
    from fullband.errors import InputError

    with pytest.raises(InputError, match=r"parity examples of 100,000,000 steps .* accepted: at most 125 steps"):
        next(training_sequences("parity:100000000", "train", ByteTokenizer(), room=128))


# ---------------------------------------------------------------------- hostile files where a folder or JSON is expected
def _folder_with(tmp_path: Path, make) -> Path:
    folder = tmp_path / "m"
    tiny_model().save(folder)
    (folder / "config.json").unlink()
    make(folder / "config.json")
    return folder


@pytest.mark.parametrize("make, words", [
    (os.mkfifo, ["a FIFO, not a regular file"]),
    (lambda p: p.symlink_to("/dev/zero"), ["a character device, not a regular file"]),
    (lambda p: p.write_text("[" * 100_000 + "]" * 100_000), ["nested too deeply"]),
    (lambda p: p.write_bytes(b"\xff\xfe{\x00}\x00"), ["UTF-16"]),
])
@pytest.mark.parametrize("command", ["doctor", "convert", "generate", "init"])
def test_a_hostile_config_json_is_one_line_at_once(tmp_path, make, words, command):
    folder = _folder_with(tmp_path, make)
    args = {"doctor": [str(folder)], "convert": [str(folder), str(tmp_path / "out")],
            "generate": ["--checkpoint", str(folder), "--prompt", "x"],
            "init": ["--config", "tiny", "--out", str(folder), "--overwrite"]}[command]
    done = run(command, *args, timeout=60, child=make is os.mkfifo)
    if command == "doctor":  # doctor reports findings: a FAIL line and exit status 1, never a hang or a traceback
        assert done.returncode == 1 and "Traceback" not in done.stderr and "FAIL" in done.stdout, done.stdout
        assert any(w in done.stdout for w in words), done.stdout
    elif command == "init":  # not a folder fullband wrote: left alone
        one_line_error(done, "is not a model folder written by fullband")
        assert (folder / "model.safetensors").is_file()
    else:
        one_line_error(done, *words)


def test_a_damaged_trainer_json_is_named(tmp_path, ckpt):
    from fullband.errors import CheckpointError
    from fullband.train.checkpoint import read_trainer_state

    step = tmp_path / "run" / "step_000002"
    step.mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "optimizer.pt", "rng.pt"):
        (step / name).write_text("x")
    state = {"step": 2, "tokens": "many", "compute_tokens": 4, "elapsed": 1.0, "sampler": {}}
    (step / "trainer.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"tokens='many' is invalid; accepted: an integer >= 0"):
        read_trainer_state(step)
    (step / "trainer.json").write_text(json.dumps({**state, "tokens": 8, "flops": -1.0}))
    with pytest.raises(CheckpointError, match=r"flops=-1.0 is invalid; accepted: a number >= 0"):
        read_trainer_state(step)


def test_a_destination_that_is_a_symlink_loop_is_one_line(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    one_line_error(run("init", "--config", "tiny", "--out", str(tmp_path / "loop")), "loop")


def test_json_output_onto_a_fifo_is_refused(tmp_path, ckpt):
    os.mkfifo(tmp_path / "out.json")
    one_line_error(run("doctor", str(ckpt), "--json", str(tmp_path / "out.json"), child=True), "out.json")


# ---------------------------------------------------------------------- hostile sizes
def test_a_synthetic_chat_set_of_a_hostile_size_is_refused():
    from fullband.data.chat.sources import chat_conversations
    from fullband.errors import DataError

    for spec, words in (("arithmetic:100000000000", "N=100000000000 is invalid"), ("arithmetic:00", "N=0"),
                        ("arithmetic:\u00b2", "N='\u00b2' is not an integer")):
        with pytest.raises(DataError, match=words):
            next(chat_conversations(spec, "train", 2.0))


# ---------------------------------------------------------------------- text that is not what it should be
@pytest.mark.parametrize("content, words", [
    (b"\xff\xfe{\x00", ["UTF-16"]),
    (b'{"messages": [{"role": "user", "content": "\xe9"}]}\n', ["not UTF-8 text", "0xe9"]),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "A"}]}\n',
     ["lone surrogate"]),
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", ["nested too deeply"]),
])
def test_chat_data_that_is_not_text_or_json_is_one_line_naming_the_line(tmp_path, ckpt, content, words):
    (tmp_path / "bad.jsonl").write_bytes(content)
    one_line_error(run("eval", "chat", "--checkpoint", str(ckpt), "--data", str(tmp_path / "bad.jsonl"),
                       "--out", str(tmp_path / "out")), *words)


@pytest.mark.parametrize("args", [["--task", "parity", "--train-length", "\u00b2"], ["--modes", "fused:\u00b2"],
                                  ["--n", "\u0661\u0662"]])  # superscript two; Arabic-Indic 12, which int() reads
def test_unicode_digits_are_not_integers(ckpt, tmp_path, args):
    done = run("eval", "tracking", "--checkpoint", str(ckpt), "--task", "parity", "--train-length", "4", *args,
               "--out", str(tmp_path / "e"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "is not" in done.stderr, done.stderr


def test_a_damaged_run_json_beside_a_checkpoint_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    tiny_model().save(run_dir / "step_000001", tokenizer=ByteTokenizer())
    for text in ("{not json", "[1, 2]"):
        (run_dir / "run.json").write_text(text)
        one_line_error(run("eval", "loss", "--checkpoint", str(run_dir / "step_000001"), "--out", str(tmp_path / "e")),
                       "run.json")


def test_a_bad_stop_text_escape_is_one_line(ckpt, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    one_line_error(run("eval", "generate-length", "--checkpoint", str(ckpt), "--prompts", str(prompts),
                       "--stop-text", "\\x", "--out", str(tmp_path / "e")), "--stop-text")


def test_a_numpy_seed_is_accepted():
    import numpy as np

    from fullband import generate

    model = tiny_model()
    assert generate(model, [[1, 2]], 3, temperature=1.0, seed=np.int64(3)) == \
        generate(model, [[1, 2]], 3, temperature=1.0, seed=3)


def test_lmeval_cli_errors_are_one_line(ckpt, tmp_path):
    pytest.importorskip("lm_eval")
    from unittest import mock

    from fullband.lmeval import main as lmeval_main
    (tmp_path / "t.jsonl").write_text('{"prompt": "a", "answer": "b"}\n')
    (tmp_path / "fb_t.yaml").write_text(f"task: fb_t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                        f"    test: {tmp_path / 't.jsonl'}\ntest_split: test\noutput_type: "
                                        "generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n")
    truncated = tmp_path / "cut"
    shutil.copytree(ckpt, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    for model_args, words in ((f"chekpoint={ckpt}", "unknown model arg 'chekpoint'"), ("mode=soft", "checkpoint=DIR"),
                              (f"checkpoint={truncated}", "model.safetensors")):
        argv = ["--model", "fullband", "--model_args", model_args, "--tasks", "fb_t", "--include_path", str(tmp_path)]
        with mock.patch.object(sys, "argv", ["fullband.lmeval", *argv]):
            done = in_process(lambda _: lmeval_main(), argv)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert words in done.stderr.strip().splitlines()[-1], done.stderr[-500:]


def test_a_figure_that_fails_to_write_leaves_no_file(tmp_path, monkeypatch):
    import errno

    from fullband.files import plt, save_figure
    from fullband.files import OutputError

    fig = plt().figure()

    def full(path, **kwargs):
        Path(path).write_bytes(b"\x89PNG")  # a part written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fig, "savefig", full)
    with pytest.raises(OutputError, match="the disk is full: could not write loss.png"):
        save_figure(fig, tmp_path / "loss.png")
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_write_that_stops_short_with_space_left_is_said_plainly(tmp_path, monkeypatch):
    """torch.save's "unexpected pos" hides the errno; when the disk has space again by the time it is looked at (another
    process freed some), the error still says the write stopped short, with the free space, and leaves nothing."""
    import torch

    from fullband.files import OutputError
    from fullband.train import checkpoint
    from fullband.train.parallel import Dist

    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    real = torch.save

    def short(obj, path, *args, **kwargs):
        if Path(path).name == "optimizer.pt":
            Path(path).write_bytes(b"PK")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 817781120 vs 817781008")
        return real(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", short)
    with pytest.raises(OutputError, match=r"could not write checkpoint step_000001 at .*: a write stopped short "
                                          r"\(.*unexpected pos.*\): the disk was probably full at that moment; \d+ MiB"):
        checkpoint.save_checkpoint(tmp_path, 1, model, optimizer, {}, d=Dist())
    assert list(tmp_path.iterdir()) == []


def test_saved_folders_and_files_follow_the_umask(tmp_path):
    import stat

    from fullband.files import replace_file

    for mask in (0o022, 0o077):
        old = os.umask(mask)
        try:
            folder = tiny_model().save(tmp_path / f"m{mask:o}", tokenizer=ByteTokenizer())
            replace_file(tmp_path / f"f{mask:o}.txt", "x")
        finally:
            os.umask(old)
        assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~mask
        assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {0o666 & ~mask}
        assert stat.S_IMODE((tmp_path / f"f{mask:o}.txt").stat().st_mode) == 0o666 & ~mask


def test_overwriting_a_model_without_a_tokenizer_keeps_the_saved_one(tmp_path):
    from fullband.data.tokenizer import load_tokenizer
    from fullband.doctor import diagnose
    from fullband.errors import FullbandWarning

    chat = ByteTokenizer(chat=True)
    folder = tiny_model(vocab_size=chat.vocab_size).save(tmp_path / "m", tokenizer=chat)
    tiny_model(seed=1, vocab_size=chat.vocab_size).save(folder, overwrite=True)
    assert load_tokenizer(folder).vocab_size == chat.vocab_size != ByteTokenizer().vocab_size
    assert not diagnose(folder).failed
    with pytest.warns(FullbandWarning, match=r"the saved tokenizer \(263 ids\) was not kept"):
        tiny_model().save(folder, overwrite=True)  # a smaller vocabulary: it would not fit
    assert not (folder / "tokenizer.json").exists() and not diagnose(folder).failed


def test_an_empty_chat_split_is_named_as_empty():
    from fullband.data.chat.packing import pack_chats
    from fullband.errors import DataError

    with pytest.raises(DataError, match="the val split of 'x.jsonl' holds no conversation"):
        pack_chats(iter([]), 64, 0, what="the val split of 'x.jsonl'")


def test_a_llama_config_that_does_not_describe_its_weights_is_refused_before_allocating(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    claims = json.loads((tmp_path / "llama" / "config.json").read_text())
    claims.update(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, head_dim=128)  # a 70B Llama: 280 GB in float32, were it allocated
    (tmp_path / "llama" / "config.json").write_text(json.dumps(claims))
    one_line_error(run("convert", str(tmp_path / "llama"), str(tmp_path / "out")),
                   "config.json implies model.embed_tokens.weight of shape (300, 8192); the weights hold (300, 64)")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_output_into_a_full_device_names_the_device(tmp_path):
    folder = tiny_model().save(tmp_path / "m", tokenizer=ByteTokenizer())
    with open("/dev/full", "w") as full:
        done = subprocess.run([*CLI, "generate", "--checkpoint", str(folder), "--prompt", "ab", "--max-new-tokens",
                               "4"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=60,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    one_line_error(done, "could not write the output: no space left on '/dev/full'")


# ---------------------------------------------------------------------- issue 46: the real-model surfaces' messages
@pytest.mark.parametrize("spec", ["shipped:nope", "SHIPPED:smollm2", "shipped:"])
def test_a_shipped_name_that_is_not_one_lists_the_shipped_models(spec, tmp_path, capsys):
    from fullband.cli import main

    for args in (["convert", spec, str(tmp_path / "out")],
                 ["train", "configs/warmstart-smollm2.toml", "--set", f'train.init_from="{spec}"', "--set",
                  f'log.run_dir="{tmp_path / "run"}"'],
                 ["bench", "decode", "--model", spec]):
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert f"{spec!r} names no shipped model; accepted: shipped:smollm2" in err[-1], (args, err)
    assert not (tmp_path / "out").exists() and not (tmp_path / "run" / "run.json").exists()


def test_a_gguf_type_for_a_folder_destination_is_refused(ckpt, tmp_path, capsys):
    from fullband.cli import main

    assert main(["convert", str(ckpt), str(tmp_path / "hf"), "--gguf-type", "F16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--gguf-type) is a GGUF file's tensor type, but" in err
    assert not (tmp_path / "hf").exists()


def test_chat_with_standard_input_closed_is_one_line():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "fullband.cli", "chat", "--checkpoint", "nowhere"],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: __import__("os").close(0))
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1].startswith(
        "fullband chat: error: fullband chat reads your turns from standard input, which is closed"), run.stderr
    assert "Traceback" not in run.stderr


def test_a_reward_module_that_exits_on_import_is_one_line(tmp_path):
    from fullband.errors import ConfigError
    from fullband.rl.rewards import load_reward

    (tmp_path / "bad.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ConfigError, match=r"importing '.*bad\.py' called sys\.exit\(3\); accepted: a module"):
        load_reward(f"{tmp_path / 'bad.py'}:score")


def test_the_llama_cpp_engine_without_llama_cpp_python_is_one_line(capsys, monkeypatch):
    import builtins

    from fullband.cli import main

    real = builtins.__import__

    def no_llama(name, *a, **k):
        if name == "llama_cpp":
            raise ImportError("No module named 'llama_cpp'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    assert main(["generate", "--checkpoint", "m.gguf", "--engine", "llamacpp", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("fullband generate: error: the llama.cpp engine needs "
                                                   "llama-cpp-python") and "Traceback" not in err


def test_under_torchrun_a_refusal_is_the_failure_report_s_root_cause(tmp_path, monkeypatch, capsys):
    """torchrun prints each failed worker's error file as its report's root cause; fullband writes its one line
    there (as torch's `record` would write a traceback), so an FSDP refusal is not buried above the report."""
    from fullband.cli import main

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert main(["train", "configs/tiny.toml", "--set", 'train.passes="adaptive"', "--set",
                 'train.parallel="fsdp"', "--set", f'log.run_dir="{tmp_path / "run"}"']) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    said = json.loads((tmp_path / "error.json").read_text())["message"]
    assert said["message"] == line and "FSDP's sharded weights do not support" in line
