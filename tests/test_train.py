"""Training end to end on a micro model: metrics, checkpoints, exact resume after SIGKILL, 2-process DDP
equivalence, the divergence guard, and bad input that writes nothing."""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fullband.errors import ConfigError
from fullband.train.config import load_run_config
import fullband.train.trainer as trainer_module
from fullband.train.trainer import TrainingDiverged, train

# the corpus and cache fixtures live in conftest too
from conftest import MICRO_PASSES, assert_resume_is_bitwise, losses, micro_start, torchrun, write_config


def cli(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "fullband.cli", *args], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_training_run_writes_metrics_checkpoints_and_plot(tmp_path, corpus, cache):
    cfg = load_run_config(write_config(tmp_path, corpus, cache, steps=10, keep_last=2))
    result = train(cfg)
    run = tmp_path / "run"
    assert result["steps"] == 10 and set(result["eval"]) == {"1", "2"}
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step_")) == ["step_000008", "step_000010"]
    assert {"run.json", "metrics.jsonl", "tokenizer.json", "loss.png"} <= {p.name for p in run.iterdir()}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss_pass" in r]
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert all(len(r["loss_pass"]) == r["k"] for r in steps)
    assert all(r["k"] == 1 for r in steps[:3])  # the first stage is single-pass
    assert steps[-1]["compute_tokens"] == sum(256 * r["k"] for r in steps)
    # training FLOPs: each step's own k counted, cumulative, in the training and eval rows and the result
    from itertools import accumulate

    from fullband.model.flops import train_flops

    flops = list(accumulate(256 * train_flops(cfg.model, r["k"], seq_len=32) for r in steps))
    assert [r["flops"] for r in steps] == flops and result["flops"] == flops[-1]
    assert [(r["step"], r["flops"]) for r in rows if "eval" in r] == [(4, flops[3]), (8, flops[7]), (10, flops[9])]
    assert {"lr", "grad_norm", "state_rms", "tok_per_s"} <= set(steps[0])
    assert steps[-1]["loss_pass"][0] < steps[0]["loss_pass"][0]
    # a checkpoint is a loadable model folder
    from fullband import FullbandLM, generate

    model = FullbandLM.load(run / "step_000010")
    assert model.config.bos_token_id == 256
    assert len(generate(model, [[256, 100, 101]], 4, mode="fused")[0]) == 4
    for name in ("optimizer.pt", "trainer.json", "rng.pt", "model.safetensors", "config.json", "tokenizer.json"):
        assert (run / "step_000010" / name).is_file()


# the adaptive schedule measures every 3 steps: its mix (and so every later k) depends on the measurements
ADAPTIVE = '{schedule = "adaptive", every = 3, horizon = 4, windows = 2, cap = 4}'


ANCHORED = MICRO_PASSES + '\ndistill = 0.3\nanchor = 0.5\ninit_from = "{start}"'


