"""The run directory: one process owns it (a lock), a new run needs a new or empty folder, what a killed run left
half-written is swept, and a resume finds its checkpoint and refuses settings that differ from the run's own."""

from __future__ import annotations

import json
from pathlib import Path

from fullband.errors import ConfigError
from fullband.files import FolderLock, describe_entries, lock_folder, make_folder, read_json_file, replace_file, sweep_temps
from fullband.train import checkpoint as ckpt

RUN_FILE = "run.json"
# resuming needs these to be equal; anything else (logging, eval cadence) may change
MUST_MATCH = ("model", "data", "optim", "train.seq_len", "train.global_batch_tokens", "train.seed", "train.passes",
              "train.steps", "train.warmup_steps", "train.cooldown_fraction", "train.z_loss",
              "train.decay_wd_in_cooldown", "train.trainable", "train.blend_until")


def claim_run_dir(run_dir: Path, *, resume: bool, key: str = "log.run_dir") -> tuple[FolderLock, bool]:
    """Create (for a new run) and lock `run_dir` for this process; remove what a killed run left half-written
    (.step_N.tmp folders). Returns the lock and whether the folder was created here. A fresh run is refused
    in a folder that already holds anything. `key`: the recipe's setting that names the folder, as messages say it
    (rl.run_dir for fullband rl)."""
    created = not run_dir.exists()
    if resume and created:
        raise ConfigError(f"--resume {str(run_dir)!r} does not exist")
    make_folder(run_dir, key)
    lock = lock_folder(run_dir, "run directory", hint=f", or choose another {key} (--set {key}=...)")
    try:
        swept = sweep_temps(run_dir, r"\.step_\d+\.tmp")
        if swept:
            print(f"removed {len(swept)} half-written checkpoint folder(s) a stopped run left in {run_dir}: "
                  f"{', '.join(swept)}", flush=True)
        entries = sorted(p.name for p in run_dir.iterdir()) if not resume else []
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


def resume_run_dir(path: Path) -> Path:
    """--resume accepts a run directory or one of its step_NNNNNN folders: the run directory."""
    if not path.exists():
        raise ConfigError(f"--resume {str(path)!r} does not exist")
    if not path.is_dir():
        raise ConfigError(f"--resume {str(path)!r} is a file; accepted: a run directory or a step_NNNNNN folder")
    return path.parent if ckpt.STEP_DIR.match(path.name) else path


def resume_checkpoint(path: Path, run_dir: Path) -> Path | None:
    """The checkpoint to resume from: the named step folder, else the run's latest (None: the run stopped
    before its first checkpoint, and starts again from step 0 with its saved settings)."""
    if ckpt.STEP_DIR.match(path.name):
        ckpt.read_trainer_state(path)
        return path
    found = ckpt.list_checkpoints(run_dir)
    if found:
        return found[-1]
    if not (run_dir / RUN_FILE).is_file():
        raise ConfigError(f"--resume {str(run_dir)!r} is not a fullband run directory: it has no {RUN_FILE} and no "
                          "step_NNNNNN/ checkpoint; start a new run there instead (without --resume)")
    return None


def check_resume_config(run_dir: Path, now: dict, keys: tuple[str, ...] = MUST_MATCH) -> None:
    """Refuse a resume whose settings (`now`, a resolved config as a dict) differ from run.json's in one of `keys`."""
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


def saved_setting(run_dir: Path, dotted: str):
    """One setting of a run's run.json (`dotted`, e.g. 'train.threads'); None where the file or the key is missing
    (check_resume_config has checked the file)."""
    try:
        saved = read_json_file(run_dir / RUN_FILE, "the run's settings", error=ConfigError)
    except ConfigError:
        return None
    return _get(saved, dotted) if isinstance(saved, dict) else None


def _run_kind(saved) -> str | None:
    """Which command wrote a run.json: 'rl' (an [rl] table alone), 'train' (its [train] table), else None."""
    if not isinstance(saved, dict):
        return None
    if isinstance(saved.get("rl"), dict) and "train" not in saved:
        return "rl"
    return "train" if isinstance(saved.get("train"), dict) else None


_UNSET = object()


def resume_differences(saved: dict, now: dict, keys: tuple[str, ...] = MUST_MATCH) -> list[str]:
    """'key: run has A, config has B' for every setting a resume needs equal (`keys`, dotted) that differs between two
    resolved run configs (as dicts)."""
    return [d for key in keys for d in _differences(_get(saved, key), _get(now, key), key)]


def _differences(a, b, key: str, path: str = "") -> list[str]:
    """'key: run has path=A, config has path=B' for every leaf setting under `key` that differs between a and b
    (for a leaf key itself: 'key: run has A, config has B')."""
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
