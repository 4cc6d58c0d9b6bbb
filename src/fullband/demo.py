"""The main job (`make demo`, `fullband demo`): latent feedback against a standard transformer, side by side, in a few
minutes on a CPU, on data every machine has. Its phases (the parity race, the code LM, summary.md) and what they
show: README.md, "Two commands". Each phase's results stay in the output folder and are reused when the demo runs
again (an interrupted training resumes)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from fullband.data.tokenizer import load_tokenizer
from fullband.decode.generate import generate
from fullband.decode.sampling import Sampling
from fullband.eval.commands import eval_loss, eval_tracking
from fullband.eval.tracking import tracking_figure
from fullband.files import lock_folder, make_folder, read_json, replace_file, save_figure
from fullband.folder import read_header
from fullband.loader import load_model
from fullband.machine import hardware
from fullband.train.checkpoint import list_checkpoints, read_trainer_state
from fullband.train.config import load_run_config
from fullband.train.rundir import RUN_FILE
from fullband.train.trainer import train

RACE, CODE = "configs/demo-parity.toml", "configs/tiny.toml"
RACERS = {"standard": ['train.passes="none"', 'model.fusion="none"'], "full-bandwidth": []}  # the recipe's grow:11
RACE_MODES = {"standard": ["standard"], "full-bandwidth": ["standard", "fused:1", "fused:4", "exact"]}
CODE_STEPS = 100  # the code LM: configs/tiny.toml's 200 steps shortened to leave time for the race
PROMPT = 'def read_config(path):\n    """Read a configuration file and return a dict."""\n'
SAMPLE_MODES = [("standard", 0), ("soft", 0), ("fused", 1), ("exact", 0)]
SAMPLING = Sampling(temperature=0.8, top_p=0.95, seed=0)
QUICK = {"race": ["train.steps=12", "train.warmup_steps=2"], "code": ["train.steps=4", "train.warmup_steps=1"]}


def run_demo(out: str | Path = "runs/demo", *, quick: bool = False, race_config: str | Path = RACE,
             code_config: str | Path = CODE, code_overrides: list[str] | None = None) -> int:
    """The three phases into `out`. `quick` shrinks every phase to seconds (a check that it all runs);
    `code_overrides` apply to the code LM's recipe after the demo's own."""
    out = Path(out)
    make_folder(out, "demo folder")
    with lock_folder(out, "demo folder", hint=", or pass another --out"):
        t0 = time.perf_counter()
        race = _race(out, race_config, quick)
        code = _code(out, code_config, quick, list(code_overrides or []))
        text = _summary(out, race, code, time.perf_counter() - t0)
    print("\n" + text)
    return 0


def _trained(config: str | Path, run_dir: Path, overrides: list[str], what: str) -> tuple[Path, dict]:
    """Train (or resume, or reuse) a run -> its final checkpoint and its size, tokens, compute and training time."""
    cfg = load_run_config(config, [*overrides, f'log.run_dir="{run_dir}"', "log.eval_every=0"])
    done = list_checkpoints(run_dir)
    if done and read_trainer_state(done[-1])["step"] >= cfg.train.steps:
        print(f"== {what}: reusing {done[-1]}", flush=True)
    else:
        print(f"== {what}: {cfg.train.steps} steps of {config} ({', '.join(overrides) or 'as written'})", flush=True)
        train(cfg, resume=run_dir if done or (run_dir / RUN_FILE).is_file() else None)
        done = list_checkpoints(run_dir)
    state = read_trainer_state(done[-1])
    return done[-1], {"checkpoint": str(done[-1]), "train_seconds": state["elapsed"], "steps": state["step"],
                      "tokens": state["tokens"], "compute_tokens": state["compute_tokens"],
                      "parameters": sum(math.prod(shape) for _, shape in read_header(done[-1]).values())}


def _fresh(saved: Path, checkpoint: Path, **settings) -> dict | None:
    """What an evaluation wrote before for this checkpoint: newer than its weights, with the same settings."""
    data = read_json(saved)
    if (not data or data.get("checkpoint") != str(checkpoint) or any(data.get(k) != v for k, v in settings.items())
            or saved.stat().st_mtime < (checkpoint / "model.safetensors").stat().st_mtime):
        return None
    print(f"   reusing {saved}")
    return data


def _race(out: Path, config: str | Path, quick: bool) -> dict:
    n, runs, rows = 16 if quick else 200, {}, []
    for name, overrides in RACERS.items():
        ckpt, runs[name] = _trained(config, out / f"parity-{name}", [*overrides, *(QUICK["race"] if quick else [])],
                                    f"parity, {name} model")
        modes = RACE_MODES[name]
        result = _fresh(ckpt / "eval" / "tracking_parity.json", ckpt, n=n, modes=modes) or \
            {**eval_tracking(ckpt, n=n, modes=modes), "modes": modes}
        replace_file(ckpt / "eval" / "tracking_parity.json", json.dumps(result, indent=2) + "\n")
        rows += [{**r, "model": name, "mode": f"{name} model, read {r['mode']}"} for r in result["rows"]]
    race = {**{k: result[k] for k in ("task", "train_length", "lengths", "chance", "n")}, "rows": rows, "runs": runs,
            "title": f"Running parity, trained on inputs of up to {result['train_length']} bits: a standard transformer "
                     "and a full-bandwidth one of the same size"}
    save_figure(tracking_figure(race), out / "race.png")
    replace_file(out / "race.json", json.dumps(race, indent=2) + "\n")
    return race


def _code(out: Path, config: str | Path, quick: bool, overrides: list[str]) -> dict:
    ckpt, code = _trained(config, out / "code", [*(QUICK["code"] if quick else [f"train.steps={CODE_STEPS}"]),
                                                 *overrides], "the code LM")
    windows, new_tokens = (4, 8) if quick else (256, 60)
    code["loss"] = _fresh(ckpt / "eval" / "loss.json", ckpt, windows=windows) or \
        eval_loss(ckpt, max_prefill=2, exact=False, windows=windows)
    samples = _fresh(out / "samples.json", ckpt, new_tokens=new_tokens)
    if samples is None:
        model, tok = load_model(ckpt), load_tokenizer(ckpt)
        samples = {"checkpoint": str(ckpt), "new_tokens": new_tokens, "text": {}}
        for mode, k in SAMPLE_MODES:
            for kind, sampling in (("greedy", None), ("sampled", SAMPLING)):
                ids = generate(model, [tok.encode(PROMPT)], new_tokens, mode=mode, prefill_passes=k, sampling=sampling,
                               stop_tokens=[tok.eos_id])[0]
                samples["text"][f"{mode if mode != 'fused' else f'fused k={k}'}, {kind}"] = tok.decode(ids)
        replace_file(out / "samples.json", json.dumps(samples, indent=2) + "\n")
        md = [f"# Demo continuations ({ckpt})", "", "```python", PROMPT.rstrip(), "```", "", "Greedy, and sampled at "
              f"temperature {SAMPLING.temperature}, top-p {SAMPLING.top_p}, seed {SAMPLING.seed}.", ""]
        for name, text in samples["text"].items():
            md += [f"## {name}", "", "```python", PROMPT + text, "```", ""]
        replace_file(out / "samples.md", "\n".join(md))
    for name, text in samples["text"].items():
        print(f"--- {name} ---\n{text}\n")
    return code


def _verdict(diff: float, se: float) -> str:
    """What a paired difference in held-out loss shows, from its size against its standard error."""
    if not math.isfinite(se) or abs(diff) < 2 * se:
        return "no difference shown at this size (within 2 standard errors)"
    return f"{'lower' if diff < 0 else 'higher'} than STANDARD by {abs(diff) / se:.1f} standard errors"


def _race_sentence(race: dict) -> str:
    rows = {r["mode"]: r["accuracy"] for r in race["rows"]}
    L, beyond = race["train_length"], ", ".join(str(n) for n in race["lengths"][1:])

    def acc(mode: str) -> str:
        a = rows[mode]
        return f"{a[0]:.2f} at {L} bits and {' / '.join(f'{v:.2f}' for v in a[1:])} at {beyond}"

    best = max((m for m in rows if m.startswith("full")), key=lambda m: sum(rows[m][1:]))
    return (f"Parity of inputs up to {L} bits (chance {race['chance']:.2f}): the standard model scores "
            f"{acc('standard model, read standard')}; the full-bandwidth model, {best.split(', ')[1]}, scores "
            f"{acc(best)}, and read standard {acc('full-bandwidth model, read standard')}.")


def _summary(out: Path, race: dict, code: dict, seconds: float) -> str:
    std, fb = race["runs"]["standard"], race["runs"]["full-bandwidth"]
    first, fused = code["loss"]["rows"][0], code["loss"]["rows"][1]
    lines = [
        "# fullband demo: what latent feedback buys", "",
        f"Machine: {hardware()}; this run {seconds / 60:.1f} min of wall time (reused phases cost nothing).", "",
        "What was trained:", "",
        f"- parity, standard model: {std['parameters'] / 1e3:.0f}k parameters, {std['tokens'] / 1e6:.2f}M tokens, one "
        f"pass each, {std['train_seconds']:.0f} s",
        f"- parity, full-bandwidth model: {fb['parameters'] / 1e3:.0f}k parameters, {fb['tokens'] / 1e6:.2f}M tokens, "
        f"{fb['compute_tokens'] / max(fb['tokens'], 1):.1f} passes per token on average "
        f"({fb['compute_tokens'] / max(std['compute_tokens'], 1):.1f}x the standard model's compute), "
        f"{fb['train_seconds']:.0f} s",
        f"- the code LM: {code['parameters'] / 1e6:.2f}M parameters, {code['steps']} steps, {code['tokens'] / 1e6:.2f}M "
        f"tokens of the Python standard library, {code['train_seconds']:.0f} s", "",
        "Results:", "",
        f"- {_race_sentence(race)} ![race](race.png)",
        f"- Code LM, held-out loss: {first['mode']} {first['nats_per_token']:.4f} nats/token; {fused['mode']} "
        f"{fused['minus_first']:+.4f} ± {fused['minus_first_stderr']:.4f} (paired, over {code['loss']['windows']} "
        f"windows): {_verdict(fused['minus_first'], fused['minus_first_stderr'])}, for a "
        f"{code['parameters'] / 1e6:.1f}M-parameter model after {code['tokens'] / 1e6:.1f}M tokens.", "",
        f"Files in {out}/: summary.md, race.png, race.json, samples.md, samples.json, and the runs (parity-standard/, "
        "parity-full-bandwidth/, code/: metrics, loss.png, checkpoints; each final checkpoint's eval/ holds its "
        "evaluation, table and figure).",
    ]
    text = "\n".join(lines) + "\n"
    replace_file(out / "summary.md", text)
    return text
