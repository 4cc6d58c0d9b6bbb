"""Tokenizers: bytes (256 ids + BOS/EOS/PAD, no training), a trained byte-level BPE (Hugging Face `tokenizers`),
and a pretrained model's own tokenizer (for runs warm-started from a Hugging Face model).
A checkpoint's `tokenizer.json` is our small JSON (`"fullband_tokenizer": "byte"`) or a standard HF tokenizer.json
(with `special_ids.json` beside it for a pretrained model's tokenizer)."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fullband.data.corpus import _short_hash, resolve_corpus
from fullband.errors import CheckpointError, InputError, MissingPackage
from fullband.files import Kind, atomic_folder, check_destination, parse_json, read_json_file, read_text

TOKENIZER_FILE = "tokenizer.json"
BYTE_TOKENIZER_FILE = "fullband_tokenizer.json"  # beside a transformers folder of ours: the byte tokenizer it was made from
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # beside a pretrained model's tokenizer.json: its own chat template
SPECIAL_IDS_FILE = "special_ids.json"  # beside a pretrained model's tokenizer.json: its BOS / EOS / PAD ids
TOKENIZER_KIND = Kind("tokenizer folder", frozenset({TOKENIZER_FILE, SPECIAL_IDS_FILE, CHAT_TEMPLATE_FILE}))
SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")
# The role markers of fullband's default chat template (fullband.data.chat.templates.MarkerTemplate), special tokens
# of a chat vocabulary: <|system|> / <|user|> / <|assistant|> open a turn, <|end|> closes it.
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
INSTALL_HINT = "pip install 'fullband[data]'"


def _check_text(text: Any) -> str:
    if not isinstance(text, str):
        raise InputError(f"text must be a str, got {type(text).__name__}")
    return text


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS=256, EOS=257, PAD=258; with `chat=True` the chat markers follow
    (CHAT_TOKENS as ids 259..262)."""

    kind = "byte"
    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259
    chat_template = None  # the markers are the template (fullband.data.chat.templates.MarkerTemplate)

    def __init__(self, chat: bool = False) -> None:
        self.chat = bool(chat)
        if self.chat:
            self.vocab_size = ByteTokenizer.vocab_size + len(CHAT_TOKENS)

    @property
    def chat_ids(self) -> dict[str, int] | None:
        """Marker -> id of the chat markers (None: a vocabulary without them)."""
        return {t: ByteTokenizer.vocab_size + i for i, t in enumerate(CHAT_TOKENS)} if self.chat else None

    def with_chat_tokens(self) -> "ByteTokenizer":
        """This vocabulary with the chat markers added (itself when it has them)."""
        return self if self.chat else ByteTokenizer(chat=True)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a generation by default (fullband generate stops at them unless --ignore-eos): EOS,
        and the end-of-turn marker of a chat vocabulary."""
        chat = self.chat_ids
        return (self.eos_id,) + ((chat["<|end|>"],) if chat else ())

    @property
    def fingerprint(self) -> str:
        return _short_hash(self._payload())

    add_bos = True  # a prompt starts with BOS (fullband's own vocabularies; a pretrained model's says)

    def encode(self, text: str, *, bos: bool | None = None, eos: bool = False, special: bool = False) -> list[int]:
        """Ids of `text`, with BOS in front when `bos` is true (default: the vocabulary's add_bos: always for
        fullband's own vocabularies, as the model's tokenizer does for a pretrained one). Special-token text is read
        as text in fullband's own vocabularies whatever `special` says (their BOS is a document start); a pretrained
        model's tokenizer reads its special tokens (PretrainedTokenizer.encode)."""
        bos = self.add_bos if bos is None else bos
        return ([self.bos_id] if bos else []) + self._ids(_check_text(text)) + ([self.eos_id] if eos else [])

    def _ids(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, without BOS/EOS (the fast path used to build token shards)."""
        return [self._ids(_check_text(text)) for text in texts]

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        """Text of the byte ids (invalid UTF-8 becomes U+FFFD); special ids are dropped or shown as <bos> etc."""
        chat = {i: t for t, i in (self.chat_ids or {}).items()}
        names = {self.bos_id: "<bos>", self.eos_id: "<eos>", self.pad_id: "<pad>", **chat}
        parts, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
            elif not skip_special:
                parts += [run.decode("utf-8", errors="replace"), names.get(i, f"<{i}>")]
                run = bytearray()
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def _payload(self) -> dict:
        payload = {"fullband_tokenizer": self.kind, "version": 1, "vocab_size": self.vocab_size}
        if self.chat:  # only then: a plain byte vocabulary keeps its fingerprint (token caches, resumes)
            payload["chat_tokens"] = list(CHAT_TOKENS)
        return payload

    def to_hf(self):
        """The same tokenizer as a Hugging Face `tokenizers.Tokenizer` (ids 0..255 the bytes, then <bos>, <eos>,
        <pad>; BOS added in front, as `encode` does), so transformers and vLLM can read text for a byte model."""
        tk = _hf_tokenizers()
        vocab = {char: byte for byte, char in _byte_chars().items()}
        tokenizer = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
        tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = tk.decoders.ByteLevel()
        tokenizer.add_special_tokens(list(SPECIAL_TOKENS))  # ids 256, 257, 258 in this order
        if self.chat:
            tokenizer.add_special_tokens(list(CHAT_TOKENS))  # ids 259.. in this order
        tokenizer.post_processor = tk.processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", self.bos_id)])
        return tokenizer

    def save(self, directory: str | Path, *, name: str = TOKENIZER_FILE) -> None:
        (Path(directory) / name).write_text(json.dumps(self._payload(), indent=2) + "\n")


def _byte_chars() -> dict[int, str]:
    """Byte -> the printable character byte-level BPE uses for it (printable Latin-1 bytes stand for
    themselves; the others take code points from 256 up, in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(others)) for b in range(256)}


