"""Token shards: tokenise a corpus split once, as `[bos] + ids` per document, into uint16/uint32 files + a manifest.
The cache folder is keyed by corpus, tokenizer and split, written atomically, reused when it matches, read by memmap."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np
from tqdm.auto import tqdm

from fullband.data.corpus import Conversation, Corpus, Document
from fullband.errors import DataError
from fullband.files import Kind, make_folder, make_temp, publish_folder, read_json, sweep_temps, writing

FORMAT = "fullband-tokens"
VERSION = 1
MANIFEST = "manifest.json"
CACHE_KIND = Kind("token cache", frozenset({MANIFEST}), patterns=(r"tokens-\d{5}\.bin",))
# our temporary folders: `.NAME.*.tmp` (locked while written), and `.NAME.tmp-*` of fullband 0.1.0 (never locked)
TEMP_PATTERN = r"\.(train|val)-[0-9a-f]{12}\.(.+\.tmp|tmp-.+)"
SHARD_TOKENS = 64 * 2**20  # ~128 MiB per uint16 shard: large files, few handles
BATCH_CHARS = 4 * 2**20  # text handed to encode_batch at once: big enough for its thread pool, small in memory


class TokenizerLike(Protocol):
    kind: str
    vocab_size: int
    bos_id: int

    @property
    def fingerprint(self) -> str: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def cache_key(corpus_fingerprint: str, tokenizer_fingerprint: str, split: str) -> str:
    payload = json.dumps([FORMAT, VERSION, corpus_fingerprint, tokenizer_fingerprint, split])
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


class TokenStream:
    """Read-only view of a cache folder's shards as one flat token sequence (memory-mapped, nothing loaded)."""

    def __init__(self, path: Path, manifest: dict, shards: list[np.memmap], *, cached: bool) -> None:
        self.path, self.manifest, self.cached = path, manifest, cached  # cached: reused, nothing was tokenised
        self._shards = shards
        self._starts = np.cumsum([0] + [len(s) for s in shards])  # token offset of each shard, then the total
        tokenizer = manifest.get("tokenizer")
        vocab = tokenizer.get("vocab_size") if isinstance(tokenizer, dict) else None
        self._vocab = vocab if isinstance(vocab, int) and vocab > 0 else int(np.iinfo(_dtype(manifest["dtype"])).max) + 1

    @classmethod
    def open(cls, directory: str | Path, *, cached: bool = True) -> "TokenStream":
        path = Path(directory)
        manifest = _read_manifest(path)
        if manifest is None:
            raise DataError(f"{path / MANIFEST} is missing or not a {FORMAT} v{VERSION} manifest; delete {path} to "
                            "rebuild it")
        dtype = _dtype(manifest["dtype"])
        shards = []
        for entry in manifest["shards"]:
            file = path / entry["file"]
            expected = entry["n_tokens"] * dtype.itemsize
            size = file.stat().st_size if file.exists() else None
            if size != expected:
                raise DataError(f"token shard {file} has {size} bytes, its manifest says {expected}; delete {path} "
                                "to rebuild it")
            shards.append(np.memmap(file, dtype=dtype, mode="r", shape=(entry["n_tokens"],)))
        return cls(path, manifest, shards, cached=cached)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __repr__(self) -> str:
        return f"TokenStream({str(self.path)!r}, n_tokens={len(self)}, shards={len(self._shards)}, cached={self.cached})"

    @property
    def dtype(self) -> np.dtype:
        return _dtype(self.manifest["dtype"])

    def head(self, n: int) -> "TokenStream":
        """The stream's first n tokens, as a stream of their own (same cache and fingerprint; nothing copied)."""
        if not 0 < n <= len(self):
            raise DataError(f"{n:,} tokens asked of a stream of {len(self):,}; accepted: 1 <= n <= {len(self):,}")
        cut = [s[: max(0, min(len(s), n - int(start)))] for s, start in zip(self._shards, self._starts)]
        return TokenStream(self.path, self.manifest, [s for s in cut if len(s)], cached=self.cached)

    @property
    def fingerprint(self) -> str:
        """Identity of the tokens: the cache key of (corpus, tokenizer, split, format)."""
        return self.manifest["key"]

    def slice(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as a new array, gathered across shard boundaries."""
        n = len(self)
        if not 0 <= start <= stop <= n:
            raise DataError(f"token slice [{start}, {stop}) is outside the stream; accepted: 0 <= start <= stop <= {n}")
        out = np.empty(stop - start, dtype=self.dtype)
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            lo = pos - int(self._starts[i])
            take = min(stop, int(self._starts[i + 1])) - pos
            out[pos - start : pos - start + take] = self._shards[i][lo : lo + take]
            pos += take
            i += 1
        if len(out) and int(out.max()) >= self._vocab:  # a tokenizer never writes such an id: the file was damaged
            raise DataError(f"token cache {self.path} is damaged: tokens {start}..{stop} hold id {int(out.max())}, "
                            f"but its tokenizer has {self._vocab} ids; delete {self.path} and it is rebuilt")
        return out

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise DataError(f"TokenStream supports stream[start:stop] only, got {index!r}")
        start, stop, _ = index.indices(len(self))
        return self.slice(start, max(start, stop))


def _dtype(name: str) -> np.dtype:
    # Shards are little-endian on every machine, so a cache can be copied between hosts.
    return np.dtype(name).newbyteorder("<")


def tokenize_corpus(corpus: Corpus, tokenizer: TokenizerLike, split: str, cache_dir: str | Path, *,
                    progress: bool = True, shard_tokens: int = SHARD_TOKENS) -> TokenStream:
    """The token stream of `split`, from `cache_dir` when a matching cache exists, else tokenised now."""
    if shard_tokens < 1:
        raise DataError(f"shard_tokens={shard_tokens}; accepted: an integer >= 1")
    key = cache_key(corpus.fingerprint, tokenizer.fingerprint, split)
    cache_dir = Path(cache_dir)
    out = cache_dir / f"{split}-{key}"
    # temporary folders of writers that were killed (a live writer holds a lock on its own)
    sweep_temps(cache_dir, TEMP_PATTERN)
    if _read_manifest(out, key) is not None:
        try:
            return TokenStream.open(out, cached=True)
        except DataError:
            shutil.rmtree(out, ignore_errors=True)  # a damaged cache (missing or truncated shard) is rebuilt
    make_folder(cache_dir, "token cache folder")
    action = f"tokenise the {split!r} split into the cache"
    with writing(cache_dir, action):
        tmp, lock = make_temp(cache_dir, f".{out.name}.")
    try:
        with writing(tmp, action):
            _write_shards(tmp, corpus, tokenizer, split, key, progress=progress, shard_tokens=shard_tokens)
            _publish(tmp, out, key)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # still there unless it was published
        lock.release()
    return TokenStream.open(out, cached=False)


def _write_shards(tmp: Path, corpus: Corpus, tokenizer: TokenizerLike, split: str, key: str, *, progress: bool,
                  shard_tokens: int) -> None:
    dtype = _dtype(token_dtype(tokenizer.vocab_size).name)
    writer = _ShardWriter(tmp, dtype, shard_tokens)
    n_docs = 0
    encode = _Encoder(tokenizer, corpus)
    with tqdm(desc=f"tokenising {split}", unit="doc", disable=not progress, dynamic_ncols=True) as bar:
        for batch in _batches(corpus.documents(split)):
            writer.add(_with_bos(encode(batch), tokenizer.bos_id, dtype))
            n_docs += len(batch)
            bar.update(len(batch))
    writer.close()
    if writer.n_tokens == 0:
        raise DataError(f"split {split!r} of corpus {corpus.describe()} gave 0 tokens; accepted: a corpus with text")
    manifest = {"format": FORMAT, "version": VERSION, "key": key, "split": split,
                "corpus": {"fingerprint": corpus.fingerprint, "description": corpus.describe()},
                "tokenizer": {"fingerprint": tokenizer.fingerprint, "kind": tokenizer.kind,
                              "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id},
                "dtype": dtype.name, "n_documents": n_docs, "n_tokens": writer.n_tokens, "shards": writer.shards}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


class _Encoder:
    """Ids of a batch of documents: texts read as plain text (encode_batch), conversations as the tokenizer's chat
    template renders them (made on the first one; DataError naming the corpus when the tokenizer has none)."""

    def __init__(self, tokenizer: TokenizerLike, corpus: Corpus) -> None:
        self.tokenizer, self.corpus, self.template = tokenizer, corpus, None

    def __call__(self, batch: list[Document]) -> list[list[int]]:
        texts = [i for i, doc in enumerate(batch) if isinstance(doc, str)]
        if len(texts) == len(batch):
            return self.tokenizer.encode_batch(batch)
        out: list[list[int]] = [[] for _ in batch]
        for i, ids in zip(texts, self.tokenizer.encode_batch([batch[i] for i in texts])):
            out[i] = ids
        for i, doc in enumerate(batch):
            if isinstance(doc, Conversation):
                out[i] = [t for _, seg in self._template().segments(list(doc.messages)) for t in seg]
        return out

    def _template(self):
        if self.template is None:
            from fullband.data.chat.templates import chat_template

            try:
                self.template = chat_template(self.tokenizer)
            except DataError as err:
                raise DataError(f"corpus {self.corpus.describe()} holds conversations (JSON-lines rows with "
                                f"'messages'), read as the model's chat template renders them: {err}") from None
        return self.template


def _with_bos(batch: list[list[int]], bos_id: int, dtype: np.dtype) -> np.ndarray:
    """One flat array of `[bos] + ids` for every document of the batch."""
    out = np.empty(sum(len(ids) + 1 for ids in batch), dtype=dtype)
    pos = 0
    for ids in batch:
        out[pos] = bos_id
        out[pos + 1 : pos + 1 + len(ids)] = ids  # numpy raises OverflowError rather than wrapping a too-large id
        pos += len(ids) + 1
    return out


def _batches(docs: Iterable[Document], max_chars: int = BATCH_CHARS,
             max_docs: int = 1024) -> Iterator[list[Document]]:
    batch, chars = [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if chars >= max_chars or len(batch) >= max_docs:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


class _ShardWriter:
    """Appends token arrays to tokens-NNNNN.bin files of at most `shard_tokens` tokens each."""

    def __init__(self, directory: Path, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.dtype, self.shard_tokens = directory, dtype, shard_tokens
        self.shards: list[dict] = []
        self.n_tokens = 0
        self._file = None

    def add(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._file is None or self.shards[-1]["n_tokens"] == self.shard_tokens:
                self._next_file()
            room = self.shard_tokens - self.shards[-1]["n_tokens"]
            head, tokens = tokens[:room], tokens[room:]
            self._file.write(head.astype(self.dtype, copy=False).tobytes())
            self.shards[-1]["n_tokens"] += len(head)
            self.n_tokens += len(head)

    def _next_file(self) -> None:
        self.close()
        name = f"tokens-{len(self.shards):05d}.bin"
        self._file = open(self.directory / name, "wb")  # noqa: SIM115 - closed in _next_file / close
        self.shards.append({"file": name, "n_tokens": 0})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _publish(tmp: Path, out: Path, key: str) -> None:
    """Move the finished folder into place; a stale folder of ours is replaced, a concurrent writer's result is
    kept, and anything else in the way is refused."""
    if _read_manifest(out, key) is not None:
        return  # another process finished the same cache while we tokenised; the caller drops ours
    if out.is_symlink() or (out.exists() and not (out.is_dir() and CACHE_KIND.recognises(out))):
        raise DataError(f"{out} is in the way of the token cache and was not written by fullband; move it away "
                        "(or choose another data.cache_dir)")
    try:
        publish_folder(tmp, out, replace=out.exists())
    except OSError:
        if _read_manifest(out, key) is None:  # another process won the race only if its result is complete
            raise


def _read_manifest(directory: Path, key: str | None = None) -> dict | None:
    """The folder's manifest if it is a complete one of this format (and `key`), else None."""
    manifest = read_json(directory / MANIFEST)
    if manifest is None or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        return None
    return None if key is not None and manifest.get("key") != key else manifest
