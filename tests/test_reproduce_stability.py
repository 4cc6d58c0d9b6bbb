"""`fullband reproduce stability` end to end on micro runs: both schedules trained, their pass maps swept and
reported; a rerun reuses the runs and the kept sweeps (nothing trained or evaluated again)."""

from __future__ import annotations

import json

import pytest
from conftest import write_config

SHRINK = ["train.steps=3", "train.warmup_steps=1", "train.global_batch_tokens=512", "train.micro_batch=4",
          "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "train.seq_len=32"]


def test_reproduce_stability_keeps_its_sweeps(tmp_path, corpus, cache, monkeypatch):
    from functools import partial

    import fullband.eval.stability as stability
    from fullband.reproduce import reproduce, stability as experiment

    monkeypatch.setattr(stability, "contraction", partial(stability.contraction, horizons=(1, 8, 32), vectors=1,
                                                          power_iters=3))
    monkeypatch.setattr(experiment, "WINDOWS", 4)
    base = write_config(tmp_path, corpus, cache, "base", ckpt_every=0)
    options = dict(root=tmp_path / "runs", docs=tmp_path / "docs", base=str(base), seeds=1,
                   extra=[*SHRINK, f'data.cache_dir="{cache}"'])
    text = reproduce("stability", **options).read_text()
    assert "**one-two** (trained up to 2 passes): loss " in text and "| one-two-three |" in text
    saved = json.loads((tmp_path / "docs" / "stability" / "eval" / "one-two.json").read_text())
    assert saved["windows"] == 4 and saved["checkpoint"].endswith("step_000003")
    assert len(saved["sweep"]["loss"]) == len(saved["sweep"]["ks"]) and saved["contraction"]["horizons"] == [1, 8, 32]
    for name in ("jacobi_sweep", "contraction"):
        monkeypatch.setattr(stability, name, lambda *a, **k: pytest.fail("evaluated again"))
    monkeypatch.setattr("fullband.train.trainer.train", lambda *a, **k: pytest.fail("trained again"))
    again = reproduce("stability", **options).read_text()
    strip = lambda t: [line for line in t.splitlines() if "Wall time" not in line]
    assert strip(again) == strip(text)
