"""A real pretrained LLM through fullband's surfaces: SmolLM2-135M-Instruct (Llama architecture, 30 layers), installed
offline as a GGUF file by `make install`. Each surface is checked against the reference it should equal:
transformers' own reading of the same GGUF file (float32), token for token or to float rounding."""

from __future__ import annotations

import io
import json

import pytest
import torch

import fullband
from fullband.cli import main

pytest.importorskip("transformers")

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
TEXT = "The Python standard library is"


def reference_ids(smollm2, messages, **kw) -> list[int]:
    ids = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kw)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def reference_greedy(smollm2, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = smollm2.reference.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


# ---------------------------------------------------------------------- convert, both ways, both formats
def test_converted_folders_compute_the_reference_logits(smollm2):
    """GGUF -> native -> hf: STANDARD logits within 1e-4 of transformers' (float32) on a ChatML prompt, plain text
    and a ragged (left-padded) batch; native -> hf -> native is bitwise."""
    from transformers import AutoModelForCausalLM

    import fullband.hf  # noqa: F401  (registers the transformers classes)

    native = fullband.load_model(smollm2.native)
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2.hf)).eval()
    chat = reference_ids(smollm2, CHAT)
    text = smollm2.tokenizer(TEXT)["input_ids"]
    with torch.no_grad():
        for ids in (chat, text):
            x = torch.tensor([ids])
            want = smollm2.reference(x).logits
            assert (native(x).logits - want).abs().max() < 1e-4
            assert (hf(x).logits - want).abs().max() < 1e-4
        # a ragged batch through transformers' calling convention: left padding and the attention mask
        batch = smollm2.tokenizer.pad({"input_ids": [chat, text]}, padding_side="left", return_tensors="pt")
        got = hf(**batch).logits[1, -len(text):]
        assert (got - smollm2.reference(torch.tensor([text])).logits[0]).abs().max() < 1e-4
    again = fullband.load_model(smollm2.back)
    mine, theirs = native.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_the_tokenizer_travels_untouched(smollm2):
    """The model's own vocabulary (no id added), special tokens, BOS policy (SmolLM2 adds none), ChatML template and
    end-of-turn id, in every folder, as fullband and as transformers read them; doctor calls each folder healthy."""
    from transformers import AutoTokenizer

    from fullband.doctor import diagnose

    ref = smollm2.tokenizer
    want_chat = reference_ids(smollm2, CHAT)
    im_end = ref.convert_tokens_to_ids("<|im_end|>")
    for folder in (smollm2.native, smollm2.hf, smollm2.back):
        tok = fullband.load_tokenizer(folder)
        assert tok.vocab_size == len(ref) == 49152
        assert (tok.bos_id, tok.eos_id, tok.stop_ids, tok.add_bos) == (ref.bos_token_id, ref.eos_token_id, (im_end,),
                                                                        False)
        assert tok.encode(TEXT) == ref(TEXT)["input_ids"]
        assert fullband.apply_chat_template(tok, CHAT) == want_chat
        report = diagnose(folder)
        assert not report.failed, report.format()
        assert "feedback_trained = false" in report.format()
    auto = AutoTokenizer.from_pretrained(str(smollm2.hf))
    assert len(auto) == 49152 and auto.padding_side == "left"
    assert (auto.bos_token, auto.eos_token, auto.pad_token) == (ref.bos_token, ref.eos_token, ref.pad_token)
    assert reference_ids(type("S", (), {"tokenizer": auto}), CHAT) == want_chat
    for name in ("config.json", "generation_config.json"):
        assert json.loads((smollm2.hf / name).read_text())["eos_token_id"] == im_end
    config = json.loads((smollm2.hf / "config.json").read_text())
    assert (config["feedback_mode"], config["feedback_trained"], config["vocab_size"]) == ("standard", False, 49152)


# ---------------------------------------------------------------------- generate and chat
def test_generate_is_transformers_greedy_continuation(smollm2, capsys):
    """`fullband generate --prompt TEXT` reads TEXT as transformers does (no BOS for SmolLM2), decodes STANDARD by
    default (the fusion is untrained; it says so) and writes transformers' greedy continuation."""
    text_ids = smollm2.tokenizer(TEXT)["input_ids"]
    want = smollm2.tokenizer.decode(reference_greedy(smollm2, text_ids, 12))
    for folder in (smollm2.native, smollm2.hf):
        capsys.readouterr()
        assert main(["generate", "--checkpoint", str(folder), "--prompt", TEXT, "--max-new-tokens", "12"]) == 0
        out = capsys.readouterr()
        assert out.out.rstrip("\n") == want
        assert "feedback weights are untrained" in out.err and "12 tokens, standard" in out.err


CHATML = "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n"


