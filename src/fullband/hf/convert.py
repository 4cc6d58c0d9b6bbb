"""`fullband convert`: native checkpoint folder <-> transformers folder (and a Llama folder into either).

  native   config.json with "format": "fullband" + model.safetensors (+ tokenizer.json)   FullbandLM.load
  hf       config.json with "model_type": "fullband" + model.safetensors                 AutoModelForCausalLM
  llama    a LlamaForCausalLM folder (read only; converted through fullband.hf.from_llama)
  gguf     a GGUF file of a Llama-family model (read only; dequantized by transformers' GGUF reader, then as llama)

Weights are copied unchanged (HF names are the native ones under `model.`), so native -> hf -> native is
bitwise. A pretrained model's tokenizer travels untouched in every direction: its vocabulary (no id added), its
special tokens, BOS policy, chat template and end-of-turn ids (special_ids.json beside tokenizer.json, so fullband
reads a transformers folder as transformers does). The destination is written to a temporary sibling folder and
renamed into place when complete."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fullband.data.tokenizer import (BYTE_TOKENIZER_FILE, SPECIAL_IDS_FILE, SPECIAL_TOKENS, BPETokenizer,
                                     PretrainedTokenizer, load_tokenizer)
from fullband.errors import CheckpointError, ConfigError
from fullband.files import Kind, atomic_folder, check_destination, read_json, read_json_file
from fullband.folder import (HF_INDEX_FILE, HF_MODEL_TYPE, MODEL_KIND, is_transformers_folder, load_transformers_folder,
                             write_model_files)
from fullband.gguf_file import gguf_args, gguf_path, is_gguf, parsed_once
from fullband.hf.gguf import load_causal_lm, require_native
from fullband.hf.gguf_out import GGUF_TYPES, check_exportable_type, export_gguf, read_sidecar, sidecar_tokenizer
from fullband.hf.llama import from_llama
from fullband.model.config import require_one_slot
from fullband.model.decoder import FullbandLM

TARGETS = ("hf", "native", "gguf")
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


# what save_pretrained and convert write into a transformers folder of ours (the model's code: fullband.hf.remote)
HF_KIND = Kind("transformers fullband folder",
               frozenset({"config.json", "generation_config.json", "model.safetensors", HF_INDEX_FILE,
                          "modeling_fullband.py", "chat_template.jinja", "added_tokens.json", BYTE_TOKENIZER_FILE,
                          SPECIAL_IDS_FILE, *HF_TOKENIZER_FILES}),
               patterns=(r"model-\d{5}-of-\d{5}\.safetensors", r"fullband_[a-z_]+\.py"),
               marker=is_transformers_folder)


def detect(src: str | Path) -> str:
    """The kind of checkpoint `src` is: 'native', 'hf' or 'llama' (folders), or 'gguf' (a .gguf file)."""
    if is_gguf(src):
        return "gguf"
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


def pretrained_source(path: str | Path) -> bool:
    """Whether `path` names a standard pretrained model fullband converts (a GGUF file, or a transformers Llama
    folder) rather than a folder fullband wrote: train.init_from then takes its sizes and tokenizer."""
    if not path:
        return False
    if is_gguf(path):
        return True
    data = read_json(Path(path) / "config.json")
    return isinstance(data, dict) and data.get("model_type") == "llama"


@parsed_once()  # the header check, config, tokenizer and weights of a GGUF source: one parse
def convert(src: str | Path, dst: str | Path, *, to: str | None = None, dtype: torch.dtype | None = None,
            fusion: str = "gated", overwrite: bool = False, gguf_type: str | None = None) -> tuple[str, str]:
    """Convert folder `src` into `dst` (format `to`: 'hf', 'native' or 'gguf'; default 'gguf' for a dst ending in
    .gguf, else the other one, 'native' for a Llama). A GGUF file is written as fullband.hf.gguf_out writes it
    (`gguf_type` F32 / F16 / Q8_0, default F32; refused for a folder). Returns (source kind, target kind)."""
    src, dst = Path(src), Path(dst)
    kind = detect(src)
    if kind == "gguf":  # refused by name before anything is written or loaded
        require_native(src, use="fullband convert")
        src = gguf_path(src)
    if to is None and dst.suffix == ".gguf":
        to = "gguf"
    if to == "gguf":
        if dtype is not None:
            raise ConfigError("dtype applies to folders; a GGUF file's precision is gguf_type (--gguf-type): "
                              f"{', '.join(GGUF_TYPES)}")
        check_exportable_type(gguf_type or "F32")
        native, tokenizer = _read(src, kind, fusion)
        export_gguf(native, dst, tokenizer=tokenizer, dtype=gguf_type or "F32", overwrite=overwrite)
        return kind, "gguf"
    if gguf_type is not None:
        raise ConfigError(f"gguf_type={gguf_type!r} (--gguf-type) is a GGUF file's tensor type, but {str(dst)!r} is "
                          "written as a folder; accepted: a destination FILE.gguf (or --to gguf), or drop it")
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
    native, tokenizer = _read(src, kind, fusion)
    if target == "hf":
        require_one_slot(native.config, "a transformers folder (convert to='hf')")
    if tokenizer is not None and tokenizer.vocab_size > native.config.vocab_size:
        raise CheckpointError(f"{src}: its tokenizer has {tokenizer.vocab_size} ids, more than the model's "
                              f"{native.config.vocab_size} embedding rows; nothing was written")
    if dtype is not None:
        native = native.to(dtype)
    stops = list(getattr(tokenizer, "stop_ids", ())) if _ends_turns(tokenizer) else []
    with atomic_folder(dst, out_kind, overwrite=overwrite, sources=[src], flag=flag, error=CheckpointError,
                       action=f"write the {target} folder") as tmp:
        if target == "hf":
            _write_hf(native, tmp, src, tokenizer, stops)
        else:  # model.safetensors + tokenizer + config.json (last: it records the other files)
            write_model_files(tmp, native.config, native.state_dict(), tokenizer=tokenizer)
    return kind, target


def _ends_turns(tokenizer) -> bool:
    """Whether a tokenizer's stop ids belong in the converted config (eos_token_id), so that transformers' and
    vLLM's generate end where fullband's does: a pretrained model's own, or a chat vocabulary's."""
    return isinstance(tokenizer, PretrainedTokenizer) or bool(getattr(tokenizer, "chat_ids", None))


def source_stop_ids(src: Path) -> list[int]:
    """The EOS id(s) a transformers folder declares (generation_config.json, else config.json; [] when none):
    the converted model keeps them as its default stop tokens, as transformers' generate would stop there."""
    for name in ("generation_config.json", "config.json"):
        ids = hf_stop_ids(read_json(src / name) or {})
        if ids:
            return ids
    return []


