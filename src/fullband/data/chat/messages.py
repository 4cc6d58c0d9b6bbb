"""Chat messages: the {role, content} message, one conversation's messages checked, and the conversations of a
chat JSONL file read.

A conversation is one JSON object per line with a `messages` list of {"role": "system" | "user" | "assistant",
"content": str}, multi-turn, at least one assistant turn, no empty assistant turn. Any defect is an error naming
the file and the line."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fullband.errors import DataError
from fullband.files import jsonl_values

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def check_messages(obj: Any, where: str, *, reply: bool = True) -> list[Message]:
    """The messages of one conversation (a JSON object with a `messages` list), or DataError naming `where`; with
    `reply`, one of them must be an assistant turn (something to learn from)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with a 'messages' list, got {type(obj).__name__}")
    if "messages" not in obj:
        raise DataError(f"{where}: no 'messages' key (keys: {', '.join(map(str, obj)) or 'none'})")
    messages = obj["messages"]
    if not isinstance(messages, list):
        raise DataError(f"{where}: 'messages' must be a list of {{role, content}} objects, got "
                        f"{type(messages).__name__}")
    out = [as_message(m, f"{where}: message {i}") for i, m in enumerate(messages)]
    if reply and not any(m.role == "assistant" for m in out):
        raise DataError(f"{where}: no assistant turn (nothing to learn from)")
    return out


def up_to_last_user(messages: list[Message], where: str, *, to: str = "answer") -> list[Message]:
    """The conversation up to and including its last user turn (a reply after it is left out: what is asked is
    answered again). DataError naming `where` when there is no user turn `to` answer."""
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    if not users:
        raise DataError(f"{where}: no user turn to {to}")
    return messages[: users[-1] + 1]


def read_chat_jsonl(path: str | Path) -> Iterator[list[Message]]:
    """Each conversation of a JSONL file (blank lines skipped, a UTF-8 byte-order mark allowed)."""
    for where, obj in jsonl_values(path, "chat data", error=DataError):
        yield check_messages(obj, where)


def as_message(m: Any, where: str, *, empty_reply: bool = False) -> Message:
    """One {"role", "content"} message checked (DataError naming `where`). `empty_reply`: an empty assistant turn
    is accepted (a conversation read to answer it, which may hold an empty reply the model gave; training data has
    nothing to learn from one)."""
    if not isinstance(m, dict):
        raise DataError(f"{where}: expected an object with 'role' and 'content', got {type(m).__name__}")
    if "role" not in m:
        raise DataError(f"{where}: no 'role'; accepted: {', '.join(ROLES)}")
    role = m["role"]
    if role not in ROLES:
        raise DataError(f"{where}: unknown role {role!r}; accepted: {', '.join(ROLES)}")
    content = m.get("content")
    if not isinstance(content, str):
        raise DataError(f"{where} ({role}): 'content' must be a string, got {type(content).__name__}")
    if role == "assistant" and not content.strip() and not empty_reply:
        raise DataError(f"{where}: empty assistant turn (nothing to learn from)")
    return Message(role, content)
