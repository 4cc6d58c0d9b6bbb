"""SOFT decoding on llama.cpp's engine against llama.cpp's own STANDARD decoding of the same file and against
fullband.generate on the same weights: batch 1, greedy, decode tokens per second, side by side in one run.

Run in .venv-llama (make llama-env), from a native model folder (default: the shipped SmolLM2 converted here):

  .venv-llama/bin/python benchmarks/llamacpp_soft.py [--model DIR] [--threads 1 2] [--types F32 F16 Q8_0]

Rows, per GGUF type and thread count (medians over --repeats, the rows interleaved within each repeat):
  llama.cpp STANDARD     llama.cpp's own loop: token ids in, argmax of its logits, one llama_decode per token
  llama.cpp SOFT         fullband.generate(LlamaCppModel, mode="soft"): the host loop (fusion, one round trip)
  llama.cpp STANDARD (fullband)   the same host loop without feedback
  llama.cpp SOFT (minimal host loop)   the core's fusion and one decode per token, no decode engine: the floor
  fullband SOFT / STANDARD        fullband.generate on the native float32 model (F32 rows only)
The ratios are what to read; the machine (CPU model, load) is printed and written with them. "ms/token over it" is
each row's time per token minus llama.cpp's own loop's: the host's cost per token (SOFT minus the fullband loop's
STANDARD is the fusion's; the fullband loop's STANDARD minus llama.cpp's own is the generic decode step's), about
constant across files, so its share grows as a llama.cpp step shortens."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def own_standard(engine, prompt: list[int], new: int) -> float:
    """llama.cpp's own greedy loop on the engine's context: token ids in -> decode tokens per second."""
    L, ctx = engine._L, engine._ctx
    L.llama_memory_clear(engine._mem, True)
    b = L.llama_batch_init(len(prompt), 0, 1)
    try:
        for i, t in enumerate(prompt):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, i, 1, int(i == len(prompt) - 1)
            b.seq_id[i][0] = 0
        b.n_tokens = len(prompt)
        L.llama_decode(ctx, b)
        V = engine.config.vocab_size
        start = time.perf_counter()
        for s in range(new):
            token = int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(V,)).argmax())
            b.token[0], b.pos[0], b.n_seq_id[0], b.logits[0], b.n_tokens = token, len(prompt) + s, 1, 1, 1
            b.seq_id[0][0] = 0
            L.llama_decode(ctx, b)
        return new / (time.perf_counter() - start)
    finally:
        L.llama_batch_free(b)


@torch.no_grad()
def minimal_soft(engine, prompt: list[int], new: int) -> float:
    """The floor of a host loop: greedy SOFT as the core's read of the prompt and then its step (one fused input,
    one llama.cpp decode) per token, and nothing else (no decode engine: no stops, samplers or steps handed out)
    -> decode tokens per second."""
    from fullband.model.mode import DecodeMode

    cache = engine.new_cache(1, len(prompt) + new)
    state = engine.read(torch.tensor([prompt]), DecodeMode("soft"), cache=cache).hidden[:, -1]
    logits = engine.head(state)
    start = time.perf_counter()
    for s in range(new):
        position = len(prompt) + s
        state, top = engine.step(logits.argmax(-1), torch.tensor([position]), cache, prev=state, kv_len=position + 1)
        logits = engine.head(top)
    return new / (time.perf_counter() - start)


def timed(model, prompt: list[int], new: int, mode: str) -> float:
    """fullband.generate's decode tokens per second (the prompt read timed apart: one extra token's run)."""
    from fullband import generate

    start = time.perf_counter()
    generate(model, [prompt], 1, mode=mode)
    read = time.perf_counter() - start
    start = time.perf_counter()
    generate(model, [prompt], new + 1, mode=mode)
    return new / max(time.perf_counter() - start - read, 1e-9)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a native model folder (default: the shipped SmolLM2, converted)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--types", nargs="+", default=["F32", "F16", "Q8_0"])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    load_start = os.getloadavg()
    from fullband import load_model
    from fullband.data.tokenizer import load_tokenizer
    from fullband.hf.convert import convert
    from fullband.llamacpp import LlamaCppModel, export_gguf
    from fullband.machine import cpu_model

    work = Path(tempfile.mkdtemp(prefix="llamacpp-soft-"))
    folder = Path(args.model) if args.model else work / "native"
    if not args.model:
        from fullband.gguf_file import shipped_gguf

        convert(shipped_gguf(), folder)
    native, tok = load_model(folder).eval(), load_tokenizer(folder)
    text = "The history of the Roman Empire spans many centuries, from the founding of the city"
    prompt = (tok.encode(text) * args.prompt_len)[: args.prompt_len]
    rows = []
    for kind in args.types:
        path = export_gguf(native, work / f"model-{kind}.gguf", tokenizer=tok, dtype=kind)
        for threads in args.threads:
            torch.set_num_threads(threads)
            engine = LlamaCppModel(path, threads=threads, n_ctx=args.prompt_len + args.new_tokens + 8)
            runs = {"llama.cpp STANDARD": lambda: own_standard(engine, prompt, args.new_tokens),
                    "llama.cpp SOFT": lambda: timed(engine, prompt, args.new_tokens, "soft"),
                    "llama.cpp STANDARD (fullband loop)": lambda: timed(engine, prompt, args.new_tokens, "standard"),
                    "llama.cpp SOFT (minimal host loop)": lambda: minimal_soft(engine, prompt, args.new_tokens)}
            if kind == "F32":
                runs["fullband SOFT"] = lambda: timed(native, prompt, args.new_tokens, "soft")
                runs["fullband STANDARD"] = lambda: timed(native, prompt, args.new_tokens, "standard")
            seen: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.repeats):
                for name, run in runs.items():
                    seen[name].append(run())
            engine.close()
            base = statistics.median(seen["llama.cpp STANDARD"])
            for name, values in seen.items():
                tok_s = statistics.median(values)
                rows.append({"type": kind, "threads": threads, "row": name, "tok_s": tok_s,
                             "vs_llama_cpp_standard": tok_s / base, "ms_per_token_over": 1e3 / tok_s - 1e3 / base})
    machine = {"cpu": cpu_model(), "load_start": load_start, "load": os.getloadavg(), "torch": torch.__version__,
               "llama_cpp": __import__("llama_cpp").__version__}
    print(f"# {machine['cpu']}; load {load_start[0]:.2f} at the start, {machine['load'][0]:.2f} at the end; prompt {args.prompt_len}, {args.new_tokens} new "
          f"tokens, batch 1, greedy, median of {args.repeats}")
    print("| type | threads | row | tok/s | vs llama.cpp STANDARD | ms/token over it |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['type']} | {r['threads']} | {r['row']} | {r['tok_s']:.1f} | {r['vs_llama_cpp_standard']:.3f} | "
              f"{r['ms_per_token_over']:+.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
