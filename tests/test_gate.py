"""The stability gate: each check fires on a model built to fail it (and only the checks it should), a healthy tiny
model passes, and a training run logs it, returns it, prints it, and doctor and reproduce's report show it."""

from __future__ import annotations

import json

import torch

from fullband.cli import main
from fullband.eval.gate import CHECKS, Gate, stability_gate, verdict
from fullband.train.metrics import last_gate

from conftest import MICRO_MODEL, random_ids, tiny_model, write_config

IDS = random_ids(4, 64)  # 64 positions: pass 32 is not yet the fixed point


def healthy(**changes):
    """A tiny model whose pass map contracts: the additive fusion e + h W with a small W (an untrained gated fusion
    does not: the state is its value path)."""
    model = tiny_model(fusion="additive", **changes)
    with torch.no_grad():
        model.fusion.w_h.weight.mul_(0.3)
    return model


def failed(gate: Gate) -> set[str]:
    return {c.name for c in gate.checks if c.passed is False}


def test_a_healthy_model_passes_and_the_gate_round_trips():
    model = healthy().train()
    gate = stability_gate(model, IDS)
    assert model.training  # the caller's mode comes back
    assert [c.name for c in gate.checks] == list(CHECKS) and gate.passed and failed(gate) == set()
    assert gate.summary() == "stability gate: pass" and verdict(gate.to_dict()) == "stability gate: pass"
    d = json.loads(json.dumps(gate.to_dict()))
    assert Gate.from_dict(d) == gate
    assert set(d["checks"]["finite"]["values"]) == {"1", "8", "32"}  # the logits at each pass count evaluated


def test_a_nan_weight_fails_the_finite_logits_check():
    model = healthy()
    with torch.no_grad():
        model.norm_out.weight[0] = float("nan")
    gate = stability_gate(model, IDS)
    assert "finite" in failed(gate) and not gate.passed
    assert "non-finite logits at pass 1, 8, 32" in gate.summary()


def test_large_logits_fail_only_the_max_logit_check():
    model = healthy()
    with torch.no_grad():
        model.embed.weight.mul_(1000.0)  # the tied head; every input reads the embedding normalised: only logits grow
    gate = stability_gate(model, IDS)
    assert failed(gate) == {"max_logit"}
    assert gate.summary().startswith("stability gate: FAILED (max |logit| ") and ">= 100" in gate.summary()


def test_an_expanding_feedback_fails_the_state_and_residual_checks():
    # T2MLR's residual mixer, fed the pre-norm residual stream, with a state projection of gain 3: the state grows
    # by about 3x per pass along the positions the passes reach
    model = tiny_model(fusion="t2mlr", feedback="residual")
    with torch.no_grad():
        model.fusion.scale_h.fill_(3.0)
        model.fusion.w_p.weight.copy_(3.0 * torch.eye(model.config.d_model))
    gate = stability_gate(model, IDS)
    assert {"state_rms", "residual"} <= failed(gate)
    assert "outside [0.25, 4]" in gate.summary() and "residual at pass 32" in gate.summary()


def test_a_non_contracting_pass_map_fails_the_residual_check_alone():
    gate = stability_gate(tiny_model(), IDS)  # an untrained gated fusion: each pass's state is new, none settles
    assert failed(gate) == {"residual"} and "residual at pass 32 " in gate.summary()


def test_a_model_without_feedback_reports_the_state_checks_as_not_applicable():
    gate = stability_gate(tiny_model(fusion="none"), IDS)
    assert gate.passed and [c.passed for c in gate.checks] == [True, True, None, None]
    assert set(gate.checks[0].values) == {"1"}


def test_short_windows_are_exact_before_the_deep_pass():
    gate = stability_gate(healthy(), random_ids(2, 6))  # exact after 6 passes: the residual beyond is 0
    assert gate.passed and gate.checks[3].values == {"pass8": 0.0, "pass32": 0.0}


def test_a_training_run_logs_returns_and_shows_its_gate(tmp_path, corpus, cache, capsys):
    from fullband.reproduce import gate_section

    config = write_config(tmp_path, corpus, cache, steps=2, ckpt_every=2, model=MICRO_MODEL + '\nfusion = "additive"')
    assert main(["train", str(config)]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "run"
    done = [line for line in out.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and done[0].endswith("; stability gate: pass")
    assert "stability gate: pass" in [line for line in out.splitlines() if "val loss" in line][0]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval" in r]
    assert evals and all(r["gate"]["passed"] and set(r["gate"]["checks"]) == set(CHECKS) for r in evals)
    assert last_gate(run).passed
    assert main(["doctor", str(run)]) == 0
    assert "ok    metrics.jsonl (stability gate): stability gate: pass at the last eval" in capsys.readouterr().out
    lines = gate_section(tmp_path)
    assert "## Stability gate" in lines and "- `run`: pass" in lines
    # a failed gate: doctor warns (the files are healthy); the report names what failed
    bad = Gate.from_dict(evals[-1]["gate"])
    bad.checks[1].passed, bad.checks[1].failure = False, "max |logit| 143 >= 100 at pass 2"
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 2, "eval": evals[-1]["eval"], "gate": bad.to_dict()}) + "\n")
    assert main(["doctor", str(run)]) == 0
    out = capsys.readouterr().out
    assert "warn  metrics.jsonl (stability gate): did not pass at the last eval: max |logit| 143 >= 100" in out
    assert "- `run`: FAILED: max |logit| 143 >= 100 at pass 2" in gate_section(tmp_path)
    assert verdict(bad.to_dict()) == "stability gate FAILED: max |logit| 143 >= 100 at pass 2"
    # a report rebuilt after the run folders are gone (compare reuses its records) keeps the lines it had
    kept = tmp_path / "gates.json"
    before = gate_section(tmp_path, kept=kept)
    import shutil

    shutil.rmtree(run)
    assert gate_section(tmp_path, kept=kept) == before


def test_a_run_from_before_the_gate_is_not_measured(tmp_path, capsys):
    from fullband.reproduce import gate_section

    run = tmp_path / "old"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "eval": {"1": 5.0}}) + "\n")
    assert last_gate(run) is False
    assert gate_section(tmp_path)[-1].startswith("- `old`: not measured")
    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    assert "- `rl`: no validation eval logged" in gate_section(tmp_path)


def test_gate_windows_zero_turns_the_gate_off(tmp_path, corpus, cache):
    from fullband.train.config import load_run_config
    from fullband.train.trainer import train

    config = write_config(tmp_path, corpus, cache, steps=3, ckpt_every=3)
    result = train(load_run_config(config, ["log.gate_windows=0"]))
    assert result["gate"] is None and result["eval"]
    assert last_gate(tmp_path / "run") is False
