"""`fullband reproduce rl` end to end on micro runs: every stage trained and scored, the report's tables computed
from the numbers, and a rerun reusing every finished run and evaluation."""

from __future__ import annotations

import json


def test_reproduce_rl_writes_a_report_and_a_rerun_reuses_it(tmp_path, corpus, cache, capsys):
    from conftest import write_config
    from fullband.reproduce import reproduce

    base = write_config(tmp_path, corpus, cache, "base", steps=3, ckpt_every=0)
    small = ["train.steps=3", "train.warmup_steps=1", "train.seq_len=256", "train.global_batch_tokens=512",
             "train.micro_batch=2", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=256"]
    options = dict(root=tmp_path / "runs", docs=tmp_path / "docs", base=str(base), seeds=1,
                   extra=[*small, f'data.cache_dir="{cache}"'], sft_extra=['data.corpus="arithmetic-mixed:300"'],
                   rl_extra=("rl.steps=2", "rl.group=2", "rl.prompts_per_step=2", "rl.max_new_tokens=8",
                             "rl.eval_prompts=4", 'rl.data="arithmetic-mixed:300"', "rl.accept=0"),
                   held_out=6, max_new_tokens=8, study_prompts=2, study_tokens=4)
    out = reproduce("rl", **options)
    text = out.read_text()
    assert text.startswith("# Reproduction: rl") and "**Outcome.**" in text
    for model, modes in (("fbt", ("standard", "soft", "fused k=1")), ("standard", ("standard",))):
        for stage in ("sft", "onpolicy-sft", "rl"):
            for mode in modes:
                assert f"| {model} | {stage} | {mode} |" in text, (model, stage, mode)
    for mode in ("soft", "fused k=2"):
        for path in ("jacobi:1", "jacobi:8", "replay"):
            assert f"| {mode} | {path} |" in text
    rows = [json.loads(x) for x in (tmp_path / "runs" / "rl" / "onpolicy-sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["kept"] == 4 for r in rows)  # accept=0: every reply kept
    for name in ("rl.png", "runs/rl.png", "runs/standard-onpolicy-sft.png", "eval/rl/chat.json"):
        assert (tmp_path / "docs" / "rl" / name).is_file(), name
    capsys.readouterr()
    again = reproduce("rl", **options).read_text()
    assert "== training" not in capsys.readouterr().out  # every run reused
    strip = [line for line in text.splitlines() if "Wall time" not in line]
    assert strip == [line for line in again.splitlines() if "Wall time" not in line]  # ...and every number
