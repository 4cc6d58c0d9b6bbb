"""Torch's thread count from the free cores (fullband.machine): the rule, the overrides, and the CLI restoring the
caller's count."""

from __future__ import annotations

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
