"""Evaluation: synthetic tasks, grouped probes, the Jacobi stability sweep, the contraction diagnostic,
adaptive prefill, and every `fullband eval` command end to end on a micro run."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from conftest import random_ids, tiny_model, write_config
from fullband import generate, stream
from fullband.data.synthetic import completion_tracking, delayed_memory, register_last_write, training_documents
from fullband.eval.probe import answer_accuracy, final_streams, grouped_folds, probe_accuracy
from fullband.eval.stability import contraction, jacobi_sweep

pytest.importorskip("sklearn")


# ---------------------------------------------------------------------- synthetic tasks
@pytest.mark.parametrize("make", [completion_tracking, delayed_memory, register_last_write])
def test_tasks_are_balanced_grouped_and_hide_the_label(make):
    examples = make()
    targets = np.array([e.target for e in examples])
    assert targets.mean() == 0.5
    by_group: dict[str, list[int]] = {}
    for e in examples:
        assert e.text.endswith(":")
        assert not re.search(rf"\b{re.escape(e.label)}\b", e.text) or e.task == "registers"
        by_group.setdefault(e.group, []).append(e.target)
    assert all(np.mean(v) == 0.5 for v in by_group.values()), "every group holds both labels"


def test_task_sizes_match_the_paper():
    assert len(completion_tracking()) == 1600 and len({e.group for e in completion_tracking()}) == 80
    assert len(delayed_memory()) == 1280 and len({e.group for e in delayed_memory()}) == 128


def test_task_labels_are_right():
    for e in completion_tracking(groups=5):
        req, done = re.findall(r"= (\d+)", e.text)[:2]
        assert e.label == ("done" if req == done else "more")
    for e in delayed_memory(groups=5):
        assert e.target == int(e.text.split("\n")[0][-1])
    for e in register_last_write(groups=12):
        query = re.search(r"query = (r\d+)", e.text).group(1)
        writes = re.findall(rf"^{query} = (\d)$", e.text, flags=re.M)
        assert e.target == int(writes[-1])
        assert len(e.text) >= 180 - len("scratch += 0\n")  # padded up to ~180 characters (longer schedules exceed it)


def test_training_documents_end_with_the_label():
    docs = training_documents(50)
    assert len(docs) == 50 and all(re.search(r":(done|more|zero|one|0|1)\n$", d) for d in docs), docs[:3]
    spaced = training_documents(50, sep=" ")
    assert all(re.search(r": (done|more|zero|one|0|1)\n$", d) for d in spaced)


def test_answer_accuracy_matches_a_per_example_loop():
    from fullband import ByteTokenizer
    from fullband.data.synthetic import Example
    from fullband.errors import InputError

    model = tiny_model(max_seq_len=512)
    tok = ByteTokenizer()
    examples = delayed_memory(groups=6, scratch=(0, 3))
    for passes in (1, 2):
        got = answer_accuracy(model, tok, examples, passes=passes)
        hits = {}
        with torch.no_grad():
            for ex in examples:
                logits = model(torch.tensor([tok.encode(ex.text)]), passes=passes).logits[0, -1]
                hits.setdefault(ex.length, []).append(int(logits[ord("o")] > logits[ord("z")]) == ex.target)
        assert got["by_length"] == {n: pytest.approx(np.mean(v)) for n, v in hits.items()}
        assert got["accuracy"] == pytest.approx(np.mean([h for v in hits.values() for h in v]))
    clash = [Example("t", "a:", "done", 1, "g", 0), Example("t", "b:", "dull", 0, "g", 0)]
    with pytest.raises(InputError, match="start with the same token"):
        answer_accuracy(model, tok, clash)
    with pytest.raises(InputError, match="binary"):
        answer_accuracy(model, tok, completion_tracking(groups=2) + delayed_memory(groups=2))


# ---------------------------------------------------------------------- probes
def test_grouped_folds_never_share_a_group():
    groups = [e.group for e in completion_tracking()]
    for train, test in grouped_folds(groups, 4):
        assert not {groups[i] for i in train} & {groups[i] for i in test}


def test_probe_reads_a_planted_signal_and_not_noise():
    rng = np.random.default_rng(0)
    n, d = 400, 32
    labels = np.repeat([0, 1], n // 2)
    groups = [f"g{i // 4}" for i in range(n)]
    noise = rng.normal(size=(n, d))
    planted = noise.copy()
    planted[:, 3] += 8 * (labels - 0.5)  # classes 8 sigma apart along one direction
    assert probe_accuracy(planted, labels, groups) > 0.97
    assert 0.35 < probe_accuracy(noise, labels, groups) < 0.65


def test_final_streams_depth_zero_semantics():
    model = tiny_model(max_seq_len=512)
    from fullband import ByteTokenizer

    examples = completion_tracking(groups=4, scratch=(0, 2))
    tok = ByteTokenizer()
    std = final_streams(model, tok, examples, "standard")
    one = final_streams(model, tok, examples, "one-step")
    full = final_streams(model, tok, examples, "full")
    assert std.shape == (len(examples), model.config.n_layers + 1, model.config.d_model)
    # standard prefill: the stack input at the final ':' is its embedding alone, the same for every example
    assert np.allclose(std[:, 0], std[0, 0])
    # one-step recurrent prefill: it carries the previous position's top state, so it differs per example
    assert not np.allclose(one[:, 0], one[0, 0])
    # deeper layers of standard prefill see the context through attention
    assert not np.allclose(std[:, -1], std[0, -1])
    assert not np.allclose(one, full)


# ---------------------------------------------------------------------- stability and contraction
def test_jacobi_sweep_bookkeeping():
    model = tiny_model()
    T = 12
    batches = [(random_ids(2, T, seed=s), random_ids(2, T, seed=s + 10)) for s in range(2)]
    res = jacobi_sweep(model, batches, ks=(1, 2, 3, 5, T, T + 1, 40))
    assert res.ks == [1, 2, 3, 5, T, T + 1, 40]
    assert res.converged_at is not None and res.converged_at <= T + 1
    k_idx = {k: i for i, k in enumerate(res.ks)}
    assert res.update_rms[k_idx[40]] == 0.0 and res.update_rms[k_idx[T + 1]] == 0.0
    assert res.exact_rms[k_idx[T]] < 1e-4 and res.exact_rms[k_idx[1]] > res.exact_rms[k_idx[5]]
    assert all(a >= b for a, b in zip(res.exact_rms, res.exact_rms[1:]))  # the iterate only approaches h*
    assert len(res.update_curve) == 40
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(
            torch.cat([model(x, passes=1).logits for x, _ in batches]).flatten(0, 1), torch.cat([y for _, y in batches]).flatten())
    assert abs(res.loss[0] - float(ref)) < 1e-5
    assert abs(res.loss[k_idx[40]] - res.exact_loss) < 1e-4


def test_contraction_diagnostic():
    model = tiny_model()
    ids = random_ids(1, 16)
    c = contraction(model, ids, horizons=(1, 2, 4), vectors=2, power_iters=8)
    assert len(c.growth) == 3 and all(np.isfinite(c.growth)) and c.lipschitz > 0
    with torch.no_grad():
        model.fusion.w_u.weight.zero_()  # the state no longer reaches the input: J = 0
    dead = contraction(model, ids, horizons=(1, 2), vectors=1, power_iters=3)
    assert dead.growth == [0.0, 0.0] and dead.lipschitz == 0.0


# ---------------------------------------------------------------------- adaptive prefill
def test_adaptive_prefill_stops_and_matches_fixed_passes():
    model = tiny_model()
    prompt = random_ids(1, 10, seed=3)
    first = next(stream(model, prompt, 1, mode="fused", prefill_passes="auto", prefill_tol=1e-4))
    assert 2 <= first.prefill_passes <= 11  # the prompt's fixed point is reached after 10 passes at most
    with torch.no_grad():
        ref = model(prompt, passes=first.prefill_passes).logits[0, -1]
    assert torch.allclose(first.logits[0], ref, atol=1e-5)
    loose = next(stream(model, prompt, 1, mode="fused", prefill_passes="auto", prefill_tol=1e9))
    assert loose.prefill_passes == 2  # the first check (after pass 2) already passes
    capped = next(stream(model, prompt, 1, mode="fused", prefill_passes="auto", prefill_tol=1e-12, max_prefill_passes=3))
    assert capped.prefill_passes == 4
    assert generate(model, prompt, 5, mode="fused", prefill_passes="auto", prefill_tol=1e-9) == \
        generate(model, prompt, 5, mode="exact")
    with pytest.raises(ValueError, match="prefill_passes='fast'"):
        generate(model, prompt, 2, mode="fused", prefill_passes="fast")


# ---------------------------------------------------------------------- the commands
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, corpus, cache):
    from fullband.train.config import load_run_config
    from fullband.train.trainer import train

    tmp = tmp_path_factory.mktemp("evalrun")
    train(load_run_config(write_config(tmp, corpus, cache, steps=6, ckpt_every=0)))
    return tmp / "run" / "step_000006"


def test_eval_loss_command(checkpoint, tmp_path):
    from fullband.eval.commands import eval_loss

    res = eval_loss(checkpoint, max_prefill=2, seq_len=32, windows=8, batch_size=4, out=tmp_path, auto_tols=[1e-3],
                    progress=False)
    modes = [r["mode"] for r in res["rows"]]
    assert modes == ["standard", "fused k=1", "fused k=2", "auto tol=0.001", "exact"]
    assert res["windows"] == 8 and all(r["nats_per_token"] > 0 and r["stderr"] >= 0 for r in res["rows"])
    auto = res["rows"][3]
    assert 1 <= auto["fused_passes_used"] <= 32
    assert abs(auto["nats_per_token"] - res["rows"][-1]["nats_per_token"]) < 0.05  # near the fixed point
    # each mode against STANDARD, paired over the same windows: the difference of the means, with its error
    first = res["rows"][0]
    assert first["minus_first"] == 0 and all(
        r["minus_first"] == pytest.approx(r["nats_per_token"] - first["nats_per_token"], abs=1e-9)
        and math.isfinite(r["minus_first_stderr"]) for r in res["rows"][1:])
    assert (tmp_path / "loss.png").stat().st_size > 0 and json.loads((tmp_path / "loss.json").read_text())["rows"]


def test_eval_stability_command(checkpoint, tmp_path):
    from fullband.eval.commands import eval_stability

    res = eval_stability(checkpoint, ks=[1, 2, 3, 10, 40], seq_len=32, windows=4, batch_size=2, out=tmp_path,
                         progress=False)
    assert res["sweep"]["converged_at"] <= 33 and res["sweep"]["update_rms"][-1] == 0.0
    assert len(res["contraction"]["growth"]) == 6
    assert (tmp_path / "stability.png").stat().st_size > 0


def test_eval_probe_command(checkpoint, tmp_path):
    from fullband.eval.commands import eval_probe

    res = eval_probe(checkpoint, tasks=("memory",), scratch=(0, 4), out=tmp_path, progress=False)
    accs = res["tasks"]["memory"]["modes"]
    assert set(accs) == {"standard", "one-step", "suffix", "full"}
    assert all(len(a) == 3 and all(0 <= x <= 1 for x in a) for a in accs.values())
    assert accs["standard"][0] <= 0.6  # nothing but ':' at depth 0
    answers = res["tasks"]["memory"]["answer"]
    assert set(answers) == {"standard", "fused k=1"}
    assert all(0 <= a["accuracy"] <= 1 and set(a["by_length"]) == {0, 4} for a in answers.values())
    assert (tmp_path / "probe.png").stat().st_size > 0


def test_eval_generate_length_command(checkpoint, tmp_path):
    from fullband.eval.commands import eval_generate_length

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):", "answer": "return x"}\n{"prompt": "import os\\n"}\n')
    res = eval_generate_length(checkpoint, prompts, modes=[("standard", 0), ("soft", 0), ("fused", 2)],
                               max_new_tokens=12, out=tmp_path)
    assert [m["mode"] for m in res["modes"]] == ["standard", "soft", "fused"]
    assert all(0 <= m["median_tokens"] <= 12 for m in res["modes"])
    assert all(m["accuracy"] in (0.0, 1.0) for m in res["modes"])  # one answered row


@pytest.mark.parametrize("exp", ["fusion-ablation", "data-efficiency"])
def test_reproduce_writes_a_report(exp, tmp_path, corpus, cache):
    from fullband.reproduce import reproduce

    base = write_config(tmp_path, corpus, cache, "base", steps=3, ckpt_every=0)
    out = reproduce(exp, root=tmp_path / "runs", docs=tmp_path / "docs", base=str(base), seeds=1,
                    extra=["train.steps=3", "train.warmup_steps=1", "train.seq_len=32", "train.global_batch_tokens=256",
                           "train.micro_batch=4"])
    text = out.read_text()
    assert text.startswith(f"# Reproduction: {exp}") and "Hardware:" in text and "| run |" in text or "| fusion |" in text
    assert any(p.suffix == ".png" for p in (tmp_path / "docs" / exp).iterdir())


def test_reproduce_rejects_unknown_experiments():
    from fullband.reproduce import reproduce

    with pytest.raises(ValueError, match="did you mean 'stability'"):
        reproduce("stabilty")


def test_stability_sweep_iterates_the_model_s_own_pass_on_a_converted_llama():
    """A converted Llama has input_norm = false (plain positions read the raw embedding): the sweep must iterate
    the pass forward runs, so k = 1 is forward's loss and k = T + 1 the exact recurrence's."""
    pytest.importorskip("transformers")
    import torch.nn.functional as F
    from test_hf import tiny_llama

    from fullband.hf import from_llama

    model = from_llama(tiny_llama(False, seed=4)).eval()
    assert model.config.input_norm is False
    g = torch.Generator().manual_seed(2)
    ids, targets = torch.randint(2, 101, (3, 12), generator=g), torch.randint(2, 101, (3, 12), generator=g)
    T = ids.shape[1]
    sweep = jacobi_sweep(model, [(ids, targets)], ks=(1, 2, T + 1))
    with torch.no_grad():
        plain, two = model(ids, passes=1).logits, model(ids, passes=2).logits
        exact = model.recurrent_forward(ids).logits
    nll = lambda logits: F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()  # noqa: E731
    assert sweep.loss[0] == pytest.approx(nll(plain), abs=1e-6)
    assert sweep.loss[1] == pytest.approx(nll(two), abs=1e-6)
    assert sweep.loss[2] == pytest.approx(nll(exact), abs=1e-5) and sweep.exact_loss == pytest.approx(nll(exact))
