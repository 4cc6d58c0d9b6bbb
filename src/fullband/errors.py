"""Error types a user can act on: each names what was wrong, the value seen and what is accepted."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class FullbandError(Exception):
    """Base class for every error fullband raises on purpose."""


class ConfigError(FullbandError, ValueError):
    """A configuration value is invalid."""


class InputError(FullbandError, ValueError):
    """An argument to a public function (prompt, mode, token ids, ...) is invalid."""


class DataError(FullbandError, ValueError):
    """A corpus, token cache or data sampler setting is missing, malformed or does not match."""


class CheckpointError(FullbandError, OSError):
    """A checkpoint folder is missing, incomplete, corrupted or does not match its config."""


class MissingPackage(FullbandError, ImportError):
    """An optional package a feature needs is not installed; the message says how to install it."""


class TrainingDiverged(FullbandError):
    """A loss, gradient or weight became NaN or infinite (training or RL); the run stopped before writing it."""


class FullbandWarning(UserWarning):
    """Something was accepted but deserves a look (e.g. config keys filled with defaults)."""


def closest(name: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest valid name, or '' when nothing is close."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""
