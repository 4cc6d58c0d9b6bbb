"""Chat data: conversations read from JSONL and checked, and the sequence a rendered conversation trains as.

A conversation is one JSON object per line with a `messages` list of {"role": "system" | "user" | "assistant",
"content": str}, multi-turn, at least one assistant turn, no empty assistant turn. Any defect is an error naming
the file and the line.

Once a template has rendered a conversation into segments (`prompt`: everything a user or the template
supplies, up to and including the marker that opens an assistant turn; `response`: the assistant's tokens and
the marker that ends its turn), `assemble` gives the training sequence:

  targets  the next token where that token is part of a response, -100 elsewhere: the loss falls on assistant
           tokens only (the turn's end marker included, so the model learns to stop);
  fed      positions whose input takes the previous position's state at inference. SOFT / FUSED decoding
           feeds every generated token (the response's tokens); the end marker ends the turn and is read with
           the next turn's prompt, plainly, as every prompt position is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fullband.errors import DataError

ROLES = ("system", "user", "assistant")
SEGMENTS = ("prompt", "response")
IGNORE = -100


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def check_messages(obj: Any, where: str) -> list[Message]:
    """The messages of one conversation (a JSON object with a `messages` list), or DataError naming `where`."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with a 'messages' list, got {type(obj).__name__}")
    if "messages" not in obj:
        raise DataError(f"{where}: no 'messages' key (keys: {', '.join(map(str, obj)) or 'none'})")
    messages = obj["messages"]
    if not isinstance(messages, list):
        raise DataError(f"{where}: 'messages' must be a list of {{role, content}} objects, got "
                        f"{type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        at = f"{where}: message {i}"
        if not isinstance(m, dict):
            raise DataError(f"{at}: expected an object with 'role' and 'content', got {type(m).__name__}")
        if "role" not in m:
            raise DataError(f"{at}: no 'role'; accepted: {', '.join(ROLES)}")
        role = m["role"]
        if role not in ROLES:
            raise DataError(f"{at}: unknown role {role!r}; accepted: {', '.join(ROLES)}")
        content = m.get("content")
        if not isinstance(content, str):
            raise DataError(f"{at} ({role}): 'content' must be a string, got {type(content).__name__}")
        if role == "assistant" and not content.strip():
            raise DataError(f"{at}: empty assistant turn (nothing to learn from)")
        out.append(Message(role, content))
    if not any(m.role == "assistant" for m in out):
        raise DataError(f"{where}: no assistant turn (nothing to learn from)")
    return out


def read_chat_jsonl(path: str | Path) -> Iterator[list[Message]]:
    """Each conversation of a JSONL file (blank lines skipped, a UTF-8 byte-order mark allowed)."""
    path = Path(path)
    try:
        handle = path.open(encoding="utf-8-sig")
    except OSError as err:
        raise DataError(f"{path}: cannot be read: {err.strerror or err}") from None
    with handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
            yield check_messages(obj, where)


@dataclass
class ChatSequence:
    ids: list[int]
    targets: list[int]  # next-token targets, IGNORE where the next token is not a response token
    fed: list[bool]  # positions fed the previous position's state at inference

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def loss_tokens(self) -> int:
        return sum(t != IGNORE for t in self.targets)


def assemble(segments: Sequence[tuple[str, Sequence[int]]], bos_id: int | None) -> ChatSequence:
    """The training sequence of a rendered conversation: BOS (when given), then the segments in order (see the
    module docstring for targets and fed)."""
    ids: list[int] = [] if bos_id is None else [bos_id]
    response: list[bool] = [False] * len(ids)
    last_of_response: list[bool] = [False] * len(ids)
    for kind, seg in segments:
        if kind not in SEGMENTS:
            raise DataError(f"segment kind {kind!r}; accepted: {', '.join(SEGMENTS)}")
        seg = list(seg)
        if kind == "response" and not seg:
            raise DataError("an empty response segment (it must hold at least the turn's end marker)")
        ids += seg
        response += [kind == "response"] * len(seg)
        last_of_response += [kind == "response" and i == len(seg) - 1 for i in range(len(seg))]
    targets = [ids[t + 1] if response[t + 1] else IGNORE for t in range(len(ids) - 1)] + [IGNORE]
    fed = [r and not last for r, last in zip(response, last_of_response)]
    return ChatSequence(ids, targets, fed)


# ---------------------------------------------------------------------------------------------------- a synthetic set
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana")
ITEMS = ("apples", "books", "coins", "pens", "shells", "stamps")
ANSWER = "Answer: "


def final_answer(text: str) -> str | None:
    """The final answer of a response: what follows its last 'Answer: ' up to the end of that line (None: none)."""
    at = text.rfind(ANSWER)
    if at < 0:
        return None
    return text[at + len(ANSWER):].split("\n", 1)[0].strip() or None


def _steps(rng, start: int, ops: int) -> tuple[str, list[str], int]:
    """`ops` changes to a count: their wording, the worked steps, the result (never negative)."""
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
            n = rng.randint(1, 20)
            words.append(f"gets {n} more")
            steps.append(f"{value} + {n} = {value + n}.")
            value += n
    return ", then ".join(words), steps, value


def arithmetic_chats(n: int, *, seed: int = 0, max_ops: int = 3, follow_up: float = 0.3) -> list[dict]:
    """`n` conversations of word problems answered with worked steps and a final 'Answer: N' (a `follow_up`
    share of them two turns long: the second question continues the first), deterministic from `seed`; each is
    a {"messages": [...]} object as the chat JSONL holds it."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        start = rng.randint(1, 30)
        wording, steps, value = _steps(rng, start, rng.randint(1, max_ops))
        messages = [
            {"role": "user", "content": f"{name} has {start} {item}, {wording}. How many {item} does {name} have?"},
            {"role": "assistant", "content": " ".join([f"{name} starts with {start}.", *steps, f"{ANSWER}{value}"])},
        ]
        if rng.random() < follow_up:
            wording, steps, value = _steps(rng, value, rng.randint(1, max_ops))
            messages += [
                {"role": "user", "content": f"Then {name} {wording}. How many now?"},
                {"role": "assistant", "content": " ".join([*steps, f"{ANSWER}{value}"])},
            ]
        out.append({"messages": messages})
    return out


def write_chat_jsonl(conversations: Sequence[dict], path: str | Path) -> Path:
    """Conversations as JSONL (one object per line), each checked first; written whole or not at all."""
    from fullband.files import replace_file

    for i, obj in enumerate(conversations):
        check_messages(obj, f"conversation {i}")
    replace_file(path, "".join(json.dumps(obj, ensure_ascii=False) + "\n" for obj in conversations))
    return Path(path)
