"""The multi-pass training objective, outside the model: NTP(pass 1) + pass_loss_weight * mean(NTP(passes 2..k))
(a ponder model: NTP(pass k) alone, as PonderLM-2 trains),
each term plus z_loss * mean(logsumexp(logits)^2) when z_loss > 0, plus latent_loss * the mean over passes of the
next-latent error (latent_error) when latent_loss > 0, plus distill * the mean over passes 2..k of the KL divergence
from pass 1's next-token distribution, not differentiated, to that pass's (distill_kl) when distill > 0, plus anchor *
the mean over every pass of the KL divergence from a frozen model's next-token distribution (`anchor_logp`, the run's
starting point read STANDARD) to that pass's (distill_kl again) when anchor > 0, plus block_match * the mean over
passes 2..k of every block's output drawn to the first pass's, not differentiated (block_distance) when block_match > 0,
and the training-time inputs of the later passes (uniform jitter on the fed state, a random plain prefix per sequence,
detaching between passes). Called by the trainer and the transformers class's labels path; eval.loss scores with the
same `ntp`.

Shipped as source with every transformers folder (fullband.hf.remote): it imports only other shipped modules."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from fullband.errors import InputError
from fullband.model.mode import DecodeMode


@dataclass
class Objective:
    loss: Tensor  # the objective
    pass_losses: list[Tensor]  # NTP of every pass (k entries; passes beyond a noise-free fixed point repeat it)
    state: Tensor  # (B, T, D) the last pass's fed-back state
    top: Tensor  # (B, T, D) the last pass's final-norm output
    latent: Tensor | None = None  # the mean over passes of latent_error (None unless latent_loss > 0)
    distill: Tensor | None = None  # the mean over passes 2..k of distill_kl (None unless distill > 0 and k > 1)
    anchor: Tensor | None = None  # the mean over passes 1..k of distill_kl from anchor_logp (None unless anchor > 0)
    block_match: Tensor | None = None  # the mean over passes 2..k of block_distance (None unless block_match > 0
    # and k > 1)


def ntp(logits: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
    """Next-token cross-entropy of logits (B, T, V) against targets (B, T) (-100 = not scored), in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)


def latent_error(head, state: Tensor, targets: Tensor) -> Tensor:
    """The next-latent error of one pass: sum ||head(h_t) - h_{t+1}||^2 / sum ||h_{t+1}||^2 over the positions t
    whose successor is scored (targets[t + 1] != -100), the fed-back states `state` (B, T, D) as h, the target h_{t+1}
    not differentiated (the gradient reaches h_t through `head`: it shapes what is fed back). In float32 at least;
    0 when no pair is scored."""
    dtype = torch.promote_types(state.dtype, torch.float32)
    pred = head(state[:, :-1]).to(dtype)  # (B, T-1, D)
    goal = state[:, 1:].detach().to(dtype)
    scored = (targets[:, 1:] != -100).to(dtype)  # (B, T-1)
    err = ((pred - goal).pow(2).sum(-1) * scored).sum()
    return err / (goal.pow(2).sum(-1) * scored).sum().clamp_min(torch.finfo(dtype).tiny)


def scored_log_probs(logits: Tensor, targets: Tensor) -> Tensor:
    """Next-token log-probabilities (N, V) of logits (B, T, V) at the scored positions (targets != -100), in float32
    at least: a distillation term's teacher and student."""
    return F.log_softmax(logits[targets != -100].to(torch.promote_types(logits.dtype, torch.float32)), -1)


def distill_kl(teacher: Tensor, logits: Tensor, targets: Tensor) -> Tensor:
    """The distillation term of one pass: the mean over scored positions (targets != -100) of KL(p_teacher || p_pass),
    `teacher` log-probabilities over the scored positions (N, V), already detached (self-distillation: the first
    pass's, the STANDARD read the fed passes are drawn towards; the anchor: a frozen model's), `logits` (B, T, V) the
    pass's. In float32 at least; 0 when nothing is scored."""
    logp = scored_log_probs(logits, targets)
    kl = F.kl_div(logp, teacher.to(logp.dtype), log_target=True, reduction="sum")
    return kl / max(teacher.shape[0], 1)


