"""Hostile and careless input: values that are not finite or out of any useful range, files that are not
regular, bytes that are not UTF-8, missing optional packages, devices that are not there. Each is refused
before any work with a one-line error that names the input and what is accepted (or, where the input is
fine, simply handled)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import tiny_model, write_config
from fullband import ByteTokenizer, ConfigError, InputError, generate
from fullband.cli import main
from fullband.train.config import load_run_config

CLI = [sys.executable, "-m", "fullband.cli"]


def one_line_error(err: str) -> bool:
    lines = [line for line in err.strip().splitlines() if "warning:" not in line]
    return len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return tiny_model().save(tmp_path_factory.mktemp("m") / "ckpt", tokenizer=ByteTokenizer())


# ---------------------------------------------------------------------- values that are not finite / in range
@pytest.mark.parametrize("override, words", [
    ("train.z_loss=nan", ["train.z_loss=nan", "finite"]),
    ("train.cooldown_fraction=inf", ["train.cooldown_fraction=inf", "finite"]),
    ("model.rope_theta=inf", ["model.rope_theta=inf", "finite"]),
    ("data.val_percent=nan", ["data.val_percent=nan", "finite"]),
    ("model.jitter=-inf", ["model.jitter=-inf", "finite"]),
    ("train.seed=9223372036854775808", ["train.seed=9223372036854775808", "2**63"]),
    ("model.max_seq_len=1000000000000", ["max_seq_len=1000000000000", "1048576"]),
])
def test_recipe_values_that_are_not_finite_or_out_of_range(tmp_path, corpus, cache, override, words):
    config = write_config(tmp_path, corpus, cache)
    with pytest.raises(ConfigError) as info:
        load_run_config(config, [override])
    for w in words:
        assert w in str(info.value), str(info.value)
    assert not (tmp_path / "run").exists()


def test_a_large_seed_trains(tmp_path, corpus, cache):
    """Seeds up to 2**63 - 1 are accepted everywhere a seed goes (the per-step noise seed folds into 64 bits)."""
    from fullband.train.trainer import train

    train(load_run_config(write_config(tmp_path, corpus, cache, steps=2, ckpt_every=0), [f"train.seed={2**63 - 1}"]))


@pytest.mark.parametrize("kwargs, words", [
    ({"temperature": math.nan}, ["temperature=nan", "finite"]),
    ({"temperature": math.inf}, ["temperature=inf", "finite"]),
    ({"seed": 2**64}, ["seed=18446744073709551616", "2**63"]),
    ({"mode": "fused", "prefill_passes": 10**6}, ["prefill_passes=1000000", "cap of max_seq_len=160"]),
    ({"mode": "fused", "prefill_passes": "auto", "max_prefill_passes": 10**6}, ["max_prefill_passes=1000000"]),
])
def test_decode_arguments_that_are_not_finite_or_out_of_range(kwargs, words):
    with pytest.raises(InputError) as info:
        generate(tiny_model(), [[256, 1, 2]], 4, **kwargs)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_prefill_passes_beyond_the_prompt_change_nothing_and_cost_nothing():
    from fullband import stream

    model = tiny_model()
    prompt = [[256, *range(40, 60)]]  # 21 tokens: exact after 21 passes
    exact = generate(model, prompt, 8, mode="exact")
    assert generate(model, prompt, 8, mode="fused", prefill_passes=159) == exact
    assert generate(model, prompt, 8, mode="fused", prefill_passes=20) == exact
    first = next(iter(stream(model, prompt, 8, mode="fused", prefill_passes=159)))
    assert first.prefill_passes == 21  # not 160: passes past the prompt's length would recompute the fixed point


def test_cli_prefill_passes_auto_and_its_cap(ckpt, capsys):
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "def f(x):", "--mode", "fused",
                 "--prefill-passes", "auto", "--prefill-tol", "1e-4", "--max-new-tokens", "6", "--ignore-eos"]) == 0
    assert "6 tokens, fused" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "x", "--mode", "fused",
                 "--prefill-passes", "1000000"]) == 2
    assert "cap of max_seq_len" in capsys.readouterr().err


@pytest.mark.parametrize("args", [
    ["eval", "loss", "--auto", "-1"], ["eval", "loss", "--auto", "nan"], ["eval", "loss", "--auto", "0"],
    ["eval", "loss", "--seq-len", "0"], ["eval", "loss", "--batch-size", "0"], ["eval", "loss", "--max-prefill", "-1"],
    ["eval", "stability", "--ks", "0"], ["generate", "--prompt", "x", "--seed", str(2**63)],
    ["generate", "--prompt", "x", "--max-new-tokens", "0"], ["generate", "--prompt", "x", "--prefill-passes", "-2"],
])
def test_cli_numbers_are_checked_before_any_work(ckpt, tmp_path, args, capsys):
    with pytest.raises(SystemExit) as info:
        main([*args, "--checkpoint", str(ckpt)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and ("out of range" in err or "not a" in err or "invalid" in err)
    assert not (ckpt / "eval").exists()


def test_eval_api_checks_its_arguments_before_loading(ckpt):
    from fullband.eval.commands import eval_loss, eval_stability

    with pytest.raises(ConfigError, match=r"auto tolerance nan is invalid"):
        eval_loss(ckpt, auto_tols=[math.nan])
    with pytest.raises(ConfigError, match=r"max_prefill=-1 is invalid"):
        eval_loss(ckpt, max_prefill=-1)
    with pytest.raises(ConfigError, match=r"batch_size=0 is invalid"):
        eval_stability(ckpt, batch_size=0)
    assert not (ckpt / "eval").exists()


# ---------------------------------------------------------------------- files that are not regular / not UTF-8
def test_non_regular_corpus_entries_are_skipped_not_read(tmp_path):
    """A FIFO named *.txt would hang the reader forever; dangling and looping symlinks would raise."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(4):
        (folder / f"doc{i}.txt").write_text(f"document {i} " * 200)
    os.mkfifo(folder / "pipe.txt")
    (folder / "dangling.txt").symlink_to(folder / "missing.txt")
    (folder / "loop.txt").symlink_to(folder / "loop.txt")
    (folder / "link.txt").symlink_to(folder / "doc0.txt")  # a symlink to a regular file is read
    code = f"""
import warnings
from fullband.data.corpus import resolve_corpus
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    corpus = resolve_corpus({str(folder)!r}, val_percent=25)
    docs = list(corpus.documents("train")) + list(corpus.documents("val"))
print(len(docs), "|".join(str(w.message) for w in caught))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    count, message = done.stdout.split(" ", 1)
    assert int(count) == 5
    assert "skipped 3 entries" in message and "pipe.txt (a FIFO)" in message
    assert "dangling.txt (a dangling symlink)" in message and "loop.txt (a symlink loop)" in message


def test_a_fifo_named_as_the_corpus_is_refused(tmp_path):
    from fullband.data.corpus import resolve_corpus
    from fullband.errors import DataError

    os.mkfifo(tmp_path / "corpus.txt")
    with pytest.raises(DataError, match=r"is not a regular file or folder \(a FIFO\)"):
        resolve_corpus(str(tmp_path / "corpus.txt"))


def test_a_jsonl_file_with_a_byte_order_mark_is_simply_read(tmp_path):
    from fullband.data.corpus import resolve_corpus
    from fullband.eval.generation import read_prompts

    rows = "".join(json.dumps({"text": f"row {i}", "prompt": f"p{i}"}) + "\n" for i in range(30))
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + rows.encode())
    (tmp_path / "plain.jsonl").write_bytes(rows.encode())
    def docs(name):  # both splits: the split keys name the file, so the two files split differently
        corpus = resolve_corpus(str(tmp_path / name), val_percent=20)
        return sorted([*corpus.documents("train"), *corpus.documents("val")])

    assert docs("bom.jsonl") == docs("plain.jsonl") == sorted(f"row {i}" for i in range(30))
    assert read_prompts(tmp_path / "bom.jsonl") == read_prompts(tmp_path / "plain.jsonl")


def test_invalid_utf8_prompt_is_a_one_line_error(ckpt, capsys):
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "def f\udcff(x):"]) == 2
    err = capsys.readouterr().err
    assert one_line_error(err) and "--prompt is not valid UTF-8 (byte 0xff at position 5)" in err


def test_binary_toml_and_a_folder_as_config(tmp_path, capsys):
    (tmp_path / "bad.toml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    assert main(["train", str(tmp_path / "bad.toml")]) == 2
    assert "is not a text file (invalid UTF-8" in capsys.readouterr().err
    assert main(["init", "--config", str(tmp_path / "bad.toml"), "--out", str(tmp_path / "m")]) == 2
    assert "is not a text file" in capsys.readouterr().err
    (tmp_path / "dir.toml").mkdir()
    assert main(["train", str(tmp_path / "dir.toml")]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_run_dir_and_cache_that_are_files(tmp_path, corpus, cache, capsys, monkeypatch):
    (tmp_path / "taken").write_text("a file")
    config = write_config(tmp_path, corpus, cache, run_dir=tmp_path / "taken")
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert one_line_error(err) and "log.run_dir" in err and "is a file" in err
    assert (tmp_path / "taken").read_text() == "a file"
    config = write_config(tmp_path, corpus, "", name="nocache")
    monkeypatch.setenv("FULLBAND_CACHE", str(tmp_path / "taken"))
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert one_line_error(err) and "FULLBAND_CACHE=" in err and "is a file" in err
    assert not (tmp_path / "nocache").exists()


def test_cuda_asked_for_on_a_machine_without_it(ckpt, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "x", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert one_line_error(err) and "CUDA is not available on this machine; accepted: cpu" in err
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "x", "--device", "gpu0"]) == 2
    assert "is not a device" in capsys.readouterr().err


def test_generate_piped_into_head_ends_quietly(ckpt, tmp_path):
    err = tmp_path / "err.txt"
    cmd = (f"{sys.executable} -m fullband.cli generate --checkpoint {ckpt} --prompt x --max-new-tokens 150 "
           f"--ignore-eos --temperature 1 --seed 0 2> {err} | head -c 1 > /dev/null; echo ${{PIPESTATUS[0]}}")
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() in ("0", "141"), done.stdout
    assert "Traceback" not in err.read_text() and "BrokenPipe" not in err.read_text()


def test_read_only_output_folders(tmp_path, corpus, cache):
    """A read-only folder (a read-only mount: permissions alone do not stop root) gives a one-line error."""
    from test_run_ownership import unshare_available

    if not unshare_available():
        pytest.skip("cannot mount a read-only tmpfs here (unshare -rm / mount not permitted)")
    ro = tmp_path / "ro"
    ro.mkdir()
    config = write_config(tmp_path, corpus, cache, run_dir=ro / "run")
    script = f"""
