"""Corpora: turn a spec ("stdlib", a file, a directory, a glob, *.jsonl, "hf:...") into documents with a fixed split.
The train/val split hashes each document's identity (relative path, file + line, row index), never order or seed."""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fullband.errors import DataError, FullbandWarning, closest
from fullband.files import file_kind

SPLITS = ("train", "val")
DEFAULT_EXTENSIONS = (
    ".txt", ".md", ".rst", ".tex", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java",
    ".js", ".ts", ".sh", ".json", ".toml", ".yaml", ".yml", ".html", ".css", ".csv",
)
# Never walked into: installed third-party code and build debris are not "the corpus" a user points at.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "node_modules"})
HF_PREFIX = "hf:"
INSTALL_HINT = "pip install 'fullband[data]'"
ACCEPTED = "'stdlib', a text file, a directory, a glob pattern, *.jsonl file(s), or 'hf:<path>[:<config>]'"


def in_val(key: str, val_percent: float) -> bool:
    """True iff the document named `key` is held out: sha1(key) mod 10000 < val_percent * 100."""
    bucket = int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:8], "big") % 10000
    return bucket < val_percent * 100


def _short_hash(payload: Any) -> str:
    """16 hex digits of sha256 over canonical JSON, so key order and whitespace never change it."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _stat(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


class Part(Protocol):
    """One resolved source of a corpus; a Corpus chains its parts."""

    def documents(self, split: str, val_percent: float) -> Iterator[Document]: ...
    def identity(self) -> dict: ...
    def summary(self, val_percent: float) -> str: ...


@dataclass(frozen=True)
class TextFiles:
    """Plain text files, one document each, split by relative path.

    When the by-file split leaves one side empty (a corpus of one or a few files), every file is split inside
    its text instead: the last `val_percent` of its characters (from a line start when there is one) is val."""

    label: str  # stdlib | file | directory | glob
    source: str
    files: tuple[Path, ...]
    keys: tuple[str, ...]
    stats: tuple[tuple, ...] = field(repr=False)

    def by_file(self, val_percent: float) -> bool:
        n_val = sum(in_val(k, val_percent) for k in self.keys)
        return 0 < n_val < len(self.keys) or val_percent in (0, 100)

    def documents(self, split: str, val_percent: float) -> Iterator[str]:
        want_val = split == "val"
        by_file = self.by_file(val_percent)
        for path, key in zip(self.files, self.keys):
            if by_file and in_val(key, val_percent) != want_val:
                continue
            # Bytes + explicit decode: no newline translation, and non-UTF-8 files do not stop a run.
            text = path.read_bytes().decode("utf-8", errors="replace")
            if not by_file:  # the last val_percent of the characters is val, from a line start when there is one
                cut = int(len(text) * (1 - val_percent / 100))
                cut = text.rfind("\n", 0, cut) + 1 or cut
                text = text[cut:] if want_val else text[:cut]
            yield text

    def identity(self) -> dict:
        return {"kind": "text", "files": [[k, *s] for k, s in zip(self.keys, self.stats)]}

    def summary(self, val_percent: float) -> str:
        n_val = sum(in_val(k, val_percent) for k in self.keys)
        how = f"{n_val} in val, split by file" if self.by_file(val_percent) else f"last {val_percent:g}% of each is val"
        if self.label == "stdlib":
            return f"stdlib ({self.source}): {len(self.files)} .py files ({how})"
        return f"{self.label} {self.source}: {len(self.files)} files ({how})"


@dataclass(frozen=True)
class Conversation:
    """A document that is a conversation (a JSON-lines row with a `messages` list and no `text_field`): tokenised as
    the model's chat template renders it, its special tokens as tokens (text is read as plain text: a `<|im_start|>`
    written in a document is characters, not the marker), every token trained."""

    messages: tuple  # of fullband.data.chat.messages.Message

    def __len__(self) -> int:  # characters, as a text document's (tokeniser batches are sized by them)
        return sum(len(m.content) for m in self.messages)

    @property
    def text(self) -> str:
        """Its messages' contents, one after another (what a tokenizer is trained on)."""
        return "\n".join(m.content for m in self.messages)


Document = str | Conversation


