"""`fullband reproduce --seeds N`: the findings each seed's report records, their spread and verdicts across seeds,
and an experiment run end to end with two seeds (a rerun reuses every run)."""

from __future__ import annotations

import json
import math

import pytest

from conftest import write_config
from fullband.reproduce.seeds import Findings, across, across_lines

SMALL = ["train.steps=3", "train.warmup_steps=1", "train.seq_len=32", "train.global_batch_tokens=256",
         "train.micro_batch=4"]


def _seeds(*per_seed: dict) -> dict[int, Findings]:
    out = {}
    for seed, items in enumerate(per_seed):
        f = Findings()
        for what, (kind, *args) in items.items():
            getattr(f, kind)(what, *args)
        out[seed] = f
    return out


def test_across_seeds_gives_mean_range_standard_error_and_counted_verdicts():
    rows = {r.what: r for r in across(_seeds(
        {"loss": ("value", 1.0, 0.1), "gain": ("diff", -0.05, 0.01), "tie": ("diff", 0.001, 0.01),
         "split": ("diff", -0.05, 0.01), "solves": ("claim", True)},
        {"loss": ("value", 2.0, 0.3), "gain": ("diff", -0.03, 0.01), "tie": ("diff", -0.002, 0.01),
         "split": ("diff", 0.001, 0.01), "solves": ("claim", False)},
        {"loss": ("value", 3.0, 0.2), "gain": ("diff", -0.04, 0.01), "tie": ("diff", 0.0, 0.01),
         "split": ("diff", 0.06, 0.01), "solves": ("claim", True)}))}
    loss = rows["loss"]
    assert (loss.mean, loss.low, loss.high) == (2.0, 1.0, 3.0)
    assert loss.se == pytest.approx(1 / math.sqrt(3))  # sample s.d. 1 over sqrt(3) seeds
    assert loss.within == pytest.approx(0.2) and loss.verdict == ""
    assert rows["gain"].verdict == "lower in every seed (3 of 3, each 2+ standard errors)"
    assert rows["tie"].verdict == "no difference shown in any seed (3)"
    assert rows["split"].verdict == "mixed: lower in 1, no difference shown in 1, higher in 1 of 3 seeds"
    assert rows["solves"].verdict == "holds in 2 of 3 seeds" and rows["solves"].mean == pytest.approx(2 / 3)
    table = "\n".join(across_lines(list(rows.values()), [0, 1, 2]))
    assert "| loss | 1.0000 | 2.0000 | 3.0000 | 2.0000 | 1.0000 - 3.0000 | 0.5774 | 0.2000 |  |" in table
    assert "| solves | holds | fails | holds | 0.67 |" in table


def test_a_finding_only_some_seeds_recorded_is_counted_over_those():
    rows = {r.what: r for r in across(_seeds({"a": ("value", 1.0)}, {"a": ("value", 3.0), "b": ("claim", False)}))}
    assert rows["b"].seeds == [1] and rows["b"].verdict == "fails in every seed (1)" and math.isnan(rows["b"].se)
    assert "| b | - | fails |" in "\n".join(across_lines(list(rows.values()), [0, 1]))


def test_findings_round_trip_through_json():
    f = _seeds({"x": ("diff", 0.5, 0.1), "y": ("claim", True), "z": ("value", 2.0)})[0]
    again = Findings.from_data(json.loads(json.dumps(f.to_data())))
    assert again == f and [i.verdict() for i in again.items.values()] == ["higher", "holds", None]


def test_reproduce_with_two_seeds_trains_each_reports_the_spread_and_reuses_the_runs(tmp_path, corpus, cache,
                                                                                       monkeypatch):
    from fullband import reproduce as rp
    from fullband.reproduce import reproduce

    base = write_config(tmp_path, corpus, cache, "base", steps=3, ckpt_every=0)
    options = dict(root=tmp_path / "runs", docs=tmp_path / "docs", base=str(base), extra=SMALL, seeds=2)
    text = reproduce("data-efficiency", **options).read_text()
    assert "`fullband reproduce data-efficiency --seeds 2 " + " ".join(f"--set {o}" for o in SMALL) + "`" in text
    assert "## Across seeds" in text and "## Seed 0" in text and "[seed 1](data-efficiency/seed-1.md)" in text
    docs = tmp_path / "docs" / "data-efficiency"
    seed1 = (docs / "seed-1.md").read_text()
    assert "train.seed=1" in seed1 and "![data efficiency](seed-1/data_efficiency.png)" in seed1
    assert (docs / "seed-1" / "data_efficiency.png").stat().st_size > 0
    # each seed trained its own runs: seed 1 under seed-1/, with train.seed = 1; seed 0 as the recipe is written
    runs = tmp_path / "runs" / "data-efficiency"
    for seed, run in ((0, runs / "fbt-N"), (1, runs / "seed-1" / "fbt-N")):
        assert json.loads((run / "run.json").read_text())["train"]["seed"] == seed
    spread = json.loads((docs / "seeds.json").read_text())
    assert spread["seeds"] == [0, 1]
    row = next(r for r in spread["rows"] if r["what"] == "fbt-N FUSED k=2 minus standard-N (nats/token)")
    assert len(row["values"]) == 2 and row["values"][0] != row["values"][1]  # two trainings, two results
    assert row["low"] == min(row["values"]) and row["high"] == max(row["values"])
    assert row["verdict"] and f"| {row['what']} |" in text
    per_seed = [json.loads((d / "findings.json").read_text()) for d in (docs, docs / "seed-1")]
    assert [p[row["what"]]["value"] for p in per_seed] == row["values"]
    # a rerun trains nothing and writes the same findings
    monkeypatch.setattr("fullband.train.trainer.train", lambda *a, **k: pytest.fail("trained again"))
    again = reproduce("data-efficiency", **options).read_text()
    assert json.loads((docs / "seeds.json").read_text()) == spread
    assert again.split("## Across seeds")[1] == text.split("## Across seeds")[1]
    with pytest.raises(ValueError, match=r"--seeds=0 is invalid; accepted: an integer 1 <= --seeds < 101"):
        reproduce("data-efficiency", **{**options, "seeds": 0})
    assert rp.REGISTRY["compare"].seeds >= 2 and rp.REGISTRY["tracking"].seeds >= 3


