"""Chat corpora: a spec (a .jsonl file, a folder or glob of them, 'hf:<dataset>', the synthetic 'arithmetic[:N]') read
as checked conversations, each on the train or the val side by a hash of its messages."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fullband.data.chat.arithmetic import STYLES, arithmetic_chats, final_answer
from fullband.data.chat.messages import Message, check_messages, up_to_last_user
from fullband.errors import DataError
from fullband.data.corpus import in_val, regular_files
from fullband.files import jsonl_values, regular_file
from fullband.validate import parse_int

SYNTHETIC = "arithmetic"  # "arithmetic" or "arithmetic:N": arithmetic_chats(N, seed=0), generated in memory
SYNTHETIC_MIXED = "arithmetic-mixed"  # the same problems, each reply worked fully, partly or not at all
SYNTHETIC_SIZE = 20000
SYNTHETIC_MAX = 10**6  # conversations of arithmetic:N (generated in memory, ~0.5 KB each)
CHAT_ACCEPTED = ("a .jsonl file, a folder or glob of .jsonl files, 'hf:<dataset>' with a 'messages' column, or "
                 "'arithmetic[:N]' / 'arithmetic-mixed[:N]' (the built-in synthetic set; -mixed: replies of three "
                 "lengths; options ':ops=K:numbers=M:turns=1')")


def chat_conversations(spec: str | Sequence[str], split: str, val_percent: float) -> Iterator[list[Message]]:
    """The checked conversations of a chat corpus's `split` ('train' or 'val'). A conversation's split is a hash
    of its messages, so a conversation repeated anywhere in the data is always on the same side."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    for one in specs:
        for where, obj in chat_objects(str(one)):
            messages = check_messages(obj, where)
            if in_split(messages, split, val_percent):
                yield messages


def in_split(messages: Sequence[Message], split: str, val_percent: float) -> bool:
    """Whether a conversation is on the `split` side ('train' or 'val'): a hash of its messages."""
    key = json.dumps([[m.role, m.content] for m in messages], ensure_ascii=False)
    return in_val(key, val_percent) == (split == "val")


def check_prompt(obj: Any, where: str) -> tuple[list[Message], str, list[Message]]:
    """A prompt to answer, its reference answer and the object's whole conversation, from a chat object: with an
    `answer` key, its messages up to the last user turn (a reply after it is left out) and that answer; without
    one, the conversation up to its last assistant turn and that turn's final 'Answer: ...'. DataError naming
    `where` otherwise."""
    messages = check_messages(obj, where, reply=False)
    if "answer" in obj:
        answer = obj["answer"]
        if isinstance(answer, bool) or not isinstance(answer, str | int | float) or not str(answer).strip():
            raise DataError(f"{where}: 'answer' must be a non-empty string or a number, got {answer!r}")
        return up_to_last_user(messages, where), str(answer).strip(), messages
    replies = [j for j, m in enumerate(messages) if m.role == "assistant"]
    if not replies:
        raise DataError(f"{where}: no 'answer' key, and no assistant turn whose final 'Answer: ...' could be the "
                        "reference; a prompt to score needs one of them (e.g. {\"messages\": [{\"role\": \"user\", "
                        "\"content\": ...}], \"answer\": \"7\"})")
    last = replies[-1]
    reference = final_answer(messages[last].content)
    if reference is None:
        raise DataError(f"{where}: its last assistant turn has no final 'Answer: ...' line to score against (and "
                        "the object has no 'answer' key)")
    return messages[:last], reference, messages


def chat_prompts(spec: str, split: str | None, val_percent: float) -> Iterator[tuple[list[Message], str]]:
    """(prompt, reference answer) of each object of a chat corpus (check_prompt), on the `split` side ('train' /
    'val', by the hash chat_conversations splits with: a conversation trained on is never a held-out prompt), or
    every one (`split` None)."""
    for where, obj in chat_objects(spec):
        prompt, answer, whole = check_prompt(obj, where)
        if split is None or in_split(whole, split, val_percent):
            yield prompt, answer


SYNTHETIC_OPTIONS = {"ops": ("max_ops", 1, 10), "numbers": ("numbers", 1, 10**6), "turns": ("follow_up", 1, 2)}


def _synthetic_options(spec: str, rest: str) -> tuple[int, dict]:
    """'N:ops=K:numbers=M:turns=T' (each part optional) -> (N, arithmetic_chats' keyword arguments): at most K
    changes per problem, counts from 1 to M, T = 1 for one-turn conversations only (2: the default ~30% two)."""
    parts = rest.split(":") if rest else []
    count = parts.pop(0) if parts and "=" not in parts[0] else ""
    try:  # the set is generated in memory: a size far beyond any corpus is refused
        n = parse_int("N", count, 1, below=SYNTHETIC_MAX + 1, error=DataError) if count else SYNTHETIC_SIZE
        options = {}
        for part in parts:
            key, eq, value = part.partition("=")
            if key not in SYNTHETIC_OPTIONS or not eq:
                raise DataError(f"{part!r} is not an option; accepted: " + ", ".join(f"{k}=INT" for k in
                                                                                   SYNTHETIC_OPTIONS))
            arg, low, high = SYNTHETIC_OPTIONS[key]
            options[arg] = parse_int(key, value, low, below=high + 1, error=DataError)
    except DataError as err:
        raise DataError(f"chat corpus {spec!r}: {err}") from None
    if "follow_up" in options:
        options["follow_up"] = 0.0 if options["follow_up"] == 1 else 0.3
    return n, options


def chat_objects(spec: str) -> Iterator[tuple[str, Any]]:
    """(where, object) of each conversation of a chat corpus spec (CHAT_ACCEPTED), unchecked: `where` names it in
    errors (a file and line, a dataset row, a synthetic conversation's number)."""
    import glob
    import os

    name, _, count = spec.partition(":")
    if name in (SYNTHETIC, SYNTHETIC_MIXED):
        n, options = _synthetic_options(spec, count)
        styles = STYLES if name == SYNTHETIC_MIXED else ("full",)
        for i, obj in enumerate(arithmetic_chats(n, seed=0, styles=styles, **options)):
            yield f"{name} conversation {i}", obj
        return
    if spec.startswith("hf:"):
        from fullband.data.corpus import _hf_part

        part = _hf_part(spec, "messages", None, "train", None)
        for i, row in enumerate(part.dataset.select_columns(["messages"])):
            yield f"{spec} row {i}", row
        return
    path = Path(spec).expanduser()
    if path.is_dir():  # a FIFO named like a .jsonl file is skipped (reading it would block), with a warning
        files = regular_files(sorted(path.rglob("*.jsonl")), spec)
    elif path.exists() or path.is_symlink():
        files = [regular_file(path, "chat corpus", error=DataError)]
    elif any(c in spec for c in "*?["):
        files = regular_files(sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True)
                                      if not Path(p).is_dir()), spec)
    else:
        raise DataError(f"chat corpus not found: {spec!r}; accepted: {CHAT_ACCEPTED}")
    if not files:
        raise DataError(f"chat corpus {spec!r} holds no .jsonl file; accepted: {CHAT_ACCEPTED}")
    for file in files:
        yield from jsonl_values(file, "chat data", error=DataError)
