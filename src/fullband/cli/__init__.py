"""The `fullband` command: one entry point, one subcommand per job (init, generate, train, eval, convert, ...)."""


import argparse
import contextlib
import errno
import os
import sys
import warnings

from fullband.cli.bench import BENCH
from fullband.cli.eval import EVAL
from fullband.cli.generate import CHAT, GENERATE
from fullband.cli.train import CONVERT, DEMO, DOCTOR, INIT, REPRODUCE, RL, SERVE, TOKENIZER, TRAIN
from fullband.errors import FullbandError, FullbandWarning

# The commands, in the order `fullband --help` lists them; each module keeps a command's options beside its function.
COMMANDS = (INIT, GENERATE, CHAT, BENCH, TRAIN, RL, TOKENIZER, EVAL, REPRODUCE, CONVERT, SERVE, DOCTOR, DEMO)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fullband", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_to(sub)
    _refuse_empty(p)
    return p


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None and args.command in HEAVY:  # the command as a program (not called from Python)
        from fullband.machine import restart_keeping_freed_memory

        restart_keeping_freed_memory()
    default_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # fullband's warnings: one line on stderr
        if issubclass(category, FullbandWarning):
            print(f"fullband {args.command}: warning: {message}", file=sys.stderr)
        else:
            default_show(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    threads = None
    try:
        if args.command in (*HEAVY, "generate", "chat"):  # torch's threads to the free cores, said once; restored
            import torch

            from fullband.machine import fit_threads

            threads = torch.get_num_threads()
            message = fit_threads()
            if message:
                print(f"fullband {args.command}: {message}", file=sys.stderr)
        return args.func(args)
    except FullbandError as err:
        print(f"fullband {args.command}: error: {err}", file=sys.stderr)
        _tell_torchrun(args.command, err)
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


def _tell_torchrun(command: str, err: FullbandError) -> None:
    """Under torchrun, the error for its failure report (TORCHELASTIC_ERROR_FILE, as torch's own `record` writes
    it): the report then shows fullband's one line as the root cause instead of burying it above."""
    import json
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    line = f"fullband {command}: error: {err}"
    with contextlib.suppress(OSError):
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)


# commands whose steps take and free gigabytes: they run with glibc keeping freed memory (fullband.machine)
HEAVY = ("train", "rl", "eval", "bench", "demo", "reproduce")

