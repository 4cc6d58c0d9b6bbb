"""Speed on a real model's shapes (`fullband bench decode --model X`, `fullband bench train --model X`): a GGUF file,
a transformers Llama folder or a fullband folder, against transformers on the same weights and against the
machine's own bounds, every variant of a cell timed side by side (interleaved repetitions, medians) in one process.

Decode, per thread count and batch: fullband STANDARD / SOFT / FUSED k, transformers' generate, the chain of the
model's own weight mat-vecs (torch's kernels, nothing else) and the streaming read of the weights a decode step
reads (a sum over every weight byte: the machine's memory bound at batch 1). Training: forward + backward of the
k-pass objective (k = 1, 2, 3) against transformers' own forward + backward (labels) of the same model and batch."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from fullband.bench.decode import (decode_timer, decode_weights, hf_timer, matmul_chain, paired_soft_overhead,
                                   same_shape_llama, theory_overhead, timed, timed_rounds)
from fullband.machine import hardware

MB = 2**20


def load_pair(spec: str | Path):
    """(native FullbandLM, transformers model or None, what was loaded): a GGUF file or Llama folder gives both (the
    native model by `fullband convert`'s conversion, its fusion fresh); a fullband folder gives its model only."""
    from fullband.hf.convert import detect
    from fullband.gguf_file import is_gguf
    from fullband.hf.gguf import load_causal_lm
    from fullband.hf.llama import from_llama
    from fullband.loader import load_model

    kind = detect(spec)
    if kind in ("gguf", "llama"):
        hf = load_causal_lm(spec).eval()
        return from_llama(hf).eval(), hf, f"{spec} ({'GGUF file' if is_gguf(spec) else 'Llama folder'})"
    return load_model(spec).eval(), None, f"{spec} ({kind} folder)"


def model_config(spec: str | Path):
    """The ModelConfig a real-model benchmark will build, read without loading any weight: a fullband folder's own,
    or the one `fullband convert` gives a GGUF file or Llama folder (its header checked first)."""
    from fullband.folder import read_config
    from fullband.hf.convert import detect
    from fullband.hf.gguf import pretrained_config, require_native
    from fullband.hf.llama import config_from_llama

    kind = detect(spec)
    if kind == "gguf":  # another architecture is refused by name, before transformers reads it
        require_native(spec, use="bench --model")
    if kind in ("gguf", "llama"):
        return config_from_llama(pretrained_config(spec))
    return read_config(spec)


def check_model_sizes(spec: str | Path, *, what: str, batches=(1,), prompt_len: int = 0, new_tokens: int = 0,
                      seq_len: int = 0, passes=(1,)) -> None:
    """Refuse, before the model is loaded, a benchmark of `spec` whose sequences exceed its context or whose
    largest step or decode batch would not fit in memory (as bench cost refuses them): one line naming the flag."""
    from fullband.bench.cost import cost_memory
    from fullband.errors import InputError
    from fullband.train.memory import check_fits

    cfg = model_config(spec)
    for name, value in (("--seq-len", seq_len), ("--prompt-len + --new-tokens", prompt_len + new_tokens)):
        if value > cfg.max_seq_len:
            raise InputError(f"{name} = {value:,} exceeds the model's context (max_seq_len={cfg.max_seq_len:,}); "
                             f"accepted: at most {cfg.max_seq_len:,}")
    check_fits(cost_memory(cfg, passes=passes, batch=max(batches), seq_len=max(seq_len, 1), prompt_len=prompt_len,
                           new_tokens=new_tokens, decode_batches=batches, dtype="float32"), what,
               smaller="--batch-sizes, --batch, --seq-len, --prompt-len, --new-tokens")


def stream_read(weights: list[torch.Tensor]) -> Callable[[], float]:
    """Seconds to read every byte of `weights` once (a sum per tensor: the memory system's streaming read)."""

    def run() -> None:
        with torch.inference_mode():
            for w in weights:
                w.sum()

    return timed(run)


def run_model_decode(spec: str, *, batches=(1, 8), threads=(1, 2), prompt_len: int = 32, new_tokens: int = 128,
                     prefill_passes: int = 1, repeats: int = 5, hf: bool = True, pairs: int = 400, log=print) -> dict:
    """The decode table of a real model (module docstring). Tokens/s are decode steps only (prefill excluded) for
    fullband, end to end for transformers' generate (its prefill is one forward of a short prompt); SOFT's overhead
    over STANDARD from `pairs` paired decode steps per cell (bench.decode.paired_soft_overhead)."""
    check_model_sizes(spec, what="bench decode --model", batches=batches, prompt_len=prompt_len,
                      new_tokens=new_tokens)
    model, hf_model, what = load_pair(spec)
    if hf and hf_model is None:
        hf_model = same_shape_llama(model.config, tie=model.config.tie_embeddings)
    fused = f"fused k={prefill_passes}"
    weights = decode_weights(model)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    rows, paired = [], {}
    before = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    try:
        for n in threads:
            torch.set_num_threads(n)
            for batch in batches:
                prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g)
                timers = {"standard": decode_timer(model, prompts, new_tokens, "standard", 0),
                          "soft": decode_timer(model, prompts, new_tokens, "soft", 0),
                          fused: decode_timer(model, prompts, new_tokens, "fused", prefill_passes)}
                chain, read = matmul_chain(model, batch), stream_read(weights)
                hf_run = hf_timer(hf_model, prompts, new_tokens) if hf_model is not None else None
                log(f"[bench] {n} thread(s), batch {batch}: warm-up")
                times = timed_rounds({**timers, "chain": chain, "read": read, "hf": hf_run}, repeats, log,
                                     f"{n} thread(s), batch {batch}")
                paired[f"t{n}/b{batch}"] = paired_soft_overhead(model, prompts, pairs)
                steps = new_tokens - 1
                cell = dict(threads=n, batch=batch)
                for name in timers:
                    dec = statistics.median(d for _, d in times[name])
                    pre = statistics.median(p for p, _ in times[name])
                    rows.append({**cell, "variant": f"fullband {name}", "tokens_per_s": batch * steps / dec,
                                 "prefill_ms": 1000 * pre})
                if times["hf"]:
                    rows.append({**cell, "variant": "transformers generate",
                                 "tokens_per_s": batch * new_tokens / statistics.median(times["hf"])})
                rows.append({**cell, "variant": "weight mat-vec chain (torch)",
                             "tokens_per_s": batch / statistics.median(times["chain"])})
                t = statistics.median(times["read"])
                rows.append({**cell, "variant": "streaming read of the weights", "tokens_per_s": batch / t,
                             "gb_per_s": nbytes / t / 1e9})
    finally:
        torch.set_num_threads(before)
    return {"model": what, "machine": hardware(), "params": sum(p.numel() for p in model.parameters()),
            "weight_bytes_per_step": nbytes, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "theory_soft_overhead": theory_overhead(model.config), "rows": rows,
            "soft_overhead_paired_steps": paired}


