"""Decode benchmark: STANDARD vs SOFT vs FUSED tokens/s side by side, against the matmul bound and HF generate.

Every variant of one (dtype, batch) cell runs in the same process, interleaved (A B C A B C ...), and the
median is reported, so ratios hold on a noisy shared machine. The matmul bound is the time of the decode
step's weight matrix-vector products alone (one token's worth, same shapes and dtype, timed in the same
loop): the ceiling for batch-1 decoding on this hardware. The model runs on `device` (the CPU by default); on
CUDA every timing waits for the kernels it queued before the clock stops."""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from fullband.decode.generate import generate, stream
from fullband.errors import InputError
from fullband.model.config import ModelConfig
from fullband.model.decoder import FullbandLM
from fullband.model.flops import DTYPE_BYTES, kv_bytes_per_token, param_count
from fullband.model.layers import linear
from fullband.model.mode import DecodeMode
from fullband.model.weights import lookup, split as split_rows
from fullband.train.memory import check_fits, model_bytes


PAIRS = 400  # paired STANDARD / SOFT decode steps that measure SOFT's overhead (paired_soft_overhead)


@dataclass
class Row:
    dtype: str
    batch: int
    variant: str
    tokens_per_s: float  # tokens/s summed over the batch rows
    ms_per_step: float  # per decode step (per generated token for end-to-end rows)
    prefill_ms: float | None = None
    note: str = ""


def decode_timer(model, prompts, new_tokens: int, mode: str, prefill_passes: int, compile: bool = False):
    """A callable timing one generation: returns (prefill s, decode s for the new_tokens - 1 decode steps)."""

    def run() -> tuple[float, float]:
        t0 = time.perf_counter()
        it = stream(model, prompts, new_tokens, mode=mode, prefill_passes=prefill_passes, compile=compile)
        next(it).tokens.tolist()
        t1 = time.perf_counter()
        for step in it:
            step.tokens.tolist()
        return t1 - t0, time.perf_counter() - t1

    return run


