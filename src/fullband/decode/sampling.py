"""Next-token selection from logits: greedy, temperature, top-k and top-p (nucleus) sampling, with its settings in
one small checked object (Sampling) that travels from the caller to the decode loop.

Shipped as source with every transformers folder (fullband.hf.remote): it imports only other shipped modules."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fullband.errors import InputError
from fullband.validate import integer, number


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: temperature 0 is greedy (argmax); otherwise sampling at `temperature` after the top_k /
    top_p filters, from a generator seeded with `seed` (None: torch's global generator). Checked on construction."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", float(number("temperature", self.temperature, low=0, error=InputError)))
        if self.top_k is not None:
            integer("top_k", self.top_k, 1, error=InputError)
        if self.top_p is not None:
            number("top_p", self.top_p, low=0, high=1, low_open=True, error=InputError)
        if self.seed is not None:
            object.__setattr__(self, "seed", integer("seed", self.seed, 0, below=2**63, error=InputError))

    @classmethod
    def of(cls, sampling: Sampling | None = None, **settings) -> Sampling:
        """`sampling` (default greedy) with the settings given as keywords (None: keep) replacing its own."""
        base = sampling if sampling is not None else cls()
        if not isinstance(base, Sampling):
            raise InputError(f"sampling must be a fullband.Sampling, got {type(base).__name__}")
        given = {k: v for k, v in settings.items() if v is not None}
        return base if not given else cls(**{**base.__dict__, **given})

    def generator(self, device: torch.device | str) -> torch.Generator | None:
        return torch.Generator(device).manual_seed(self.seed) if self.seed is not None else None

    def __call__(self, logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """logits (B, V) -> token ids (B,)."""
        return sample(logits, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, generator=generator)


def sample(logits: Tensor, *, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> Tensor:
    """logits (B, V) -> token ids (B,). temperature 0 is greedy (argmax); top_k / top_p filter first."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the mass before it already reaches top_p; the most likely token always stays
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
