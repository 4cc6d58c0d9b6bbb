"""lm-evaluation-harness model `fullband` (the `eval` extra): score and generate with a checkpoint in any mode.
Usage (`python -m fullband.lmeval`, the harness's CLI with this model registered): docs/lm-eval.md.

`loglikelihood` prefills the context in the mode and feeds the continuation through the decode step
(fullband.decode.score), so a score is what decoding in that mode sees; `loglikelihood_rolling` scores a text in
max_seq_len windows; `generate_until` decodes in the mode and cuts at the first stop string.

With the harness's `--apply_chat_template` (a checkpoint with a chat vocabulary, or a pretrained model's own
template) each request is the conversation rendered by the vocabulary's template, read back with its special
tokens' text (<bos>, <|user|>, ...) as their ids: exactly `fullband.apply_chat_template`'s prompt ids; a
generation then also ends at the vocabulary's stop ids (EOS, <|end|>), where the turn ends."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

from fullband.errors import ConfigError, DataError, FullbandError, MissingPackage, closest
from fullband.validate import ascii_int

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingPackage("the lm-evaluation-harness model needs lm-eval: pip install 'fullband[eval]'") from exc

ARGS = ("checkpoint", "mode", "prefill_passes", "batch_size", "device", "max_gen_toks", "dtype")
IGNORED = ("max_batch_size",)  # passed by the harness; fullband batches by batch_size alone


@register_model("fullband")
class FullbandHarnessLM(LM):
    def __init__(self, checkpoint: str | Path | None = None, mode: str = "standard",
                 prefill_passes: int | str | None = None, batch_size: int | str = 8, device: str = "cpu",
                 max_gen_toks: int = 256, dtype: str = "float32", **unknown: Any) -> None:
        super().__init__()
        unknown = {k: v for k, v in unknown.items() if k not in IGNORED}
        if unknown:
            name = next(iter(unknown))
            raise ConfigError(f"unknown model arg {name!r} for --model fullband{closest(name, ARGS)}; "
                              f"accepted: {', '.join(ARGS)}")
        if checkpoint is None:
            raise ConfigError("--model fullband needs model_args checkpoint=DIR (a fullband model folder)")
        import torch

        from fullband import validate
        from fullband.loader import load_model
        from fullband.data.tokenizer import load_tokenizer
        from fullband.model.mode import DecodeMode

        self.batch_size = 8 if str(batch_size).startswith("auto") else _int_arg("batch_size", batch_size, 1)
        self.max_gen_toks = _int_arg("max_gen_toks", max_gen_toks, 1)
        decode_mode = DecodeMode.parse(mode, prefill_passes, error=ConfigError)
        torch_dtype = validate.dtype("dtype", dtype)
        if str(device).startswith("cuda") and not torch.cuda.is_available():  # the harness CLI's default device
            warnings.warn(f"device={device!r} asked for but CUDA is not available; using the CPU", stacklevel=2)
            device = "cpu"
        self.model = load_model(checkpoint, device=device, dtype=torch_dtype).eval()
        self.tokenizer = load_tokenizer(checkpoint)
        self.mode = decode_mode.check(self.model.config, ConfigError)
        self.max_length = self.model.config.max_seq_len
        self._prefix = self.tokenizer.encode("")  # what the tokenizer prepends (BOS), possibly nothing
        self._bos = self._prefix[-1] if self._prefix else self.model.config.bos_token_id
        self._template: Any = None  # the vocabulary's chat template, once --apply_chat_template asks for it
        self._chat = False  # contexts are chat-rendered text (set when the harness applies the chat template)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None):
        """model_args win over the harness's own flags (--batch_size, --device) when both name a setting."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # ------------------------------------------------------------------ chat templates (--apply_chat_template)
    @property
    def tokenizer_name(self) -> str:
        """The vocabulary's name in the harness's request cache keys (read under --apply_chat_template only)."""
        self._chat_template()  # a vocabulary without a chat template fails here, before any request is built
        self._chat = True
        return f"fullband-{self.tokenizer.kind}-{self.tokenizer.fingerprint}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The Jinja text of the vocabulary's chat template (what a converted folder's tokenizer carries), None
        when not asked for or when the vocabulary has none. fullband has one template per vocabulary, so a
        template name is not looked up."""
        from fullband.data.chat.templates import hf_chat_template

        return None if chat_template is False or chat_template is None else hf_chat_template(self.tokenizer)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation rendered as text by the vocabulary's template: BOS, each message, then the assistant's
        marker (add_generation_prompt), or, without it, the last (assistant) message left open to continue (the
        harness's gen_prefix). Contexts so rendered are read back with the markers as their ids."""
        from fullband.data.chat.messages import as_message
        from fullband.data.chat.templates import MARKER_JINJA, MarkerTemplate

        template = self._chat_template()
        self._chat = True
        messages = [as_message(m, f"chat_history[{i}]") for i, m in enumerate(chat_history)]
        history = [{"role": m.role, "content": m.content} for m in messages]
        open_last = not add_generation_prompt and bool(messages) and messages[-1].role == "assistant"
        if isinstance(template, MarkerTemplate):
            import jinja2.sandbox

            env = jinja2.sandbox.ImmutableSandboxedEnvironment()
            text = env.from_string(MARKER_JINJA).render(messages=history, add_generation_prompt=add_generation_prompt,
                                                        bos_token=self._token_text(self.tokenizer.bos_id))
            end = "<|end|>"
            return text[: -len(end)] if open_last and text.endswith(end) else text
        try:  # a pretrained model's own template, rendered by transformers
            return template.text(messages, generation_prompt=add_generation_prompt, continue_final=open_last)
        except DataError as err:
            raise ConfigError(f"--apply_chat_template: {err}") from None

    def _chat_template(self):
        """The vocabulary's chat template (fullband.data.chat), or ConfigError saying why there is none."""
        if self._template is None:
            from fullband.data.chat.templates import chat_template

            try:
                self._template = chat_template(self.tokenizer)
            except DataError as err:
                raise ConfigError(f"--apply_chat_template: the checkpoint's {self.tokenizer.kind} vocabulary has no "
                                  f"chat template ({err}); accepted: a checkpoint trained with [data] format = "
                                  "\"chat\", or evaluation without --apply_chat_template") from None
        return self._template

    def _token_text(self, token: int) -> str:
        """A special token's text (<bos>, <|user|>, ...)."""
        return self.tokenizer.decode([token], skip_special=False)

    def _encode_chat(self, text: str) -> list[int]:
        """Ids of chat-rendered text: its special tokens' text (BOS, the role markers) as their ids, the text
        between them encoded as the template encodes a message's content; BOS first."""
        import re

        from fullband.data.chat.templates import MarkerTemplate

        template = self._chat_template()
        bos = self.tokenizer.bos_id
        if isinstance(template, MarkerTemplate):
            specials = {self._token_text(bos): bos, **self.tokenizer.chat_ids}
            pattern = "(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")"
            ids: list[int] = []
            for piece in re.split(pattern, text):
                if piece in specials:
                    ids.append(specials[piece])
                elif piece:
                    ids += self.tokenizer.encode(piece, bos=False)
        else:  # the template writes a pretrained model's special tokens as text: its tokenizer reads them so
            ids = template.encode_text(text)
        return ids if bos is None or not template.prompt_bos or ids[:1] == [bos] else [bos, *ids]

    # ------------------------------------------------------------------ tokens
    def _encode(self, context: str) -> list[int]:
        """Ids of a request's context (chat-rendered under --apply_chat_template)."""
        return self._encode_chat(context) if self._chat else self.tokenizer.encode(context)

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids; the pair is tokenised whole where that keeps the context's tokens."""
        ctx = self._encode(context)
        whole = self._encode(context + continuation)
        if whole[: len(ctx)] == ctx and len(whole) > len(ctx):
            cont = whole[len(ctx):]
        else:
            cont = self.tokenizer.encode(continuation)[len(self._prefix):]
        if not ctx:
            ctx = [self._bos if self._bos is not None else cont[0]]
        room = self.max_length - len(cont)
        if room < 1:
            raise ConfigError(f"a continuation of {len(cont)} tokens does not fit max_seq_len={self.max_length}")
        return ctx[-room:], cont

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        from fullband.decode.score import score

        out: list[tuple[float, bool]] = []
        for start in range(0, len(pairs), self.batch_size):
            chunk = pairs[start : start + self.batch_size]
            out += score(self.model, [c for c, _ in chunk], [x for _, x in chunk], mode=self.mode)
        return out

    # ------------------------------------------------------------------ the harness API
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._split(*req.args) for req in requests]
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))  # similar lengths batch together
        scored = self._score([pairs[i] for i in order])
        return [result for _, result in sorted(zip(order, scored), key=lambda pair: pair[0])]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in requests:
            tokens = self.tokenizer.encode(req.args[0])[len(self._prefix):]
            if not tokens:
                out.append(0.0)
                continue
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=tokens, prefix_token=self._bos, max_seq_len=self.max_length, context_len=1)]
            out.append(sum(lp for lp, _ in self._score([(list(c), list(p)) for c, p in windows])))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from fullband.decode.generate import generate

        out = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = _int_arg("max_gen_toks", kwargs.pop("max_gen_toks", self.max_gen_toks), 1)
            temperature = kwargs.pop("temperature", 0.0) if kwargs.pop("do_sample", False) else 0.0
            try:
                temperature = float(temperature)
            except (TypeError, ValueError):
                temperature = float("nan")
            if not math.isfinite(temperature) or temperature < 0:
                raise ConfigError(f"temperature={kwargs.get('temperature', temperature)!r} in the task's generation "
                                  "settings is invalid; accepted: a number >= 0")
            ctx = self._encode(context) or [self._bos]
            max_new = max(1, min(max_new, self.max_length - 1))
            ctx = ctx[-(self.max_length - max_new):]
            # a chat turn ends at a stop id (EOS, <|end|>): the text after it would be the next turn's
            stops = list(self.tokenizer.stop_ids) if self._chat else None
            ids = generate(self.model, [ctx], max_new, mode=self.mode, temperature=temperature,
                           seed=0 if temperature > 0 else None, stop_tokens=stops)[0]
            text = self.tokenizer.decode(ids)
            cuts = [text.index(stop) for stop in until if stop and stop in text]
            out.append(text[: min(cuts)] if cuts else text)
        return out


def _int_arg(name: str, value: Any, minimum: int) -> int:
    """An integer model arg or generation setting (the harness passes ints, or strings from --model_args)."""
    if isinstance(value, str) and (parsed := ascii_int(value.strip())) is not None:
        value = parsed
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} is invalid; accepted: an integer >= {minimum}")
    return value


def main() -> None:
    """The harness CLI with `--model fullband` registered."""
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    except FullbandError as err:  # a wrong model arg or an unloadable checkpoint: one line, as `fullband` prints
        print(f"fullband.lmeval: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