@dataclass(frozen=True)
class JsonlFiles:
    """JSON-lines files: each line one object whose `text_field` is a document, or without one a conversation (its
    `messages`, a Conversation); split by (file, line number)."""

    source: str
    files: tuple[Path, ...]
    keys: tuple[str, ...]
    stats: tuple[tuple, ...] = field(repr=False)
    text_field: str = "text"

    def documents(self, split: str, val_percent: float) -> Iterator[Document]:
        want_val = split == "val"
        for path, key in zip(self.files, self.keys):
            with path.open("rb") as f:
                for lineno, raw in enumerate(f, start=1):
                    if lineno == 1:
                        raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark is not part of the JSON
                    # Deciding the split first means val reads parse only ~val_percent of the lines.
                    if not raw.strip() or in_val(f"{key}:{lineno}", val_percent) != want_val:
                        continue
                    yield self._text(path, lineno, raw)

    def _text(self, path: Path, lineno: int, raw: bytes) -> Document:
        try:
            obj = json.loads(raw.decode("utf-8", errors="replace"))
        except json.JSONDecodeError as err:
            raise DataError(f"{path}, line {lineno}: not valid JSON ({err.msg}); accepted: one JSON object per "
                            "line") from None
        if isinstance(obj, dict) and self.text_field not in obj and "messages" in obj:
            from fullband.data.chat.messages import check_messages

            return Conversation(tuple(check_messages(obj, f"{path}, line {lineno}", reply=False)))
        if not isinstance(obj, dict) or self.text_field not in obj:
            keys = sorted(obj)[:10] if isinstance(obj, dict) else type(obj).__name__
            raise DataError(f"{path}, line {lineno}: no field {self.text_field!r} (found {keys}); "
                            f"accepted: objects with a string {self.text_field!r} field (or set text_field), or a "
                            "'messages' conversation")
        text = obj[self.text_field]
        if not isinstance(text, str):
            raise DataError(f"{path}, line {lineno}: field {self.text_field!r} is {type(text).__name__} "
                            f"{str(text)[:40]!r}; accepted: a string")
        return text

    def identity(self) -> dict:
        return {"kind": "jsonl", "text_field": self.text_field, "files": [[k, *s] for k, s in zip(self.keys, self.stats)]}

    def summary(self, val_percent: float) -> str:
        return (f"jsonl {self.source}: {len(self.files)} files (field {self.text_field!r} or a 'messages' "
                "conversation a line, split by line)")


@dataclass(frozen=True, eq=False)
class HFRows:
    """A Hugging Face `datasets.Dataset`; each row's `text_field` is a document (with `conversations`, its
    `messages` column: a Conversation); split by row index."""

    source: str
    dataset: Any = field(repr=False)
    text_field: str
    ident: dict = field(repr=False)
    batch_rows: int = 1000
    conversations: bool = False

    def documents(self, split: str, val_percent: float) -> Iterator[Document]:
        want_val = split == "val"
        column = self.dataset.select_columns([self.text_field])
        for start in range(0, len(column), self.batch_rows):
            # Slicing a batch at a time: one Arrow -> Python conversion per batch, not per row.
            texts = column[start : start + self.batch_rows][self.text_field]
            for i, text in enumerate(texts, start=start):
                if in_val(str(i), val_percent) != want_val:
                    continue
                if self.conversations:
                    from fullband.data.chat.messages import check_messages

                    yield Conversation(tuple(check_messages({"messages": text}, f"{self.source}: row {i}",
                                                            reply=False)))
                    continue
                if not isinstance(text, str):
                    raise DataError(f"{self.source}: row {i} field {self.text_field!r} is {type(text).__name__}; "
                                    "accepted: a string")
                yield text

    def identity(self) -> dict:
        return self.ident

    def summary(self, val_percent: float) -> str:
        return f"hf {self.source}: {len(self.dataset)} rows (field {self.text_field!r}, split by row)"


@dataclass(frozen=True, eq=False)
class Corpus:
    """Documents from one or more sources, with a fixed train/val split."""

    spec: str
    parts: tuple[Part, ...]
    val_percent: float = 1.0

    def documents(self, split: str) -> Iterator[Document]:
        """Non-empty documents of `split` ('train' or 'val'), in a fixed order; raises if there are none. A document
        is a text, or a Conversation (a JSON-lines row's `messages`)."""
        if split not in SPLITS:
            raise DataError(f"split={split!r}{closest(str(split), SPLITS)}; accepted: {', '.join(SPLITS)}")
        if (split == "val" and self.val_percent == 0) or (split == "train" and self.val_percent == 100):
            raise DataError(f"corpus {self.spec!r} has no {split!r} split with val_percent={self.val_percent:g}; "
                            "accepted: 0 < val_percent < 100")
        return self._documents(split)

    def texts(self, split: str) -> Iterator[str]:
        """The documents of `split` as text (a conversation's contents), e.g. to train a tokenizer on."""
        for doc in self.documents(split):
            yield doc if isinstance(doc, str) else doc.text

    def _documents(self, split: str) -> Iterator[Document]:
        count = 0
        for part in self.parts:
            for doc in part.documents(split, self.val_percent):
                if doc:  # an empty document would be a lone BOS: skip it
                    count += 1
                    yield doc
        if count == 0:
            hint = (f"use a larger val_percent (now {self.val_percent:g}) or more files/rows" if split == "val"
                    else "the corpus is empty or all of it is held out")
            raise DataError(f"corpus {self.spec!r} has no non-empty documents in its {split!r} split "
                            f"({self.describe()}); {hint}")

    @property
    def fingerprint(self) -> str:
        """Stable hash of the sources (paths, split keys, sizes, mtimes; dataset identity) and the split."""
        return _short_hash({"version": 1, "val_percent": self.val_percent, "parts": [p.identity() for p in self.parts]})

    def describe(self) -> str:
        return " + ".join(p.summary(self.val_percent) for p in self.parts) + f"; val_percent={self.val_percent:g}"


