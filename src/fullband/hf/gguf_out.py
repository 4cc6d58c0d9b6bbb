"""GGUF out: a full-bandwidth model in the form llama.cpp runs (`fullband convert CKPT OUT.gguf`).

The trunk goes into OUT.gguf in llama.cpp's `llama` layout (the Llama family: what `fullband convert` reads in, so a
warm-started SmolLM2 goes back out), F32, F16 or Q8_0 through the `gguf` package, with its tokenizer; llama.cpp,
transformers' GGUF reader and any other GGUF runtime load it as the model's STANDARD decoder. llama.cpp's loader
refuses a file holding tensors its graph does not use, so what the trunk has no place for (`norm_in` and the
fusion matrices, float32, and the model config) goes in a sidecar beside it, OUT.feedback.safetensors, which the
GGUF file names under `fullband.sidecar` (with `fullband.method`). `fullband.llamacpp.LlamaCppModel` reads both,
and `fullband convert OUT.gguf DIR` reads them back (read_sidecar)."""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from pathlib import Path

import numpy as np
import torch

from fullband.errors import CheckpointError, ConfigError, InputError
from fullband.files import temp_sibling, writing
from fullband.gguf_file import PAIR_KEY, SIDECAR_KEY, gguf_path, inspect_gguf
from fullband.model.weights import lookup, named, split

GGUF_TYPES = ("F32", "F16", "Q8_0")
SIDECAR_SUFFIX = ".feedback.safetensors"
SIDECAR_FORMAT = "fullband-gguf-sidecar"
METHOD_KEY = "fullband.method"
PAIR = "pair"  # the sidecar's copy of the pair's identity (the GGUF file's under PAIR_KEY)
METHOD = "latent feedback (Full-bandwidth Transformer): fuse(e_t, h_{t-1}) fed back into block 0"


def sidecar_path(gguf_file: str | Path) -> Path:
    return Path(f"{gguf_file}{SIDECAR_SUFFIX}".replace(f".gguf{SIDECAR_SUFFIX}", SIDECAR_SUFFIX))


