"""Linear probes on the residual stream (the paper's Fig. 7 / appendix F): at the final ':' of each synthetic
state-tracking example, read the stream at every depth (0 = the stack input) under four prefill modes and
fit L2-regularised logistic regression with 4-fold grouped cross-validation.

Prefill modes: `standard` (one plain pass), `one-step` (only the final position is fused, with the plain
state of the position before it), `suffix` (the last k positions run the exact recurrence after a plain
prefix), `full` (the exact recurrence over the whole example)."""

from __future__ import annotations

import functools
from collections import defaultdict

import numpy as np
import torch
from tqdm.auto import tqdm

from fullband.data.synthetic import Example
from fullband.errors import ConfigError, InputError

PREFILLS = ("standard", "one-step", "suffix", "full")


@torch.no_grad()
def final_streams(model, tokenizer, examples: list[Example], mode: str, *, suffix: int = 8,
                  progress: bool = False) -> np.ndarray:
    """(N, L + 1, D) float32: the residual stream at each example's last position, depth 0 .. L."""
    if mode not in PREFILLS:
        raise InputError(f"prefill mode {mode!r} is unknown; accepted: {', '.join(PREFILLS)}")
    model.eval()
    device = next(model.parameters()).device
    encoded = [tokenizer.encode(ex.text) for ex in examples]
    out = np.zeros((len(examples), len(model.blocks) + 1, model.config.d_model), dtype=np.float32)
    captured: dict[int, torch.Tensor] = {}

    def grab(depth, module, args):
        captured[depth] = args[0][:, -1].float().cpu()

    # depth d < L is the input of block d (its first norm reads it), depth L the final norm's input: both in a
    # whole-sequence pass and in a decode step; each keeps its last call (blocks below model.feedback_target run
    # once, the others once per pass)
    hooks = [m.register_forward_pre_hook(functools.partial(grab, d))
             for d, m in enumerate([*(b.attn_norm for b in model.blocks), model.norm_out])]
    bar = tqdm(total=len(examples), desc=f"probe prefill {mode}", unit="ex", disable=not progress)
    try:
        for chunk in _same_length_batches(encoded, 16):
            ids = torch.tensor([encoded[i] for i in chunk], device=device)
            captured.clear()
            _run(model, ids, mode, suffix)
            last = torch.stack([captured[d] for d in range(len(model.blocks) + 1)], dim=1)  # (B, L + 1, D)
            out[chunk] = last.numpy()
            bar.update(len(chunk))
    finally:
        for h in hooks:
            h.remove()
        bar.close()
    return out


def _run(model, ids: torch.Tensor, mode: str, suffix: int) -> None:
    B, T = ids.shape
    pos = torch.arange(T, device=ids.device)
    if mode == "standard":
        model(ids, passes=1, return_logits=False)
    elif mode == "one-step":  # plain everywhere but the final position; 2 passes make it read a plain state
        model(ids, passes=2, plain_mask=(pos < T - 1).expand(B, T), return_logits=False)
    elif mode == "suffix":  # exact over the last `suffix` positions (k + 1 Jacobi passes are exact there)
        k = min(suffix, T - 1)
        model(ids, passes=k + 1, plain_mask=(pos < T - k).expand(B, T), return_logits=False)
    else:  # the exact recurrence token by token; its last call is the final position
        model.recurrent_forward(ids, return_logits=False)


