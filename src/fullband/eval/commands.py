"""`fullband eval <what> --checkpoint DIR`: check the arguments, load a checkpoint and its held-out data, run one
diagnostic (the eval modules compute), and hand the result to eval.report (a table, `<what>.json` and `<what>.png`
under CHECKPOINT/eval or --out)."""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fullband.data.sampler import count_windows, window_batches
from fullband.data.tokenizer import load_tokenizer
from fullband.model.mode import DecodeMode
from fullband.errors import ConfigError, FullbandWarning
from fullband.eval import report
from fullband.eval.loss import loss_by_mode
from fullband.files import cache_root, read_json, read_json_file
from fullband.model.core import FeedbackModel
from fullband.validate import integer


MAX_EXAMPLES = 100_000  # eval tracking: examples per length (each length's set is made in memory)

# ---------------------------------------------------------------------- inputs
def load(checkpoint: str | Path) -> tuple[FeedbackModel, object]:
    """The model and tokenizer of any folder fullband writes (fullband.loader.load_model)."""
    from fullband.loader import load_model

    return load_model(checkpoint), load_tokenizer(checkpoint)


def load_any(checkpoint: Path) -> tuple[FeedbackModel, object]:
    """`load`, and also a Llama folder (read with latent feedback, as `fullband convert` reads it, through a temporary
    native folder, so weights and tokenizer come back exactly as the native tools see them)."""
    import tempfile

    from fullband.hf.convert import convert, detect

    if detect(checkpoint) != "llama":
        return load(checkpoint)
    with tempfile.TemporaryDirectory(prefix="fullband-eval-") as tmp:
        convert(checkpoint, Path(tmp) / "native", to="native")
        return load(Path(tmp) / "native")


def held_out_stream(checkpoint: Path, tokenizer, *, corpus: str | None, val_percent: float | None):
    """The validation split the run held out (from its run.json), or --corpus; tokenised through the cache.
    `val_percent` (default: the run's, else 1) is the share of the corpus held out; 100 scores all of it."""
    if val_percent is not None and not (isinstance(val_percent, int | float) and not isinstance(val_percent, bool)
                                        and 0 < val_percent <= 100):
        raise ConfigError(f"val_percent={val_percent!r}; accepted: 0 < val_percent <= 100 (the held-out share of the "
                          "corpus, by file; 100 scores the whole corpus)")
    from fullband.data.corpus import resolve_corpus
    from fullband.data.shards import tokenize_corpus

    data = run_data(checkpoint)
    spec = corpus or data.get("corpus")
    if spec is None:
        raise ConfigError(f"{checkpoint} has no run.json beside it to name its corpus; pass --corpus")
    src = resolve_corpus(spec, text_field=data.get("text_field", "text"),
                         val_percent=val_percent or data.get("val_percent", 1.0))
    return tokenize_corpus(src, tokenizer, "val", cache_root(data.get("cache_dir", "")) / "tokens")


def warn_few_windows(stream, seq_len: int, windows: int, corpus: str | None) -> None:
    """Say so (FullbandWarning) when the held-out text holds fewer windows than were asked for (none: an error)."""
    have = count_windows(stream, seq_len)
    where = f"the held-out split of {corpus!r}" if corpus else "the run's held-out split"
    if have == 0:
        raise ConfigError(f"{where} holds {len(stream):,} tokens, not one window of seq_len={seq_len} + 1; lower "
                          "--seq-len, or hold out more of the corpus (--val-percent, 100 for all of it)")
    if windows > have:
        one = " (one window: no standard error)" if have == 1 else ""
        warnings.warn(f"{where} holds {len(stream):,} tokens: {have} window(s) of {seq_len} tokens, fewer than the "
                      f"{windows} asked for; scoring {have}{one}. Hold out more of the corpus with --val-percent "
                      "(100 scores all of it), or lower --seq-len", FullbandWarning, stacklevel=3)


def run_data(checkpoint: Path) -> dict:
    """The [data] section of the run.json beside a checkpoint ({} for a folder without one); a damaged one is a
    ConfigError that says so."""
    path = checkpoint.parent / "run.json"
    if not (path.exists() or path.is_symlink()):
        return {}
    saved = read_json_file(path, "the run's settings beside the checkpoint", error=ConfigError)
    data = saved.get("data", {}) if isinstance(saved, dict) else None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is damaged: no [data] section (it holds a JSON {type(saved).__name__}); pass "
                          "--corpus (and --task / --train-length for tracking) or restore it from a checkpoint's "
                          "trainer.json")
    return data


def bytes_per_token(tokenizer, vocab_size: int) -> torch.Tensor:
    """UTF-8 bytes each id stands for (0 for special ids), for bits/byte."""
    if tokenizer.kind == "byte":
        table = torch.zeros(vocab_size)
        table[:256] = 1
        return table
    lengths = [0] * vocab_size
    for tok, i in tokenizer.hf_tokenizer.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            lengths[i] = len(tok)  # byte-level BPE: one alphabet character per byte
    for i in {tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id}:
        if 0 <= i < vocab_size:
            lengths[i] = 0
    return torch.tensor(lengths, dtype=torch.get_default_dtype())


