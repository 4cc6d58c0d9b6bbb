"""Serial state tracking by length and decoding mode (`fullband eval tracking`): for a task of
fullband.data.tracking, the accuracy of the answer the model gives after reading an input of L, 2L, 4L, 8L steps
in each way of reading a prompt: STANDARD (one plain pass), FUSED with k prefill passes, adaptive prefill
(passes until the state stops moving), and EXACT (the recurrence, token by token).

The answer is the label (of the task's alphabet) with the highest logit at the query position."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from fullband.data.tracking import Example, label_ids, labels, length_sets
from fullband.model.mode import DecodeMode
from fullband.errors import InputError

DEFAULT_MODES = ("standard", "fused:1", "fused:2", "fused:4", "fused:auto", "exact")


@torch.no_grad()
def predictions(model, tokenizer, examples: list[Example], mode: DecodeMode, task: str, *,
                batch_size: int = 32) -> tuple[np.ndarray, list[int]]:
    """(predicted label index of every example, fused passes used per batch under adaptive prefill)."""
    candidates = torch.tensor(label_ids(tokenizer, task))
    device = next(model.parameters()).device
    preds, used = [], []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(examples), batch_size):
            rows = [tokenizer.encode(e.text, bos=True) for e in examples[start : start + batch_size]]
            lengths = torch.tensor([len(r) for r in rows], device=device)
            ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(r) for r in rows], batch_first=True).to(device)
            if int(lengths.max()) > model.config.max_seq_len:
                raise InputError(f"an example of {int(lengths.max())} tokens exceeds max_seq_len="
                                 f"{model.config.max_seq_len}; lower the train length or the number of multiples")
            out = model.read(ids, mode)
            top = out.top[torch.arange(len(rows), device=device), lengths - 1]
            logits = model.head(top).float()[:, candidates.to(device)]
            preds.append(logits.argmax(-1).cpu().numpy())
            if mode.adaptive:
                used.append(out.passes_used - 1)
    finally:
        model.train(was_training)
    return np.concatenate(preds), used


def accuracy_table(model, tokenizer, task: str, train_length: int, *, n: int = 200, modes=DEFAULT_MODES,
                   batch_size: int = 32, progress: bool = True) -> dict:
    """Accuracy ± standard error by test length (L, 2L, 4L, 8L) and mode."""
    modes = [DecodeMode.parse(m) for m in modes]
    for mode in modes:
        mode.check(model.config)
    sets = length_sets(task, train_length, n)
    alphabet = labels(task)
    rows = []
    for mode in modes:
        accs, ses, passes = [], [], []
        for length, exs in tqdm(sets.items(), desc=f"{task} {mode.label}", disable=not progress, leave=False):
            pred, used = predictions(model, tokenizer, exs, mode, task, batch_size=batch_size)
            truth = np.array([alphabet.index(e.label) for e in exs])
            acc = float((pred == truth).mean())
            accs.append(acc)
            ses.append(math.sqrt(acc * (1 - acc) / len(exs)))
            passes.append(float(np.mean(used)) if used else None)
        rows.append({"mode": mode.label, "accuracy": accs, "stderr": ses, "fused_passes_used": passes})
    return {"task": task, "train_length": train_length, "lengths": list(sets), "n": n,
            "chance": 1 / len(alphabet), "rows": rows}


def tracking_table(result: dict) -> str:
    lengths = result["lengths"]
    head = f"{'mode':<22}" + "".join(f"{f'length {n}':>16}" for n in lengths)
    lines = [f"{result['task']}: accuracy ± s.e. over {result['n']} examples per length (trained up to "
             f"{result['train_length']}; chance {result['chance']:.2f})", head]
    for r in result["rows"]:
        cells = "".join(f"{f'{a:.3f} ± {s:.3f}':>16}" for a, s in zip(r["accuracy"], r["stderr"]))
        lines.append(f"{r['mode']:<22}{cells}")
    return "\n".join(lines)


def tracking_figure(result: dict):
    from fullband.files import plt

    fig, ax = plt().subplots(figsize=(8, 4))
    for r in result["rows"]:
        ax.errorbar(result["lengths"], r["accuracy"], yerr=r["stderr"], marker="o", capsize=3, label=r["mode"])
    ax.axhline(result["chance"], color="k", ls=":", lw=1, label="chance")
    ax.axvline(result["train_length"], color="grey", ls="--", lw=1, label="longest training input")
    ax.set_xscale("log", base=2)
    ax.set_xticks(result["lengths"], [str(n) for n in result["lengths"]])
    ax.set(ylim=(0, 1.02), xlabel="input length (steps)", ylabel="accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the axes: lines meet at chance
    ckpt = Path(result.get("checkpoint", ""))  # run/step_N: the run's name says which model it is
    label = f"{ckpt.parent.name}/{ckpt.name}" if ckpt.name.startswith("step_") else ckpt.name
    # over the whole figure (the legend takes the right of it), wrapped: a long title (the demo's race) is not clipped
    fig.suptitle(textwrap.fill(result.get("title") or f"{result['task']}: {label}", 90), fontsize=10)
    fig.tight_layout()
    return fig
