"""Per-request decoding modes for the vLLM model: what a request may ask for, checked where vLLM admits it, and
what a cached KV block of a request depends on beyond its tokens (`block_keys`, for prefix caching).

A request picks its mode with vLLM's per-request extra arguments: `SamplingParams(extra_args={"feedback_mode":
"fused", "prefill_passes": 2})` offline, `vllm_xargs` / `extra_body={"vllm_xargs": {...}}` through the OpenAI API.
Unset keys take the served folder's defaults (its config.json `feedback_mode` and `prefill_passes`). What
`fullband serve` checks in a request before vLLM reads it is here too (`http_request`). Pure Python: no vLLM
import, so the rules are tested without vLLM."""

from __future__ import annotations

from collections.abc import Container, Mapping
from types import SimpleNamespace
from typing import Any

from fullband.data.chat.messages import as_message
from fullband.errors import DataError, InputError, closest
from fullband.files import decode_text, parse_json
from fullband.model.mode import DecodeMode
from fullband.validate import spans

# modes a served model decodes in; "exact" (the token-by-token reference) is for tests, not a server
SERVED_MODES = ("standard", "soft", "fused")
KEYS = ("feedback_mode", "prefill_passes", "fullband_states", "fed_spans")  # the per-request keys fullband reads
STATES = "fullband_states"  # a request's key under which the worker keeps its fed states (fullband.vllm.states)
FED = "fed_spans"  # a SOFT request's prompt positions read as they were generated (a conversation's replies)
GENERATED = 2**62  # the end of a feeding request's generated run: every position it will ever generate
# a prompt is exact after as many passes as it has tokens: more passes than this are refused, not run
MAX_PASSES = 2**20


def request_mode(extra_args: Mapping[str, Any] | None, default: DecodeMode, *, has_feedback: bool = True,
                 max_passes: int = MAX_PASSES, issued: Container[str] | None = None) -> DecodeMode:
    """The DecodeMode a request asks for (its extra_args over the served default), checked as DecodeMode checks a
    mode for a model whose max_seq_len is `max_passes`. Raises InputError naming the key, the value seen and what
    is accepted; a key that looks like a misspelling of ours is refused, others are left to other plugins.

    `issued`: where a request is admitted, the fullband_states keys this process handed out
    (generate_with_states, which collects and frees the states after its requests): any other key is refused, so
    no request leaves states behind (a server hands out none). None (the worker, the scheduler): not checked."""
    args = dict(extra_args or {})
    for key in args.keys() - set(KEYS):
        if hint := closest(str(key), KEYS):
            raise InputError(f"unknown request key {key!r}{hint}; fullband reads {', '.join(KEYS)}")
    spelled, passes = args.get("feedback_mode", default.name), args.get("prefill_passes")
    name = spelled.partition(":")[0] if isinstance(spelled, str) else spelled
    if name not in SERVED_MODES:
        raise InputError(f"feedback_mode={spelled!r} is not a serving mode; accepted: {', '.join(SERVED_MODES)}")
    if passes is not None and name != "fused":
        raise InputError(f"prefill_passes={passes!r} applies to feedback_mode='fused' only (the request asks for "
                         f"{name!r})")
    mode = DecodeMode.parse(spelled, passes, field="feedback_mode",
                            default_passes=default.prefill_passes if default.name == "fused" else None)
    if mode.adaptive:  # adaptive prefill ("auto") is not served
        seen = f"feedback_mode={spelled!r}" if passes is None else f"prefill_passes={passes!r}"
        raise InputError(f"{seen} is invalid (adaptive prefill is not served); accepted: an integer 0 <= "
                         f"prefill_passes <= {max_passes} (fused Jacobi passes over the prompt after the plain one)")
    mode = mode.check(SimpleNamespace(has_feedback=has_feedback, max_seq_len=max_passes))
    if STATES in args:
        key = args[STATES]
        if not isinstance(key, str) or not key:
            raise InputError(f"{STATES}={key!r} is invalid; accepted: a non-empty string naming the request's states "
                             "(fullband.vllm.generate_with_states sets it)")
        if issued is not None and key not in issued:
            raise InputError(f"{STATES}={key!r} was not set by fullband.vllm.generate_with_states in this process: fed "
                             "states are kept only for it (offline), which hands them over and frees them, and a "
                             f"server returns none; accepted: no {STATES} key")
        if not mode.feeds_state:
            raise InputError(f"{STATES} asks for the fed states of a request in {mode.name!r}, which feeds none; "
                             "accepted with it: feedback_mode 'soft' or 'fused'")
    if FED in args:
        fed_spans(args[FED])
        mode.read(MAX_PASSES, 1, what=f"{FED}={args[FED]!r}")  # fed spans are SOFT's
    return mode


def fed_spans(value: Any) -> list[tuple[int, int]]:
    """A request's fed_spans, [[start, end), ...] prompt positions, or flat [start, end, start, end, ...] (what
    vllm_xargs can carry over HTTP), checked -> [(start, end), ...]."""
    if _flat(value) and len(value) % 2 == 0:
        value = [value[i:i + 2] for i in range(0, len(value), 2)]
    return spans(FED, value, error=InputError)


# the requests whose `messages` vLLM renders with the chat template: one conversation, or a list of them (batch)
CHAT_PATHS = ("/chat/completions", "/chat/completions/render", "/tokenize")
BATCH_CHAT_PATHS = ("/chat/completions/batch",)


