"""The machine a command runs on: the line every report and benchmark prints about it, and torch's thread count
from the cores that are free (on a machine whose cores are busy with other processes, threads beyond the free
cores spin against them: docs/benchmarks, 2 threads on 2 cores with one busy decode 2.1x and train 1.6x slower)."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

OVERRIDE = "FULLBAND_THREADS"  # a thread count that wins over the measurement


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module says."""
    cpu = platform.processor() or platform.machine()
    try:
        return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), cpu)
    except OSError:
        return cpu


def hardware() -> str:
    """'CPU model, N cores, torch version (threads), GPU' in one line."""
    import torch

    cpu = cpu_model()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), {gpu}"


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all cores from /proc/stat (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [float(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_cores(interval: float = 0.1) -> float | None:
    """How many cores other processes keep busy, measured over `interval` seconds (None where it cannot be read)."""
    first = _cpu_times()
    time.sleep(interval)
    second = _cpu_times()
    if first is None or second is None or second[1] <= first[1]:
        return None
    return (second[0] - first[0]) / (second[1] - first[1]) * (os.cpu_count() or 1)


def choose(cores: int, busy: float | None, current: int) -> int:
    """Threads for `cores` usable cores of which `busy` are taken: the free ones, at least 1, at most `current`."""
    if busy is None:
        return current
    return max(1, min(current, cores, round(cores - busy)))


# The most threads any setting may ask for: torch's thread pool fails to allocate far beyond it (MemoryError at 4096)
# and llama.cpp crashes; far more than any machine's cores (the rounding of more threads than cores is still tested).
MAX_THREADS = 1024


def env_threads(var: str) -> int | None:
    """The thread count environment variable `var` sets: None when unset or empty; ConfigError naming it for
    anything but an integer 1 <= N <= MAX_THREADS ("01" is 1: read as a number, as everywhere)."""
    from fullband.errors import ConfigError
    from fullband.validate import ascii_int

    text = os.environ.get(var, "").strip()
    if not text:
        return None
    value = ascii_int(text)
    if value is None or not 1 <= value <= MAX_THREADS:
        raise ConfigError(f"{var}={text!r}; accepted: an integer 1 <= {var} <= {MAX_THREADS} (torch's threads), or "
                          "unset it to let fullband choose")
    return value


def fit_threads() -> str | None:
    """Set torch's threads to the free cores (FULLBAND_THREADS or OMP_NUM_THREADS, when set, win; a torchrun process
    keeps its own). -> a line saying what was done and why, or None when nothing changed. ConfigError for a
    FULLBAND_THREADS that is not a count (env_threads)."""
    import torch

    env = env_threads(OVERRIDE)
    if env is not None:
        torch.set_num_threads(env)
        return None
    if "OMP_NUM_THREADS" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    current = torch.get_num_threads()
    busy = busy_cores()
    threads = choose(cores, busy, current)
    if threads >= current:
        return None
    torch.set_num_threads(threads)
    return (f"{busy:.1f} of {cores} cores are busy with other processes: {threads} thread(s) instead of {current} "
            f"(more would spin against them; {OVERRIDE}=N sets the count)")


def run_threads(asked: int, key: str, *, resume: bool = False, recorded: int | None = None) -> tuple[int, str | None]:
    """Set torch's threads for a run and return (the count it records, a line to print or None). torch's results
    differ in the last bits with the thread count, so a run keeps one count from its start to its end:
    - a new run takes `asked` (its recipe's `key`) or, for 0, FULLBAND_THREADS when set, else the count this process
      runs with (the free cores, or OMP_NUM_THREADS);
    - a resumed run takes the count it `recorded` at its start (None: a run from before counts were recorded keeps
      this process's); a recipe's count, FULLBAND_THREADS or OMP_NUM_THREADS that differ are refused (ConfigError
      naming both), and the line says when this process would have chosen another count (the machine's load)."""
    import torch

    from fullband.errors import ConfigError

    if not resume:
        asked = asked or env_threads(OVERRIDE) or 0  # the CLI set it already; a Python caller's run takes it too
        if asked:
            torch.set_num_threads(asked)
        return torch.get_num_threads(), None
    current = torch.get_num_threads()
    if not recorded:
        return current, None
    fix = f"unset it or set it to {recorded}; a resume with another count is not bit-for-bit"
    if asked and asked != recorded:
        raise ConfigError(f"{key}={asked}, but the run started with {key}={recorded} (its run.json): {fix}")
    for var in (OVERRIDE, "OMP_NUM_THREADS"):
        value = env_threads(var)
        if value is not None and value != recorded:
            raise ConfigError(f"{var}={value}, but the run started with {recorded} thread(s) ({key} in its "
                              f"run.json): {fix}")
    torch.set_num_threads(recorded)
    if current == recorded:
        return recorded, None
    return recorded, (f"resuming with the run's {recorded} thread(s) ({key}, as it started), not the {current} this "
                      "machine's load would choose now: torch's results differ in the last bits with the thread count")


# glibc malloc settings, read when a process starts: blocks over 32 MB are not served by an mmap of their own, and
# freed memory is not handed back to the kernel (trimmed) while under 64 GiB.
KEEP_FREED_MEMORY = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**36)}


def keeps_freed_memory() -> bool:
    """Whether this process started with KEEP_FREED_MEMORY (or where it does not apply: not glibc)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return True
    return all(os.environ.get(k) is not None for k in KEEP_FREED_MEMORY)


def restart_keeping_freed_memory() -> None:
    """Start this command again (os.execv: the same process id, arguments and environment) with glibc keeping the
    memory of freed tensors, unless it already does or FULLBAND_MALLOC=default. A training step frees and takes
    again gigabytes of activations (k passes' worth, and the (B, T, V) logits of every pass); by default glibc hands
    large freed blocks back to the kernel and every step faults them in again, zero-filled, page by page. Measured
    on SmolLM2-135M (4 x 256 tokens, 2 threads): a three-pass step 3.48x transformers' one-pass step by default,
    3.12x with the memory kept (docs/benchmarks/real-smollm2.md). The process keeps its peak memory until it exits.
    Setting the variables with mallopt once Python runs did not give the same (measured 3.50x): they must be there
    from the start, before the first allocation. Not under torchrun (its agent watches the worker it started):
    there, `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 torchrun ...` does the same."""
    import sys

    if keeps_freed_memory() or os.environ.get("FULLBAND_MALLOC") == "default":
        return
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        return  # a worker torchrun started and watches: set the variables on torchrun's command line instead
    argv = list(getattr(sys, "orig_argv", []))
    if not argv:
        return
    os.environ.update(KEEP_FREED_MEMORY)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *argv[1:]])