def block_distance(outputs: list[Tensor], first: list[Tensor]) -> Tensor:
    """The block-match term of one fed pass: the mean over blocks of mean((y - sg(y_1))^2) / mean(sg(y_1)^2), `outputs`
    the pass's block outputs (B, T, D) in the order the blocks ran, `first` the first pass's, paired in that order (a
    block run once per pass, below config.feedback_target, is not in `outputs`: only the blocks both passes ran are
    paired, from the top). In float32 at least."""
    dtype = torch.promote_types(outputs[0].dtype, torch.float32)
    terms = []
    for y, y1 in zip(outputs, first[len(first) - len(outputs):]):
        goal = y1.detach().to(dtype)
        terms.append((y.to(dtype) - goal).pow(2).mean() / goal.pow(2).mean().clamp_min(torch.finfo(dtype).tiny))
    return torch.stack(terms).mean()


@contextmanager
def block_outputs(blocks) -> Iterator[list[Tensor]]:
    """Every output of `blocks` (a ModuleList) while inside, in the order they ran (forward hooks, removed on exit; a
    block wrapped for activation checkpointing reports once, not again when its backward recomputes it)."""
    seen: list[Tensor] = []

    def hook(module, args, output):
        seen.append(output[0] if isinstance(output, tuple) else output)

    handles = [b.register_forward_hook(hook) for b in blocks]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def prefix_mixin(B: int, T: int, prob: float, device: torch.device, generator: torch.Generator | None) -> Tensor:
    """(B, T) bool: with probability `prob` a sequence reverts positions t <= p, p ~ U[0, T), to plain inputs."""
    use = torch.rand(B, device=device, generator=generator) < prob
    p = torch.randint(0, T, (B,), device=device, generator=generator)
    return use[:, None] & (torch.arange(T, device=device)[None, :] <= p[:, None])


def training_feed(cfg, *, noise: bool, generator: torch.Generator | None):
    """The `feed` hook of the model's pass loop (fullband.model.core): the state fed to pass j is detached
    (cfg.detach_between_passes) and, with `noise`, jittered by U(-jitter, jitter), with a random plain prefix per
    sequence (cfg.prefix_mixin_prob). None when nothing changes what a pass reads."""
    jitter = cfg.jitter if noise else 0.0
    mixin = cfg.prefix_mixin_prob if noise else 0.0
    if not (cfg.detach_between_passes or jitter > 0 or mixin > 0):
        return None

    def feed(j: int, state: Tensor, plain: Tensor) -> tuple[Tensor, Tensor]:
        prev = state.detach() if cfg.detach_between_passes else state
        if jitter > 0:
            noise_ = torch.empty(prev.shape, dtype=prev.dtype, device=prev.device)
            prev = prev + noise_.uniform_(-jitter, jitter, generator=generator)
        if mixin > 0:
            B, T = plain.shape
            plain = plain | prefix_mixin(B, T, mixin, plain.device, generator)
        return prev, plain

    return feed


