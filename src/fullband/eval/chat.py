"""Chat evaluation (`fullband eval chat`): for held-out conversations, answer the last user turn greedily in each
decoding mode and report exact match of the final answer ('Answer: N') against the reference reply, and the
response length in tokens, each with its standard error; differences to STANDARD are paired (same items)."""

from __future__ import annotations

import math
from itertools import islice
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fullband.data.chat.arithmetic import final_answer
from fullband.data.chat.messages import Message
from fullband.data.chat.templates import chat_prompt, chat_template
from fullband.decode.generate import generate
from fullband.model.mode import DecodeMode
from fullband.errors import DataError


def held_out_items(path: str | Path, *, limit: int | None = None, val_percent: float = 2.0,
                   split: str | None = None) -> list[tuple[list[Message], str]]:
    """(prompt, reference answer) pairs of a chat corpus (fullband.data.chat.sources.check_prompt: an object's
    'answer', or its last assistant turn's final 'Answer: ...'), the first `limit` of them. `split` 'train' / 'val':
    that side of the corpus (by a hash of each conversation, as training splits it); None: a .jsonl file whole, any
    other corpus spec (e.g. 'arithmetic') its held-out side."""
    from fullband.data.chat.sources import chat_prompts

    if split is None:
        split = None if Path(path).is_file() else "val"
    items = list(islice(chat_prompts(str(path), split, val_percent), limit))
    if not items:
        raise DataError(f"{path} holds no conversation" + (f" on its {split!r} side" if split else ""))
    return items


def _mean_se(values) -> tuple[float, float]:
    a = np.asarray(values, dtype=np.float64)
    se = float(a.std(ddof=1) / math.sqrt(a.size)) if a.size > 1 else float("nan")
    return float(a.mean()), se


def chat_eval(model, tokenizer, items: list[tuple[list[Message], str]], modes: list[DecodeMode], *,
              max_new_tokens: int = 192, batch_size: int = 16, progress: bool = True, score=None) -> dict:
    """Per mode: accuracy and response length (mean ± s.e.), the share of answers that ended with the end-of-turn
    token, paired differences to the first mode, and every answer (for inspection). Accuracy is the mean of
    `score(messages, answer text, reference)` (default: 1 for an exact match of the final 'Answer: ...')."""
    template = chat_template(tokenizer)
    prompts = [chat_prompt(tokenizer, msgs, template=template) for msgs, _ in items]
    stops = list(tokenizer.stop_ids)
    # every item gets the same budget: one whose prompt leaves less room is skipped (counted)
    fits = [len(p) + max_new_tokens <= model.config.max_seq_len for p in prompts]
    skipped = len(items) - sum(fits)
    items = [it for it, ok in zip(items, fits) if ok]
    prompts = [p for p, ok in zip(prompts, fits) if ok]
    if not items:
        raise DataError(f"no conversation leaves room for {max_new_tokens} new tokens in max_seq_len="
                        f"{model.config.max_seq_len}; lower max_new_tokens")
    new = max_new_tokens
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    rows = []
    for mode in modes:
        answers: list[list[int]] = [[] for _ in prompts]
        batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
        for batch in tqdm(batches, desc=f"chat eval {mode.label}", disable=not progress, leave=False):
            for i, ids in zip(batch, generate(model, [prompts[i] for i in batch], new, mode=mode, stop_tokens=stops)):
                answers[i] = ids
        texts = [tokenizer.decode([t for t in a if t not in stops]) for a in answers]
        correct = [float(final_answer(t) == ref) if score is None else float(score(msgs, t, ref))
                   for t, (msgs, ref) in zip(texts, items)]
        lengths = [len(a) for a in answers]
        ended = [float(bool(a) and a[-1] in stops) for a in answers]
        acc, acc_se = _mean_se(correct)
        length, length_se = _mean_se(lengths)
        rows.append({"mode": mode.label, "accuracy": acc, "accuracy_se": acc_se, "tokens": length,
                     "tokens_se": length_se, "ended": float(np.mean(ended)), "answers": texts,
                     "correct": correct, "lengths": lengths})
    base = rows[0]
    for row in rows:
        row["accuracy_diff"], row["accuracy_diff_se"] = _mean_se(np.subtract(row["correct"], base["correct"]))
        row["tokens_diff"], row["tokens_diff_se"] = _mean_se(np.subtract(row["lengths"], base["lengths"]))
    return {"n": len(items), "skipped": skipped, "max_new_tokens": new, "baseline": modes[0].label, "rows": rows,
            "references": [ref for _, ref in items]}


def chat_table(result: dict) -> str:
    base = result["baseline"]
    skipped = f" ({result['skipped']} skipped: too long for the context)" if result.get("skipped") else ""
    lines = [f"{result['n']} held-out conversations{skipped}, greedy, at most {result['max_new_tokens']} new tokens",
             f"{'mode':<16} {'exact match':>15} {'vs ' + base:>18} {'tokens':>14} {'vs ' + base:>16} {'ended':>6}"]
    for r in result["rows"]:
        same = r["mode"] == base
        acc_diff = "" if same else f"{r['accuracy_diff']:+.3f} ± {r['accuracy_diff_se']:.3f}"
        tok_diff = "" if same else f"{r['tokens_diff']:+.1f} ± {r['tokens_diff_se']:.1f}"
        lines.append(f"{r['mode']:<16} {r['accuracy']:>7.3f} ± {r['accuracy_se']:.3f} {acc_diff:>18} "
                     f"{r['tokens']:>6.1f} ± {r['tokens_se']:>5.1f} {tok_diff:>16} {r['ended']:>6.0%}")
    return "\n".join(lines)


def chat_figure(result: dict):
    from fullband.files import plt

    rows = result["rows"]
    names = [r["mode"] for r in rows]
    fig, axes = plt().subplots(1, 2, figsize=(10, 3.6))
    x = np.arange(len(rows))
    axes[0].bar(x, [r["accuracy"] for r in rows], yerr=[r["accuracy_se"] for r in rows], capsize=4, color="#3a7")
    axes[0].set(ylabel="exact match of the final answer", ylim=(0, 1))
    axes[1].bar(x, [r["tokens"] for r in rows], yerr=[r["tokens_se"] for r in rows], capsize=4, color="#27a")
    axes[1].set_ylabel("response length (tokens)")
    for ax in axes:
        ax.set_xticks(x, names, fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{Path(result['checkpoint']).name}: {result['n']} held-out conversations per mode")
    return fig
