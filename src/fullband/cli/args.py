"""What the command modules share: a command as data (Command, opt) and the checks of command-line values, made at
parse time or before any work."""

import argparse
import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fullband.errors import InputError
from fullband.machine import MAX_THREADS
from fullband.validate import ascii_int, available_device, dtype as _dtype_of


def opt(*flags: str, **kw) -> tuple[tuple[str, ...], dict]:
    """One option of a Command: add_argument's arguments."""
    return flags, kw


@dataclass(frozen=True)
class Command:
    """A `fullband` command as data: its name, help and options (opt(...), in --help order), and what it runs: a
    function of the parsed arguments, or a group's subcommands (then `sub`: their dest and metavar)."""

    name: str
    help: str
    run: Callable[[argparse.Namespace], int] | tuple["Command", ...]
    options: tuple = ()
    description: str | None = None
    sub: tuple[str, str] = ("", "")

    def add_to(self, subparsers) -> None:
        parser = subparsers.add_parser(self.name, help=self.help, description=self.description)
        for flags, kw in self.options:
            parser.add_argument(*flags, **kw)
        if callable(self.run):
            parser.set_defaults(func=self.run)
            return
        dest, metavar = self.sub
        group = parser.add_subparsers(dest=dest, required=True, metavar=metavar)
        for command in self.run:
            command.add_to(group)


class Registry(Sequence):
    """A registry's names as choices=, read when first needed: its module is slow to import (fullband.hf imports
    transformers)."""

    def __init__(self, module: str, name: str):
        self.names = lambda: getattr(importlib.import_module(module), name)

    def __getitem__(self, i):
        return self.names()[i]

    def __len__(self) -> int:
        return len(self.names())


JSON = opt("--json", help="also write the results to this JSON file")
OVERRIDE = "repeatable; VALUE read as TOML, null unsets an optional one"
SET_MODEL = opt("--set", action="append", metavar="KEY=VALUE", help=f"override a model field ({OVERRIDE})")
SET_RECIPE = opt("--set", action="append", metavar="SECTION.KEY=VALUE", help=f"override a setting ({OVERRIDE})")


def dtype(name: str):
    return _dtype_of("--dtype", name, error=InputError)


def device(name: str) -> str:
    """--device checked before any work: a device torch knows and this machine has."""
    return available_device("--device", name, error=InputError)


def utf8(text: str, flag: str) -> str:
    """`text` from the command line, refused when it is not valid UTF-8 (undecodable bytes arrive as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = ord(text[err.start])
        byte = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"character U+{bad:04X}"
        raise InputError(f"{flag} is not valid UTF-8 ({byte} at position {err.start}); accepted: UTF-8 text") from None
    return text


def count(minimum: int, below: int | None = None, accepted: str | None = None):
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


SEED = count(0, 2**63, "an integer 0 <= seed < 2**63")
THREADS = count(1, MAX_THREADS + 1, f"an integer 1 <= threads <= {MAX_THREADS}")


def unescape(text: str, flag: str) -> str:
    """Backslash escapes (\\n, \\t, \\x41, \\u00e9) in a command-line string, read as Python reads them."""
    try:
        return utf8(text, flag).encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as err:
        raise InputError(f"{flag} {text!r} has a bad escape ({err.reason}); accepted: text with \\n, \\t, "
                         "\\xHH or \\uHHHH escapes") from None


def tolerance(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is out of range; accepted: a finite number > 0")
    return value


def check_json_out(json_path: str | None, key: str = "rows") -> None:
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