def _read(src: Path, kind: str, fusion: str):
    """(native model, tokenizer or None) of a source: a Llama folder or GGUF file with its own tokenizer (its EOS
    ids the stop ids, as transformers' generate stops there), a folder of ours with the tokenizer it holds."""
    if kind == "native":
        native = FullbandLM.load(src)
    elif kind == "hf":
        native = load_transformers_folder(src)
    else:
        side, meta = read_sidecar(src) if kind == "gguf" else ({}, {})  # a sidecar not the file's own: refused first
        if kind == "gguf":
            hf = load_causal_lm(src)
            stops = hf_stop_ids(hf.generation_config) or hf_stop_ids(hf.config)
        else:
            hf, stops = str(src), source_stop_ids(src)
        if meta:  # a file fullband wrote: the config and feedback weights as they were, the trunk from the file
            native = from_llama(hf, **json.loads(meta["config"]))
            native.load_state_dict(side, strict=False)
            return native, sidecar_tokenizer(meta)
        native = from_llama(hf, fusion=fusion)
        has_tokenizer = kind == "gguf" or any((src / name).is_file() for name in HF_TOKENIZER_FILES)
        return native, PretrainedTokenizer.from_pretrained(src, stop_ids=tuple(stops)) if has_tokenizer else None
    if not ((src / "tokenizer.json").is_file() or (src / BYTE_TOKENIZER_FILE).is_file()):
        return native, None
    try:
        return native, load_tokenizer(src)
    except CheckpointError:  # a tokenizer the native tools cannot read: left behind, as before
        return native, None


def hf_stop_ids(config) -> list[int]:
    """The EOS id(s) a transformers (generation) config, or its JSON object, declares, as a list ([] when none)."""
    eos = config.get("eos_token_id") if isinstance(config, dict) else getattr(config, "eos_token_id", None)
    ids = eos if isinstance(eos, list) else [eos]
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0]


def _write_hf(native, out: Path, src: Path, tokenizer, stops: list[int]) -> None:
    from fullband.hf.modeling import FullbandForCausalLM

    eos = {"eos_token_id": stops if len(stops) > 1 else stops[0]} if stops else {}
    FullbandForCausalLM.from_native(native, **eos).save_pretrained(out)
    if tokenizer is not None:
        save_hf_tokenizer(tokenizer, out, src)


def save_hf_tokenizer(tokenizer, out: Path, src: Path | None = None) -> None:
    """The tokenizer as transformers (AutoTokenizer) and vLLM read it, into folder `out`, padding on the left (a
    batch of prompts for generate ends where each prompt ends; right-padded rows would continue after their
    padding, silently). A pretrained model's tokenizer keeps its own special tokens, BOS policy and chat template
    (and special_ids.json, so fullband reads the folder back as it was); fullband's byte and BPE vocabularies get
    their <bos> / <eos> / <pad> and, for a chat vocabulary, the marker template."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from fullband.data.chat.templates import hf_chat_template

    chat = {"chat_template": hf_chat_template(tokenizer)} if hf_chat_template(tokenizer) else {}
    if isinstance(tokenizer, PretrainedTokenizer):
        if pretrained_source(src):
            # a Llama folder or GGUF file: transformers' own tokenizer, with everything it keeps beside the vocabulary
            name, extra = gguf_args(src)
            hf = AutoTokenizer.from_pretrained(name, **extra)
        else:
            backend = type(tokenizer.hf_tokenizer).from_str(tokenizer.hf_tokenizer.to_str())
            names = {k: tokenizer.token(i) for k, i in
                     (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id), ("pad_token", tokenizer.pad_id))}
            hf = PreTrainedTokenizerFast(tokenizer_object=backend, **names, **chat)
        hf.padding_side = hf.init_kwargs["padding_side"] = "left"  # init_kwargs: what save_pretrained records
        for key in ("is_local", "local_files_only"):  # where it was read from, not what it is
            hf.init_kwargs.pop(key, None)
        hf.save_pretrained(out)
        tokenizer.save_ids(out)
        return
    bos, eos, pad = SPECIAL_TOKENS
    bpe = isinstance(tokenizer, BPETokenizer)  # AutoTokenizer reads a BPE as a fast tokenizer
    # the byte tokenizer: its transformers equivalent for other tools, and itself for the way back
    backend = type(tokenizer.hf_tokenizer).from_str(tokenizer.hf_tokenizer.to_str()) if bpe else tokenizer.to_hf()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=pad, padding_side="left",
                            **chat).save_pretrained(out)
    if not bpe:
        tokenizer.save(out, name=BYTE_TOKENIZER_FILE)
