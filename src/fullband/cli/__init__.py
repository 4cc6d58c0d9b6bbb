"""The `fullband` command: one entry point, one subcommand per job (init, generate, train, eval, convert, ...)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

from fullband.errors import FullbandError, FullbandWarning, InputError
from fullband.validate import DTYPES, ascii_int, available_device, dtype as _dtype_of


def _dtype(name: str):
    return _dtype_of("--dtype", name, error=InputError)


def _device(name: str) -> str:
    """--device checked before any work: a device torch knows and this machine has."""
    return available_device("--device", name, error=InputError)


def _utf8(text: str, flag: str) -> str:
    """`text` from the command line, refused when it is not valid UTF-8 (undecodable bytes arrive as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = ord(text[err.start])
        byte = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"character U+{bad:04X}"
        raise InputError(f"{flag} is not valid UTF-8 ({byte} at position {err.start}); accepted: UTF-8 text") from None
    return text


def _count(minimum: int, below: int | None = None, accepted: str | None = None):
    """argparse type: an integer >= minimum (and < below), refused at parse time (before any work)."""
    accepted = accepted or f"an integer >= {minimum}"

    def parse(text: str) -> int:
        value = ascii_int(text)
        if value is None:
            raise argparse.ArgumentTypeError(f"{text!r} is not {accepted}")
        if value < minimum or (below is not None and value >= below):
            raise argparse.ArgumentTypeError(f"{value} is out of range; accepted: {accepted}")
        return value
    parse.__name__ = accepted
    return parse


_seed = _count(0, 2**63, "an integer 0 <= seed < 2**63")
_passes = _count(0, accepted="an integer >= 0 or 'auto'")


# Options where an empty value means something of its own (an empty prompt: generate from BOS alone; an empty stop
# text: the whole reply is the answer). Every other text option refuses '' at parse time (see _refuse_empty).
EMPTY_ALLOWED = frozenset({"--prompt", "--stop-text"})


def _nonempty(flag: str, optional: bool):
    """argparse type of a text option: the text, refused when empty (a script's unset variable must not be read as
    the option's default, or as the current folder)."""
    accepted = f"a non-empty value, or no {flag} at all (its default)" if optional else "a non-empty value"

    def parse(text: str) -> str:
        if text == "":
            raise argparse.ArgumentTypeError(f"'' is empty; accepted: {accepted}")
        return text
    parse.__name__ = "value"
    return parse


def _refuse_empty(parser: argparse.ArgumentParser) -> None:
    """Give every text option and argument of `parser` and its subcommands the _nonempty type (options with
    choices refuse '' already, numbers are not text, EMPTY_ALLOWED take it)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                _refuse_empty(sub)
        elif (action.type is None and action.choices is None and action.nargs not in (0, argparse.REMAINDER)
              and not set(action.option_strings) & EMPTY_ALLOWED and not isinstance(action, argparse._HelpAction)):
            flag = action.option_strings[-1] if action.option_strings else action.dest
            action.type = _nonempty(flag, optional=bool(action.option_strings) and not action.required)


def _prefill_passes(text: str) -> int | str:
    """--prefill-passes: an integer >= 0 or 'auto' (adaptive prefill, see --prefill-tol)."""
    return text if text == "auto" else _passes(text)


def _unescape(text: str, flag: str) -> str:
    """Backslash escapes (\\n, \\t, \\x41, \\u00e9) in a command-line string, read as Python reads them."""
    try:
        return _utf8(text, flag).encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as err:
        raise InputError(f"{flag} {text!r} has a bad escape ({err.reason}); accepted: text with \\n, \\t, "
                         "\\xHH or \\uHHHH escapes") from None


def _tolerance(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is out of range; accepted: a finite number > 0")
    return value


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


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream a continuation of --prompt to stdout, token by token."""
    import torch

    from fullband.data.tokenizer import TextStream, load_tokenizer
    from fullband.decode.generate import stream
    from fullband.decode.sampling import Sampling
    from fullband.loader import load_model

    prompt_text = _utf8(args.prompt, "--prompt")
    asked = _mode_arg(args.mode, args.prefill_passes, args.prefill_tol)  # checked before the model is loaded
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    model = load_model(args.checkpoint, device=_device(args.device), dtype=_dtype(args.dtype))
    tokenizer = load_tokenizer(args.checkpoint)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise FullbandError(f"the checkpoint's tokenizer has {tokenizer.vocab_size} ids but the model only "
                            f"{model.config.vocab_size}")
    mode = _model_mode(asked, model.config)
    prompt = tokenizer.encode(prompt_text)  # with a BOS where the model's tokenizer adds one (its add_bos)
    stops = [] if args.ignore_eos else [i for i in tokenizer.stop_ids if i < model.config.vocab_size]
    t0 = time.perf_counter()
    steps = stream(model, [prompt], args.max_new_tokens, mode=mode, sampling=sampling, stop_tokens=stops,
                   compile=args.compile)
    out = sys.stdout
    if args.echo:
        out.write(prompt_text)
    text = TextStream(tokenizer)
    with torch.inference_mode():
        for step in steps:
            if bool(step.finished[0]):
                break
            out.write(text.push(int(step.tokens[0])))
            out.flush()
    out.write(text.rest() + "\n")
    out.flush()
    ids, dt = text.ids, time.perf_counter() - t0  # the last line, on stderr: tokens, mode, speed, why it stopped
    why = f"; stopped at EOS id {ids[-1]} (--ignore-eos to go on)" if ids and ids[-1] in stops else ""
    print(f"[{len(ids)} tokens, {mode.label}, {len(ids) / dt:.1f} tok/s{why}]", file=sys.stderr)
    return 0


def _mode_arg(text: str | None, prefill_passes, tol: float | None = None):
    """--mode (MODE or fused:K) with --prefill-passes / --prefill-tol as a DecodeMode; None when no --mode was given
    (the model's default, known once it is loaded)."""
    from fullband.model.mode import DecodeMode

    if text is None:
        return None
    if ":" in text:
        return DecodeMode.parse(text)
    return DecodeMode.of(text, prefill_passes, tol=tol)


def _model_mode(asked, config):
    """The mode asked for, checked against the model, or the model's default (said on stderr when it is STANDARD
    because the model's feedback weights are untrained)."""
    from fullband.model.mode import default_mode, default_note

    if asked is not None:
        return asked.check(config)
    note = default_note(config)
    if note:
        print(f"[{note}]", file=sys.stderr, flush=True)
    return default_mode(config)


CHAT_HELP = """commands: /mode MODE (standard | soft | fused | fused:K | exact), /reset (a new conversation),
/exit (or Ctrl-D). Ctrl-C stops an answer and keeps the conversation."""


def cmd_chat(args: argparse.Namespace) -> int:
    """An interactive chat in the terminal: the answer streams, the conversation keeps its cache and state."""
    from fullband.chat import ChatSession, check_chat_model
    from fullband.data.tokenizer import load_tokenizer
    from fullband.model.mode import DecodeMode
    from fullband.loader import load_model

    asked = _mode_arg(args.mode, args.prefill_passes)
    model = load_model(args.checkpoint, device=_device(args.device), dtype=_dtype(args.dtype))
    tokenizer = load_tokenizer(args.checkpoint)
    check_chat_model(model, tokenizer)
    mode = _model_mode(asked, model.config)
    session = ChatSession(model, tokenizer, mode=mode, system=args.system and _utf8(args.system, "--system"),
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed)
    out = sys.stdout
    print(f"fullband chat: {args.checkpoint} ({session.mode.label}); /help for commands", flush=True)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:  # at the prompt: a fresh line, the session goes on
            print()
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            name, _, rest = text.partition(" ")
            if name in ("/exit", "/quit"):
                return 0
            if name == "/reset":
                session.reset()
                print("(new conversation)", flush=True)
            elif name == "/mode":
                try:
                    print(f"(mode: {session.set_mode(DecodeMode.parse(rest.strip() or 'soft')).label})", flush=True)
                except FullbandError as err:
                    print(f"(error: {err})", flush=True)
            else:
                print(CHAT_HELP, flush=True)
            continue
        try:
            _chat_turn(session, text, out)
        except KeyboardInterrupt:  # between the answer and its summary line: the session goes on
            print(flush=True)


def _chat_turn(session, text: str, out) -> None:
    """One turn of `fullband chat`: the streamed answer (Ctrl-C stops it; what was said stays), then its summary."""
    from fullband.chat import Turn

    before = session.last
    t0 = time.perf_counter()
    try:  # from the moment "assistant> " shows, a Ctrl-C stops this answer (and its summary line follows)
        out.write("assistant> ")
        out.flush()
        for piece in session.reply(_utf8(text, "your message")):
            out.write(piece)
            out.flush()
    except KeyboardInterrupt:
        pass  # the answer so far stays in the conversation
    except FullbandError as err:
        print(f"\n(error: {err})", flush=True)
        return
    turn = session.last if session.last is not before else Turn()  # stopped before the answer began: nothing
    dt = time.perf_counter() - t0
    print(f"\n[{len(turn.ids)} tokens, {session.mode.label}, {len(turn.ids) / max(dt, 1e-9):.1f} tok/s, "
          f"{turn.stopped or 'interrupted'}{', conversation re-read' if turn.reread else ''}]", flush=True)


def cmd_bench_decode(args: argparse.Namespace) -> int:
    from fullband.bench.decode import format_report, run_decode_bench
    from fullband.presets import load_model_config

    if args.model:  # a real model: its weights, transformers on them, the machine's bounds (fullband.bench.real)
        from fullband.bench.real import format_model_decode, run_model_decode

        _check_json_out(args.json)
        result = run_model_decode(args.model, batches=args.batch_sizes, threads=args.threads,
                                  prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                  prefill_passes=args.prefill_passes, repeats=args.repeats, hf=not args.no_hf,
                                  pairs=args.pairs, log=lambda s: print(s, file=sys.stderr))
        return _report(format_model_decode(result), result, args.json)
    cfg = load_model_config(args.config, args.set)
    device = _device(args.device)
    _check_json_out(args.json)
    result = run_decode_bench(
        cfg, batches=args.batch_sizes, dtypes=args.dtypes, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
        prefill_passes=args.prefill_passes, repeats=args.repeats, hf=not args.no_hf, compile=args.compile,
        device=device, log=lambda s: print(s, file=sys.stderr),
    )
    return _report(format_report(result), result, args.json)


def _check_json_out(json_path: str | None, key: str = "rows") -> None:
    """--json PATH, checked before the work runs: a new file, or the results file of an earlier run of the same
    command (a JSON object with `key`); never a folder or a file of something else."""
    if not json_path:
        return
    from fullband.files import OutputError, check_no_loop, check_writable, read_json

    path = Path(json_path)
    check_no_loop(path, "--json")
    if path.is_dir():
        raise OutputError(f"--json {json_path!r} is a folder; accepted: a file path for the results")
    if path.exists() and key not in (read_json(path) or {}):
        raise OutputError(f"--json {json_path!r} exists and is not an earlier result of this command; nothing was "
                          "overwritten. Choose a new file")
    check_writable(path.parent, "--json folder")


def _report(text: str, result: dict, json_path: str | None) -> int:
    """Print a benchmark's table and write its results as JSON when asked."""
    from fullband.files import make_folder, replace_file

    print(text)
    if json_path:
        _check_json_out(json_path)
        make_folder(Path(json_path).parent, "--json folder")
        replace_file(json_path, json.dumps(result, indent=2) + "\n")
    return 0


def cmd_bench_train(args: argparse.Namespace) -> int:
    from fullband.bench.train import format_train_report, run_train_bench

    _check_json_out(args.json)
    if args.model:  # k-pass steps against transformers' own step of the same model (fullband.bench.real)
        from fullband.bench.real import format_model_steps, run_model_steps

        result = run_model_steps(args.model, batch=args.batch, seq_len=args.seq_len, repeats=args.rounds,
                                 log=lambda s: print(s, file=sys.stderr))
        return _report(format_model_steps(result), result, args.json)
    result = run_train_bench(args.config, overrides=args.set, steps=args.steps, warmup=args.warmup,
                             rounds=args.rounds, log=lambda s: print(s, file=sys.stderr))
    return _report(format_train_report(result), result, args.json)


def cmd_bench_cost(args: argparse.Namespace) -> int:
    from fullband.bench.cost import format_cost_report, run_cost_bench
    from fullband.presets import load_model_config

    cfg = load_model_config(args.config, args.set)
    _check_json_out(args.json)
    result = run_cost_bench(cfg, passes=args.passes, schedule=args.schedule, batch=args.batch, seq_len=args.seq_len,
                            prompt_len=args.prompt_len, new_tokens=args.new_tokens, decode_batches=args.batch_sizes,
                            fused_passes=args.prefill_passes, repeats=args.repeats, dtype=args.dtype,
                            progress=False if args.no_progress else None)
    return _report(format_cost_report(result), result, args.json)


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


def cmd_eval(args: argparse.Namespace) -> int:
    from fullband.eval import commands

    commands.report.check_out(args.out or Path(args.checkpoint) / "eval", args.what.replace("-", "_"))  # before the work
    if args.what == "loss":
        commands.eval_loss(args.checkpoint, max_prefill=args.max_prefill, exact=not args.no_exact, seq_len=args.seq_len,
                           windows=args.windows, batch_size=args.batch_size, corpus=args.corpus, out=args.out,
                           auto_tols=args.auto, val_percent=args.val_percent)
    elif args.what == "stability":
        commands.eval_stability(args.checkpoint, ks=args.ks, seq_len=args.seq_len, windows=args.windows,
                                batch_size=args.batch_size, corpus=args.corpus, out=args.out,
                                val_percent=args.val_percent)
    elif args.what == "probe":
        commands.eval_probe(args.checkpoint, tasks=args.tasks, modes=args.modes, suffix=args.suffix,
                            scratch=args.scratch, out=args.out)
    elif args.what == "tracking":
        commands.eval_tracking(args.checkpoint, args.task, train_length=args.train_length, n=args.n,
                               modes=args.modes, batch_size=args.batch_size, out=args.out)
    elif args.what == "chat":
        commands.eval_chat(args.checkpoint, args.data, modes=args.modes, max_new_tokens=args.max_new_tokens,
                           batch_size=args.batch_size, limit=args.limit, out=args.out)
    else:
        from fullband.model.mode import DecodeMode

        modes = [DecodeMode.parse(m) for m in args.modes]
        commands.eval_generate_length(args.checkpoint, args.prompts, modes=modes, max_new_tokens=args.max_new_tokens,
                                      stop_text=_unescape(args.stop_text, "--stop-text"), out=args.out)
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    from fullband.reproduce import REGISTRY, reproduce

    from fullband.errors import InputError

    options = {}
    scaled = ("compare", "warmstart")  # the experiments that take --scale
    if args.scale is not None and args.experiment not in scaled:
        raise InputError(f"--scale applies to `fullband reproduce {' / '.join(scaled)}` only, not to "
                         f"{args.experiment!r}; accepted: drop it, or run one of those")
    if args.budget is not None and args.experiment != "compare":
        raise InputError(f"--budget applies to `fullband reproduce compare` only, not to {args.experiment!r}; "
                         "accepted: drop it, or run compare")
    if args.model is not None and args.experiment != "warmstart":
        raise InputError(f"--model applies to `fullband reproduce warmstart` only, not to {args.experiment!r}; "
                         "accepted: drop it, or run warmstart")
    if args.scale is not None:
        options["scale"] = args.scale
    if args.experiment == "compare" and (args.scale is not None or args.budget is not None):
        options = {"scale": "cpu" if args.scale is None else args.scale, "budget": args.budget}
        if args.budget is not None and not args.budget >= 0:
            raise InputError(f"--budget {args.budget}: accepted: minutes >= 0 (0 trains nothing new and reports the "
                             "finished runs)")
    if args.model is not None:
        options["model"] = args.model
    for exp in REGISTRY if args.experiment == "all" else [args.experiment]:
        reproduce(exp, root=args.root, docs=args.docs, **options)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert a checkpoint folder between the native and the transformers layout (or a Llama into either)."""
    from fullband.hf.convert import convert
    from fullband.hf.llama import _transformers

    _transformers()
    kind, target = convert(args.src, args.dst, to=args.to, dtype=None if args.dtype is None else _dtype(args.dtype),
                           fusion=args.fusion, overwrite=args.overwrite)
    how = {"hf": "load with AutoModelForCausalLM.from_pretrained (after `import fullband.hf`)",
           "native": "load with FullbandLM.load or --checkpoint"}[target]
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

    _check_json_out(args.json, key="findings")
    report = diagnose(args.path, hashes=not args.quick)
    print(report.format())
    if args.json:
        from fullband.files import replace_file

        replace_file(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
    return 1 if report.failed else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from fullband.demo import run_demo

    return run_demo(args.out, quick=args.quick, race_config=args.race_config, code_config=args.config)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fullband", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("init", help="write a randomly initialised checkpoint")
    s.add_argument("--config", required=True, help="a preset name (tiny, bench-91m) or a .toml/.json file")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model field (repeatable)")
    s.add_argument("--out", required=True, help="checkpoint folder to write (new or empty)")
    s.add_argument("--overwrite", action="store_true", help="replace a model folder written earlier (nothing else)")
    s.add_argument("--seed", type=_seed, default=0)
    s.set_defaults(func=cmd_init)

    sampling = argparse.ArgumentParser(add_help=False)  # what generate and chat share
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--seed", type=_seed, default=None)
    sampling.add_argument("--dtype", choices=DTYPES, default="float32")
    sampling.add_argument("--device", default="cpu")

    s = sub.add_parser("generate", parents=[sampling], help="stream a continuation of a prompt")
    s.add_argument("--checkpoint", required=True)
    s.add_argument("--prompt", required=True)
    s.add_argument("--mode", default=None, help="standard | soft | fused | fused:K | exact (default: soft; standard "
                   "for a model whose feedback weights are untrained, e.g. a converted Llama)")
    s.add_argument("--prefill-passes", type=_prefill_passes, default=1,
                   help="extra fused passes over the prompt (fused mode), or 'auto': iterate until the RMS state "
                        "update < --prefill-tol (at most 32)")
    s.add_argument("--prefill-tol", type=_tolerance, default=1e-3, help="tolerance of --prefill-passes auto")
    s.add_argument("--max-new-tokens", type=_count(1), default=128)
    s.add_argument("--compile", action="store_true", help="torch.compile the decode step (first call is slow)")
    s.add_argument("--echo", action="store_true", help="print the prompt before the continuation")
    s.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the EOS token(s) (by default the tokenizer's EOS, or a converted "
                        "model's own EOS ids, end the generation)")
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("chat", parents=[sampling], help="talk to a chat model in the terminal (/mode, /reset, /exit; Ctrl-C stops)")
    s.add_argument("--checkpoint", required=True, help="a model folder trained on chat data (fullband train, "
                   "data.format = \"chat\")")
    s.add_argument("--mode", default=None, help="standard | soft | fused | fused:K | exact (default: soft; standard "
                   "for a model whose feedback weights are untrained, e.g. a converted Llama)")
    s.add_argument("--prefill-passes", type=_prefill_passes, default=1, help="fused passes over the prompt (fused)")
    s.add_argument("--system", help="a system message that opens the conversation")
    s.add_argument("--max-new-tokens", type=_count(1), default=256, help="the longest answer")
    s.set_defaults(func=cmd_chat)

    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True, metavar="BENCH")
    s = b.add_parser("decode", help="STANDARD vs SOFT vs FUSED decode tokens/s, matmul bound, HF generate")
    s.add_argument("--config", default="bench-91m")
    s.add_argument("--set", action="append", metavar="KEY=VALUE")
    s.add_argument("--model", help="a real model instead of --config: a .gguf file (shipped:smollm2), a transformers "
                   "Llama folder or a fullband folder; float32, against transformers and the machine's bounds")
    s.add_argument("--threads", type=_count(1), nargs="+", default=[1, 2], help="with --model: torch threads")
    s.add_argument("--pairs", type=_count(2), default=400, help="with --model: paired STANDARD / SOFT decode steps "
                   "that measure SOFT's overhead (per threads x batch)")
    s.add_argument("--batch-sizes", type=_count(1), nargs="+", default=[1, 8])
    s.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["float32", "bfloat16"])
    s.add_argument("--prompt-len", type=_count(1), default=32)
    s.add_argument("--new-tokens", type=_count(2), default=64)
    s.add_argument("--prefill-passes", type=_count(0), default=1)
    s.add_argument("--repeats", type=_count(1), default=5)
    s.add_argument("--no-hf", action="store_true", help="skip the Hugging Face generate comparison")
    s.add_argument("--compile", action="store_true", help="also time the torch.compile'd decode step")
    s.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:N")
    s.add_argument("--json", help="also write the results to this JSON file")
    s.set_defaults(func=cmd_bench_decode)

    s = sub.add_parser("train", help="train a model from a recipe (configs/*.toml); torchrun for several GPUs")
    s.add_argument("config", help="recipe TOML, e.g. configs/tiny.toml")
    s.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a setting (repeatable)")
    s.add_argument("--resume", metavar="DIR", help="a run directory (its latest checkpoint) or a step_NNNNNN folder")
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("rl", help="on-policy RL with verifiable rewards from a chat model (a recipe's [rl] table)")
    s.add_argument("config", help="recipe TOML, e.g. configs/rl-tiny.toml")
    s.add_argument("--set", action="append", metavar="rl.KEY=VALUE", help="override a setting (repeatable)")
    s.add_argument("--resume", metavar="DIR", help="a run directory (its latest checkpoint) or a step_NNNNNN folder")
    s.set_defaults(func=cmd_rl)

    t = sub.add_parser("tokenizer", help="tokenizers").add_subparsers(dest="tokenizer", required=True, metavar="CMD")
    s = t.add_parser("train", help="train a byte-level BPE (Hugging Face tokenizers) on a corpus")
    s.add_argument("--corpus", action="append", required=True, help="stdlib, a path, a glob, a .jsonl or hf:NAME")
    s.add_argument("--vocab-size", type=int, required=True)
    s.add_argument("--out", required=True, help="folder for tokenizer.json (new or empty)")
    s.add_argument("--overwrite", action="store_true", help="replace a tokenizer folder written earlier")
    s.add_argument("--text-field", default="text")
    s.add_argument("--val-percent", type=float, default=1.0, help="held-out share never seen by the tokenizer")
    s.add_argument("--min-frequency", type=int, default=2)
    s.add_argument("--max-chars", type=int, default=None, help="stop reading after this many characters")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=cmd_tokenizer_train)

    s = b.add_parser("train", help="training step tokens/s and peak memory for k = 1, 2, 3 and 75/22/3")
    s.add_argument("--config", default="configs/tiny.toml")
    s.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    s.add_argument("--steps", type=int, default=6, help="timed steps per variant and round")
    s.add_argument("--warmup", type=int, default=2)
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--model", help="instead of a recipe: forward + backward of k = 1, 2, 3 passes on this model (a "
                   ".gguf file, a Llama folder or a fullband folder) against transformers' own step, in one process")
    s.add_argument("--batch", type=_count(1), default=4, help="with --model: sequences per step")
    s.add_argument("--seq-len", type=_count(2), default=256, help="with --model: tokens per sequence")
    s.add_argument("--json", help="also write the results to this JSON file")
    s.set_defaults(func=cmd_bench_train)

    s = b.add_parser("cost", help="a method vs its standard counterpart: parameters, FLOPs counted, time measured")
    s.add_argument("--config", default="configs/tiny.toml", help="a preset name or a .toml/.json file ([model])")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model field (repeatable)")
    s.add_argument("--vs", choices=["standard"], default="standard",
                   help="the baseline: the same width and depth with fusion='none', no loop, no ponder slots")
    s.add_argument("--passes", type=_count(1), nargs="+", default=[1, 2, 3], help="training pass counts to cost")
    s.add_argument("--schedule", help="also count a pass schedule's mean cost (a preset, e.g. three-pass)")
    s.add_argument("--batch", type=_count(1), default=8, help="training rows per timed step")
    s.add_argument("--seq-len", type=_count(1), default=128, help="training positions per row")
    s.add_argument("--batch-sizes", type=_count(1), nargs="+", default=[1, 8], help="decode batch sizes")
    s.add_argument("--prompt-len", type=_count(1), default=32)
    s.add_argument("--new-tokens", type=_count(2), default=32)
    s.add_argument("--prefill-passes", type=_count(1), default=1, help="k of the FUSED mode timed")
    s.add_argument("--repeats", type=_count(1), default=7, help="alternated repetitions of every variant")
    s.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--json", help="also write the results to this JSON file")
    s.set_defaults(func=cmd_bench_cost)

    e = sub.add_parser("eval", help="the paper's diagnostics on a checkpoint").add_subparsers(
        dest="what", required=True, metavar="WHAT")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--checkpoint", required=True, help="a model folder (e.g. runs/tiny/step_000200)")
    common.add_argument("--out", help="where to write WHAT.json / WHAT.png (default: CHECKPOINT/eval)")
    data = argparse.ArgumentParser(add_help=False)
    data.add_argument("--corpus", help="held-out data (default: the run's corpus, validation split)")
    data.add_argument("--val-percent", type=float, default=None, help="the share of the corpus held out and scored, by "
                      "file (default: the run's, else 1; 100 scores the whole corpus)")
    data.add_argument("--seq-len", type=_count(1), default=256)
    data.add_argument("--batch-size", type=_count(1), default=16)
    s = e.add_parser("loss", parents=[common, data], help="held-out loss: STANDARD, FUSED k=1..K, exact")
    s.add_argument("--windows", type=_count(0), default=256, help="validation windows (0 = all)")
    s.add_argument("--max-prefill", type=_count(0), default=3)
    s.add_argument("--no-exact", action="store_true", help="skip the (slow) exact recurrence")
    s.add_argument("--auto", type=_tolerance, nargs="*", default=[], metavar="TOL",
                   help="also adaptive prefill: iterate until the RMS update < TOL")
    s = e.add_parser("stability", parents=[common, data], help="iterate the pass map to k = 1000 (Fig. 3)")
    s.add_argument("--windows", type=_count(0), default=32)
    s.add_argument("--ks", type=_count(1), nargs="+", default=None,
                   help="pass counts (default 1 2 3 5 10 30 100 300 1000)")
    s = e.add_parser("probe", parents=[common], help="linear probes on synthetic state tracking (Fig. 7)")
    s.add_argument("--tasks", nargs="+", default=["completion", "memory"], choices=["completion", "memory", "registers"])
    s.add_argument("--modes", nargs="+", default=["standard", "one-step", "suffix", "full"],
                   choices=["standard", "one-step", "suffix", "full"])
    s.add_argument("--suffix", type=_count(1), default=8, help="k of the k-step suffix recurrence")
    s.add_argument("--scratch", type=_count(0), nargs="+", default=None,
                   help="scratch update counts (default 0 8 32 128 256)")
    s = e.add_parser("generate-length", parents=[common], help="median generated length and accuracy per mode")
    s.add_argument("--prompts", required=True, help="JSONL with 'prompt' (and optional 'answer') per line")
    s.add_argument("--modes", nargs="+", default=["standard", "soft", "fused:1"], help="MODE or fused:K")
    s.add_argument("--max-new-tokens", type=_count(1), default=256)
    s.add_argument("--stop-text", default="\\n", help="the answer is the text before this (default: newline)")
    s = e.add_parser("chat", parents=[common], help="exact match of the final answer and reply length per mode")
    s.add_argument("--data", required=True, help="held-out chat JSONL ({\"messages\": [...]} per line), or a chat "
                   "corpus (arithmetic, a folder, hf:NAME) whose held-out split is scored as the run split it; the "
                   "last assistant turn of each is the reference, its 'Answer: N' line is scored")
    s.add_argument("--modes", nargs="+", default=["standard", "soft", "fused:1", "fused:2"], help="MODE or fused:K")
    s.add_argument("--max-new-tokens", type=_count(1), default=192)
    s.add_argument("--batch-size", type=_count(1), default=16)
    s.add_argument("--limit", type=_count(1), default=None, help="score only the first N conversations")
    s = e.add_parser("tracking", parents=[common], help="state tracking accuracy by input length and mode",
                     description="--checkpoint may also be a `fullband convert --to hf` folder or a Llama folder "
                     "(read as `fullband convert` reads it); give --task and --train-length for any folder that "
                     "is not from a tracking run")
    s.add_argument("--task", choices=["parity", "counter", "s5", "registers"],
                   help="default: the task the run trained on")
    s.add_argument("--train-length", type=_count(1), help="L, the longest training input (default: the run's); "
                   "tested at L, 2L, 4L, 8L")
    s.add_argument("--n", type=_count(1), default=200, help="examples per length")
    s.add_argument("--modes", nargs="+", default=None,
                   help="MODE or fused:K (default: standard fused:1 fused:2 fused:4 fused:auto exact)")
    s.add_argument("--batch-size", type=_count(1), default=32)
    for what in e.choices.values():
        what.set_defaults(func=cmd_eval)

    from fullband.reproduce import REGISTRY

    s = sub.add_parser("reproduce", help="the paper's claims at small scale: train, evaluate, write a report")
    s.add_argument("experiment", choices=[*REGISTRY, "all"])
    s.add_argument("--root", default="runs/repro", help="where the runs go (finished ones are reused)")
    s.add_argument("--docs", default="docs/results", help="where the report and figures go")
    s.add_argument("--scale", default=None, help="compare: cpu (default, ~6 h on 2 cores), gpu-small (the same "
                   "study, larger, on a GPU) or micro (a smoke test of the pipeline); warmstart: cpu (default, "
                   "about 1 h 45 min on 2 cores), gpu or micro")
    s.add_argument("--model", default=None, metavar="PATH",
                   help="warmstart only: the pretrained Llama to add latent feedback to (a .gguf file or a "
                        "transformers folder; default shipped:smollm2)")
    s.add_argument("--budget", type=float, default=None, metavar="MIN",
                   help="compare only: start no new run after MIN minutes, then report the finished runs and "
                        "list the rest (a rerun goes on)")
    s.set_defaults(func=cmd_reproduce)

    s = sub.add_parser("convert", help="native checkpoint <-> transformers folder (a Llama folder into either)")
    s.add_argument("src", help="a native checkpoint, a transformers fullband folder or a LlamaForCausalLM folder")
    s.add_argument("dst", help="folder to write (must not exist or be empty unless --overwrite)")
    s.add_argument("--to", choices=("hf", "native"), help="target layout (default: the other one; native for a Llama)")
    s.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: keep)")
    s.add_argument("--fusion", default="gated", help="fusion of the new feedback weights when converting a Llama")
    s.add_argument("--overwrite", action="store_true", help="replace a non-empty destination")
    s.set_defaults(func=cmd_convert)

    s = sub.add_parser("serve", help="vLLM's OpenAI-compatible server on a transformers folder (fullband[vllm])")
    s.add_argument("folder", help="a transformers fullband folder (fullband convert ... --to hf, save_pretrained)")
    s.add_argument("options", nargs=argparse.REMAINDER, help="passed to vLLM's server (--port, --dtype, ...)")
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("doctor", help="check a model folder, training checkpoint or run directory (read only)")
    s.add_argument("path", help="a run directory, a step_NNNNNN checkpoint, a model folder or a transformers folder")
    s.add_argument("--quick", action="store_true", help="compare file sizes only, not the sha256 of every file")
    s.add_argument("--json", help="also write the findings to this JSON file")
    s.set_defaults(func=cmd_doctor)

    s = sub.add_parser("demo", help="the embedded demo (what `make demo` runs): latent feedback vs a standard model",
                       description="A race on running parity (a standard and a full-bandwidth model, scored beyond "
                       "their training length), then the code LM on the Python standard library; a few minutes on a "
                       "CPU. Finished phases are reused.")
    s.add_argument("--out", default="runs/demo", help="where everything goes (default runs/demo)")
    s.add_argument("--config", default="configs/tiny.toml", help="the code LM's recipe (default configs/tiny.toml)")
    s.add_argument("--race-config", default="configs/demo-parity.toml", help="the race's recipe")
    s.add_argument("--quick", action="store_true", help="every phase in seconds (a check that it all runs)")
    s.set_defaults(func=cmd_demo)
    _refuse_empty(p)
    return p


def _show_warnings(command: str) -> None:
    """fullband's own warnings as one line each on stderr ('fullband generate: warning: ...'), others as usual."""
    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, FullbandWarning):
            print(f"fullband {command}: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None and args.command in HEAVY:  # the command as a program (not called from Python)
        from fullband.machine import restart_keeping_freed_memory

        restart_keeping_freed_memory()
    _show_warnings(args.command)
    threads = _fit_threads(args.command)
    try:
        return args.func(args)
    except FullbandError as err:
        print(f"fullband {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`fullband generate ... | head`): stop quietly, as cat does
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    except OSError as err:  # a file-system failure no check foresaw: one line naming the path, not a traceback
        from fullband.files import output_error

        if err.filename is None and err.errno == errno.ENOSPC:  # print() into a full device (`> /dev/full`)
            target = "standard output"
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{sys.stdout.fileno()}")
            with contextlib.suppress(OSError):  # nothing more to flush at exit
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            print(f"fullband {args.command}: error: could not write the output: no space left on {target!r}",
                  file=sys.stderr)
            return 2
        where = err.filename or "."
        print(f"fullband {args.command}: error: {output_error(err, where, 'complete the command')}", file=sys.stderr)
        return 1 if err.errno not in (errno.ENOSPC, errno.EACCES, errno.EROFS) else 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if threads is not None:  # an in-process caller gets its thread count back
            import torch

            torch.set_num_threads(threads)


# commands whose steps take and free gigabytes: they run with glibc keeping freed memory (fullband.machine)
HEAVY = ("train", "rl", "eval", "bench", "demo", "reproduce")


def _fit_threads(command: str) -> int | None:
    """Torch's threads to the free cores (fullband.machine), saying so once; -> the count to restore after."""
    computing = ("train", "rl", "generate", "chat", "eval", "bench", "demo", "reproduce")
    if command not in computing:
        return None
    import torch

    from fullband.machine import fit_threads

    before = torch.get_num_threads()
    message = fit_threads()
    if message:
        print(f"fullband {command}: {message}", file=sys.stderr)
    return before

