"""A run directory belongs to one process at a time; a run killed at any moment (tokenising, before its first
checkpoint, while writing one) resumes and leaves no debris; a full disk, a damaged run.json or trainer.json and
a config that differs from the run's are one-line errors that say what to do."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch

from conftest import write_config
from fullband import ConfigError
from fullband.errors import CheckpointError
from fullband.train.config import load_run_config
from fullband.train.trainer import train

CLI = [sys.executable, "-m", "fullband.cli"]


def child_env() -> dict[str, str]:
    """One thread per CLI child: micro-model matmuls gain nothing from more, and two spinning OpenMP threads in each
    of two children (or beside other work) on a 2-core machine slow every step by orders of magnitude."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=child_env())


def wait_for(condition, proc: subprocess.Popen | None = None, timeout: float = 120.0, every: float = 0.005) -> bool:
    """Poll `condition` until it holds (True), the process ends, or the time is up (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        if proc is not None and proc.poll() is not None:
            return condition()
        time.sleep(every)
    return False


def steps_logged(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if "loss_pass" in r]


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob(".*")) if folder.exists() else []


def refused_as_busy(proc_err: str) -> bool:
    return "in use by another fullband process" in proc_err or "already holds a run" in proc_err


# ---------------------------------------------------------------------- one process per run directory
def test_two_trainings_started_together_in_one_run_directory(tmp_path, corpus, cache):
    config = write_config(tmp_path, corpus, cache, steps=150, ckpt_every=50)
    procs = [start("train", str(config)) for _ in range(2)]
    done = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in done)
    assert codes == [0, 2], done
    loser = next(err for code, err in done if code == 2)
    assert refused_as_busy(loser) and "Traceback" not in loser
    assert steps_logged(tmp_path / "run") == list(range(1, 151))  # one run, nothing interleaved


def test_two_resumes_of_one_run_at_once(tmp_path, corpus, cache):
    config = write_config(tmp_path, corpus, cache, steps=200, ckpt_every=10)
    first = start("train", str(config))
    assert wait_for(lambda: (tmp_path / "run" / "step_000010").is_dir(), first)
    first.kill()
    first.wait()
    procs = [start("train", str(config), "--resume", str(tmp_path / "run")) for _ in range(2)]
    done = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert sorted(code for code, _ in done) == [0, 2], done
    assert "in use by another fullband process (pid" in next(err for code, err in done if code == 2)
    assert steps_logged(tmp_path / "run") == list(range(1, 201))


def test_a_run_directory_held_by_another_process_is_refused_until_it_ends(tmp_path, corpus, cache):
    """The lock is on the folder: a process that holds it keeps every other process out until it ends."""
    config = write_config(tmp_path, corpus, cache, steps=4, ckpt_every=2)
    train(load_run_config(config))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from fullband.files import lock_folder; lock_folder(sys.argv[1], 'x'); "
        "print('locked', flush=True); time.sleep(60)"), str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(Exception, match=r"is in use by another fullband process \(pid \d+\)"):
            train(load_run_config(config), resume=tmp_path / "run")
    finally:
        holder.kill()
        holder.wait()
    train(load_run_config(config), resume=tmp_path / "run")  # the holder is gone: the lock went with it


# ---------------------------------------------------------------------- kills at any moment
def big_corpus(root: Path, megabytes: int = 12) -> Path:
    """Standard-library text, enough of it that tokenising takes a moment (a kill can land inside it)."""
    root.mkdir()
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), key=lambda p: -p.stat().st_size)
    total, i = 0, 0
    while total < megabytes * 2**20:
        text = files[i % len(files)].read_bytes()
        (root / f"part{i:03d}.py").write_bytes(text)
        total += len(text)
        i += 1
    return root


def test_a_run_killed_at_any_moment_resumes_and_leaves_no_debris(tmp_path):
    rng = random.Random(7)
    corpus, cache = big_corpus(tmp_path / "corpus"), tmp_path / "cache"
    config = write_config(tmp_path, corpus, cache, steps=40, ckpt_every=20, keep_last=2)
    run_dir, tokens = tmp_path / "run", cache / "tokens"

    # 1. killed while tokenising: its temporary cache folder stays behind ...
    proc = start("train", str(config))
    saw = wait_for(lambda: any(p.name.startswith(".train-") for p in tokens.glob(".*")), proc)
    proc.kill()
    proc.wait()
    if saw:
        assert hidden(tokens), "the kill should have left the temporary folder it was writing"
    # 2. ... and the next run removes it; killed again before its first checkpoint
    proc = start("train", str(config))
    assert wait_for(lambda: (run_dir / "run.json").is_file(), proc)
    time.sleep(rng.uniform(0.0, 0.15))
    proc.kill()
    proc.wait()
    assert not list(run_dir.glob("step_*")), "the kill should land before the first checkpoint"
    assert hidden(tokens) == []
    # a fresh start is refused (it would lose the run), --resume starts it again from step 0
    again = run("train", str(config))
    assert again.returncode == 2 and "--resume" in again.stderr
    # 3. a checkpoint half-written when a kill came
    stale = run_dir / ".step_000020.tmp"
    stale.mkdir()
    (stale / "optimizer.pt").write_bytes(b"\0" * 4096)
    proc = start("train", str(config), "--resume", str(run_dir))
    assert wait_for(lambda: (run_dir / "step_000020").is_dir(), proc)
    time.sleep(rng.uniform(0.0, 0.3))
    proc.kill()
    proc.wait()
    resumed = run("train", str(config), "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert hidden(run_dir) == [] and hidden(tokens) == []
    assert steps_logged(run_dir) == list(range(1, 41))
    # the same weights as a run that was never interrupted
    reference = write_config(tmp_path, corpus, cache, "ref", steps=40, ckpt_every=20, keep_last=2)
    assert run("train", str(reference)).returncode == 0
    from safetensors.torch import load_file

    a = load_file(str(run_dir / "step_000040" / "model.safetensors"))
    b = load_file(str(tmp_path / "ref" / "step_000040" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_of_a_run_with_no_checkpoint_starts_from_step_zero(tmp_path, corpus, cache, capsys):
    from fullband.train.build import resolve
    from fullband.train.parallel import Dist

    config = write_config(tmp_path, corpus, cache, steps=6, ckpt_every=0)
    cfg, _ = resolve(load_run_config(config), Dist())
    # what a kill before the first checkpoint leaves: the (resolved) settings, some metrics
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text(json.dumps(cfg.to_dict()))
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss_pass": [5.0]}\n{"step": 2, "los')
    train(load_run_config(config), resume=tmp_path / "run")
    assert "holds no complete checkpoint yet" in capsys.readouterr().out
    assert steps_logged(tmp_path / "run") == [1, 2, 3, 4, 5, 6]


# ---------------------------------------------------------------------- messages that say what to do
def test_resume_with_a_different_config_names_every_differing_key(tmp_path, corpus, cache):
    config = write_config(tmp_path, corpus, cache, steps=4, ckpt_every=2)
    train(load_run_config(config))
    with pytest.raises(ConfigError) as info:
        train(load_run_config(config, ["optim.lr=0.01", "model.vocab_size=300", "model.d_model=48"]),
              resume=tmp_path / "run")
    msg = str(info.value)
    for part in ("optim: run has lr=0.02, config has lr=0.01", "model: run has vocab_size=259, config has "
                 "vocab_size=300", "model: run has d_model=32, config has d_model=48", "3 setting(s) differ"):
        assert part in msg, msg


def test_damaged_run_and_trainer_files_are_one_line_errors(tmp_path, corpus, cache):
    config = write_config(tmp_path, corpus, cache, steps=4, ckpt_every=2, keep_last=3)
    train(load_run_config(config))
    run_json = tmp_path / "run" / "run.json"
    good = run_json.read_text()
    run_json.write_text(good[: len(good) // 2])
    with pytest.raises(ConfigError, match=r"run.json is corrupted .*restore it"):
        train(load_run_config(config), resume=tmp_path / "run")
    run_json.write_text(json.dumps({k: v for k, v in json.loads(good).items() if k != "optim"}))
    with pytest.raises(ConfigError, match=r"lacks the section\(s\) optim"):
        train(load_run_config(config), resume=tmp_path / "run")
    run_json.write_text(good)
    trainer = tmp_path / "run" / "step_000004" / "trainer.json"
    state = json.loads(trainer.read_text())
    del state["tokens"]
    trainer.write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"trainer.json is damaged: it lacks tokens; resume from an earlier"):
        train(load_run_config(config), resume=tmp_path / "run" / "step_000004")
    done = run("train", str(config), "--resume", str(tmp_path / "run" / "step_000004"))
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------- a full disk
def unshare_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt || exit 3"],
                           capture_output=True)
    return probe.returncode == 0


needs_tmpfs = pytest.mark.skipif(not unshare_available(),
                                 reason="cannot mount a small tmpfs here (unshare -rm / mount not permitted)")


@needs_tmpfs
def test_a_full_disk_during_a_checkpoint_is_said_plainly_and_keeps_the_last_checkpoint(tmp_path, corpus, cache):
    disk = tmp_path / "disk"
    disk.mkdir()
    config = write_config(tmp_path, corpus, cache, steps=8, ckpt_every=2, keep_last=5, run_dir=disk / "run")
    script = f"""
