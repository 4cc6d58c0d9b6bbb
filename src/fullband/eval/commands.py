"""`fullband eval <what> --checkpoint DIR`: load a checkpoint and its held-out data, run one diagnostic, print a
table and write `<what>.json` and `<what>.png` next to it (or under --out)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from fullband.data.sampler import count_windows, read_windows
from fullband.data.tokenizer import load_tokenizer
from fullband.decode.mode import DecodeMode
from fullband.errors import ConfigError
from fullband.files import OutputError, check_writable, make_folder, read_json, replace_file, writing
from fullband.model.decoder import FullbandLM


# ---------------------------------------------------------------------- inputs
def load(checkpoint: str | Path) -> tuple[FullbandLM, object]:
    from fullband.checkpoint import load_native

    model = load_native(checkpoint, "fullband eval")
    return model, load_tokenizer(checkpoint)


def held_out_stream(checkpoint: Path, tokenizer, *, corpus: str | None, val_percent: float | None):
    """The validation split the run held out (from its run.json), or --corpus; tokenised through the cache."""
    from fullband.data.corpus import resolve_corpus
    from fullband.data.shards import tokenize_corpus
    from fullband.train.data import cache_root

    run_json = checkpoint.parent / "run.json"
    data = json.loads(run_json.read_text())["data"] if run_json.is_file() else {}
    spec = corpus or data.get("corpus")
    if spec is None:
        raise ConfigError(f"{checkpoint} has no run.json beside it to name its corpus; pass --corpus")
    src = resolve_corpus(spec, text_field=data.get("text_field", "text"),
                         val_percent=val_percent or data.get("val_percent", 1.0))
    return tokenize_corpus(src, tokenizer, "val", cache_root(data.get("cache_dir", "")) / "tokens")


def window_batches(stream, seq_len: int, windows: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Evenly spaced validation windows, read lazily batch by batch (the stream stays on disk)."""
    total = count_windows(stream, seq_len)
    n = min(windows, total) if windows > 0 else total
    picks = np.arange(n, dtype=np.int64) * total // n
    for i in range(0, n, batch_size):
        yield read_windows(stream, picks[i : i + batch_size], seq_len)


def bytes_per_token(tokenizer, vocab_size: int) -> torch.Tensor:
    """UTF-8 bytes each id stands for (0 for special ids), for bits/byte."""
    table = torch.zeros(vocab_size)
    if tokenizer.kind == "byte":
        table[:256] = 1
        return table
    hf = tokenizer.hf_tokenizer
    special = {tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id}
    for i in range(min(vocab_size, tokenizer.vocab_size)):
        tok = hf.id_to_token(i)
        if tok is not None and i not in special:
            table[i] = len(tok)  # byte-level BPE: one alphabet character per byte
    return table


def check_out(out: str | Path, name: str) -> Path:
    """The folder for NAME.json / NAME.png, refused now (before any work) when it is a file or not writable, or
    when it holds a NAME.json / NAME.png that fullband eval did not write (those are never overwritten)."""
    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise OutputError(f"--out {str(out)!r} is a file; accepted: a folder for {name}.json / {name}.png")
    ours = "checkpoint" in (read_json(out / f"{name}.json") or {})  # every eval result names its checkpoint
    theirs = [f for f in (f"{name}.json", f"{name}.png") if (out / f).exists() and not ours]
    if theirs:
        raise OutputError(f"--out {str(out)!r} holds {' and '.join(theirs)}, not written by fullband eval; nothing "
                          "was overwritten. Choose another --out")
    check_writable(out, "--out")
    return out


def require_sklearn() -> None:
    """The probes fit logistic regressions with scikit-learn: refuse before any model work when it is missing."""
    try:
        import sklearn  # noqa: F401
    except ImportError:
        raise ConfigError("the probes need scikit-learn, which is not installed: pip install 'fullband[eval]'") from None


def _save(out: Path, name: str, result: dict, fig=None) -> None:
    """WHAT.json and WHAT.png into `out`, each through a temporary file and a rename."""
    check_out(out, name)
    make_folder(out, "--out")
    replace_file(out / f"{name}.json", json.dumps(result, indent=2) + "\n")
    if fig is not None:
        import matplotlib.pyplot as plt

        fig.tight_layout()
        tmp = out / f".{name}.png.tmp"
        with writing(out, f"write {name}.png"):
            fig.savefig(tmp, dpi=120, format="png")
            os.replace(tmp, out / f"{name}.png")
        plt.close(fig)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _check_counts(**values: tuple[int, int]) -> None:
    """ConfigError for the first name=(value, minimum) whose value is not an integer >= minimum."""
    for name, (value, minimum) in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{name}={value!r} is invalid; accepted: an integer >= {minimum}")