def resolve_corpus(spec: str | Sequence[str], *, text_field: str = "text", val_percent: float = 1.0,
                   extensions: Sequence[str] | None = None, data_files: Any = None, hf_split: str = "train",
                   hf_cache_dir: str | Path | None = None) -> Corpus:
    """The corpus named by `spec` (a string or a list of strings, see ACCEPTED).

    `extensions` picks text files inside directories (default DEFAULT_EXTENSIONS); files named explicitly or by a
    glob are taken whatever their extension. `data_files`, `hf_split` and `hf_cache_dir` go to `datasets`."""
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not specs or not all(isinstance(s, (str, os.PathLike)) for s in specs):
        raise DataError(f"corpus spec {spec!r} is not a string or a non-empty list of strings; accepted: {ACCEPTED}")
    if isinstance(val_percent, bool) or not isinstance(val_percent, (int, float)) or not 0 <= val_percent <= 100:
        raise DataError(f"val_percent={val_percent!r}; accepted: a number from 0 to 100")
    exts = _normalise_extensions(extensions)
    if data_files is not None and not any(str(s).startswith(HF_PREFIX) for s in specs):
        raise DataError(f"data_files={data_files!r} is only used by 'hf:' specs; the spec is {spec!r}")
    parts: list[Part] = []
    for one in map(str, specs):
        if one.startswith(HF_PREFIX):
            parts.append(_hf_part(one, text_field, data_files, hf_split, hf_cache_dir))
        else:
            parts.extend(_file_parts(one, exts, text_field))
    return Corpus(spec=" + ".join(map(str, specs)), parts=tuple(parts), val_percent=float(val_percent))


def _normalise_extensions(extensions: Sequence[str] | None) -> tuple[str, ...]:
    if extensions is None:
        return DEFAULT_EXTENSIONS
    if isinstance(extensions, str):
        extensions = [extensions]
    return tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in extensions)


def _file_parts(spec: str, extensions: tuple[str, ...], text_field: str) -> list[Part]:
    if spec == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        label, files = "stdlib", _walk(root, (".py",))
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            root, label, files = path, "directory", _walk(path, extensions)
        elif path.is_file():
            root, label, files = path.parent, "file", [path]
        elif path.exists() or path.is_symlink():
            raise DataError(f"corpus path {spec!r} is not a regular file or folder ({file_kind(path)}); "
                            f"accepted: {ACCEPTED}")
        elif any(c in spec for c in "*?["):
            root, label = _glob_root(spec), "glob"
            matched = [Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True)]
            files = regular_files([p for p in matched if not p.is_dir()], spec)
            if not files:
                raise DataError(f"corpus glob {spec!r} matches no files; accepted: {ACCEPTED}")
        else:
            raise DataError(f"corpus path not found: {spec!r}; accepted: {ACCEPTED}")
    if not files:
        raise DataError(f"corpus {spec!r} is empty: no files with extensions {' '.join(extensions)} under {root}")
    keyed = sorted((f.relative_to(root).as_posix(), f) for f in files)
    stats = [tuple(_stat(f)) for _, f in keyed]
    if all(s[1] == 0 for s in stats):
        raise DataError(f"corpus {spec!r} is empty: its {len(stats)} file(s) are all empty")
    text = [(k, f, s) for (k, f), s in zip(keyed, stats) if f.suffix.lower() != ".jsonl"]
    jsonl = [(k, f, s) for (k, f), s in zip(keyed, stats) if f.suffix.lower() == ".jsonl"]
    parts: list[Part] = []
    if text:
        k, f, s = zip(*text)
        parts.append(TextFiles(label=label, source=spec if label != "stdlib" else str(root), files=f, keys=k, stats=s))
    if jsonl:
        k, f, s = zip(*jsonl)
        parts.append(JsonlFiles(source=spec, files=f, keys=k, stats=s, text_field=text_field))
    return parts


