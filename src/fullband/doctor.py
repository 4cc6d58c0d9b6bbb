"""`fullband doctor PATH`: check a model folder, a training checkpoint or a run directory without changing it:
files complete and as recorded at save time, weights finite and matching the config, the run resumable."""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from fullband.errors import FullbandError

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass
class Finding:
    level: str  # ok | warn | FAIL
    where: str  # the file or folder it is about, relative to the checked path
    text: str


@dataclass
class Report:
    path: Path
    kind: str  # "run directory" | "training checkpoint" | "model folder" | "transformers folder" | "unknown"
    findings: list[Finding] = field(default_factory=list)
    verdict: str = ""

    @property
    def failed(self) -> bool:
        return any(f.level == FAIL for f in self.findings)

    def add(self, level: str, where: str, text: str) -> None:
        self.findings.append(Finding(level, where, text))

    def format(self) -> str:
        lines = [f"{self.kind} {self.path}"]
        lines += [f"  {f.level:<4}  {f.where}: {f.text}" for f in self.findings]
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"path": str(self.path), "kind": self.kind, "failed": self.failed, "verdict": self.verdict,
                "findings": [vars(f) for f in self.findings]}


def diagnose(path: str | Path, *, hashes: bool = True) -> Report:
    """Everything doctor can tell about `path` (nothing is written, locked for longer than a check, or deleted)."""
    from fullband.folder import CONFIG_FILE
    from fullband.files import read_json, read_json_file
    from fullband.train.checkpoint import STEP_DIR
    from fullband.train.rundir import RUN_FILE

    path = Path(path)
    if not path.is_dir():
        report = Report(path, "unknown", verdict="nothing to check")
        report.add(FAIL, ".", "does not exist" if not path.exists() else "is a file, not a folder")
        return report
    config = read_json(path / CONFIG_FILE) or {}
    if (path / RUN_FILE).is_file() or any(STEP_DIR.match(p.name) for p in path.iterdir() if p.is_dir()):
        return _run_dir(path, hashes)
    if config.get("format") == "fullband" or (path / "trainer.json").is_file():
        report = Report(path, "training checkpoint" if (path / "trainer.json").is_file() else "model folder")
        ok = _checkpoint(report, path, ".", hashes)
    elif config.get("model_type") == "fullband":
        report = Report(path, "transformers folder")
        ok = _hf_folder(report, path, hashes)
    else:
        report = Report(path, "unknown", verdict="nothing to check")
        why = "no run.json, no step_NNNNNN/ checkpoints and no config.json written by fullband"
        if (path / CONFIG_FILE).exists() or (path / CONFIG_FILE).is_symlink():
            try:
                read_json_file(path / CONFIG_FILE, "its config.json", error=FullbandError)
            except FullbandError as err:
                why = str(err)
        report.add(FAIL, ".", f"not a fullband folder: {why}")
        return report
    report.verdict = "healthy" if ok else "damaged: see the FAIL lines"
    return report


# ---------------------------------------------------------------------- one model folder or checkpoint
def _checkpoint(report: Report, folder: Path, where: str, hashes: bool) -> bool:
    """Findings for a native model folder or training checkpoint; True when nothing failed."""
    from fullband.folder import FILES_KEY, MODEL_KIND, _model_config, read_config_file
    from fullband.files import check_record

    n_fail = sum(f.level == FAIL for f in report.findings)
    label = lambda name: name if where == "." else f"{where}/{name}"  # noqa: E731
    try:
        data = read_config_file(folder)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            config = _model_config(folder, data)
        for w in caught:
            report.add(WARN, label("config.json"), str(w.message))
        report.add(OK, label("config.json"), f"a valid model config (d_model={config.d_model}, "
                                             f"n_layers={config.n_layers}, vocab_size={config.vocab_size}, "
                                             f"fusion={config.fusion})")
    except FullbandError as err:
        report.add(FAIL, label("config.json"), str(err))
        return False
    record = data.get(FILES_KEY)
    if record is None:
        report.add(WARN, label("."), "config.json has no record of the files' sizes and hashes (written by an "
                                     "older fullband): completeness can only be checked by loading")
    else:
        trainer = (folder / "trainer.json").is_file()
        left = sorted(n for n in record if not trainer and _training_state(n) and not (folder / n).exists())
        if left:  # model files copied out of a training checkpoint: they load; they cannot resume training
            report.add(WARN, label("."), f"the training state saved beside these weights is not here ({', '.join(left)}"
                                         "): a model folder copied out of a training checkpoint; it loads and "
                                         "generates, it cannot resume training")
        problems = [(name, problem) for name, entry in sorted(record.items()) if name not in left
                    for problem in check_record(folder, {name: entry}, hashes=hashes)]
        for name, problem in problems:
            report.add(FAIL, label(name), problem)
        if not problems:
            what = "sizes and sha256" if hashes else "sizes (hashes not checked: --quick)"
            report.add(OK, label("."), f"{len(record)} files match the {what} recorded at save time")
    trainer = (folder / "trainer.json").is_file()
    if not trainer:
        foreign = MODEL_KIND.foreign(folder)
        if foreign:
            report.add(WARN, label("."), f"holds files fullband does not write: {', '.join(foreign[:5])}")
    _weights(report, folder, label, data, config)
    _tokenizer(report, folder, label, config.vocab_size)
    if trainer:
        _trainer_files(report, folder, label)
    return sum(f.level == FAIL for f in report.findings) == n_fail