# ---------------------------------------------------------------------- eval loss
@torch.no_grad()
def eval_loss(checkpoint: str | Path, *, max_prefill: int = 3, exact: bool = True, seq_len: int = 256,
              windows: int = 256, batch_size: int = 16, corpus: str | None = None, out: str | Path | None = None,
              auto_tols=(), max_auto: int = 32, progress: bool = True) -> dict:
    """Held-out loss for STANDARD, FUSED with k = 1..max_prefill prefill passes, adaptive prefill (iterate until
    the RMS state update < tol, at most max_auto fused passes) for each of `auto_tols`, and the exact recurrence."""
    checkpoint = Path(checkpoint)
    _check_counts(seq_len=(seq_len, 1), windows=(windows, 0), batch_size=(batch_size, 1), max_prefill=(max_prefill, 0),
                  max_auto=(max_auto, 1))
    if max_prefill > seq_len:
        raise ConfigError(f"max_prefill={max_prefill} is above seq_len={seq_len}: {seq_len} passes already make every "
                          "window exact (the 'exact' row); accepted: 0 <= max_prefill <= seq_len")
    for tol in auto_tols:
        if isinstance(tol, bool) or not isinstance(tol, int | float) or not (math.isfinite(tol) and tol > 0):
            raise ConfigError(f"auto tolerance {tol!r} is invalid; accepted: a finite number > 0")
    check_out(Path(out) if out else checkpoint / "eval", "loss")
    model, tok = load(checkpoint)
    stream = held_out_stream(checkpoint, tok, corpus=corpus, val_percent=None)
    seq_len = min(seq_len, model.config.max_seq_len)
    per_byte = bytes_per_token(tok, model.config.vocab_size)
    modes = [("standard", DecodeMode("standard"))]
    modes += [(f"fused k={k}", DecodeMode("fused", k)) for k in range(1, max_prefill + 1)]
    modes += [(f"auto tol={t:g}", DecodeMode("fused", "auto", tol=t, max_passes=max_auto)) for t in auto_tols]
    if exact:
        modes.append(("exact", DecodeMode("exact")))
    sums = {name: [] for name, _ in modes}
    used: dict[str, list[int]] = {name: [] for name, mode in modes if mode.tolerance}
    nbytes = 0.0
    from tqdm.auto import tqdm

    n_batches = math.ceil(min(windows, count_windows(stream, seq_len)) / batch_size)
    for inputs, targets in tqdm(window_batches(stream, seq_len, windows, batch_size), total=n_batches,
                                desc="eval loss", unit="batch", disable=not progress):
        nbytes += float(per_byte[targets].sum())
        for name, mode in modes:
            if mode.exact:
                logits = model.recurrent_forward(inputs).logits
            else:
                res = model(inputs, passes=mode.passes, tol=mode.tolerance)
                logits = res.logits
                if mode.tolerance:
                    used[name].append(res.passes_used - 1)
            nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
            sums[name].append(nll.view(targets.shape).double())
    rows = []
    for name, mode in modes:
        nll = torch.cat(sums[name])  # (N, T)
        per_window = nll.mean(dim=1)
        rows.append({
            "mode": name, "passes": None if mode.exact or mode.tolerance else mode.passes,
            "fused_passes_used": float(np.mean(used[name])) if name in used else None,
            "nats_per_token": float(per_window.mean()),
            "stderr": float(per_window.std() / math.sqrt(len(per_window))),
            "bits_per_byte": float(nll.sum()) / math.log(2) / max(nbytes, 1.0),
        })
    result = {"checkpoint": str(checkpoint), "seq_len": seq_len, "windows": int(nll.shape[0]), "rows": rows}
    print(f"{'mode':<15} {'passes':>6} {'nats/token':>11} {'± s.e.':>8} {'bits/byte':>10}")
    for r in rows:
        passes = r["passes"] or ("T+1" if r["mode"] == "exact" else f"{1 + r['fused_passes_used']:.1f}")
        print(f"{r['mode']:<15} {passes:>6} {r['nats_per_token']:>11.4f} {r['stderr']:>8.4f} "
              f"{r['bits_per_byte']:>10.4f}")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ks = list(range(0, max_prefill + 1))
    fused = [r for r in rows if r["passes"] is not None]
    for r in rows:
        if r["fused_passes_used"] is not None:
            ax.errorbar([r["fused_passes_used"]], [r["nats_per_token"]], yerr=[r["stderr"]], marker="D", capsize=3,
                        ls="none", label=f"{r['mode']} (mean passes used)")
    ax.errorbar(ks, [r["nats_per_token"] for r in fused], yerr=[r["stderr"] for r in fused], marker="o", capsize=3,
                label="STANDARD (k=0) and FUSED (k prefill passes)")
    if exact:
        ex = rows[-1]
        ax.axhline(ex["nats_per_token"], color="k", ls="--", lw=1, label="exact recurrence")
    ax.set_xlabel("fused prefill passes k")
    ax.set_ylabel("held-out loss (nats / token)")
    ax.set_xticks(ks)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(checkpoint.name)
    _save(Path(out) if out else checkpoint / "eval", "loss", result, fig)
    return result


