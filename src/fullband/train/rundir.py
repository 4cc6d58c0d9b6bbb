"""The run directory: one process owns it (a lock), a new run needs a new or empty folder, what a killed run left
half-written is swept, and a resume finds its checkpoint and refuses settings that differ from the run's own.
RunDir is that lifecycle, from claim to release, as `fullband train` and `fullband rl` share it."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from fullband.errors import ConfigError
from fullband.files import (FolderLock, describe_entries, lock_folder, make_folder, read_json_file, replace_file,
                            sweep_temps, writing)
from fullband.machine import run_threads
from fullband.train import checkpoint as ckpt
from fullband.train.metrics import METRICS_FILE
from fullband.train.parallel import Dist, all_reduce_max

RUN_FILE = "run.json"
# resuming needs these to be equal; anything else (logging, eval cadence) may change
MUST_MATCH = ("model", "data", "optim", "train.seq_len", "train.global_batch_tokens", "train.seed", "train.passes",
              "train.steps", "train.warmup_steps", "train.cooldown_fraction", "train.z_loss",
              "train.decay_wd_in_cooldown", "train.trainable", "train.blend_until",
              "train.latent_loss", "train.distill", "train.distill_until", "train.anchor",
              "train.anchor_from", "train.anchor_until", "train.block_match", "train.block_match_until")


class RunDir:
    """One run's folder from claim to release; torch's threads are the run's own until release(). `owner`: the main
    rank; `resume`: the run directory or one of its step folders; `key`: its setting (log.run_dir, rl.run_dir)."""

    def __init__(self, folder: str | Path, *, resume: str | Path | None, key: str = "log.run_dir",
                 owner: bool = True) -> None:
        self.resume, self.path = (Path(resume) if resume is not None else None), Path(folder)
        if self.resume is not None:
            if not self.resume.exists():
                raise ConfigError(f"--resume {str(self.resume)!r} does not exist")
            if not self.resume.is_dir():
                raise ConfigError(f"--resume {str(self.resume)!r} is a file; accepted: a run directory or a "
                                  "step_NNNNNN folder")
            self.path = self.resume.parent if ckpt.STEP_DIR.match(self.resume.name) else self.resume
        self.owner, self.threads = owner, torch.get_num_threads()  # the caller's, given back by release()
        self.checkpoint: Path | None = None  # the one a resume starts from (None: from step 0)
        self.lock, self.created = self._claim(key) if owner else (None, False)  # a second process stops here

    def _claim(self, key: str) -> tuple[FolderLock, bool]:
        """Create (for a new run) and lock the folder, sweep a killed run's .step_N.tmp folders and refuse a fresh run
        in a folder holding anything. -> (the lock, whether the folder was created here)."""
        run_dir, created = self.path, not self.path.exists()
        make_folder(run_dir, key)
        lock = lock_folder(run_dir, "run directory", hint=f", or choose another {key} (--set {key}=...)")
        try:
            swept = sweep_temps(run_dir, r"\.step_\d+\.tmp")
            if swept:
                print(f"removed {len(swept)} half-written checkpoint folder(s) a stopped run left in {run_dir}: "
                      f"{', '.join(swept)}", flush=True)
            entries = sorted(p.name for p in run_dir.iterdir()) if self.resume is None else []
            if entries and not ((run_dir / RUN_FILE).is_file() or ckpt.list_checkpoints(run_dir)):
                raise ConfigError(f"{key} {str(run_dir)!r} is not empty and holds no fullband run (it holds "
                                  f"{describe_entries(entries)}); a run needs a new or empty folder: choose another "
                                  f"{key} (e.g. --set {key}=runs/new)")
            if entries:
                raise ConfigError(f"run directory {str(run_dir)!r} already holds a run; resume it with --resume "
                                  f"{run_dir} or choose another {key} (e.g. --set {key}=runs/new)")
        except BaseException:
            lock.release()
            raise
        return lock, created

    def check(self, now: dict, keys: tuple[str, ...], threads_key: str, threads: int) -> int:
        """On a resume: find its checkpoint (the named step folder, else the latest; None: start again from step 0)
        and refuse settings (`now`, the resolved config as a dict) that differ from run.json's in `keys`. Then set
        torch's threads (`threads`, the recipe's `threads_key`; a resume keeps the run's) -> the count to record."""
        recorded = None
        if self.resume is not None:
            if ckpt.STEP_DIR.match(self.resume.name):
                ckpt.read_trainer_state(self.resume)
                self.checkpoint = self.resume
            elif found := ckpt.list_checkpoints(self.path):
                self.checkpoint = found[-1]
            elif not (self.path / RUN_FILE).is_file():
                raise ConfigError(f"--resume {str(self.path)!r} is not a fullband run directory: it has no {RUN_FILE} "
                                  "and no step_NNNNNN/ checkpoint; start a new run there instead (without --resume)")
            recorded = _get(check_resume_config(self.path, now, keys), threads_key)
        count, said = run_threads(threads, threads_key, resume=self.resume is not None, recorded=recorded)
        if said and self.owner:
            print(said, flush=True)
        return count

    def load(self, model, optimizer, d: Dist) -> dict | None:
        """Restore model, optimizer and RNG from the checkpoint a resume starts from; its trainer state (None: none)."""
        return None if self.checkpoint is None else ckpt.load_checkpoint(self.checkpoint, model, optimizer, d=d)

    def begin(self, settings: dict, step: int, *, tokenizer=None) -> None:
        """A new run writes its settings (run.json, and the tokenizer's files when given); a resumed one drops the
        metrics rows logged after the step it resumes from (all of them from step 0: its first evaluation again)."""
        if not self.owner:
            return
        if self.resume is not None:
            truncate_metrics(self.path / METRICS_FILE, step if step else -1)
            return
        with writing(self.path, "write the run's settings"):
            if tokenizer is not None:
                tokenizer.save(self.path)
            replace_file(self.path / RUN_FILE, json.dumps(settings, indent=2) + "\n")

    def last_good(self) -> str:
        """The sentence a stopped run ends with: its newest complete checkpoint."""
        last = ckpt.list_checkpoints(self.path)
        return f"Last good checkpoint: {last[-1] if last else 'none yet'}"

    def interrupted(self, step: int, path: Path | None, command: str) -> str:
        """What a Ctrl-C after `step` says: the checkpoint kept (`path`) and how to go on."""
        return (f"interrupted after step {step}: {_kept(path)}; continue with fullband {command} RECIPE "
                f"--resume {self.path}")

    def out_of_time(self, step: int, steps: int, minutes: float, path: Path | None) -> str:
        """What a run that used its train.stop_after_minutes says: where it stopped, the checkpoint, how to go on."""
        return (f"stopped after step {step} of {steps}: train.stop_after_minutes={minutes:g} passed; {_kept(path)}; "
                f"continue with fullband train RECIPE --resume {self.path}")

    def abandon(self) -> None:
        """After a failure: the folder this run created goes when nothing of the run was written (no trace left)."""
        if self.lock is not None and self.created and self.path.is_dir() and not any(self.path.iterdir()):
            self.path.rmdir()
        self.release()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
        torch.set_num_threads(self.threads)

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is not None:
            self.abandon()
        self.release()