def _walk(root: Path, extensions: tuple[str, ...]) -> list[Path]:
    found = []
    unreadable: list[str] = []
    for directory, dirs, files in os.walk(root, onerror=lambda err: unreadable.append(f"{err.filename} ({err.strerror})")):
        # Hidden folders (.git, .venv) and EXCLUDED_DIRS are skipped; pruning in place stops the descent.
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in EXCLUDED_DIRS]
        found += [Path(directory, f) for f in files if not f.startswith(".") and Path(f).suffix.lower() in extensions]
    if unreadable:
        warnings.warn(f"corpus {str(root)!r}: skipped {len(unreadable)} folder(s) that cannot be read: "
                      f"{', '.join(unreadable[:5])}", FullbandWarning, stacklevel=4)
    return regular_files(found, str(root))


def regular_files(paths: list[Path], spec: str) -> list[Path]:
    """The regular files among `paths` (symlinks to regular files included); the others (FIFOs, sockets, devices,
    dangling or looping symlinks) are skipped with one warning naming them: reading a FIFO would hang."""
    kinds = [(path, file_kind(path)) for path in paths]
    kept = [path for path, kind in kinds if kind == "a regular file"]
    skipped = [f"{path.name} ({kind})" for path, kind in kinds if kind != "a regular file"]
    if skipped:
        warnings.warn(f"corpus {spec!r}: skipped {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} that "
                      f"{'is' if len(skipped) == 1 else 'are'} not a regular file: {', '.join(skipped[:5])}"
                      f"{' ...' if len(skipped) > 5 else ''}", FullbandWarning, stacklevel=4)
    return kept


def _glob_root(pattern: str) -> Path:
    """The folder a glob's relative keys start from: its leading components without wildcards."""
    parts = Path(os.path.expanduser(pattern)).parts
    lead = list(itertools.takewhile(lambda part: not any(c in part for c in "*?["), parts))
    return Path(*lead) if lead else Path(".")


def _hf_part(spec: str, text_field: str, data_files: Any, hf_split: str, cache_dir: str | Path | None) -> HFRows:
    try:
        import datasets
    except ModuleNotFoundError:
        raise ModuleNotFoundError(f"corpus {spec!r} needs the Hugging Face 'datasets' package; install it with "
                                  f"{INSTALL_HINT}") from None
    path, _, config = spec[len(HF_PREFIX):].partition(":")
    if not path:
        raise DataError(f"corpus spec {spec!r} names no dataset; accepted: 'hf:<path>[:<config>]', e.g. 'hf:json' "
                        "with data_files")
    local = Path(path).expanduser()
    try:
        if local.is_dir() and ((local / "state.json").exists() or (local / "dataset_dict.json").exists()):
            ds = datasets.load_from_disk(str(local))  # a folder written by Dataset.save_to_disk
            ds = ds[hf_split] if isinstance(ds, datasets.DatasetDict) else ds
        else:
            ds = datasets.load_dataset(path, config or None, data_files=data_files, split=hf_split,
                                       cache_dir=None if cache_dir is None else str(cache_dir))
    except (FileNotFoundError, ValueError, KeyError, ConnectionError) as err:
        raise DataError(f"corpus {spec!r} (split {hf_split!r}, data_files={data_files!r}) could not be loaded: "
                        f"{err}") from None
    conversations = text_field not in ds.column_names and "messages" in ds.column_names
    if conversations:
        text_field = "messages"
    elif text_field not in ds.column_names:
        raise DataError(f"corpus {spec!r} has no column {text_field!r}; its columns: {ds.column_names}; set "
                        "text_field (or a 'messages' column: conversations)")
    if len(ds) == 0:
        raise DataError(f"corpus {spec!r} is empty: split {hf_split!r} has 0 rows")
    ident = {"kind": "hf", "path": path, "config": config, "split": hf_split, "text_field": text_field, "rows": len(ds),
             "data_files": _data_file_identity(data_files), "dataset_fingerprint": getattr(ds, "_fingerprint", None)}
    return HFRows(source=spec[len(HF_PREFIX):], dataset=ds, text_field=text_field, ident=ident,
                  conversations=conversations)


def _data_file_identity(data_files: Any) -> Any:
    """data_files with every local file replaced by [path, size, mtime], so edits invalidate token caches."""
    if data_files is None:
        return None
    if isinstance(data_files, dict):
        return {str(k): _data_file_identity(v) for k, v in sorted(data_files.items())}
    items = [data_files] if isinstance(data_files, (str, os.PathLike)) else list(data_files)
    return [_stat(Path(p)) if Path(p).is_file() else str(p) for p in items]
