"""`fullband init | train | rl | tokenizer train | reproduce | demo | convert | serve | doctor`: make a model, train it
from a recipe, train a tokenizer; the paper's claims at small scale, and the embedded demo; and what is done with a
model folder besides decoding it."""

import argparse
import json
import os
from pathlib import Path

from fullband.cli.args import (OVERRIDE, SEED, SET_MODEL, SET_RECIPE, THREADS, Command, Registry, check_json_out,
                               dtype, opt)
from fullband.errors import InputError
from fullband.reproduce import REGISTRY
from fullband.validate import DTYPES


def cmd_init(args: argparse.Namespace) -> int:
    """Write a randomly initialised checkpoint (config.json + model.safetensors + tokenizer.json)."""
    import torch

    from fullband.folder import MODEL_KIND
    from fullband.data.tokenizer import ByteTokenizer
    from fullband.files import check_destination
    from fullband.model.decoder import FullbandLM
    from fullband.presets import load_model_config
    from fullband.train.memory import check_fits, model_bytes

    cfg = load_model_config(args.config, args.set)
    check_destination(args.out, MODEL_KIND, overwrite=args.overwrite)  # before the model is built
    check_fits({"model": model_bytes(cfg)}, "the model", smaller="d_model, n_layers, d_ff, vocab_size or max_seq_len")
    torch.manual_seed(args.seed)
    model = FullbandLM(cfg)
    tokenizer = ByteTokenizer() if cfg.vocab_size >= ByteTokenizer.vocab_size else None
    model.save(args.out, tokenizer=tokenizer, overwrite=args.overwrite)
    print(f"wrote {args.out}: {model.num_params() / 1e6:.2f}M parameters "
          f"(fusion {(model.num_params() - model.num_params(fusion=False)) / 1e6:.3f}M), fusion={cfg.fusion}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Train from a recipe TOML; --resume continues a run exactly where its last checkpoint left it."""
    from fullband.eval.gate import verdict
    from fullband.train.config import load_run_config
    from fullband.train.trainer import train

    cfg = load_run_config(args.config, args.set)
    result = train(cfg, resume=args.resume)
    if result.get("eval") and not result["stopped"] and int(os.environ.get("RANK", "0")) == 0:
        losses = "  ".join(f"passes={k}: {v:.4f}" for k, v in result["eval"].items())
        gate = f"; {verdict(result['gate'])}" if result.get("gate") else ""  # a failed gate says what failed
        print(f"done: {result['steps']} steps, {result['tokens'] / 1e6:.2f}M tokens, {result['elapsed']:.0f}s; "
              f"val loss {losses}; run dir {result['run_dir']}{gate}")
    return 0


def cmd_rl(args: argparse.Namespace) -> int:
    """On-policy RL with verifiable rewards from a recipe's [rl] table; --resume continues a run exactly."""
    from fullband.rl.run import load_rl_recipe, rl_train

    run_dir = rl_train(load_rl_recipe(args.config, args.set), resume=args.resume)
    print(f"done: {run_dir} (metrics.jsonl, rl.png, step_NNNNNN/)")
    return 0


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from fullband.data.tokenizer import train_tokenizer_cli

    corpus = args.corpus[0] if len(args.corpus) == 1 else args.corpus
    tok = train_tokenizer_cli(corpus, args.vocab_size, args.out, text_field=args.text_field,
                              val_percent=args.val_percent, min_frequency=args.min_frequency,
                              max_chars=args.max_chars, progress=not args.no_progress, overwrite=args.overwrite)
    print(f"wrote {Path(args.out) / 'tokenizer.json'}: BPE with {tok.vocab_size} ids "
          f"(use it with data.tokenizer = {str(args.out)!r})")
    return 0


INIT = Command("init", "write a randomly initialised checkpoint", cmd_init, (
    opt("--config", required=True, help="a preset name (tiny, bench-91m) or a .toml/.json file"), SET_MODEL,
    opt("--out", required=True, help="checkpoint folder to write (new or empty)"),
    opt("--overwrite", action="store_true", help="replace a model folder written earlier (nothing else)"),
    opt("--seed", type=SEED, default=0),
))
RESUME = opt("--resume", metavar="DIR", help="a run directory (its latest checkpoint) or a step_NNNNNN folder")
TRAIN = Command("train", "train a model from a recipe (configs/*.toml); torchrun for several GPUs", cmd_train, (
    opt("config", help="recipe TOML, e.g. configs/tiny.toml"), SET_RECIPE, RESUME,
))
RL = Command("rl", "on-policy RL with verifiable rewards from a chat model (a recipe's [rl] table)", cmd_rl, (
    opt("config", help="recipe TOML, e.g. configs/rl-tiny.toml"),
    opt("--set", action="append", metavar="rl.KEY=VALUE", help=f"override a setting ({OVERRIDE})"), RESUME,
))
TOKENIZER = Command("tokenizer", "tokenizers", (
    Command("train", "train a byte-level BPE (Hugging Face tokenizers) on a corpus", cmd_tokenizer_train, (
        opt("--corpus", action="append", required=True, help="stdlib, a path, a glob, a .jsonl or hf:NAME"),
        opt("--vocab-size", type=int, required=True),
        opt("--out", required=True, help="folder for tokenizer.json (new or empty)"),
        opt("--overwrite", action="store_true", help="replace a tokenizer folder written earlier"),
        opt("--text-field", default="text"),
        opt("--val-percent", type=float, default=1.0, help="held-out share never seen by the tokenizer"),
        opt("--min-frequency", type=int, default=2),
        opt("--max-chars", type=int, default=None, help="stop reading after this many characters"),
        opt("--no-progress", action="store_true"),
    )),
), sub=("tokenizer", "CMD"))


LONG = ("warmstart-long", "warmstart-keep")  # trained invocation by invocation, each at most --budget minutes


def cmd_reproduce(args: argparse.Namespace) -> int:
    from fullband.reproduce import check_extra, reproduce

    options = {}
    scaled = ("compare", "warmstart", *LONG, "robustness")  # the experiments that take --scale
    if args.scale is not None and args.experiment not in scaled:
        raise InputError(f"--scale applies to `fullband reproduce {' / '.join(scaled)}` only, not to "
                         f"{args.experiment!r}; accepted: drop it, or run one of those")
    budgeted, modelled = ("compare", *LONG), ("warmstart", *LONG)
    if args.budget is not None and args.experiment not in budgeted:
        raise InputError(f"--budget applies to `fullband reproduce {' / '.join(budgeted)}` only, not to "
                         f"{args.experiment!r}; accepted: drop it, or run one of those")
    if args.model is not None and args.experiment not in modelled:
        raise InputError(f"--model applies to `fullband reproduce {' / '.join(modelled)}` only, not to "
                         f"{args.experiment!r}; accepted: drop it, or run one of those")
    if args.budget is not None and args.experiment in LONG:
        options["budget"] = args.budget
    if args.cooldown is not None:
        if args.experiment not in LONG:
            raise InputError(f"--cooldown applies to `fullband reproduce {' / '.join(LONG)}` only, not to "
                             f"{args.experiment!r}; accepted: drop it, or run one of those")
        options["cooldown"] = args.cooldown
    for flag, value in (("--cooldown-replay", args.cooldown_replay), ("--cooldown-anchor", args.cooldown_anchor)):
        if value is not None:
            if args.experiment != "warmstart-keep":
                raise InputError(f"{flag} applies to `fullband reproduce warmstart-keep` only, not to "
                                 f"{args.experiment!r}; accepted: drop it, or run that one")
            options[flag[2:].replace("-", "_")] = value
    if args.replies is not None:
        if args.experiment != "warmstart-keep":
            raise InputError(f"--replies applies to `fullband reproduce warmstart-keep` only, not to "
                             f"{args.experiment!r}; accepted: drop it, or run that one")
        options["replies"] = args.replies
    if args.scale is not None:
        options["scale"] = args.scale
    if args.experiment == "compare" and (args.scale is not None or args.budget is not None):
        options = {"scale": "cpu" if args.scale is None else args.scale, "budget": args.budget}
        if args.budget is not None and not args.budget >= 0:
            raise InputError(f"--budget {args.budget}: accepted: minutes >= 0 (0 trains nothing new and reports the "
                             "finished runs)")
    if args.model is not None:
        options["model"] = args.model
    if args.threads is not None:
        if args.experiment != "robustness":
            raise InputError(f"--threads applies to `fullband reproduce robustness` only, not to {args.experiment!r}; "
                             "accepted: drop it (the other experiments fix each run's threads in its recipe)")
        threads = tuple(sorted(set(args.threads)))
        options["machine_threads" if args.scale == "race" else "threads"] = threads
    chosen = list(REGISTRY) if args.experiment == "all" else [args.experiment]
    for exp in chosen:  # every experiment's --set checked before the first trains
        check_extra(exp, args.set)
    for exp in chosen:
        reproduce(exp, root=args.root, docs=args.docs, seeds=args.seeds, extra=args.set, **options)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from fullband.demo import run_demo

    return run_demo(args.out, quick=args.quick, race_config=args.race_config, code_config=args.config)


REPRODUCE = Command("reproduce", "the paper's claims at small scale: train, evaluate, write a report", cmd_reproduce, (
    opt("experiment", choices=[*REGISTRY, "all"]),
    opt("--root", default="runs/repro", help="where the runs go (finished ones are reused)"),
    opt("--docs", default="docs/results", help="where the report and figures go"),
    opt("--scale", default=None, help="compare: cpu (default, ~6 h on 2 cores), gpu-small (the same study, larger, "
        "on a GPU) or micro (a smoke test of the pipeline); warmstart: cpu (default, about 1 h 45 min on 2 cores), "
        "gpu or micro; warmstart-long and warmstart-keep: cpu (default) or micro; robustness: cpu (default, the "
        "whole study) or race (the race's grid alone on this machine, kept beside other machines' grids: about 45 "
        "min for --seeds 10)"),
    opt("--model", default=None, metavar="PATH", help="warmstart, warmstart-long and warmstart-keep: the pretrained "
        "Llama to add latent feedback to (a .gguf file or a transformers folder; default shipped:smollm2)"),
    opt("--budget", type=float, default=None, metavar="MIN", help="compare: start no new run after MIN minutes, "
        "then report the finished runs and list the rest (a rerun goes on); warmstart-long and warmstart-keep: "
        "train at most MIN minutes in this invocation (default 90; 0: none, the latest checkpoint read), then report "
        "the curve so far and the latest checkpoint cooled over 100 more steps (about 10 min more on 2 cores; a "
        "rerun extends the curve)"),
    opt("--cooldown", type=int, default=None, metavar="STEPS", help="warmstart-long and warmstart-keep: cool the "
        "latest checkpoint over STEPS more steps in place of 100 (its own branch, beside the default one); with "
        "--budget 0, a longer cooldown of the run as it stands"),
    opt("--cooldown-replay", type=float, default=None, metavar="SHARE", help="warmstart-keep: the cooldown is a run "
        "of its own from the latest checkpoint's weights on another mix: the replay at SHARE of the windows (0 < SHARE "
        "< 1), the anchor held to the pretrained model (default: a branch of the run's own recipe)"),
    opt("--cooldown-anchor", type=float, default=None, metavar="W", help="warmstart-keep, with --cooldown-replay: "
        "the anchor's weight in that cooldown (default 2)"),
    opt("--replies", type=int, default=None, metavar="N", help="warmstart-keep: the count of chat prompts the "
        "pretrained model answers for the replay (default 300 at --scale cpu; a third questions on the standard "
        "library, the rest word problems), sampled once when the run starts; a rerun must ask for the same"),
    opt("--threads", type=THREADS, nargs="+", default=None, metavar="T", help="robustness: the torch thread counts "
        "of the race's grid (default 1 2 4 8 for the whole study, 1 2 for --scale race; the goal counts 1 and 2; "
        "finished runs are reused, so a rerun with more counts adds columns)"),
    opt("--set", action="append", metavar="SECTION.KEY=VALUE", help="a training setting every run of the "
        "experiment gets after its recipe's own, e.g. train.dtype=bfloat16 on a GPU or a CPU with AMX (the "
        "post-training phases' recipes excepted); the report's header names it. A finished run whose model, data, "
        "optimizer or schedule differ from what --set makes of its recipe is refused, not reused"),
    opt("--seeds", type=int, default=None, metavar="N", help="train every run with N seeds (0..N-1; seed 0 is the "
        "recipes as written) and report each finding's spread across them; default per experiment: "
        + ", ".join(f"{name} {e.seeds}" for name, e in REGISTRY.items())),
))
DEMO = Command("demo", "the embedded demo (what `make demo` runs): latent feedback vs a standard model", cmd_demo, (
    opt("--out", default="runs/demo", help="where everything goes (default runs/demo)"),
    opt("--config", default="configs/tiny.toml", help="the code LM's recipe (default configs/tiny.toml)"),
    opt("--race-config", default="configs/demo-parity.toml", help="the race's recipe"),
    opt("--quick", action="store_true", help="every phase in seconds (a check that it all runs)"),
), description="A race on running parity (a standard and a full-bandwidth model, scored beyond their training "
               "length), then the code LM on the Python standard library; a few minutes on a CPU. Finished phases "
               "are reused.")


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert a checkpoint folder between the native and the transformers layout (or a Llama into either)."""
    from fullband.hf.convert import convert
    from fullband.hf.llama import _transformers

    _transformers()
    kind, target = convert(args.src, args.dst, to=args.to, dtype=None if args.dtype is None else dtype(args.dtype),
                           fusion=args.fusion, overwrite=args.overwrite, gguf_type=args.gguf_type)
    how = {"hf": "load with AutoModelForCausalLM.from_pretrained (after `import fullband.hf`)",
           "native": "load with FullbandLM.load or --checkpoint",
           "gguf": "its feedback weights are beside it (.feedback.safetensors); decode with --engine llamacpp"}[target]
    print(f"converted {kind} {args.src} -> {target} {args.dst}; {how}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """vLLM's OpenAI-compatible server on a transformers fullband folder (fullband.vllm.serve)."""
    from fullband.vllm.serve import serve

    serve(args.folder, args.options)
    return 0  # not reached: the process is now vLLM's server


def cmd_doctor(args: argparse.Namespace) -> int:
    """Check a model folder, training checkpoint or run directory; exit status 1 when something is damaged."""
    from fullband.doctor import diagnose

    check_json_out(args.json, key="findings")
    report = diagnose(args.path, hashes=not args.quick)
    print(report.format())
    if args.json:
        from fullband.files import replace_file

        replace_file(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
    return 1 if report.failed else 0


CONVERT = Command("convert", "native checkpoint <-> transformers folder <-> GGUF file (a Llama into any)",
                  cmd_convert, (
    opt("src", help="a native checkpoint, a transformers fullband folder, a LlamaForCausalLM folder or a GGUF file"),
    opt("dst", help="folder to write (must not exist or be empty unless --overwrite), or FILE.gguf"),
    opt("--to", choices=Registry("fullband.hf.convert", "TARGETS"), metavar="LAYOUT",
        help="target layout: hf, native or gguf (default: gguf for a .gguf dst, else the other one; native for a "
             "Llama)"),
    opt("--dtype", choices=DTYPES, help="cast the weights (default: keep)"),
    opt("--gguf-type", default=None, choices=Registry("fullband.hf.gguf_out", "GGUF_TYPES"), metavar="TYPE",
        help="a GGUF file's tensor type: F32, F16 or Q8_0 (default F32; norms stay F32; a GGUF destination only)"),
    opt("--fusion", default="gated", help="fusion of the new feedback weights when converting a Llama"),
    opt("--overwrite", action="store_true", help="replace a non-empty destination"),
))
SERVE = Command("serve", "vLLM's OpenAI-compatible server on a transformers folder (fullband[vllm])", cmd_serve, (
    opt("folder", help="a transformers fullband folder (fullband convert ... --to hf, save_pretrained)"),
    opt("options", nargs=argparse.REMAINDER, help="passed to vLLM's server (--port, --dtype, ...)"),
))
DOCTOR = Command("doctor", "check a model folder, training checkpoint, run directory or GGUF file (read only)", cmd_doctor, (
    opt("path", help="a run directory, a step_NNNNNN checkpoint, a model folder, a transformers folder or a GGUF "
        "file (its header against its tensors, and whether its feedback sidecar is its own)"),
    opt("--quick", action="store_true", help="compare file sizes only, not the sha256 of every file"),
    opt("--json", help="also write the findings to this JSON file"),
))
