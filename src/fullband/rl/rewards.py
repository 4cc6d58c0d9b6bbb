"""Verifiable rewards: the built-in checkers (`answer`: exact match of a final 'Answer: N'; `contains`: the
reference answer anywhere in the reply, as a word), or a user function
`module:function(prompt, response, example) -> float` (module a dotted name or a .py file), checked on every call."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fullband.data.chat.arithmetic import final_answer
from fullband.errors import ConfigError, DataError

Reward = Callable[[str, str, dict], float]


def exact_answer(prompt: str, response: str, example: dict) -> float:
    """1.0 when the response's final 'Answer: ...' equals the example's answer (as text, spaces trimmed), else 0."""
    return float(final_answer(response) == str(example["answer"]).strip())


def contains_answer(prompt: str, response: str, example: dict) -> float:
    """1.0 when the example's answer occurs in the response as a whole word or number (case-insensitive), else 0:
    a reward an instruction-tuned model earns without a fixed answer format ("Paris", "The capital is Paris.")."""
    answer = str(example["answer"]).strip()
    return float(bool(answer) and re.search(rf"(?<!\w){re.escape(answer)}(?!\w)", response, re.IGNORECASE) is not None)


BUILT_IN = {"answer": exact_answer, "contains": contains_answer}


def load_reward(spec: str, *, timeout: float = 0.0) -> Reward:
    """'answer' (the built-in checker) or 'module:function' / 'path/to/file.py:function' -> a checked reward: each
    call returns a finite number within `timeout` seconds (0: no limit), or a one-line DataError naming the reward
    and the prompt (for what it raised, a sys.exit, a call that never returns, a value that is not a number)."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    module_name, sep, name = spec.rpartition(":")
    if not sep or not module_name or not name:
        raise ConfigError(f"rl.reward={spec!r} is not a reward; accepted: {', '.join(BUILT_IN)}, or "
                          "'module:function' / 'file.py:function' taking (prompt, response, example) -> float")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            loader = importlib.util.spec_from_file_location(path.stem, path)
            if loader is None or not path.is_file():
                raise FileNotFoundError(f"no file {str(path)!r}")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except SystemExit as err:  # sys.exit() while the module is imported would end the run without a word
        raise ConfigError(f"rl.reward={spec!r}: importing {module_name!r} called sys.exit({err.code!r}); accepted: a "
                          "module that defines the reward function when imported") from None
    except Exception as err:  # noqa: BLE001 -- whatever the user's module raises on import, said in one line
        raise ConfigError(f"rl.reward={spec!r}: cannot import {module_name!r} ({type(err).__name__}: {err})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"rl.reward={spec!r}: {module_name!r} has no function {name!r}")
    return _checked(fn, spec, timeout)


class _TimedOut(BaseException):  # raised inside the user's function by the alarm; no `except Exception` catches it
    pass


class _Outer(BaseException):  # what an outer alarm's own handler raised, carried past the user's function
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _checked(fn: Callable, spec: str, timeout: float) -> Reward:
    def reward(prompt: str, response: str, example: dict) -> float:
        where = f"(prompt {prompt[-60:]!r}, response {response[:60]!r})"
        try:
            with _deadline(timeout):
                value: Any = fn(prompt, response, example)
        except _Outer as outer:
            raise outer.error from None
        except _TimedOut:
            raise DataError(f"the reward {spec!r} did not return within rl.reward_timeout={timeout:g} s {where}; "
                            "make it return sooner or raise rl.reward_timeout (0: no limit)") from None
        except SystemExit as err:  # sys.exit() inside a reward would end the run without a word
            raise DataError(f"the reward {spec!r} called sys.exit({err.code!r}) {where}; accepted: a function that "
                            "returns a finite number") from None
        except Exception as err:  # noqa: BLE001 -- the user's function, named with what it raised
            raise DataError(f"the reward {spec!r} raised {type(err).__name__}: {err} {where}") from None
        if not isinstance(value, int | float) or not math.isfinite(value):  # a bool is 0 / 1
            raise DataError(f"the reward {spec!r} returned {value!r} {where}; accepted: a finite number")
        return float(value)

    return reward


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise _TimedOut in the calling code after `seconds` (a real-time alarm, SIGALRM), in the main thread of a POSIX
    process (elsewhere: no limit). An alarm someone else set (a test runner's timeout) keeps its own time and
    handler: whichever is due first fires, and the other's is set again after."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return
    outer, interval = signal.getitimer(signal.ITIMER_REAL)
    previous = signal.getsignal(signal.SIGALRM)
    ours_first = not outer or seconds < outer
    start = time.monotonic()
    fired = []  # the outer alarm went off while we held the timer: not to be set again for a time already past

    def expire(signum, frame):
        if ours_first:
            raise _TimedOut
        fired.append(True)
        signal.signal(signal.SIGALRM, previous)  # the outer alarm is due: its own handler, as if we were not here
        if callable(previous):
            try:
                previous(signum, frame)
            except BaseException as err:  # noqa: BLE001 -- the outer handler's own, raised as it is by `reward`
                raise _Outer(err) from None
        elif previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGALRM)

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds if ours_first else outer)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if fired and interval:  # a repeating outer alarm goes on at its own interval
            signal.setitimer(signal.ITIMER_REAL, interval, interval)
        elif outer and not fired:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3), interval)
