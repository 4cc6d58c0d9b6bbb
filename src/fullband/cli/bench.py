"""`fullband bench decode | train | cost`: the benchmarks, each a table on stdout and, with --json, a results file."""


import argparse
import json
import sys
from pathlib import Path

from fullband.cli.args import JSON, SET_MODEL, SET_RECIPE, THREADS, Command, check_json_out, count, device, opt
from fullband.validate import DTYPES


def _log(text: str) -> None:
    print(text, file=sys.stderr)


def cmd_bench_decode(args: argparse.Namespace) -> int:
    from fullband.bench.decode import format_report, run_decode_bench
    from fullband.presets import load_model_config

    if args.model:  # a real model: its weights, transformers on them, the machine's bounds (fullband.bench.real)
        from fullband.bench.real import format_model_decode, run_model_decode

        check_json_out(args.json)
        result = run_model_decode(args.model, batches=args.batch_sizes, threads=args.threads,
                                  prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                  prefill_passes=args.prefill_passes, repeats=args.repeats, hf=not args.no_hf,
                                  pairs=args.pairs, log=_log)
        return _report(format_model_decode(result), result, args.json)
    cfg = load_model_config(args.config, args.set)
    on = device(args.device)
    check_json_out(args.json)
    result = run_decode_bench(
        cfg, batches=args.batch_sizes, dtypes=args.dtypes, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
        prefill_passes=args.prefill_passes, repeats=args.repeats, hf=not args.no_hf, compile=args.compile,
        device=on, log=_log,
    )
    return _report(format_report(result), result, args.json)


def _report(text: str, result: dict, json_path: str | None) -> int:
    """Print a benchmark's table and write its results as JSON when asked."""
    from fullband.files import make_folder, replace_file

    print(text)
    if json_path:
        check_json_out(json_path)
        make_folder(Path(json_path).parent, "--json folder")
        replace_file(json_path, json.dumps(result, indent=2) + "\n")
    return 0


def cmd_bench_train(args: argparse.Namespace) -> int:
    from fullband.bench.train import format_train_report, run_train_bench

    check_json_out(args.json)
    if args.model:  # k-pass steps against transformers' own step of the same model (fullband.bench.real)
        from fullband.bench.real import format_model_steps, run_model_steps

        result = run_model_steps(args.model, batch=args.batch, seq_len=args.seq_len, repeats=args.rounds, log=_log)
        return _report(format_model_steps(result), result, args.json)
    result = run_train_bench(args.config, overrides=args.set, steps=args.steps, warmup=args.warmup,
                             rounds=args.rounds, log=_log)
    return _report(format_train_report(result), result, args.json)


def cmd_bench_cost(args: argparse.Namespace) -> int:
    from fullband.bench.cost import format_cost_report, run_cost_bench
    from fullband.presets import load_model_config

    cfg = load_model_config(args.config, args.set)
    check_json_out(args.json)
    result = run_cost_bench(cfg, passes=args.passes, schedule=args.schedule, batch=args.batch, seq_len=args.seq_len,
                            prompt_len=args.prompt_len, new_tokens=args.new_tokens, decode_batches=args.batch_sizes,
                            fused_passes=args.prefill_passes, repeats=args.repeats, dtype=args.dtype,
                            progress=False if args.no_progress else None)
    return _report(format_cost_report(result), result, args.json)


DECODE = Command("decode", "STANDARD vs SOFT vs FUSED decode tokens/s, matmul bound, HF generate", cmd_bench_decode, (
    opt("--config", default="bench-91m"), SET_MODEL,
    opt("--model", help="a real model instead of --config: a .gguf file (shipped:smollm2), a transformers Llama folder "
        "or a fullband folder; float32, against transformers and the machine's bounds"),
    opt("--threads", type=THREADS, nargs="+", default=[1, 2], help="with --model: torch threads"),
    opt("--pairs", type=count(2, 10**6 + 1), default=400, help="with --model: paired STANDARD / SOFT decode steps that "
        "measure SOFT's overhead (per threads x batch)"),
    opt("--batch-sizes", type=count(1), nargs="+", default=[1, 8]),
    opt("--dtypes", nargs="+", choices=DTYPES, default=["float32", "bfloat16"]),
    opt("--prompt-len", type=count(1), default=32), opt("--new-tokens", type=count(2), default=64),
    opt("--prefill-passes", type=count(0), default=1), opt("--repeats", type=count(1, 1001), default=5),
    opt("--no-hf", action="store_true", help="skip the Hugging Face generate comparison"),
    opt("--compile", action="store_true", help="also time the torch.compile'd decode step"),
    opt("--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:N"), JSON,
))
TRAIN = Command("train", "training step tokens/s and peak memory for k = 1, 2, 3 and 75/22/3", cmd_bench_train, (
    opt("--config", default="configs/tiny.toml"), SET_RECIPE,
    opt("--steps", type=count(1, 10**5), default=6, help="timed steps per variant and round"),
    opt("--warmup", type=count(0, 10**5), default=2), opt("--rounds", type=count(1, 1001), default=3),
    opt("--model", help="instead of a recipe: forward + backward of k = 1, 2, 3 passes on this model (a .gguf file, a "
        "Llama folder or a fullband folder) against transformers' own step, in one process"),
    opt("--batch", type=count(1), default=4, help="with --model: sequences per step"),
    opt("--seq-len", type=count(2), default=256, help="with --model: tokens per sequence"), JSON,
))
COST = Command("cost", "a method vs its standard counterpart: parameters, FLOPs counted, time measured",
               cmd_bench_cost, (
    opt("--config", default="configs/tiny.toml", help="a preset name or a .toml/.json file ([model])"), SET_MODEL,
    opt("--vs", choices=["standard"], default="standard",
        help="the baseline: the same width and depth with fusion='none', no loop, no ponder slots"),
    opt("--passes", type=count(1), nargs="+", default=[1, 2, 3], help="training pass counts to cost"),
    opt("--schedule", help="also count a pass schedule's mean cost (a preset, e.g. three-pass)"),
    opt("--batch", type=count(1), default=8, help="training rows per timed step"),
    opt("--seq-len", type=count(1), default=128, help="training positions per row"),
    opt("--batch-sizes", type=count(1), nargs="+", default=[1, 8], help="decode batch sizes"),
    opt("--prompt-len", type=count(1), default=32), opt("--new-tokens", type=count(2), default=32),
    opt("--prefill-passes", type=count(1), default=1, help="k of the FUSED mode timed"),
    opt("--repeats", type=count(1, 1001), default=7, help="alternated repetitions of every variant"),
    opt("--dtype", choices=["float32", "bfloat16"], default="float32"), opt("--no-progress", action="store_true"), JSON,
))
BENCH = Command("bench", "benchmarks", (DECODE, TRAIN, COST), sub=("bench", "BENCH"))
