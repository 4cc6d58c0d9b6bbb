"""Data pipeline: tokenizers, corpora and their split, token shards and the window sampler, on tiny local data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fullband.data import (
    BPETokenizer, ByteTokenizer, TokenStream, WindowSampler, load_tokenizer, resolve_corpus, tokenize_corpus,
    train_bpe, train_tokenizer_cli, validation_batches,
)
from fullband.data.corpus import in_val
from fullband.data.sampler import MixSampler, block_counts
from fullband.errors import CheckpointError, ConfigError, DataError

TEXT = (
    "The quick brown fox jumps over the lazy dog. def main(): return 0\n"
    "Ünïcödé wörds, 日本語のテキスト, emoji 🙂 and tabs\tand  double spaces.\n"
) * 40


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def text_dir(root: Path, n: int = 40) -> Path:
    """n small .txt files in nested folders, plus files the walker must skip."""
    for i in range(n):
        write(root / f"sub{i % 3}" / f"doc{i:02d}.txt", f"document {i}\n" + "words " * (i + 1))
    write(root / "data.bin", b"\x00\x01binary")
    write(root / ".git" / "HEAD.txt", "hidden")
    write(root / "site-packages" / "pkg.txt", "installed")
    return root


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return train_bpe([TEXT], 300, show_progress=False)


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip_and_fingerprint(tmp_path):
    tok = ByteTokenizer()
    ids = tok.encode("héllo", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and tok.decode(ids) == "héllo"
    assert tok.encode_batch(["ab", "é"]) == [tok.encode("ab", bos=False), tok.encode("é", bos=False)]
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, ByteTokenizer) and again.fingerprint == tok.fingerprint
    assert isinstance(load_tokenizer(tmp_path / "missing"), ByteTokenizer)


@pytest.mark.parametrize("text", ["plain: x = 1 + 2\n", "Ünïcödé 日本語 🙂 never-seen ŋ⁂", "", " lead and trail  "])
def test_bpe_round_trip(bpe, text):
    ids = bpe.encode(text, bos=True, eos=True)
    assert ids[0] == bpe.bos_id and ids[-1] == bpe.eos_id
    assert bpe.decode(ids) == text
    assert bpe.encode_batch([text]) == [bpe.encode(text, bos=False)]


def test_bpe_specials_in_text_stay_plain(bpe):
    ids = bpe.encode("a <bos> b <eos>", bos=False)
    assert bpe.bos_id not in ids and bpe.eos_id not in ids
    assert bpe.decode(ids) == "a <bos> b <eos>"


def test_bpe_save_load(bpe, tmp_path):
    bpe.save(tmp_path)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    assert data["model"]["type"] == "BPE"  # a standard Hugging Face file
    again = load_tokenizer(tmp_path)
    assert isinstance(again, BPETokenizer) and again.kind == "bpe"
    assert again.fingerprint == bpe.fingerprint and again.vocab_size == bpe.vocab_size == 300
    assert (again.bos_id, again.eos_id, again.pad_id) == (bpe.bos_id, bpe.eos_id, bpe.pad_id)
    assert again.encode(TEXT[:200]) == bpe.encode(TEXT[:200])
    assert again.fingerprint != ByteTokenizer().fingerprint


def test_a_folder_read_again_gives_the_tokenizer_its_files_hold_now(bpe, tmp_path):
    """load_tokenizer keeps what it read (a reproduction reads one vocabulary dozens of times, from as many folders):
    the same files give the same object, in this folder or a copy of it; a rewritten tokenizer.json, special_ids.json
    or chat template is read again, a corrupted one refused."""
    (tmp_path / "a").mkdir()
    bpe.save(tmp_path / "a")
    first = load_tokenizer(tmp_path / "a")
    assert load_tokenizer(tmp_path / "a") is first
    other = train_bpe([TEXT[::-1]], 280, show_progress=False)
    other.save(tmp_path / "a")
    again = load_tokenizer(tmp_path / "a")
    assert again is not first and again.vocab_size == 280 and again.fingerprint == other.fingerprint
    write(tmp_path / "a" / "special_ids.json", json.dumps({"bos_id": 1, "eos_id": 2, "pad_id": 3, "add_bos": False}))
    held = load_tokenizer(tmp_path / "a")
    assert (held.bos_id, held.add_bos, held.chat_template) == (1, False, None)
    write(tmp_path / "a" / "chat_template.jinja", "{{ messages }}")
    assert load_tokenizer(tmp_path / "a").chat_template == "{{ messages }}"
    write(tmp_path / "a" / "special_ids.json", "{not json")
    with pytest.raises(CheckpointError, match="special_ids.json"):
        load_tokenizer(tmp_path / "a")
    write(tmp_path / "a" / "special_ids.json", json.dumps({"bos_id": 1, "eos_id": 2, "pad_id": 3, "add_bos": False}))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert load_tokenizer(tmp_path / "b") is load_tokenizer(tmp_path / "a")
    write(tmp_path / "b" / "special_ids.json", json.dumps({"bos_id": 4, "eos_id": 2, "pad_id": 3}))
    assert load_tokenizer(tmp_path / "b").bos_id == 4


def test_load_tokenizer_errors(tmp_path, bpe):
    path = write(tmp_path / "tokenizer.json", "{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json is corrupted"):
        load_tokenizer(tmp_path)
    write(path, json.dumps({"fullband_tokenizer": "sentencepiece"}))
    with pytest.raises(CheckpointError, match="unknown tokenizer kind 'sentencepiece'.*'byte'"):
        load_tokenizer(tmp_path)
    write(path, json.dumps({"model": {"type": "WordLevel"}}))
    with pytest.raises(CheckpointError, match="model type 'WordLevel'"):
        load_tokenizer(tmp_path)
    bpe.save(tmp_path)
    data = json.loads(path.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<pad>"]
    data["model"]["vocab"].pop("<pad>")
    write(path, json.dumps(data))
    with pytest.raises(CheckpointError, match=r"tokenizer.json lacks the special tokens \['<pad>'\]"):
        load_tokenizer(tmp_path)


def test_train_bpe_rejects_tiny_vocab():
    with pytest.raises(ValueError, match="vocab_size=100.*>= 259"):
        train_bpe(["abc"], 100, show_progress=False)


def test_train_tokenizer_cli(tmp_path):
    corpus = text_dir(tmp_path / "corpus")
    tok = train_tokenizer_cli(str(corpus), 280, tmp_path / "tok", min_frequency=1, progress=False)
    loaded = load_tokenizer(tmp_path / "tok")
    assert loaded.fingerprint == tok.fingerprint and loaded.vocab_size <= 280


# ---------------------------------------------------------------- corpora


def test_stdlib_corpus_split_by_file_is_deterministic():
    a, b = resolve_corpus("stdlib"), resolve_corpus("stdlib")
    (part,) = a.parts
    assert part.label == "stdlib" and len(part.keys) > 100
    assert list(part.keys) == sorted(part.keys)
    assert not any("site-packages" in k or "dist-packages" in k for k in part.keys)
    val_keys = [k for k in part.keys if in_val(k, 1.0)]
    assert 0 < len(val_keys) < len(part.keys) // 20
    assert val_keys == [k for k in b.parts[0].keys if in_val(k, 1.0)] and a.fingerprint == b.fingerprint
    val_docs = list(a.documents("val"))
    # Each val document is one whole file (a by-file split, not a cut inside a file).
    expected = [(part.files[part.keys.index(k)]).read_bytes().decode("utf-8", errors="replace") for k in val_keys]
    assert [d for d in expected if d] == val_docs
    assert next(iter(a.documents("train")))  # train is non-empty too
    assert "stdlib" in a.describe() and "split by file" in a.describe()


def test_non_utf8_file_is_decoded_with_replacement(tmp_path):
    write(tmp_path / "c" / "latin.txt", "café naïve".encode("latin-1"))
    write(tmp_path / "c" / "ok.txt", "fine\n")
    corpus = resolve_corpus(str(tmp_path / "c"), val_percent=0)
    assert list(corpus.documents("train")) == ["caf\ufffd na\ufffdve", "fine\n"]


def test_directory_corpus_filters_sorts_and_splits_by_file(tmp_path):
    root = text_dir(tmp_path / "c")
    corpus = resolve_corpus(str(root), val_percent=25)
    (part,) = corpus.parts
    assert len(part.keys) == 40 and list(part.keys) == sorted(part.keys)
    assert all(k.endswith(".txt") and not k.startswith((".git", "site-packages")) for k in part.keys)
    train, val = list(corpus.documents("train")), list(corpus.documents("val"))
    assert train and val and len(train) + len(val) == 40
    assert sorted(train + val) == sorted(f.read_text() for f in part.files)
    only_bin = resolve_corpus(str(root), extensions=["bin"])
    assert [f.name for f in only_bin.parts[0].files] == ["data.bin"]


def test_glob_corpus(tmp_path):
    root = text_dir(tmp_path / "c")
    corpus = resolve_corpus(str(root / "sub1" / "*.txt"), val_percent=50)
    (part,) = corpus.parts
    # Split keys are relative to the glob's fixed leading folder, so they do not depend on where the corpus lives.
    assert part.label == "glob" and list(part.keys) == sorted(f.name for f in (root / "sub1").glob("*.txt"))
    deep = resolve_corpus(str(root / "**" / "doc0*.txt"))
    assert list(deep.parts[0].keys) == sorted(f"sub{i % 3}/doc0{i}.txt" for i in range(10))


def test_single_file_is_split_inside_its_text(tmp_path):
    path = write(tmp_path / "one.txt", "".join(f"line {i}\n" for i in range(1000)))
    corpus = resolve_corpus(str(path), val_percent=10)
    (train,), (val,) = list(corpus.documents("train")), list(corpus.documents("val"))
    assert train + val == path.read_text() and val.startswith("line ")
    assert 0.08 < len(val) / (len(train) + len(val)) < 0.12
    assert "last 10% of each is val" in corpus.describe()


def test_jsonl_corpus(tmp_path):
    lines = [json.dumps({"body": f"doc {i}", "id": i}) for i in range(200)]
    path = write(tmp_path / "d.jsonl", "\n".join(lines[:100]) + "\n\n" + "\n".join(lines[100:]) + "\n")
    corpus = resolve_corpus(str(path), text_field="body", val_percent=10)
    train, val = list(corpus.documents("train")), list(corpus.documents("val"))
    assert sorted(train + val) == sorted(f"doc {i}" for i in range(200)) and 5 < len(val) < 40
    assert list(resolve_corpus(str(path), text_field="body", val_percent=10).documents("val")) == val
    mixed = resolve_corpus([str(path), str(write(tmp_path / "t" / "a.txt", "plain"))], text_field="body")
    assert len(mixed.parts) == 2 and "jsonl" in mixed.describe()


def test_a_jsonl_row_with_messages_is_a_conversation_read_as_the_chat_template_renders_it(tmp_path):
    """A row without the text field but with `messages` is a conversation: tokenised as the model's chat template
    renders it, its markers as their ids (a text document's `<|user|>` stays characters), beside plain text rows; a
    tokenizer is trained on its contents; a tokenizer without a template is refused, naming the corpus."""
    from fullband.data.chat.templates import chat_template, encode_chat
    from fullband.data.chat.messages import Message
    from fullband.data.corpus import Conversation

    talk = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    path = write(tmp_path / "mix.jsonl", json.dumps({"text": "<|user|>plain"}) + "\n" + json.dumps({"messages": talk})
                 + "\n")
    corpus = resolve_corpus(str(path), val_percent=0)
    docs = list(corpus.documents("train"))
    assert docs[0] == "<|user|>plain" and docs[1] == Conversation((Message("user", "2+2?"), Message("assistant", "4")))
    assert list(corpus.texts("train")) == ["<|user|>plain", "2+2?\n4"]
    tok = ByteTokenizer(chat=True)
    stream = tokenize_corpus(corpus, tok, "train", tmp_path / "cache", progress=False)
    rendered = encode_chat(chat_template(tok), list(docs[1].messages)).ids  # BOS, the markers, the contents
    assert stream[0:len(stream)].tolist() == [tok.bos_id, *tok.encode("<|user|>plain", bos=False), *rendered]
    marker, text_part = tok.chat_ids["<|user|>"], stream[0:1 + len("<|user|>plain")].tolist()
    assert marker in rendered and marker not in text_part
    with pytest.raises(DataError, match=r"mix.jsonl.*holds conversations .*'messages'.*neither a chat template"):
        tokenize_corpus(corpus, ByteTokenizer(), "train", tmp_path / "cache2", progress=False)
    bad = write(tmp_path / "bad.jsonl", json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(DataError, match="bad.jsonl, line 1: message 0: unknown role 'robot'"):
        list(resolve_corpus(str(bad), val_percent=0).documents("train"))


@pytest.mark.parametrize(
    "line, words",
    [
        ("{broken", ["bad.jsonl, line 2", "not valid JSON"]),
        (json.dumps({"content": "x"}), ["bad.jsonl, line 2", "no field 'text'", "content", "'messages'"]),
        (json.dumps({"text": 5}), ["bad.jsonl, line 2", "field 'text' is int"]),
        (json.dumps(["text"]), ["bad.jsonl, line 2", "no field 'text'", "list"]),
    ],
)
def test_jsonl_errors_name_file_line_and_field(tmp_path, line, words):
    path = write(tmp_path / "bad.jsonl", json.dumps({"text": "ok"}) + "\n" + line + "\n")
    corpus = resolve_corpus(str(path), val_percent=0)
    with pytest.raises(DataError) as info:
        list(corpus.documents("train"))
    for word in words:
        assert word in str(info.value)


def test_hf_local_datasets(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    rows = [{"text": f"row {i} héllo", "n": i} for i in range(300)]
    path = write(tmp_path / "rows.json", "\n".join(json.dumps(r) for r in rows) + "\n")
    kwargs = dict(data_files=[str(path)], hf_cache_dir=tmp_path / "cache", val_percent=5)
    corpus = resolve_corpus("hf:json", **kwargs)
    train, val = list(corpus.documents("train")), list(corpus.documents("val"))
    assert sorted(train + val) == sorted(r["text"] for r in rows)
    assert val == [f"row {i} héllo" for i in range(300) if in_val(str(i), 5)]
    assert resolve_corpus("hf:json", **kwargs).fingerprint == corpus.fingerprint
    assert "300 rows" in corpus.describe()
    with pytest.raises(DataError, match="no column 'body'.*'text', 'n'"):
        resolve_corpus("hf:json", text_field="body", **kwargs)
    datasets.Dataset.from_list(rows[:50]).save_to_disk(str(tmp_path / "saved"))
    saved = resolve_corpus(f"hf:{tmp_path / 'saved'}", val_percent=5)
    assert len(list(saved.documents("train"))) + len(list(saved.documents("val"))) == 50
    # a 'messages' column (and no text column): conversations, as a JSON-lines file's rows are
    from fullband.data.chat.messages import Message
    from fullband.data.corpus import Conversation

    talks = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
             for i in range(20)]
    datasets.Dataset.from_list(talks).save_to_disk(str(tmp_path / "talks"))
    docs = list(resolve_corpus(f"hf:{tmp_path / 'talks'}", val_percent=0).documents("train"))
    assert docs[3] == Conversation((Message("user", "q3"), Message("assistant", "a3"))) and len(docs) == 20


@pytest.mark.parametrize(
    "make_spec, words",
    [
        (lambda p: str(p / "nowhere.txt"), ["corpus path not found", "nowhere.txt", "stdlib"]),
        (lambda p: str(p / "*.nothing"), ["matches no files", "*.nothing"]),
        (lambda p: str(write(p / "e" / "a.txt", "").parent), ["is empty", "all empty"]),
        (lambda p: str(write(p / "e" / "a.bin", "data").parent), ["is empty", "no files with extensions"]),
        (lambda p: [], ["non-empty list"]),
    ],
)
def test_corpus_errors(tmp_path, make_spec, words):
    spec = make_spec(tmp_path)
    with pytest.raises(DataError) as info:
        resolve_corpus(spec)
    for word in words:
        assert word in str(info.value)


def test_split_errors(tmp_path):
    path = write(tmp_path / "one.jsonl", json.dumps({"text": "only"}) + "\n")
    corpus = resolve_corpus(str(path), val_percent=1)
    assert list(corpus.documents("train")) == ["only"]
    with pytest.raises(DataError, match="no non-empty documents in its 'val' split.*larger val_percent"):
        list(corpus.documents("val"))
    with pytest.raises(DataError, match="split='vall'.*did you mean 'val'"):
        corpus.documents("vall")
    with pytest.raises(DataError, match="no 'val' split with val_percent=0"):
        resolve_corpus(str(path), val_percent=0).documents("val")
    with pytest.raises(DataError, match="val_percent=101"):
        resolve_corpus(str(path), val_percent=101)


# ---------------------------------------------------------------- token shards


def expected_tokens(corpus, tok, split) -> tuple[np.ndarray, list[int]]:
    docs = [[tok.bos_id] + tok.encode(d, bos=False) for d in corpus.documents(split)]
    starts = np.cumsum([0] + [len(d) for d in docs])[:-1].tolist()
    return np.concatenate([np.array(d) for d in docs]), starts


def test_shards_hold_bos_plus_ids_per_document(tmp_path, bpe):
    corpus = resolve_corpus(str(text_dir(tmp_path / "c")), val_percent=25)
    for tok in (ByteTokenizer(), bpe):
        stream = tokenize_corpus(corpus, tok, "train", tmp_path / "cache", progress=False)
        want, starts = expected_tokens(corpus, tok, "train")
        got = stream.slice(0, len(stream))
        assert stream.dtype == np.uint16 and np.array_equal(got, want)
        assert np.flatnonzero(got == tok.bos_id).tolist() == starts  # BOS exactly at document starts
        m = stream.manifest
        assert (m["n_tokens"], m["n_documents"], m["split"]) == (len(want), len(starts), "train")
        assert m["tokenizer"] == {"fingerprint": tok.fingerprint, "kind": tok.kind,
                                  "vocab_size": tok.vocab_size, "bos_id": tok.bos_id}
        assert m["corpus"]["fingerprint"] == corpus.fingerprint and stream.path.name.startswith("train-")


class CountingTokenizer(ByteTokenizer):
    """Byte tokenizer that counts encode_batch calls, or one with a vocab too big for uint16."""

    def __init__(self, vocab_size: int = 259, offset: int = 0) -> None:
        self.vocab_size, self.offset, self.calls = vocab_size, offset, 0
        self.bos_id = vocab_size - 1

    @property
    def fingerprint(self) -> str:
        return f"counting-{self.vocab_size}-{self.offset}"

    def encode_batch(self, texts):
        self.calls += 1
        return [[b + self.offset for b in ids] for ids in super().encode_batch(texts)]


def test_cache_is_reused_and_written_atomically(tmp_path):
    corpus = resolve_corpus(str(text_dir(tmp_path / "c")), val_percent=25)
    tok, cache = CountingTokenizer(), tmp_path / "cache"
    first = tokenize_corpus(corpus, tok, "val", cache, progress=False)
    assert not first.cached and tok.calls > 0
    calls = tok.calls
    second = tokenize_corpus(corpus, tok, "val", cache, progress=False)
    assert second.cached and tok.calls == calls and second.path == first.path
    assert np.array_equal(second.slice(0, len(second)), first.slice(0, len(first)))
    assert [p.name for p in cache.iterdir()] == [first.path.name]  # no temp folder left behind
    train = tokenize_corpus(corpus, tok, "train", cache, progress=False)
    assert train.path != first.path and len(list(cache.iterdir())) == 2
    # A damaged cache is rebuilt rather than trusted.
    shard = first.path / first.manifest["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-2])
    rebuilt = tokenize_corpus(corpus, tok, "val", cache, progress=False)
    assert not rebuilt.cached and len(rebuilt) == len(first)


def test_failed_tokenising_leaves_nothing(tmp_path):
    corpus = resolve_corpus(str(text_dir(tmp_path / "c")), val_percent=25)

    class Broken(CountingTokenizer):
        def encode_batch(self, texts):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        tokenize_corpus(corpus, Broken(), "train", tmp_path / "cache", progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


def test_large_vocab_uses_uint32(tmp_path):
    corpus = resolve_corpus(str(text_dir(tmp_path / "c", n=5)), val_percent=25)
    tok = CountingTokenizer(vocab_size=70000, offset=66000)
    stream = tokenize_corpus(corpus, tok, "train", tmp_path / "cache", progress=False)
    assert stream.dtype == np.uint32 and stream.manifest["dtype"] == "uint32"
    tokens = stream.slice(0, len(stream))
    assert tokens.max() == 69999 and tokens[tokens != 69999].min() >= 66000


def test_slices_cross_shard_boundaries(tmp_path):
    corpus = resolve_corpus(str(text_dir(tmp_path / "c", n=6)), val_percent=25)
    stream = tokenize_corpus(corpus, ByteTokenizer(), "train", tmp_path / "cache", progress=False, shard_tokens=7)
    want, _ = expected_tokens(corpus, ByteTokenizer(), "train")
    shards = stream.manifest["shards"]
    assert len(shards) == -(-len(want) // 7) and all(s["n_tokens"] == 7 for s in shards[:-1])
    for start in range(0, 30):
        for stop in (start, start + 1, start + 6, start + 7, start + 8, start + 23):
            assert np.array_equal(stream.slice(start, stop), want[start:stop])
    assert np.array_equal(stream[len(want) - 10 :], want[-10:])
    reopened = TokenStream.open(stream.path)
    assert np.array_equal(reopened.slice(0, len(reopened)), want)
    with pytest.raises(DataError, match=r"outside the stream.*<= \d+"):
        stream.slice(0, len(want) + 1)


def test_a_stream_head_is_its_first_tokens_across_shards(tmp_path):
    corpus = resolve_corpus(str(text_dir(tmp_path / "c", n=6)), val_percent=25)
    stream = tokenize_corpus(corpus, ByteTokenizer(), "train", tmp_path / "cache", progress=False, shard_tokens=7)
    want, _ = expected_tokens(corpus, ByteTokenizer(), "train")
    for n in (1, 6, 7, 8, 20, len(want)):
        head = stream.head(n)
        assert len(head) == n and head.fingerprint == stream.fingerprint
        assert np.array_equal(head.slice(0, n), want[:n])
        with pytest.raises(DataError, match="outside the stream"):
            head.slice(0, n + 1)
    for bad in (0, len(want) + 1):
        with pytest.raises(DataError, match=rf"{bad:,} tokens asked of a stream of {len(want):,}"):
            stream.head(bad)


def test_empty_split_raises(tmp_path):
    path = write(tmp_path / "one.jsonl", json.dumps({"text": "only"}) + "\n")
    with pytest.raises(DataError, match="no non-empty documents in its 'val' split"):
        tokenize_corpus(resolve_corpus(str(path)), ByteTokenizer(), "val", tmp_path / "cache", progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


# ---------------------------------------------------------------- sampler


class ArrayStream:
    """In-memory stream of 0..n-1, so a window's first input names its start."""

    def __init__(self, n: int, fingerprint: str = "arange") -> None:
        self.tokens, self.fingerprint = np.arange(n, dtype=np.int64), fingerprint

    def __len__(self) -> int:
        return len(self.tokens)

    def slice(self, start: int, stop: int) -> np.ndarray:
        return self.tokens[start:stop].copy()


def windows_of(inputs: torch.Tensor, seq_len: int) -> list[int]:
    return (inputs[:, 0] // seq_len).tolist()


def test_sampler_batches_are_deterministic_and_shifted():
    stream = ArrayStream(1001)
    a = WindowSampler(stream, seq_len=10, global_batch=8, micro_batch=4, seed=3)
    assert (a.n_windows, a.accum_steps) == (100, 2)
    x, y = a.batch(5, 1)
    assert x.shape == y.shape == (4, 10) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # targets are the inputs shifted by one token
    assert torch.equal(x[:, 0] % 10, torch.zeros(4, dtype=torch.int64))
    b = WindowSampler(stream, seq_len=10, global_batch=8, micro_batch=4, seed=3)
    b.batch(0, 0)  # a different history must not matter
    assert torch.equal(b.batch(5, 1)[0], x)
    other = WindowSampler(stream, seq_len=10, global_batch=8, micro_batch=4, seed=4)
    assert not torch.equal(other.batch(5, 1)[0], x)


def test_ranks_and_accumulation_cover_the_same_windows():
    stream = ArrayStream(64 * 8 + 1)
    one = WindowSampler(stream, 8, global_batch=8, micro_batch=2, seed=0)
    two = [WindowSampler(stream, 8, global_batch=8, micro_batch=2, seed=0, rank=r, world_size=2) for r in range(2)]
    assert one.accum_steps == 4 and two[0].accum_steps == 2
    for step in (0, 7, 8, 20):  # 8 steps per epoch: includes epoch boundaries
        a = sorted(w for m in range(4) for w in windows_of(one.batch(step, m)[0], 8))
        b = sorted(w for s in two for m in range(2) for w in windows_of(s.batch(step, m)[0], 8))
        assert a == b and len(set(a)) == 8


def test_every_window_once_per_epoch():
    stream = ArrayStream(10 * 4 + 3)  # 10 windows of 4 (the 3 spare tokens are never a full window)
    s = WindowSampler(stream, 4, global_batch=3, micro_batch=3, seed=7)
    order = [w for step in range(10) for w in windows_of(s.batch(step, 0)[0], 4)]  # 30 samples = 3 epochs
    epochs = [order[i : i + 10] for i in range(0, 30, 10)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1]  # a fresh order each epoch


def test_sampler_state_check():
    stream = ArrayStream(1001)
    s = WindowSampler(stream, 10, 8, 4, seed=1)
    state = json.loads(json.dumps(s.state_dict()))  # survives a JSON round trip (checkpoint sidecar)
    s.check_state(state)
    WindowSampler(stream, 10, 8, 2, seed=1, rank=1, world_size=2).check_state(state)  # new world size is fine
    with pytest.raises(DataError, match="seed: checkpoint 1, now 2"):
        WindowSampler(stream, 10, 8, 4, seed=2).check_state(state)
    with pytest.raises(DataError, match="stream_fingerprint: checkpoint 'arange', now 'other'.*n_tokens"):
        WindowSampler(ArrayStream(2001, "other"), 10, 8, 4, seed=1).check_state(state)


def test_sampler_errors():
    with pytest.raises(DataError, match="has 9 tokens, fewer than one window needs \\(11 for seq_len=10\\)"):
        WindowSampler(ArrayStream(9), 10, 8, 4, seed=0)
    with pytest.raises(ConfigError, match="global_batch=12 is not divisible by .* = 8"):
        WindowSampler(ArrayStream(1001), 10, 12, 4, seed=0, world_size=2)
    with pytest.raises(ConfigError, match="rank=2"):
        WindowSampler(ArrayStream(1001), 10, 8, 4, seed=0, rank=2, world_size=2)
    with pytest.raises(DataError, match="micro=2.*accum_steps=2"):
        WindowSampler(ArrayStream(1001), 10, 8, 4, seed=0).batch(0, 2)


def test_validation_batches_are_fixed_and_evenly_spaced():
    stream = ArrayStream(100 * 5 + 1)
    batches = validation_batches(stream, 5, n_windows=10, batch_size=4)
    assert [x.shape[0] for x, _ in batches] == [4, 4, 2]
    starts = [w for x, _ in batches for w in windows_of(x, 5)]
    assert starts == list(range(0, 100, 10))
    again = validation_batches(stream, 5, n_windows=10, batch_size=4)
    assert all(torch.equal(x, x2) and torch.equal(y, y2) for (x, y), (x2, y2) in zip(batches, again))
    assert all(torch.equal(y, x + 1) for x, y in batches)
    short = validation_batches(ArrayStream(3 * 5 + 1), 5, n_windows=10, batch_size=8)
    assert windows_of(short[0][0], 5) == [0, 1, 2]  # fewer windows than asked: all of them


def test_sampler_reads_token_shards(tmp_path):
    corpus = resolve_corpus(str(text_dir(tmp_path / "c")), val_percent=25)
    stream = tokenize_corpus(corpus, ByteTokenizer(), "train", tmp_path / "cache", progress=False, shard_tokens=50)
    s = WindowSampler(stream, 16, global_batch=4, micro_batch=2, seed=0)
    x, y = s.batch(0, 1)
    w = int(s.windows(0, 1)[0])
    assert x[0].tolist() == stream.slice(w * 16, w * 16 + 16).tolist() and torch.equal(x[:, 1:], y[:, :-1])
    assert s.state_dict()["stream_fingerprint"] == stream.fingerprint


def _mix_order(sampler, steps: int, accum: int) -> list[tuple[int, int]]:
    return [pair for step in range(steps) for m in range(accum) for pair in sampler.windows(step, m)]


def test_block_counts_are_the_shares_in_whole_samples():
    assert block_counts([0.8, 0.2]).tolist() == [800, 200]
    assert block_counts([1 / 3] * 3).tolist() == [334, 333, 333]  # largest remainder: they sum to the block
    assert block_counts([0.9995, 0.0005]).tolist() == [999, 1]  # a positive share gets at least one sample
    assert block_counts([0.5, 0.3, 0.2], 4).tolist() == [2, 1, 1]


def test_a_mix_draws_each_source_at_its_share_in_a_seeded_order_each_source_its_own_epochs():
    streams = [ArrayStream(10 * 8 + 1, "a"), ArrayStream(1000 * 8 + 1, "b")]
    mix = MixSampler(streams, [0.25, 0.75], 8, global_batch=8, micro_batch=4, seed=5)
    order = _mix_order(mix, 250, 2)  # 2,000 samples: two blocks
    for start in (0, 1000):
        sources = [s for s, _ in order[start : start + 1000]]
        assert sources.count(0) == 250 and sources.count(1) == 750
    first = [w for s, w in order if s == 0]  # the small source, 50 epochs of 10 windows
    assert all(sorted(first[i : i + 10]) == list(range(10)) for i in range(0, 500, 10))
    assert first[:10] != first[10:20]
    x, y = mix.batch(3, 1)
    pairs = mix.windows(3, 1)
    assert torch.equal(y, x + 1) and windows_of(x, 8) == [w for _, w in pairs]
    # a pure function of (seed, step, sample): the history, the micro-batch and the world size do not matter
    again = MixSampler(streams, [0.25, 0.75], 8, global_batch=8, micro_batch=2, seed=5)
    assert _mix_order(again, 250, 4) == order
    ranks = [MixSampler(streams, [0.25, 0.75], 8, 8, 2, seed=5, rank=r, world_size=2) for r in range(2)]
    assert sorted(p for r in ranks for m in range(2) for p in r.windows(7, m)) == sorted(order[56:64])
    assert _mix_order(MixSampler(streams, [0.25, 0.75], 8, 8, 4, seed=6), 10, 2) != order[:80]


def test_a_mix_resumes_only_with_the_same_sources_and_shares():
    streams = [ArrayStream(801, "a"), ArrayStream(1601, "b")]
    mix = MixSampler(streams, [0.5, 0.5], 8, 8, 4, seed=1)
    state = json.loads(json.dumps(mix.state_dict()))
    MixSampler(streams, [0.5, 0.5], 8, 8, 2, seed=1, rank=1, world_size=2).check_state(state)
    with pytest.raises(DataError, match=r"shares: checkpoint \[0.5, 0.5\], now \[0.25, 0.75\]"):
        MixSampler(streams, [0.25, 0.75], 8, 8, 4, seed=1).check_state(state)
    with pytest.raises(DataError, match="sources: checkpoint"):
        MixSampler([streams[0], ArrayStream(1601, "c")], [0.5, 0.5], 8, 8, 4, seed=1).check_state(state)
    with pytest.raises(DataError, match="format: checkpoint 'fullband-window-sampler', now 'fullband-mix-sampler'"):
        mix.check_state(WindowSampler(streams[0], 8, 8, 4, seed=1).state_dict())
    with pytest.raises(ConfigError, match="2 stream\\(s\\) and 1 share\\(s\\)"):
        MixSampler(streams, [1.0], 8, 8, 4, seed=1)


@pytest.mark.parametrize("changes,words", [
    ({"shares": [0.5, 0.5]}, "2 share\\(s\\) for 1 data.corpus entry"),
    ({"corpus": ["a", "b"], "shares": [0.5, 0.4]}, "sums to 0.9; accepted: shares summing to 1, e.g. \\[0.5556, 0.4444\\]"),
    ({"corpus": ["a", "b"], "shares": [1.0, 0.0]}, "data.shares\\[1\\]=0.0"),
    ({"corpus": ["a", "b"], "shares": [0.5, "x"]}, "data.shares\\[1\\]='x' must be a number"),
    ({"corpus": ["a", "b"], "shares": 0.5}, "must be a list of numbers"),
    ({"corpus": ["a", "b"], "shares": [0.5, 0.5], "format": "chat"}, "accepted for data.format='chat': \\[\\]"),
    ({"corpus": ["a", "b"], "shares": [0.5, 0.5], "train_tokens": 1000}, "data.train_tokens=1000 limits one stream"),
    ({"corpus": ["a", "b", "a"], "shares": [0.5, 0.25, 0.25]}, "data.corpus lists 'a' more than once"),
])
def test_shares_errors(changes, words):
    from fullband.train.config import DataConfig

    with pytest.raises(ConfigError, match=words):
        DataConfig(**changes)


def test_a_run_with_shares_trains_on_both_corpora_at_their_shares(tmp_path, cache):
    from fullband.train.config import load_run_config
    from fullband.train.data import prepare_data
    from fullband.train.parallel import Dist
    from fullband.train.checkpoint import read_trainer_state
    from fullband.train.rundir import resume_differences
    from fullband.train.trainer import train

    from conftest import write_config

    text, code = text_dir(tmp_path / "text"), tmp_path / "code"
    code.mkdir()
    (code / "a.py").write_text("x = 1\n" * 400)
    (code / "b.py").write_text("y = 2\n" * 400)
    path = write_config(tmp_path, "unused", cache, steps=2)
    shares = [f"data.corpus={json.dumps([str(text), str(code)])}", "data.shares=[0.3, 0.7]", "data.val_percent=50.0"]
    cfg = load_run_config(path, shares)
    run = prepare_data(cfg, Dist())
    assert isinstance(run.sampler, MixSampler) and len(run.val_batches) >= 2
    seq = cfg.train.seq_len
    sources = [s for step in range(1000 // cfg.train.global_windows) for m in range(run.sampler.accum_steps)
               for s, _ in run.sampler.windows(step, m)]
    assert sources.count(1) == 700
    x, _ = run.sampler.batch(0, 0)
    for row, (s, w) in zip(x.tolist(), run.sampler.windows(0, 0)):
        assert row == run.train[s].slice(w * seq, w * seq + seq).tolist()
    small = tmp_path / "small.txt"
    small.write_text("too short for a window in both splits")
    with pytest.raises(DataError, match=f"data.corpus entry '{small}': its train split has .* tokens, fewer than one "
                                        "window needs \\(33 for train.seq_len=32\\)"):
        prepare_data(load_run_config(path, [f"data.corpus={json.dumps([str(text), str(small)])}",
                                            "data.shares=[0.5, 0.5]", "data.val_percent=50.0"]), Dist())
    train(cfg)  # and the trainer runs on it, its checkpoint holding the mix's state
    state = read_trainer_state(tmp_path / "run" / "step_000002")
    assert state["sampler"]["shares"] == [0.3, 0.7] and len(state["sampler"]["sources"]) == 2
    # the held-out loss is logged for each entry too: the run's is their mean weighted by their windows
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if "eval" in r)
    counts = dict(run.val_sources)
    assert list(row["eval_by_corpus"]) == [str(text), str(code)] and sum(counts.values()) == cfg.log.eval_windows
    for k, nats in row["eval"].items():
        mixed = sum(counts[name] * by[k] for name, by in row["eval_by_corpus"].items()) / cfg.log.eval_windows
        assert nats == pytest.approx(mixed, rel=1e-9)
    assert row["eval_by_corpus"][str(text)]["1"] != row["eval_by_corpus"][str(code)]["1"]
    # a run recorded before data.shares existed resumes as the one stream it was; other shares are refused
    now = load_run_config(path).to_dict()
    old = json.loads(json.dumps(now))
    del old["data"]["shares"]
    assert resume_differences(old, now) == []
    assert resume_differences(cfg.to_dict(), load_run_config(path, [*shares, "data.shares=[0.5, 0.5]"]).to_dict()) \
        == ["data: run has shares=[0.3, 0.7], config has shares=[0.5, 0.5]"]