def read_sidecar(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The feedback weights and metadata (format, config, tokenizer files) of the sidecar the GGUF file at `path`
    names (fullband.sidecar, read with the checked header); ({}, {}) for a file without one."""
    from safetensors import SafetensorError, safe_open

    info = inspect_gguf(path)
    name = info["sidecar"]
    if not name:
        return {}, {}
    name = Path(name).name
    file = gguf_path(path).parent / name
    if not file.is_file():
        raise CheckpointError(f"{str(path)!r} names its feedback sidecar {name!r} ({SIDECAR_KEY}), which is not "
                              "beside it; keep both files together (fullband convert writes them)")
    try:
        with safe_open(file, "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as err:
        raise CheckpointError(f"{str(file)!r}: not a readable safetensors file ({err})") from None
    if meta.get("format") != SIDECAR_FORMAT or "config" not in meta:
        raise CheckpointError(f"{str(file)!r} is not a fullband GGUF sidecar (format={meta.get('format')!r})")
    _check_pair(path, file, info, meta)
    return tensors, meta


def _check_pair(path, file: Path, info: dict, meta: dict[str, str]) -> None:
    """Refuse a sidecar that is not the GGUF file's own: another identity (PAIR_KEY: a sidecar written beside
    another file, put here), or, for a pair written before the identity existed, sizes that disagree."""
    said = f"{str(path)!r} and its sidecar {str(file)!r}"
    own = info.get("pair")
    if (own or meta.get(PAIR)) and own != meta.get(PAIR):
        raise CheckpointError(f"{said} are not one pair: the sidecar was written with another GGUF file "
                              f"({PAIR_KEY} {own!r} in the file, {meta.get(PAIR)!r} in the sidecar, which names "
                              f"{meta.get('gguf')!r}); accepted: the two files `fullband convert` wrote together")
    try:
        cfg = json.loads(meta["config"])
    except (TypeError, ValueError):
        raise CheckpointError(f"{str(file)!r}: its config is not JSON; accepted: a sidecar fullband convert wrote") \
            from None
    sizes = info.get("sizes") or {}
    got = {"width": cfg.get("d_model"), "blocks": cfg.get("n_layers"), "vocab": cfg.get("vocab_size")}
    wrong = [f"{k} {v} in the sidecar, {sizes[k]} in the file" for k, v in got.items() if k in sizes and v != sizes[k]]
    if wrong:
        raise CheckpointError(f"{said} disagree: {'; '.join(wrong)}; accepted: the two files `fullband convert` "
                              "wrote together")


def sidecar_tokenizer(meta: dict[str, str]):
    """The tokenizer a sidecar carries (the files tokenizer.save wrote), None when it carries none."""
    from fullband.data.tokenizer import load_tokenizer

    files = json.loads(meta.get("tokenizer", "{}"))
    if not files:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in files.items():
            (Path(tmp) / Path(name).name).write_text(text, encoding="utf-8")
        return load_tokenizer(tmp)


def check_exportable_type(dtype: str) -> None:
    if dtype not in GGUF_TYPES:
        raise InputError(f"GGUF type {dtype!r} is unknown; accepted: {', '.join(GGUF_TYPES)}")


def check_exportable(cfg) -> None:
    """Refuse, in one line naming the field, a model llama.cpp's llama graph with a host-side feedback loop cannot
    compute: the loop reads the final-norm output (llama.cpp's embeddings) and feeds block 0 (the batch's input
    embeddings), and the trunk must be a plain Llama."""
    why = {"ponder": (cfg.ponder, "a ponder model (PonderLM-2) interleaves two slots per token"),
           "loop_start": (cfg.loop_start is not None, "a looped model repeats blocks, which a GGUF trunk does not"),
           "qk_norm": (cfg.qk_norm, "llama.cpp's llama graph has no per-head q/k norm"),
           "attn_gate": (cfg.attn_gate, "llama.cpp's llama graph has no attention output gate"),
           "sliding_window": (cfg.sliding_window is not None, "llama.cpp's llama graph attends globally"),
           "feedback": (cfg.feedback != "final", "llama.cpp hands out the final-norm output only"),
           "feedback_source": (cfg.feedback_source is not None, "llama.cpp hands out the top block's output only"),
           "feedback_target": (cfg.feedback_target != 0, "llama.cpp takes input embeddings at block 0 only")}
    for field, (bad, reason) in why.items():
        if bad:
            raise ConfigError(f"GGUF export: {field}={getattr(cfg, field)!r} is not supported ({reason}); accepted: "
                              "a Llama-family model (from a Llama, SmolLM or GGUF checkpoint: fullband convert / "
                              "train.init_from)")
    if cfg.fusion not in ("gated", "additive", "concat", "none"):
        raise ConfigError(f"GGUF export: fusion={cfg.fusion!r} is not supported (a recurrent mixer with state of its "
                          "own); accepted: gated, additive, concat, none")


def to_gguf_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows from the half-split rotary layout (transformers' and fullband's) to llama.cpp's interleaved
    one: within each head, row i of the first half and row i of the second half become rows 2i and 2i + 1."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _trunk(model) -> tuple[list[tuple[str, np.ndarray]], dict[str, torch.Tensor]]:
    """(GGUF name, float32 array) of every trunk tensor, and the native tensors that stay beside it."""
    import gguf

    cfg = model.config
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, cfg.n_layers)
    trunk, rest = [], {}
    for name, tensor in model.state_dict().items():
        w, layer = lookup(name)
        if not w.llama:
            rest[name] = tensor.detach().float().contiguous()
            continue
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue  # llama.cpp reads a missing output.weight as tied to token_embd
        for source, part in zip((named(w, layer, n) for n in w.llama), split(w, tensor.detach().float(), cfg)):
            if source.endswith(("q_proj.weight", "k_proj.weight")):
                part = to_gguf_rotary(part, cfg.n_heads if "q_proj" in source else cfg.n_kv_heads)
            trunk.append((names.get_name(source, try_suffixes=(".weight",)), part.contiguous().numpy()))
    return trunk, rest


def _stored(gguf, array: np.ndarray, dtype: str):
    """(data, raw type) of one tensor as `dtype` stores it; norms (1-D) and rows Q8_0 cannot block stay F32 / F16."""
    if array.ndim == 1 or dtype == "F32":
        return array, None
    if dtype == "Q8_0" and array.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
        return gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    return array.astype(np.float16), None


def _tokenizer_keys(writer, tokenizer, vocab_size: int) -> None:
    """The tokenizer as llama.cpp's BPE vocabulary (gguf's reader of a tokenizer.json), padded to the model's
    vocab_size with unused tokens. A tokenizer without merges (fullband's byte tokenizer) is written as no
    vocabulary (tokenizer.ggml.model = "none": llama.cpp's BPE reader requires merges): ids in, logits out, the
    text read and written by fullband's tokenizer (fullband.llamacpp does)."""
    import logging

    import gguf

    quiet = logging.getLogger("gguf.vocab")  # its remarks on a pair template (fullband never encodes pairs)
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            hf = tokenizer.to_hf() if hasattr(tokenizer, "to_hf") else tokenizer.hf_tokenizer
            hf.save(str(Path(tmp) / "tokenizer.json"))
            vocab = gguf.vocab.BpeVocab(Path(tmp))
            special = gguf.SpecialVocab(Path(tmp), load_merges=True, n_vocab=vocab_size)
    finally:
        quiet.setLevel(level)
    if not special.merges:
        writer.add_tokenizer_model("none")
        return
    tokens, types = [], []
    for text, _, kind in vocab.all_tokens():
        tokens.append(text if isinstance(text, bytes) else str(text).encode())
        types.append(kind)
    if len(tokens) > vocab_size:
        raise ConfigError(f"GGUF export: the tokenizer has {len(tokens)} tokens, more than the model's vocab_size="
                          f"{vocab_size}")
    tokens += [f"[PAD{i}]".encode() for i in range(len(tokens), vocab_size)]
    types += [gguf.TokenType.UNUSED] * (vocab_size - len(types))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special.add_to_gguf(writer, quiet=True)


def _tokenizer_files(tokenizer) -> dict[str, str]:
    """The files tokenizer.save writes, by name (the sidecar carries them: a byte tokenizer's GGUF has none)."""
    if tokenizer is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(tmp)
        return {f.name: f.read_text(encoding="utf-8") for f in Path(tmp).iterdir() if f.is_file()}


def _write_gguf(gguf, path: Path, out: Path, side: Path, cfg, trunk, dtype: str, tokenizer, pair: str) -> None:
    """The trunk as a llama-layout GGUF file at `path` (published later as `out`), naming its sidecar `side` and
    carrying `pair`, the identity its sidecar carries too."""
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                 "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(out.stem)
    writer.add_file_type(int(file_type))
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_string(METHOD_KEY, METHOD if cfg.has_feedback else "none (a standard model)")
    writer.add_string(SIDECAR_KEY, side.name)
    writer.add_string(PAIR_KEY, pair)
    if tokenizer is not None:
        _tokenizer_keys(writer, tokenizer, cfg.vocab_size)
    for name, array in trunk:
        data, raw = _stored(gguf, array, dtype)
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def export_gguf(model, out: str | Path, *, tokenizer=None, dtype: str = "F32", overwrite: bool = False) -> Path:
    """Write `model` (a FullbandLM) as OUT.gguf (the trunk, `dtype` F32 / F16 / Q8_0) and OUT.feedback.safetensors
    beside it (its feedback weights, config and tokenizer). Refuses what llama.cpp cannot run (check_exportable) and an
    existing file unless overwrite; both files are written to temporaries and renamed into place. -> OUT."""
    import gguf
    from safetensors.torch import save_file

    from fullband.model.decoder import FullbandLM

    if not isinstance(model, FullbandLM):
        raise ConfigError(f"GGUF export writes a native FullbandLM; got {type(model).__name__} (a model.hf_path run "
                          "wraps another architecture, which llama.cpp's llama layout does not hold)")
    cfg = model.config
    check_exportable_type(dtype)
    check_exportable(cfg)
    out = Path(out)
    side = sidecar_path(out)
    for path in (out, side):
        if path.exists() and not overwrite:
            raise InputError(f"{str(path)!r} exists; pass --overwrite (overwrite=True) to replace it")
    trunk, rest = _trunk(model)
    action = f"write {out.name} and {side.name}"
    with writing(out, action):
        tmp_gguf, tmp_side = temp_sibling(out), temp_sibling(side)
    pair = uuid.uuid4().hex  # the identity both files carry: a reader refuses a sidecar that is not this file's
    try:
        with writing(out, action):  # a full disk names the file asked for, not a temporary (or stdout)
            _write_gguf(gguf, tmp_gguf, out, side, cfg, trunk, dtype, tokenizer, pair)
            save_file(rest, str(tmp_side), metadata={
                "format": SIDECAR_FORMAT, "config": json.dumps(cfg.to_dict()), "gguf": out.name, PAIR: pair,
                "method": METHOD, "tokenizer": json.dumps(_tokenizer_files(tokenizer))})
            os.replace(tmp_side, side)
            os.replace(tmp_gguf, out)
    finally:
        for tmp in (tmp_gguf, tmp_side):
            tmp.unlink(missing_ok=True)
    return out
