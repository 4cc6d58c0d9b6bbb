"""The training loop: the multi-pass objective under a pass schedule, NorMuon + Adam with WSD, periodic
validation, atomic checkpoints that resume bitwise-exactly, and a divergence guard.

Everything random is a pure function of (seed, step, micro-batch): the pass count, a looped model's r, the
data, the jitter and the prefix mixin. So a resumed run, or the same global batch split over more processes,
replays the same computation.

Compute is logged as compute_tokens (tokens x passes, the paper's token-equivalent compute) and flops
(fullband.model.flops.train_flops of each step's k and r; for a wrapped Hugging Face model: the native count)."""

from __future__ import annotations

import contextlib
import gc
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from fullband.errors import ConfigError, TrainingDiverged
from fullband.files import writing
from fullband.gguf_file import parsed_once
from fullband.eval.gate import gate_windows, stability_gate
from fullband.eval.loss import validation_loss
from fullband.model.flops import train_flops
from fullband.model.objective import objective, scored_log_probs
from fullband.train import checkpoint as ckpt
from fullband.train.config import RunConfig
from fullband.train.build import anchor_model, build, resolve
from fullband.train.data import RunData, chat_eval_batches, prepare_data
from fullband.train.rundir import MUST_MATCH, RunDir, stop_after_step
from fullband.train.metrics import METRICS_FILE, MetricsLog, plot_metrics, progress_bar
from fullband.train.parallel import (Dist, all_reduce_max, all_reduce_mean, barrier, broadcast0, init_distributed,
                                     no_sync, shutdown, unwrap)
from fullband.train.schedule import (AdaptiveSchedule, PassMix, blend_weight, distill_weight, in_cooldown,
                                     sample_loops, wsd_factor)


@dataclass
class StepStats:
    k: int
    loss: float
    pass_losses: list[float]
    grad_norm: float
    state_rms: float
    loops: int = 1  # r, the looped group's repetitions in this step
    blend: float = 1.0  # the blend curriculum's weight a in this step (1: the paper's fed input)
    latent: float = 0.0  # the next-latent error (Objective.latent; 0 when train.latent_loss = 0)
    distill: float = 0.0  # the self-distillation KL (Objective.distill; 0 when off or in a one-pass step)
    distill_weight: float = 0.0  # its weight in this step (train.distill falling to 0 at train.distill_until)
    anchor: float = 0.0  # the anchor's KL (Objective.anchor; 0 when off)
    anchor_weight: float = 0.0  # its weight in this step (train.anchor falling to 0 at train.anchor_until)
    block_match: float = 0.0  # the block-match term (Objective.block_match; 0 when off or in a one-pass step)
    block_match_weight: float = 0.0  # its weight in this step (train.block_match falling to 0 at its _until)


def noise_seed(seed: int, step: int, block: int) -> int:
    """Seed of the jitter / prefix-mixin generator for global micro-batch `block` of `step` (folded into the 64
    bits torch takes; unchanged for every seed whose value fits)."""
    return ((seed * 1_000_003 + step) * 10_007 + block) % 2**64


def _print0(d: Dist, *args) -> None:
    if d.main:
        print(*args, flush=True)


