"""Verifiable rewards: the built-in checkers (`answer`: exact match of a final 'Answer: N'; `contains`: the
reference answer anywhere in the reply, as a word), or a user function
`module:function(prompt, response, example) -> float` (module a dotted name or a .py file), checked on every call."""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
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


def load_reward(spec: str) -> Reward:
    """'answer' (the built-in checker) or 'module:function' / 'path/to/file.py:function' -> a checked reward."""
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
    except Exception as err:  # noqa: BLE001 -- whatever the user's module raises on import, said in one line
        raise ConfigError(f"rl.reward={spec!r}: cannot import {module_name!r} ({type(err).__name__}: {err})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"rl.reward={spec!r}: {module_name!r} has no function {name!r}")
    return _checked(fn, spec)


def _checked(fn: Callable, spec: str) -> Reward:
    def reward(prompt: str, response: str, example: dict) -> float:
        try:
            value: Any = fn(prompt, response, example)
        except Exception as err:  # noqa: BLE001 -- the user's function, named with what it raised
            raise DataError(f"the reward {spec!r} raised {type(err).__name__}: {err} (response {response[:60]!r})") \
                from None
        if not isinstance(value, int | float) or not math.isfinite(value):  # a bool is 0 / 1
            raise DataError(f"the reward {spec!r} returned {value!r}; accepted: a finite number")
        return float(value)

    return reward
