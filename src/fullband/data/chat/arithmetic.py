"""The built-in synthetic chat set, offline: word problems about counts answered with worked steps and a final
'Answer: N', deterministic from a seed; a response's final answer read back; conversations written as JSONL."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from fullband.data.chat.messages import check_messages

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana")
ITEMS = ("apples", "books", "coins", "pens", "shells", "stamps")
ANSWER = "Answer: "


def final_answer(text: str) -> str | None:
    """The final answer of a response: what follows its last 'Answer: ' up to the end of that line (None: none)."""
    at = text.rfind(ANSWER)
    return None if at < 0 else (text[at + len(ANSWER):].split("\n", 1)[0].strip() or None)


def _steps(rng, start: int, ops: int, numbers: int = 30) -> tuple[str, list[str], int]:
    """`ops` changes to a count: their wording, the worked steps, the result (never negative); a count grows by
    1 to min(20, numbers) at a time."""
    words, steps, value = [], [], start
    for _ in range(ops):
        if value > 3 and rng.random() < 0.5:
            n = rng.randint(1, value - 1)
            words.append(f"gives away {n}")
            steps.append(f"{value} - {n} = {value - n}.")
            value -= n
        elif rng.random() < 0.3:
            n = rng.randint(2, 3)
            words.append(f"{'doubles' if n == 2 else 'triples'} them")
            steps.append(f"{value} * {n} = {value * n}.")
            value *= n
        else:
            n = rng.randint(1, min(20, numbers))
            words.append(f"gets {n} more")
            steps.append(f"{value} + {n} = {value + n}.")
            value += n
    return ", then ".join(words), steps, value


STYLES = ("full", "partial", "direct")  # every worked step; the last step only; the answer alone


def _reply(style: str, steps: list[str], value: int, opening: list[str]) -> str:
    shown = {"full": [*opening, *steps], "partial": steps[-1:], "direct": []}[style]
    return " ".join([*shown, f"{ANSWER}{value}"])


def arithmetic_chats(n: int, *, seed: int = 0, max_ops: int = 3, follow_up: float = 0.3,
                     styles: Sequence[str] = ("full",), numbers: int = 30) -> list[dict]:
    """`n` conversations of word problems answered with a final 'Answer: N' (a `follow_up` share of them two turns
    long: the second question continues the first), deterministic from `seed`; each is a {"messages": [...]} object
    as the chat JSONL holds it. Each reply is written in one of `styles` (STYLES: worked steps, the last step, the
    answer alone), drawn per conversation by a generator of its own: the problems are the same whatever the styles,
    so a mixed set holds the same kind of problem at several lengths. A problem has 1 to `max_ops` changes to a
    count that starts at 1 to `numbers` and grows by 1 to min(20, `numbers`) at a time."""
    import random

    unknown = [s for s in styles if s not in STYLES]
    if unknown or not styles:
        raise ValueError(f"styles={tuple(styles)!r}; accepted: a non-empty choice of {', '.join(STYLES)}")
    rng, style_rng = random.Random(seed), random.Random(f"{seed} styles")  # the problems do not depend on the styles
    out = []
    for _ in range(n):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        start = rng.randint(1, numbers)
        wording, steps, value = _steps(rng, start, rng.randint(1, max_ops), numbers)
        style = style_rng.choice(list(styles))
        messages = [
            {"role": "user", "content": f"{name} has {start} {item}, {wording}. How many {item} does {name} have?"},
            {"role": "assistant", "content": _reply(style, steps, value, [f"{name} starts with {start}."])},
        ]
        if rng.random() < follow_up:
            wording, steps, value = _steps(rng, value, rng.randint(1, max_ops), numbers)
            messages += [{"role": "user", "content": f"Then {name} {wording}. How many now?"},
                         {"role": "assistant", "content": _reply(style, steps, value, [])}]
        out.append({"messages": messages})
    return out


def write_chat_jsonl(conversations: Sequence[dict], path: str | Path) -> Path:
    """Conversations as JSONL (one object per line), each checked first; written whole or not at all."""
    from fullband.files import replace_file

    for i, obj in enumerate(conversations):
        check_messages(obj, f"conversation {i}")
    replace_file(path, "".join(json.dumps(obj, ensure_ascii=False) + "\n" for obj in conversations))
    return Path(path)
