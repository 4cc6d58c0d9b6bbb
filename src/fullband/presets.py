"""Model shapes by name, reading a model config from a preset, a TOML/JSON file, and key=value overrides, and
finding the recipes that ship with the package (configs/NAME)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fullband.configio import apply_overrides, read_settings_file
from fullband.errors import ConfigError, closest
from fullband.model.config import ModelConfig

# The recipes (configs/*.toml, configs/quiz.jsonl) live in the package, so an installed fullband has them; the
# repository's configs/ is a link to this folder.
RECIPES = Path(__file__).parent / "configs"

BYTE = dict(vocab_size=259, bos_token_id=256)

PRESETS: dict[str, dict[str, Any]] = {
    # a few-second CPU model for tests and the demo
    "tiny": dict(BYTE, d_model=128, n_layers=4, n_heads=4, max_seq_len=512),
    # the decode benchmark's shape: 12 layers, D 768, vocab 8192, ~91M parameters
    "bench-91m": dict(vocab_size=8192, d_model=768, n_layers=12, n_heads=12, d_ff=2048, max_seq_len=2048),
}


def recipe_path(spec: str | Path) -> Path:
    """`spec` as a path; when nothing is there and it is spelled configs/NAME (as the manual, the experiments and
    the demo name the recipes), the recipe NAME shipped with the package, so they are found from any folder."""
    path = Path(spec)
    if path.exists() or path.is_symlink() or path.parent != Path("configs"):
        return path
    shipped = RECIPES / path.name
    return shipped if shipped.is_file() else path


def load_model_config(spec: str, overrides: list[str] | None = None) -> ModelConfig:
    """A preset name or a .toml/.json file (its [model] table, or the whole file), then overrides."""
    path = recipe_path(spec)
    if spec in PRESETS:
        data, source = dict(PRESETS[spec]), f"preset {spec!r}"
    elif path.suffix in (".toml", ".json"):
        data = read_settings_file(path, path.suffix[1:].upper())
        data, source = data.get("model", data), spec
        if not isinstance(data, dict):
            raise ConfigError(f"{spec}: [model] is not a table of settings")
        data = dict(data)
    else:
        raise ConfigError(f"config {spec!r} is neither a preset{closest(spec, PRESETS)} nor a .toml/.json file; "
                          f"presets: {', '.join(PRESETS)}")
    data = apply_overrides(data, overrides)
    return ModelConfig.from_dict(data, source=source)