def objective(model, input_ids: Tensor, targets: Tensor, passes: int, *, plain_mask: Tensor | None = None,
              generator: torch.Generator | None = None, z_loss: float = 0.0, latent_loss: float = 0.0,
              distill: float = 0.0, anchor: float = 0.0, anchor_logp: Tensor | None = None, block_match: float = 0.0,
              noise: bool | None = None, cache=None) -> Objective:
    """The objective of `passes` Jacobi passes over input_ids (B, T) against targets (B, T) (-100 = ignore).
    `model` is a FeedbackModel or its data-parallel wrapper (the loss is computed inside its forward). `noise`
    (default: the model's training mode) adds the jitter and prefix mixin; without it passes beyond T repeat the
    fixed point, so they are not run again and their terms are the last one's. `latent_loss` > 0 adds that weight
    times the mean over passes of latent_error through the model's latent_head (model.latent_head); `distill` > 0
    adds that weight times the mean over passes 2..k of distill_kl from pass 1's distribution (no extra forward: pass
    1's logits are the teacher). `anchor` > 0 adds that weight times the mean over every pass of distill_kl from
    `anchor_logp`, a frozen model's log-probabilities over the scored positions (N, V), computed by the caller.
    `block_match` > 0 adds that weight times the mean over passes 2..k of block_distance, every block's output in the
    pass against the first pass's (read by forward hooks on the model's `blocks`; no extra forward). A `cache`
    receives the last pass's keys and values."""
    net = getattr(model, "module", model)  # DDP: the model inside
    cfg = net.config
    head = getattr(net, "latent_head", None) if latent_loss > 0 else None
    if latent_loss > 0 and head is None:
        raise InputError(f"latent_loss={latent_loss} trains a latent head; this model has none (accepted: "
                         'model.latent_head = "linear", or latent_loss = 0)')
    if anchor > 0 and anchor_logp is None:
        raise InputError(f"anchor={anchor} draws every pass towards a frozen model's distribution; anchor_logp (its "
                         "log-probabilities over the scored positions) was not given")
    noise = net.training if noise is None else noise
    T = input_ids.shape[1]
    run = passes if noise else DecodeMode.from_passes(passes).read(T, fixed_point=net.exact_passes(T)).passes
    ntps: list[Tensor] = []
    latents: list[Tensor] = []
    kls: list[Tensor] = []
    teacher: list[Tensor] = []  # pass 1's log-probabilities over the scored positions, when distill > 0
    anchors: list[Tensor] = []
    matches: list[Tensor] = []
    first: list[Tensor] = []  # the first pass's block outputs, when block_match > 0

    def each_pass(j: int, state: Tensor, top: Tensor) -> Tensor:
        logits = net.head(top)
        ce = ntp(logits, targets)
        ntps.append(ce)
        if head is not None:
            latents.append(latent_error(head, state, targets))
        if distill > 0 and passes > 1:
            if j == 0:
                teacher.append(scored_log_probs(logits.detach(), targets))
            else:
                kls.append(distill_kl(teacher[0], logits, targets))
        if anchor > 0:
            anchors.append(distill_kl(anchor_logp, logits, targets))
        if outputs is not None:
            if j == 0:
                first.extend(outputs)
            else:
                matches.append(block_distance(outputs, first))
            outputs.clear()
        return ce + z_loss * logits.float().logsumexp(-1).pow(2).mean() if z_loss > 0 else ce

    watch = block_match > 0 and passes > 1
    with block_outputs(net.blocks) if watch else nullcontext() as outputs:
        out = model(input_ids, passes=run, plain_mask=plain_mask, cache=cache, return_logits=False,
                    feed=training_feed(cfg, noise=noise, generator=generator), each_pass=each_pass)
    terms = out.per_pass + [out.per_pass[-1]] * (passes - run)
    ntps += [ntps[-1]] * (passes - run)
    loss = terms[0]
    if getattr(cfg, "ponder", False):  # PonderLM-2 trains the last pass's ponder slots only
        loss = terms[-1]
    elif len(terms) > 1:
        loss = loss + cfg.pass_loss_weight * torch.stack(terms[1:]).mean()
    # passes run beyond a noise-free fixed point repeat the last pass's terms, as its NTP
    latent, kl, held, match = (torch.stack(t + [t[-1]] * (passes - run)).mean() if t else None
                               for t in (latents, kls, anchors, matches))
    for weight, term in ((latent_loss, latent), (distill, kl), (anchor, held), (block_match, match)):
        if term is not None:
            loss = loss + weight * term
    return Objective(loss=loss, pass_losses=ntps, state=out.hidden, top=out.top, latent=latent, distill=kl,
                     anchor=held, block_match=match)