def http_request(path: str, body: bytes, default: DecodeMode, *, has_feedback: bool = True,
                 max_passes: int = MAX_PASSES) -> tuple[Any, bool]:
    """A JSON request to the server checked before vLLM reads it (`fullband serve`'s middleware, fullband.vllm.chat),
    so what is wrong meets fullband's sentence, not vLLM's schema or tokenizer errors: its text (UTF-8, no lone
    surrogate escape: fullband.files), its vllm_xargs as the frontend admits them (no fullband_states key: a
    server returns no states) with fed_spans written flat (vLLM's schema takes no nested lists), and a chat
    request's messages as chat data's (fullband.data.chat.messages; an empty reply is a reply the model can give).
    -> (its JSON value, whether it was rewritten); (None, False) for an empty body. InputError / DataError."""
    if not body.strip():
        return None, False
    data = parse_json(decode_text(body, "the request body", error=InputError), "the request body", error=InputError)
    if not isinstance(data, dict):
        return data, False
    changed = False
    xargs = data.get("vllm_xargs")
    if isinstance(xargs, dict):
        request_mode(xargs, default, has_feedback=has_feedback, max_passes=max_passes, issued=())
        if FED in xargs and not _flat(xargs[FED]):
            data["vllm_xargs"] = {**xargs, FED: [p for span in fed_spans(xargs[FED]) for p in span]}
            changed = True
    conversations = data.get("messages")
    if path.endswith(CHAT_PATHS) and isinstance(conversations, list):
        conversations = {"messages": conversations}
    elif path.endswith(BATCH_CHAT_PATHS) and isinstance(conversations, list):
        conversations = {f"messages[{i}]": c for i, c in enumerate(conversations) if isinstance(c, list)}
    else:
        conversations = {}
    for where, messages in conversations.items():
        for i, m in enumerate(messages):
            as_message(_text_parts(m, f"{where}[{i}]"), f"{where}[{i}]", empty_reply=True)
    return data, changed


def _text_parts(m: Any, where: str) -> Any:
    """A message whose content is OpenAI's list of parts, checked as its text (the request goes to vLLM as it came):
    text parts only, this server's models read text."""
    if not isinstance(m, dict) or not isinstance(m.get("content"), list):
        return m
    texts = []
    for j, part in enumerate(m["content"]):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise DataError(f"{where}: content part {j} is {kind!r}; accepted: text parts "
                            "({\"type\": \"text\", \"text\": ...}) or a string (a text model)")
        texts.append(part["text"])
    return {**m, "content": "".join(texts)}


def _flat(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def fed_runs(mode: DecodeMode, extra_args: Mapping[str, Any] | None, prompt_len: int) -> tuple[tuple[int, int], ...]:
    """Every position a request reads fed, as [start, end) runs in order, merged: its fed_spans within the prompt
    (past it are its generated positions) and, when the mode feeds them, its generated positions [prompt_len,
    GENERATED). A function of the request alone, so two requests with the same tokens and runs read them alike."""
    runs = [(a, min(b, prompt_len)) for a, b in fed_spans((extra_args or {}).get(FED, [])) if a < prompt_len]
    if mode.feeds_state:
        runs.append((prompt_len, GENERATED))
    merged: list[tuple[int, int]] = []
    for a, b in runs:
        if merged and merged[-1][1] >= a:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return tuple(merged)


def served_default(feedback_mode: Any, prefill_passes: Any, *, has_feedback: bool) -> DecodeMode:
    """The folder's default mode (config.json), as a served model uses it; a model without feedback weights
    serves STANDARD whatever its config says."""
    if not has_feedback:
        return DecodeMode("standard")
    if prefill_passes == "auto":
        raise InputError("prefill_passes='auto' (adaptive prefill) is not served through vLLM; set an integer "
                         "prefill_passes in the folder's config.json")
    return request_mode({"feedback_mode": feedback_mode, "prefill_passes": prefill_passes}
                        if feedback_mode == "fused" else {"feedback_mode": feedback_mode}, DecodeMode("soft"))


def block_keys(mode: DecodeMode, runs: tuple[tuple[int, int], ...], start: int, end: int) -> tuple:
    """fullband's extra keys of the cached block holding positions [start, end) of a request whose fed positions
    are `runs` (fed_runs; vLLM chains block hashes, so a key on one block sets apart every block after it):

      * the first block carries the prompt's read (Read.key): plain prompt blocks are shared by STANDARD and
        SOFT requests, FUSED-K ones by FUSED-K requests with the same prefix, and never one by the other;
      * a block holding fed positions (fed prompt spans, generated positions of any mode but STANDARD) carries
        which of its positions they are. With the tokens and the read, that fixes the block's keys and values (the
        recurrence's, the one fixed point whoever computes it: a request generating those positions, the same
        request recomputing them after preemption, a later request declaring them fed); a request reading the
        same tokens plainly has no such key and never matches.

    STANDARD generates plain positions, so its output blocks are what a later plain read of the same tokens
    computes, and get no key. The state a block's last position feeds forward is not in its keys and values: the
    model keeps it by block id (fullband.vllm.model)."""
    keys: list[tuple] = [("fullband-read", mode.read(MAX_PASSES).key)] if start == 0 else []
    fed = tuple((max(a, start) - start, min(b, end) - start) for a, b in runs if a < end and b > start)
    if fed:
        keys.append(("fullband-fed", fed))
    return tuple(keys)