def _sync(device: torch.device) -> None:
    """Wait until `device` has run every kernel queued on it (CUDA runs them asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_weights(model, *, split: bool = False) -> list[torch.Tensor]:
    """The weight matrices one STANDARD decode step reads: every hidden matrix of every block
    (fullband.model.weights: wqkv, wo, w_in, w_down, and the output gates when there are any), then the head (the
    tied embedding). `split`: the Llama-style sequence instead (fused matrices cut into their row blocks: q, k, v,
    o, gate, up, down as seven matrices of the same total size)."""
    weights: list[torch.Tensor] = []
    for name, p in model.named_parameters():
        w, _ = lookup(name)
        if w.kind == "matrix":
            weights += [m.contiguous() for m in split_rows(w, p, model.config)] if split else [p]
    return weights + [model.embed.weight if model.lm_head is None else model.lm_head.weight]


def matmul_chain(model: FullbandLM, batch: int, *, split: bool = False) -> Callable[[], float]:
    """The decode step's weight matrix-vector products alone (decode_weights, `split` or not), one token's worth,
    with the model's own kernel choice (`layers.linear`). The callable returns seconds per token (median of 5)."""
    weights = decode_weights(model, split=split)
    inputs = [torch.randn(batch, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]

    def once() -> None:
        for x, w in zip(inputs, weights):
            linear(x, w)
        _sync(weights[0].device)

    def run() -> float:
        with torch.inference_mode():
            return statistics.median([timed(once)() for _ in range(5)])

    return run


def paired_soft_overhead(model: FullbandLM, prompts: torch.Tensor, pairs: int = PAIRS) -> float:
    """SOFT's per-step cost over STANDARD's, from decode steps of the two modes run in pairs on two caches, the
    order swapped every pair (STANDARD SOFT, SOFT STANDARD, ...): the median over pairs of SOFT's time / STANDARD's,
    minus 1. Pairs of single steps cancel the machine's drift, which whole-generation timings cannot resolve at the
    1% level (on 2 shared cores those differ by up to 5% either way), and swapping the order cancels what the
    first step of a pair does to the second."""
    B, P = prompts.shape
    device = prompts.device
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.inference_mode():
        runs = {}
        for feed in (False, True):
            cache = model.new_cache(B, P + pairs + 1)
            out = model(prompts, cache=cache, return_logits=False)
            runs[feed] = [cache, out.hidden[:, -1], out.top[:, -1]]
        tokens = prompts[:, -1]
        for i in range(pairs + 1):
            positions = torch.full((B,), P + i, dtype=torch.long, device=device)
            for feed in ((False, True) if i % 2 == 0 else (True, False)):
                cache, state, _ = runs[feed]
                _sync(device)
                t0 = time.perf_counter()
                state, top = model.step(tokens, positions, cache, prev=state if feed else None, kv_len=P + i + 1)
                tokens = model.head(top).argmax(-1)
                _sync(device)
                times[feed].append(time.perf_counter() - t0)
                runs[feed][1] = state
    # the first pair warms up
    return statistics.median(b / a for a, b in zip(times[False][1:], times[True][1:])) - 1


def theory_overhead(cfg: ModelConfig) -> float:
    """SOFT's extra weight reads per token over STANDARD's: 2 D^2 / (matmul weights of one decode step)."""
    qkvo = cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    per_token = cfg.n_layers * (qkvo + 3 * cfg.d_model * cfg.d_ff) + cfg.vocab_size * cfg.d_model
    return 2 * cfg.d_model**2 / per_token


def same_shape_llama(cfg: ModelConfig, *, tie: bool):
    """A random transformers LlamaForCausalLM of `cfg`'s shape, in eval mode (`tie`: its head is the embedding)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=tie, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps)).eval()


def hf_timer(hf, prompts: torch.Tensor, new_tokens: int) -> Callable[[], float]:
    """Seconds of transformers' greedy generate of new_tokens after `prompts` (end to end, prefill included)."""

    def run() -> None:
        with torch.inference_mode():
            hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        _sync(prompts.device)

    return timed(run)


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    """`fn` as a callable returning the seconds it took."""

    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return run


def timed_rounds(timers: dict[str, Callable[[], object] | None], repeats: int, log: Callable[[str], None] | None = None,
                 cell: str = "", *, alternate: bool = False, tick: Callable[[], None] = lambda: None) -> dict[str, list]:
    """Each timer once to warm up, then `repeats` rounds of all of them in turn (A B C A B C ...; with `alternate`
    every other round in reverse, A B C C B A ...: no variant always runs first, or after the same one), `tick`
    after every run and each round logged: every timer's results by name (none for a None timer)."""
    live = {name: fn for name, fn in timers.items() if fn is not None}
    for fn in live.values():
        fn()
        tick()
    times: dict[str, list] = {name: [] for name in timers}
    for r in range(repeats):
        for name in list(live)[:: -1 if alternate and r % 2 else 1]:
            times[name].append(live[name]())
            tick()
        if log:
            log(f"[bench] {cell}: repetition {r + 1}/{repeats}")
    return times


def decode_memory(cfg: ModelConfig, *, batches, dtypes, prompt_len: int, new_tokens: int, pairs: int,
                  hf: bool) -> dict[str, float]:
    """Bytes run_decode_bench holds at its peak, by part: the model (built in float32), its copy in the widest dtype,
    HF's Llama of the same shape (float32, batch 1) and, at the largest batch, a generation's KV cache, the paired
    measure's two and a prefill pass's activations and logits."""
    widest = max(dtypes, key=DTYPE_BYTES.get)
    size, rows = DTYPE_BYTES[widest], max(batches)
    positions = (prompt_len + new_tokens) + 2 * (prompt_len + pairs + 1)
    parts = {"models": model_bytes(cfg) + size * param_count(cfg),
             "decode": rows * positions * kv_bytes_per_token(cfg, widest)
             + rows * cfg.slots_per_token * prompt_len * (10 * cfg.d_model + 4 * cfg.d_ff + 2 * cfg.vocab_size) * size}
    if hf:
        parts["HF Llama"] = model_bytes(cfg)  # the same shape, without the fusion
    return parts


def run_decode_bench(cfg: ModelConfig, *, batches: list[int] = (1, 8), dtypes: list[str] = ("float32", "bfloat16"),
                     prompt_len: int = 32, new_tokens: int = 64, prefill_passes: int = 1, repeats: int = 5,
                     hf: bool = True, compile: bool = False, seed: int = 0, device: str = "cpu",
                     log: Callable[[str], None] = print) -> dict:
    """Every variant of each (dtype, batch) cell timed side by side on `device` (random weights from `seed`, built
    on the CPU and moved there); see format_report for the table and the ratios."""
    if prompt_len + new_tokens > cfg.max_seq_len:
        raise InputError(f"--prompt-len + --new-tokens = {prompt_len + new_tokens} exceeds max_seq_len="
                         f"{cfg.max_seq_len}; accepted: at most {cfg.max_seq_len}")
    DecodeMode("fused", prefill_passes).check(cfg, weights=False)
    pairs = min(PAIRS, cfg.max_seq_len - prompt_len - 1)  # the paired steps' positions stay within max_seq_len
    check_fits(decode_memory(cfg, batches=batches, dtypes=dtypes, prompt_len=prompt_len, new_tokens=new_tokens,
                             pairs=pairs, hf=hf), "bench decode", torch.device(device),
               smaller="--set d_model / n_layers / d_ff / vocab_size, --batch-sizes")
    torch.manual_seed(seed)
    base = FullbandLM(cfg).eval()
    fused = f"fused(k={prefill_passes})"
    rows: list[Row] = []
    paired: dict[str, float] = {}
    for dtype_name in dtypes:
        model = copy.deepcopy(base).to(device=device, dtype=getattr(torch, dtype_name))
        for batch in batches:
            prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len)).to(device)
            decoders = {"standard": decode_timer(model, prompts, new_tokens, "standard", 0),
                        "soft": decode_timer(model, prompts, new_tokens, "soft", 0),
                        fused: decode_timer(model, prompts, new_tokens, "fused", prefill_passes)}
            if compile:
                decoders["standard compiled"] = decode_timer(model, prompts, new_tokens, "standard", 0, True)
                decoders["soft compiled"] = decode_timer(model, prompts, new_tokens, "soft", 0, True)
            chain, chain7 = matmul_chain(model, batch), matmul_chain(model, batch, split=True)
            e2e = timed(lambda: generate(model, prompts, new_tokens, mode="standard")) if batch == 1 else None
            hf_run = None
            if hf and batch == 1 and dtype_name == "float32":  # a same-shape Llama, random weights; needs transformers
                with contextlib.suppress(ImportError):
                    hf_run = hf_timer(same_shape_llama(cfg, tie=True).to(device),
                                      torch.randint(0, cfg.vocab_size, (1, prompt_len)).to(device), new_tokens)
            log(f"[bench] {dtype_name} batch {batch}: warm-up" + (" (compiling)" if compile else ""))
            times = timed_rounds({**decoders, "chain": chain, "chain7": chain7, "e2e": e2e, "hf": hf_run}, repeats, log,
                                 f"{dtype_name} batch {batch}")
            paired[f"{dtype_name}/b{batch}"] = paired_soft_overhead(model, prompts, pairs)
            steps = new_tokens - 1
            for name in decoders:
                pre = statistics.median(p for p, _ in times[name])
                dec = statistics.median(d for _, d in times[name])
                rows.append(Row(dtype_name, batch, name, batch * steps / dec, 1000 * dec / steps, 1000 * pre))
            for name, variant, tokens, note in (  # tokens per row of one timed run; e2e and hf run at batch 1
                    ("chain", "matmul bound", 1, "weights only: wqkv, wo, w_in, w_down, head"),
                    ("chain7", "matmul bound (7/layer)", 1, "weights only: q, k, v, o, gate, up, down, head"),
                    ("e2e", "standard end-to-end", new_tokens, "generate(): prefill + decode"),
                    ("hf", "HF Llama generate", new_tokens, "same shape, greedy, end-to-end")):
                if times[name]:
                    t = statistics.median(times[name])
                    rows.append(Row(dtype_name, batch, variant, batch * tokens / t, 1000 * t / tokens, note=note))
    return {"rows": [asdict(r) for r in rows], "params": base.num_params(),
            "params_fusion": base.num_params() - base.num_params(fusion=False), "device": str(torch.device(device)),
            "threads": torch.get_num_threads(),
            "prompt_len": prompt_len, "new_tokens": new_tokens, "theory_soft_overhead": theory_overhead(cfg),
            **_summary(rows, fused), **{f"soft_overhead_paired_steps/{k}": v for k, v in paired.items()}}


