"""Teacher-forced scoring: the log-probability of a continuation given a context, as decoding in a mode sees it.

The context is prefilled exactly as `generate` prefills a prompt (STANDARD / SOFT: one plain pass; FUSED:
1 + k passes; EXACT: the recurrence), then the continuation's tokens are fed one by one through the same
cached decode step, with the fed-back state in every mode but STANDARD. This is what lm-evaluation-harness's
`loglikelihood` asks for."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fullband.decode.generate import stream
from fullband.model.mode import DecodeMode
from fullband.errors import InputError


def score(model, contexts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], *,
          mode: str | DecodeMode = "standard", prefill_passes: int | str | None = None,
          **kwargs) -> list[tuple[float, bool]]:
    """For each (context, continuation) pair of token-id lists: (sum of log p(continuation token), whether
    greedy decoding would have produced the whole continuation). Rows may differ in both lengths."""
    if len(contexts) != len(continuations):
        raise InputError(f"score: {len(contexts)} contexts but {len(continuations)} continuations")
    lengths = [len(c) for c in continuations]
    if not lengths or min(lengths) < 1:
        raise InputError("score: every continuation needs at least one token")
    n = max(lengths)
    forced = torch.nn.utils.rnn.pad_sequence([torch.as_tensor(list(c), dtype=torch.long) for c in continuations],
                                             batch_first=True)
    logprob = torch.zeros(len(lengths), dtype=torch.float64)
    greedy = torch.ones(len(lengths), dtype=torch.bool)
    live = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # (B, n)
    for s, step in enumerate(stream(model, [list(c) for c in contexts], n, mode=mode, prefill_passes=prefill_passes,
                                    forced_tokens=forced, **kwargs)):
        logp = torch.log_softmax(step.logits.double().cpu(), dim=-1)
        tok = forced[:, s]
        logprob += torch.where(live[:, s], logp.gather(1, tok[:, None])[:, 0], torch.zeros((), dtype=torch.float64))
        greedy &= ~live[:, s] | (logp.argmax(-1) == tok)
    return [(float(lp), bool(g)) for lp, g in zip(logprob, greedy)]