def _training_state(name: str) -> bool:
    """Whether a checkpoint file is training state (not needed to load the model)."""
    return name in ("trainer.json", "rng.pt") or re.fullmatch(r"optimizer(\.rank\d+)?\.pt", name) is not None


def _weights(report: Report, folder: Path, label, data: dict, config) -> None:
    from fullband.loader import load_model
    from fullband.folder import HF_CONFIG_KEY, WEIGHTS_FILE

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = load_model(folder)
    except FullbandError as err:
        report.add(FAIL, label(WEIGHTS_FILE), str(err))
        return
    n = sum(p.numel() for p in model.parameters())
    wrapped = " (a Hugging Face model wrapped with latent feedback)" if HF_CONFIG_KEY in data else ""
    report.add(OK, label(WEIGHTS_FILE), f"{n / 1e6:.2f}M parameters{wrapped}: names and shapes match config.json, "
                                        "every value is finite")


def _tokenizer(report: Report, folder: Path, label, vocab_size: int) -> None:
    from fullband.data.tokenizer import TOKENIZER_FILE, load_tokenizer

    if not (folder / TOKENIZER_FILE).is_file():
        report.add(WARN, label(TOKENIZER_FILE), "missing: the byte tokenizer will be assumed")
        return
    try:
        tok = load_tokenizer(folder)
    except FullbandError as err:
        report.add(FAIL, label(TOKENIZER_FILE), str(err))
        return
    if tok.vocab_size > vocab_size:
        report.add(FAIL, label(TOKENIZER_FILE), f"{tok.vocab_size} ids, more than the model's vocab_size={vocab_size}")
    else:
        report.add(OK, label(TOKENIZER_FILE), f"{tok.kind} tokenizer, {tok.vocab_size} ids")


def _trainer_files(report: Report, folder: Path, label) -> None:
    import torch

    from fullband.train.checkpoint import read_trainer_state

    try:
        state = read_trainer_state(folder)
    except FullbandError as err:
        report.add(FAIL, label("trainer.json"), str(err))
        return
    report.add(OK, label("trainer.json"), f"step {state['step']}, {state['tokens'] / 1e6:.2f}M tokens")
    world = state.get("world_size", 1)
    names = [f"optimizer.rank{r}.pt" for r in range(world)] if state.get("fsdp") else ["optimizer.pt"]
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        report.add(FAIL, label(missing[0]), f"missing ({', '.join(missing)}): the optimizer state cannot be restored")
    try:
        rng = torch.load(folder / "rng.pt", weights_only=False)
        if not isinstance(rng, dict) or {"torch", "numpy", "python"} - set(rng):
            raise ValueError("not the RNG states fullband saves")
    except Exception as err:  # torch.load raises many types for a damaged file
        report.add(FAIL, label("rng.pt"), f"cannot be read: {err}")


def _hf_folder(report: Report, folder: Path, hashes: bool) -> bool:
    from fullband.folder import check_finite, read_header

    n_fail = sum(f.level == FAIL for f in report.findings)
    try:
        from fullband.hf.modeling import FullbandConfig

        FullbandConfig.from_pretrained(folder)
        report.add(OK, "config.json", "a valid FullbandConfig")
    except FullbandError as err:
        report.add(FAIL, "config.json", str(err))
    except Exception as err:  # transformers' own errors
        report.add(FAIL, "config.json", f"cannot be read by transformers: {err}")
    if (folder / "model.safetensors").is_file():
        try:
            from safetensors.torch import load_file

            read_header(folder)
            check_finite(load_file(str(folder / "model.safetensors")), folder / "model.safetensors")
            report.add(OK, "model.safetensors", "readable, floating point, every value finite")
        except FullbandError as err:
            report.add(FAIL, "model.safetensors", str(err))
    else:
        report.add(WARN, "model.safetensors", "missing (a sharded folder is not checked tensor by tensor)")
    return sum(f.level == FAIL for f in report.findings) == n_fail