mount -t tmpfs -o size=1m,ro tmpfs {ro} || exit 90
{sys.executable} -m fullband.cli init --config tiny --out {ro / 'm'} 2> {tmp_path / 'init.txt'}; echo "init=$?"
{sys.executable} -m fullband.cli train {config} 2> {tmp_path / 'train.txt'}; echo "train=$?"
"""
    out = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300).stdout
    assert "init=2" in out and "train=2" in out, out
    for name in ("init.txt", "train.txt"):
        err = (tmp_path / name).read_text()
        assert one_line_error(err) and "read-only" in err, err


# ---------------------------------------------------------------------- optional packages, lm-eval arguments
def test_probe_without_scikit_learn_fails_before_the_model_work(ckpt, tmp_path):
    code = ("import sys; sys.modules['sklearn'] = None\n"
            "from fullband.cli import main\n"
            f"sys.exit(main(['eval', 'probe', '--checkpoint', {str(ckpt)!r}, '--out', {str(tmp_path / 'o')!r}]))")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and one_line_error(done.stderr), done.stderr
    assert "pip install 'fullband[eval]'" in done.stderr and time.perf_counter() - t0 < 60
    assert not (tmp_path / "o").exists()


def test_lm_eval_arguments_that_are_not_numbers(ckpt):
    pytest.importorskip("lm_eval")
    from fullband.lmeval import FullbandHarnessLM

    with pytest.raises(ConfigError, match=r"max_gen_toks='abc' is invalid; accepted: an integer >= 1"):
        FullbandHarnessLM.create_from_arg_string(f"checkpoint={ckpt},max_gen_toks=abc")
    with pytest.raises(ConfigError, match=r"prefill_passes='x' is invalid"):
        FullbandHarnessLM.create_from_arg_string(f"checkpoint={ckpt},mode=fused,prefill_passes=x")


# ---------------------------------------------------------------------- a converted model keeps its EOS
def test_a_converted_llama_stops_at_its_own_eos(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from test_hf import tiny_llama

    from fullband.data.tokenizer import load_tokenizer
    from fullband.hf.convert import convert

    llama = tiny_llama(False, seed=2)
    # the token greedy decoding emits first becomes the model's EOS: a generation must stop right there
    prompt = [5, 9, 13]  # "t5 t9 t13" as the tokenizer encodes it: it adds no BOS, so fullband adds none either
    first = int(llama(torch.tensor([prompt])).logits[0, -1].argmax())
    llama.config.eos_token_id = first
    llama.generation_config.eos_token_id = first
    llama.save_pretrained(tmp_path / "llama")
    vocab = {f"t{i}": i for i in range(101)}
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="t1", eos_token=f"t{first}")
    fast.save_pretrained(tmp_path / "llama")
    assert convert(tmp_path / "llama", tmp_path / "native") == ("llama", "native")
    assert load_tokenizer(tmp_path / "native").stop_ids == (first,)
    # (as plain text: this toy vocabulary's special token "t1" would otherwise match inside "t13", as in transformers)
    args = ["generate", "--checkpoint", str(tmp_path / "native"), "--prompt", "t5 t9 t13", "--max-new-tokens", "6",
            "--special-as-text"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "[1 tokens, standard" in err and f"stopped at EOS id {first} (--ignore-eos to go on)" in err
    assert "feedback weights are untrained" in err  # a converted model decodes as it was, and says so
    assert main([*args, "--ignore-eos"]) == 0
    assert "[6 tokens, standard" in capsys.readouterr().err
    assert convert(tmp_path / "llama", tmp_path / "hf", to="hf") == ("llama", "hf")
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id == first