# ---------------------------------------------------------------------- eval stability
def eval_stability(checkpoint: str | Path, *, ks=None, seq_len: int = 256, windows: int = 32, batch_size: int = 8,
                   corpus: str | None = None, out: str | Path | None = None, contraction_windows: int = 2,
                   progress: bool = True) -> dict:
    from fullband.eval.stability import KS, contraction, jacobi_sweep

    checkpoint = Path(checkpoint)
    _check_counts(seq_len=(seq_len, 1), windows=(windows, 0), batch_size=(batch_size, 1),
                  contraction_windows=(contraction_windows, 1))
    if ks is not None:
        _check_counts(**{f"ks[{i}]": (k, 1) for i, k in enumerate(ks)})
    check_out(Path(out) if out else checkpoint / "eval", "stability")
    model, tok = load(checkpoint)
    stream = held_out_stream(checkpoint, tok, corpus=corpus, val_percent=None)
    seq_len = min(seq_len, model.config.max_seq_len)
    batches = list(window_batches(stream, seq_len, windows, batch_size))
    sweep = jacobi_sweep(model, batches, ks or KS, progress=progress)
    probe_inputs = batches[0][0][:contraction_windows]
    con = contraction(model, probe_inputs)
    result = {"checkpoint": str(checkpoint), "seq_len": seq_len, "windows": sum(len(b[0]) for b in batches),
              "sweep": asdict(sweep), "contraction": asdict(con)}
    print(f"{'k':>5} {'loss':>8} {'± s.e.':>7} {'|h(k)-h(k-1)|':>14} {'|h(k)-exact|':>13}")
    for i, k in enumerate(sweep.ks):
        ex = sweep.exact_rms[i]
        print(f"{k:>5} {sweep.loss[i]:>8.4f} {sweep.loss_stderr[i]:>7.4f} {sweep.update_rms[i]:>14.3e} "
              f"{(f'{ex:.3e}' if ex is not None else '-'):>13}")
    if sweep.converged_at:
        print(f"every window reached its fixed point (the exact recurrence) at k = {sweep.converged_at} (T = {seq_len})")
    print("perturbation growth per pass (||J^k v|| / ||v||)^(1/k): "
          + ", ".join(f"k={h}: {g:.3f}" for h, g in zip(con.horizons, con.growth))
          + f"; one-pass gain ||J||_2 = {con.lipschitz:.3f}")
    print("growth < 1: the pass map contracts and long feedback horizons stay stable; > 1: perturbations grow")
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    axes[0].errorbar(sweep.ks, sweep.loss, yerr=sweep.loss_stderr, marker="o", capsize=3, label="Jacobi iterate")
    if sweep.exact_loss is not None:
        axes[0].axhline(sweep.exact_loss, color="k", ls="--", lw=1, label="exact recurrence")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("passes k")
    axes[0].set_ylabel("held-out loss (nats / token)")
    axes[0].legend(fontsize=8)
    curve = np.array(sweep.update_curve)
    kk = np.arange(1, len(curve) + 1)
    keep = curve > 0
    axes[1].loglog(kk[keep][1:], curve[keep][1:], label="RMS ||h(k) - h(k-1)||")
    exact = [(k, v) for k, v in zip(sweep.ks, sweep.exact_rms) if v]
    if exact:
        axes[1].loglog(*zip(*exact), "s--", label="RMS ||h(k) - h_exact||")
    axes[1].set_xlabel("passes k")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(f"{checkpoint.name}: iterating the fused pass map (T = {seq_len})")
    _save(Path(out) if out else checkpoint / "eval", "stability", result, fig)
    return result


