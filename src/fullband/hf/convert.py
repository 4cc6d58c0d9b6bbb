"""`fullband convert`: native checkpoint folder <-> transformers folder (and a Llama folder into either).

  native   config.json with "format": "fullband" + model.safetensors (+ tokenizer.json)   FullbandLM.load
  hf       config.json with "model_type": "fullband" + model.safetensors                 AutoModelForCausalLM
  llama    a LlamaForCausalLM folder (read only; converted through fullband.hf.from_llama)

Weights are copied unchanged (HF names are the native ones under `model.`), so native -> hf -> native is
bitwise. The destination is written to a temporary sibling folder and renamed into place when complete."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from fullband.data.tokenizer import BYTE_TOKENIZER_FILE
from fullband.errors import CheckpointError, ConfigError
from fullband.files import Kind, atomic_folder, check_destination, read_json, read_json_file
from fullband.folder import HF_INDEX_FILE, HF_MODEL_TYPE, is_transformers_folder, load_transformers_folder
from fullband.model.config import require_one_slot

TARGETS = ("hf", "native")
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


# what save_pretrained and convert write into a transformers folder of ours (the model's code: fullband.hf.remote)
HF_KIND = Kind("transformers fullband folder",
               frozenset({"config.json", "generation_config.json", "model.safetensors", HF_INDEX_FILE,
                          "modeling_fullband.py", "chat_template.jinja", "added_tokens.json", BYTE_TOKENIZER_FILE,
                          *HF_TOKENIZER_FILES}),
               patterns=(r"model-\d{5}-of-\d{5}\.safetensors", r"fullband_[a-z_]+\.py"),
               marker=is_transformers_folder)


def detect(src: str | Path) -> str:
    """The kind of checkpoint folder `src` is: 'native', 'hf' or 'llama'."""
    path = Path(src) / "config.json"
    if not (path.exists() or path.is_symlink()):
        raise CheckpointError(f"{str(src)!r} is not a checkpoint folder: {path.name} is missing")
    data = read_json_file(path, "the config", error=CheckpointError)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}; accepted: a config object")
    if data.get("format") == "fullband":
        return "native"
    kind = {HF_MODEL_TYPE: "hf", "llama": "llama"}.get(data.get("model_type"))
    if kind is None:
        raise CheckpointError(f"{path}: neither a fullband checkpoint (format 'fullband') nor a transformers "
                              f"folder of model_type 'fullband' or 'llama' (model_type={data.get('model_type')!r})")
    return kind


def convert(src: str | Path, dst: str | Path, *, to: str | None = None, dtype: torch.dtype | None = None,
            fusion: str = "gated", overwrite: bool = False) -> tuple[str, str]:
    """Convert folder `src` into `dst` (format `to`: 'hf' or 'native'; default the other one, 'native' for a
    Llama). Returns (source kind, target kind)."""
    from fullband.folder import MODEL_KIND

    src, dst = Path(src), Path(dst)
    kind = detect(src)
    target = to if to is not None else ("hf" if kind == "native" else "native")
    if target not in TARGETS:
        raise ConfigError(f"to={target!r} is not a target format; accepted: {', '.join(TARGETS)}")
    if kind == target:
        raise ConfigError(f"{str(src)!r} is already a {kind} folder; accepted targets from it: "
                          f"{', '.join(t for t in TARGETS if t != kind)}")
    out_kind = HF_KIND if target == "hf" else MODEL_KIND
    flag = "overwrite=True (--overwrite)"
    # before the (slow) read, and again before the rename
    check_destination(dst, out_kind, overwrite=overwrite, sources=[src], flag=flag, error=CheckpointError)
    native = _read_native(src, kind, fusion)
    if target == "hf":
        require_one_slot(native.config, "a transformers folder (convert to='hf')")
    if dtype is not None:
        native = native.to(dtype)
    stops = source_stop_ids(src) if kind == "llama" else _chat_stop_ids(src)
    with atomic_folder(dst, out_kind, overwrite=overwrite, sources=[src], flag=flag, error=CheckpointError,
                       action=f"write the {target} folder") as tmp:
        if target == "hf":
            _write_hf(native, tmp, src, kind, stops)
        else:
            _write_native(native, tmp, src, kind, stops)
    return kind, target


def _chat_stop_ids(src: Path) -> list[int]:
    """A chat vocabulary's stop ids (EOS and the end-of-turn marker), so transformers' and vLLM's generate end a
    turn where fullband's does; [] for other folders (their converted config names no EOS, as before)."""
    from fullband.data.tokenizer import load_tokenizer

    if not (src / "tokenizer.json").is_file():
        return []
    try:
        tokenizer = load_tokenizer(src)
    except CheckpointError:
        return []
    return list(tokenizer.stop_ids) if tokenizer.chat_ids else []


