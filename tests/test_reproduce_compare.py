"""`fullband reproduce compare` end to end at its micro scale: every method trained and scored, the standard models
at matched FLOPs planned from the FLOP counter, the report's tables computed from the numbers, a rerun reusing
every run and evaluation, and a budget that reports what finished and lists the rest."""

from __future__ import annotations

import re

import pytest


def _options(tmp_path, corpus, cache, **kw):
    return dict(root=tmp_path / "runs", docs=tmp_path / "docs", extra=[f'data.cache_dir="{cache}"'], scale="micro",
                seeds=1, lm_extra=(f'data.corpus="{corpus}"',), tasks=("parity",), **kw)


def test_the_plan_matches_each_rival_s_training_flops():
    """Standard runs get round(N x the rival's counted training FLOPs per token / standard's) steps; the deeper
    standard model is the depth whose FLOPs per token come closest to ours."""
    from fullband.model.flops import train_flops
    from fullband.reproduce.compare import METHODS, SCALES, _mean_passes, plan
    from fullband.reproduce.runner import Settings

    sc = SCALES["cpu"]
    runs = {p.name: p for p in plan(sc, Settings(), tasks=("parity",))}
    std = runs["fresh-standard"]

    def per_token(p):
        return train_flops(p.model_cfg, _mean_passes(METHODS[p.method].passes), seq_len=256)

    for key in ("fbt", "t2mlr", "lrt", "looped", "ponder"):
        ratio = per_token(runs[f"fresh-{key}"]) / per_token(std)
        matched = [p for p in runs.values() if p.regime == "fresh" and p.role.startswith("x")
                   and key in p.role[1:].split("/")]
        assert len(matched) == 1, key
        assert matched[0].steps == pytest.approx(sc.steps * ratio, abs=0.03 * sc.steps * ratio), key
    deep = runs[next(n for n in runs if n.startswith("fresh-standard-deep"))]
    ours = per_token(runs["fresh-fbt"]) / per_token(std)
    assert abs(per_token(deep) / per_token(std) - ours) < 0.5
    assert deep.model_cfg.n_layers > std.model_cfg.n_layers and deep.steps == sc.steps
    assert runs["repeated-standard-2n"].steps == 2 * sc.steps
    assert all(f"data.train_tokens={sc.unique_tokens}" in p.run.overrides for p in runs.values()
               if p.regime == "repeated")
    assert runs["parity-ponder"].model_cfg.ponder and runs["parity-looped"].model_cfg.has_loop


def test_reproduce_compare_writes_a_report_and_a_rerun_reuses_it(tmp_path, corpus, cache, capsys):
    from fullband.reproduce import reproduce
    from fullband.reproduce.compare import METHODS, RIVALS

    out = reproduce("compare", **_options(tmp_path, corpus, cache))
    assert out.name == "compare-micro.md"
    text = out.read_text()
    assert text.startswith("# Reproduction: compare-micro") and "Pending" not in text
    for key in RIVALS:  # the cost table, both regimes' rows and the summary
        assert f"| {key} | " in text, key
        for regime in ("fresh", "repeated"):
            assert f"| {regime}-{key} | 4 |" in text and f"| {regime} | {key} | " in text, (regime, key)
    for key in METHODS:
        assert f"| parity-{key} | " in text, key
    for read in ("| FUSED k=2 |", "| r=3 |", "| FUSED k=4 |", "| fused:auto |", "| exact |", "| r=6 |"):
        assert read in text, read
    assert "| fresh | standard 2N | STANDARD |" in text and "repeated-standard-deep" in text
    assert "nan" not in text
    assert text.count("Early stopping: the standard model's lowest held-out loss") == 2  # both regimes
    figs = tmp_path / "docs" / "compare-micro"
    for png in ("loss_tokens.png", "loss_flops.png", "tracking.png", "eval/parity-fbt/tracking.png"):
        assert (figs / png).is_file(), png
    capsys.readouterr()
    again = reproduce("compare", **_options(tmp_path, corpus, cache)).read_text()
    assert "== training" not in capsys.readouterr().out  # every run reused
    strip = [line for line in text.splitlines() if "Wall time" not in line]
    assert strip == [line for line in again.splitlines() if "Wall time" not in line]  # ...and every number

    # another machine: the checkpoints are gone, the report's folder (records, evaluations) is kept
    import json
    import shutil

    shutil.rmtree(tmp_path / "runs")
    moved = reproduce("compare", **_options(tmp_path, corpus, cache)).read_text()
    assert "== training" not in capsys.readouterr().out  # every run reused from its record
    assert strip == [line for line in moved.splitlines() if "Wall time" not in line]
    record = json.loads((figs / "records" / "fresh-fbt.json").read_text())
    assert record["curve"] and record["curve"][-1]["step"] == 4 and record["train_seconds"] > 0
    import torch

    assert record["threads"] == torch.get_num_threads()
    row = r"\| fresh-fbt \| 4 \| [^|]+ \| [^|]+ \| [0-9.]+ min{} \|"
    assert re.search(row.format(""), moved)

    # a record without its curve is drawn as one marker and named, a run trained with other threads says so; a
    # record of another command is not reused
    record["curve"] = None
    record["threads"] = torch.get_num_threads() + 1
    (figs / "records" / "fresh-fbt.json").write_text(json.dumps(record))
    text = reproduce("compare", **_options(tmp_path, corpus, cache)).read_text()
    assert "kept no held-out curve: fresh-fbt." in text
    assert re.search(row.format(rf" \({record['threads']} threads\)"), text)
    assert "; 1 of them trained with another number of CPU threads (marked in the tables)" in text
    record["key"]["overrides"].append("optim.lr=0.01")
    (figs / "records" / "fresh-lrt.json").write_text(json.dumps(record))
    reproduce("compare", **_options(tmp_path, corpus, cache))
    trained = [line for line in capsys.readouterr().out.splitlines() if line.startswith("== training")]
    assert [line.split(":")[0] for line in trained] == ["== training fresh-lrt"]


