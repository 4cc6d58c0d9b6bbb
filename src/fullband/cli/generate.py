"""`fullband generate` and `fullband chat`: decode from a checkpoint into the terminal, in any decoding mode (one
spelling, DecodeMode.parse's: standard | soft | fused | fused:K | fused:auto | exact)."""


import argparse
import sys
import time

from fullband.cli.args import SEED, THREADS, Command, count, device, dtype, opt, tolerance, utf8
from fullband.errors import FullbandError, InputError
from fullband.model.mode import AUTO, DecodeMode, default_mode, default_note
from fullband.validate import DTYPES, ascii_int


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream a continuation of --prompt to stdout, token by token; or, with --replies-to, write the model's replies
    to a chat corpus's prompts to --out."""
    import torch

    from fullband.data.tokenizer import TextStream
    from fullband.decode.generate import model_stops, stream
    from fullband.decode.sampling import Sampling

    if (args.prompt is None) == (args.replies_to is None):
        raise InputError("fullband generate needs one of --prompt TEXT (a continuation, streamed) or --replies-to "
                         "CHATS --out FILE.jsonl (the model's replies to a chat corpus's prompts)")
    if args.replies_to is not None:
        return _replies(args)
    if args.out is not None:
        raise InputError("--out goes with --replies-to; a --prompt's continuation is streamed to standard output")
    prompt_text = utf8(args.prompt, "--prompt")
    asked = _mode_arg(args.mode, args.prefill_passes, args.prefill_tol)  # checked before the model is loaded
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    model, tokenizer = _load(args)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise FullbandError(f"the checkpoint's tokenizer has {tokenizer.vocab_size} ids but the model only "
                            f"{model.config.vocab_size}")
    mode = _model_mode(asked, model.config)
    # with a BOS where the model's tokenizer adds one (its add_bos), its special tokens read as its tokenizer reads them
    prompt = tokenizer.encode(prompt_text, special=not args.special_as_text)
    stops = [] if args.ignore_eos else model_stops(model, tokenizer)
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


def _replies(args: argparse.Namespace) -> int:
    """--replies-to CHATS --out FILE: the model's reply to each prompt, written whole (fullband.decode.replies)."""
    from fullband.decode.replies import write_replies
    from fullband.decode.sampling import Sampling

    if args.out is None:
        raise InputError("--replies-to needs --out FILE.jsonl, the file the conversations are written to")
    if args.engine != "torch":
        raise InputError("--replies-to decodes batches on torch's engine; accepted: --engine torch (the default)")
    for flag, given in (("--echo", args.echo), ("--ignore-eos", args.ignore_eos),
                        ("--special-as-text", args.special_as_text), ("--compile", args.compile)):
        if given:
            raise InputError(f"{flag} is for a --prompt's continuation; --replies-to renders each prompt with the "
                             "model's chat template and ends a reply at its stop tokens")
    asked = _mode_arg(args.mode, args.prefill_passes, args.prefill_tol)
    Sampling(args.temperature, args.top_k, args.top_p, args.seed)  # checked before the model is loaded
    model, tokenizer = _load(args)
    mode = _model_mode(asked, model.config)
    t0 = time.perf_counter()
    done = write_replies(model, tokenizer, args.replies_to, args.out, mode=mode, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                         batch_size=args.batch_size, overwrite=args.overwrite)
    empty = f", {done['empty']} empty replies left out" if done["empty"] else ""
    print(f"wrote {args.out}: {done['conversations']} conversations ({done['stopped']} replies ended at a stop token"
          f"{empty}), {done['tokens']} tokens generated in {mode.label}, {time.perf_counter() - t0:.0f} s")
    return 0


def _load(args: argparse.Namespace):
    """(model, tokenizer) of --checkpoint on --engine: torch (a model folder, on --device in --dtype) or llamacpp (a
    GGUF file fullband convert wrote, or any Llama-family GGUF file for STANDARD, on llama.cpp's CPU engine)."""
    if args.engine == "llamacpp":
        if args.device != "cpu" or args.dtype != "float32":
            raise InputError("--device and --dtype are torch's; the llama.cpp engine runs the GGUF file's own tensor "
                             "types on the CPU (convert with --gguf-type F16 / Q8_0 for another precision)")
        from fullband.llamacpp import LlamaCppModel

        model = LlamaCppModel(args.checkpoint, threads=args.threads, n_ctx=args.n_ctx)
        return model, model.tokenizer
    from fullband.data.tokenizer import load_tokenizer
    from fullband.loader import load_model

    return load_model(args.checkpoint, device=device(args.device), dtype=dtype(args.dtype)), load_tokenizer(
        args.checkpoint)


def _prefill_passes(text: str) -> int | str:
    """argparse type of --prefill-passes K, the older spelling of --mode fused:K: K as DecodeMode.parse reads it (an
    integer >= 0, or 'auto': adaptive prefill, see --prefill-tol)."""
    try:
        if text:  # (DecodeMode.parse reads a bare 'fused:' as fused)
            mode = DecodeMode.parse(f"fused:{text}")
            return AUTO if mode.adaptive else mode.prefill_passes
    except InputError:
        pass
    value = ascii_int(text)
    if value is not None and value < 0:
        raise argparse.ArgumentTypeError(f"{value} is out of range; accepted: an integer >= 0 or 'auto'")
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0 or 'auto'")