def _summary(rows: list[Row], fused: str) -> dict:
    get = {(r.dtype, r.batch, r.variant): r.tokens_per_s for r in rows}
    out: dict = {}
    for dtype, batch, variant in list(get):
        if variant != "standard":
            continue
        key = f"{dtype}/b{batch}"
        std = get[(dtype, batch, "standard")]
        out[f"soft_overhead/{key}"] = std / get[(dtype, batch, "soft")] - 1
        out[f"fused_decode_overhead/{key}"] = std / get[(dtype, batch, fused)] - 1
        out[f"standard_vs_bound/{key}"] = std / get[(dtype, batch, "matmul bound")]
        if (dtype, batch, "standard compiled") in get:
            comp = get[(dtype, batch, "standard compiled")]
            out[f"compiled_vs_bound/{key}"] = comp / get[(dtype, batch, "matmul bound")]
            out[f"compiled_soft_overhead/{key}"] = comp / get[(dtype, batch, "soft compiled")] - 1
        if (dtype, batch, "HF Llama generate") in get:
            out[f"e2e_vs_hf/{key}"] = get[(dtype, batch, "standard end-to-end")] / get[(dtype, batch, "HF Llama generate")]
        if dtype == "bfloat16" and ("float32", batch, "standard") in get:
            out[f"bf16_vs_fp32/b{batch}"] = std / get[("float32", batch, "standard")]
            bound = get[(dtype, batch, "matmul bound")]
            out[f"bf16_vs_fp32_bound/b{batch}"] = bound / get[("float32", batch, "matmul bound")]
    return out


def format_report(result: dict) -> str:
    lines = [f"parameters {result['params'] / 1e6:.1f}M (fusion {result['params_fusion'] / 1e6:.2f}M), "
             f"{result['device']}, {result['threads']} threads, prompt {result['prompt_len']} tokens, "
             f"{result['new_tokens']} new tokens",
             f"{'dtype':<9} {'batch':>5}  {'variant':<22} {'tok/s':>9} {'ms/step':>8} {'prefill ms':>10}  note"]
    for r in result["rows"]:
        pre = f"{r['prefill_ms']:.1f}" if r["prefill_ms"] is not None else ""
        lines.append(f"{r['dtype']:<9} {r['batch']:>5}  {r['variant']:<22} {r['tokens_per_s']:>9.1f} "
                     f"{r['ms_per_step']:>8.2f} {pre:>10}  {r['note']}")
    lines.append(f"theoretical SOFT overhead (2 D^2 / weights read per token): {100 * result['theory_soft_overhead']:.2f}%")
    for key, value in result.items():
        if "overhead" in key:
            lines.append(f"{key:<34} {100 * value:+.2f}%")
        elif "/" in key:
            lines.append(f"{key:<34} {value:.3f}x")
    return "\n".join(lines)
