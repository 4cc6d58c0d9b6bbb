"""What a run records and shows while it trains, kept out of the training loop: metrics.jsonl (always),
TensorBoard and Weights & Biases (when asked for, imported lazily), the progress bar, and the loss plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from fullband.errors import ConfigError
from fullband.files import writing
from fullband.train.config import RunConfig
from fullband.train.parallel import Dist

if TYPE_CHECKING:
    from fullband.eval.gate import Gate

METRICS_FILE = "metrics.jsonl"


def progress_bar(cfg: RunConfig, d: Dist, start: int, total: int):
    if not (cfg.log.progress and d.main):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)


class MetricsLog:
    """metrics.jsonl always; TensorBoard and Weights & Biases when the run's [log] asks for them (imported lazily;
    `cfg` None: metrics.jsonl alone, as `fullband rl` logs)."""

    def __init__(self, run_dir: Path, cfg: RunConfig | None = None, d: Dist | None = None) -> None:
        self.path = run_dir / METRICS_FILE
        self.file = open(self.path, "a")
        self.tb = self.wandb = None
        if cfg is not None and cfg.log.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("log.tensorboard = true needs the tensorboard package: pip install tensorboard") from None
            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        if cfg is not None and cfg.log.wandb:
            try:
                import wandb
            except ImportError:
                raise ConfigError("log.wandb = true needs the wandb package: pip install wandb") from None
            self.wandb = wandb.init(project=cfg.log.wandb_project, dir=str(run_dir), config=cfg.to_dict(),
                                    name=run_dir.name, resume="allow")

    def log(self, row: dict) -> None:
        with writing(self.path, "log the step's metrics"):
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        flat = _flatten(row)
        step = row["step"]
        if self.tb is not None:
            for key, value in flat.items():
                if key != "step":
                    self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(flat, step=step)

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _flatten(row: dict, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}/"))
        elif isinstance(value, list):
            out.update({f"{name}/{i + 1}": v for i, v in enumerate(value)})
        elif isinstance(value, int | float):
            out[name] = value
    return out


def metric_rows(metrics: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def plot_metrics(metrics: Path, out: Path) -> Path | None:
    """Training loss per pass count (smoothed) and validation loss against tokens, as a PNG."""
    from fullband.files import plt as pyplot, save_figure

    try:
        plt = pyplot()
    except ImportError:
        return None
    rows = metric_rows(metrics)
    train_rows = [r for r in rows if "loss_pass" in r]
    eval_rows = [r for r in rows if "eval" in r]
    if not train_rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    by_k: dict[int, list[tuple[float, float]]] = {}
    for r in train_rows:
        by_k.setdefault(r["k"], []).append((r["tokens"] / 1e6, r["loss_pass"][-1]))
    first = [(r["tokens"] / 1e6, r["loss_pass"][0]) for r in train_rows]
    ax.plot(*zip(*_smooth(first, max(1, len(first) // 50))), label="train, pass 1", lw=1.2)
    for k, pts in sorted(by_k.items()):
        if k > 1 and len(pts) > 1:
            ax.plot(*zip(*_smooth(pts, max(1, len(pts) // 50))), label=f"train, pass {k} (steps with k={k})", lw=1, alpha=0.8)
    for k in sorted({k for r in eval_rows for k in r["eval"]}, key=int):
        pts = [(r["tokens"] / 1e6, r["eval"][k]) for r in eval_rows if k in r["eval"]]
        ax.plot(*zip(*pts), "o--", label=f"validation, {k} pass{'es' if k != '1' else ''}", ms=4)
    ax.set(xlabel="training tokens (millions)", ylabel="loss (nats / token)",
           title=f"{metrics.parent.name}: multi-pass training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, out)
    return out


def _smooth(points: list[tuple[float, float]], window: int) -> list[tuple[float, float]]:
    """Each point's y averaged with the window - 1 before it."""
    ys = [y for _, y in points]
    return [(x, sum(ys[max(0, i - window + 1) : i + 1]) / min(i + 1, window)) for i, (x, _) in enumerate(points)]


def last_gate(run_dir: str | Path) -> Gate | None | bool:
    """The gate at the last eval of a run directory that recorded one (metrics.jsonl): a Gate; False when the run
    has evals but none with a gate (trained before the gate existed, or with log.gate_windows = 0); None when there
    is no metrics.jsonl or no eval row."""
    from fullband.eval.gate import Gate

    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return None
    found: Gate | None | bool = None
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a torn last line of a killed run
            continue
        if not isinstance(row, dict) or "eval" not in row:
            continue
        if isinstance(row.get("gate"), dict):
            try:
                found = Gate.from_dict(row["gate"])
            except (KeyError, TypeError):
                pass
        elif found is None:
            found = False
    return found
