"""The checks every setting and argument goes through: each returns the value or raises an error that names the
setting, the value seen and what is accepted (ConfigError for settings, InputError for call arguments)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from fullband.errors import ConfigError, FullbandError, closest


# the largest float32: torch's optimizers take a learning rate as a scalar of the weights' dtype, and a larger one
# fails inside their step ("value cannot be converted to type float without overflow")
MAX_LR = 3.4028234663852886e38


def integer(name: str, value: Any, minimum: int | None = None, *, below: int | None = None,
            error: type[FullbandError] = ConfigError) -> int:
    """An int (not a bool) with minimum <= value (< below)."""
    if isinstance(value, bool) or not (isinstance(value, int) or type(value).__name__ in _NUMPY_INTS):
        raise error(f"{name}={value!r} must be an integer (got {type(value).__name__})")
    if (minimum is not None and value < minimum) or (below is not None and value >= below):
        raise error(f"{name}={value!r} is invalid; accepted: {_int_range(name, minimum, below)}")
    return int(value)


def ascii_int(text: Any) -> int | None:
    """What int() reads from the string `text`, in ASCII only (int() also reads other scripts' digits, and
    str.isdigit() accepts '²', which int() refuses); None for anything else."""
    if not isinstance(text, str) or not text.isascii():
        return None
    try:
        return int(text)
    except ValueError:
        return None


def parse_int(name: str, text: str, minimum: int | None = None, *, below: int | None = None,
              error: type[FullbandError] = ConfigError) -> int:
    """An integer written as text (ascii_int), within the range of `integer`."""
    value = ascii_int(text)
    if value is None:
        raise error(f"{name}={text!r} is not an integer; accepted: {_int_range(name, minimum, below)}")
    return integer(name, value, minimum, below=below, error=error)


_NUMPY_INTS = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}


def _int_range(name: str, minimum: int | None, below: int | None) -> str:
    if below is None:
        return f"an integer >= {minimum}"
    return f"an integer < {below}" if minimum is None else f"an integer {minimum} <= {name} < {_power_of_two(below)}"


def _power_of_two(n) -> str:
    """A bound as the errors write it: 2**K for a large power of two; another field's name (the key reference's
    `n_layers`) as it is."""
    return f"2**{n.bit_length() - 1}" if isinstance(n, int) and n > 1024 and n & (n - 1) == 0 else str(n)


def number(name: str, value: Any, *, low: float | None = None, high: float | None = None, low_open: bool = False,
           high_open: bool = False, error: type[FullbandError] = ConfigError) -> float:
    """A finite int or float (not a bool) within [low, high] (open ends with low_open / high_open)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise error(f"{name}={value!r} must be a number (got {type(value).__name__})")
    accepted = _float_range(name, low, high, low_open, high_open)
    if not math.isfinite(value):
        raise error(f"{name}={value!r} is not a finite number; accepted: {accepted}")
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        raise error(f"{name}={value!r} is invalid; accepted: {accepted}")
    return value


def _float_range(name: str, low, high, low_open: bool, high_open: bool) -> str:
    lo, hi = ("<" if low_open else "<="), ("<" if high_open else "<=")
    if low is not None and high is not None:
        return f"{low:g} {lo} {name} {hi} {high:g}"
    if low is not None:
        return f"a finite number {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"a finite number {'<' if high_open else '<='} {high:g}"
    return "a finite number"


def choice(name: str, value: Any, choices: Iterable[str], *, error: type[FullbandError] = ConfigError) -> str:
    """One of `choices` (a near miss is named: 'did you mean ...')."""
    choices = tuple(choices)
    if value not in choices:
        hint = closest(value, choices) if isinstance(value, str) else ""
        raise error(f"{name}={value!r} is invalid{hint}; accepted: {', '.join(choices)}")
    return value


DTYPES = ("float32", "bfloat16", "float16")  # the weight dtypes a model can be loaded in, by name


def dtype(name: str, value: Any, *, error: type[FullbandError] = ConfigError):
    """A weight dtype by name (one of DTYPES) -> the torch.dtype."""
    import torch

    return getattr(torch, choice(name, value, DTYPES, error=error))


def boolean(name: str, value: Any, *, error: type[FullbandError] = ConfigError) -> bool:
    if not isinstance(value, bool):
        raise error(f"{name}={value!r} must be true or false")
    return value


def spans(name: str, value: Any, *, length: int | None = None, error: type[FullbandError] = ConfigError) \
        -> list[tuple[int, int]]:
    """Position spans [[start, end), ...]: pairs of integers 0 <= start < end (<= length), in order and apart."""
    accepted = (f"a list of [start, end) pairs of integers, 0 <= start < end{'' if length is None else f' <= {length}'}"
                ", in order, not overlapping")
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise error(f"{name}={value!r} is invalid; accepted: {accepted}")
    out: list[tuple[int, int]] = []
    for span in value:
        pair = list(span) if isinstance(span, Iterable) and not isinstance(span, str | bytes) else None
        ok = pair is not None and len(pair) == 2 and all(
            not isinstance(v, bool) and (isinstance(v, int) or type(v).__name__ in _NUMPY_INTS) for v in pair)
        if not ok or not (out[-1][1] if out else 0) <= pair[0] < pair[1] or (length is not None and pair[1] > length):
            raise error(f"{name}={value!r} is invalid at {span!r}; accepted: {accepted}")
        out.append((int(pair[0]), int(pair[1])))
    return out


def available_device(name: str, value: Any, *, error: type[FullbandError] = ConfigError) -> str:
    """A device setting (`name`, e.g. '--device' or 'rl.device') checked before any work: a device torch knows and
    this machine has (cuda:N within its devices, mps where it is built)."""
    import torch

    label = f"{name} {value!r}" if name.startswith("--") else f"{name}={value!r}"
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        raise error(f"{label} is not a device; accepted: cpu, cuda, cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise error(f"{label}: CUDA is not available on this machine; accepted: cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise error(f"{label}: this machine has {torch.cuda.device_count()} CUDA device(s); accepted: cuda:0 .. "
                        f"cuda:{torch.cuda.device_count() - 1}")
    elif dev.type != "cpu" and not (dev.type == "mps" and torch.backends.mps.is_available()):
        raise error(f"{label} is not available here; accepted: cpu, cuda, cuda:N")
    return value
