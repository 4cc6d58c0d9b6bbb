"""`fullband doctor PATH`: check a model folder, a training checkpoint or a run directory without changing it:
files complete and as recorded at save time, weights finite and matching the config, the run resumable."""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from fullband.errors import FullbandError
from fullband.files import check_record, read_json, read_json_file, try_lock

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
    from fullband.train.checkpoint import STEP_DIR
    from fullband.train.rundir import RUN_FILE

    path = Path(path)
    if path.is_file() and path.name.lower().endswith(".gguf"):
        return _gguf(path)
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


def _gguf(path: Path) -> Report:
    """A GGUF file: its header against its tensors, and for a file fullband wrote, whether the sidecar beside it is
    its own (the pair's identity, the sizes) and readable."""
    from fullband.errors import CheckpointError, ConfigError
    from fullband.gguf_file import inspect_gguf
    from fullband.hf.gguf_out import read_sidecar

    report = Report(path, "GGUF file")
    try:
        info = inspect_gguf(path)
    except (ConfigError, FullbandError) as err:
        report.add(FAIL, path.name, str(err))
        report.verdict = "damaged: see the FAIL lines"
        return report
    sizes = info["sizes"]
    report.add(OK, path.name, f"{info['architecture']} header, {info['tensors']} tensors "
               f"({', '.join(f'{n} {t}' for t, n in sorted(info['tensor_types'].items()))})"
               + (f"; {sizes['blocks']} blocks, width {sizes['width']}, vocabulary {sizes['vocab']:,}, every tensor "
                  "the header implies" if sizes else ""))
    if not info["sidecar"]:
        report.add(OK, path.name, "no feedback sidecar: a standard model (llama.cpp decodes it STANDARD)")
    else:
        try:
            side, _ = read_sidecar(path)
            report.add(OK, info["sidecar"], f"the file's own feedback sidecar ({len(side)} tensors)"
                       + ("" if info.get("pair") else "; written before pairs carried an identity: sizes checked"))
        except (CheckpointError, ConfigError) as err:
            report.add(FAIL, info["sidecar"], str(err))
    report.verdict = "damaged: see the FAIL lines" if report.failed else "healthy"
    return report


# ---------------------------------------------------------------------- one model folder or checkpoint
def _checkpoint(report: Report, folder: Path, where: str, hashes: bool) -> bool:
    """Findings for a native model folder or training checkpoint; True when nothing failed."""
    from fullband.folder import FILES_KEY, MODEL_KIND, _model_config, read_config_file

    n_fail = sum(f.level == FAIL for f in report.findings)
    label = lambda name: name if where == "." else f"{where}/{name}"  # noqa: E731
    try:
        data = read_config_file(folder)
        with warnings.catch_warnings(record=True, action="always") as caught:
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
    trainer = (folder / "trainer.json").is_file()
    if record is None:
        report.add(WARN, label("."), "config.json has no record of the files' sizes and hashes (written by an "
                                     "older fullband): completeness can only be checked by loading")
    else:
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
    foreign = [] if trainer else MODEL_KIND.foreign(folder)
    if foreign:
        report.add(WARN, label("."), f"holds files fullband does not write: {', '.join(foreign[:5])}")
    _weights(report, folder, label, data, config)
    _tokenizer(report, folder, label, config)
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
        with warnings.catch_warnings(action="ignore"):
            model = load_model(folder)
    except FullbandError as err:
        report.add(FAIL, label(WEIGHTS_FILE), str(err))
        return
    n = sum(p.numel() for p in model.parameters())
    wrapped = " (a Hugging Face model wrapped with latent feedback)" if HF_CONFIG_KEY in data else ""
    report.add(OK, label(WEIGHTS_FILE), f"{n / 1e6:.2f}M parameters{wrapped}: names and shapes match config.json, "
                                        "every value is finite")


