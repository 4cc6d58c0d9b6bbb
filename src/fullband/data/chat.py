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

import numpy as np

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
    out = [as_message(m, f"{where}: message {i}") for i, m in enumerate(messages)]
    if not any(m.role == "assistant" for m in out):
        raise DataError(f"{where}: no assistant turn (nothing to learn from)")
    return out


def read_chat_jsonl(path: str | Path) -> Iterator[list[Message]]:
    """Each conversation of a JSONL file (blank lines skipped, a UTF-8 byte-order mark allowed)."""
    for where, obj in _numbered(Path(path)):
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


# ---------------------------------------------------------------------------------------------------- templates
# fullband's default template, for byte and BPE vocabularies with the chat markers (special tokens):
#   <bos><|system|>...<|end|><|user|>...<|end|><|assistant|>...<|end|><|user|>...<|end|><|assistant|>
# The same template in Jinja, written with a converted folder's tokenizer (AutoTokenizer.apply_chat_template,
# vLLM's chat API); tests check the two give the same ids.
MARKER_JINJA = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
Segments = list[tuple[str, list[int]]]


class MarkerTemplate:
    """fullband's default template over a vocabulary with the chat markers (tokenizer.chat_ids): each message is
    its role's marker, its text, <|end|>; an assistant turn's marker is prompt, its text and <|end|> response."""

    def __init__(self, tokenizer) -> None:
        ids = tokenizer.chat_ids
        if not ids:
            raise DataError("the tokenizer has no chat markers; accepted: one made with with_chat_tokens()")
        self.tokenizer = tokenizer
        self.marker = {role: ids[f"<|{role}|>"] for role in ROLES}
        self.end = ids["<|end|>"]
        self.bos_id = tokenizer.bos_id

    def segments(self, messages: Sequence[Message], *, generation_prompt: bool = False) -> Segments:
        """The rendered conversation as ("prompt" | "response", ids) segments, BOS not included."""
        out: Segments = []
        prompt: list[int] = []
        for m in messages:
            text = self.tokenizer.encode(m.content, bos=False)
            if m.role == "assistant":
                out.append(("prompt", prompt + [self.marker["assistant"]]))
                out.append(("response", text + [self.end]))
                prompt = []
            else:
                prompt += [self.marker[m.role], *text, self.end]
        if generation_prompt:
            prompt.append(self.marker["assistant"])
        if prompt:
            out.append(("prompt", prompt))
        return out


class JinjaTemplate:
    """A Hugging Face chat template (a pretrained model's own `chat_template`), rendered by transformers. Response
    spans are found by rendering each conversation's prefixes (the text up to an assistant turn with the
    generation prompt, and through that turn); a response ends at its first stop token (EOS / end of turn)
    and what the template adds after it (e.g. a newline) is prompt."""

    def __init__(self, tokenizer, template: str) -> None:
        try:
            import transformers as tk
        except ImportError:
            raise DataError("a model's own chat template is rendered by transformers: pip install 'fullband[hf]'") \
                from None
        backend = type(tokenizer.hf_tokenizer).from_str(tokenizer.hf_tokenizer.to_str())
        backend.encode_special_tokens = False  # the template writes special tokens as text
        self._backend = backend
        names = [backend.id_to_token(i) for i in (tokenizer.bos_id, tokenizer.eos_id)]
        self._fast = tk.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=names[0], eos_token=names[1])
        self._fast.chat_template = template
        self.tokenizer = tokenizer
        self.bos_id = tokenizer.bos_id
        self.stops = set(tokenizer.stop_ids)

    def text(self, messages: Sequence[Message], *, generation_prompt: bool = False,
             continue_final: bool = False) -> str:
        """The rendered conversation (`continue_final`: its last message left open, to be continued)."""
        msgs = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self._fast.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt,
                                                  continue_final_message=continue_final)
        except Exception as err:  # jinja2's TemplateError and whatever the template raises itself
            raise DataError(f"the chat template failed on this conversation: {err}") from None

    def encode_text(self, text: str) -> list[int]:
        """Ids of rendered text, the special tokens the template writes read as their ids."""
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def segments(self, messages: Sequence[Message], *, generation_prompt: bool = False) -> Segments:
        full = self.text(messages, generation_prompt=generation_prompt)
        spans = []
        for i, m in enumerate(messages):
            if m.role != "assistant":
                continue
            start = self.text(messages[:i], generation_prompt=True) if i else ""
            through = self.text(messages[: i + 1])
            if not (full.startswith(through) and through.startswith(start)):
                raise DataError("the chat template does not render a conversation's turns as prefixes of it, so the "
                                "assistant's tokens cannot be told apart; accepted: a template that appends turns")
            spans.append((len(start), len(through)))
        enc = self._backend.encode(full, add_special_tokens=False)
        kinds = []
        for a, _ in enc.offsets:
            kinds.append("response" if any(s <= a < e for s, e in spans) else "prompt")
        ids = list(enc.ids)
        # a response ends at its first stop token: template text after it is read as prompt
        for t in range(len(ids)):
            if kinds[t] == "response" and ids[t] in self.stops:
                u = t + 1
                while u < len(ids) and kinds[u] == "response":
                    kinds[u] = "prompt"
                    u += 1
        if ids and ids[0] == self.bos_id:  # assemble adds the BOS
            ids, kinds = ids[1:], kinds[1:]
        out: Segments = []
        for tok, kind in zip(ids, kinds):
            if out and out[-1][0] == kind:
                out[-1][1].append(tok)
            else:
                out.append((kind, [tok]))
        return out


