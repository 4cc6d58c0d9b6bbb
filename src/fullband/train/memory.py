"""A training step's memory, estimated from the config before a run starts (the trainer prints it), so a run that
cannot fit is known before its first step, not after minutes of loading and tokenising.

What a step holds at its peak: the weights, their gradients, the optimizer's state, and the activations the
backward keeps: for every pass (gradients flow between passes, so every pass's are kept) each block's saved
tensors, about 10 D + 4 F values per token (the norms' inputs, q / k / v and their rotations, the attention
output, SwiGLU's two branches and their product), and the head's logits, log-softmax and their gradient (3 V per
token). Measured on SmolLM2-135M (30 blocks, D 576, F 1536, V 49,152), float32 on a CPU, 4 x 256 tokens: 1.9 GB
per pass against 2.1 GB estimated. With activation checkpointing a block keeps only its input (D per token) and
one block's tensors are live at a time."""

from __future__ import annotations

import os
from dataclasses import dataclass

from fullband.errors import FullbandError, InputError
from fullband.model.flops import param_count, repeats

GB = 1e9


@dataclass
class StepMemory:
    weights: float  # bytes
    gradients: float
    optimizer: float
    activations: float
    passes: int
    tokens: int  # per micro-batch

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    def describe(self, optimizer: str) -> str:
        return (f"about {self.total / GB:.1f} GB at a {self.passes}-pass step (weights {self.weights / GB:.2f}, "
                f"gradients {self.gradients / GB:.2f}, {optimizer} state {self.optimizer / GB:.2f}, activations "
                f"{self.activations / GB:.2f} GB for {self.passes} pass{'es' if self.passes > 1 else ''} of "
                f"{self.tokens:,} tokens)")


def step_memory(cfg, *, passes: int, tokens: int, optimizer: str = "normuon", checkpointing: bool = False,
                dtype_bytes: int = 4, trained: int | None = None, anchor: bool = False) -> StepMemory:
    """The estimate for a ModelConfig `cfg`, a step of `passes` passes over micro-batches of `tokens` tokens
    (activations in `dtype_bytes`; weights, gradients and optimizer state in float32, as the trainer keeps them).
    `trained`: the weights that train (train.trainable; None: all): only they have gradients and optimizer state
    (the backward still keeps every pass's activations, since the fed state reaches the bottom of the stack).
    `anchor` (train.anchor > 0): a second, frozen copy of the weights, read without gradients."""
    n = param_count(cfg)
    D, Dh, F, V, L = cfg.d_model, cfg.head_dim, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    matrices = L * (D * (cfg.n_heads + 2 * cfg.n_kv_heads) * Dh + cfg.n_heads * Dh * D + 3 * D * F)
    # AdamW: two moments per weight; NorMuon: a momentum per matrix entry (the per-neuron second moment is small)
    # and Adam's two moments for the rest
    state = 2 * n if optimizer == "adamw" else matrices + 2 * (n - matrices)
    if trained is not None:  # a part trained: its share of the state (conservatively, Adam's two moments each)
        state = min(state, 2 * trained)
    block = 10 * D + 4 * F
    # block runs per token: a looped group's every repetition (r = loops, the most a step runs), and under ponder
    # each token's two slots
    runs = sum(repeats(cfg, i) for i in range(L)) * cfg.slots_per_token
    per_token = (runs * D + block if checkpointing else runs * block) + 3 * V
    return StepMemory(weights=4 * n * (2 if anchor else 1), gradients=4 * (n if trained is None else trained),
                      optimizer=4 * state,
                      passes=passes, tokens=tokens, activations=passes * tokens * per_token * dtype_bytes)


def available_memory(device) -> float | None:
    """Bytes a run can still take: free GPU memory on CUDA, the kernel's MemAvailable on the CPU (None: unknown)."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def model_bytes(cfg) -> float:
    """What building FullbandLM(cfg) allocates: its weights (built in float32), and the RoPE tables (cos and sin for
    every position, computed in float64)."""
    return 4 * param_count(cfg) + 2 * 8 * cfg.max_seq_len * cfg.head_dim


def check_fits(parts: dict[str, float], what: str, device="cpu", *, smaller: str,
               error: type[FullbandError] = InputError) -> None:
    """Raise `error` before anything is allocated when the bytes of `parts` ({what: bytes}) add up to more memory
    than `device` has available (unknown: nothing is refused); `smaller` names the settings that shrink it."""
    need, free = sum(parts.values()), available_memory(device)
    if free is not None and need > free:
        detail = ", ".join(f"{name} {bytes_ / GB:,.1f} GB" for name, bytes_ in parts.items())
        detail = f" ({detail})" if len(parts) > 1 else ""
        raise error(f"{what} needs about {need / GB:,.1f} GB{detail} but {free / GB:,.1f} GB is available; "
                    f"nothing was allocated. Accepted: sizes that fit (smaller {smaller})")
