"""Training checkpoints: `step_NNNNNN/` folders with the model (loadable by FullbandLM.load), optimizer,
trainer state (step, data position, config, code version) and RNG, written atomically; the last N are kept."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fullband.folder import FILES_KEY, load_state, model_metadata, read_config_file, write_model_files
from fullband.errors import CheckpointError
from fullband.files import check_record, parse_json, publish_folder, read_text, writing
from fullband.train.parallel import Dist, barrier, is_fsdp, unwrap
from fullband.version import __version__

STEP_DIR = re.compile(r"^step_(\d{6,})$")
TRAINER_FILE = "trainer.json"
REQUIRED = ("config.json", "model.safetensors", TRAINER_FILE, "rng.pt")


def code_version() -> dict:
    info = {"fullband": __version__, "torch": torch.__version__}
    try:
        root = Path(__file__).resolve().parents[3]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            info["git"] = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary folders of an interrupted write are ignored)."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / TRAINER_FILE).is_file()
             and (p / "config.json").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded, CPU) model state dict; collective under FSDP2 (every rank must call)."""
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}


def save_checkpoint(run_dir: Path, step: int, model, optimizer, trainer_state: dict, *, d: Dist, tokenizer=None,
                    keep_last: int = 3) -> Path:
    """Write step_NNNNNN/ atomically: every file goes to a temporary folder renamed into place at the end;
    config.json, written last, records the size and sha256 of every other file. A failed write (a full disk)
    removes the temporary folder and says what happened; the previous checkpoints are untouched."""
    final = run_dir / f"step_{step:06d}"
    tmp = run_dir / f".step_{step:06d}.tmp"
    action = f"write checkpoint {final.name}"
    try:
        if d.main:
            shutil.rmtree(tmp, ignore_errors=True)
            with writing(run_dir, action):
                tmp.mkdir(parents=True)
        barrier(d)
        state = model_state(model)
        fsdp = is_fsdp(model)
        with writing(tmp, action):
            if fsdp:  # optimizer state is sharded like the parameters: one file per rank
                torch.save(optimizer.state_dict(), tmp / f"optimizer.rank{d.rank}.pt")
            if d.main:
                if not fsdp:
                    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
                rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
                torch.save(rng, tmp / "rng.pt")
                payload = {**trainer_state, "step": step, "world_size": d.world, "fsdp": fsdp, "code": code_version()}
                (tmp / TRAINER_FILE).write_text(json.dumps(payload, indent=2) + "\n")
            barrier(d)
            if d.main:  # config.json last: it records every other file, the optimizer shards included
                write_model_files(tmp, unwrap(model).config, state, tokenizer=tokenizer,
                                  metadata=model_metadata(unwrap(model)))
    except BaseException:
        if d.main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier(d)
    if d.main:
        publish_folder(tmp, final, replace=final.exists())  # resuming from an earlier step rewrites later ones
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(d)
    return final


TRAINER_KEYS = ("step", "tokens", "compute_tokens", "elapsed", "sampler")


def read_trainer_state(path: Path) -> dict:
    missing = [name for name in REQUIRED if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: missing {', '.join(missing)}")
    file = path / TRAINER_FILE
    state = parse_json(read_text(file, "the trainer state", error=CheckpointError), f"{file} is corrupted",
                       error=CheckpointError)
    lacking = [k for k in TRAINER_KEYS if not isinstance(state, dict) or k not in state]
    if lacking:
        raise CheckpointError(f"{file} is damaged: it lacks {', '.join(lacking)}; resume from an earlier checkpoint "
                              f"of the run (--resume {path.parent}/step_NNNNNN)")
    for key in ("step", "tokens", "compute_tokens", "elapsed", "flops"):
        value = state.get(key, 0)  # flops: none in a checkpoint written before it was counted (the trainer counts it)
        whole = key not in ("elapsed", "flops")
        if isinstance(value, bool) or not isinstance(value, int if whole else int | float) or value < 0:
            raise CheckpointError(f"{file}: {key}={value!r} is invalid; accepted: "
                                  f"{'an integer' if whole else 'a number'} >= 0 (the file is damaged)")
    if not isinstance(state["sampler"], dict):
        raise CheckpointError(f"{file}: sampler={state['sampler']!r} is invalid; accepted: the sampler's state (an "
                              "object); the file is damaged")
    return state


def load_checkpoint(path: Path, model, optimizer, *, d: Dist) -> dict:
    """Restore model, optimizer and RNG from `path`; returns the trainer state."""
    state = read_trainer_state(path)
    fsdp = is_fsdp(model)
    if state.get("fsdp") != fsdp or (fsdp and state.get("world_size") != d.world):
        raise CheckpointError(f"checkpoint {str(path)!r} was written with fsdp={state.get('fsdp')} on "
                              f"{state.get('world_size')} processes; this run has fsdp={fsdp} on {d.world} (FSDP "
                              "optimizer shards need the same world size)")
    data = read_config_file(path)
    problems = check_record(path, data.get(FILES_KEY, {}), hashes=False)
    if problems:
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete or damaged: {'; '.join(problems)}; resume from "
                              f"an earlier checkpoint (--resume {path.parent}/step_NNNNNN); `fullband doctor {path}` "
                              "checks every file")
    weights = load_state(path, data)
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
        opt_file = path / f"optimizer.rank{d.rank}.pt"
    else:
        unwrap(model).load_state_dict(weights, strict=True)
        opt_file = path / "optimizer.pt"
    if not opt_file.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: missing {opt_file.name}")
    try:
        opt_state = torch.load(opt_file, map_location=d.device, weights_only=False)
        rng = torch.load(path / "rng.pt", weights_only=False)
    except Exception as err:  # torch.load raises many types for a damaged file
        raise CheckpointError(f"{opt_file} or rng.pt in {str(path)!r} is corrupted: {err}") from None
    optimizer.load_state_dict(opt_state)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    return state


def describe(state: dict[str, Any]) -> str:
    return f"step {state['step']} ({state.get('tokens', 0) / 1e6:.2f}M tokens)"
