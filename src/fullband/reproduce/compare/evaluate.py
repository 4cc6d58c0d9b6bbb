"""The evaluations of `fullband reproduce compare`, each kept beside the report and reused: held-out loss of every
read, the held-out curve with the FLOPs spent, state tracking, the cost bench, and each finished run's record."""

from __future__ import annotations

import json
from pathlib import Path

from fullband.reproduce.compare.plan import METHODS, REGIMES, Planned, Scale, _schedule, reads, tracking_modes
from fullband.reproduce.runner import Settings, kept


def _evaluations(p: Planned, ckpt: Path, figs: Path, sc: Scale) -> tuple[Path, dict]:
    """Where a run's evaluation is kept beside the report, and the key it is kept under."""
    family, loops = METHODS[p.method].family, getattr(p.model_cfg, "loops", 3)
    if p.regime in REGIMES:
        return (figs / "eval" / p.name / "loss.json",
                {"checkpoint": str(ckpt), "windows": sc.windows, "reads": [r.label for r in reads(family, loops)]})
    return (figs / "eval" / p.name / "tracking.json",
            {"checkpoint": str(ckpt), "n": sc.examples, "modes": [t[0] for t in tracking_modes(family, loops)]})


def _record_key(p: Planned, settings: Settings) -> dict:
    """What a run's record is valid for: its recipe and every override (the command that trains it)."""
    return {"config": p.run.config or settings.base, "overrides": [*p.run.overrides, *settings.extra]}


def _write_record(p: Planned, figs: Path, settings: Settings, done: tuple[Path, float, int | None],
                  points: list | None) -> None:
    from fullband.files import replace_file

    path = figs / "records" / f"{p.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, json.dumps({"key": _record_key(p, settings), "checkpoint": str(done[0]),
                                   "train_seconds": done[1], "threads": done[2], "curve": points}))


def _kept_record(p: Planned, figs: Path, settings: Settings, sc: Scale) -> dict | None:
    """A finished run's record when it still stands for this run (the same command) and its evaluation is kept
    under the key of the checkpoint it names; None: the run must be trained."""
    from fullband.files import read_json

    record = read_json(figs / "records" / f"{p.name}.json")
    if not record or record.get("key") != _record_key(p, settings):
        return None
    path, key = _evaluations(p, Path(record["checkpoint"]), figs, sc)
    saved = read_json(path)
    return record if saved and saved.get("key") == key else None


def _looping(model, loops: int | None):
    import contextlib

    return model.looping(loops) if loops is not None and model.config.has_loop else contextlib.nullcontext()


def lm_reads(p: Planned, ckpt: Path, figs: Path, sc: Scale) -> dict:
    """Held-out loss of every read of a language-modelling run, per window (for paired differences)."""
    from fullband.model.flops import forward_flops
    from fullband.eval.loss import validation_loss
    from fullband.model.decoder import FullbandLM
    from fullband.reproduce.runner import val_batches

    todo = reads(METHODS[p.method].family, getattr(p.model_cfg, "loops", 3))

    def compute() -> dict:
        model = FullbandLM.load(ckpt)
        batches = val_batches(ckpt, windows=sc.windows)
        seq = batches[0][0].shape[1]
        out = {}
        for read in todo:
            with _looping(model, read.loops):
                res = validation_loss(model, batches, read.passes)
            out[read.label] = {"nats": res.nats, "stderr": res.stderr, "per_window": res.per_window.tolist(),
                               "flops": forward_flops(model.config, read.passes, seq_len=seq, loops=read.loops)}
        return {"result": out}

    path, key = _evaluations(p, ckpt, figs, sc)
    return kept(path, {"key": key}, ckpt, compute)["result"]


def curve(p: Planned, run_dir: Path, cfg) -> list[dict]:
    """The run's held-out points (metrics.jsonl eval rows) with the tokens and training FLOPs spent by then (FLOPs
    counted step by step from each step's passes and loops)."""
    from fullband.model.flops import train_flops
    from fullband.rl.run import metric_rows

    rows = metric_rows(run_dir / "metrics.jsonl")
    spent, flops = 0.0, {}
    for row in rows:
        if "eval" not in row:
            spent += cfg.train.global_batch_tokens * train_flops(p.model_cfg, row["k"], seq_len=cfg.train.seq_len,
                                                                 loops=row.get("loops"))
            flops[row["step"]] = spent
    return [{"step": r["step"], "tokens": r["tokens"], "flops": flops[r["step"]], "eval": r["eval"]}
            for r in rows if "eval" in r]


def tracking_eval(p: Planned, ckpt: Path, figs: Path, sc: Scale) -> dict:
    from fullband.data.tracking import parse_spec
    from fullband.files import save_figure
    from fullband.eval.tracking import accuracy_table, tracking_figure
    from fullband.eval.commands import load_any

    todo = tracking_modes(METHODS[p.method].family, getattr(p.model_cfg, "loops", 3))
    where = figs / "eval" / p.name

    def compute() -> dict:
        model, tok = load_any(ckpt)
        task, length = parse_spec(next(o for o in p.run.overrides if o.startswith("data.corpus=")).split("=", 1)[1]
                                  .strip('"'))
        result: dict = {}
        for label, mode, loops in todo:
            with _looping(model, loops):
                table = accuracy_table(model, tok, task, length, n=sc.examples, modes=[mode], progress=False)
            row = table["rows"][0]
            row["mode"] = label
            result = {**table, "rows": [*result.get("rows", []), row]}
        where.mkdir(parents=True, exist_ok=True)
        save_figure(tracking_figure(result), where / "tracking.png")
        return {"result": result}

    path, key = _evaluations(p, ckpt, figs, sc)
    return kept(path, {"key": key}, ckpt, compute)["result"]


def cost_table(methods: dict[str, object], scale: Scale, figs: Path) -> dict[str, dict]:
    """fullband bench cost of every method against the standard model of its width and depth (cached by config)."""
    from fullband.bench.cost import run_cost_bench

    out = {}
    for key, cfg in methods.items():
        if key == "standard":
            continue
        schedule = _schedule(METHODS[key].passes)  # one stage for every method here: its k and their chances
        probs = {k: p for k, p in schedule.stages[-1].probs.items() if p > 0}
        kw = {**scale.cost, "passes": tuple(sorted(probs)), "progress": False}
        key_of = {"config": cfg.to_dict(), **{k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()}}
        out[key] = kept(figs / "cost" / f"{key}.json", {"key": key_of}, None,
                        lambda: {"result": run_cost_bench(cfg, **kw)})["result"]
        out[key]["probs"] = {str(k): p for k, p in probs.items()}
    return out