def _check_counts(**values: tuple[int, int]) -> None:
    """ConfigError for the first name=(value, minimum) whose value is not an integer >= minimum."""
    for name, (value, minimum) in values.items():
        integer(name, value, minimum)


@torch.no_grad()
def eval_loss(checkpoint: str | Path, *, max_prefill: int = 3, exact: bool = True, seq_len: int = 256,
              windows: int = 256, batch_size: int = 16, corpus: str | None = None, out: str | Path | None = None,
              auto_tols=(), max_auto: int = 32, progress: bool = True, val_percent: float | None = None) -> dict:
    """Held-out loss for STANDARD, FUSED with k = 1..max_prefill prefill passes, adaptive prefill (iterate until
    the RMS state update < tol, at most max_auto fused passes) for each of `auto_tols`, and the exact recurrence.
    The held-out text: the run's validation split, or `corpus`'s (`val_percent` of it by file; 100: all of it)."""
    checkpoint = Path(checkpoint)
    _check_counts(seq_len=(seq_len, 1), windows=(windows, 0), batch_size=(batch_size, 1), max_prefill=(max_prefill, 0),
                  max_auto=(max_auto, 1))
    if max_prefill > seq_len:
        raise ConfigError(f"max_prefill={max_prefill} is above seq_len={seq_len}: {seq_len} passes already make every "
                          "window exact (the 'exact' row); accepted: 0 <= max_prefill <= seq_len")
    for tol in auto_tols:
        if isinstance(tol, bool) or not isinstance(tol, int | float) or not (math.isfinite(tol) and tol > 0):
            raise ConfigError(f"auto tolerance {tol!r} is invalid; accepted: a finite number > 0")
    where = report.check_out(Path(out) if out else checkpoint / "eval", "loss")
    model, tok = load(checkpoint)
    stream = held_out_stream(checkpoint, tok, corpus=corpus, val_percent=val_percent)
    seq_len = min(seq_len, model.config.max_seq_len)
    warn_few_windows(stream, seq_len, windows, corpus)
    per_byte = bytes_per_token(tok, model.config.vocab_size)
    modes = [("standard", DecodeMode("standard"))]
    modes += [(f"fused k={k}", DecodeMode("fused", k)) for k in range(1, max_prefill + 1)]
    modes += [(f"auto tol={t:g}", DecodeMode("fused", max_auto, tol=t)) for t in auto_tols]
    if exact:
        modes.append(("exact", DecodeMode("exact")))
    n = min(windows, count_windows(stream, seq_len)) if windows > 0 else count_windows(stream, seq_len)
    batches = tqdm(window_batches(stream, seq_len, windows, batch_size), total=math.ceil(n / batch_size),
                   desc="eval loss", unit="batch", disable=not progress)
    rows = loss_by_mode(model, batches, modes, per_byte)
    result = {"checkpoint": str(checkpoint), "seq_len": seq_len, "windows": n, "rows": rows}
    report.show("loss", result, where)
    return result


def eval_stability(checkpoint: str | Path, *, ks=None, seq_len: int = 256, windows: int = 32, batch_size: int = 8,
                   corpus: str | None = None, out: str | Path | None = None, contraction_windows: int = 2,
                   progress: bool = True, val_percent: float | None = None) -> dict:
    from fullband.eval.stability import KS, contraction, jacobi_sweep

    checkpoint = Path(checkpoint)
    _check_counts(seq_len=(seq_len, 1), windows=(windows, 0), batch_size=(batch_size, 1),
                  contraction_windows=(contraction_windows, 1))
    if ks is not None:
        _check_counts(**{f"ks[{i}]": (k, 1) for i, k in enumerate(ks)})
    where = report.check_out(Path(out) if out else checkpoint / "eval", "stability")
    model, tok = load(checkpoint)
    stream = held_out_stream(checkpoint, tok, corpus=corpus, val_percent=val_percent)
    seq_len = min(seq_len, model.config.max_seq_len)
    warn_few_windows(stream, seq_len, windows, corpus)
    batches = list(window_batches(stream, seq_len, windows, batch_size))
    sweep = jacobi_sweep(model, batches, ks or KS, progress=progress)
    probe_inputs = batches[0][0][:contraction_windows]
    con = contraction(model, probe_inputs)
    result = {"checkpoint": str(checkpoint), "seq_len": seq_len, "windows": sum(len(b[0]) for b in batches),
              "sweep": asdict(sweep), "contraction": asdict(con)}
    report.show("stability", result, where)
    return result