def grouped_folds(groups: list[str] | np.ndarray, folds: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train, test) index arrays; every group lies wholly in one test fold (scikit-learn's GroupKFold)."""
    from sklearn.model_selection import GroupKFold

    groups = np.asarray(groups)
    return list(GroupKFold(n_splits=folds).split(np.arange(len(groups)), groups=groups))


def probe_accuracy(features: np.ndarray, labels: np.ndarray, groups, *, folds: int = 4, C: float = 1.0) -> float:
    """Mean held-out accuracy of an L2 logistic-regression probe under grouped k-fold cross-validation."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    accs = []
    for train, test in grouped_folds(groups, folds):
        clf = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=2000))
        clf.fit(features[train], labels[train])
        accs.append(float((clf.predict(features[test]) == labels[test]).mean()))
    return float(np.mean(accs))


@torch.no_grad()
def answer_accuracy(model, tokenizer, examples: list[Example], passes: int = 1) -> dict:
    """How often the model itself answers: at the final ':' (which the training documents follow directly with the
    label), does the first token of the right label outscore the other label's? `passes` = 1 is STANDARD prefill,
    k > 1 is FUSED with k - 1 extra passes. Returns the accuracy overall and per length."""
    model.eval()
    device = next(model.parameters()).device
    words = sorted({(ex.target, ex.label) for ex in examples})
    if len(words) != 2:
        raise InputError(f"answer_accuracy needs a binary task; saw labels {[w for _, w in words]}")
    skip = len(tokenizer.encode(""))  # tokens the tokenizer prepends (BOS)
    first = [tokenizer.encode(word)[skip] for _, word in words]
    if first[0] == first[1]:
        raise InputError(f"labels {words[0][1]!r} and {words[1][1]!r} start with the same token; cannot score them")
    encoded = [tokenizer.encode(ex.text) for ex in examples]
    correct = np.zeros(len(examples), dtype=bool)
    for chunk in _same_length_batches(encoded, 32):
        logits = model(torch.tensor([encoded[i] for i in chunk], device=device), passes=passes).logits[:, -1]
        pred = (logits[:, first[1]] > logits[:, first[0]]).long().cpu().numpy()
        correct[chunk] = pred == np.array([examples[i].target for i in chunk])
    lengths = defaultdict(list)
    for ex, ok in zip(examples, correct):
        lengths[ex.length].append(ok)
    return {"accuracy": float(correct.mean()), "by_length": {n: float(np.mean(v)) for n, v in sorted(lengths.items())}}


def _same_length_batches(encoded: list[list[int]], size: int):
    """Index lists of up to `size` sequences of one length (so they stack without padding), shortest first."""
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(encoded):
        by_len[len(ids)].append(i)
    for _, rows in sorted(by_len.items()):
        for start in range(0, len(rows), size):
            yield rows[start : start + size]


def probe_tasks(model, tokenizer, tasks, modes, *, suffix: int, scratch: tuple[int, ...], progress: bool = False) -> dict:
    """For each synthetic task: what the model itself answers (STANDARD and FUSED k=1 prefill) and the layer-by-layer
    probe accuracy under each probe prefill `modes` (see PREFILLS). -> {task: {examples, groups, modes, answer}}."""
    from fullband.data.synthetic import completion_tracking, delayed_memory, register_last_write
    from fullband.model.mode import DecodeMode

    build = {"completion": lambda: completion_tracking(scratch=scratch), "memory": lambda: delayed_memory(scratch=scratch),
             "registers": lambda: register_last_write()}
    out: dict = {}
    for task in tasks:
        examples = build[task]()
        longest = max(len(tokenizer.encode(ex.text)) for ex in examples)
        if longest > model.config.max_seq_len:
            raise ConfigError(f"task {task!r} has examples of {longest} tokens > max_seq_len="
                              f"{model.config.max_seq_len}; pass fewer scratch updates (--scratch 0 8 32)")
        labels, groups = np.array([ex.target for ex in examples]), [ex.group for ex in examples]
        out[task] = {"examples": len(examples), "groups": len(set(groups)), "modes": {}, "answer": {}}
        # what the model itself answers after the ':' (the probe cannot be asked to find what the model never computed)
        for mode in (DecodeMode("standard"), DecodeMode("fused", 1)):
            out[task]["answer"][mode.label] = answer_accuracy(model, tokenizer, examples, passes=mode.passes)
        for mode in modes:
            streams = final_streams(model, tokenizer, examples, mode, suffix=suffix, progress=progress)
            out[task]["modes"][mode] = [probe_accuracy(streams[:, d], labels, groups) for d in range(streams.shape[1])]
    return out
