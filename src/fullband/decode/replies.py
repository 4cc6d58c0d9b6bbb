"""A model's own replies to a set of prompts, as conversations to train on: `fullband generate --replies-to CHATS
--out FILE.jsonl`. Mixed into a warm start's corpus (data.corpus with data.shares), they hold the model to what it
said before training (a replay of its own chat); each row is a conversation, read as the model's chat template renders
it (fullband.data.corpus.Conversation)."""

from __future__ import annotations

import json
from pathlib import Path

from fullband.data.chat.messages import Message, check_messages, up_to_last_user
from fullband.errors import DataError, InputError
from fullband.files import check_writable, replace_file


def reply_prompts(spec: str) -> list[list[Message]]:
    """The prompts of a chat corpus `spec` (as chat_conversations reads it): each conversation up to its last user
    turn (a reply after it is left out, to be answered again). DataError naming the conversation when it has no user
    turn."""
    from fullband.data.chat.sources import chat_objects

    out = []
    for where, obj in chat_objects(spec):
        out.append(up_to_last_user(check_messages(obj, where, reply=False), where, to="reply to"))
    if not out:
        raise DataError(f"chat corpus {spec!r} holds no conversation to reply to")
    return out


def write_replies(model, tokenizer, spec: str, out: str | Path, *, mode, max_new_tokens: int = 256,
                  temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                  seed: int | None = None, batch_size: int = 16, overwrite: bool = False,
                  progress: bool = True) -> dict:
    """Write `model`'s reply (decoded in `mode`) to each prompt of `spec` (reply_prompts) to `out` as JSON lines
    {"messages": [..., {"role": "assistant", "content": reply}], "stopped": whether it ended at a stop token},
    whole or not at all; an empty reply is left out. Batch b samples with seed + b (the same seed and batch_size give
    the same replies). Returns {"conversations", "stopped", "empty", "tokens"} (tokens: every reply's)."""
    import torch
    from tqdm.auto import tqdm

    from fullband.data.chat.templates import chat_prompt, chat_template
    from fullband.decode.generate import generate, model_stops
    from fullband.decode.sampling import Sampling

    out = Path(out)
    if out.exists() and not overwrite:
        raise InputError(f"{str(out)!r} exists; pass --overwrite to replace it")
    if out.is_dir():
        raise InputError(f"{str(out)!r} is a folder; accepted: a .jsonl file to write")
    check_writable(out.parent, "the folder of --out")
    prompts = reply_prompts(spec)
    template = chat_template(tokenizer)
    stops = model_stops(model, tokenizer)
    rows, n_stopped, n_tokens, empty = [], 0, 0, 0
    with tqdm(total=len(prompts), desc="replies", unit="conv", disable=not progress, dynamic_ncols=True) as bar:
        for b, start in enumerate(range(0, len(prompts), batch_size)):
            batch = prompts[start:start + batch_size]
            sampling = Sampling(temperature, top_k, top_p, None if seed is None else seed + b)
            with torch.inference_mode():
                ids = generate(model, [chat_prompt(tokenizer, m, template=template) for m in batch], max_new_tokens,
                               mode=mode, sampling=sampling, stop_tokens=stops)
            for messages, reply in zip(batch, ids):
                stopped = bool(reply) and reply[-1] in stops
                text = tokenizer.decode(reply[:-1] if stopped else reply).strip()
                n_tokens += len(reply)
                if not text:  # nothing said: nothing to train on (a conversation's reply is never empty)
                    empty += 1
                    continue
                rows.append({"messages": [{"role": m.role, "content": m.content} for m in messages]
                             + [{"role": "assistant", "content": text}], "stopped": stopped})
                n_stopped += stopped
            bar.update(len(batch))
    if not rows:
        raise DataError(f"the model's {len(prompts)} replies to {spec!r} are all empty; nothing was written")
    replace_file(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return {"conversations": len(rows), "stopped": n_stopped, "empty": empty, "tokens": n_tokens}