def test_a_finished_run_of_another_recipe_is_not_reused_as_this_one(tmp_path, corpus, cache):
    """A reproduction reuses a finished run only when it was trained with the recipe the experiment asks for now:
    a recipe changed since (here the base's learning rate) is refused, naming the run and the setting."""
    from fullband.reproduce import reproduce

    base = write_config(tmp_path, corpus, cache, "base", steps=3, ckpt_every=0)
    options = dict(root=tmp_path / "runs", docs=tmp_path / "docs", base=str(base), extra=SMALL, seeds=1)
    reproduce("data-efficiency", **options)
    with pytest.raises(ValueError, match=r"fbt-N was trained with another recipe than this experiment's \(optim: run "
                                         r"has lr=0\.\d+, config has lr=0\.5\)"):
        reproduce("data-efficiency", **{**options, "extra": [*SMALL, "optim.lr=0.5"]})


def test_a_report_s_command_sets_each_key_once_with_the_value_the_run_used():
    """A run's overrides then the report's extra settings may set a key twice (a recipe's blend_until, then the long
    run's): the command a report prints sets it once, with the later value, and reads as the same config."""
    import shlex

    from fullband.reproduce.runner import Run, config_line
    from fullband.train.config import load_run_config

    run = Run("r", ["train.blend_until=0.5", "train.steps=40", 'train.passes="two-pass"', "train.cooldown_fraction=0.2"],
              config="configs/tiny.toml")
    line = config_line(run, "train.cooldown_fraction=0.0", "train.blend_until=0.025", "log.eval_passes=[1, 2]")
    assert line == ("`fullband train configs/tiny.toml --set train.steps=40 --set train.passes=\"two-pass\" --set "
                    "train.cooldown_fraction=0.0 --set train.blend_until=0.025 --set 'log.eval_passes=[1, 2]'`")
    printed = [w for w in shlex.split(line.strip("`"))[3:] if w != "--set"]
    everything = [*run.overrides, "train.cooldown_fraction=0.0", "train.blend_until=0.025", "log.eval_passes=[1, 2]"]
    assert load_run_config("configs/tiny.toml", printed) == load_run_config("configs/tiny.toml", everything)


def test_a_kept_evaluation_is_reused_only_for_the_weights_it_read(tmp_path):
    """A kept evaluation records the weights it read: rewritten weights at the same checkpoint path are read again,
    even when the kept file is newer (a report's files restored after retraining); a run whose weights are gone
    keeps its record; an evaluation that writes its own file (save=False) gets the stamp there too."""
    import os

    from fullband.reproduce.runner import kept

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    weights = ckpt / "model.safetensors"
    weights.write_bytes(b"first")
    saved, calls = tmp_path / "eval" / "x.json", []

    def compute():
        calls.append(weights.read_bytes() if weights.is_file() else None)
        return {"loss": len(calls)}

    def read():
        return kept(saved, {"checkpoint": str(ckpt)}, ckpt, compute)

    assert read()["loss"] == 1 and read()["loss"] == 1 and calls == [b"first"]
    weights.write_bytes(b"second")
    t = saved.stat().st_mtime
    os.utime(weights, (t - 100, t - 100))  # older than the kept file, yet other weights
    assert read()["loss"] == 2 and calls == [b"first", b"second"]
    assert read()["loss"] == 2 and len(calls) == 2
    assert kept(saved, {"checkpoint": "elsewhere"}, ckpt, compute)["loss"] == 3  # another key: read again
    weights.unlink()
    assert read()["loss"] == 4 and read()["loss"] == 4  # the key changed back; then the record holds without weights
    weights.write_bytes(b"third")
    own = tmp_path / "eval" / "own.json"

    def writes():
        own.write_text(json.dumps({"checkpoint": str(ckpt), "loss": 9}))
        return {"loss": 9}

    assert kept(own, {"checkpoint": str(ckpt)}, ckpt, writes, save=False)["loss"] == 9
    assert "weights" in json.loads(own.read_text())
    assert kept(own, {"checkpoint": str(ckpt)}, ckpt, lambda: pytest.fail("read again"), save=False)["loss"] == 9