def test_a_prompt_s_control_tokens_are_read_as_the_model_s_tokenizer_reads_them(smollm2, capsys):
    """SmolLM2's ChatML prompt written as text: fullband reads `<|im_start|>` as the one control token, as
    transformers (and vLLM and llama.cpp) do, and answers what transformers answers; --special-as-text reads the
    markers as plain text (untrusted input), as before."""
    from fullband.data.tokenizer import load_tokenizer

    want_ids = smollm2.tokenizer(CHATML, add_special_tokens=False)["input_ids"]
    tok = load_tokenizer(smollm2.native)
    assert tok.encode(CHATML) == want_ids and want_ids[0] == smollm2.tokenizer.convert_tokens_to_ids("<|im_start|>")
    plain = tok.encode(CHATML, special=False)
    assert len(plain) > len(want_ids) and smollm2.tokenizer.convert_tokens_to_ids("<|im_start|>") not in plain
    im_end = smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")
    greedy = reference_greedy(smollm2, want_ids, 16)
    want = smollm2.tokenizer.decode(greedy[:greedy.index(im_end)] if im_end in greedy else greedy)
    assert "red" in want.lower()  # an answer to the question (transformers': "1. Red: The most common ...")
    for folder in (smollm2.native, smollm2.hf):
        capsys.readouterr()
        assert main(["generate", "--checkpoint", str(folder), "--prompt", CHATML, "--max-new-tokens", "16"]) == 0
        assert capsys.readouterr().out.rstrip("\n") == want
    assert main(["generate", "--checkpoint", str(smollm2.native), "--prompt", CHATML, "--max-new-tokens", "16",
                 "--special-as-text"]) == 0
    assert capsys.readouterr().out.rstrip("\n") != want


def test_every_mode_runs_and_standard_equals_transformers(smollm2):
    model = fullband.load_model(smollm2.native)
    chat = reference_ids(smollm2, CHAT)
    text = smollm2.tokenizer(TEXT)["input_ids"]
    want = [reference_greedy(smollm2, ids, 10) for ids in (chat, text)]
    im_end = smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")
    got = fullband.generate(model, [chat, text], 10, stop_tokens=[im_end])  # a ragged batch, STANDARD by default
    assert [g[:len(w)] for g, w in zip(got, want)] == [w[:len(g)] for g, w in zip(got, want)]
    assert [len(g) for g in got] == [len(w) if im_end not in w else w.index(im_end) + 1 for w in want]
    for mode, k in (("soft", 0), ("fused", 1), ("exact", 0)):
        out = fullband.generate(model, [text], 4, mode=mode, prefill_passes=k)
        assert len(out[0]) == 4


def test_chat_uses_the_models_template_and_stops_at_im_end(smollm2, monkeypatch, capsys):
    """`fullband chat` on the converted folder: ChatML from the model's own template, stops at <|im_end|>, and the
    greedy reply is transformers' greedy reply, token for token."""
    want = reference_greedy(smollm2, reference_ids(smollm2, CHAT), 48)
    im_end = smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in want  # the reference ends its turn within the budget
    want_text = smollm2.tokenizer.decode(want[:want.index(im_end)])
    monkeypatch.setattr("sys.stdin", io.StringIO(CHAT[0]["content"] + "\n"))
    capsys.readouterr()
    assert main(["chat", "--checkpoint", str(smollm2.hf), "--max-new-tokens", "48"]) == 0
    out = capsys.readouterr().out
    assert f"assistant> {want_text}\n" in out
    assert f"[{want.index(im_end) + 1} tokens, standard, " in out and " tok/s, end" in out


# ---------------------------------------------------------------------- evaluation
@pytest.fixture(scope="module")
def prose(tmp_path_factory):
    """Three small real-text documents (the standard library's own docs: pydoc_data's prose)."""
    from pydoc_data.topics import topics

    root = tmp_path_factory.mktemp("prose")
    for name in ("assignment", "for", "with"):
        (root / f"{name}.txt").write_text(topics[name][:2000])
    return root


