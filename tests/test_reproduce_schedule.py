"""`fullband reproduce schedule` end to end on micro runs: every schedule x supervision x setting trained, scored,
reported from its numbers; a rerun reuses every run and evaluation."""

from __future__ import annotations

import json

from conftest import write_config

SHRINK = ["train.steps=3", "train.warmup_steps=1", "train.global_batch_tokens=512", "train.micro_batch=4",
          "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "log.eval_windows=4"]


def test_equal_flops_steps():
    from fullband.reproduce.schedule import STEPS, expected_step_flops, runs

    by_name = {r.name: r for r in runs()}
    assert len(by_name) == 18
    for name, run in by_name.items():
        steps = int(run.overrides[-1].removeprefix("train.steps="))
        recipe = run.config or "configs/tiny.toml"
        ref = by_name[name.split("-")[0] + "-75-22-3"]
        cost, ref_cost = (expected_step_flops(recipe, r.overrides[:-1]) for r in (run, ref))
        assert abs(steps * cost / (STEPS * ref_cost) - 1) < 0.5 / STEPS * 2  # equal FLOPs up to rounding a step
    assert by_name["code-75-25"].overrides[-1] == "train.steps=410"  # 1.25 passes a step against 1.28


def test_reproduce_schedule_writes_a_report_and_reuses_it(tmp_path, corpus, cache, capsys, monkeypatch):
    from functools import partial

    import fullband.eval.stability as stability
    from fullband.reproduce import reproduce

    # the report's measurements, smaller (the two horizons it shows, one vector): the evaluation of
    # 18 micro models was 3/4 of this test's time; every measurement still runs and reaches the report
    monkeypatch.setattr(stability, "contraction", partial(stability.contraction, horizons=(8, 32), vectors=1,
                                                          power_iters=3))
    base = write_config(tmp_path, corpus, cache, "base", ckpt_every=0)
    options = dict(root=tmp_path / "runs", docs=tmp_path / "docs", base=str(base), seeds=1,
                   extra=[*SHRINK, f'data.cache_dir="{cache}"'])
    text = reproduce("schedule", **options).read_text()
    assert text.startswith("# Reproduction: schedule") and "Hardware:" in text
    for setting in ("code", "registers", "stress"):
        assert f"## {setting}" in text
        assert f"**{setting}**: the paper's stability finding is " in text
    assert text.count("| 75-22-3-latent |") == 2 and "| adaptive |" in text
    assert "exact acc L / 2L" in text and "## Stability gate" in text
    saved = json.loads((tmp_path / "docs" / "schedule" / "code-adaptive" / "schedule_eval.json").read_text())
    assert saved["step"] == 3 and len(saved["sweep"]["loss"]) == 6 and "passed" in saved["gate"]
    assert (tmp_path / "docs" / "schedule" / "schedule.png").stat().st_size > 0
    capsys.readouterr()
    again = reproduce("schedule", **options).read_text()
    assert "== training" not in capsys.readouterr().out  # every run reused
    strip = lambda t: [line for line in t.splitlines() if "Wall time" not in line and "Evaluation in" not in line]
    assert strip(again) == strip(text)