def chat_template(tokenizer):
    """The template conversations are rendered with: a pretrained model's own chat template when it has one,
    else fullband's marker template (the vocabulary needs the chat markers: with_chat_tokens())."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        return JinjaTemplate(tokenizer, template)
    if getattr(tokenizer, "chat_ids", None):
        return MarkerTemplate(tokenizer)
    raise DataError("this tokenizer has neither a chat template nor fullband's chat markers; a chat run adds the "
                    "markers to byte and BPE vocabularies ([data] format = \"chat\"), a pretrained model needs its "
                    "own chat_template")


def hf_chat_template(tokenizer) -> str | None:
    """The Jinja template a transformers tokenizer of this vocabulary carries (None: not a chat vocabulary)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    return MARKER_JINJA if getattr(tokenizer, "chat_ids", None) else None


def encode_chat(template, messages: Sequence[Message]) -> ChatSequence:
    """The training sequence of a conversation (see `assemble`)."""
    return assemble(template.segments(messages), template.bos_id)


def chat_prompt(tokenizer, messages, *, template=None) -> list[int]:
    """The ids a model reads before answering `messages` (a list of {"role", "content"} dicts ending with a user
    turn, or Message objects): BOS, the rendered conversation and the assistant's turn marker."""
    template = template or chat_template(tokenizer)
    msgs = [m if isinstance(m, Message) else as_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    ids = [template.bos_id]
    for _, seg in template.segments(msgs, generation_prompt=True):
        ids += seg
    return ids


def as_message(m: Any, where: str) -> Message:
    """One {"role", "content"} message checked (DataError naming `where`)."""
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
    if role == "assistant" and not content.strip():
        raise DataError(f"{where}: empty assistant turn (nothing to learn from)")
    return Message(role, content)


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


# ---------------------------------------------------------------------------------------------------- chat corpora
SYNTHETIC = "arithmetic"  # "arithmetic" or "arithmetic:N": arithmetic_chats(N, seed=0), generated in memory
SYNTHETIC_SIZE = 20000
CHAT_ACCEPTED = "a .jsonl file, a folder or glob of .jsonl files, 'hf:<dataset>' with a 'messages' column, or " \
                "'arithmetic[:N]' (the built-in synthetic set)"


def chat_conversations(spec: str | Sequence[str], split: str, val_percent: float) -> Iterator[list[Message]]:
    """The checked conversations of a chat corpus's `split` ('train' or 'val'). A conversation's split is a hash
    of its messages, so a conversation repeated anywhere in the data is always on the same side."""
    from fullband.data.corpus import in_val

    specs = [spec] if isinstance(spec, str) else list(spec)
    want_val = split == "val"
    for one in specs:
        for where, obj in _chat_objects(str(one)):
            messages = check_messages(obj, where)
            key = json.dumps([[m.role, m.content] for m in messages], ensure_ascii=False)
            if in_val(key, val_percent) == want_val:
                yield messages


def _chat_objects(spec: str) -> Iterator[tuple[str, Any]]:
    import glob
    import os

    name, _, count = spec.partition(":")
    if name == SYNTHETIC:
        if count and not count.isdigit() or count == "0":
            raise DataError(f"chat corpus {spec!r}: accepted 'arithmetic' or 'arithmetic:N' with N >= 1")
        for i, obj in enumerate(arithmetic_chats(int(count) if count else SYNTHETIC_SIZE, seed=0)):
            yield f"{SYNTHETIC} conversation {i}", obj
        return
    if spec.startswith("hf:"):
        from fullband.data.corpus import _hf_part

        part = _hf_part(spec, "messages", None, "train", None)
        for i, row in enumerate(part.dataset.select_columns(["messages"])):
            yield f"{spec} row {i}", row
        return
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(path.rglob("*.jsonl"))
    elif path.is_file():
        files = [path]
    elif any(c in spec for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file())
    else:
        raise DataError(f"chat corpus not found: {spec!r}; accepted: {CHAT_ACCEPTED}")
    if not files:
        raise DataError(f"chat corpus {spec!r} holds no .jsonl file; accepted: {CHAT_ACCEPTED}")
    for file in files:
        yield from _numbered(file)


def _numbered(path: Path) -> Iterator[tuple[str, Any]]:
    """(file:line, object) of each non-blank JSON line of a file."""
    try:
        handle = path.open(encoding="utf-8-sig")
    except OSError as err:
        raise DataError(f"{path}: cannot be read: {err.strerror or err}") from None
    with handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: invalid JSON ({err.msg} at column {err.colno})") from None


# ---------------------------------------------------------------------------------------------------- packing
TOO_LONG = ("drop", "truncate")
OPEN_WINDOWS = 16


@dataclass
class PackedChat:
    """Conversations packed whole into windows of seq_len positions (each starts with BOS, none is split across
    windows; the rest of a window is padding, plain and without loss). Row r of the arrays is window r."""

    ids: np.ndarray  # (N, T) int64
    targets: np.ndarray  # (N, T) int64, IGNORE off responses
    fed: np.ndarray  # (N, T) bool
    conversations: int
    dropped: int  # longer than a window (too_long="drop"), or left without a response token by truncation
    truncated: int

    def __len__(self) -> int:  # a WindowSampler counts (len - 1) // seq_len windows
        return self.ids.size + 1

    @property
    def fingerprint(self) -> str:
        import hashlib

        h = hashlib.sha256()
        for a in (self.ids, self.targets, self.fed):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:16]

    @property
    def loss_tokens(self) -> int:
        return int((self.targets != IGNORE).sum())

    def describe(self) -> str:
        n, t = self.ids.shape
        parts = [f"{self.conversations} conversations in {n} windows of {t}",
                 f"{self.loss_tokens} assistant tokens ({self.loss_tokens / max(n * t, 1):.0%} of positions)"]
        if self.dropped:
            parts.append(f"{self.dropped} dropped (longer than a window)")
        if self.truncated:
            parts.append(f"{self.truncated} truncated to a window")
        return ", ".join(parts)