def _mode_arg(text: str | None, prefill_passes: int | str = 1, tol: float | None = None):
    """--mode (read by DecodeMode.parse: MODE, fused:K or fused:auto) with --prefill-passes K (`--mode fused
    --prefill-passes 2` is fused:2) and --prefill-tol (fused:auto's tolerance) as a DecodeMode; None when no --mode
    was given (the model's default, known once it is loaded)."""
    if text is None:
        return None
    mode = DecodeMode.parse(text)
    if ":" not in text:
        return DecodeMode.of(mode.name, prefill_passes, tol=tol)
    k = AUTO if mode.adaptive else mode.prefill_passes
    if prefill_passes not in (1, k):
        raise InputError(f"--mode {text} and --prefill-passes {prefill_passes} disagree ({text} is --prefill-passes "
                         f"{k}); accepted: one of them, e.g. --mode {text} alone")
    return DecodeMode.of(mode.name, k, tol=tol)


def _model_mode(asked, config):
    """The mode asked for, checked against the model, or the model's default (said on stderr when it is STANDARD
    because the model's feedback weights are untrained)."""
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

    asked = _mode_arg(args.mode, args.prefill_passes)
    if sys.stdin is None or sys.stdin.closed:  # started with standard input closed (`<&-`): no turn can be read
        raise InputError("fullband chat reads your turns from standard input, which is closed; accepted: a terminal, "
                         "or a pipe or file (e.g. `echo 'Hello' | fullband chat ...`)")
    model, tokenizer = _load(args)
    check_chat_model(model, tokenizer)
    mode = _model_mode(asked, model.config)
    session = ChatSession(model, tokenizer, mode=mode, system=args.system and utf8(args.system, "--system"),
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed)
    out = sys.stdout
    print(f"fullband chat: {args.checkpoint} ({session.mode.label}); /help for commands", flush=True)
    while True:
        try:
            line = input("you> ")
        except (EOFError, OSError, ValueError, RuntimeError):  # the end of input, or input gone mid-session
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
        for piece in session.reply(utf8(text, "your message")):
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


SAMPLING = (  # what generate and chat share
    opt("--temperature", type=float, default=0.0, help="0 = greedy (default)"),
    opt("--top-k", type=int, default=None), opt("--top-p", type=float, default=None),
    opt("--seed", type=SEED, default=None),
    opt("--dtype", choices=DTYPES, default="float32"), opt("--device", default="cpu"),
    opt("--engine", choices=("torch", "llamacpp"), default="torch",
        help="torch (default), or llamacpp: --checkpoint FILE.gguf (fullband convert CKPT FILE.gguf) decoded by "
             "llama.cpp, batch 1, on the CPU (needs llama-cpp-python: make llama-env)"),
    opt("--threads", type=THREADS, default=None, help="llama.cpp's threads (--engine llamacpp; default: torch's)"),
    opt("--n-ctx", type=count(1), default=None, help="llama.cpp's context, the longest sequence (--engine llamacpp; "
        "default: the model's max_seq_len, at most 4096)"),
)
MODE = opt("--mode", default=None, help="standard | soft | fused | fused:K | fused:auto | exact (default: soft; "
           "standard for a model whose feedback weights are untrained, e.g. a converted Llama)")

GENERATE = Command("generate", "stream a continuation of a prompt", cmd_generate, (
    *SAMPLING,
    opt("--checkpoint", required=True), opt("--prompt", help="the text to continue (or --replies-to)"), MODE,
    opt("--prefill-passes", type=_prefill_passes, default=1,
        help="extra fused passes over the prompt (fused mode; --mode fused:K says the same), or 'auto': iterate until "
             "the RMS state update < --prefill-tol (at most 32)"),
    opt("--prefill-tol", type=tolerance, default=1e-3, help="tolerance of --prefill-passes auto"),
    opt("--max-new-tokens", type=count(1), default=128),
    opt("--compile", action="store_true", help="torch.compile the decode step (first call is slow)"),
    opt("--echo", action="store_true", help="print the prompt before the continuation"),
    opt("--ignore-eos", action="store_true", help="keep generating past the EOS token(s) (by default the tokenizer's "
        "EOS, or a converted model's own EOS ids, end the generation)"),
    opt("--special-as-text", action="store_true", help="read a pretrained model's special tokens written in the "
        "prompt (e.g. <|im_start|>) as plain text, for untrusted input (by default they are those tokens, as "
        "transformers, vLLM and llama.cpp read them)"),
    opt("--replies-to", metavar="CHATS", help="in place of --prompt: reply to each conversation of a chat corpus (a "
        ".jsonl file or folder of them, 'hf:<dataset>', 'arithmetic:N'), read up to its last user turn with the "
        "model's template, and write the conversations with the replies to --out (JSON lines, a corpus to train on: "
        "data.corpus with data.shares)"),
    opt("--out", help="the .jsonl file --replies-to writes (whole, or not at all)"),
    opt("--batch-size", type=count(1), default=16, help="prompts decoded together (--replies-to)"),
    opt("--overwrite", action="store_true", help="replace --out when it exists"),
))
CHAT = Command("chat", "talk to a chat model in the terminal (/mode, /reset, /exit; Ctrl-C stops)", cmd_chat, (
    *SAMPLING,
    opt("--checkpoint", required=True, help="a model folder trained on chat data (fullband train, "
        "data.format = \"chat\")"),
    MODE,
    opt("--prefill-passes", type=_prefill_passes, default=1, help="fused passes over the prompt (fused; the same as "
        "--mode fused:K)"),
    opt("--system", help="a system message that opens the conversation"),
    opt("--max-new-tokens", type=count(1), default=256, help="the longest answer"),
))