def source_stop_ids(src: Path) -> list[int]:
    """The EOS id(s) a transformers folder declares (generation_config.json, else config.json; [] when none):
    the converted model keeps them as its default stop tokens, as transformers' generate would stop there."""
    for name in ("generation_config.json", "config.json"):
        data = read_json(src / name) or {}
        eos = data.get("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos]
        ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
        if ids:
            return ids
    return []


def _read_native(src: Path, kind: str, fusion: str):
    if kind == "native":
        from fullband.model.decoder import FullbandLM

        return FullbandLM.load(src)
    if kind == "llama":
        from fullband.hf.llama import from_llama

        return from_llama(str(src), fusion=fusion)
    return load_transformers_folder(src)


def _write_hf(native, out: Path, tokenizer_dir: Path, kind: str, stops: list[int]) -> None:
    from fullband.hf.modeling import FullbandForCausalLM

    eos = {"eos_token_id": stops if len(stops) > 1 else stops[0]} if stops else {}
    FullbandForCausalLM.from_native(native, **eos).save_pretrained(out)
    if kind == "llama":  # an HF tokenizer already: copy its files
        for name in HF_TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, out / name)
        return
    if not (tokenizer_dir / "tokenizer.json").is_file():
        return
    from transformers import PreTrainedTokenizerFast

    from fullband.data.chat.templates import hf_chat_template
    from fullband.data.tokenizer import SPECIAL_TOKENS, BPETokenizer, load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    bos, eos, pad = SPECIAL_TOKENS
    # a chat vocabulary carries its template, so AutoTokenizer.apply_chat_template and vLLM's chat API render
    # conversations exactly as fullband's own template does
    chat = {"chat_template": hf_chat_template(tokenizer)} if hf_chat_template(tokenizer) else {}
    bpe = isinstance(tokenizer, BPETokenizer)  # AutoTokenizer reads a BPE as a fast tokenizer
    # the byte tokenizer: its transformers equivalent for other tools, and itself for the way back
    file = str(tokenizer_dir / "tokenizer.json")
    source = {"tokenizer_file": file} if bpe else {"tokenizer_object": tokenizer.to_hf()}
    # left padding: a batch of prompts for generate ends where each prompt ends (right-padded rows would
    # continue after their padding, silently)
    PreTrainedTokenizerFast(**source, bos_token=bos, eos_token=eos, pad_token=pad, padding_side="left",
                            **chat).save_pretrained(out)
    if not bpe:
        shutil.copy2(tokenizer_dir / "tokenizer.json", out / BYTE_TOKENIZER_FILE)


def _write_native(native, out: Path, tokenizer_dir: Path, kind: str, stops: list[int]) -> None:
    """model.safetensors + tokenizer + config.json (last: it records the other files)."""
    from fullband.folder import write_model_files
    from fullband.data.tokenizer import PretrainedTokenizer, load_tokenizer

    tokenizer = None
    byte = tokenizer_dir / BYTE_TOKENIZER_FILE
    if (tokenizer_dir / "tokenizer.json").is_file() and kind == "llama":
        # its own tokenizer, with its BOS and EOS ids: fullband generate stops at the EOS, as transformers does
        tokenizer = PretrainedTokenizer.from_pretrained(tokenizer_dir, stop_ids=tuple(stops))
    elif byte.is_file():
        shutil.copy2(byte, out / "tokenizer.json")
    elif (tokenizer_dir / "tokenizer.json").is_file():
        try:
            load_tokenizer(tokenizer_dir)
        except CheckpointError:  # a tokenizer the native tools cannot read: leave it with its model
            pass
        else:
            shutil.copy2(tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    write_model_files(out, native.config, native.state_dict(), tokenizer=tokenizer)
