"""Generation length by decoding mode (the paper's "shorter reasoning" measurement): for a JSONL prompt set,
generate greedily in each mode and report the median generated length and, where rows carry an
`answer`, exact-match accuracy of the text before the first stop string."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from fullband.decode.generate import generate
from fullband.model.mode import DecodeMode
from fullband.errors import DataError
from fullband.files import jsonl_values


@dataclass
class ModeResult:
    mode: str
    prefill_passes: int | str  # fused prefill passes ("auto": adaptive, at most that many), 0 for the other modes
    median_tokens: float
    mean_tokens: float
    accuracy: float | None  # exact match over rows with an answer
    outputs: list[str]


def read_prompts(path: str | Path, *, prompt_field: str = "prompt", answer_field: str = "answer") -> list[dict]:
    """The rows of a JSONL prompt file (read by fullband.files.jsonl_values: UTF-8, a byte-order mark read past)."""
    rows = []
    for where, row in jsonl_values(path, "prompt file", error=DataError):
        if not isinstance(row, dict) or not isinstance(row.get(prompt_field), str):
            raise DataError(f"{where}: needs a string field {prompt_field!r}")
        answer = row.get(answer_field)
        rows.append({"prompt": row[prompt_field], "answer": None if answer is None else str(answer)})
    if not rows:
        raise DataError(f"prompt file {str(path)!r} holds no prompts")
    return rows


def generation_lengths(model, tokenizer, rows: list[dict], modes: list[DecodeMode | tuple[str, int]], *,
                       max_new_tokens: int = 256, stop_text: str = "\n", batch_size: int = 8) -> list[ModeResult]:
    """Greedy generations of every row in each mode (a DecodeMode, or (mode, prefill passes))."""
    results = []
    for mode in modes:
        mode = DecodeMode.of(*mode) if isinstance(mode, tuple) else mode
        lengths, outputs, hits, answered = [], [], 0, 0
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            prompts = [tokenizer.encode(r["prompt"]) for r in chunk]
            gens = generate(model, prompts, max_new_tokens, mode=mode, stop_tokens=[tokenizer.eos_id])
            for row, ids in zip(chunk, gens):
                ids = [i for i in ids if i != tokenizer.eos_id]
                text = tokenizer.decode(ids)
                cut = text.find(stop_text) if stop_text else -1
                answer_text = (text[:cut] if cut >= 0 else text).strip()
                lengths.append(_tokens_before(tokenizer, ids, stop_text) if cut >= 0 else len(ids))
                outputs.append(text)
                if row["answer"] is not None:
                    answered += 1
                    hits += int(answer_text == row["answer"].strip())
        k = ("auto" if mode.adaptive else mode.prefill_passes) if mode.name == "fused" else 0
        results.append(ModeResult(mode.name, k, float(statistics.median(lengths)), float(statistics.fmean(lengths)),
                                  hits / answered if answered else None, outputs))
    return results


def _tokens_before(tokenizer, ids: list[int], stop_text: str) -> int:
    """How many generated tokens come before the one that completes the first `stop_text`."""
    for n in range(1, len(ids) + 1):
        if stop_text in tokenizer.decode(ids[:n]):
            return n - 1
    return len(ids)