def _kept(path: Path | None) -> str:
    """A stop's checkpoint, as its line says it."""
    return f"checkpoint {path}" if path else "no checkpoint (the weights are not finite)"


def check_resume_config(run_dir: Path, now: dict, keys: tuple[str, ...]) -> dict:
    """Refuse a resume whose settings (`now`, a resolved config as a dict) differ from run.json's in one of `keys`;
    run.json's settings."""
    saved_path = run_dir / RUN_FILE
    if not saved_path.is_file():
        raise ConfigError(f"{str(run_dir)!r} has no {RUN_FILE}; it is not a fullband run directory")
    try:
        saved = read_json_file(saved_path, "the run's settings", error=ConfigError)
    except ConfigError as err:
        raise ConfigError(f"{saved_path} is corrupted ({err}); it holds the run's settings: restore it from a "
                          f"checkpoint's trainer.json ('config') or start a new run") from None
    sections = [s.split(".")[0] for s in keys]
    other = _run_kind(saved)
    if other and other != _run_kind({s: {} for s in sections}):
        raise ConfigError(f"{str(run_dir)!r} is a `fullband {other}` run (its {RUN_FILE} holds that command's "
                          f"settings), not one this command resumes; resume it with `fullband {other} RECIPE --resume "
                          f"{run_dir}`, or start a new run")
    if not isinstance(saved, dict) or any(not isinstance(saved.get(s), dict) for s in sections):
        missing = sorted({s for s in sections if not isinstance(saved, dict) or not isinstance(saved.get(s), dict)})
        raise ConfigError(f"{saved_path} is damaged: it lacks the section(s) {', '.join(missing)}; restore it "
                          "from a checkpoint's trainer.json ('config') or start a new run")
    diffs = resume_differences(saved, now, keys)
    if diffs:
        raise ConfigError(f"cannot resume {str(run_dir)!r} with this config; {len(diffs)} setting(s) differ: "
                          + "; ".join(diffs) + ". Use the run's own settings (its run.json) or start a new run")
    return saved