# ---------------------------------------------------------------------- eval probe
def eval_probe(checkpoint: str | Path, *, tasks=("completion", "memory"), modes=("standard", "one-step", "suffix", "full"),
               suffix: int = 8, scratch=None, out: str | Path | None = None, progress: bool = True) -> dict:
    from fullband.data.synthetic import SCRATCH, completion_tracking, delayed_memory, register_last_write
    from fullband.eval.probe import answer_accuracy, final_streams, probe_by_depth

    require_sklearn()
    checkpoint = Path(checkpoint)
    _check_counts(suffix=(suffix, 1))
    check_out(Path(out) if out else checkpoint / "eval", "probe")
    model, tok = load(checkpoint)
    scratch = tuple(scratch or SCRATCH)
    build = {"completion": lambda: completion_tracking(scratch=scratch), "memory": lambda: delayed_memory(scratch=scratch),
             "registers": lambda: register_last_write()}
    result: dict = {"checkpoint": str(checkpoint), "suffix": suffix, "scratch": list(scratch), "tasks": {}}
    for task in tasks:
        examples = build[task]()
        longest = max(len(tok.encode(ex.text)) for ex in examples)
        if longest > model.config.max_seq_len:
            raise ConfigError(f"task {task!r} has examples of {longest} tokens > max_seq_len="
                              f"{model.config.max_seq_len}; pass fewer scratch updates (--scratch 0 8 32)")
        result["tasks"][task] = {"examples": len(examples), "groups": len({e.group for e in examples}), "modes": {},
                                 "answer": {}}
        # what the model itself answers after the ':' (the probe cannot be asked to find what the model never computed)
        for mode in (DecodeMode("standard"), DecodeMode("fused", 1)):
            ans = answer_accuracy(model, tok, examples, passes=mode.passes)
            result["tasks"][task]["answer"][mode.label] = ans
            print(f"{task:<11} model answers ({mode.label}): {ans['accuracy']:.3f}  by length {ans['by_length']}")
        for mode in modes:
            streams = final_streams(model, tok, examples, mode, suffix=suffix, progress=progress)
            acc = probe_by_depth(streams, examples)
            result["tasks"][task]["modes"][mode] = acc
            print(f"{task:<11} {mode:<9} layer 0: {acc[0]:.3f}  best: {max(acc):.3f} (depth {int(np.argmax(acc))})")
    plt = _plt()
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for mode, acc in result["tasks"][task]["modes"].items():
            ax.plot(range(len(acc)), acc, marker="o", label=mode if mode != "suffix" else f"suffix k={suffix}")
        ax.axhline(0.5, color="k", lw=0.8, ls=":")
        ax.set_ylim(0.3, 1.02)
        ax.set_xticks(range(len(acc)))
        ax.set_xlabel("depth (0 = stack input)")
        ax.set_ylabel("probe accuracy (4-fold grouped CV)")
        ax.set_title(task)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(Path(out) if out else checkpoint / "eval", "probe", result, fig)
    return result


# ---------------------------------------------------------------------- eval generate-length
def eval_generate_length(checkpoint: str | Path, prompts: str | Path, *,
                         modes=(DecodeMode("standard"), DecodeMode("soft"), DecodeMode("fused", 1)),
                         max_new_tokens: int = 256, stop_text: str = "\n", out: str | Path | None = None) -> dict:
    from fullband.eval.generation import generation_lengths, read_prompts

    checkpoint = Path(checkpoint)
    _check_counts(max_new_tokens=(max_new_tokens, 1))
    check_out(Path(out) if out else checkpoint / "eval", "generate_length")
    model, tok = load(checkpoint)
    rows = read_prompts(prompts)
    res = generation_lengths(model, tok, rows, list(modes), max_new_tokens=max_new_tokens, stop_text=stop_text)
    result = {"checkpoint": str(checkpoint), "prompts": str(prompts), "n": len(rows), "modes": [asdict(r) for r in res]}
    print(f"{'mode':<14} {'median tokens':>13} {'mean':>8} {'exact match':>11}")
    for r in res:
        name = r.mode if r.mode != "fused" else f"fused k={r.prefill_passes}"
        acc = f"{r.accuracy:.3f}" if r.accuracy is not None else "-"
        print(f"{name:<14} {r.median_tokens:>13.1f} {r.mean_tokens:>8.1f} {acc:>11}")
    _save(Path(out) if out else checkpoint / "eval", "generate_length", result)
    return result
