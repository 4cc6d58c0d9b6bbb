"""fullband inside vLLM: decode throughput ratios, measured side by side in one run (`make bench-vllm`).

  1. SOFT vs STANDARD inside vLLM, batch 1 and batch 32 (one engine: the mode is per request), against theory:
     SOFT adds the fusion's 2·D² weights to those read per generated token.
  2. fullband's model in STANDARD mode vs vLLM's own LlamaForCausalLM on the same weights (a random Llama at the
     same shape, converted with `fullband convert`).
  3. vLLM at 32 concurrent requests vs `fullband.generate` at batch 32 (SOFT).
  4. Prefix caching in every mode: requests sharing a 512-token prefix (distinct 16-token suffixes), one engine
     with caching on and one with it off: the share of prompt tokens read from cached blocks, and the time to the
     first token (a request of one new token: its prefill) with caching on / off.

Every ratio is the median over interleaved repetitions (A B A B ...), so it holds on a noisy shared machine.
Run with the vLLM environment: .venv-vllm/bin/python benchmarks/vllm_bench.py [--reps 5] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fullband.decode.generate import generate
from fullband.hf.convert import convert
from fullband.machine import cpu_model
from fullband.model.config import ModelConfig
from fullband.model.decoder import FullbandLM
from fullband.presets import PRESETS


def llama_folder(cfg: ModelConfig, path: Path) -> None:
    """A random LlamaForCausalLM with the shape of `cfg` (no QK-norm, untied head, as converted Llamas are)."""
    import transformers

    torch.manual_seed(0)
    llama = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                                     num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                                     num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.max_seq_len,
                                     tie_word_embeddings=False, initializer_range=0.05)
    transformers.LlamaForCausalLM(llama).save_pretrained(path)


def real_llama_folder(spec: str, path: Path) -> None:
    """A real Llama as a transformers folder (a GGUF file dequantized by transformers, or the folder copied)."""
    from fullband.gguf_file import is_gguf
    from fullband.hf.gguf import load_causal_lm

    if not is_gguf(spec):
        import shutil

        shutil.copytree(spec, path)
        return
    load_causal_lm(spec).save_pretrained(path)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions per ratio (median reported)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--parts", default="soft,llama,generate,prefix",
                    help="which comparisons to run (comma-separated: soft, llama, generate, prefix)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--model", help="a real model instead of the random bench-91m Llama: a .gguf file "
                    "(shipped:smollm2) or a transformers Llama folder")
    ap.add_argument("--batches", default="1,32", help="concurrent requests of the SOFT and Llama comparisons")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import vllm

    root = Path(tempfile.mkdtemp(prefix="fullband-vllm-bench-"))
    if args.model:
        real_llama_folder(args.model, root / "llama")
    else:
        cfg = ModelConfig(**PRESETS["bench-91m"])
        llama_folder(cfg, root / "llama")
    convert(root / "llama", root / "native", to="native")
    convert(root / "native", root / "fb", to="hf")
    native = FullbandLM.load(root / "native").eval()
    cfg = native.config
    D = cfg.d_model
    # weights a STANDARD decode step reads: every matrix but the fusion's, the embedding only as a tied head
    read_standard = sum(p.numel() for n, p in native.named_parameters() if p.ndim == 2 and not n.startswith("fusion.")
                        and (n != "embed.weight" or native.lm_head is None))
    theory = 2 * D * D / read_standard
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, vLLM {vllm.__version__}; threads {torch.get_num_threads()}")
    print(f"{args.model or 'shape bench-91m'}: D={D}, L={cfg.n_layers}, V={cfg.vocab_size}; weights read per token "
          f"{read_standard / 1e6:.1f}M, fusion 2·D² = {2 * D * D / 1e6:.2f}M -> theory SOFT overhead {theory:+.2%}")

    batches = [int(b) for b in args.batches.split(",")]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_tokens,), generator=g).tolist() for _ in range(max(batches))]
    settings = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=1024, max_num_seqs=max(batches), seed=0)

    def sampling(mode: str):
        return vllm.SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=0.0,
                                   ignore_eos=True, extra_args={"feedback_mode": mode})

    def gen(llm, batch, sp):
        return llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)

    results: dict = {"cpu": cpu_model(), "theory_soft_overhead": theory, "reps": args.reps,
                     "new_tokens": args.new_tokens, "model": args.model or "bench-91m (random)",
                     "load_average": os.getloadavg()}
    parts = set(args.parts.split(","))
    ours = vllm.LLM(str(root / "fb"), **settings)
    for batch in batches if "soft" in parts else ():
        rows = prompts[:batch]
        gen(ours, rows, sampling("soft"))  # warm-up
        std, soft = [], []
        for _ in range(args.reps):
            std.append(timed(lambda: gen(ours, rows, sampling("standard"))))
            soft.append(timed(lambda: gen(ours, rows, sampling("soft"))))
        ratio = statistics.median(s / t for s, t in zip(soft, std))
        results[f"soft_vs_standard_b{batch}"] = ratio - 1
        results[f"standard_tok_s_b{batch}"] = batch * args.new_tokens / statistics.median(std)
        print(f"batch {batch:2d}: SOFT time / STANDARD time = {ratio:.4f} (overhead {ratio - 1:+.2%}; theory "
              f"{theory:+.2%}); STANDARD {batch * args.new_tokens / statistics.median(std):.1f} tok/s")

    if "llama" in parts:
        # The engine started first reads its weights measurably slower here (seen: 0.93x one way, 1.00x the
        # other, same binary), so both start orders run, each with fresh engines, and both are reported.
        plain = vllm.SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=0.0,
                                    ignore_eos=True)
        ours.llm_engine.engine_core.shutdown()
        speeds: dict[int, list[float]] = {b: [] for b in batches}
        for first in ("fullband", "llama"):
            names = ["fb", "llama"] if first == "fullband" else ["llama", "fb"]
            engines = {name: vllm.LLM(str(root / name), **settings) for name in names}
            for batch in batches:
                rows = prompts[:batch]
                gen(engines["llama"], rows, plain)
                gen(engines["fb"], rows, sampling("standard"))
                a, b = [], []
                for _ in range(args.reps):
                    a.append(timed(lambda: gen(engines["fb"], rows, sampling("standard"))))
                    b.append(timed(lambda: gen(engines["llama"], rows, plain)))
                speed = statistics.median(t / s for s, t in zip(a, b))
                speeds[batch].append(speed)
                results[f"llama_tok_s_b{batch}_{first}_first"] = batch * args.new_tokens / statistics.median(b)
                print(f"batch {batch:2d} ({first} engine started first): fullband STANDARD speed / vLLM Llama "
                      f"speed = {speed:.3f}x; vLLM Llama {batch * args.new_tokens / statistics.median(b):.0f} tok/s")
            for engine in engines.values():
                engine.llm_engine.engine_core.shutdown()
        for batch, pair in speeds.items():
            mean = (pair[0] * pair[1]) ** 0.5
            results[f"standard_vs_llama_b{batch}"] = mean
            print(f"batch {batch:2d}: fullband STANDARD speed / vLLM Llama speed, both orders = {mean:.3f}x")
        ours = vllm.LLM(str(root / "fb"), **settings) if "generate" in parts else None

    sp = sampling("soft")
    prompts = prompts[:32]
    generate(native, prompts[:2], 4, mode="soft")
    a, b = [], []
    for _ in range(max(1, args.reps // 2) if "generate" in parts else 0):
        a.append(timed(lambda: gen(ours, prompts, sp)))
        b.append(timed(lambda: generate(native, prompts, args.new_tokens, mode="soft")))
    if a:
        speed = statistics.median(t / s for s, t in zip(a, b))
        results["vllm32_vs_generate32"] = speed
        print(f"32 requests, SOFT: vLLM speed / fullband.generate (batch 32) speed = {speed:.2f}x")
    if "prefix" in parts:
        if ours is not None:
            ours.llm_engine.engine_core.shutdown()
        results["prefix"] = prefix_caching(vllm, root / "fb", settings, cfg.vocab_size, args.reps)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


PREFIX_MODES = (("standard", None), ("soft", None), ("fused", 1), ("fused", 2))


def prefix_caching(vllm, folder: Path, settings: dict, vocab: int, reps: int, prefix: int = 512, suffix: int = 16,
                   requests: int = 4) -> dict:
    """Hit rate and time to first token with a shared prefix, prefix caching on vs off, in every mode."""
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, vocab, (prefix,), generator=g).tolist()
    engines = {on: vllm.LLM(str(folder), **settings, enable_prefix_caching=on) for on in (True, False)}
    out = {}
    print(f"prefix caching: {requests} requests per round sharing a {prefix}-token prefix ({suffix}-token suffixes), "
          "one at a time, one new token each")
    for mode, passes in PREFIX_MODES:
        extra = {"feedback_mode": mode, **({"prefill_passes": passes} if passes is not None else {})}
        sp = vllm.SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)

        def round_(llm, r: int) -> tuple[float, int, int]:
            batch = [shared + torch.randint(0, vocab, (suffix,), generator=torch.Generator().manual_seed(100 * r + i))
                     .tolist() for i in range(requests)]
            t0, hit = time.perf_counter(), 0
            for p in batch:
                hit += llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].num_cached_tokens or 0
            return (time.perf_counter() - t0) / requests, hit, requests * (prefix + suffix)

        for llm in engines.values():
            round_(llm, -1)  # warm-up; with caching on it also leaves the prefix's blocks cached
        on, off, hits, total = [], [], 0, 0
        for r in range(reps):
            t, h, n = round_(engines[True], r)
            on.append(t)
            hits, total = hits + h, total + n
            off.append(round_(engines[False], r)[0])
        label = mode if passes is None else f"{mode} k={passes}"
        ratio = statistics.median(a / b for a, b in zip(on, off))
        out[label] = {"hit_rate": hits / total, "ttft_on_vs_off": ratio}
        print(f"  {label:<12} cached share of prompt tokens {hits / total:.1%}; time to first token, caching on / off "
              f"= {ratio:.3f}")
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    return out


if __name__ == "__main__":
    main()
