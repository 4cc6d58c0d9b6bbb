"""The lm-evaluation-harness model, offline: local JSON tasks (multiple choice and generation) through
`lm_eval.simple_evaluate`, with the adapter's loglikelihoods equal to direct scoring."""

from __future__ import annotations

import importlib
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


def tasks(folder):
    """The harness's task index of `folder` alone: its built-in tasks' index takes 5-6 s to build, once per call."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(folder), include_defaults=False)


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
    tmp, rows, gens = setup
    lm = FullbandHarnessLM(checkpoint=str(tmp / "ckpt"), mode=mode, prefill_passes=k, batch_size=2)
    res = lm_eval.simple_evaluate(model=lm, tasks=["fb_mc", "fb_gen"], task_manager=tasks(tmp), log_samples=True)
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
    import fullband.hf  # noqa: F401  (registers model_type "fullband" with the Auto classes)
    from fullband.data.tokenizer import train_bpe
    from fullband.hf.convert import convert

    tmp, rows, _ = setup
    texts = [json.dumps(r) for r in rows] * 20 + ["def f(x):\n    return x\nimport os\n" * 30]
    tok = train_bpe(texts, 300, show_progress=False)
    tiny_model(seed=3, vocab_size=300, bos_token_id=tok.bos_id).save(tmp_path / "native", tokenizer=tok)
    convert(tmp_path / "native", tmp_path / "hf")
    manager = tasks(tmp)
    ours = lm_eval.simple_evaluate(model=FullbandHarnessLM(checkpoint=str(tmp_path / "native"), mode="standard"),
                                   tasks=["fb_mc"], task_manager=manager, log_samples=True)
    from lm_eval.models.huggingface import HFLM

    hflm = HFLM(pretrained=str(tmp_path / "hf"), add_bos_token=True, dtype="float32", device="cpu")
    theirs = lm_eval.simple_evaluate(model=hflm, tasks=["fb_mc"], task_manager=manager, log_samples=True)

    def lls(res):
        return [float(r[0][0]) for s in sorted(res["samples"]["fb_mc"], key=lambda s: s["doc_id"]) for r in s["resps"]]

    assert lls(theirs) == pytest.approx(lls(ours), abs=1e-4)
    assert theirs["results"]["fb_mc"]["acc,none"] == ours["results"]["fb_mc"]["acc,none"]


# ---------------------------------------------------------------------------------------------------- chat templates
CHAT_GEN = """task: fb_chat_gen
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
  max_gen_toks: {new}
metric_list:
  - metric: exact_match