def pack_chats(sequences: Iterator[ChatSequence], seq_len: int, pad_id: int, *, too_long: str = "drop") -> PackedChat:
    """Pack conversations in order into windows of `seq_len` positions: a conversation goes into the first of the
    last OPEN_WINDOWS windows with room for it, else it starts a new one. Longer ones are dropped, or
    (too_long="truncate") cut to one window (kept when a response token survives)."""
    if too_long not in TOO_LONG:
        raise DataError(f"too_long={too_long!r}; accepted: {', '.join(TOO_LONG)}")
    rows: list[tuple[list[int], list[int], list[bool]]] = []
    open_rows: list[tuple[list[int], list[int], list[bool]]] = []
    count = dropped = truncated = 0
    for seq in sequences:
        ids, targets, fed = seq.ids, seq.targets, seq.fed
        if len(ids) > seq_len:
            if too_long == "drop":
                dropped += 1
                continue
            ids, targets, fed = ids[:seq_len], targets[: seq_len - 1] + [IGNORE], fed[:seq_len]
            if all(t == IGNORE for t in targets):
                dropped += 1
                continue
            truncated += 1
        # first fit among the windows still open (the last OPEN_WINDOWS started), else a new window
        row = next((r for r in open_rows if len(r[0]) + len(ids) <= seq_len), None)
        if row is None:
            row = ([], [], [])
            rows.append(row)
            open_rows.append(row)
            if len(open_rows) > OPEN_WINDOWS:
                open_rows.pop(0)
        row[0].extend(ids)
        row[1].extend(targets)
        row[2].extend(fed)
        count += 1
    if not rows:
        raise DataError(f"no conversation fits a window of seq_len={seq_len} tokens ({dropped} dropped); raise "
                        "train.seq_len or set data.chat_too_long = \"truncate\"")
    n = len(rows)
    out_ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    out_targets = np.full((n, seq_len), IGNORE, dtype=np.int64)
    out_fed = np.zeros((n, seq_len), dtype=bool)
    for r, (ids, targets, fed) in enumerate(rows):
        out_ids[r, : len(ids)] = ids
        out_targets[r, : len(ids)] = targets
        out_fed[r, : len(ids)] = fed
    return PackedChat(out_ids, out_targets, out_fed, count, dropped, truncated)
