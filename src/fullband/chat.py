"""A conversation with a model, turn by turn, on the decode engine (`fullband chat`, `ChatSession`).

The conversation keeps its cache and its fed-back state between turns. A new turn's prompt tokens (the end of
the last answer, the user's message, the assistant's marker) go through the decode step as the mode reads a
prompt: plainly in STANDARD and SOFT (what training's chat windows do), fed in EXACT (the exact recurrence
over the prompt); earlier turns are never read again. FUSED reads the whole conversation again with 1 + k
Jacobi passes at every turn: its prefill is a parallel pass over the prompt, and the prompt is the whole
conversation. The answer is decoded as the mode decodes (STANDARD plain, the others fed). When the rendered
conversation does not continue the tokens already read (a tokenizer that splits a generated text differently
when it is read back), the turn starts over from the whole conversation."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from fullband.data.tokenizer import TextStream
from fullband.data.chat.messages import Message
from fullband.data.chat.templates import chat_prompt, chat_template
from fullband.decode.generate import DecodeState, advance, prefill
from fullband.decode.sampling import Sampling
from fullband.errors import InputError
from fullband.model.mode import DecodeMode, default_mode
from fullband.validate import integer


@dataclass
class Turn:
    """What the last reply did: its tokens, why it stopped, and how the prompt was read."""

    ids: list[int] = field(default_factory=list)
    stopped: str = ""  # "end" (the end-of-turn token), "length" (max_new_tokens), "interrupted", "context"
    reread: bool = False  # the whole conversation was read again (FUSED, a first turn, or a mismatch)
    prompt_tokens: int = 0  # tokens read before answering


class ChatSession:
    """A conversation with `model` (a FullbandLM, or a model with the decode interface) in `mode`.

    `reply(text)` adds a user message and yields the answer's text as it is generated; stopping the iteration
    early (Ctrl-C in the terminal) keeps what was answered so far as the assistant's turn."""

    def __init__(self, model, tokenizer, *, mode: str | DecodeMode | None = None, prefill_passes: int | str | None = None,
                 system: str | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.template = chat_template(tokenizer)
        mode = default_mode(model.config) if mode is None else mode  # the model's: SOFT, or STANDARD if untrained
        self.mode = DecodeMode.of(mode, prefill_passes).check(model.config)
        self.max_new_tokens = integer("max_new_tokens", max_new_tokens, 1, error=InputError)
        self.sampling = Sampling(temperature, top_k, top_p, seed)
        self.device = next(model.parameters()).device
        self.generator = self.sampling.generator(self.device)
        self.stops = set(tokenizer.stop_ids)
        self.system = system
        self.last = Turn()
        self.reset()

    # ------------------------------------------------------------------ the conversation
    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.messages: list[Message] = [Message("system", self.system)] if self.system else []
        self.read: list[int] = []  # the tokens whose keys and values are in the cache, in order
        self.state: DecodeState | None = None

    def set_mode(self, mode: str | DecodeMode, prefill_passes: int | str | None = None) -> DecodeMode:
        """Switch the decoding mode; the next turn reads the conversation again in it."""
        self.mode = DecodeMode.of(mode, prefill_passes).check(self.model.config)
        self.state = None
        return self.mode

    @property
    def context(self) -> int:
        return self.model.config.max_seq_len

    def reply(self, text: str) -> Iterator[str]:
        """Add the user's `text` and yield the answer's text as it grows (pieces that never split a character)."""
        if not isinstance(text, str) or not text.strip():
            raise InputError("a message must be non-empty text")
        self.messages.append(Message("user", text))
        self.last = Turn()
        try:
            logits = self._read_prompt()
        except BaseException:  # too long, or stopped while reading: the message is not part of the conversation
            self.messages.pop()
            raise
        ids: list[int] = []
        text = TextStream(self.tokenizer)
        try:
            for _ in range(self.max_new_tokens):
                token = int(self.sampling(logits[None], self.generator)[0])
                ids.append(token)
                if token in self.stops:
                    self.last.stopped = "end"
                    break
                piece = text.push(token)
                if piece:
                    yield piece
                if len(self.read) + 1 >= self.context:
                    self.last.stopped = "context"
                    break
                logits = self._feed([token], feed=self.mode.feeds_state)
            else:
                self.last.stopped = "length"
            rest = text.rest()
            if rest:
                yield rest
        finally:
            if not self.last.stopped:
                self.last.stopped = "interrupted"
            self.last.ids = ids
            self.messages.append(Message("assistant", self.tokenizer.decode([i for i in ids if i not in self.stops])))

    # ------------------------------------------------------------------ reading
    def _read_prompt(self) -> torch.Tensor:
        """Read the new turn's prompt; -> the logits of the answer's first token."""
        full = chat_prompt(self.tokenizer, self.messages, template=self.template)
        if len(full) >= self.context:
            raise InputError(f"the conversation ({len(full)} tokens) no longer fits the model's context of "
                             f"{self.context}; /reset to start a new one")
        # in the cache: the earlier turns; the last answer's final sampled token (its end marker) was never read
        read = self.mode.read(len(full))  # its new tokens fed as the mode reads a prompt, or everything again
        incremental = (self.state is not None and not read.rereads and self.state.longest == len(self.read)
                       and len(full) > len(self.read) and full[: len(self.read)] == self.read)
        if not incremental:
            return self._prefill(full)
        self.last.prompt_tokens = len(full) - len(self.read)
        return self._feed(full[len(self.read):], feed=not read.plain_prompt)

    def _prefill(self, ids: list[int]) -> torch.Tensor:
        self.last.reread, self.last.prompt_tokens = True, len(ids)
        t = torch.tensor([ids], device=self.device)
        lengths = torch.tensor([len(ids)], device=self.device)
        with torch.inference_mode():
            self.state, out = prefill(self.model, t, lengths, self.mode, room=self.context - len(ids))
            logits = self.model.head(out.top[:, -1])[0]
        self.read = list(ids)
        return logits

    def _feed(self, ids: list[int], *, feed: bool) -> torch.Tensor:
        """Read `ids` one by one through the decode step, fed the state when `feed` -> the last one's logits."""
        logits = None
        with torch.inference_mode():
            for token in ids:
                logits = advance(self.model, self.state, torch.tensor([token], device=self.device), feed=feed)[0]
                self.read.append(token)
        return logits


def check_chat_model(model, tokenizer) -> None:
    """Refuse a model whose vocabulary cannot hold the tokenizer's chat tokens."""
    if tokenizer.vocab_size > model.config.vocab_size:
        raise InputError(f"the checkpoint's tokenizer has {tokenizer.vocab_size} ids but the model only "
                         f"{model.config.vocab_size}")


__all__ = ["ChatSession", "Turn", "check_chat_model"]