def eval_probe(checkpoint: str | Path, *, tasks=("completion", "memory"), modes=("standard", "one-step", "suffix", "full"),
               suffix: int = 8, scratch=None, out: str | Path | None = None, progress: bool = True) -> dict:
    from fullband.data.synthetic import SCRATCH
    from fullband.eval.probe import probe_tasks

    try:  # the probes fit logistic regressions with scikit-learn: refuse before any model work when it is missing
        import sklearn  # noqa: F401
    except ImportError:
        raise ConfigError("the probes need scikit-learn, which is not installed: pip install "
                          "'fullband[eval]'") from None
    checkpoint = Path(checkpoint)
    _check_counts(suffix=(suffix, 1))
    where = report.check_out(Path(out) if out else checkpoint / "eval", "probe")
    model, tok = load(checkpoint)
    scratch = tuple(scratch or SCRATCH)
    result: dict = {"checkpoint": str(checkpoint), "suffix": suffix, "scratch": list(scratch),
                    "tasks": probe_tasks(model, tok, tasks, modes, suffix=suffix, scratch=scratch, progress=progress)}
    report.show("probe", result, where)
    return result


def eval_generate_length(checkpoint: str | Path, prompts: str | Path, *,
                         modes=(DecodeMode("standard"), DecodeMode("soft"), DecodeMode("fused", 1)),
                         max_new_tokens: int = 256, stop_text: str = "\n", out: str | Path | None = None) -> dict:
    from fullband.eval.generation import generation_lengths, read_prompts

    checkpoint = Path(checkpoint)
    _check_counts(max_new_tokens=(max_new_tokens, 1))
    where = report.check_out(Path(out) if out else checkpoint / "eval", "generate_length")
    model, tok = load(checkpoint)
    rows = read_prompts(prompts)
    res = generation_lengths(model, tok, rows, list(modes), max_new_tokens=max_new_tokens, stop_text=stop_text)
    result = {"checkpoint": str(checkpoint), "prompts": str(prompts), "n": len(rows), "modes": [asdict(r) for r in res]}
    report.show("generate_length", result, where)
    return result


CHAT_MODES = ("standard", "soft", "fused:1", "fused:2")


def eval_chat(checkpoint: str | Path, data: str | Path, *, modes=CHAT_MODES, max_new_tokens: int = 192,
              batch_size: int = 16, limit: int | None = None, out: str | Path | None = None,
              progress: bool = True) -> dict:
    """Exact match of the final answer and response length per decoding mode on held-out conversations."""
    from fullband.eval.chat import chat_eval, chat_figure, chat_table, held_out_items

    checkpoint = Path(checkpoint)
    _check_counts(max_new_tokens=(max_new_tokens, 1), batch_size=(batch_size, 1), **({} if limit is None else
                                                                                      {"limit": (limit, 1)}))
    modes = [DecodeMode.parse(m) for m in modes]
    where = report.check_out(Path(out) if out else checkpoint / "eval", "chat")
    split = (read_json(checkpoint.parent / "run.json") or {}).get("data")  # a corpus is split as its run split it
    val_percent = split.get("val_percent", 2.0) if isinstance(split, dict) else 2.0
    items = held_out_items(data, limit=limit, val_percent=val_percent)
    model, tok = load(checkpoint)
    for mode in modes:
        mode.check(model.config, ConfigError)
    result = {"checkpoint": str(checkpoint), "data": str(data),
              **chat_eval(model, tok, items, modes, max_new_tokens=max_new_tokens, batch_size=batch_size,
                          progress=progress)}
    print(chat_table(result))
    report.write(where, "chat", result, chat_figure(result))
    return result


def eval_tracking(checkpoint: str | Path, task: str | None = None, *, train_length: int | None = None,
                  n: int = 200, modes=None, batch_size: int = 32, out: str | Path | None = None,
                  progress: bool = True) -> dict:
    """Accuracy by input length (L, 2L, 4L, 8L) and decoding mode on a serial state-tracking task. The task and L
    default to the run's own (a `data.format = "tracking"` run, from its run.json)."""
    from fullband.data.tracking import TEST_MULTIPLES, check_fits, parse_spec
    from fullband.eval.tracking import DEFAULT_MODES, accuracy_table, tracking_figure, tracking_table

    checkpoint = Path(checkpoint)
    _check_counts(n=(n, 1), batch_size=(batch_size, 1))
    if n > MAX_EXAMPLES:
        raise ConfigError(f"n={n:,} examples per length is too many to score; accepted: 1 <= n <= {MAX_EXAMPLES:,}")
    data = run_data(checkpoint)
    if data.get("format") == "tracking":
        own_task, own_length = parse_spec(data["corpus"])
        task, train_length = task or own_task, train_length or own_length
    if task is None or train_length is None:
        raise ConfigError(f"{checkpoint} is not from a tracking run (no run.json with data.format = 'tracking' "
                          "beside it); pass --task and --train-length")
    _check_counts(train_length=(train_length, 1))
    name = f"tracking_{task}"
    where = report.check_out(Path(out) if out else checkpoint / "eval", name)
    model, tok = load_any(checkpoint)
    check_fits(task, TEST_MULTIPLES[-1] * train_length, model.config.max_seq_len,
               f"--train-length {train_length} (tested up to {TEST_MULTIPLES[-1]}L, within max_seq_len)")
    result = {"checkpoint": str(checkpoint),
              **accuracy_table(model, tok, task, train_length, n=n, modes=modes or DEFAULT_MODES,
                               batch_size=batch_size, progress=progress)}
    print(tracking_table(result))
    report.write(where, name, result, tracking_figure(result))
    return result
