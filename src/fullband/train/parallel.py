"""Process groups and model wrapping, in one place: activation checkpointing, compile, then DDP or FSDP2.

The model code knows nothing about parallelism. Launch several processes with `torchrun`; a single process
runs without a process group. Order follows torchtitan: checkpointing, compile, data parallelism."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fullband.errors import ConfigError


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but CUDA is not available here; accepted: auto or cpu")
    return torch.device(f"cuda:{local_rank}") if name == "cuda" else torch.device(name)


def init_distributed(device: str) -> Dist:
    """Join the process group torchrun set up (RANK / WORLD_SIZE / LOCAL_RANK), or run alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if world > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank=rank, world=world, local_rank=local_rank, device=dev)


def shutdown(d: Dist, *, finished: bool = True) -> None:
    """Leave the process group. After a clean finish every rank meets at a barrier first, so that none tears down
    its connections while another still uses them (a rank destroying the group ahead of the others can hang
    gloo's teardown: pytorch/pytorch#75097). After a failure the ranks may be anywhere, and any collective,
    destroy included, could wait forever: the process's exit is left to close the connections."""
    if d.enabled and dist.is_initialized() and finished:
        dist.barrier()
        dist.destroy_process_group()


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def all_reduce_mean(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= d.world
    return t


def broadcast0(t: torch.Tensor, d: Dist) -> torch.Tensor:
    """Rank 0's `t` on every rank."""
    if d.enabled:
        dist.broadcast(t, src=0)
    return t


def all_reduce_max(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def parallelize(model: nn.Module, *, d: Dist, mode: str, activation_checkpointing: bool, compile: bool) -> nn.Module:
    """Wrap `model` for training; returns the module to call (DDP wrapper, or the FSDP2-sharded model)."""
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    if compile:
        for block in model.blocks:
            block.compile()
    if not d.enabled:
        return model
    if mode == "fsdp":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    # single-pass steps leave the fusion weights unused (the same on every rank, since k is drawn per step), and
    # train.latent_loss = 0 a latent head
    unused = model.config.has_feedback or model.config.latent_head != "none"
    return DistributedDataParallel(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None,
                                   find_unused_parameters=unused)


def unwrap(model: nn.Module) -> nn.Module:
    """The FullbandLM inside a DDP wrapper (FSDP2 shards in place, so the model is itself)."""
    return model.module if hasattr(model, "module") else model


def is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def no_sync(model: nn.Module, skip: bool):
    """Context that skips the gradient all-reduce for all but the last micro-batch of a step."""
    import contextlib

    if not skip:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2

        @contextlib.contextmanager
        def _ctx():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return _ctx()
    return contextlib.nullcontext()