def test_eval_loss_scores_the_folder_asked_for_as_transformers_does(smollm2, prose, tmp_path, capsys):
    """`eval loss --corpus FOLDER --val-percent 100` scores the whole folder; STANDARD's loss is transformers' loss on
    the same windows; asking for more windows than the text holds is said (and scores what there is)."""
    import warnings

    from fullband.errors import FullbandWarning
    from fullband.eval.commands import eval_loss, held_out_stream, window_batches

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = eval_loss(smollm2.native, corpus=str(prose), val_percent=100, windows=64, seq_len=64,
                           max_prefill=1, exact=False, batch_size=8, out=tmp_path / "eval", progress=False)
    said = [str(w.message) for w in caught if issubclass(w.category, FullbandWarning)]
    assert result["windows"] < 64 and any(f"fewer than the 64 asked for; scoring {result['windows']}" in m
                                          for m in said)
    assert result["windows"] >= 8  # all three files, not a 1% split of them
    stream = held_out_stream(smollm2.native, fullband.load_tokenizer(smollm2.native), corpus=str(prose),
                             val_percent=100)
    nll = []
    with torch.no_grad():
        for inputs, targets in window_batches(stream, 64, 64, 8):
            logits = smollm2.reference(inputs).logits
            nll.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
                       .view(targets.shape).mean(1))
    standard = next(r for r in result["rows"] if r["mode"] == "standard")
    assert standard["nats_per_token"] == pytest.approx(float(torch.cat(nll).mean()), abs=1e-4)


def test_lm_eval_fullband_equals_the_stock_hf_backend(smollm2, tmp_path):
    """lm-evaluation-harness on a small local task: `--model fullband` in STANDARD and the stock `hf` backend (on
    transformers' own reading of the GGUF file, its defaults: no BOS added) give the same loglikelihoods."""
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    from lm_eval.models.huggingface import HFLM

    from fullband.lmeval import FullbandHarnessLM
    from test_lmeval import MC, tasks  # the lm-eval tests' multiple-choice task (fb_mc), their task index

    rows = [{"question": "The capital of France is", "choices": ["Paris", "Berlin", "a river"], "answer": 0},
            {"question": "2 + 2 =", "choices": ["4", "5"], "answer": 0},
            {"question": "Water freezes at", "choices": ["0 degrees Celsius", "50 degrees Celsius"], "answer": 0}]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "fb_mc.yaml").write_text(MC.format(data=tmp_path / "mc.jsonl"))
    manager = tasks(tmp_path)

    def lls(model):
        res = lm_eval.simple_evaluate(model=model, tasks=["fb_mc"], task_manager=manager, log_samples=True)
        return [float(r[0][0]) for s in sorted(res["samples"]["fb_mc"], key=lambda s: s["doc_id"])
                for r in s["resps"]]

    ours = lls(FullbandHarnessLM(checkpoint=str(smollm2.native), mode="standard"))
    stock = lls(HFLM(pretrained=smollm2.reference, tokenizer=smollm2.tokenizer, batch_size=4))
    assert len(ours) == 7 and ours == pytest.approx(stock, abs=1e-4)


# ---------------------------------------------------------------------- post-training
def test_fullband_rl_runs_a_step_on_the_real_model_with_an_earnable_reward(smollm2, tmp_path, capsys):
    """configs/rl-smollm2.toml (the quiz and the `contains` reward) for one step: rewards that differ within a
    group (something to learn from), a checkpoint, and the held-out reward under the run's own reward."""
    from fullband.rl.run import load_rl_recipe, metric_rows, rl_train

    recipe = load_rl_recipe("configs/rl-smollm2.toml", [
        f"rl.init_from={smollm2.native}", f"rl.run_dir={tmp_path / 'rl'}", "rl.steps=1", "rl.group=4",
        "rl.prompts_per_step=2", "rl.max_new_tokens=12", "rl.eval_prompts=2", "rl.eval_every=0", "rl.seed=1"])
    run = rl_train(recipe, progress=False)
    rows = metric_rows(run / "metrics.jsonl")
    step = rows[-1]
    assert step["step"] == 1 and 0 < step["reward"] < 1 and step["flat_groups"] < 2
    assert "eval" in step and 0 <= step["eval"]["accuracy"] <= 1
    assert (run / "step_000001" / "model.safetensors").is_file()
    out = capsys.readouterr()
    assert "held-out reward" in out.err + out.out and "changed nothing" not in out.err + out.out


