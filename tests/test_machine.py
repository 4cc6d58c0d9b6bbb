"""Torch's thread count from the free cores (fullband.machine): the rule, the overrides, and the CLI restoring the
caller's count."""

from __future__ import annotations

import pytest
import torch

from fullband import machine as threads


def test_threads_follow_the_free_cores():
    assert threads.choose(2, 0.1, 2) == 2  # idle
    assert threads.choose(2, 1.0, 2) == 1  # one core busy
    assert threads.choose(2, 1.9, 2) == 1  # never fewer than one
    assert threads.choose(8, 2.2, 4) == 4  # never more than torch had
    assert threads.choose(2, None, 2) == 2  # not measurable: unchanged


def test_a_busy_core_lowers_the_threads_and_says_so(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(threads.OVERRIDE, raising=False)
    monkeypatch.setattr(threads, "busy_cores", lambda interval=0.1: 1.0)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    try:
        torch.set_num_threads(2)
        message = threads.fit_threads()
        assert torch.get_num_threads() == 1 and "1.0 of 2 cores are busy" in message and threads.OVERRIDE in message
        torch.set_num_threads(2)
        monkeypatch.setenv(threads.OVERRIDE, "2")  # the user's count wins
        assert threads.fit_threads() is None and torch.get_num_threads() == 2
        monkeypatch.delenv(threads.OVERRIDE)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert threads.fit_threads() is None and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_busy_cores_reads_the_machine():
    busy = threads.busy_cores(0.05)
    assert busy is None or 0.0 <= busy <= (threads.os.cpu_count() or 1) + 1e-6


def test_a_command_on_a_busy_machine_says_so_and_gives_the_caller_its_threads_back(tmp_path, monkeypatch, capsys):
    from conftest import tiny_model
    from fullband.cli import main
    from fullband.data.tokenizer import ByteTokenizer

    tiny_model().save(tmp_path / "m", tokenizer=ByteTokenizer())
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(threads.OVERRIDE, raising=False)
    monkeypatch.setattr(threads, "busy_cores", lambda interval=0.1: 1.0)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(["generate", "--checkpoint", str(tmp_path / "m"), "--prompt", "x", "--max-new-tokens", "2"]) == 0
        assert "cores are busy with other processes: 1 thread(s) instead of 2" in capsys.readouterr().err
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_heavy_command_restarts_once_keeping_freed_memory(tmp_path, model):
    """`fullband bench train` as a program: started without glibc's settings it re-executes itself with them (the
    run reports freed_memory_kept); FULLBAND_MALLOC=default keeps the default allocator and starts once."""
    import json
    import os
    import subprocess
    import sys

    model.save(tmp_path / "tiny")
    env = {k: v for k, v in os.environ.items() if k not in threads.KEEP_FREED_MEMORY}
    for setting, kept in ((None, True), ("default", False)):
        if setting:
            env["FULLBAND_MALLOC"] = setting
        out = tmp_path / f"{setting}.json"
        subprocess.run([sys.executable, "-m", "fullband.cli", "bench", "train", "--model", str(tmp_path / "tiny"),
                        "--batch", "1", "--seq-len", "8", "--rounds", "1", "--json", str(out)], env=env, check=True,
                       capture_output=True, timeout=120)
        assert json.loads(out.read_text())["freed_memory_kept"] is kept


@pytest.mark.parametrize("value", ["0", "-2", "1000000", "two", "1.5"])
def test_a_thread_count_that_is_not_one_is_refused_in_one_line_everywhere(value, monkeypatch, capsys):
    """FULLBAND_THREADS, train.threads / rl.threads and the --threads flags take one rule: an integer 1..1024 (0
    in a recipe: chosen at the start); 0 and negatives were silently 1, a million crashed torch's thread pool."""
    from fullband.cli import main

    monkeypatch.setenv("FULLBAND_THREADS", value)
    assert main(["generate", "--checkpoint", "nowhere", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"FULLBAND_THREADS={value!r}; accepted: an integer 1 <= FULLBAND_THREADS <= " \
        "1024" in err, err


def test_thread_counts_are_read_one_way(monkeypatch, capsys):
    import torch

    from fullband.cli import main
    from fullband.errors import ConfigError
    from fullband.machine import run_threads
    from fullband.rl.run import RLConfig
    from fullband.train.config import TrainConfig

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("FULLBAND_THREADS", "01")  # the same count as 1
        assert run_threads(0, "train.threads", resume=True, recorded=1)[0] == 1
        monkeypatch.setenv("FULLBAND_THREADS", "2")
        with pytest.raises(ConfigError, match="FULLBAND_THREADS=2, but the run started with 1 thread"):
            run_threads(0, "train.threads", resume=True, recorded=1)
    finally:
        torch.set_num_threads(before)
    for make, key in ((lambda n: TrainConfig(threads=n), "train.threads"),
                      (lambda n: RLConfig(init_from="x", threads=n), "rl.threads")):
        with pytest.raises(ConfigError, match=rf"{key}=4096 is invalid; accepted: .*{key} < 1025"):
            make(4096)
        assert make(1024).threads == 1024
    for args in (["bench", "decode", "--model", "shipped:smollm2", "--threads", "1000000"],
                 ["generate", "--checkpoint", "x", "--prompt", "y", "--engine", "llamacpp", "--threads", "0"]):
        with pytest.raises(SystemExit):
            main(args)
        assert "accepted: an integer 1 <= threads <= 1024" in capsys.readouterr().err