def test_a_budget_reports_the_finished_runs_and_lists_the_rest(tmp_path, corpus, cache, capsys):
    from fullband.reproduce import reproduce

    text = reproduce("compare", **_options(tmp_path, corpus, cache, budget=0)).read_text()
    assert "== training" not in capsys.readouterr().out
    assert "**Pending (" in text and "fresh-fbt" in text.split("**Pending (", 1)[1]
    assert "| fresh-fbt | 4 | - |" in text and "| parity-fbt | pending |" in text


def test_scale_and_budget_are_checked(tmp_path, capsys):
    from fullband.cli import main
    from fullband.errors import InputError
    from fullband.reproduce import reproduce

    for scale in ("gpu", ""):  # refused before anything is written (from Python too, where '' reaches it)
        with pytest.raises(InputError, match=rf"--scale '{scale}' is unknown.*accepted: cpu, gpu-small, micro"):
            reproduce("compare", root=tmp_path / "root", docs=tmp_path / "docs", scale=scale)
        assert not (tmp_path / "root").exists() and not (tmp_path / "docs").exists()
    assert main(["reproduce", "tracking", "--scale", "micro"]) == 2
    assert ("--scale applies to `fullband reproduce compare / warmstart / warmstart-long / warmstart-keep / "
            "robustness` only" in capsys.readouterr().err)
    assert main(["reproduce", "tracking", "--budget", "5"]) == 2
    assert ("--budget applies to `fullband reproduce compare / warmstart-long / warmstart-keep` only"
            in capsys.readouterr().err)
    assert main(["reproduce", "compare", "--budget", "-1", "--root", str(tmp_path)]) == 2
    assert "--budget -1.0: accepted: minutes >= 0" in capsys.readouterr().err
    assert main(["reproduce", "warmstart-long", "--replies", "50"]) == 2
    assert "--replies applies to `fullband reproduce warmstart-keep` only" in capsys.readouterr().err
    for bad in ("1", "100001"):  # refused before anything is written
        assert main(["reproduce", "warmstart-keep", "--replies", bad, "--root", str(tmp_path / "keep")]) == 2
        assert "--replies" in capsys.readouterr().err and not (tmp_path / "keep").exists()


def test_the_experiments_recipes_ship_with_the_package_and_load_from_any_folder(tmp_path, monkeypatch, capsys):
    """`fullband reproduce` (and the demo, and `fullband train configs/NAME`) outside the repository: every recipe
    an experiment names is found in the package (the repository's configs/ is a link to it) and loads with each
    run's overrides; pyproject's package data ships every file of it."""
    import fnmatch
    import tomllib
    from pathlib import Path

    from fullband import demo
    from fullband.cli import main
    from fullband.presets import RECIPES, load_model_config, recipe_path
    from fullband.reproduce import BASE, REGISTRY
    from fullband.reproduce import rl as rl_experiment
    from fullband.rl.run import load_rl_recipe
    from fullband.train.config import load_run_config

    repo = Path(__file__).resolve().parents[1]
    assert (repo / "configs").resolve() == RECIPES.resolve()
    shipped = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["fullband"]
    files = sorted(p.relative_to(RECIPES.parent).as_posix() for p in RECIPES.iterdir())
    assert files and all(any(fnmatch.fnmatch(f, pattern) for pattern in shipped) for f in files), (files, shipped)

    monkeypatch.chdir(tmp_path)  # no configs/ here
    named = {demo.RACE, demo.CODE}
    for exp in REGISTRY.values():
        for run in exp.runs():  # compare's plan reads configs/tiny.toml and configs/tracking-tiny.toml itself
            named.add(run.config or BASE)
            load_run_config(run.config or BASE, [*run.overrides, f'log.run_dir="{tmp_path / run.name}"'])
    assert {BASE, "configs/tracking-tiny.toml", "configs/sft-tiny.toml"} <= named
    assert load_rl_recipe(rl_experiment.RL).rl.algorithm == "grpo"
    assert all(recipe_path(name).parent == RECIPES for name in [*named, rl_experiment.RL])
    assert load_model_config("configs/tiny.toml").d_model == 128
    # a file of that path in the current folder comes first; anything else is not looked up
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.toml").write_text("[model]\nd_model = 64\nn_heads = 2\n")
    assert load_model_config("configs/tiny.toml").d_model == 64
    assert main(["init", "--config", "configs/nope.toml", "--out", str(tmp_path / "m")]) == 2
    assert "config file 'configs/nope.toml' does not exist" in capsys.readouterr().err and not (tmp_path / "m").exists()
