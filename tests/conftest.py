"""Shared fixtures: tiny random models that run in milliseconds on a CPU."""

from __future__ import annotations

import pytest
import torch

from fullband import FullbandLM, ModelConfig

torch.set_num_threads(min(2, torch.get_num_threads()))


def tiny_config(**changes) -> ModelConfig:
    base = dict(vocab_size=259, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=160, bos_token_id=256)
    base.update(changes)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **changes) -> FullbandLM:
    torch.manual_seed(seed)
    return FullbandLM(tiny_config(**changes)).eval()


@pytest.fixture
def model() -> FullbandLM:
    return tiny_model()


def random_ids(batch: int, length: int, *, seed: int = 1, vocab: int = 256) -> torch.Tensor:
    """Ids below 256 (bytes), so no accidental BOS in the middle."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)