class Trainer:
    def __init__(self, cfg: RunConfig, *, resume: str | Path | None = None) -> None:
        self.d = init_distributed(cfg.train.device)
        self.rundir = RunDir(cfg.log.run_dir, resume=resume, owner=self.d.main)
        self.run_dir = self.rundir.path
        try:
            self._setup(cfg, resume)
        except BaseException:
            self.rundir.abandon()
            raise

    @parsed_once()  # a warm start from a GGUF file reads its config, tokenizer and weights: one parse
    def _setup(self, cfg: RunConfig, resume: str | Path | None) -> None:
        # everything that can fail on user input happens before the run directory is written to
        self.cfg, source = resolve(cfg, self.d, run_dir=self.run_dir if resume is not None else None)
        cfg = self.cfg
        if self.d.main:
            say_memory(cfg, self.d.device)
        threads = self.rundir.check(cfg.to_dict(), MUST_MATCH, "train.threads", cfg.train.threads)
        self.resume_from = self.rundir.checkpoint
        cfg = self.cfg = replace(cfg, train=replace(cfg.train, threads=threads))  # what run.json records
        self.data: RunData = prepare_data(cfg, self.d, source=source)
        built = build(cfg, self.d, warm=resume is None)
        self.model, self.optimizer, self.warm_started = built.model, built.optimizer, built.warm_started
        self.chat_batches = chat_eval_batches(cfg, self.data.tokenizer, unwrap(self.model).config.max_seq_len)
        self.anchor = anchor_model(cfg, self.d.device) if cfg.train.anchor > 0 else None  # frozen, read STANDARD
        self.schedule = cfg.train.schedule
        # the adaptive schedule's current mix (None for a fixed schedule), steered by adapt()
        self.mix = self.schedule.start() if isinstance(self.schedule, AdaptiveSchedule) else None
        self.step, self.tokens, self.compute_tokens, self.elapsed, self.flops = 0, 0, 0, 0.0, 0.0
        self._step_flops: dict[tuple[int, int], float] = {}  # (k, r) -> one step's FLOPs, counted once
        self.autocast = _autocast(cfg.train.dtype, self.d.device)
        barrier(self.d)
        state = self.rundir.load(self.model, self.optimizer, self.d)
        if state is not None:
            self.data.sampler.check_state(state["sampler"])
            self.step, self.tokens = state["step"], state["tokens"]
            self.compute_tokens, self.elapsed = state["compute_tokens"], state["elapsed"]
            if self.mix is not None:
                self.mix = PassMix(*state["pass_mix"])
            # a checkpoint written before FLOPs were counted has none: every step's (k, r) is a function of
            # (seed, step), so the steps it holds are counted again, in order (the sum an uninterrupted run makes)
            self.flops = state["flops"] if "flops" in state else sum(
                self.step_flops(*self.draws(s)) for s in range(self.step))
            _print0(self.d, f"resumed from {self.resume_from} at {ckpt.describe(state)}")
        elif resume is not None:  # a run killed before its first checkpoint: it starts again from step 0
            _print0(self.d, f"{self.run_dir} holds no complete checkpoint yet (the run stopped before its first); "
                            "starting it from step 0 with its saved settings")
        self.rundir.begin(cfg.to_dict(), self.step, tokenizer=self.data.tokenizer)
        self.loggers = MetricsLog(self.run_dir, cfg, self.d) if self.d.main else None

    # ------------------------------------------------------------------ one optimizer step
    def draws(self, step: int) -> tuple[int, int]:
        """(k, r) of 0-based optimizer step `step`: its pass count under self.schedule and a looped model's
        repetitions (1 without a loop), functions of (seed, step) only."""
        cfg = self.cfg
        k = (self.schedule.sample(step, cfg.train.steps, cfg.train.seed) if self.mix is None
             else self.schedule.sample(step, cfg.train.steps, cfg.train.seed, self.mix))
        return k, sample_loops(cfg.model, step, cfg.train.seed)  # a looped model's depth: another axis than k

    def step_flops(self, k: int, loops: int) -> float:
        """Training FLOPs of one optimizer step of k passes at r = loops: global_batch_tokens x train_flops."""
        if (k, loops) not in self._step_flops:
            train = self.cfg.train
            per_token = train_flops(self.cfg.model, k, seq_len=train.seq_len, loops=loops,
                                    latent=train.latent_loss > 0, anchor=train.anchor > 0)
            self._step_flops[k, loops] = train.global_batch_tokens * per_token
        return self._step_flops[k, loops]

    def train_step(self, step: int) -> StepStats:
        cfg, d, sampler = self.cfg, self.d, self.data.sampler
        k, r = self.draws(step)
        factor = wsd_factor(step, cfg.train.steps, cfg.train.warmup_steps, cfg.train.cooldown_fraction)
        cooldown = in_cooldown(step, cfg.train.steps, cfg.train.cooldown_fraction)
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * factor
            wd_factor = factor if (cooldown and cfg.train.decay_wd_in_cooldown) else 1.0
            group["weight_decay"] = group["base_wd"] * wd_factor
        z_loss = cfg.train.z_loss if cooldown else 0.0
        model = self.model
        model.train()
        accum = sampler.accum_steps
        sums = torch.zeros(k + 6, device=d.device)  # per-pass NTP, objective, state RMS, next-latent, KLs, match
        blend = blend_weight(step, cfg.train.steps, cfg.train.blend_until)
        distill = distill_weight(step, cfg.train.steps, cfg.train.distill, cfg.train.distill_until)
        anchor = distill_weight(step, cfg.train.steps, cfg.train.anchor, cfg.train.anchor_until)
        match = distill_weight(step, cfg.train.steps, cfg.train.block_match, cfg.train.block_match_until)
        net = unwrap(model)
        with (net.looping(r) if cfg.model.has_loop else contextlib.nullcontext()), \
                (net.blended(blend) if blend < 1 else contextlib.nullcontext()):
            for micro in range(accum):
                # text: (inputs, targets); chat: + the positions read plainly (prompts, as decoding reads them)
                inputs, targets, *plain = (t.to(d.device) for t in sampler.batch(step, micro))
                block = micro * d.world + d.rank  # global micro-batch index: the same noise for any world size
                gen = torch.Generator(device=d.device).manual_seed(noise_seed(cfg.train.seed, step, block))
                with no_sync(model, skip=micro < accum - 1), self.autocast:
                    held = self.anchor_logp(inputs, targets) if anchor > 0 else None
                    out = objective(model, inputs, targets, k, plain_mask=plain[0] if plain else None, generator=gen,
                                    z_loss=z_loss, latent_loss=cfg.train.latent_loss, distill=distill,
                                    anchor=anchor, anchor_logp=held, block_match=match)
                    (out.loss / accum).backward()
                with torch.no_grad():
                    sums[:k] += torch.stack(out.pass_losses).detach().float()
                    sums[k] += out.loss.detach().float()
                    sums[k + 1] += out.state.detach().float().pow(2).mean().sqrt()
                    if out.latent is not None:
                        sums[k + 2] += out.latent.detach().float()
                    if out.distill is not None:
                        sums[k + 3] += out.distill.detach().float()
                    if out.anchor is not None:
                        sums[k + 4] += out.anchor.detach().float()
                    if out.block_match is not None:
                        sums[k + 5] += out.block_match.detach().float()
        sums = all_reduce_mean(sums / accum, d)
        values = sums.tolist()
        bad = [j + 1 for j, v in enumerate(values[:k]) if not math.isfinite(v)]
        if not math.isfinite(values[k]) and not bad:
            bad = [0]
        if bad:
            self.optimizer.zero_grad(set_to_none=True)
            where = f"pass {bad[0]}" if bad[0] else "the z-loss term" + (" or the next-latent term"
                                                                          if cfg.train.latent_loss else "") + (
                " or the self-distillation term" if distill else "") + (" or the anchor's term" if anchor else "") + (
                " or the block-match term" if match else "")
            raise TrainingDiverged(f"non-finite loss at step {step + 1} in {where} (losses per pass: {values[:k]}); "
                                   f"stopped before applying it. {self.rundir.last_good()}. Try a lower learning rate "
                                   "(optim.lr / optim.adam_lr), more warmup, or gradient clipping (optim.grad_clip).")
        clip = cfg.optim.grad_clip or float("inf")  # 0: no clipping, the norm still measured
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(k=k, loss=values[k], pass_losses=values[:k], grad_norm=grad_norm, state_rms=values[k + 1],
                         loops=r, blend=blend, latent=values[k + 2], distill=values[k + 3], distill_weight=distill,
                         anchor=values[k + 4], anchor_weight=anchor, block_match=values[k + 5],
                         block_match_weight=match)

    @torch.no_grad()
    def anchor_logp(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The frozen starting model's next-token log-probabilities over the scored positions (N, V), read STANDARD
        (one plain pass), in float32 at least: the distribution train.anchor draws every pass towards."""
        return scored_log_probs(self.anchor(inputs, passes=1).logits, targets)

    # ------------------------------------------------------------------ validation
    def evaluate(self) -> dict[str, float]:
        """Mean validation NTP loss (nats/token) for each pass count in log.eval_passes (a model without feedback
        weights: one pass only, which is what any number of its passes would compute)."""
        feedback = self.cfg.model.has_feedback
        reads = {str(k): validation_loss(self.model, self.data.val_batches, k, autocast=self.autocast)
                 for k in self.cfg.log.eval_passes if k == 1 or feedback}
        self.eval_by_corpus, at = {}, 0  # data.shares: each entry's windows, in the order the batches hold them
        for name, n in self.data.val_sources:
            self.eval_by_corpus[name] = {k: float(r.per_window[at : at + n].mean()) for k, r in reads.items()}
            at += n
        self.eval_chats = {k: validation_loss(self.model, self.chat_batches, int(k), autocast=self.autocast).nats
                           for k in reads} if self.chat_batches else {}
        return {k: r.nats for k, r in reads.items()}

    def adapt(self) -> dict:
        """The adaptive schedule's measurement and decision: the pass map's perturbation growth per pass over
        `horizon` passes (eval.stability.contraction, as `fullband eval stability` measures it) and the fixed-point
        residual at `horizon`, on the first held-out windows; every rank takes the same values (the largest) and so
        the same next mix."""
        from fullband.eval.stability import contraction, pass_residuals

        sched, net = self.schedule, unwrap(self.model)
        inputs, _ = gate_windows(self.data.val_batches, sched.windows)  # the gate's first windows, read as PassMap does
        growth = contraction(net, inputs, horizons=(sched.horizon,), vectors=sched.vectors, power_iters=0).growth[0]
        residual = pass_residuals(net, inputs, (sched.horizon,))[sched.horizon]
        growth, residual = all_reduce_max(torch.tensor([growth, residual], dtype=torch.float64,
                                                       device=self.d.device), self.d).tolist()
        self.mix, action = sched.decide(self.mix, growth, residual)
        return {"growth": growth, "residual": residual, "action": action, "share": self.mix.share,
                "top": self.mix.top}

    def gate(self) -> dict | None:
        """The stability gate (fullband.eval.gate) on the first log.gate_windows validation windows, as a dict
        (None with log.gate_windows = 0). Every rank runs it on the same windows: an FSDP forward is collective."""
        if not self.cfg.log.gate_windows:
            return None
        inputs, plain = gate_windows(self.data.val_batches, self.cfg.log.gate_windows)
        return stability_gate(unwrap(self.model), inputs, plain_mask=plain, autocast=self.autocast).to_dict()

    # ------------------------------------------------------------------ the loop
    def weights_finite(self) -> bool:
        """Whether every parameter (every rank's shard) is finite."""
        bad = torch.zeros((), device=self.d.device)
        for p in self.model.parameters():
            local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
            bad = torch.maximum(bad, (~torch.isfinite(local)).any().float())
        return float(all_reduce_max(bad, self.d)) == 0.0

    def save(self) -> Path | None:
        """Write a checkpoint of the current step, unless the weights are no longer finite (an update can overflow
        while its loss was still finite): such a checkpoint is never written, and the last good one stays the
        newest. At the final step that ends the run with TrainingDiverged; before it, the next step's loss guard
        stops the run."""
        if not self.weights_finite():
            msg = (f"the weights are no longer finite after step {self.step} (the update overflowed); the checkpoint "
                   f"was not written. {self.rundir.last_good()}")
            if self.step == self.cfg.train.steps:
                raise TrainingDiverged(msg + ". Try a lower learning rate (optim.lr / optim.adam_lr) or gradient "
                                       "clipping (optim.grad_clip)")
            _print0(self.d, msg)
            return None
        state = {"tokens": self.tokens, "compute_tokens": self.compute_tokens, "flops": self.flops,
                 "elapsed": self.elapsed, "sampler": self.data.sampler.state_dict(), "config": self.cfg.to_dict()}
        if self.mix is not None:
            state["pass_mix"] = list(self.mix)
        return ckpt.save_checkpoint(self.run_dir, self.step, self.model, self.optimizer, state, d=self.d,
                                    tokenizer=self.data.tokenizer, keep_last=self.cfg.log.keep_last)

    def run(self) -> dict:
        """Train to the last step (from a resumed one); a Ctrl-C or SIGTERM stops after the step it is in, with a
        checkpoint."""
        d = self.d
        bar = progress_bar(self.cfg, d, self.step, self.cfg.train.steps)
        self.last_eval: dict[str, float] = {}
        self.eval_by_corpus: dict[str, dict[str, float]] = {}
        self.eval_chats: dict[str, float] = {}
        self.last_gate: dict | None = None
        self.started = time.monotonic()  # this invocation's (train.stop_after_minutes)
        try:
            with stop_after_step() as stop:
                self._loop(bar, stop)
        finally:
            if bar is not None:
                bar.close()
            if self.loggers:
                self.loggers.close()
        if d.main:
            with writing(self.run_dir / "loss.png", "plot the losses"):
                plot_metrics(self.run_dir / METRICS_FILE, self.run_dir / "loss.png")
        out = {"steps": self.step, "stopped": self.step < self.cfg.train.steps, "tokens": self.tokens,
               "compute_tokens": self.compute_tokens, "flops": self.flops, "elapsed": self.elapsed,
               "eval": self.last_eval, "gate": self.last_gate, "run_dir": str(self.run_dir)}
        if self.mix is not None:
            out["pass_mix"] = self.mix._asdict()
        return out

    def _loop(self, bar, stop) -> None:
        cfg, d = self.cfg, self.d
        total = cfg.train.steps
        tokens_per_step = cfg.train.global_batch_tokens
        while self.step < total:
            t0 = time.perf_counter()
            stats = self.train_step(self.step)
            dt = time.perf_counter() - t0
            mix = self.mix
            self.step += 1
            self.tokens += tokens_per_step
            self.compute_tokens += tokens_per_step * stats.k
            self.flops += self.step_flops(stats.k, stats.loops)
            self.elapsed += dt
            lr = {name: opt.param_groups[0]["lr"] for name, opt in self.optimizer.optimizers.items()
                  if opt.param_groups}
            row = {"step": self.step, "k": stats.k, "loss": stats.loss, "loss_pass": stats.pass_losses, "lr": lr,
                   "grad_norm": stats.grad_norm, "state_rms": stats.state_rms, "tokens": self.tokens,
                   "compute_tokens": self.compute_tokens, "flops": self.flops, "tok_per_s": tokens_per_step / dt,
                   "time": self.elapsed}
            if cfg.model.has_loop:
                row["loops"] = stats.loops
            if cfg.train.blend_until > 0:
                row["blend"] = stats.blend
            if mix is not None:  # the mix this step drew from, then (every `every` steps) the measurement
                row["mix"] = mix._asdict()
                if self.step % self.schedule.every == 0 and self.step < total:
                    row["adapt"] = self.adapt()
            if cfg.train.latent_loss > 0:
                row["latent_loss"] = stats.latent
            if cfg.train.distill > 0:
                row["distill"], row["distill_weight"] = stats.distill, stats.distill_weight
            if cfg.train.anchor > 0:
                row["anchor"], row["anchor_weight"] = stats.anchor, stats.anchor_weight
            if cfg.train.block_match > 0:
                row["block_match"], row["block_match_weight"] = stats.block_match, stats.block_match_weight
            if self.loggers:
                self.loggers.log(row)
            if bar is not None:
                bar.set_postfix(loss=f"{stats.loss:.3f}", pass1=f"{stats.pass_losses[0]:.3f}", k=stats.k,
                                tok_s=f"{tokens_per_step / dt:,.0f}")  # loss: the objective, as metrics.jsonl
                bar.update(1)
            done = self.step == total
            if (cfg.log.eval_every and self.step % cfg.log.eval_every == 0) or done:
                self.last_eval = last_eval = self.evaluate()
                self.last_gate = gate = self.gate()
                if self.loggers:
                    extra = {"gate": gate, "eval_by_corpus": self.eval_by_corpus, "eval_chats": self.eval_chats}
                    self.loggers.log({"step": self.step, "eval": last_eval, "tokens": self.tokens, "flops": self.flops}
                                     | {k: v for k, v in extra.items() if v})
                msg = "  ".join(f"passes={k}: {v:.4f}" for k, v in last_eval.items())
                also = list(self.eval_by_corpus.items()) + ([("chats", self.eval_chats)] if self.eval_chats else [])
                msg += "".join(f"; {name}: " + " / ".join(f"{v:.4f}" for v in by.values()) for name, by in also)
                msg += f"; {gate['summary']}" if gate else ""
                (bar.write if bar is not None else (lambda s: _print0(d, s)))(f"step {self.step}: val loss {msg}")
            due = (cfg.log.ckpt_every and self.step % cfg.log.ckpt_every == 0) or done
            path = self.save() if due else None
            if done:
                continue
            interrupted = stop.agreed(d)  # Ctrl-C or SIGTERM
            if interrupted or self.out_of_time():  # this step is whole: keep it, then stop
                path = path or (None if due else self.save())
                if interrupted:
                    _print0(d, self.rundir.interrupted(self.step, path, "train"))
                    raise stop.stopped()
                _print0(d, self.rundir.out_of_time(self.step, total, cfg.train.stop_after_minutes, path))
                return

    def out_of_time(self) -> bool:
        """Whether train.stop_after_minutes of wall time have passed in this invocation (rank 0's clock decides, so
        every rank stops after the same step)."""
        limit = self.cfg.train.stop_after_minutes
        if not limit:
            return False
        late = torch.tensor(float(time.monotonic() - self.started >= 60 * limit), device=self.d.device)
        return float(broadcast0(late, self.d)) > 0

    def close(self, *, finished: bool = True) -> None:
        self.rundir.release()
        if finished:  # the DDP wrapper holds the process group: let it go here, on every rank, so that the group's
            self.model = unwrap(self.model)  # teardown happens inside shutdown's destroy, after its barrier, and not
            if self.d.world > 1:  # whenever each rank's Trainer is freed (a late rank's teardown hung once, its peer
                gc.collect()  # gone); one process holds no group (a full collection costs ~0.25 s a run)
        shutdown(self.d, finished=finished)


def step_estimate(cfg: RunConfig, device, *, passes: int | None = None, checkpointing: bool | None = None):
    """train.memory.step_memory of the run's largest step on `device` (its micro-batch, optimizer, autocast dtype,
    the weights it trains; `passes` / `checkpointing` in place of the recipe's schedule / setting)."""
    from fullband.train.build import trained_weights
    from fullband.train.memory import step_memory

    t = cfg.train
    bf16 = t.dtype == "bfloat16" or (t.dtype == "auto" and getattr(device, "type", "cpu") == "cuda")
    return step_memory(cfg.model, passes=t.schedule.max_passes if passes is None else passes,
                       tokens=t.micro_batch * t.seq_len, optimizer=cfg.optim.name, dtype_bytes=2 if bf16 else 4,
                       checkpointing=t.activation_checkpointing if checkpointing is None else checkpointing,
                       trained=trained_weights(cfg), anchor=t.anchor > 0)


def say_memory(cfg: RunConfig, device) -> None:
    """Print the estimated memory of the run's largest step and what is available; warn when it may not fit."""
    import warnings

    from fullband.errors import FullbandWarning
    from fullband.train.memory import GB, available_memory

    est = step_estimate(cfg, device)
    free = available_memory(device)
    print(f"memory: {est.describe(cfg.optim.name)}"
          + (f"; {free / GB:.1f} GB available" if free is not None else ""), flush=True)
    if free is not None and est.total > free:
        said = (f"the largest step may not fit: about {est.total / GB:.1f} GB against {free / GB:.1f} GB available; "
                "lower train.micro_batch (gradient accumulation keeps the global batch) or set "
                "train.activation_checkpointing = true")
        if cfg.train.memory_check:
            raise ConfigError(f"{said} (train.memory_check = false goes on anyway)")
        warnings.warn(said, FullbandWarning, stacklevel=2)


def train(cfg: RunConfig, *, resume: str | Path | None = None) -> dict:
    """Run (or resume) `cfg`; the run sets torch's threads (train.threads) and gives the caller its count back."""
    trainer = Trainer(cfg, resume=resume)
    try:
        result = trainer.run()
    except BaseException:
        trainer.close(finished=False)
        raise
    trainer.close()
    return result


def _autocast(dtype: str, device: torch.device):
    """The micro-batch's autocast (benchmarks/gpu_check.py runs its steps in it too)."""
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
