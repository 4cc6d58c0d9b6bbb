"""The lm-evaluation-harness model, offline: local JSON tasks (multiple choice and generation) through
`lm_eval.simple_evaluate`, with the adapter's loglikelihoods equal to direct scoring."""

from __future__ import annotations

import json
import math

import pytest

from conftest import tiny_model
from fullband import ByteTokenizer, generate
from fullband.decode.score import score
from fullband.errors import ConfigError

lm_eval = pytest.importorskip("lm_eval")
from fullband.lmeval import FullbandHarnessLM  # noqa: E402

MC = """task: fb_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN = """task: fb_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lmeval")
    tiny_model().save(tmp / "ckpt")
    rows = [{"question": "2 + 2 =", "choices": ["4", "5", "22"], "answer": 0},
            {"question": "def f(x):\n    return", "choices": ["x", "None"], "answer": 0},
            {"question": "import", "choices": ["os", "sys", "re", "json"], "answer": 2}]
    (tmp / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gens = [{"prompt": "print(", "answer": "1)"}, {"prompt": "x = ", "answer": "0"}]
    (tmp / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gens))
    (tmp / "fb_mc.yaml").write_text(MC.format(data=tmp / "mc.jsonl"))
    (tmp / "fb_gen.yaml").write_text(GEN.format(data=tmp / "gen.jsonl"))
    return tmp, rows, gens


@pytest.mark.parametrize("mode,k", [("standard", 1), ("fused", 2), ("soft", 1)])
def test_simple_evaluate_scores_like_the_model(setup, mode, k):
    from lm_eval.tasks import TaskManager

    tmp, rows, gens = setup
    lm = FullbandHarnessLM(checkpoint=str(tmp / "ckpt"), mode=mode, prefill_passes=k, batch_size=2)
    res = lm_eval.simple_evaluate(model=lm, tasks=["fb_mc", "fb_gen"], task_manager=TaskManager(include_path=str(tmp)),
                                  log_samples=True)
    assert set(res["results"]) == {"fb_mc", "fb_gen"}
    tok = ByteTokenizer()
    samples = sorted(res["samples"]["fb_mc"], key=lambda s: s["doc_id"])
    correct = []
    for row, sample in zip(rows, samples):
        args = _pairs(sample["arguments"])
        assert [c for _, c in args] == [" " + c for c in row["choices"]]  # the harness's target delimiter
        direct = score(lm.model, [tok.encode(q) for q, _ in args], [tok.encode(c)[1:] for _, c in args],
                       mode=mode, prefill_passes=k)
        got = [r[0] for r in sample["resps"]]  # [[(logprob, greedy)], ...]
        assert [g[0] for g in got] == pytest.approx([d[0] for d in direct], abs=1e-5)  # float32, other batch shapes
        correct.append(max(range(len(direct)), key=lambda i: direct[i][0]) == row["answer"])
    assert res["results"]["fb_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))
    # generation: the harness's answer is the mode's greedy continuation cut at the first newline
    gen_samples = sorted(res["samples"]["fb_gen"], key=lambda s: s["doc_id"])
    for row, sample in zip(gens, gen_samples):
        ids = generate(lm.model, [tok.encode(row["prompt"])], 6, mode=mode, prefill_passes=k)[0]
        assert sample["resps"][0][0] == tok.decode(ids).split("\n")[0]
    assert 0.0 <= res["results"]["fb_gen"]["exact_match,none"] <= 1.0


def _pairs(arguments) -> list[tuple[str, str]]:
    """(context, continuation) per request from a logged sample (a list of tuples, or of {"arg_0", "arg_1"})."""
    out = []
    for a in arguments:
        out.append((a["arg_0"], a["arg_1"]) if isinstance(a, dict) else (a[0], a[1]))
    return out


def test_loglikelihood_rolling_sums_the_text(setup):
    tmp, _, _ = setup
    lm = FullbandHarnessLM(checkpoint=str(tmp / "ckpt"))
    text = "for i in range(3):\n    print(i)\n"

    class Req:
        args = (text,)

    (total,) = lm.loglikelihood_rolling([Req()])
    tok = ByteTokenizer()
    ids = tok.encode(text)
    (direct, _), = score(lm.model, [ids[:1]], [ids[1:]])
    assert total == pytest.approx(direct, abs=1e-6) and total < 0 and math.isfinite(total)


def test_bad_model_args_are_named(setup):
    tmp, _, _ = setup
    with pytest.raises(ConfigError, match="unknown model arg 'prefil_passes'.*did you mean 'prefill_passes'"):
        FullbandHarnessLM.create_from_arg_string(f"checkpoint={tmp / 'ckpt'},prefil_passes=2")
    # model_args win over the harness's own --batch_size / --device
    lm = FullbandHarnessLM.create_from_arg_string(f"checkpoint={tmp / 'ckpt'},batch_size=3",
                                                  {"batch_size": 16, "device": "cpu", "max_batch_size": None})
    assert lm.batch_size == 3
    with pytest.raises(ConfigError, match="mode='fusd'"):
        FullbandHarnessLM(checkpoint=str(tmp / "ckpt"), mode="fusd")
    with pytest.raises(ConfigError, match="needs model_args checkpoint"):
        FullbandHarnessLM()


def test_the_harness_hf_model_reads_a_converted_folder(setup, tmp_path):
    """A checkpoint converted with `fullband convert` is an ordinary transformers model to lm-eval's own `hf`
    backend: its loglikelihoods (one plain pass, BOS prepended) equal the `fullband` model's in STANDARD mode."""
    pytest.importorskip("accelerate")  # lm-eval's hf backend needs it (the `eval` extra installs it)
    pytest.importorskip("transformers")
    from lm_eval.tasks import TaskManager

    import fullband.hf  # noqa: F401  (registers model_type "fullband" with the Auto classes)
    from fullband.data.tokenizer import train_bpe
    from fullband.hf.convert import convert

    tmp, rows, _ = setup
    texts = [json.dumps(r) for r in rows] * 20 + ["def f(x):\n    return x\nimport os\n" * 30]
    tok = train_bpe(texts, 300, show_progress=False)
    tiny_model(seed=3, vocab_size=300, bos_token_id=tok.bos_id).save(tmp_path / "native", tokenizer=tok)
    convert(tmp_path / "native", tmp_path / "hf")
    manager = TaskManager(include_path=str(tmp))
    ours = lm_eval.simple_evaluate(model=FullbandHarnessLM(checkpoint=str(tmp_path / "native"), mode="standard"),
                                   tasks=["fb_mc"], task_manager=manager, log_samples=True)
    from lm_eval.models.huggingface import HFLM

    hflm = HFLM(pretrained=str(tmp_path / "hf"), add_bos_token=True, dtype="float32", device="cpu")
    theirs = lm_eval.simple_evaluate(model=hflm, tasks=["fb_mc"], task_manager=manager, log_samples=True)

    def lls(res):
        return [float(r[0][0]) for s in sorted(res["samples"]["fb_mc"], key=lambda s: s["doc_id"]) for r in s["resps"]]

    assert lls(theirs) == pytest.approx(lls(ours), abs=1e-4)
    assert theirs["results"]["fb_mc"]["acc,none"] == ours["results"]["fb_mc"]["acc,none"]