mount -t tmpfs -o size=1m tmpfs {disk} || exit 90
{sys.executable} -m fullband.cli train {config} 2> {tmp_path / 'err.txt'}
echo "train_rc=$?"
ls -a {disk / 'run'}
{sys.executable} -m fullband.cli doctor {disk / 'run'} --quick > {tmp_path / 'doctor.txt'}
echo "doctor_rc=$?"
"""
    out = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=600,
                         env=child_env()).stdout
    err = (tmp_path / "err.txt").read_text()
    assert "train_rc=2" in out, (out, err)
    assert "the disk is full" in err and str(disk / "run") in err and "Traceback" not in err
    listing = out.split("train_rc=2")[1].split("doctor_rc")[0].split()
    assert "step_000002" in listing and not [n for n in listing if n.endswith(".tmp")]
    doctor = (tmp_path / "doctor.txt").read_text()
    assert "verdict: resumable from step_" in doctor and "FAIL" not in doctor


@needs_tmpfs
def test_a_full_disk_while_saving_a_model_names_the_folder_and_leaves_nothing(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    assert run("init", "--config", "tiny", "--out", str(tmp_path / "small")).returncode == 0  # 3.6 MB > 1 MB
    cli = " ".join(CLI)
    script = f"""
mount -t tmpfs -o size=1m tmpfs {disk} || exit 90
{cli} init --config tiny --out {disk / 'init'} 2> {tmp_path / 'init.txt'}; echo "init_rc=$?"
{cli} convert {tmp_path / 'small'} {disk / 'hf'} 2> {tmp_path / 'convert.txt'}; echo "convert_rc=$?"
ls -a {disk}
"""
    out = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300,
                         env=child_env()).stdout
    assert "init_rc=2" in out and "convert_rc=2" in out, out
    for name, folder in (("init", "init"), ("convert", "hf")):
        err = (tmp_path / f"{name}.txt").read_text()
        assert "the disk is full" in err and f"{disk / folder}'" in err and "Traceback" not in err, err
    assert out.split("convert_rc=2")[1].split() == [".", ".."], out  # no temporary folder left behind


def test_a_damaged_token_cache_says_so(tmp_path, corpus):
    from fullband.errors import DataError

    config = write_config(tmp_path, corpus, tmp_path / "cache", steps=2, ckpt_every=0)
    train(load_run_config(config))
    shard = next((tmp_path / "cache" / "tokens").glob("train-*/tokens-00000.bin"))
    blob = bytearray(shard.read_bytes())
    blob[: len(blob) // 2] = b"\xff" * (len(blob) // 2)  # the same size: only the contents are garbage
    shard.write_bytes(bytes(blob))
    again = write_config(tmp_path, corpus, tmp_path / "cache", "again", steps=2, ckpt_every=0)
    with pytest.raises(DataError, match=r"token cache .*train-\w+ is damaged: tokens \d+\.\.\d+ hold id 65535, but "
                                        r"its tokenizer has 259 ids; delete .* and it is rebuilt"):
        train(load_run_config(again))


def test_a_full_disk_while_exporting_a_gguf_file_names_it_and_leaves_nothing(tmp_path):
    """The GGUF file and its sidecar written on a full disk (a 1 MB tmpfs): one line naming the file asked for
    (not stdout's pipe, nor a temporary), no traceback, nothing left beside it."""
    pytest.importorskip("gguf")
    disk = tmp_path / "disk"
    disk.mkdir()
    assert run("init", "--config", "tiny", "--set", "qk_norm=false", "--set", "input_norm=false", "--out",
               str(tmp_path / "small")).returncode == 0  # a Llama-style model of 3.6 MB > 1 MB
    cli = " ".join(CLI)
    script = f"""
mount -t tmpfs -o size=1m tmpfs {disk} || exit 90
{cli} convert {tmp_path / 'small'} {disk / 'm.gguf'} 2> {tmp_path / 'gguf.txt'} | cat; echo "gguf_rc=$?"
ls -a {disk}
"""
    out = subprocess.run(["unshare", "-rm", "bash", "-c", "set -o pipefail; " + script], capture_output=True,
                         text=True, timeout=300, env=child_env()).stdout
    assert "gguf_rc=2" in out, out
    err = (tmp_path / "gguf.txt").read_text()
    assert "the disk is full" in err and f"{disk / 'm.gguf'}'" in err and "Traceback" not in err, err
    assert err.count("\n") == 1 and "pipe:" not in err, err
    assert out.split("gguf_rc=2")[1].split() == [".", ".."], out


def test_a_disk_that_fills_while_the_sidecar_is_written_names_the_pair_and_leaves_nothing(tmp_path):
    """A disk with room for the GGUF file but not its sidecar (safetensors hides the errno in a SafetensorError):
    one line naming both files, no traceback, neither file nor a temporary left."""
    pytest.importorskip("gguf")
    disk = tmp_path / "disk"
    disk.mkdir()
    assert run("init", "--config", "tiny", "--set", "qk_norm=false", "--set", "input_norm=false", "--out",
               str(tmp_path / "small")).returncode == 0
    assert run("convert", str(tmp_path / "small"), str(tmp_path / "ref.gguf")).returncode == 0
    room = -(-(tmp_path / "ref.gguf").stat().st_size // 4096) * 4096 + 4096  # the GGUF file and one page more
    assert (tmp_path / "ref.feedback.safetensors").stat().st_size > 2 * 4096  # 130 KB: the sidecar cannot fit
    cli = " ".join(CLI)
    script = f"""
mount -t tmpfs -o size={room} tmpfs {disk} || exit 90
{cli} convert {tmp_path / 'small'} {disk / 'm.gguf'} 2> {tmp_path / 'side.txt'}; echo "side_rc=$?"
ls -a {disk}
"""
    out = subprocess.run(["unshare", "-rm", "bash", "-c", script], capture_output=True, text=True, timeout=300,
                         env=child_env()).stdout
    assert "side_rc=2" in out, out
    err = (tmp_path / "side.txt").read_text()
    assert "the disk is full" in err and "m.gguf and m.feedback.safetensors" in err and "Traceback" not in err, err
    assert err.count("\n") == 1, err
    assert out.split("side_rc=2")[1].split() == [".", ".."], out