def _tokenizer(report: Report, folder: Path, label, config, hf: dict | None = None) -> None:
    """The tokenizer against the model and its config: the vocabulary fits the embedding, the special and stop
    ids are ids of the model, BOS agrees with the model's document start; for a transformers folder (`hf`, its
    config.json) also what transformers and vLLM read: the tokenizer AutoTokenizer loads (same special tokens,
    left padding, the same chat template rendering the same ids) and the end ids in config.json."""
    from fullband.data.tokenizer import BYTE_TOKENIZER_FILE, TOKENIZER_FILE, load_tokenizer

    where = label(TOKENIZER_FILE)
    if not ((folder / TOKENIZER_FILE).is_file() or (folder / BYTE_TOKENIZER_FILE).is_file()):
        report.add(WARN, where, "missing: the byte tokenizer will be assumed")
        return
    try:
        tok = load_tokenizer(folder)
    except FullbandError as err:
        report.add(FAIL, where, f"fullband cannot read it: {err}")
        return
    vocab = config.vocab_size
    problems = []
    if tok.vocab_size > vocab:
        problems.append(f"{tok.vocab_size} ids, more than the model's vocab_size={vocab}: ids past {vocab - 1} have no "
                        "embedding row")
    named = {"BOS": tok.bos_id, "EOS": tok.eos_id, "PAD": tok.pad_id, **{f"stop id {i}": i for i in tok.stop_ids}}
    problems += [f"its {what} {i} is not an id of the model (vocab_size={vocab})" for what, i in named.items()
                 if not 0 <= i < vocab]
    if config.bos_token_id is not None and config.bos_token_id != tok.bos_id:
        problems.append(f"its BOS id {tok.bos_id} differs from the model's bos_token_id={config.bos_token_id} (the "
                        "document start whose position is read plainly)")
    for text in problems:
        report.add(FAIL, where, text)
    if not problems:
        policy = "" if getattr(tok, "add_bos", True) else ", no BOS added to a text (as the model's own tokenizer)"
        report.add(OK, where, f"{tok.kind} tokenizer, {tok.vocab_size} ids; BOS, EOS, PAD and stop ids "
                              f"{list(tok.stop_ids)} are ids of the model{policy}")
    _chat_agrees(report, folder, label, tok)
    if hf is not None:
        _transformers_view(report, folder, tok, hf)
    if config.has_feedback and not config.feedback_trained:
        report.add(WARN, label("config.json"), "feedback_trained = false: the fusion weights are freshly initialised "
                                               "(a converted model); it decodes STANDARD unless a mode is asked for")


def _chat_agrees(report: Report, folder: Path, label, tok) -> None:
    """A chat template, when the tokenizer has one, renders a conversation into ids of this vocabulary."""
    from fullband.data.chat.templates import chat_prompt, hf_chat_template

    if not hf_chat_template(tok):
        report.add(OK, label("chat template"), "none (a base model: fullband chat and the chat API refuse it)")
        return
    try:
        ids = chat_prompt(tok, SAMPLE_CHAT)
    except FullbandError as err:
        report.add(FAIL, label("chat template"), f"cannot render a conversation: {err}")
        return
    report.add(OK, label("chat template"), f"renders a two-message conversation into {len(ids)} ids")


SAMPLE_CHAT = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi!"},
               {"role": "user", "content": "What is 2 + 3?"}]


