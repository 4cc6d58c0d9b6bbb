"""Folders we must not touch: every tool that writes a folder or file refuses a destination that holds anything
fullband did not write, replaces an earlier output of its own kind only when told to, never deletes its
source, and leaves no half-written temporary folder behind (one a killed writer left is removed next time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from fullband import ByteTokenizer, CheckpointError, FullbandLM
from fullband.cli import main


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes (what a refusal must leave exactly as it was)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def user_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("three weeks of notes\n")
    (path / "data").mkdir()
    (path / "data" / "train.jsonl").write_text('{"text": "mine"}\n')
    return path


# ---------------------------------------------------------------------- fullband init
def test_init_refuses_a_plain_file_and_a_folder_of_the_users(tmp_path, capsys):
    target = tmp_path / "d"
    target.write_text("a plain file of the user's\n")
    assert main(["init", "--config", "tiny", "--out", str(target)]) == 2
    assert target.read_text() == "a plain file of the user's\n"
    assert "is not a folder" in capsys.readouterr().err

    folder = user_folder(tmp_path / "mine")
    before = snapshot(folder)
    for extra in ([], ["--overwrite"]):
        assert main(["init", "--config", "tiny", "--out", str(folder), *extra]) == 2
        err = capsys.readouterr().err
        assert "not a model folder written by fullband" in err and "notes.txt" in err
        assert snapshot(folder) == before


def test_init_replaces_its_own_output_only_when_asked(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["init", "--config", "tiny", "--set", "n_layers=1", "--out", str(out)]) == 0
    first = snapshot(out)
    assert main(["init", "--config", "tiny", "--set", "n_layers=2", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err and snapshot(out) == first
    assert main(["init", "--config", "tiny", "--set", "n_layers=2", "--out", str(out), "--overwrite"]) == 0
    assert FullbandLM.load(out).config.n_layers == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary or old folder left


# ---------------------------------------------------------------------- FullbandLM.save
def test_save_never_replaces_a_run_directory(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    tiny_model().save(run / "step_000100")
    before = snapshot(run)
    for overwrite in (False, True):
        with pytest.raises(CheckpointError, match=r"not a model folder written by fullband .*metrics.jsonl"):
            tiny_model(seed=1).save(run, overwrite=overwrite)
        assert snapshot(run) == before


def test_save_into_an_empty_folder_and_over_its_own_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    tiny_model().save(tmp_path / "empty", tokenizer=ByteTokenizer())
    assert FullbandLM.load(tmp_path / "empty").config == tiny_model().config
    with pytest.raises(CheckpointError, match="overwrite=True"):
        tiny_model(seed=3).save(tmp_path / "empty")
    # a checkpoint with eval results beside it (fullband eval writes CHECKPOINT/eval/) is still ours
    (tmp_path / "empty" / "eval").mkdir()
    (tmp_path / "empty" / "eval" / "loss.json").write_text("{}")
    tiny_model(seed=3).save(tmp_path / "empty", overwrite=True)
    assert torch.equal(FullbandLM.load(tmp_path / "empty").embed.weight, tiny_model(seed=3).embed.weight)
    # ... but not one the user put a file of their own into
    (tmp_path / "empty" / "README.md").write_text("my model card")
    with pytest.raises(CheckpointError, match="README.md"):
        tiny_model(seed=4).save(tmp_path / "empty", overwrite=True)
    assert (tmp_path / "empty" / "README.md").read_text() == "my model card"


def test_a_killed_save_leaves_nothing_that_lasts(tmp_path):
    """A temporary folder left by a killed writer is removed by the next save to the same place; one that a live
    process is still writing is left alone; an interrupted replacement is put back."""
    stale = tmp_path / ".m.k1ll3d.tmp"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x" * 1000)
    live = tmp_path / ".m.l1v3.tmp"
    live.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from fullband.files import lock_folder; lock_folder(sys.argv[1], 'x'); "
        "print('locked', flush=True); time.sleep(60)"), str(live)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        tiny_model().save(tmp_path / "m")
        assert not stale.exists() and live.exists()
    finally:
        holder.kill()
        holder.wait()
    # a kill between the two renames of a replacement: the old folder is back in place before anything else
    os.rename(tmp_path / "m", tmp_path / ".m.sw4p.old.tmp")
    with pytest.raises(CheckpointError, match="overwrite=True"):
        tiny_model(seed=1).save(tmp_path / "m")
    assert torch.equal(FullbandLM.load(tmp_path / "m").embed.weight, tiny_model().embed.weight)


# ---------------------------------------------------------------------- fullband convert
def test_convert_never_deletes_its_source(tmp_path):
    pytest.importorskip("transformers")
    root = tmp_path / "R"
    tiny_model().save(root / "src", tokenizer=ByteTokenizer())
    (root / "notes.txt").write_text("mine")
    before = snapshot(root)
    for dst in (root, root / "src"):
        assert main(["convert", str(root / "src"), str(dst), "--overwrite"]) == 2
        assert snapshot(root) == before
    # a destination that holds the user's files is refused with --overwrite too; an earlier conversion is not
    user = user_folder(tmp_path / "user")
    assert main(["convert", str(root / "src"), str(user), "--overwrite"]) == 2
    assert (user / "notes.txt").exists()
    assert main(["convert", str(root / "src"), str(tmp_path / "hf")]) == 0
    assert main(["convert", str(root / "src"), str(tmp_path / "hf")]) == 2
    assert main(["convert", str(root / "src"), str(tmp_path / "hf"), "--overwrite"]) == 0


@pytest.mark.parametrize("args", [
    ["convert", "{ckpt}", "{loop}"],  # was: RuntimeError: Symlink loop (a traceback)
    ["convert", "{ckpt}", "{loop}/hf"],
    ["init", "--config", "tiny", "--out", "{loop}/model"],
    ["eval", "stability", "--checkpoint", "{ckpt}", "--out", "{loop}"],
    ["bench", "cost", "--config", "tiny", "--json", "{loop}"],
    ["doctor", "{ckpt}", "--json", "{loop}/doctor.json"],
    ["reproduce", "stability", "--docs", "{loop}", "--root", "{tmp}/runs"],
    ["train", "configs/tiny.toml", "--set", 'log.run_dir="{loop}/run"'],
])
def test_an_output_through_a_symlink_loop_is_a_one_line_error(args, tmp_path, capsys):
    """Every command that writes an output path says that it is (or goes through) a symlink loop, before any work,
    and leaves the link as it was (a JSON file once replaced it)."""
    if args[0] == "convert":
        pytest.importorskip("transformers")
    ckpt, loop = tmp_path / "ckpt", tmp_path / "loop"
    tiny_model().save(ckpt, tokenizer=ByteTokenizer())
    loop.symlink_to("loop")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main([a.format(ckpt=ckpt, loop=loop, tmp=tmp_path) for a in args]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line or "Traceback" in line]
    assert len(err) == 1 and "symlink loop" in err[0] and str(loop) in err[0], err
    assert os.readlink(loop) == "loop" and sorted(p.name for p in tmp_path.iterdir()) == before


# ---------------------------------------------------------------------- fullband tokenizer train
def test_tokenizer_train_keeps_an_existing_tokenizer(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"m{i}.py").write_text(f"def function_{i}(value):\n    return value * {i}\n" * 20)
    out = tmp_path / "tok"
    out.mkdir()
    (out / "tokenizer.json").write_text('{"mine": true}')
    command = ["tokenizer", "train", "--corpus", str(corpus), "--vocab-size", "300", "--no-progress", "--val-percent", "20"]
    args = [*command, "--out", str(out)]
    assert main(args) == 2
    assert (out / "tokenizer.json").read_text() == '{"mine": true}'
    assert "--overwrite" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0
    assert json.loads((out / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    mixed = user_folder(tmp_path / "mixed")
    assert main([*command, "--out", str(mixed), "--overwrite"]) == 2
    assert not (mixed / "tokenizer.json").exists()


# ---------------------------------------------------------------------- fullband eval / bench outputs
def test_eval_and_bench_outputs_refuse_the_users_files_before_the_work(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    tiny_model().save(ckpt, tokenizer=ByteTokenizer())
    out = user_folder(tmp_path / "results")
    (out / "stability.json").write_text('{"my": "own stability study"}')
    before = snapshot(out)
    t0 = time.perf_counter()
    assert main(["eval", "stability", "--checkpoint", str(ckpt), "--out", str(out), "--corpus", "stdlib"]) == 2
    assert time.perf_counter() - t0 < 10  # refused before tokenising anything
    assert "not written by fullband eval" in capsys.readouterr().err and snapshot(out) == before
    mine = tmp_path / "bench.json"
    mine.write_text('{"my": "results"}')
    assert main(["bench", "decode", "--config", "tiny", "--json", str(mine), "--no-hf", "--repeats", "1"]) == 2
    assert mine.read_text() == '{"my": "results"}'


# ---------------------------------------------------------------------- fullband train
def test_training_into_a_folder_of_the_users_is_refused(tmp_path, corpus, cache):
    from conftest import write_config

    from fullband import ConfigError
    from fullband.train.config import load_run_config
    from fullband.train.trainer import train

    folder = user_folder(tmp_path / "home")
    before = snapshot(folder)
    with pytest.raises(ConfigError, match=r"is not empty and holds no fullband run \(it holds data, notes.txt\)"):
        train(load_run_config(write_config(tmp_path, corpus, cache, run_dir=folder)))
    assert snapshot(folder) == before and sorted(p.name for p in folder.iterdir()) == ["data", "notes.txt"]