def test_trl_grpo_trainer_takes_a_step_on_the_real_model(smollm2, tmp_path):
    """TRL's GRPOTrainer (fullband.rl.trl.FeedbackGRPOTrainer) on the converted transformers folder: the model's own
    chat template renders the prompts, replies end at <|im_end|>, the quiz reward scores them and a step is taken."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from fullband.rl.rewards import contains_answer
    from fullband.rl.trl import FeedbackGRPOTrainer

    rows = [json.loads(line) for line in open("configs/quiz.jsonl")][:2]
    dataset = datasets.Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])
    seen = []

    def reward(completions, answer, **_):  # TRL's signature: conversational completions and the dataset's columns
        scores = [contains_answer("", c[0]["content"], {"answer": a}) for c, a in zip(completions, answer)]
        seen.extend(scores)
        return scores

    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=2,
                          max_completion_length=12, max_steps=1, learning_rate=1e-6, beta=0.0, use_cpu=True,
                          bf16=False, report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
                          gradient_checkpointing=False)
    trainer = FeedbackGRPOTrainer(model=str(smollm2.hf), reward_funcs=reward, args=args, train_dataset=dataset)
    before = trainer.model.model.embed.weight.detach().clone()
    result = trainer.train()
    assert len(seen) == 4 and max(seen) == 1.0  # the model earns the reward on the quiz
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(before, trainer.model.model.embed.weight.detach())  # a step was taken


# ---------------------------------------------------------------------- a warm start from the GGUF file
def test_warmstart_recipe_takes_its_sizes_weights_and_tokenizer_from_the_gguf_file(smollm2, prose, tmp_path, capsys):
    """configs/warmstart-smollm2.toml with train.init_from the GGUF file: the model is the Llama's (STANDARD logits
    are transformers'), the run reads the model's own tokenizer, states its memory before the first step, trains a
    two-pass step, and its checkpoint decodes SOFT by default (feedback_trained)."""
    from fullband.train.config import load_run_config
    from fullband.train.trainer import train

    cfg = load_run_config("configs/warmstart-smollm2.toml", [
        f"train.init_from={smollm2.gguf}", f"log.run_dir={tmp_path / 'run'}", "train.steps=1", "train.seq_len=32",
        "train.global_batch_tokens=64", "train.micro_batch=2", 'train.passes="three-pass"', "train.warmup_steps=0",
        "log.eval_windows=2", f"data.cache_dir={tmp_path / 'cache'}", f"data.corpus={prose}",
        "data.val_percent=50", "log.progress=false", "optim.adam_lr=1e-12"])  # a step that moves nothing visible
    result = train(cfg)
    out = capsys.readouterr().out
    assert "memory: about" in out and "warm start from" in out
    ckpt = tmp_path / "run" / "step_000001"
    tok = fullband.load_tokenizer(ckpt)
    assert tok.vocab_size == 49152 and not tok.add_bos and tok.stop_ids == (2,) and tok.chat_template
    model = fullband.load_model(ckpt)
    assert model.config.feedback_trained and model.config.d_model == 576 and model.config.n_layers == 30
    assert result["steps"] == 1 and all(v == v for v in result["eval"].values())
    x = torch.tensor([smollm2.tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        assert (model(x).logits - smollm2.reference(x).logits).abs().max() < 1e-4  # the Llama's weights


# ---------------------------------------------------------------------- speed on its shapes
def test_bench_decode_and_train_take_a_real_model(smollm2, capsys):
    """`fullband bench decode --model` and `bench train --model` on the converted folder (smoke test: one thread,
    a few tokens): every row, the read bound, transformers at the same shape; `shipped:smollm2` names the file."""
    from fullband.gguf_file import SHIPPED, gguf_path

    assert gguf_path(SHIPPED) == smollm2.gguf
    folder = str(smollm2.native)
    assert main(["bench", "decode", "--model", folder, "--threads", "1", "--batch-sizes", "1", "--new-tokens", "4",
                 "--repeats", "1", "--pairs", "4"]) == 0
    out = capsys.readouterr().out
    for row in ("fullband standard", "fullband soft", "fullband fused k=1", "transformers generate",
                "weight mat-vec chain (torch)", "streaming read of the weights"):
        assert row in out
    assert "513 MiB of weights read per decode step" in out
    assert main(["bench", "train", "--model", folder, "--batch", "1", "--seq-len", "16", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert all(f"k={k}" in out for k in (1, 2, 3)) and "transformers" in out


@pytest.mark.parametrize("args, said", [
    (["decode", "--prompt-len", "1000000000"], "--prompt-len + --new-tokens = 1,000,000,064 exceeds the model's "
                                               "context (max_seq_len=8,192)"),
    (["decode", "--batch-sizes", "1000000"], "bench decode --model needs about"),
    (["train", "--seq-len", "1000000000"], "--seq-len = 1,000,000,000 exceeds the model's context"),
    (["train", "--batch", "1000000"], "bench train --model needs about"),
])
def test_real_model_benchmarks_refuse_sizes_before_loading(smollm2_gguf, args, said, capsys):
    """bench decode / train --model check the sizes bench cost checks, before any weight is loaded."""
    import time

    t0 = time.perf_counter()
    assert main(["bench", *args[:1], "--model", "shipped:smollm2", *args[1:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err and time.perf_counter() - t0 < 60, err


def test_benchmark_rounds_are_counted_at_parse_time(capsys):
    for args in (["train", "--rounds", "0"], ["train", "--rounds", "-1"], ["decode", "--repeats", "0"]):
        with pytest.raises(SystemExit):
            main(["bench", *args])
        assert "is out of range; accepted: an integer >= 1" in capsys.readouterr().err
