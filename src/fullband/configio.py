"""Dataclass configs from TOML/JSON mappings: type checks, unknown keys named with the closest valid one,
and dotted `section.key=value` overrides, so every config error says where, what and what is accepted."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from fullband.errors import ConfigError, closest

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return f"{origin.__name__} of {', '.join(_type_name(a) for a in typing.get_args(tp) if a is not Ellipsis)}"
    if origin is dict:
        return "table"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted for floats, lists for tuples."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}={value!r} has the wrong type; accepted: {_type_name(tp)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{where}={value!r} must be null")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}={value!r} must be a {_type_name(tp)}")
        (item,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{where}={value!r} must be a list of {len(args)} values ({_type_name(tp)})")
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}={value!r} must be a table")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):  # TOML has nan and inf; no setting of ours means either
                raise ConfigError(f"{where}={value!r} is not a finite number; accepted: a finite number")
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{where}={value!r} must be {_type_name(tp)} (got {type(value).__name__})")


def from_dict(cls: type[T], data: Any, where: str = "") -> T:
    """Build dataclass `cls` from a mapping, recursively; `where` prefixes error messages (e.g. 'train')."""
    label = where or cls.__name__
    if not isinstance(data, dict):
        raise ConfigError(f"[{label}] must be a table of settings, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"unknown key {_join(where, key)!r}{closest(key, names)}; accepted in [{label}]: "
                              f"{', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], _join(where, key))
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise ConfigError(f"[{label}] {err}") from None


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain mapping (tuples become lists), the inverse of from_dict."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def apply_overrides(data: dict, pairs: list[str] | None) -> dict:
    """Apply ['train.steps=100', 'model.fusion="additive"'] to a nested mapping (values parsed as TOML; a bare
    word that is not TOML is a string; the bare word null unsets an optional key, as a JSON run record writes it,
    since TOML has no null: 'model.sliding_window=null')."""
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {pair!r} is not key=value (e.g. --set train.steps=100)")
        try:
            value = None if raw.strip() == "null" else tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {pair!r}: {part!r} is not a section")
        node[leaf] = value
    return data


def read_settings_file(path: Path, kind: str) -> dict:
    """The table in a TOML or JSON settings file, with one-line errors for a missing, unreadable, binary or
    malformed file."""
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "is not a regular file" if path.exists() else "does not exist"
        raise ConfigError(f"config file {str(path)!r} {what}; accepted: a {kind} file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not a text file (invalid UTF-8 at byte {err.start}); accepted: a {kind} "
                          "file") from None
    except OSError as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {err.strerror}") from None
    try:
        data = json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: malformed {kind}: {err}") from None
    except RecursionError:
        raise ConfigError(f"{path}: malformed {kind}: nested too deeply to read") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table of settings, got a JSON {type(data).__name__}")
    return data


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
