"""Training-step benchmark: tokens/s and peak memory for k = 1, 2, 3 passes and a pass schedule, with and
without activation checkpointing, against the target that a k-pass step costs at most 1.05 k one-pass steps.

Each variant runs in its own process (so its peak memory is its own), the variants take turns over several
rounds, and each reports the median of its timed steps; the table gives the median over rounds."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fullband.errors import FullbandError

VARIANTS = [("k=1", 1), ("k=2", 2), ("k=3", 3), ("75/22/3", "one-two-three")]


def child(spec: dict) -> dict:
    """Run in a fresh process: build the trainer from the recipe, time `steps` optimizer steps."""
    import torch

    from fullband.train.config import load_run_config
    from fullband.train.schedule import PassSchedule
    from fullband.train.trainer import Trainer

    overrides = [*spec["overrides"], f'log.run_dir="{spec["run_dir"]}"', "log.progress=false",
                 f"train.activation_checkpointing={'true' if spec['ac'] else 'false'}"]
    cfg = load_run_config(spec["config"], overrides)
    trainer = Trainer(cfg)
    passes = spec["passes"]
    trainer.schedule = PassSchedule.parse(passes if isinstance(passes, str) else [{"until": 1.0, "probs": {str(passes): 1.0}}])
    cuda = trainer.d.device.type == "cuda"
    times, ks = [], []
    for step in range(spec["warmup"] + spec["steps"]):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = trainer.train_step(cfg.train.steps // 2 + step)  # mid-run: past the warmup, before the cooldown
        if cuda:
            torch.cuda.synchronize()
        if step >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
            ks.append(stats.k)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"step_s": statistics.median(times), "mean_step_s": statistics.fmean(times), "mean_k": statistics.fmean(ks),
            "tokens_per_step": cfg.train.global_batch_tokens, "peak_bytes": peak, "device": str(trainer.d.device)}


def check_recipe(config: str, overrides: list[str]) -> None:
    """The recipe read and the largest variant's step (the most passes, no activation checkpointing) checked against
    memory here, before any benchmark process starts: one-line errors, nothing allocated."""
    import torch

    from fullband.train.config import load_run_config
    from fullband.train.memory import check_fits
    from fullband.train.schedule import PassSchedule
    from fullband.train.trainer import step_estimate

    cfg = load_run_config(config, overrides)
    most = max(p if isinstance(p, int) else PassSchedule.parse(p).max_passes for _, p in VARIANTS)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the Trainer puts the model
    est = step_estimate(cfg, device, passes=most, checkpointing=False)
    check_fits({"weights": est.weights, "gradients": est.gradients, "optimizer state": est.optimizer,
                "activations": est.activations}, "bench train", device,
               smaller="--set model.d_model / n_layers / d_ff / vocab_size, train.micro_batch, train.seq_len")


def run_train_bench(config: str, *, overrides: list[str] | None = None, steps: int = 6, warmup: int = 2,
                    rounds: int = 3, log=print) -> dict:
    check_recipe(config, overrides or [])
    results: dict[tuple[str, bool], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name, passes in VARIANTS:
                for ac in (False, True):
                    run_dir = Path(tmp) / f"{name.replace('/', '-')}-{ac}-{r}"
                    spec = {"config": config, "overrides": overrides or [], "passes": passes, "ac": ac,
                            "steps": steps if isinstance(passes, int) else 4 * steps, "warmup": warmup,
                            "run_dir": str(run_dir)}
                    out = subprocess.run([sys.executable, "-m", "fullband.bench.train", json.dumps(spec)],
                                         capture_output=True, text=True, env=os.environ.copy())
                    if out.returncode != 0:  # what the recipe check could not foresee: the child's last line
                        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
                        raise FullbandError(f"the {name} step (activation_checkpointing={ac}) failed: {last}")
                    results.setdefault((name, ac), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
                    log(f"[bench train] round {r + 1}/{rounds} {name} activation_checkpointing={ac}: "
                        f"{results[(name, ac)][-1]['step_s'] * 1000:.0f} ms/step")
    rows = []
    base = {ac: statistics.median(x["step_s"] for x in results[("k=1", ac)]) for ac in (False, True)}
    for (name, ac), runs in results.items():
        step_s = statistics.median(x["mean_step_s"] if name == "75/22/3" else x["step_s"] for x in runs)
        k = statistics.fmean(x["mean_k"] for x in runs)
        tokens = runs[0]["tokens_per_step"]
        rows.append({"variant": name, "activation_checkpointing": ac, "mean_passes": k, "ms_per_step": 1000 * step_s,
                     "tokens_per_s": tokens / step_s, "cost_vs_k1": step_s / base[ac],
                     "cost_per_pass": step_s / base[ac] / k, "peak_mb": max(x["peak_bytes"] for x in runs) / 2**20,
                     "device": runs[0]["device"]})
    return {"config": config, "overrides": overrides or [], "rows": rows}


def format_train_report(result: dict) -> str:
    lines = [f"{result['config']} {' '.join(result['overrides'])}".strip(),
             f"{'variant':<9} {'act.ckpt':>8} {'passes':>6} {'ms/step':>9} {'tok/s':>9} {'vs k=1':>7} "
             f"{'per pass':>8} {'peak MB':>8}"]
    for r in sorted(result["rows"], key=lambda r: (r["activation_checkpointing"], r["mean_passes"])):
        lines.append(f"{r['variant']:<9} {str(r['activation_checkpointing']):>8} {r['mean_passes']:>6.2f} "
                     f"{r['ms_per_step']:>9.1f} {r['tokens_per_s']:>9.0f} {r['cost_vs_k1']:>7.2f} "
                     f"{r['cost_per_pass']:>8.3f} {r['peak_mb']:>8.0f}")
    lines.append("target: a k-pass step costs at most 1.05 k one-pass steps (per pass <= 1.05)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
