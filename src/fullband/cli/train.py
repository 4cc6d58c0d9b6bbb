"""`fullband init | train | rl | tokenizer train`: make a model, train it from a recipe, train a tokenizer."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from fullband.cli.args import SEED, SET_MODEL, Command, opt


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
    from fullband.train.config import load_run_config
    from fullband.train.trainer import train

    cfg = load_run_config(args.config, args.set)
    result = train(cfg, resume=args.resume)
    if result.get("eval") and int(os.environ.get("RANK", "0")) == 0:
        losses = "  ".join(f"passes={k}: {v:.4f}" for k, v in result["eval"].items())
        print(f"done: {result['steps']} steps, {result['tokens'] / 1e6:.2f}M tokens, {result['elapsed']:.0f}s; "
              f"val loss {losses}; run dir {result['run_dir']}")
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
    opt("--config", required=True, help="a preset name (tiny, bench-91m) or a .toml/.json file"),
    SET_MODEL,
    opt("--out", required=True, help="checkpoint folder to write (new or empty)"),
    opt("--overwrite", action="store_true", help="replace a model folder written earlier (nothing else)"),
    opt("--seed", type=SEED, default=0),
))
RESUME = opt("--resume", metavar="DIR", help="a run directory (its latest checkpoint) or a step_NNNNNN folder")
TRAIN = Command("train", "train a model from a recipe (configs/*.toml); torchrun for several GPUs", cmd_train, (
    opt("config", help="recipe TOML, e.g. configs/tiny.toml"),
    opt("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a setting (repeatable)"),
    RESUME,
))
RL = Command("rl", "on-policy RL with verifiable rewards from a chat model (a recipe's [rl] table)", cmd_rl, (
    opt("config", help="recipe TOML, e.g. configs/rl-tiny.toml"),
    opt("--set", action="append", metavar="rl.KEY=VALUE", help="override a setting (repeatable)"),
    RESUME,
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
