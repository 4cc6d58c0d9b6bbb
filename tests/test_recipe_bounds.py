"""Size-like recipe keys bounded before the first step (the adaptive schedule's, the pass counts, the memory a step
needs) and key combinations that train nothing refused: each is one line naming the key, not a run that never
ends, dies in the allocator or crashes at its first checkpoint."""

from __future__ import annotations

import pytest

from conftest import write_config
from fullband.errors import ConfigError
from fullband.train.config import load_run_config


@pytest.mark.parametrize("passes, said", [
    ('{schedule = "adaptive", horizon = 1000000}', "measures the pass map over horizon = 1000000 passes, but a window "
                                                   "of train.seq_len=32 positions reaches its fixed point after 33"),
    ('{schedule = "adaptive", vectors = 1000000}', "train.passes.vectors=1000000 is invalid; accepted:"),
    ('{schedule = "adaptive", windows = 1000000}', "train.passes.windows=1000000 is invalid; accepted:"),
    ('{schedule = "adaptive", top = 1000000, cap = 1000000}', "draws up to 1000000 passes, but a window of "
                                                              "train.seq_len=32 positions"),
    ('"grow:1000000"', "draws up to 1000000 passes"),
])
def test_pass_counts_and_measurements_are_bounded_before_anything_runs(passes, said, tmp_path, corpus, cache):
    recipe = write_config(tmp_path, corpus, cache)
    with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)")):
        load_run_config(recipe, [f"train.passes={passes}"])
    assert load_run_config(recipe, ['train.passes="grow:33"']).train.schedule.max_passes == 33


def test_a_selection_that_only_fed_passes_read_under_one_pass_is_refused(tmp_path, corpus, cache):
    from fullband.train.trainer import train

    recipe = write_config(tmp_path, corpus, cache)
    cfg = load_run_config(recipe, ['train.passes="none"', 'train.trainable=["fusion.*"]'])
    with pytest.raises(ConfigError, match=r"trains only weights a fed pass reads \(fusion\.w_u\.weight.*never runs "
                                          r"more than one pass: nothing would train"):
        train(cfg)
    assert not any(p.name.startswith("step_") for p in (tmp_path / "run").iterdir()) \
        if (tmp_path / "run").exists() else True


def test_a_step_that_cannot_fit_is_refused_unless_asked(tmp_path, corpus, cache, monkeypatch, capsys):
    """The memory estimate of the largest step against what is available: refused before anything is allocated,
    unless train.memory_check = false (then a warning, as before)."""
    from fullband.train import memory, trainer

    recipe = write_config(tmp_path, corpus, cache, steps=2, ckpt_every=0)
    monkeypatch.setattr(memory, "available_memory", lambda device: 1024)  # 1 KiB: nothing fits
    with pytest.raises(ConfigError, match=r"the largest step may not fit: about .* GB against 0\.0 GB available.*"
                                          r"\(train\.memory_check = false goes on anyway\)"):
        trainer.train(load_run_config(recipe))
    assert not (tmp_path / "run" / "run.json").exists()
    with pytest.warns(UserWarning, match="the largest step may not fit"):
        trainer.train(load_run_config(recipe, ["train.memory_check=false"]))