def _hf_tokenizers():
    """The `tokenizers` package, imported only when BPE is used so the byte path needs no extra install."""
    try:
        import tokenizers
    except ModuleNotFoundError:
        raise ModuleNotFoundError(f"BPE tokenizers need the Hugging Face 'tokenizers' package; install it with "
                                  f"{INSTALL_HINT}") from None
    return tokenizers


class BPETokenizer:
    """Byte-level BPE (Hugging Face `tokenizers`) with the same interface as ByteTokenizer.

    Special tokens are only ever added by `encode(bos=..., eos=...)`: text that happens to contain
    "<bos>" is encoded as plain text, because the model reads every BOS id as a document start."""

    kind = "bpe"

    def __init__(self, hf_tokenizer: Any, *, source: str = "the given tokenizer",
                 special_ids: tuple[int, int, int] | None = None) -> None:
        if special_ids is None:
            ids = [hf_tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
            if None in ids:
                missing = [t for t, i in zip(SPECIAL_TOKENS, ids) if i is None]
                raise InputError(f"{source} lacks the special tokens {missing}; accepted: a BPE with "
                                 f"{list(SPECIAL_TOKENS)}")
        else:
            ids = list(special_ids)
        self._tok = hf_tokenizer
        # Not saved in tokenizer.json by the library, so set on every construction.
        self._tok.encode_special_tokens = True
        self.bos_id, self.eos_id, self.pad_id = ids
        self.vocab_size = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        # the fingerprint hashes the tokenizer as constructed; parsing and hashing its JSON (a quarter of a second for
        # a 49K vocabulary) waits until a token cache asks for it
        self._fingerprint_of = (hf_tokenizer.to_str(), None if special_ids is None else ids)
        self._fingerprint: str | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> "BPETokenizer":
        return cls(_hf_tokenizers().Tokenizer.from_file(str(path)), source=str(path))

    chat_template: str | None = None  # a pretrained model's own template (PretrainedTokenizer)

    @property
    def chat_ids(self) -> dict[str, int] | None:
        """Marker -> id of the chat markers (None: a vocabulary without them)."""
        ids = {t: self._tok.token_to_id(t) for t in CHAT_TOKENS}
        return None if None in ids.values() else ids

    def with_chat_tokens(self) -> "BPETokenizer":
        """This vocabulary with the chat markers added as special tokens after its last id (itself when it has
        them); saved with it, so `AutoTokenizer` reads them after `fullband convert`."""
        if self.chat_ids is not None:
            return self
        grown = _hf_tokenizers().Tokenizer.from_str(self._tok.to_str())
        grown.add_special_tokens(list(CHAT_TOKENS))
        return type(self)._grown(self, grown)

    @classmethod
    def _grown(cls, old: "BPETokenizer", grown: Any) -> "BPETokenizer":
        return cls(grown, source="the tokenizer with chat markers")

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            text, ids = self._fingerprint_of
            payload = json.loads(text)
            self._fingerprint = _short_hash(payload if ids is None else [payload, ids])
            self._fingerprint_of = None
        return self._fingerprint

    @property
    def hf_tokenizer(self) -> Any:
        return self._tok

    stop_ids = ByteTokenizer.stop_ids

    add_bos = ByteTokenizer.add_bos

    encode = ByteTokenizer.encode

    def _ids(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, without BOS/EOS; runs in the library's Rust thread pool."""
        # encode_batch_fast skips offset tracking, which we never read.
        encodings = self._tok.encode_batch_fast([_check_text(text) for text in texts], add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def save(self, directory: str | Path) -> None:
        self._tok.save(str(Path(directory) / TOKENIZER_FILE))


class PretrainedTokenizer(BPETokenizer):
    """The tokenizer of a pretrained Hugging Face model (its tokenizer.json, any model type), with the BOS / EOS
    ids of the model's config (a model without a BOS uses its EOS as the document separator, as GPT-2 does).
    Saved as tokenizer.json + special_ids.json so a run or checkpoint folder reloads it as it was."""

    kind = "pretrained"

    def __init__(self, hf_tokenizer: Any, *, source: str = "the given tokenizer",
                 special_ids: tuple[int, int, int] | None = None, stop_ids: tuple[int, ...] = (),
                 chat_template: str | None = None, add_bos: bool = True) -> None:
        super().__init__(hf_tokenizer, source=source, special_ids=special_ids)
        self._parsing = None  # the backend encode() reads special tokens with, made on first use
        self._stop_ids = tuple(stop_ids) or (self.eos_id,)
        self.add_bos = bool(add_bos)  # whether the model's own tokenizer starts a text with BOS (SmolLM2's: no)
        self.chat_template = chat_template or None

    @property
    def fingerprint(self) -> str:
        base = super().fingerprint  # the template is part of what a run trains on
        return _short_hash([base, self.chat_template]) if self.chat_template else base

    @classmethod
    def _grown(cls, old: "BPETokenizer", grown: Any) -> "BPETokenizer":
        return cls(grown, source="the tokenizer with chat markers", special_ids=(old.bos_id, old.eos_id, old.pad_id),
                   stop_ids=old.stop_ids, chat_template=old.chat_template, add_bos=old.add_bos)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a generation by default: the model's own EOS id(s) (a Llama 3 has several)."""
        return self._stop_ids

    def encode(self, text: str, *, bos: bool | None = None, eos: bool = False, special: bool = True) -> list[int]:
        """Ids of a prompt `text`, read as the model's own tokenizer reads it (transformers, vLLM and llama.cpp
        alike): its special tokens written as text (`<|im_start|>`) become those tokens; `special=False` reads them
        as plain text (untrusted input). BOS / EOS as in ByteTokenizer.encode. Corpora (encode_batch) are read as
        plain text; a conversation is read through the model's chat template, as transformers reads it."""
        if not special:
            return super().encode(text, bos=bos, eos=eos)
        if self._parsing is None:  # a second backend that parses special tokens (the first one never does)
            self._parsing = _hf_tokenizers().Tokenizer.from_str(self._tok.to_str())
            self._parsing.encode_special_tokens = False
        bos = self.add_bos if bos is None else bos
        ids = self._parsing.encode(_check_text(text), add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + list(ids) + ([self.eos_id] if eos else [])

    @classmethod
    def from_pretrained(cls, path: str | Path, *, stop_ids: tuple[int, ...] = ()) -> "PretrainedTokenizer":
        """The fast tokenizer of the model at `path` (a folder, a GGUF file, or a hub id when online); `stop_ids`
        (default: its EOS) are the ids that end a generation."""
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise MissingPackage("a pretrained model's tokenizer needs transformers: pip install 'fullband[hf]'") from None
        from fullband.gguf_file import gguf_args, gguf_path

        name, extra = gguf_args(path)
        version = _source_version(gguf_path(path))
        key = None if version is None else (version, tuple(stop_ids))
        if key in _LOADED:
            _LOADED.move_to_end(key)
            return _LOADED[key]
        tok = _LOADED.get(version)  # transformers' tokenizer, read for other stop ids
        if tok is None:
            try:
                tok = AutoTokenizer.from_pretrained(name, **extra)
            except (OSError, ValueError) as err:
                raise InputError(f"no tokenizer could be loaded from {str(path)!r}: {err}") from None
            _kept(version, tok)
        return _kept(key, cls.from_hf(tok, source=str(path), stop_ids=stop_ids))

    @classmethod
    def from_hf(cls, tok: Any, *, source: str, stop_ids: tuple[int, ...] = ()) -> "PretrainedTokenizer":
        """A transformers fast tokenizer as fullband reads it: its ids, special tokens, BOS policy and template."""
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None:
            raise InputError(f"the tokenizer of {str(source)!r} ({type(tok).__name__}) is not a fast tokenizer; "
                             "accepted: a model with a tokenizer.json")
        eos = tok.eos_token_id
        bos = tok.bos_token_id if tok.bos_token_id is not None else eos
        if bos is None:
            raise InputError(f"the tokenizer of {str(source)!r} has neither a BOS nor an EOS token; fullband needs a "
                             "document-start token")
        eos = eos if eos is not None else bos
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        template = getattr(tok, "chat_template", None)
        # the model's BOS policy, as its tokenizer applies it: does encoding a text put BOS in front?
        plain = tok("a", add_special_tokens=False)["input_ids"]
        full = tok("a")["input_ids"]
        add_bos = len(full) > len(plain) and full[:1] == [tok.bos_token_id]
        return cls(backend, source=str(source), special_ids=(bos, eos, pad), stop_ids=stop_ids,
                   chat_template=template if isinstance(template, str) else None, add_bos=add_bos)

    def save_ids(self, directory: str | Path) -> None:
        """special_ids.json: what the vocabulary alone does not say (BOS / EOS / PAD, the stop ids, the BOS policy)."""
        ids = {"bos_id": self.bos_id, "eos_id": self.eos_id, "pad_id": self.pad_id, "stop_ids": list(self.stop_ids),
               "add_bos": self.add_bos}
        (Path(directory) / SPECIAL_IDS_FILE).write_text(json.dumps(ids, indent=2) + "\n")

    def token(self, i: int) -> str:
        """The text of id `i` in the vocabulary (a special token's name, e.g. '<|im_end|>')."""
        return self._tok.id_to_token(i)

    def save(self, directory: str | Path) -> None:
        super().save(directory)
        self.save_ids(directory)
        if self.chat_template:
            (Path(directory) / CHAT_TEMPLATE_FILE).write_text(self.chat_template, encoding="utf-8")


def train_bpe(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2,
              show_progress: bool = True) -> BPETokenizer:
    """A byte-level BPE trained on `texts` by the `tokenizers` library; ids 0..2 are <bos>, <eos>, <pad>."""
    # 256 byte symbols + 3 specials are always in the vocabulary, so anything smaller cannot be honoured.
    floor = 256 + len(SPECIAL_TOKENS)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < floor:
        raise InputError(f"vocab_size={vocab_size!r} is too small; accepted: an integer >= {floor} "
                         "(256 bytes + 3 specials)")
    if not isinstance(min_frequency, int) or min_frequency < 1:
        raise InputError(f"min_frequency={min_frequency!r}; accepted: an integer >= 1")
    tk = _hf_tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    # add_prefix_space=False keeps decode(encode(x)) == x exactly.
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                     special_tokens=list(SPECIAL_TOKENS), show_progress=show_progress,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(tok, source="the trained tokenizer")


class TextStream:
    """The text of a growing sequence of ids, piece by piece, as a terminal shows a generation: each piece ends on a
    whole character (a partial UTF-8 character, decoded as U+FFFD, is held back until it completes or `rest`)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def push(self, token: int) -> str:
        """Add one id -> the new text it completes ('' while a character is incomplete)."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece

    def rest(self) -> str:
        """What is still held back (an incomplete character, as the tokenizer decodes it)."""
        piece = self.tokenizer.decode(self.ids)[len(self.shown):]
        self.shown += piece
        return piece


# the tokenizers load_tokenizer read, by the contents of the files it read them from (a reproduction reads the same
# 49K vocabulary dozens of times from as many run and checkpoint folders, each its own copy: 0.4 s a read against
# milliseconds to hash the files), and those PretrainedTokenizer.from_pretrained read (with transformers' tokenizer
# under them), by the source's file versions (a GGUF file's vocabulary takes seconds to parse); a rewritten file is
# read again. Nothing changes a tokenizer once made (what adds tokens copies its backend first) and a tokenizer keeps
# no path, so callers may share one.
_LOADED: OrderedDict = OrderedDict()
_LOADED_MAX = 8


def load_tokenizer(directory: str | Path) -> ByteTokenizer | BPETokenizer | PretrainedTokenizer:
    """The tokenizer saved in a checkpoint folder (a transformers folder of ours: the byte tokenizer kept beside it,
    else its tokenizer.json); a folder without one gets the byte tokenizer."""
    key = _files_key(Path(directory))
    if key in _LOADED:
        _LOADED.move_to_end(key)
        return _LOADED[key]
    tokenizer = _read_tokenizer(directory)
    return _kept(key, tokenizer) if isinstance(tokenizer, BPETokenizer) else tokenizer


def _kept(key: Any, tokenizer: Any) -> Any:
    if key is not None:
        _LOADED[key] = tokenizer
        while len(_LOADED) > _LOADED_MAX:
            _LOADED.popitem(last=False)
    return tokenizer


def _source_version(path: Path) -> tuple | None:
    """What tells two versions of a pretrained model's tokenizer apart (PretrainedTokenizer.from_pretrained): a GGUF
    file's version (path, size, modification time: hashing it would read gigabytes), a folder's files' versions;
    None for a hub id or a path that cannot be examined."""
    from fullband.gguf_file import file_version

    try:
        if path.is_file():
            return "pretrained", file_version(path)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file())
            return "pretrained", str(path.resolve()), tuple(file_version(p) for p in files)
    except OSError:
        pass
    return None


def _files_key(directory: Path) -> bytes | None:
    """A digest of what load_tokenizer reads in `directory`: which of its files are there and their bytes (None:
    one cannot be read)."""
    digest = hashlib.sha256()
    for name in (BYTE_TOKENIZER_FILE, TOKENIZER_FILE, SPECIAL_IDS_FILE, CHAT_TEMPLATE_FILE):
        try:
            data = (directory / name).read_bytes()
        except FileNotFoundError:
            digest.update(b"-")
            continue
        except OSError:
            return None
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.digest()


def _read_tokenizer(directory: str | Path) -> ByteTokenizer | BPETokenizer | PretrainedTokenizer:
    path = Path(directory) / BYTE_TOKENIZER_FILE
    if not path.is_file():
        path = Path(directory) / TOKENIZER_FILE
    if not (path.exists() or path.is_symlink()):
        return ByteTokenizer()
    text = read_text(path, "the tokenizer", error=CheckpointError)
    data = parse_json(text, f"{path} is corrupted", error=CheckpointError)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}; accepted: a tokenizer JSON object")
    if "fullband_tokenizer" in data:
        kind = data["fullband_tokenizer"]
        if kind == "byte":
            chat = data.get("chat_tokens")
            if chat not in (None, list(CHAT_TOKENS)):
                raise CheckpointError(f"{path}: chat_tokens={chat!r}; accepted: {list(CHAT_TOKENS)} or none")
            return ByteTokenizer(chat=chat is not None)
        raise CheckpointError(f"{path}: unknown tokenizer kind {kind!r}; accepted: 'byte' (or a Hugging Face BPE "
                              "tokenizer.json)")
    ids_path = Path(directory) / SPECIAL_IDS_FILE
    if ids_path.is_file():
        try:
            ids = read_json_file(ids_path, "the special ids", error=CheckpointError)
            special = (int(ids["bos_id"]), int(ids["eos_id"]), int(ids["pad_id"]))
            stops = tuple(int(i) for i in ids.get("stop_ids", ()))
            add_bos = ids.get("add_bos", True)  # folders written before the policy was kept: BOS, as then
            if not isinstance(add_bos, bool):
                raise ValueError(f"add_bos={add_bos!r}; accepted: true or false")
            template_path = Path(directory) / CHAT_TEMPLATE_FILE
            template = read_text(template_path, "the chat template", error=CheckpointError) if \
                template_path.is_file() else None
            return PretrainedTokenizer(_hf_tokenizers().Tokenizer.from_str(text), source=str(path), special_ids=special,
                                       stop_ids=stops, chat_template=template, add_bos=add_bos)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{ids_path} is corrupted: {err}") from None
        except Exception as err:  # the Rust side raises a plain Exception on any schema problem
            raise CheckpointError(f"{path} is not a valid Hugging Face tokenizer.json: {err}") from None
    model_type = data.get("model", {}).get("type") if isinstance(data.get("model"), dict) else None
    if model_type != "BPE":
        raise CheckpointError(f"{path}: unrecognised tokenizer file (model type {model_type!r}); "
                              "accepted: a fullband byte tokenizer or a Hugging Face BPE tokenizer.json")
    tk = _hf_tokenizers()
    try:
        hf = tk.Tokenizer.from_str(text)
    except Exception as err:  # the Rust side raises a plain Exception on any schema problem
        raise CheckpointError(f"{path} is not a valid Hugging Face tokenizer.json: {err}") from None
    try:
        return BPETokenizer(hf, source=str(path))
    except InputError as err:
        raise CheckpointError(str(err)) from None


def train_tokenizer_cli(corpus: str | list[str], vocab_size: int, out: str | Path, *, text_field: str = "text",
                        val_percent: float = 1.0, min_frequency: int = 2, max_chars: int | None = None,
                        progress: bool = True, overwrite: bool = False) -> BPETokenizer:
    """`fullband tokenizer train`: train a BPE on the train split of `corpus` and save it to `out`/tokenizer.json.

    `out` must be new or empty, or (with `overwrite`) a tokenizer folder written earlier; that is checked before
    the training starts. `max_chars` stops reading documents once that many characters were taken (BPE training
    time grows with the text); the held-out split is never seen, so validation loss stays honest."""
    if max_chars is not None and (isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1):
        raise InputError(f"max_chars={max_chars!r}; accepted: a positive integer or None")
    check_destination(out, TOKENIZER_KIND, overwrite=overwrite)
    source = resolve_corpus(corpus, text_field=text_field, val_percent=val_percent)
    tok = train_bpe(_capped(source.texts("train"), max_chars), vocab_size,
                    min_frequency=min_frequency, show_progress=progress)
    with atomic_folder(out, TOKENIZER_KIND, overwrite=overwrite, action="save the tokenizer") as tmp:
        tok.save(tmp)
    return tok


def _capped(texts: Iterable[str], max_chars: int | None) -> Iterable[str]:
    taken = 0
    for text in texts:
        if max_chars is not None and taken >= max_chars:
            return
        taken += len(text)
        yield text
