"""The model folder on disk: `config.json` (the resolved ModelConfig, written last with a record of the other
files) and `model.safetensors` (+ tokenizer). Written atomically (a temporary sibling folder renamed into place)
so a crash never leaves half a folder; read with every size checked against the weights file's own header before
anything is allocated. A transformers folder of ours (`fullband convert --to hf`, save_pretrained: config.json of
model_type "fullband", the weights under `model.`) is read here too, into its native model, by the same checks.
Which model a folder holds is decided above, in fullband.loader."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from fullband.errors import CheckpointError, ConfigError, FullbandError, FullbandWarning
from fullband.files import Kind, atomic_folder, check_record, describe_entries, file_record, read_json, read_json_file
from fullband.model.config import ModelConfig
from fullband.version import __version__

CONFIG_FILE = "config.json"
HF_CONFIG_KEY = "hf_config"  # in config.json of a wrapped Hugging Face model: its transformers config
WEIGHTS_FILE = "model.safetensors"
FORMAT = "fullband"
FORMAT_VERSION = 1
MODEL_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE, "tokenizer.json", "special_ids.json", "chat_template.jinja"})
FILES_KEY = "files"  # in config.json: {name: {"bytes", "sha256"}} of every other file, recorded at save time


def _is_native_folder(folder: Path) -> bool:
    data = read_json(folder / CONFIG_FILE)
    return data is not None and data.get("format") == FORMAT


EVAL_OUTPUTS = ("loss", "stability", "probe", "generate_length")  # fullband eval WHAT writes WHAT.json / WHAT.png
EVAL_KIND = Kind("fullband eval output folder", frozenset(f"{w}.{ext}" for w in EVAL_OUTPUTS for ext in ("json", "png")))
# a saved model folder: config.json + model.safetensors + tokenizer, and the eval/ folder fullband eval adds
MODEL_KIND = Kind("model folder", MODEL_FILES, marker=_is_native_folder, subfolders={"eval": EVAL_KIND})


def write_model_files(directory: Path, config: Any, state: dict[str, torch.Tensor], *, tokenizer: Any = None,
                      metadata: dict | None = None) -> None:
    """model.safetensors (+ tokenizer.json), then config.json, into an existing folder (no atomicity here).
    config.json is written last and records the size and sha256 of every other file in the folder."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():  # tied weights (one storage, two names) are written as two tensors
        tensor = tensor.detach().to("cpu").contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    save_file(out, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(directory)
    write_config_file(directory, config, metadata)


def write_config_file(directory: Path, config: Any, metadata: dict | None = None) -> None:
    """config.json: the format, the ModelConfig, `metadata`, and the record of the folder's other files."""
    data = {"format": FORMAT, "format_version": FORMAT_VERSION, "fullband_version": __version__,
            "model": config.to_dict(), **(metadata or {}), FILES_KEY: file_record(directory, skip=[CONFIG_FILE])}
    (directory / CONFIG_FILE).write_text(json.dumps(data, indent=2) + "\n")


def save_model(model: torch.nn.Module, directory: str | Path, *, tokenizer: Any = None, metadata: dict | None = None,
               overwrite: bool = False) -> Path:
    """Write model (and tokenizer) into `directory`: a new or empty folder, or (with overwrite=True) a model
    folder saved earlier, replaced only once everything is written (its tokenizer is kept when no new one is given).
    Anything else is refused (OutputError)."""
    directory = Path(directory)
    with atomic_folder(directory, MODEL_KIND, overwrite=overwrite, action="save the model",
                       flag="overwrite=True (--overwrite)", error=CheckpointError) as tmp:
        if tokenizer is None and (directory / "tokenizer.json").is_file():
            tokenizer = _saved_tokenizer(directory, model.config.vocab_size)
        metadata = {**model_metadata(model), **(metadata or {})}
        write_model_files(tmp, model.config, model.state_dict(), tokenizer=tokenizer, metadata=metadata)
    return directory


def _saved_tokenizer(directory: Path, vocab_size: int) -> Any:
    """The tokenizer of the model folder about to be overwritten, when it still fits the new model's vocabulary."""
    from fullband.data.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(directory)
    except FullbandError as err:
        warnings.warn(f"{directory}: the saved tokenizer was not kept ({err})", FullbandWarning, stacklevel=4)
        return None
    if tokenizer.vocab_size > vocab_size:
        warnings.warn(f"{directory}: the saved tokenizer ({tokenizer.vocab_size} ids) was not kept: the new model has "
                      f"vocab_size={vocab_size}; pass tokenizer=...", FullbandWarning, stacklevel=4)
        return None
    return tokenizer


def model_metadata(model: torch.nn.Module) -> dict:
    """What a model adds to its config.json beyond the ModelConfig (a wrapped HF model: its HF config)."""
    hook = getattr(model, "checkpoint_metadata", None)
    return hook() if callable(hook) else {}


def read_config(directory: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint folder, with an error naming the folder and file on any problem."""
    return _model_config(directory, read_config_file(directory))


def read_config_file(directory: str | Path) -> dict:
    """The checked contents of a checkpoint folder's config.json."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint folder {str(directory)!r} does not exist (or is not a folder)")
    path = directory / CONFIG_FILE
    if not (path.exists() or path.is_symlink()):
        raise CheckpointError(f"{str(directory)!r} is not a fullband checkpoint: {CONFIG_FILE} is missing "
                              f"(a checkpoint holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    data = read_json_file(path, "the model config", error=CheckpointError)
    if not isinstance(data, dict) or data.get("format") != FORMAT or "model" not in data:
        raise CheckpointError(f"{path} is not a fullband config (expected format={FORMAT!r} and a 'model' section)")
    version = data.get("format_version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise CheckpointError(f"{path}: format_version={version!r} is invalid; accepted: an integer from 0 to "
                              f"{FORMAT_VERSION}")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format_version={version}, newer than this fullband reads "
                              f"({FORMAT_VERSION}); upgrade fullband")
    files = data.get(FILES_KEY, {})
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        raise CheckpointError(f"{path}: '{FILES_KEY}' is not a record of files ({{name: {{bytes, sha256}}}})")
    return data


# fields a folder written before they existed leaves out, whose default is what such a folder meant
QUIET_DEFAULTS = ("feedback_trained",)


def _model_config(directory: str | Path, data: dict) -> ModelConfig:
    path = Path(directory) / CONFIG_FILE
    try:
        config = ModelConfig.from_dict(data["model"], source=str(path))
    except (ConfigError, TypeError) as err:
        raise CheckpointError(f"{path}: invalid model config: {err}") from None
    filled = [f"{k}={v!r}" for k, v in config.to_dict().items() if k not in data["model"] and k not in QUIET_DEFAULTS]
    if filled:
        warnings.warn(f"{path} does not set {len(filled)} model field(s); defaults used: {', '.join(filled)}",
                      FullbandWarning, stacklevel=3)
    return config


# safetensors dtype names of floating-point tensors; anything else (I64, U8, BOOL...) is not a weight we read
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def read_header(directory: str | Path, data: dict | None = None,
                name: str = WEIGHTS_FILE) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} of a folder's weights file from its header alone (nothing is allocated), after
    checking the file's size against the one recorded at save time and that every tensor is floating point."""
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    path = directory / name
    if not path.is_file():
        raise CheckpointError(f"{str(directory)!r} is incomplete: {name} is missing")
    record = (data or {}).get(FILES_KEY, {})
    if name in record:
        problems = check_record(directory, {name: record[name]}, hashes=False)
        if problems:
            raise CheckpointError(f"{path} is corrupted or truncated: {problems[0]}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path} is corrupted or truncated: {err}") from None
    check_float(path, header)
    return header


def check_float(path: Path, header: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    wrong = [f"{k} ({dt})" for k, (dt, _) in header.items() if dt not in FLOAT_DTYPES]
    if wrong:
        raise CheckpointError(f"{path} holds non-floating-point tensors {describe_entries(sorted(wrong), 4)}; "
                              f"accepted: weights in {', '.join(FLOAT_DTYPES)} (a model's weights are never cast from "
                              "integers)")


def load_state(directory: str | Path, data: dict | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a folder's model.safetensors, checked (see read_header) and all finite."""
    read_header(directory, data)
    return read_tensors(directory)


def read_tensors(directory: str | Path, name: str = WEIGHTS_FILE) -> dict[str, torch.Tensor]:
    """The tensors of a folder's weights file (whose header was checked), all finite."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory) / name
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path} is corrupted or truncated: {err}") from None
    check_finite(state, path)
    return state


def check_finite(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """CheckpointError naming the tensors that hold NaN or infinity (one pass over the weights)."""
    bad = [name for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise CheckpointError(f"{path} holds NaN or infinite values in {describe_entries(sorted(bad), 4)}; these "
                              "weights cannot be used (a diverged run or a damaged file): load an earlier checkpoint")


def check_shapes(directory: str | Path, config: ModelConfig, expected: dict[str, tuple],
                 header: dict[str, tuple[str, tuple]]) -> None:
    found = {k: shape for k, (_, shape) in header.items()}
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = [f"{k}: {found[k]} in file, {expected[k]} expected"
              for k in expected if k in found and found[k] != expected[k]]
    kinds = (("missing tensors", missing), ("unexpected tensors", unexpected), ("shape mismatch", shapes))
    problems = [f"{what} {describe_entries(items, 4)}" for what, items in kinds if items]
    if problems:
        raise CheckpointError(f"{Path(directory) / WEIGHTS_FILE} does not match {CONFIG_FILE} "
                              f"(d_model={config.d_model}, n_layers={config.n_layers}, fusion={config.fusion!r}): "
                              + "; ".join(problems))


def check_layer_count(directory: str | Path, n_layers: int, names) -> None:
    """Refuse a config whose layer count differs from the weights' before any model is built (a config saying
    10**6 layers must not make the loader build them)."""
    found = 1 + max((int(m) for name in names for m in re.findall(r"\.(\d+)\.", name)), default=-1)
    if found != n_layers:
        raise CheckpointError(f"{Path(directory) / CONFIG_FILE} says n_layers={n_layers} but {WEIGHTS_FILE} holds "
                              f"{found} layers; the folder is inconsistent (was one of its files replaced?)")


def load_native_model(directory: str | Path, config: ModelConfig, header: dict, *, files=(WEIGHTS_FILE,),
                      prefix: str = "", device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """The native FullbandLM of a folder whose config and weights header (names without `prefix`) were read and
    checked: the shapes are compared on the meta device before the weights `files` are read."""
    from fullband.model.decoder import FullbandLM

    with torch.device("meta"):
        model = FullbandLM(config)
    check_shapes(directory, config, {k: tuple(v.shape) for k, v in model.state_dict().items()}, header)
    state = {k.removeprefix(prefix): v for name in files for k, v in read_tensors(directory, name).items()}
    model = model.to_empty(device=device)
    model.rotary.reset_tables()  # non-persistent buffers: to_empty left them uninitialised
    model.load_state_dict(state, strict=True)
    return (model if dtype is None else model.to(dtype)).eval()


HF_MODEL_TYPE = "fullband"  # config.json's model_type in a transformers folder of ours
HF_INDEX_FILE = "model.safetensors.index.json"  # a sharded transformers folder's map of tensor -> file
HF_PREFIX = "model."  # FullbandForCausalLM holds the native model as `.model`


def is_transformers_folder(directory: str | Path) -> bool:
    data = read_json(Path(directory) / CONFIG_FILE)
    return isinstance(data, dict) and data.get("model_type") == HF_MODEL_TYPE


def load_transformers_folder(directory: str | Path, *, device: str | torch.device = "cpu",
                             dtype: torch.dtype | None = None):
    """The native FullbandLM of a transformers folder of ours, read without transformers: the ModelConfig fields of
    its config.json, and its weights (one file or shards) checked against that config before anything is allocated."""
    directory = Path(directory)
    path = directory / CONFIG_FILE
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    try:
        config = ModelConfig.from_dict({k: v for k, v in read_json(path).items() if k in fields}, source=str(path))
    except (ConfigError, TypeError) as err:
        raise CheckpointError(f"{path}: invalid model config: {err}") from None
    index = read_json(directory / HF_INDEX_FILE)
    shards = index.get("weight_map") if isinstance(index, dict) else None
    files = sorted(set(shards.values())) if isinstance(shards, dict) else [WEIGHTS_FILE]
    header = {k.removeprefix(HF_PREFIX): v for name in files for k, v in read_header(directory, name=name).items()}
    check_layer_count(directory, config.n_layers, header)
    return load_native_model(directory, config, header, files=files, prefix=HF_PREFIX, device=device, dtype=dtype)