"""
CHAT_NEW = 40


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory):
    """A model with a chat byte vocabulary (the markers are ids 259..262) and a local generation task."""
    tmp = tmp_path_factory.mktemp("lmeval_chat")
    # seed 9: in each mode, with and without a system message, some answers end at <|end|> before a newline
    tiny_model(seed=9, vocab_size=263, init_std=0.1).save(tmp / "ckpt", tokenizer=ByteTokenizer(chat=True))
    gens = [{"prompt": "What is 2 + 2?", "answer": "4"}, {"prompt": "Name a fruit.", "answer": "apple"},
            {"prompt": "x = ", "answer": "0"}, {"prompt": "Say hi.", "answer": "hi"},
            {"prompt": "Count to three.", "answer": "1 2 3"}]
    (tmp / "chat_gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gens))
    (tmp / "fb_chat_gen.yaml").write_text(CHAT_GEN.format(data=tmp / "chat_gen.jsonl", new=CHAT_NEW))
    return tmp, gens


@pytest.mark.parametrize("mode,k", [("soft", 1), ("fused", 2)])
@pytest.mark.parametrize("system", [None, "Answer briefly."])
def test_apply_chat_template_generates_from_the_chat_prompt(chat_setup, mode, k, system, monkeypatch):
    """Under --apply_chat_template the model reads each request as fullband's chat prompt ids (BOS, <|user|> ...
    <|end|>, <|assistant|>, the markers as their ids, not their text's bytes) and its answer is
    fullband.generate's on those ids, ended at the chat stop ids and cut at the task's stop string."""
    from fullband.data.chat.templates import chat_prompt

    gen_module = importlib.import_module("fullband.decode.generate")  # the module (the package exports a function)

    tmp, gens = chat_setup
    tok = ByteTokenizer(chat=True)
    lm = FullbandHarnessLM(checkpoint=str(tmp / "ckpt"), mode=mode, prefill_passes=k)
    seen: list[list[int]] = []
    real = gen_module.generate

    def spy(model, prompts, n, **kwargs):
        seen.extend(list(p) for p in prompts)
        assert list(kwargs["stop_tokens"]) == [257, 262]
        return real(model, prompts, n, **kwargs)

    monkeypatch.setattr(gen_module, "generate", spy)
    res = lm_eval.simple_evaluate(model=lm, tasks=["fb_chat_gen"], task_manager=tasks(tmp),
                                  apply_chat_template=True, system_instruction=system, log_samples=True)
    monkeypatch.undo()
    samples = sorted(res["samples"]["fb_chat_gen"], key=lambda s: s["doc_id"])
    assert len(seen) == len(gens) == len(samples)
    early = 0
    for row, sample in zip(gens, samples):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": row["prompt"]}]
        ids = chat_prompt(tok, messages)
        assert ids[0] == 256 and 260 in ids and ids[-1] == 261  # BOS ... <|user|> ... <|assistant|>
        assert (259 in ids) == bool(system)
        ctx = sample["arguments"][0]
        ctx = ctx["arg_0"] if isinstance(ctx, dict) else ctx[0]
        assert ctx == lm.apply_chat_template(messages)  # the harness's context is the rendered conversation
        assert ctx.startswith("<bos>") and ctx.endswith("<|assistant|>")
        assert ids in seen
        out = real(lm.model, [ids], CHAT_NEW, mode=mode, prefill_passes=k, stop_tokens=tok.stop_ids)[0]
        early += len(out) < CHAT_NEW and "\n" not in tok.decode(out)  # the stop id, not the stop string, ends it
        assert sample["resps"][0][0] == tok.decode(out).split("\n")[0]
    assert early  # so the comparison covers a turn ended at <|end|> (whose next turn must not leak into the answer)
    assert 0.0 <= res["results"]["fb_chat_gen"]["exact_match,none"] <= 1.0


def test_apply_chat_template_renders_and_reads_back(chat_setup):
    """apply_chat_template / chat_template / tokenizer_name as lm-eval calls them, and a rendered context read back
    as the chat prompt ids (also in loglikelihood requests, the continuation after the assistant's marker)."""
    from fullband.data.chat.templates import MARKER_JINJA, chat_prompt

    tmp, _ = chat_setup
    tok = ByteTokenizer(chat=True)
    lm = FullbandHarnessLM(checkpoint=str(tmp / "ckpt"))
    messages = [{"role": "user", "content": "Ana has 3 pens."}, {"role": "assistant", "content": "Noted."},
                {"role": "user", "content": "How many <now>?"}]
    assert lm.chat_template(True) == MARKER_JINJA and lm.chat_template(False) is None
    assert lm.tokenizer_name.startswith("fullband-byte-")
    text = lm.apply_chat_template(messages)
    assert text == "<bos><|user|>Ana has 3 pens.<|end|><|assistant|>Noted.<|end|><|user|>How many <now>?<|end|>" \
                   "<|assistant|>"
    ids = chat_prompt(tok, messages)
    assert lm._encode(text) == ids
    # without the generation prompt, the last assistant message stays open (lm-eval's gen_prefix)
    opened = lm.apply_chat_template([*messages, {"role": "assistant", "content": "Answer:"}], add_generation_prompt=False)
    assert opened == text + "Answer:"
    assert lm._encode(opened) == ids + list(b"Answer:")
    ctx, cont = lm._split(text, " 5")
    assert ctx == ids and cont == list(b" 5")
    (direct, _), = score(lm.model, [ids], [list(b" 5")])
    assert lm._score([(ctx, cont)])[0][0] == pytest.approx(direct, abs=1e-6)


def test_apply_chat_template_needs_a_chat_vocabulary(setup):
    tmp, _, _ = setup
    lm = FullbandHarnessLM(checkpoint=str(tmp / "ckpt"))  # a plain byte vocabulary: no chat markers
    assert lm.chat_template(True) is None
    with pytest.raises(ConfigError, match="--apply_chat_template: the checkpoint's byte vocabulary has no chat template"):
        lm_eval.simple_evaluate(model=lm, tasks=["fb_gen"], task_manager=tasks(tmp),
                                apply_chat_template=True)
    with pytest.raises(ConfigError, match="no chat template"):
        lm.apply_chat_template([{"role": "user", "content": "hi"}])


def test_apply_chat_template_with_a_pretrained_models_own_template(tmp_path):
    """A checkpoint whose tokenizer carries a pretrained model's chat template (ChatML here): the harness renders
    with that template and reads the text back as fullband's chat prompt ids."""
    pytest.importorskip("transformers")
    from fullband.data.chat.templates import chat_prompt
    from fullband.data.tokenizer import PretrainedTokenizer, train_bpe

    bpe = train_bpe(["def f(x):\n    return x\nimport os\n" * 30], 300, show_progress=False)
    backend = bpe.hf_tokenizer
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    template = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = PretrainedTokenizer(backend, special_ids=(0, 1, 2), stop_ids=(1, backend.token_to_id("<|im_end|>")),
                              chat_template=template)
    tiny_model(vocab_size=tok.vocab_size, bos_token_id=0).save(tmp_path / "ckpt", tokenizer=tok)
    lm = FullbandHarnessLM(checkpoint=str(tmp_path / "ckpt"))
    assert lm.chat_template(True) == template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x): return x"}]
    text = lm.apply_chat_template(messages)
    assert text == "<bos><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ndef f(x): return x<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    assert lm._encode_chat(text) == chat_prompt(lm.tokenizer, messages)
    opened = lm.apply_chat_template([*messages, {"role": "assistant", "content": "Answer:"}],
                                    add_generation_prompt=False)
    assert opened == text + "Answer:"
