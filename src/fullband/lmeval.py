"""lm-evaluation-harness model `fullband` (the `eval` extra): score and generate with a checkpoint in any mode.

    python -m fullband.lmeval --model fullband --model_args checkpoint=DIR,mode=fused,prefill_passes=2 --tasks ...

(the harness's own CLI, with this model registered first), or in Python
`lm_eval.simple_evaluate(model=FullbandHarnessLM(checkpoint=...), tasks=[...])`.

`loglikelihood` prefills the context in the chosen mode (FUSED: 1 + prefill_passes Jacobi passes, the paper's
Fig. 4 protocol) and feeds the continuation through the decode step (fullband.decode.score), so a score is
what decoding in that mode sees. `loglikelihood_rolling` scores a text in max_seq_len windows;
`generate_until` decodes in the mode and cuts at the first stop string.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fullband.errors import ConfigError, FullbandError, closest

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise FullbandError("the lm-evaluation-harness model needs lm-eval: pip install 'fullband[eval]'") from exc

ARGS = ("checkpoint", "mode", "prefill_passes", "batch_size", "device", "max_gen_toks", "dtype")
IGNORED = ("max_batch_size",)  # passed by the harness; fullband batches by batch_size alone


@register_model("fullband")
class FullbandHarnessLM(LM):
    def __init__(self, checkpoint: str | Path | None = None, mode: str = "standard", prefill_passes: int | str = 1,
                 batch_size: int | str = 8, device: str = "cpu", max_gen_toks: int = 256, dtype: str = "float32",
                 **unknown: Any) -> None:
        super().__init__()
        unknown = {k: v for k, v in unknown.items() if k not in IGNORED}
        if unknown:
            name = next(iter(unknown))
            raise ConfigError(f"unknown model arg {name!r} for --model fullband{closest(name, ARGS)}; "
                              f"accepted: {', '.join(ARGS)}")
        if checkpoint is None:
            raise ConfigError("--model fullband needs model_args checkpoint=DIR (a fullband model folder)")
        import torch

        from fullband.checkpoint import load_native
        from fullband.data.tokenizer import load_tokenizer
        from fullband.decode.mode import DecodeMode

        if str(batch_size).startswith("auto"):
            batch_size = 8
        batch_size = _int_arg("batch_size", batch_size, 1)
        max_gen_toks = _int_arg("max_gen_toks", max_gen_toks, 1)
        if prefill_passes != "auto":
            prefill_passes = _int_arg("prefill_passes", prefill_passes, 0, accepted="an integer >= 0 or 'auto'")
        decode_mode = DecodeMode.of(mode, prefill_passes, error=ConfigError)
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if dtype not in dtypes:
            raise ConfigError(f"dtype={dtype!r} is invalid; accepted: {', '.join(dtypes)}")
        if str(device).startswith("cuda") and not torch.cuda.is_available():  # the harness CLI's default device
            import warnings

            warnings.warn(f"device={device!r} asked for but CUDA is not available; using the CPU", stacklevel=2)
            device = "cpu"
        self.model = load_native(checkpoint, "the lm-eval model 'fullband'", device=device, dtype=dtypes[dtype]).eval()
        self.tokenizer = load_tokenizer(checkpoint)
        self.mode = decode_mode.check(self.model.config, ConfigError)
        self.batch_size, self.max_gen_toks = int(batch_size), int(max_gen_toks)
        self.max_length = self.model.config.max_seq_len
        self._prefix = self.tokenizer.encode("")  # what the tokenizer prepends (BOS), possibly nothing
        self._bos = self._prefix[-1] if self._prefix else self.model.config.bos_token_id

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None):
        """model_args win over the harness's own flags (--batch_size, --device) when both name a setting."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # ------------------------------------------------------------------ tokens
    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids; the pair is tokenised whole where that keeps the context's tokens."""
        ctx = self.tokenizer.encode(context)
        whole = self.tokenizer.encode(context + continuation)
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
        out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        for i, result in zip(order, scored):
            out[i] = result
        return out

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
            ctx = self.tokenizer.encode(context) or [self._bos]
            max_new = max(1, min(max_new, self.max_length - 1))
            ctx = ctx[-(self.max_length - max_new):]
            ids = generate(self.model, [ctx], max_new, mode=self.mode, temperature=temperature,
                           seed=0 if temperature > 0 else None)[0]
            text = self.tokenizer.decode(ids)
            cuts = [text.index(stop) for stop in until if stop and stop in text]
            out.append(text[: min(cuts)] if cuts else text)
        return out


def _int_arg(name: str, value: Any, minimum: int, accepted: str | None = None) -> int:
    """An integer model arg or generation setting (the harness passes ints, or strings from --model_args)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} is invalid; accepted: {accepted or f'an integer >= {minimum}'}")
    return value


def main() -> None:
    """The harness CLI with `--model fullband` registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
