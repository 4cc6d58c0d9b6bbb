"""Cost of a method against its standard counterpart (the same width and depth with fusion = "none", no looped
group and no ponder slots): parameters added, FLOPs counted (fullband.model.flops) and time measured, for training,
decoding and prefill, in one table.

Every timing is a ratio of two variants measured side by side in this process, taking turns (A B A B ...), the
median of each; the table gives ratios to standard, never absolute times (the JSON keeps the medians)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from fullband.bench.decode import decode_timer, timed_rounds
from fullband.errors import InputError
from fullband.machine import hardware
from fullband.model import flops
from fullband.model.config import ModelConfig
from fullband.model.decoder import FullbandLM
from fullband.model.mode import DecodeMode
from fullband.model.objective import objective
from fullband.train.memory import check_fits, model_bytes, step_memory


def standard_of(cfg: ModelConfig) -> ModelConfig:
    """The standard transformer of the same width and depth: no fusion, nothing fed back, every block once per
    token (no looped group) and one position per token (no ponder slots)."""
    return cfg.replace(fusion="none", feedback_source=None, feedback_target=0, loop_start=None, loop_stop=None,
                       loops=1, loop_train="fixed", ponder=False)


def modes_of(cfg: ModelConfig, fused_passes: int) -> list[DecodeMode]:
    """The decoding modes timed for `cfg`: STANDARD, SOFT, FUSED k=fused_passes and EXACT, less those it cannot run
    (DecodeMode.check: without fusion weights STANDARD alone; a ponder model FUSED and EXACT, its own)."""
    runs = []
    for mode in (DecodeMode("standard"), DecodeMode("soft"), DecodeMode("fused", fused_passes), DecodeMode("exact")):
        with contextlib.suppress(InputError):
            runs.append(mode.check(cfg))
    return runs


def _train_timer(model: FullbandLM, ids: torch.Tensor, passes: int) -> Callable[[], float]:
    """A callable timing one training step's forward + backward of the k-pass objective (seconds); the optimizer's
    update is per parameter, not per token, and left out."""
    generator = torch.Generator().manual_seed(0)
    targets = ids.roll(-1, 1)

    def run() -> float:
        t0 = time.perf_counter()
        objective(model, ids, targets, passes, generator=generator).loss.backward()
        dt = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        return dt

    return run


def cost_memory(cfg: ModelConfig, *, passes: Sequence[int], batch: int, seq_len: int, prompt_len: int,
                new_tokens: int, decode_batches: Sequence[int], dtype: str) -> dict[str, float]:
    """Bytes run_cost_bench holds at its peak, by part: both models (built in float32), the method's training step
    at the most passes (its gradients and the activations the backward keeps: train.memory.step_memory) and its
    largest decode batch (KV cache over prompt + new tokens, and a prefill pass's activations and logits)."""
    size = flops.DTYPE_BYTES[dtype]
    step = step_memory(cfg, passes=max(passes), tokens=batch * seq_len, dtype_bytes=size)
    rows = max(decode_batches) * cfg.slots_per_token
    decode = (max(decode_batches) * (prompt_len + new_tokens) * flops.kv_bytes_per_token(cfg, dtype)
              + rows * prompt_len * (10 * cfg.d_model + 4 * cfg.d_ff + 2 * cfg.vocab_size) * size)
    return {"models": model_bytes(cfg) + model_bytes(standard_of(cfg)),
            "training step": step.gradients + step.activations, "decode": decode}


def run_cost_bench(cfg: ModelConfig, *, passes: Sequence[int] = (1, 2, 3), schedule: str | None = None,
                   batch: int = 8, seq_len: int = 128, prompt_len: int = 32, new_tokens: int = 32,
                   decode_batches: Sequence[int] = (1, 8), fused_passes: int = 1, repeats: int = 7,
                   dtype: str = "float32", seed: int = 0, progress: bool | None = None) -> dict:
    """Counted and measured cost of `cfg` against standard_of(cfg); see format_cost_report for the table."""
    from tqdm.auto import tqdm

    std_cfg = standard_of(cfg)
    _check_cost(cfg, passes=passes, batch=batch, seq_len=seq_len, prompt_len=prompt_len, new_tokens=new_tokens,
                decode_batches=decode_batches, fused_passes=fused_passes, dtype=dtype)
    schedule_row = _schedule_row(cfg, schedule, seq_len) if schedule else None  # counted, before anything is timed
    torch.manual_seed(seed)
    method = FullbandLM(cfg).to(getattr(torch, dtype))
    standard = FullbandLM(std_cfg).to(getattr(torch, dtype))
    modes = modes_of(cfg, fused_passes)
    rounds = repeats + 1
    total = rounds * (len(passes) + 1 + len(decode_batches) * (1 + len(modes)))
    bar = tqdm(total=total, desc="bench cost", unit="run", disable=(None if progress is None else not progress),
               dynamic_ncols=True)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    train_rows = _train_rows(method.train(), standard.train(), ids, passes, repeats, bar.update)
    if schedule_row:
        train_rows.append(schedule_row)
    context = prompt_len + new_tokens // 2  # the keys a generated token sees, on average over the run
    decode_rows, prefill_rows = [], []
    standard.eval(), method.eval()
    for b in decode_batches:
        prompts = torch.randint(0, cfg.vocab_size, (b, prompt_len))
        decode, prefill = _decode_rows(method, standard, modes, prompts, new_tokens, context, repeats, bar.update)
        decode_rows += decode
        prefill_rows += prefill
    bar.close()
    for rows in (train_rows, decode_rows, prefill_rows):
        for row in rows:
            row["flops_vs_standard"] = row["flops_per_token"] / rows[0]["flops_per_token"]
    return {"hardware": hardware(), "config": cfg.to_dict(), "dtype": dtype, "threads": torch.get_num_threads(),
            "params": flops.param_count(cfg), "params_standard": flops.param_count(std_cfg),
            "params_added": flops.fusion_params(cfg), "kv_bytes_per_token": flops.kv_bytes_per_token(cfg, dtype),
            "kv_bytes_per_token_standard": flops.kv_bytes_per_token(std_cfg, dtype),
            "state_bytes_per_row": flops.state_bytes_per_row(cfg, dtype), "batch": batch, "seq_len": seq_len,
            "prompt_len": prompt_len, "new_tokens": new_tokens, "decode_context": context, "repeats": repeats,
            "rows": train_rows, "decode": decode_rows, "prefill": prefill_rows}


def _check_cost(cfg: ModelConfig, *, passes: Sequence[int], seq_len: int, prompt_len: int, new_tokens: int,
                fused_passes: int, **sizes) -> None:
    """Refuse, before anything is built, what run_cost_bench cannot measure or what would not fit in memory
    (`sizes`: cost_memory's other keywords)."""
    if not cfg.has_feedback and any(k > 1 for k in passes):
        raise InputError(f"--passes {' '.join(map(str, passes))}: fusion='none' trains with one pass only; "
                         "accepted: --passes 1, or a config with a fusion")
    for name, value, cap in (("--seq-len", seq_len, cfg.max_seq_len),
                             ("--prompt-len + --new-tokens", prompt_len + new_tokens, cfg.max_seq_len)):
        if value > cap:
            raise InputError(f"{name} = {value} exceeds max_seq_len={cap}; accepted: at most {cap}")
    most = cfg.exact_passes(cfg.max_seq_len)  # as generate caps its passes: past the fixed point nothing changes
    if max(passes) > most:
        raise InputError(f"--passes {max(passes)} is above the cap of {most}: a sequence of max_seq_len="
                         f"{cfg.max_seq_len} positions is exact after {most} passes, so more cannot change anything; "
                         f"accepted: 1 <= passes <= {most}")
    DecodeMode("fused", fused_passes).check(cfg, weights=False)  # its cap, said (not the mode silently left out)
    check_fits(cost_memory(cfg, passes=passes, seq_len=seq_len, prompt_len=prompt_len, new_tokens=new_tokens,
                           **sizes), "bench cost",
               smaller="--set d_model / n_layers / d_ff / vocab_size, --batch, --seq-len, --passes, --batch-sizes")


def _schedule_row(cfg: ModelConfig, schedule: str, seq_len: int) -> dict:
    """The training row of a pass schedule (train.passes): its mean passes' FLOPs, counted, not timed."""
    from fullband.train.schedule import PassSchedule

    mean = PassSchedule.parse(schedule).mean_passes()
    try:
        cost = flops.train_flops(cfg, mean, seq_len=seq_len)
    except ValueError as err:
        raise InputError(f"--schedule {schedule}: {err}") from None
    return {"variant": schedule, "passes": mean, "step_s": None, "time_vs_standard": None, "flops_per_token": cost}


def _train_rows(method: FullbandLM, standard: FullbandLM, ids: torch.Tensor, passes: Sequence[int], repeats: int,
                tick: Callable[[], None]) -> list[dict]:
    """The training step of the standard model and of the method at each k, timed taking turns on `ids`."""
    seq_len = ids.shape[1]
    timers = {"standard model": _train_timer(standard, ids, 1)}
    timers.update({f"k={k}": _train_timer(method, ids, k) for k in passes})
    times = timed_rounds(timers, repeats, alternate=True, tick=tick)
    base = statistics.median(times["standard model"])
    rows = [{"variant": "standard model", "passes": 1.0,
             "flops_per_token": flops.train_flops(standard.config, 1, seq_len=seq_len), "step_s": base,
             "time_vs_standard": 1.0}]
    for k in passes:  # FLOPs at a run's mean r (train_loops); the timed step runs r = loops
        t = statistics.median(times[f"k={k}"])
        rows.append({"variant": f"k={k}", "passes": float(k), "step_s": t, "time_vs_standard": t / base,
                     "flops_per_token": flops.train_flops(method.config, k, seq_len=seq_len)})
    return rows


def _decode_rows(method: FullbandLM, standard: FullbandLM, modes: list[DecodeMode], prompts: torch.Tensor,
                 new_tokens: int, context: int, repeats: int, tick: Callable[[], None]) -> tuple[list, list]:
    """Decoding and prefill of `prompts` by the standard model and by the method in each mode, timed taking turns:
    (decode rows, prefill rows); decode FLOPs at `context` keys."""
    b, prompt_len = prompts.shape
    variants = [("standard model", standard, DecodeMode("standard")),
                *((m.label.replace(m.name, m.name.upper(), 1), method, m) for m in modes)]
    timers = {name: decode_timer(model, prompts, new_tokens, m.name, m.prefill_passes) for name, model, m in variants}
    times = timed_rounds(timers, repeats, alternate=True, tick=tick)
    pre = {name: statistics.median(p for p, _ in ts) for name, ts in times.items()}
    dec = {name: statistics.median(d for _, d in ts) / (new_tokens - 1) for name, ts in times.items()}
    decode = [{"batch": b, "variant": name, "step_s": dec[name],
               "flops_per_token": flops.decode_flops(model.config, mode, context),
               "time_vs_standard": dec[name] / dec["standard model"]} for name, model, mode in variants]
    prefill = [{"batch": b, "variant": name, "prefill_s": pre[name],
                "flops_per_token": flops.prefill_flops(model.config, mode, prompt_len),
                "time_vs_standard": pre[name] / pre["standard model"]} for name, model, mode in variants]
    return decode, prefill


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_cost_report(result: dict) -> str:
    c = result["config"]
    where = ("" if c["feedback_source"] is None and c["feedback_target"] == 0
             else f", state from block {c['feedback_source']} into block {c['feedback_target']}")
    if c.get("loop_start") is not None:
        where += f", blocks [{c['loop_start']}, {c['loop_stop']}) looped {c['loops']} times"
    if c.get("ponder"):
        where += ", ponder slots (PonderLM-2)"
    lines = [f"cost of fusion={c['fusion']!r}{where} vs standard (fusion='none'): D {c['d_model']}, {c['n_layers']} "
             f"layers, {c['n_heads']} heads ({c['n_kv_heads']} kv), d_ff {c['d_ff']}, vocab {c['vocab_size']}, "
             f"{result['dtype']}",
             f"machine: {result['hardware']}",
             "FLOPs counted (matrix products, multiply-add = 2, backward = 2x forward); times measured, alternated "
             f"with standard's, median of {result['repeats']}, as ratios",
             f"parameters: standard {result['params_standard']:,}, method {result['params']:,}, added "
             f"{result['params_added']:,} (+{100 * result['params_added'] / result['params_standard']:.2f}%)",
             f"KV cache: {result['kv_bytes_per_token']:,} bytes/token (standard "
             f"{result['kv_bytes_per_token_standard']:,}); a feedback mode also carries "
             f"{result['state_bytes_per_row']:,} bytes of state per row",
             "",
             f"training step (batch {result['batch']} x {result['seq_len']} tokens, forward + backward)",
             f"  {'variant':<16} {'passes':>6} {'MFLOP/token':>12} {'FLOPs vs std':>12} {'time vs std':>11}"]
    for r in result["rows"]:
        lines.append(f"  {r['variant']:<16} {r['passes']:>6.2f} {r['flops_per_token'] / 1e6:>12.3f} "
                     f"{r['flops_vs_standard']:>12.2f} {_ratio(r['time_vs_standard']):>11}")
    for key, title, unit in (("decode", f"decode per token (prompt {result['prompt_len']}, {result['new_tokens']} new; "
                                        f"FLOPs at {result['decode_context']} keys)", "per token"),
                             ("prefill", f"prefill of the {result['prompt_len']}-token prompt", "per prompt token")):
        lines += ["", title, f"  {'batch':>5} {'variant':<16} {'MFLOP ' + unit:>20} {'FLOPs vs std':>12} "
                             f"{'time vs std':>11}"]
        for r in result[key]:
            lines.append(f"  {r['batch']:>5} {r['variant']:<16} {r['flops_per_token'] / 1e6:>20.3f} "
                         f"{r['flops_vs_standard']:>12.2f} {_ratio(r['time_vs_standard']):>11}")
    return "\n".join(lines)