def _transformers_view(report: Report, folder: Path, tok, hf: dict) -> None:
    """What transformers and vLLM read from the folder agrees with what fullband reads."""
    from fullband.data.chat.templates import chat_prompt, hf_chat_template

    stops = sorted(tok.stop_ids) if hf_chat_template(tok) or getattr(tok, "kind", "") == "pretrained" else []
    for name in ("config.json", "generation_config.json"):
        data = (hf if name == "config.json" else read_json(folder / name)) or {}
        eos = data.get("eos_token_id")
        declared = sorted(eos if isinstance(eos, list) else [] if eos is None else [eos])
        missing = [i for i in stops if i not in declared]
        if (folder / name).is_file() and missing:
            report.add(FAIL, name, f"eos_token_id={eos!r} lacks the stop id(s) {missing} fullband ends a turn at: "
                                   "transformers' and vLLM's generate would not stop there")
    try:
        import transformers

        with warnings.catch_warnings(action="ignore"):
            auto = transformers.AutoTokenizer.from_pretrained(str(folder))
    except ImportError:
        return
    except Exception as err:  # transformers' own errors
        report.add(FAIL, "tokenizer (transformers)", f"AutoTokenizer cannot read it: {err}")
        return
    problems = []
    if len(auto) > int(hf.get("vocab_size", len(auto))):
        problems.append(f"AutoTokenizer has {len(auto)} ids, more than vocab_size={hf.get('vocab_size')}")
    for what, ours in (("bos", tok.bos_id), ("eos", tok.eos_id)):
        theirs = getattr(auto, f"{what}_token_id")
        if theirs != ours:
            problems.append(f"its {what}_token_id is {theirs}, fullband's {ours}")
    if getattr(auto, "padding_side", "left") != "left":
        problems.append(f"padding_side={auto.padding_side!r}: a batch of prompts for generate must be padded on the "
                        "left (right-padded rows continue after their padding)")
    if hf_chat_template(tok):
        try:
            ids = auto.apply_chat_template(SAMPLE_CHAT, add_generation_prompt=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        except Exception as err:  # jinja's and transformers' errors
            problems.append(f"apply_chat_template fails ({err}): the server cannot answer chat requests")
        else:
            if ids != chat_prompt(tok, SAMPLE_CHAT):
                problems.append("apply_chat_template renders other ids than fullband's template: the server and "
                                "fullband chat would read different prompts")
    for text in problems:
        report.add(FAIL, "tokenizer (transformers)", text)
    if not problems:
        report.add(OK, "tokenizer (transformers)", "AutoTokenizer agrees: special ids, left padding"
                                                    f"{', the chat template' if hf_chat_template(tok) else ''}")


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
    from fullband.folder import check_finite, load_transformers_folder, read_header

    n_fail = sum(f.level == FAIL for f in report.findings)
    try:
        from fullband.hf.modeling import FullbandConfig

        FullbandConfig.from_pretrained(folder)
        report.add(OK, "config.json", "a valid FullbandConfig")
    except FullbandError as err:
        report.add(FAIL, "config.json", str(err))
    except Exception as err:  # transformers' own errors
        report.add(FAIL, "config.json", f"cannot be read by transformers: {err}")
    try:
        with warnings.catch_warnings(action="ignore"):
            config = load_transformers_folder(folder).config
    except FullbandError:
        config = None  # the weights' findings below say why
    if config is not None:
        _tokenizer(report, folder, lambda name: name, config, hf=read_json(folder / "config.json") or {})
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
    _gate(report, path)
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

    saved = None if cfg is None else read_trainer_state(step).get("config")
    diffs = resume_differences(saved, cfg.to_dict()) if isinstance(saved, dict) else []
    if diffs:
        report.add(FAIL, f"{step.name}/trainer.json", "its config differs from run.json: " + "; ".join(diffs[:3]))
    return not diffs


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


def _gate(report: Report, run_dir: Path) -> None:
    """The stability gate at the run's last eval (fullband.eval.gate). A failed gate warns: the files are healthy,
    the training is not."""
    from fullband.train.metrics import METRICS_FILE, last_gate

    gate = last_gate(run_dir)
    if gate is None:
        return  # no eval yet (or no metrics.jsonl, reported above)
    where = f"{METRICS_FILE} (stability gate)"
    if gate is False:
        report.add(OK, where, "not measured (trained before the gate existed, or with log.gate_windows = 0)")
    elif gate.passed:
        report.add(OK, where, f"{gate.summary()} at the last eval")
    else:
        report.add(WARN, where, f"did not pass at the last eval: {'; '.join(gate.failures())}. The files are healthy; "
                                "the training is not stable (docs/method.md, the stability gate)")