@pytest.mark.parametrize("passes", [ANCHORED, ADAPTIVE], ids=["fixed-distill-anchor", "adaptive"])
def test_resume_after_sigkill_is_bitwise_identical(tmp_path, corpus, cache, passes):
    """The fixed schedule runs with self-distillation (train.distill, its weight a function of the step) and the anchor
    (train.anchor: a frozen copy of the start, built again by the resumed process)."""
    passes = passes.replace("{start}", str(micro_start(tmp_path)))
    # long enough (a few seconds) that the kill, 0-0.3 s after the second checkpoint, lands mid-run
    whole = write_config(tmp_path, corpus, cache, "whole", steps=150, ckpt_every=0, keep_last=3,  # saves at the end
                         passes=passes)
    part = write_config(tmp_path, corpus, cache, "part", steps=150, ckpt_every=2, keep_last=3, passes=passes)
    ref = cli("train", str(whole))  # the uninterrupted run, beside the victim (one thread each)
    victim = cli("train", str(part))
    deadline = time.time() + 120
    while not (tmp_path / "part" / "step_000004").exists():
        assert victim.poll() is None and time.time() < deadline, victim.stderr.read() if victim.poll() else "timeout"
        time.sleep(0.02)
    time.sleep(random.uniform(0.0, 0.3))  # a random moment: maybe mid-step, maybe mid-checkpoint
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not (tmp_path / "part" / "step_000150").exists(), "the victim finished before it was killed"
    resumed = cli("train", str(part), "--resume", str(tmp_path / "part"))
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert "resumed from" in out
    _, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err
    assert losses(tmp_path / "part") == losses(tmp_path / "whole")
    assert adapt_rows(tmp_path / "part") == adapt_rows(tmp_path / "whole")
    if passes == ADAPTIVE:
        assert len(adapt_rows(tmp_path / "whole")) == 49  # steps 3, 6, ..., 147 (none at the last step)
    else:
        rows = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
        assert sum(r.get("distill", 0) > 0 for r in rows) > 50  # the term ran in the resumed run's fed steps
        assert sum(r.get("anchor", 0) > 0 for r in rows) > 50  # and the anchor's
    a = load_file(str(tmp_path / "whole" / "step_000150" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "step_000150" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    opt_a = torch.load(tmp_path / "whole" / "step_000150" / "optimizer.pt", weights_only=False)
    opt_b = torch.load(tmp_path / "part" / "step_000150" / "optimizer.pt", weights_only=False)
    assert json.dumps(opt_a["normuon"]["param_groups"], default=str) == json.dumps(opt_b["normuon"]["param_groups"], default=str)
    for kind in ("normuon", "adam"):
        for key, state in opt_a[kind]["state"].items():
            assert all(torch.equal(v, opt_b[kind]["state"][key][n]) for n, v in state.items() if torch.is_tensor(v))


def train_in_one_and_two_processes(tmp_path, corpus, cache, **kw) -> tuple[Path, Path]:
    """The micro recipe (write_config's `kw`, no checkpoints) trained in one process, then in two
    (torch.distributed.run, gloo on CPU) with the same global batch -> the two run directories."""
    one = write_config(tmp_path, corpus, cache, "one", ckpt_every=0, **kw)
    two = write_config(tmp_path, corpus, cache, "two", ckpt_every=0, **kw)
    ref = cli("train", str(one))
    _, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err
    done = torchrun(["-m", "fullband.cli", "train", str(two)])
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path / "one", tmp_path / "two"


def assert_same_losses(a: list[list[float]], b: list[list[float]], tol: float = 1e-5) -> None:
    """Two runs' per-pass losses (conftest.losses): the same pass counts, every loss within tol."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y)
        assert max(abs(p - q) for p, q in zip(x, y)) <= tol, (x, y)


def test_a_run_out_of_time_stops_with_a_checkpoint_and_resumes_to_the_same_run(tmp_path, corpus, cache, capsys):
    """train.stop_after_minutes: every invocation stops after its first step (a limit already passed), keeps a
    checkpoint and says how to go on; resumed invocation after invocation, the run equals the uninterrupted one."""
    whole = train(load_run_config(write_config(tmp_path, corpus, cache, "whole", steps=5, ckpt_every=0)))
    assert whole["stopped"] is False
    part = write_config(tmp_path, corpus, cache, "part", steps=5, ckpt_every=0, keep_last=1)
    results, resume = [], None
    while not results or results[-1]["stopped"]:
        results.append(train(load_run_config(part, ["train.stop_after_minutes=1e-9"]), resume=resume))
        resume = tmp_path / "part"
    assert [r["steps"] for r in results] == [1, 2, 3, 4, 5]
    said = capsys.readouterr().out
    assert "stopped after step 1 of 5: train.stop_after_minutes=1e-09 passed; checkpoint " in said
    assert f"--resume {tmp_path / 'part'}" in said
    assert losses(tmp_path / "part") == losses(tmp_path / "whole")
    a, b = (load_file(str(tmp_path / n / "step_000005" / "model.safetensors")) for n in ("whole", "part"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    (tmp_path / "bad").mkdir()
    _fails(tmp_path / "bad", write_config(tmp_path / "bad", corpus, cache), ["train.stop_after_minutes=-1"],
           match=r"train.stop_after_minutes=-1")


def test_two_process_ddp_matches_one_process(tmp_path, corpus, cache):
    one, two = train_in_one_and_two_processes(tmp_path, corpus, cache, steps=5, micro=2)
    a, b = losses(one), losses(two)
    assert len(a) == 5
    assert any(len(x) > 1 for x in a)  # multi-pass steps were exercised
    assert_same_losses(a, b)


def adapt_rows(run_dir: Path) -> list[tuple]:
    """(step, mix, measurement) of every step of a run's metrics.jsonl: what the adaptive schedule drew from and
    decided."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["mix"], r["adapt"]) for r in rows if "adapt" in r]


def test_adaptive_schedule_agrees_across_ddp_ranks(tmp_path, corpus, cache):
    # every rank measures, takes the largest value and so decides the same mix; one process decides it too
    one, two = train_in_one_and_two_processes(tmp_path, corpus, cache, steps=7, micro=2,
                                              passes='{schedule = "adaptive", every = 2, horizon = 4, windows = 2, cap = 4}')
    a, b = losses(one), losses(two)
    assert [len(x) for x in a] == [len(x) for x in b]
    assert_same_losses(a, b)
    ra, rb = adapt_rows(one), adapt_rows(two)
    assert [r[0] for r in ra] == [2, 4, 6] and [(r[0], r[1], r[2]["share"], r[2]["top"]) for r in ra] == \
        [(r[0], r[1], r[2]["share"], r[2]["top"]) for r in rb]
    assert all(abs(x[2]["growth"] - y[2]["growth"]) < 1e-4 for x, y in zip(ra, rb))


def test_divergence_guard_stops_and_keeps_last_checkpoint(tmp_path, corpus, cache):
    path = write_config(tmp_path, corpus, cache, steps=30, ckpt_every=1, keep_last=3)
    cfg = load_run_config(path, ["optim.lr=1e6", "optim.adam_lr=1e6", "optim.grad_clip=0.0", "train.warmup_steps=0"])
    with pytest.raises(TrainingDiverged, match=r"non-finite loss at step (\d+) in (pass \d|the z-loss term)") as info:
        train(cfg)
    msg = str(info.value)
    assert "Last good checkpoint" in msg and "lower learning rate" in msg
    from fullband import FullbandLM
    from fullband.train.checkpoint import list_checkpoints

    last = list_checkpoints(tmp_path / "run")
    assert last, "a checkpoint from before the divergence should remain"
    FullbandLM.load(last[-1])  # intact and loadable


def test_activation_checkpointing_gives_the_same_losses(tmp_path, corpus, cache):
    a = train(load_run_config(write_config(tmp_path, corpus, cache, "plain", steps=6, ckpt_every=0)))
    b = train(load_run_config(write_config(tmp_path, corpus, cache, "ac", steps=6, ckpt_every=0),
                              ["train.activation_checkpointing=true"]))
    la, lb = losses(tmp_path / "plain"), losses(tmp_path / "ac")
    assert all(abs(x - y) <= 1e-5 for xs, ys in zip(la, lb) for x, y in zip(xs, ys))
    assert a["eval"].keys() == b["eval"].keys()


# ---------------------------------------------------------------------- bad input writes nothing
def _fails(tmp_path: Path, config: Path, overrides=(), match: str = "") -> None:
    from fullband.errors import FullbandError

    with pytest.raises(FullbandError, match=match):
        train(load_run_config(config, list(overrides)))
    assert not (tmp_path / "run").exists(), "a failed start must not leave a run directory"


def test_malformed_toml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3")
    with pytest.raises(ConfigError, match="malformed TOML"):
        load_run_config(bad)


def test_unknown_key_suggests_closest(tmp_path, corpus, cache):
    path = write_config(tmp_path, corpus, cache)
    with pytest.raises(ConfigError, match=r"unknown key 'train.step'.*did you mean 'steps'"):
        load_run_config(path, ["train.step=3"])
    with pytest.raises(ConfigError, match=r"unknown key 'trian'.*did you mean 'train'"):
        load_run_config(path, ["trian.steps=3"])


def test_wrong_types(tmp_path, corpus, cache):
    path = write_config(tmp_path, corpus, cache)
    with pytest.raises(ConfigError, match=r"train.steps='many' must be int"):
        load_run_config(path, ['train.steps="many"'])
    with pytest.raises(ConfigError, match=r"model.d_model=3.5 must be int"):
        load_run_config(path, ["model.d_model=3.5"])


def test_null_override_unsets_an_optional_key(tmp_path, corpus, cache):
    """TOML has no null: the bare word null in an override is one (what the type errors call it), so a recipe's
    optional setting can be taken back; a key that is not optional refuses it by name, and "null" quoted is text."""
    path = write_config(tmp_path, corpus, cache)
    assert load_run_config(path, ["model.sliding_window=8"]).model.sliding_window == 8
    assert load_run_config(path, ["model.sliding_window=8", "model.sliding_window= null"]).model.sliding_window is None
    with pytest.raises(ConfigError, match=r"train.steps=None must be int"):
        load_run_config(path, ["train.steps=null"])
    with pytest.raises(ConfigError, match=r"model.sliding_window='null' has the wrong type; accepted: int or null"):
        load_run_config(path, ['model.sliding_window="null"'])


def test_seq_len_longer_than_max_seq_len(tmp_path, corpus, cache):
    with pytest.raises(ConfigError, match=r"train.seq_len=256 exceeds model.max_seq_len=128"):
        load_run_config(write_config(tmp_path, corpus, cache), ["train.seq_len=256", "train.global_batch_tokens=1024"])


def test_train_tokens_trains_on_the_first_tokens_only(tmp_path, corpus, cache):
    """data.train_tokens: the training stream is the split's first N tokens (windows drawn from them only, epoch
    after epoch); the held-out split is unchanged; a count outside [seq_len + 1, the split] is refused by name."""
    from fullband.train.trainer import Trainer

    path = write_config(tmp_path, corpus, cache, steps=3, ckpt_every=0)
    whole = Trainer(load_run_config(path, ["log.run_dir=\"%s\"" % (tmp_path / "whole")]))
    some = Trainer(load_run_config(path, ["data.train_tokens=300", "log.run_dir=\"%s\"" % (tmp_path / "some")]))
    try:
        assert len(some.data.train) == 300 < len(whole.data.train)
        assert (some.data.train.slice(0, 300) == whole.data.train.slice(0, 300)).all()
        assert len(some.data.val) == len(whole.data.val)
        assert some.data.sampler.n_windows == 300 // 33 < whole.data.sampler.n_windows  # windows of seq_len + 1
        seen = {int(w) for step in range(4) for micro in range(some.data.sampler.accum_steps)
                for w in some.data.sampler.windows(step, micro)}
        assert seen == set(range(some.data.sampler.n_windows))  # 4 steps of 8 windows: every window, repeated
        have = len(whole.data.train)
    finally:
        whole.close(), some.close()
    for n in (32, have + 1):
        with pytest.raises(ConfigError, match=rf"data.train_tokens={n:,}: the training split .* has {have:,} tokens"):
            Trainer(load_run_config(path, [f"data.train_tokens={n}", "log.run_dir=\"%s\"" % (tmp_path / f"n{n}")]))
        assert not (tmp_path / f"n{n}").exists(), "a refused start leaves no run directory"
    with pytest.raises(ConfigError, match="data.train_tokens=300 limits a text corpus"):
        load_run_config(path, ["data.train_tokens=300", 'data.format="tracking"', 'data.corpus="parity:4"'])


def test_missing_corpus_path(tmp_path, cache):
    path = write_config(tmp_path, tmp_path / "no-such-corpus", cache)
    _fails(tmp_path, path, match="no-such-corpus")


def test_empty_corpus(tmp_path, cache):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("")
    _fails(tmp_path, write_config(tmp_path, empty, cache), match="empty")


def test_existing_run_dir_needs_resume(tmp_path, corpus, cache):
    path = write_config(tmp_path, corpus, cache, steps=2, ckpt_every=0)
    train(load_run_config(path))
    with pytest.raises(ConfigError, match="already holds a run; resume it with --resume"):
        train(load_run_config(path))


def test_resume_with_incompatible_config(tmp_path, corpus, cache):
    path = write_config(tmp_path, corpus, cache, steps=4, ckpt_every=2)
    train(load_run_config(path))
    with pytest.raises(ConfigError, match=r"cannot resume .* model: run has .*d_model.*32"):
        train(load_run_config(path, ["model.d_model=48"]), resume=tmp_path / "run")
    with pytest.raises(ConfigError, match=r"train.seq_len"):
        train(load_run_config(path, ["train.seq_len=16"]), resume=tmp_path / "run")


def test_resume_from_checkpoint_missing_files(tmp_path, corpus, cache):
    from fullband.errors import CheckpointError

    path = write_config(tmp_path, corpus, cache, steps=4, ckpt_every=2, keep_last=5)
    train(load_run_config(path))
    (tmp_path / "run" / "step_000004" / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match="missing optimizer.pt"):
        train(load_run_config(path), resume=tmp_path / "run")
    (tmp_path / "run" / "step_000002" / "rng.pt").unlink()
    with pytest.raises(CheckpointError, match="incomplete: missing rng.pt"):
        train(load_run_config(path), resume=tmp_path / "run" / "step_000002")


def test_fsdp2_matches_ddp_and_resumes_exactly(tmp_path, corpus, cache):
    one = write_config(tmp_path, corpus, cache, "one", steps=4, micro=2, ckpt_every=0)
    fsdp = write_config(tmp_path, corpus, cache, "fsdp", steps=4, micro=2, ckpt_every=2, keep_last=5)
    ref = cli("train", str(one))
    _, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err
    launch = ["-m", "fullband.cli", "train", str(fsdp), "--set", 'train.parallel="fsdp"']
    done = torchrun(launch)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "fsdp"
    assert {"optimizer.rank0.pt", "optimizer.rank1.pt"} <= set(os.listdir(run / "step_000004"))
    full = losses(run)
    for x, y in zip(losses(tmp_path / "one"), full):
        assert max(abs(p - q) for p, q in zip(x, y)) <= 1e-5, (x, y)
    weights = load_file(str(run / "step_000004" / "model.safetensors"))
    import shutil

    shutil.rmtree(run / "step_000004")
    done = torchrun(launch + ["--resume", str(run)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(run) == full
    again = load_file(str(run / "step_000004" / "model.safetensors"))
    assert all(torch.equal(weights[k], again[k]) for k in weights)


@pytest.fixture
def one_thread():
    """Small matmuls on one thread: on a loaded 2-core machine two spinning OpenMP threads make a step ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_paper_1b_recipe_builds_and_takes_one_step(tmp_path, corpus, cache, one_thread):
    """The paper's 1B recipe (configs/paper-1b.toml) as written: its architecture and optimiser built at full size
    on the meta device (shapes, layer options, parameter count, the routing of every parameter; nothing
    allocated), then one three-pass optimizer step through the Trainer of the same recipe narrowed to D 128 and
    12 layers, every architecture option kept and a window shorter than the sequence. (A real full-size step is
    minutes and ~12 GB on a CPU.)"""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from fullband.train.build import build
    from fullband.train.optim import canonical_name
    from fullband.train.parallel import Dist, unwrap
    from fullband.train.trainer import Trainer

    recipe = Path(__file__).resolve().parents[1] / "configs" / "paper-1b.toml"
    cfg = load_run_config(recipe, [f'log.run_dir="{tmp_path / "unused"}"'])
    m = cfg.model
    assert (m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff) == (100352, 1536, 24, 16, 8, 6656)
    assert m.qk_norm and m.attn_gate and m.tie_embeddings and (m.fusion, m.feedback) == ("gated", "final")
    assert (m.sliding_window, m.global_every) == (2048, 6)
    t = cfg.train
    assert t.parallel == "fsdp" and t.activation_checkpointing and t.compile  # single process: no sharding
    assert cfg.data.tokenizer == "bpe" and cfg.data.bpe_vocab_size == m.vocab_size

    # ---- full size, on the meta device: the run's own build step (model, AC + compile wrapping, optimizer)
    meta = torch.device("meta")
    with meta:
        built = build(cfg, Dist(device=meta))
    model = unwrap(built.model)
    assert all(isinstance(b, CheckpointWrapper) for b in model.blocks)
    params = dict(model.named_parameters())
    params_by_id = {id(p): p for p in params.values()}
    n = sum(p.numel() for p in params.values())
    print(f"paper-1b parameters: {n / 1e9:.3f}B")
    D, F, H, Hk, Dh, L, V = 1536, 6656, 16, 8, 96, 24, 100352
    per_layer = (H + 2 * Hk) * Dh * D + H * Dh * D + H * D + (H + Hk) * Dh + 2 * F * D + F * D + 2 * D
    assert n == V * D + 2 * D * D + L * per_layer + 2 * D  # embedding (tied), gated fusion, blocks, norm_in/out
    assert 1.0e9 < n < 1.3e9 and round(n / 1e9, 2) == 1.07
    assert all(p.is_meta for p in params.values())
    assert model.lm_head is None and model.embed.weight.shape == (V, D)
    assert [b.attn.window for b in model.blocks] == ([2048] * 5 + [None]) * 4  # full attention every sixth layer
    for b in model.blocks:
        a = b.attn
        assert a.wqkv.weight.shape == ((H + 2 * Hk) * Dh, D) and a.wo.weight.shape == (D, H * Dh)
        assert a.w_gate.weight.shape == (H, D) and a.qk_gain.shape == (H + Hk, Dh)  # per-head gates, QK-norm
        assert b.mlp.w_in.weight.shape == (2 * F, D) and b.mlp.w_down.weight.shape == (D, F)
    # every full-size parameter in exactly one group, at the recipe's lr / weight decay
    owner, kind = {}, {}
    for opt_name, opt in built.optimizer.optimizers.items():
        for g in opt.param_groups:
            for name, p in zip(g["names"], g["params"], strict=True):
                assert name not in owner and params_by_id.get(id(p)) is p, name
                owner[name], kind[name] = g, opt_name
    assert set(owner) == {canonical_name(k) for k in params} and len(owner) == len(params)
    muon = {k for k in owner if kind[k] == "normuon"}
    hidden = r"^(fusion\.w_[ug]|blocks\.\d+\.(attn\.(wqkv|wo|w_gate)|mlp\.(w_in|w_down)))\.weight$"
    assert muon == {k for k in owner if re.match(hidden, k)} and len(muon) == 2 + 5 * L
    for k, g in owner.items():
        lr, wd = (0.01, 0.01) if k in muon else (0.0005, 0.0)
        assert (g["base_lr"], g["base_wd"]) == (lr, wd) == (g["lr"], g["weight_decay"]), k
    assert owner["blocks.0.attn.wqkv.weight"]["splits"] == (H * Dh, Hk * Dh, Hk * Dh)
    assert owner["blocks.0.mlp.w_in.weight"]["splits"] == (F, F)

    # ---- one real step: the same recipe narrowed (D 128, 12 layers, window 16 < 64 positions), full vocabulary
    cfg = load_run_config(recipe, [
        "model.d_model=128", "model.n_layers=12", "model.d_ff=512", "model.sliding_window=16",
        "train.seq_len=64", "train.global_batch_tokens=128", "train.steps=10", "train.warmup_steps=1",
        "train.compile=false", f'data.corpus="{corpus}"', 'data.tokenizer="byte"', f'data.cache_dir="{cache}"',
        f'log.run_dir="{tmp_path / "p1b"}"', "log.progress=false",
    ])
    trainer = Trainer(cfg)
    try:
        model = unwrap(trainer.model)
        assert all(isinstance(b, CheckpointWrapper) for b in model.blocks)
        assert [b.attn.window for b in model.blocks] == ([16] * 5 + [None]) * 2
        assert model.config.n_heads == 16 and model.config.n_kv_heads == 8 and model.blocks[0].attn.w_gate is not None
        assert trainer.data.sampler.accum_steps == 2  # micro_batch 1: gradient accumulation, as the recipe
        masks = []  # (layer, the window mask it was called with): the window really cuts the sequence

        def record(module, args, kwargs) -> None:
            masks.append((module, kwargs.get("window_mask")))

        for b in model.blocks:
            b.attn.register_forward_pre_hook(record, with_kwargs=True)
        # force a three-pass step: the largest the paper-200b schedule draws
        trainer.schedule = type(trainer.schedule).parse([{"until": 1.0, "probs": {"3": 1.0}}])
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        stats = trainer.train_step(5)
        assert stats.k == 3 and len(stats.pass_losses) == 3
        assert all(math.isfinite(v) for v in [*stats.pass_losses, stats.loss, stats.grad_norm, stats.state_rms])
        assert all(10 < v < 13 for v in stats.pass_losses), stats.pass_losses  # ~ln(100352) = 11.5 at init
        span = torch.arange(64)
        expected = (span[:, None] - span[None, :] >= 0) & (span[:, None] - span[None, :] < 16)
        assert {id(a) for a, _ in masks} == {id(b.attn) for b in model.blocks}
        assert all(torch.equal(mask, expected) for _, mask in masks)
        after = dict(model.named_parameters())
        unchanged = [k for k, p in after.items() if torch.equal(before[k], p.detach())]
        assert not unchanged and all(torch.isfinite(p).all() for p in after.values())
    finally:
        trainer.close()


def test_small_recipe_builds_in_its_size_class(tmp_path, cache):
    """configs/small.toml is valid as written and builds a 10-30M parameter model that runs its multi-pass forward."""
    from fullband import FullbandLM

    root = Path(__file__).resolve().parents[1]
    cfg = load_run_config(root / "configs" / "small.toml", [f'log.run_dir="{tmp_path / "s"}"'])
    assert cfg.data.tokenizer == "bpe" and cfg.model.vocab_size == cfg.data.bpe_vocab_size
    model = FullbandLM(cfg.model)
    n = sum(p.numel() for p in model.parameters())
    assert 10e6 < n < 30e6, n
    ids = torch.randint(0, cfg.model.vocab_size, (1, 16))
    with torch.no_grad():
        out = model(ids, passes=3)
    assert out.logits.shape == (1, 16, cfg.model.vocab_size) and torch.isfinite(out.logits).all()
    assert not (tmp_path / "s").exists()  # loading a recipe writes nothing


def test_demo_races_trains_evaluates_summarises_and_reuses_every_phase(tmp_path, corpus, cache, monkeypatch, capsys):
    """The demo end to end in seconds (--quick): the parity race (both models, every mode, the figure), the code LM
    (loss by mode, paired; greedy and sampled continuations), the summary. Its evaluations are `fullband eval
    tracking`'s and `fullband eval loss`'s on the same checkpoints; a second run trains and scores nothing again."""
    from fullband import demo
    from fullband.eval.commands import eval_tracking

    config = write_config(tmp_path, corpus, cache, "code", steps=4, ckpt_every=0)
    out = tmp_path / "demo"
    assert demo.run_demo(out, quick=True, code_config=config) == 0
    for name in ("race.png", "race.json", "samples.json", "samples.md", "summary.md", "code/step_000004/eval/loss.png",
                 "parity-full-bandwidth/step_000012/eval/tracking_parity.png"):
        assert (out / name).stat().st_size > 0, name
    race = json.loads((out / "race.json").read_text())
    assert [r["mode"] for r in race["rows"]] == [
        "standard model, read standard", "standard model at the same compute, read standard",
        "full-bandwidth model, read standard", "full-bandwidth model, read fused k=1",
        "full-bandwidth model, read fused k=4", "full-bandwidth model, read exact"]
    assert race["lengths"] == [8, 16, 32, 64] and race["runs"]["standard"]["parameters"] < \
        race["runs"]["full-bandwidth"]["parameters"]  # the standard model has no fusion weights
    # the second standard model trains as many steps as the full-bandwidth model's passes cost
    std, same, fb = (race["runs"][k] for k in ("standard", "standard-compute", "full-bandwidth"))
    assert std["steps"] == fb["steps"] == 12
    assert same["steps"] == demo.equal_compute_steps(demo.RACE, demo.QUICK["race"])
    assert same["compute_tokens"] == pytest.approx(fb["compute_tokens"], rel=0.1) and same["steps"] > 5 * std["steps"]
    again = eval_tracking(race["runs"]["full-bandwidth"]["checkpoint"], n=16,
                          modes=["standard", "fused:1", "fused:4", "exact"], out=tmp_path / "eval", progress=False)
    assert [r["accuracy"] for r in again["rows"]] == [r["accuracy"] for r in race["rows"][2:]]
    loss = json.loads((out / "code" / "step_000004" / "eval" / "loss.json").read_text())
    assert [r["mode"] for r in loss["rows"]] == ["standard", "fused k=1", "fused k=2"]
    assert len(json.loads((out / "samples.json").read_text())["text"]) == 8
    assert (out / "samples.md").read_text().count("```python") == 9
    summary = (out / "summary.md").read_text()
    assert "Parity of inputs up to 8 bits" in summary and "held-out loss: standard" in summary
    assert "x the first standard model's compute" in summary
    # a second run reuses every phase: nothing is trained, scored or sampled again
    for name in ("train", "eval_tracking", "eval_loss", "generate"):
        monkeypatch.setattr(demo, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} ran again"))
    capsys.readouterr()
    assert demo.run_demo(out, quick=True, code_config=config) == 0
    assert capsys.readouterr().out.count("reusing") == 4 + 5  # the runs; the evaluations and the samples


def test_train_bench_child_measures_a_step(tmp_path, corpus, cache):
    from fullband.bench.train import child, format_train_report

    config = write_config(tmp_path, corpus, cache, "bench", steps=8, ckpt_every=0)
    out = child({"config": str(config), "overrides": [], "passes": 2, "ac": True, "steps": 2, "warmup": 1,
                 "run_dir": str(tmp_path / "bench-run")})
    assert out["mean_k"] == 2 and out["step_s"] > 0 and out["peak_bytes"] > 0
    row = {"variant": "k=2", "activation_checkpointing": True, "mean_passes": 2.0, "ms_per_step": 10.0,
           "tokens_per_s": 1.0, "cost_vs_k1": 2.0, "cost_per_pass": 1.0, "peak_mb": 1.0, "device": "cpu"}
    assert "k=2" in format_train_report({"config": "x", "overrides": [], "rows": [row]})


def test_tensorboard_and_wandb_receive_every_step(tmp_path, corpus, cache, monkeypatch):
    pytest.importorskip("tensorboard")
    wandb = pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_run_config(write_config(tmp_path, corpus, cache, steps=4),
                          ["log.tensorboard=true", "log.wandb=true"])
    train(cfg)
    run = tmp_path / "run"
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"loss", "loss_pass/1", "grad_norm", "state_rms"} <= set(tags), tags
    tb_loss = [e.value for e in events.Scalars("loss")]
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]
    jsonl = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "loss_pass" in json.loads(line)]
    assert tb_loss == pytest.approx(jsonl, rel=1e-6)
    # the offline W&B run holds the same history
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb"))
    assert wandb.run is None  # finished, not left open


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_after_the_step_with_a_checkpoint_and_resumes_bitwise(tmp_path, corpus, cache,
                                                                                     monkeypatch, capsys, signum):
    """The first Ctrl-C (SIGINT), or SIGTERM (a scheduler's preemption, torchrun's shutdown), lets the step it lands
    in finish, writes that step's checkpoint (here one the schedule would not have written) and stops (SIGTERM: with
    the shell's status for it, 143); --resume then ends with the uninterrupted run's weights. The memory estimate is
    printed before the first step."""
    from fullband.train.trainer import Trainer

    # Python's own handlers, as a program started from a terminal has them, whatever this test process inherited
    # (a background start ignores SIGINT); one CI run here saw no Ctrl-C reach the trainer, cause not found
    default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
    previous = signal.signal(signum, default)
    try:
        _stop_then_resume(tmp_path, corpus, cache, monkeypatch, capsys, Trainer, signum)
        assert signal.getsignal(signum) is default  # put back
    finally:
        signal.signal(signum, previous)


def _stop_then_resume(tmp_path, corpus, cache, monkeypatch, capsys, Trainer, signum) -> None:
    whole = write_config(tmp_path, corpus, cache, "whole")
    part = write_config(tmp_path, corpus, cache, "part")
    train(load_run_config(whole))
    assert re.search(r"memory: about [\d.]+ GB at a 3-pass step \(weights .*; [\d.]+ GB available",
                     capsys.readouterr().out)
    step = Trainer.train_step

    def interrupted(self, i):
        stats = step(self, i)
        if i == 2:  # in the middle of the run's third step, as a user's Ctrl-C or a scheduler's SIGTERM would land
            os.kill(os.getpid(), signum)
        return stats

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    if signum == signal.SIGINT:
        with pytest.raises(KeyboardInterrupt):
            train(load_run_config(part))
    else:
        with pytest.raises(SystemExit) as stopped:
            train(load_run_config(part))
        assert stopped.value.code == 143
    out = capsys.readouterr()
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert f"{name}: stopping after this step, with a checkpoint ({name} again stops now" in out.err
    assert f"interrupted after step 3: checkpoint {tmp_path / 'part' / 'step_000003'}" in out.out
    monkeypatch.setattr(Trainer, "train_step", step)
    train(load_run_config(part), resume=tmp_path / "part")
    assert losses(tmp_path / "part") == losses(tmp_path / "whole")
    a = load_file(str(tmp_path / "whole" / "step_000008" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "step_000008" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_memory_estimate_and_a_warning_when_it_does_not_fit(monkeypatch):
    """The estimate (weights, gradients, optimizer state, activations per pass) and the warning when a step may
    not fit what is available: a warning under train.memory_check = false, a refusal by default."""
    from fullband.errors import ConfigError, FullbandWarning
    from fullband.model.config import ModelConfig
    from fullband.train import memory, trainer
    from fullband.train.config import RunConfig, TrainConfig

    smol = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536)
    one = memory.step_memory(smol, passes=1, tokens=1024, optimizer="adamw")
    three = memory.step_memory(smol, passes=3, tokens=1024, optimizer="adamw")
    assert three.activations == 3 * one.activations and 1.8e9 < one.activations < 2.4e9  # measured: 1.9 GB
    assert one.optimizer == 2 * one.weights == 2 * one.gradients
    cfg = RunConfig(model=smol, train=TrainConfig(seq_len=256, global_batch_tokens=1024, micro_batch=4,
                                                   passes="three-pass", warmup_steps=0, memory_check=False))
    monkeypatch.setattr(memory, "available_memory", lambda device: 4e9)
    with pytest.warns(FullbandWarning, match=r"may not fit: about \d+\.\d GB against 4\.0 GB available; lower "
                                             "train.micro_batch"):
        trainer.say_memory(cfg, torch.device("cpu"))
    checked = RunConfig(model=smol, train=TrainConfig(seq_len=256, global_batch_tokens=1024, micro_batch=4,
                                                       passes="three-pass", warmup_steps=0))
    with pytest.raises(ConfigError, match=r"may not fit: .*\(train\.memory_check = false goes on anyway\)"):
        trainer.say_memory(checked, torch.device("cpu"))


WIDE_MODEL = "vocab_size = 259\nd_model = 256\nn_layers = 2\nn_heads = 4\nmax_seq_len = 128"  # threads change its bits


def test_a_resume_keeps_the_runs_thread_count_on_any_machine_load(tmp_path, corpus, cache, monkeypatch, capsys):
    """A run started on a busy machine (1 thread) and resumed where 2 would be chosen ends bitwise as the run that
    never stopped: the count is recorded in run.json and the resume uses it, saying so; a FULLBAND_THREADS or a
    recipe count that differs is refused by name. The caller's count comes back after each run."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("FULLBAND_THREADS", raising=False)
    kw = dict(steps=6, ckpt_every=2, model=WIDE_MODEL)
    whole, part = (write_config(tmp_path, corpus, cache, name, **kw) for name in ("whole", "part"))
    torch.set_num_threads(2)
    ones = torch.set_num_threads  # every run before the resume starts with 1 thread: the busy machine

    def resume_on_an_idle_machine(cfg, resume=None, _train=trainer_module.train):
        ones(2 if resume is not None else 1)
        return _train(cfg, resume=resume)

    monkeypatch.setattr(trainer_module, "train", resume_on_an_idle_machine)
    try:
        assert_resume_is_bitwise(whole, part, monkeypatch, stop_before=3, last="step_000006")
    finally:
        torch.set_num_threads(1)
    out = capsys.readouterr().out
    assert "resuming with the run's 1 thread(s) (train.threads, as it started), not the 2" in out
    assert json.loads((tmp_path / "part" / "run.json").read_text())["train"]["threads"] == 1
    assert torch.get_num_threads() == 1
    run = tmp_path / "part"
    monkeypatch.setenv("FULLBAND_THREADS", "2")
    with pytest.raises(ConfigError, match=r"FULLBAND_THREADS=2, but the run started with 1 thread\(s\) "
                                          r"\(train.threads in its run.json\): unset it or set it to 1"):
        trainer_module.Trainer(load_run_config(part), resume=run)
    monkeypatch.delenv("FULLBAND_THREADS")
    with pytest.raises(ConfigError, match=r"train.threads=3, but the run started with train.threads=1"):
        trainer_module.Trainer(load_run_config(part, ["train.threads=3"]), resume=run)
    # FULLBAND_THREADS sets a new run's count from Python too (not only through the CLI): it was honoured on resume
    # and ignored at the start, so a run started from Python could not be resumed under the same setting
    monkeypatch.setenv("FULLBAND_THREADS", "2")
    fresh = write_config(tmp_path, corpus, cache, "fresh", steps=2, ckpt_every=2, model=WIDE_MODEL)
    train(load_run_config(fresh))
    assert json.loads((tmp_path / "fresh" / "run.json").read_text())["train"]["threads"] == 2
    assert torch.get_num_threads() == 1  # the caller's count back


def test_the_memory_estimate_counts_every_block_run_of_a_looped_or_ponder_model():
    """A looped group keeps its activations once per repetition, a ponder model once per slot: the estimate (what
    bench cost / decode / train and the trainer check against memory) grows with them."""
    from fullband.model.config import ModelConfig
    from fullband.train.memory import step_memory

    base = dict(vocab_size=8, d_model=64, n_layers=4, n_heads=4)
    plain = step_memory(ModelConfig(**base, fusion="none"), passes=1, tokens=1024).activations
    looped = step_memory(ModelConfig(**base, fusion="none", loop_start=0, loop_stop=4, loops=8), passes=1,
                         tokens=1024).activations
    ponder = step_memory(ModelConfig(**base, fusion="none", ponder=True, jitter=0, prefix_mixin_prob=0), passes=1,
                         tokens=1024).activations
    logits = 1024 * 3 * 8 * 4
    assert looped - logits == pytest.approx(8 * (plain - logits)) and ponder - logits == pytest.approx(2 * (plain - logits))


def test_train_trainable_freezes_the_rest_and_feedback_weights_take_their_own_lr(tmp_path, corpus, cache, capsys):
    """train.trainable = ["fusion.*", "norm_in.*"] (a warm start that trains the feedback weights alone): every other
    weight stays exactly as it started and has no optimizer state; optim.feedback_lr_mult scales their learning
    rate; a pattern that matches nothing is one line naming the model's weights."""
    from fullband.train.optim import OptimConfig, routing_report

    first = write_config(tmp_path, corpus, cache, "first", steps=2, ckpt_every=2)
    train(load_run_config(first))
    start = tmp_path / "first" / "step_000002"
    second = write_config(tmp_path, corpus, cache, "second", steps=2, ckpt_every=2)
    train(load_run_config(second, [f"train.init_from='{start}'", 'train.trainable=["fusion.*", "norm_in.*"]',
                                   "optim.feedback_lr_mult=3.0"]))
    assert re.search(r"training [\d,]+ of [\d,]+ weights \(train.trainable = \['fusion.\*', 'norm_in.\*'\]\); the "
                     "rest are frozen", capsys.readouterr().out)
    a = load_file(str(start / "model.safetensors"))
    b = load_file(str(tmp_path / "second" / "step_000002" / "model.safetensors"))
    feedback = [k for k in a if k.startswith(("fusion.", "norm_in."))]
    assert feedback and all(not torch.equal(a[k], b[k]) for k in feedback)
    assert all(torch.equal(a[k], b[k]) for k in a if k not in feedback)
    state = torch.load(tmp_path / "second" / "step_000002" / "optimizer.pt", weights_only=False)
    held = sum(len(s["state"]) for s in state.values() if isinstance(s, dict) and "state" in s)
    assert held == len(feedback)  # optimizer state for the trained weights only
    from conftest import tiny_model

    lrs = {name: lr for name, _, lr, _ in routing_report(tiny_model(), OptimConfig(feedback_lr_mult=3.0))}
    base = {name: lr for name, _, lr, _ in routing_report(tiny_model(), OptimConfig())}
    assert all(lrs[k] == pytest.approx(3 * base[k]) if k.startswith(("fusion.", "norm_in.")) else lrs[k] == base[k]
               for k in base)
    with pytest.raises(ConfigError, match=r"train.trainable pattern 'fusoin.\*' matches no weight of this model; its "
                                          r"weights: blocks.\*, embed.\*, fusion.\*"):
        train(load_run_config(write_config(tmp_path, corpus, cache, "bad"), ['train.trainable=["fusoin.*"]']))
    assert not (tmp_path / "bad").exists()


def test_bfloat16_autocast_trains_with_every_objective_term(tmp_path, corpus, cache):
    """train.dtype = "bfloat16" (a GPU's default, and AMX CPUs') with every term of the objective on at once: the blend
    curriculum, the block match, self-distillation, the next-latent term, the anchor, jitter and the prefix mixin.
    Under autocast a fused input is bfloat16 while the plain one is float32, and ops that do not promote (the blend's
    lerp) must not see the two; the losses stay finite and close to the same run in float32."""
    runs = {}
    for dtype in ("float32", "bfloat16"):
        path = write_config(tmp_path, corpus, cache, dtype, steps=4, ckpt_every=4, passes='"two-pass"')
        path.write_text(path.read_text().replace("[train]\n", (
            f'[train]\ndtype = "{dtype}"\nblend_until = 0.5\nblock_match = 1.0\ndistill = 0.5\nlatent_loss = 0.1\n'
            f'anchor = 0.5\ninit_from = "{micro_start(tmp_path)}"\n')).replace(
            "[model]\n", "[model]\njitter = 0.05\nprefix_mixin_prob = 0.5\nlatent_head = \"linear\"\n"))
        train(load_run_config(path))
        runs[dtype] = losses(tmp_path / dtype)
    assert all(math.isfinite(x) for row in runs["bfloat16"] for x in row) and len(runs["bfloat16"]) == 4
    first32, first16 = runs["float32"][0], runs["bfloat16"][0]  # the same weights and batch: rounding apart
    assert first16 == pytest.approx(first32, rel=0.05) and first16 != first32
