"""The data side of a run: corpus, tokenizer (byte, BPE trained once and cached, or a saved one), token
shards for the train and validation splits, the step-deterministic sampler and fixed validation batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fullband.data.corpus import resolve_corpus
from fullband.data.sampler import MixSampler, WindowSampler, block_counts, validation_batches
from fullband.data.shards import tokenize_corpus
from fullband.data.tokenizer import TOKENIZER_KIND, ByteTokenizer, PretrainedTokenizer, load_tokenizer, train_bpe
from fullband.errors import ConfigError, DataError
from fullband.files import atomic_folder, cache_root
from fullband.model.config import ModelConfig
from fullband.train.parallel import Dist, barrier


@dataclass
class RunData:
    tokenizer: object
    train: object  # TokenStream
    val: object
    sampler: WindowSampler | MixSampler
    val_batches: list
    model_config: ModelConfig
    val_sources: list = field(default_factory=list)  # data.shares: (entry, its held-out windows), in val_batches' order


def run_tokenizer(cfg, d: Dist, *, run_dir: Path | None = None):
    """(corpus, tokenizer) of a run: the run's own tokenizer when resuming (run_dir), else the recipe's (a BPE is
    trained on the corpus once and cached). A chat run's corpus is its spec, its tokenizer the recipe's with the
    chat markers (or a pretrained model's own chat template)."""
    data = cfg.data
    pretrained = pretrained_model(cfg)
    if data.format != "text":
        return data.corpus, _tokenizer(data, None, d, run_dir, pretrained)
    corpus = resolve_corpus(data.corpus, text_field=data.text_field, val_percent=data.val_percent)
    return corpus, _tokenizer(data, corpus, d, run_dir, pretrained)


def pretrained_model(cfg) -> str:
    """The pretrained model whose own tokenizer a run reads (model.hf_path, or a train.init_from that is a GGUF file
    or a transformers Llama folder); '' for none."""
    from fullband.hf.convert import pretrained_source

    if cfg.model.hf_path:
        return cfg.model.hf_path
    return cfg.train.init_from if pretrained_source(cfg.train.init_from) else ""


def _pretrained_tokenizer(path: str) -> PretrainedTokenizer:
    """A pretrained model's tokenizer, its EOS id(s) (generation_config.json, else config.json) the stop ids."""
    from fullband.gguf_file import gguf_args, is_gguf

    try:
        from transformers import GenerationConfig

        from fullband.hf.convert import hf_stop_ids

        name, extra = gguf_args(path)
        stops = tuple(hf_stop_ids(GenerationConfig.from_pretrained(name, **extra)))
    except (ImportError, OSError, ValueError, TypeError):
        stops = ()
    if not stops and not is_gguf(path):
        from fullband.hf.convert import source_stop_ids

        stops = tuple(source_stop_ids(Path(path)))
    return PretrainedTokenizer.from_pretrained(path, stop_ids=stops)


def prepare_data(cfg, d: Dist, *, run_dir: Path | None = None, source=None) -> RunData:
    """Resolve corpus and tokenizer (or take `source`, run_tokenizer's pair), tokenise both splits (rank 0 first;
    the others read its cache)."""
    corpus, tokenizer = source if source is not None else run_tokenizer(cfg, d, run_dir=run_dir)
    model_cfg = fit_model_config(cfg.model, tokenizer)
    if cfg.data.format in ("chat", "tracking"):
        return _chat_data(cfg, d, corpus, tokenizer, model_cfg)
    if cfg.data.shares:
        return _mixed_data(cfg, d, tokenizer, model_cfg)
    streams = _streams(cfg, d, corpus, tokenizer)
    t = cfg.train
    if cfg.data.train_tokens:
        have = len(streams["train"])
        if not t.seq_len + 1 <= cfg.data.train_tokens <= have:
            raise ConfigError(f"data.train_tokens={cfg.data.train_tokens:,}: the training split of {cfg.data.corpus!r} "
                              f"has {have:,} tokens; accepted: {t.seq_len + 1:,} (one window of train.seq_len + 1) to "
                              f"{have:,}, or 0 for all of them")
        streams["train"] = streams["train"].head(cfg.data.train_tokens)
    sampler = WindowSampler(streams["train"], t.seq_len, t.global_windows, t.micro_batch, t.seed,
                            rank=d.rank, world_size=d.world)
    val = validation_batches(streams["val"], t.seq_len, cfg.log.eval_windows, t.micro_batch)
    return RunData(tokenizer, streams["train"], streams["val"], sampler, val, model_cfg)


def _streams(cfg, d: Dist, corpus, tokenizer) -> dict:
    """{"train": ..., "val": ...}: the token streams of a corpus's two splits (rank 0 tokenises and caches first, then
    every rank opens the cache)."""
    cache = cache_root(cfg.data.cache_dir)
    streams = {}
    for rank_turn in (True, False):
        if d.main == rank_turn:
            for split in ("train", "val"):
                streams[split] = tokenize_corpus(corpus, tokenizer, split, cache / "tokens", progress=d.main)
        barrier(d)
    return streams


def _mixed_data(cfg, d: Dist, tokenizer, model_cfg: ModelConfig) -> RunData:
    """data.shares: each data.corpus entry its own pair of streams; training windows drawn at the shares (MixSampler),
    held-out windows split the same way (at least one each)."""
    data, t = cfg.data, cfg.train
    entries = data.corpus if isinstance(data.corpus, list) else [data.corpus]
    streams = [_streams(cfg, d, resolve_corpus(e, text_field=data.text_field, val_percent=data.val_percent),
                        tokenizer) for e in entries]
    for entry, pair in zip(entries, streams):
        for split, stream in pair.items():
            if len(stream) < t.seq_len + 1:
                raise DataError(f"data.corpus entry {entry!r}: its {split} split has {len(stream):,} tokens, fewer "
                                f"than one window needs ({t.seq_len + 1} for train.seq_len={t.seq_len}); accepted with "
                                "data.shares: an entry with a window in each split (more text, a larger "
                                "data.val_percent or a smaller train.seq_len)")
    sampler = MixSampler([s["train"] for s in streams], data.shares, t.seq_len, t.global_windows, t.micro_batch,
                         t.seed, rank=d.rank, world_size=d.world)
    windows = block_counts(data.shares, cfg.log.eval_windows) if cfg.log.eval_windows >= len(entries) else \
        [1] * len(entries)
    parts = [validation_batches(s["val"], t.seq_len, int(n), t.micro_batch) for s, n in zip(streams, windows)]
    sources = [(str(e), sum(b[0].shape[0] for b in part)) for e, part in zip(entries, parts)]
    return RunData(tokenizer, [s["train"] for s in streams], [s["val"] for s in streams], sampler,
                   [b for part in parts for b in part], model_cfg, sources)


def _chat_data(cfg, d: Dist, spec, tokenizer, model_cfg: ModelConfig) -> RunData:
    """Both splits of a chat corpus rendered, checked and packed into windows (in memory, on every rank: a pure
    function of the data and the tokenizer); a tracking corpus's examples the same way."""
    from fullband.data.chat.packing import pack_chats
    from fullband.data.chat.sources import chat_conversations
    from fullband.data.chat.templates import chat_template, encode_chat
    from fullband.data.sampler import ChatSampler, chat_validation_batches
    from fullband.data.tracking import training_sequences

    data, t = cfg.data, cfg.train
    template = chat_template(tokenizer) if data.format == "chat" else None
    packed = {}
    for split in ("train", "val"):
        if template is None:  # tracking: each example's label is its only target
            sequences = training_sequences(spec, split, tokenizer, room=t.seq_len, repeat=data.repeat)
        else:
            sequences = (encode_chat(template, m) for m in chat_conversations(spec, split, data.val_percent))
        what = f"the {split} split of {data.corpus!r}" + (f" (val_percent={data.val_percent})" if split == "val" else "")
        packed[split] = pack_chats(sequences, t.seq_len, tokenizer.pad_id, too_long=data.chat_too_long, what=what)
        if d.main:
            words = ("chat", "conversations", "assistant tokens") if template else ("tracking", "examples", "answers")
            print(f"{words[0]} data ({split}): {packed[split].describe(*words[1:])}", flush=True)
    sampler = ChatSampler(packed["train"], t.global_windows, t.micro_batch, t.seed, fused_prompts=data.fused_prompts,
                          rank=d.rank, world_size=d.world)
    val = chat_validation_batches(packed["val"], cfg.log.eval_windows, t.micro_batch)
    return RunData(tokenizer, packed["train"], packed["val"], sampler, val, model_cfg)


def chat_eval_batches(cfg, tokenizer, max_len: int) -> list:
    """log.eval_chats: every conversation of the chat set rendered with the tokenizer's chat template, each in a
    window of its own (as long as the longest, at most `max_len`: the model's positions), as (inputs, targets, plain)
    batches of train.micro_batch (prompts plain, assistant tokens scored): a window's loss is its conversation's,
    and the read their mean, as the warm-start reports read chat. [] when it is off; ConfigError when the tokenizer
    has no chat template or no conversation has a reply."""
    spec = cfg.log.eval_chats
    if not spec:
        return []
    from fullband.data.chat.packing import pack_chats
    from fullband.data.chat.sources import chat_conversations
    from fullband.data.chat.templates import chat_template, encode_chat
    from fullband.data.sampler import chat_validation_batches

    if not (getattr(tokenizer, "chat_template", None) or getattr(tokenizer, "chat_ids", None)):
        raise ConfigError(f"log.eval_chats={spec!r} reads conversations through the run's chat template, and its "
                          "tokenizer has none; accepted: a run whose tokenizer carries one (a chat run's, or a "
                          "pretrained instruction-tuned model's), or log.eval_chats = \"\"")
    template = chat_template(tokenizer)
    what = f"log.eval_chats={spec!r}"
    try:
        every = [encode_chat(template, m) for m in chat_conversations(spec, "val", 100.0)]  # the whole set
        packed = pack_chats(every, min(max((len(s.ids) for s in every), default=1), max_len), tokenizer.pad_id,
                            too_long="truncate", what=what, alone=True)
    except DataError as err:
        raise ConfigError(f"{what}: {err}") from None  # what the chat set's reader accepts, it says
    return chat_validation_batches(packed, packed.ids.shape[0], cfg.train.micro_batch)


def _tokenizer(data, corpus, d: Dist, run_dir: Path | None, hf_path: str):
    if run_dir is not None:  # resuming: the run's own tokenizer, whatever the recipe says
        return load_tokenizer(run_dir)
    chat = data.format == "chat"
    if data.tokenizer == "byte" and hf_path:  # a pretrained model reads its own vocabulary
        tokenizer = _pretrained_tokenizer(hf_path)
        if chat and not tokenizer.chat_template:
            raise ConfigError(f"{hf_path!r} has no chat_template; accepted for data.format='chat': a model whose "
                              "tokenizer carries one (an instruction-tuned model's folder or GGUF file)")
    elif data.tokenizer == "byte":
        tokenizer = ByteTokenizer()
    elif data.tokenizer == "bpe":
        where = cache_root(data.cache_dir) / "tokenizers" / f"bpe-{data.bpe_vocab_size}-{corpus.fingerprint[:16]}"
        if d.main and not (where / "tokenizer.json").is_file():
            tok = train_bpe(corpus.texts("train"), data.bpe_vocab_size, show_progress=True)
            with atomic_folder(where, TOKENIZER_KIND, overwrite=True, action="cache the trained BPE tokenizer") as tmp:
                tok.save(tmp)
        barrier(d)
        tokenizer = load_tokenizer(where)
    else:
        path = Path(data.tokenizer).expanduser()
        if not (path / "tokenizer.json").is_file():
            accepted = ("'byte' nor a folder holding a tokenizer.json (for chat data: the base model's folder)" if chat
                        else "'byte', 'bpe' nor a folder holding a tokenizer.json")
            raise ConfigError(f"data.tokenizer={data.tokenizer!r} is neither {accepted}")
        tokenizer = load_tokenizer(path)
    return tokenizer.with_chat_tokens() if chat and not tokenizer.chat_template else tokenizer


def fit_model_config(model: ModelConfig, tokenizer) -> ModelConfig:
    """`model` with the tokenizer's BOS as its document start; refused when the vocabulary is too small or the BOS
    ids disagree."""
    if model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={model.vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer.vocab_size} ids; set model.vocab_size >= {tokenizer.vocab_size}")
    if model.bos_token_id is None:  # document starts must be plain: take the tokenizer's BOS
        return model.replace(bos_token_id=tokenizer.bos_id)
    if model.bos_token_id != tokenizer.bos_id:
        raise ConfigError(f"model.bos_token_id={model.bos_token_id} differs from the tokenizer's BOS id "
                          f"{tokenizer.bos_id}; set model.bos_token_id = {tokenizer.bos_id} (or leave it out)")
    return model