def format_model_decode(result: dict) -> str:
    lines = [f"{result['model']}: {result['params'] / 1e6:.1f}M parameters, {result['weight_bytes_per_step'] / MB:.0f} "
             f"MiB of weights read per decode step; {result['machine']}",
             f"prompt {result['prompt_len']} tokens, {result['new_tokens']} new tokens, float32",
             f"{'threads':>7} {'batch':>5}  {'variant':<32} {'tok/s':>8} {'of the read bound':>17}"]
    bound = {(r["threads"], r["batch"]): r["tokens_per_s"] for r in result["rows"]
             if r["variant"] == "streaming read of the weights"}
    for r in result["rows"]:
        share = r["tokens_per_s"] / bound[(r["threads"], r["batch"])]
        extra = f"  ({r['gb_per_s']:.1f} GB/s)" if "gb_per_s" in r else ""
        lines.append(f"{r['threads']:>7} {r['batch']:>5}  {r['variant']:<32} {r['tokens_per_s']:>8.1f} "
                     f"{share:>16.2f}x{extra}")
    lines.append(f"SOFT over STANDARD, theory (2 D^2 / weights read per token): {100 * result['theory_soft_overhead']:+.2f}%")
    for key, value in result["soft_overhead_paired_steps"].items():
        lines.append(f"SOFT over STANDARD, alternating decode steps ({key}): {100 * value:+.2f}%")
    return "\n".join(lines)


# ---------------------------------------------------------------------- training steps
def run_model_steps(spec: str, *, batch: int = 4, seq_len: int = 256, passes=(1, 2, 3), repeats: int = 3,
                    log=print) -> dict:
    """Forward + backward of the objective (jitter and prefix mixin on, as training runs it) for each k in
    `passes`, against transformers' own forward + backward with labels on the same model (a GGUF file or Llama
    folder; a same-shape random Llama for a fullband folder), interleaved, medians; no optimizer step."""
    from fullband.model.objective import objective

    check_model_sizes(spec, what="bench train --model", batches=(batch,), seq_len=seq_len, passes=passes)
    model, hf, what = load_pair(spec)
    hf = hf if hf is not None else same_shape_llama(model.config, tie=model.config.tie_embeddings)
    model.train()
    hf.train()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=g)
    y = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=g)

    def ours(k: int) -> Callable[[], None]:
        def run() -> None:
            out = objective(model, x, y, k, generator=torch.Generator().manual_seed(k))
            out.loss.backward()
            model.zero_grad(set_to_none=True)
        return run

    def theirs() -> None:
        hf(input_ids=x, labels=y).loss.backward()
        hf.zero_grad(set_to_none=True)

    fns = {"transformers": theirs, **{f"k={k}": ours(k) for k in passes}}
    times = timed_rounds({name: timed(fn) for name, fn in fns.items()}, repeats, log, "training steps")
    base = statistics.median(times["transformers"])
    rows = [{"variant": name, "seconds": statistics.median(t), "vs_transformers": statistics.median(t) / base,
             "passes": 1 if name == "transformers" else int(name[2:])} for name, t in times.items()]
    from fullband.machine import keeps_freed_memory

    return {"model": what, "machine": hardware(), "threads": torch.get_num_threads(), "batch": batch,
            "seq_len": seq_len, "rows": rows, "freed_memory_kept": keeps_freed_memory()}


def format_model_steps(result: dict) -> str:
    lines = [f"{result['model']}: forward + backward of {result['batch']} x {result['seq_len']} tokens, "
             f"{result['threads']} threads; {result['machine']}"
             + ("" if result["freed_memory_kept"] else " (glibc returning freed memory: see fullband.machine)"),
             f"{'variant':<14} {'s/step':>7} {'x transformers':>15} {'per pass':>9}  goal"]
    for r in result["rows"]:
        goal = "" if r["variant"] == "transformers" else f"<= {1.03 * r['passes']:.2f}x"
        lines.append(f"{r['variant']:<14} {r['seconds']:>7.2f} {r['vs_transformers']:>14.3f}x "
                     f"{r['vs_transformers'] / r['passes']:>8.3f}x  {goal}")
    return "\n".join(lines)