def _run_kind(saved) -> str | None:
    """Which command wrote a run.json: 'rl' (an [rl] table alone), 'train' (its [train] table), else None."""
    if not isinstance(saved, dict):
        return None
    if isinstance(saved.get("rl"), dict) and "train" not in saved:
        return "rl"
    return "train" if isinstance(saved.get("train"), dict) else None


_UNSET = object()


# settings added after runs were recorded without them, with the value that trains as those runs did (its default)
ADDED = {"train.blend_until": 0.0, "train.latent_loss": 0.0, "train.distill": 0.0, "train.distill_until": 1.0,
         "train.anchor": 0.0, "train.anchor_from": "", "train.anchor_until": 1.0, "train.block_match": 0.0,
         "train.block_match_until": 1.0,
         "rl.teacher": "reference", "rl.hold": 0.0,
         "data.repeat": 0.0, "data.shares": []}


def resume_differences(saved: dict, now: dict, keys: tuple[str, ...] = MUST_MATCH) -> list[str]:
    """'key: run has A, config has B' for every setting a resume needs equal (`keys`, dotted) that differs between two
    resolved run configs (as dicts); a run recorded before a setting existed (ADDED) holds its default."""
    return [d for key in keys for d in _differences(_recorded(saved, key), _get(now, key), key)]


def _recorded(saved: dict, dotted: str):
    section, _, name = dotted.rpartition(".")
    held = _get(saved, section) if section else saved
    if dotted in ADDED and isinstance(held, dict) and name not in held:
        return ADDED[dotted]
    value = _get(saved, dotted)
    if isinstance(value, dict):  # a whole section compared (data): the settings added to it since, at their defaults
        value = {**{key.rpartition(".")[2]: v for key, v in ADDED.items() if key.rpartition(".")[0] == dotted},
                 **value}
    return value


def _differences(a, b, key: str, path: str = "") -> list[str]:
    """resume_differences for one key, leaf by leaf ('key: run has path=A, config has path=B')."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b))
                for d in _differences(a.get(k, _UNSET), b.get(k, _UNSET), key, f"{path}.{k}" if path else k)]
    if a == b:
        return []
    name = f"{path}=" if path else ""
    return [f"{key}: run has {name}{_short(a)}, config has {name}{_short(b)}"]


def _get(data: dict, dotted: str):
    for part in dotted.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _short(value) -> str:
    if value is _UNSET:
        return "(not set)"
    text = json.dumps(value, sort_keys=True)
    return text if len(text) < 120 else text[:117] + "..."


def truncate_metrics(path: Path, step: int) -> None:
    """Drop rows logged after the checkpoint we resume from (a killed run may have logged further)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the kill
            continue
        if row.get("step", 0) <= step:
            keep.append(line)
    replace_file(path, "".join(line + "\n" for line in keep))


class StopRequest:
    """Set by the first Ctrl-C (SIGINT) or SIGTERM (a scheduler's preemption, torchrun's shutdown, `kill`) while a
    run trains: the loop finishes the step it is in, writes a checkpoint and stops (`stopped()`); a second one stops
    at once, without a checkpoint."""

    requested = False
    signum: int | None = None

    def agreed(self, d: Dist) -> bool:
        """Whether to stop now: any rank was interrupted (every rank stops after the same step)."""
        if d.world == 1:
            return self.requested
        return float(all_reduce_max(torch.tensor(float(self.requested), device=d.device), d)) > 0

    def stopped(self) -> BaseException:
        """What a run stopped by request raises once its checkpoint is written: KeyboardInterrupt after a Ctrl-C (or
        on a rank that saw none), SystemExit with the shell's status for SIGTERM (128 + 15) after a SIGTERM."""
        import signal

        if self.signum == signal.SIGTERM:
            return SystemExit(128 + signal.SIGTERM)
        return KeyboardInterrupt()


@contextlib.contextmanager
def stop_after_step():
    """A StopRequest that SIGINT and SIGTERM set for the time of the block (only in the main thread, and each only
    where it would otherwise end the program: KeyboardInterrupt for SIGINT, the default action for SIGTERM; a handler
    installed by the caller is left alone)."""
    import signal
    import sys
    import threading

    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    ours = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    ours = {signum: default for signum, default in ours.items() if signal.getsignal(signum) is default}

    def handler(signum, frame):
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if stop.requested:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        stop.requested, stop.signum = True, signum
        print(f"\n{name}: stopping after this step, with a checkpoint ({name} again stops now, without one)",
              file=sys.stderr, flush=True)

    previous = {signum: signal.signal(signum, handler) for signum in ours}
    try:
        yield stop
    finally:
        for signum, handler_before in previous.items():
            signal.signal(signum, handler_before)