# ---------------------------------------------------------------------- a run directory
def _run_dir(path: Path, hashes: bool) -> Report:
    from fullband.configio import read_settings_file
    from fullband.files import try_lock
    from fullband.train.checkpoint import STEP_DIR, TRAINER_FILE, read_trainer_state
    from fullband.train.config import RunConfig
    from fullband.train.metrics import METRICS_FILE
    from fullband.train.rundir import RUN_FILE

    report = Report(path, "run directory")
    cfg = None
    try:
        cfg = RunConfig.from_dict(read_settings_file(path / RUN_FILE, "JSON"))
        report.add(OK, RUN_FILE, f"a valid run config ({cfg.train.steps} steps, seq_len {cfg.train.seq_len})")
    except FullbandError as err:
        report.add(FAIL, RUN_FILE, f"{err} (resuming needs the run's settings)")
    got = try_lock(path)
    busy = isinstance(got, str)
    if busy:
        report.add(WARN, ".", f"in use by another process ({got}): a training or resume is running; what follows "
                              "may change while it runs")
    else:
        got.release()
    for entry in sorted(path.iterdir()):
        if entry.name.startswith(".step_") and entry.name.endswith(".tmp"):
            report.add(WARN, entry.name, "a half-written checkpoint a stopped run left; the next --resume removes it")
    steps = sorted((p for p in path.iterdir() if p.is_dir() and STEP_DIR.match(p.name)),
                   key=lambda p: int(STEP_DIR.match(p.name).group(1)))
    good: list[Path] = []
    for step in steps:
        if not (step / TRAINER_FILE).is_file() or not (step / "config.json").is_file():
            report.add(FAIL, step.name, "incomplete (no trainer.json or config.json): not a checkpoint to resume from")
            continue
        if _checkpoint(report, step, step.name, hashes) and _matches_run(report, step, cfg):
            good.append(step)
    last_step = read_trainer_state(good[-1])["step"] if good else 0
    _metrics(report, path / METRICS_FILE, last_step)
    if busy:
        report.verdict = (f"in use by a running process ({got}); {len(good)} healthy checkpoint(s) so far"
                          f"{f', the latest {good[-1].name}' if good else ''}: check again when it stops")
    elif good and cfg is None:
        report.verdict = (f"not resumable as it is: {RUN_FILE} is damaged; restore it from {good[-1].name}/"
                          f"{TRAINER_FILE} ('config'), then --resume {path}")
    elif good and good[-1] == steps[-1] and last_step >= cfg.train.steps:
        report.verdict = f"finished: {good[-1].name} is the final checkpoint, and it is healthy"
    elif good and good[-1] == steps[-1]:
        report.verdict = f"resumable from {good[-1].name} (fullband train RECIPE --resume {path})"
    elif good:
        report.verdict = f"the latest checkpoint is damaged; resumable from {good[-1].name} (--resume {good[-1]})"
    elif cfg is not None:
        report.verdict = (f"no usable checkpoint: `--resume {path}` starts the run again from step 0 with its saved "
                          "settings" + (" (the damaged checkpoints must be moved away first)" if steps else ""))
    else:
        report.verdict = "not resumable: run.json is damaged and no checkpoint is usable"
    return report


def _matches_run(report: Report, step: Path, cfg) -> bool:
    """Whether the checkpoint's own config agrees with run.json on everything a resume compares."""
    from fullband.train.checkpoint import read_trainer_state
    from fullband.train.rundir import resume_differences

    if cfg is None:
        return True
    saved = read_trainer_state(step).get("config")
    if not isinstance(saved, dict):
        return True
    diffs = resume_differences(saved, cfg.to_dict())
    if diffs:
        report.add(FAIL, f"{step.name}/trainer.json", "its config differs from run.json: " + "; ".join(diffs[:3]))
        return False
    return True


def _metrics(report: Report, path: Path, last_step: int) -> None:
    if not path.is_file():
        report.add(WARN, path.name, "missing (no step was logged yet)")
        return
    rows, cut, later = 0, 0, 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            cut += 1
            continue
        rows += 1
        later += isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > last_step
    report.add(OK, path.name, f"{rows} rows")
    if cut:
        report.add(WARN, path.name, f"{cut} line(s) cut short (a kill while writing); a resume drops them")
    if later:
        report.add(WARN, path.name, f"{later} row(s) logged after step {last_step}, the last usable checkpoint; "
                                    "a resume drops them and trains those steps again")
