"""Chat templates: a conversation rendered into prompt and response segments (fullband's markers or a model's own
Jinja template), and the sequence it trains as, the loss on the assistant's tokens only.

Once a template has rendered a conversation into segments (`prompt`: everything a user or the template
supplies, up to and including the marker that opens an assistant turn; `response`: the assistant's tokens and
the marker that ends its turn), `assemble` gives the training sequence:

  targets  the next token where that token is part of a response, -100 elsewhere: the loss falls on assistant
           tokens only (the turn's end marker included, so the model learns to stop);
  fed      positions whose input takes the previous position's state at inference. SOFT / FUSED decoding
           feeds every generated token (the response's tokens); the end marker ends the turn and is read with
           the next turn's prompt, plainly, as every prompt position is."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

from fullband.data.chat.messages import ROLES, Message, as_message
from fullband.errors import DataError, MissingPackage

SEGMENTS = ("prompt", "response")
IGNORE = -100


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
    fed: list[bool] = [False] * len(ids)  # a response's positions but its last (the end marker, read plainly)
    for kind, seg in segments:
        if kind not in SEGMENTS:
            raise DataError(f"segment kind {kind!r}; accepted: {', '.join(SEGMENTS)}")
        seg = list(seg)
        if kind == "response" and not seg:
            raise DataError("an empty response segment (it must hold at least the turn's end marker)")
        ids += seg
        response += [kind == "response"] * len(seg)
        fed += [kind == "response" and i < len(seg) - 1 for i in range(len(seg))]
    targets = [ids[t + 1] if response[t + 1] else IGNORE for t in range(len(ids) - 1)] + [IGNORE]
    return ChatSequence(ids, targets, fed)


# fullband's default template, for byte and BPE vocabularies with the chat markers (special tokens):
#   <bos><|system|>...<|end|><|user|>...<|end|><|assistant|>...<|end|><|user|>...<|end|><|assistant|>
# The same template in Jinja, written with a converted folder's tokenizer (AutoTokenizer.apply_chat_template,
# vLLM's chat API); tests check the two give the same ids. A role without a marker is refused, as chat data's is
# (as_message), on every surface that renders the folder's template.
MARKER_JINJA = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in " + repr(list(ROLES)) + " %}{{ raise_exception('messages[' ~ loop.index0 ~ "
    "\"]: unknown role '\" ~ message['role'] ~ \"'; accepted: " + ", ".join(ROLES) + "\") }}"
    "{% endif %}"
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
        self.prompt_bos = True  # fullband's template opens with BOS

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
            raise MissingPackage("a model's own chat template is rendered by transformers: pip install 'fullband[hf]'") \
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
        # whether a prompt starts with BOS, as transformers' apply_chat_template gives it: when the template writes
        # it (SmolLM2's ChatML opens with <|im_start|>, its BOS), or else when the tokenizer adds one
        probe = self.encode_text(self.text([Message("user", "x")], generation_prompt=True))
        self.prompt_bos = probe[:1] == [self.bos_id] or bool(getattr(tokenizer, "add_bos", True))

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
        kinds = ["response" if any(s <= a < e for s, e in spans) else "prompt" for a, _ in enc.offsets]
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
        return [(kind, [tok for tok, _ in run]) for kind, run in groupby(zip(ids, kinds), key=lambda pair: pair[1])]


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
    """The training sequence of a conversation (see `assemble`): with BOS in front where inference has one."""
    return assemble(template.segments(messages), template.bos_id if template.prompt_bos else None)


def chat_prompt(tokenizer, messages, *, template=None) -> list[int]:
    """The ids a model reads before answering `messages` (a list of {"role", "content"} dicts ending with a user
    turn, or Message objects): BOS, the rendered conversation and the assistant's turn marker."""
    return _prompt_segments(template or chat_template(tokenizer), _messages(messages))[0]


def fed_chat_prompt(tokenizer, messages, *, template=None) -> tuple[list[int], list[tuple[int, int]]]:
    """chat_prompt's ids and the [start, end) spans of the earlier replies' positions that SOFT decoding fed when
    it generated them, as `fullband chat` (ChatSession) has them in its cache: each reply's tokens before its end
    marker (the marker, the reply's last sampled token or the template's, is read plainly with the next prompt).
    A reply is fed where the conversation before it renders as a prefix of the whole and the reply starts right
    after it; where not, ChatSession reads the conversation again from the start, plainly, and so every reply up
    to that one is plain here. `fullband.generate(..., fed=[spans])` then reads the prompt as ChatSession did."""
    template = template or chat_template(tokenizer)
    msgs = _messages(messages)
    ids, segments = _prompt_segments(template, msgs)
    replies = [i for i, m in enumerate(msgs) if m.role == "assistant"]
    if sum(kind == "response" for kind, _ in segments) != len(replies):  # replies the template does not set apart
        return ids, []
    spans: list[tuple[int, int]] = []
    at, reply = int(template.prompt_bos), iter(replies)
    for kind, seg in segments:
        if kind == "response":
            before = _prompt_segments(template, msgs[:next(reply)])[0]
            if at != len(before) or ids[:at] != before:
                spans = []
            elif len(seg) > 1:
                spans.append((at, at + len(seg) - 1))
        at += len(seg)
    return ids, spans


def _messages(messages) -> list[Message]:
    return [m if isinstance(m, Message) else as_message(m, f"messages[{i}]", empty_reply=True)
            for i, m in enumerate(messages)]


def _prompt_segments(template, msgs: Sequence[Message]) -> tuple[list[int], Segments]:
    """The prompt's ids (BOS where the template or the tokenizer puts one, the rendered conversation, the
    assistant's turn marker) and the segments they are made of."""
    segments = template.segments(msgs, generation_prompt=True)
    head = [template.bos_id] if template.prompt_bos else []
    return head + [t for _, seg in segments for t in seg], segments
