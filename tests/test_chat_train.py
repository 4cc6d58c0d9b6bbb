"""Instruction tuning (issue 13): chat templates and their masks, vocabulary growth, packing, the chat sampler,
training on chat data warm-started from a text checkpoint (exact resume after SIGKILL), and the fused input a
response's first token gets in training compared with the one generate builds."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fullband.data.chat.arithmetic import write_chat_jsonl
from fullband.data.chat.messages import check_messages
from fullband.data.chat.packing import pack_chats
from fullband.data.chat.templates import (IGNORE, MARKER_JINJA, JinjaTemplate, MarkerTemplate, chat_prompt,
                                          chat_template, encode_chat, fed_chat_prompt)
from fullband.data.sampler import ChatSampler
from fullband.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe
from fullband.errors import ConfigError, DataError

from conftest import losses

CONVERSATION = {"messages": [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "2 + 2 = 4. Answer: 4"}, {"role": "user", "content": "and times 3?"},
    {"role": "assistant", "content": "4 * 3 = 12. Answer: 12"}]}
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def bpe(corpus):
    texts = [p.read_text(errors="ignore") for p in sorted(Path(corpus).glob("*.py"))[:8]]
    return train_bpe(texts, 400, show_progress=False)


def _pretrained(bpe, tmp_path):
    """A pretrained-model tokenizer with ChatML markers and template, saved the way transformers saves one."""
    transformers = pytest.importorskip("transformers")
    from fullband.data.tokenizer import PretrainedTokenizer

    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe.hf_tokenizer, bos_token="<bos>",
                                                eos_token="<|im_end|>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = CHATML
    fast.save_pretrained(tmp_path / "pretrained")
    return PretrainedTokenizer.from_pretrained(tmp_path / "pretrained")


def _responses(tok, seq) -> list[str]:
    """The texts the loss falls on, one per run of consecutive targets."""
    runs, cur = [], []
    for t in seq.targets:
        if t == IGNORE:
            if cur:
                runs.append(cur)
            cur = []
        else:
            cur.append(t)
    return [tok.decode(r, skip_special=False) for r in runs + ([cur] if cur else [])]


@pytest.mark.parametrize("kind", ["byte", "bpe", "pretrained"])
def test_the_loss_falls_exactly_on_assistant_tokens_for_every_template(kind, bpe, tmp_path):
    tok = {"byte": lambda: ByteTokenizer(chat=True), "bpe": bpe.with_chat_tokens,
           "pretrained": lambda: _pretrained(bpe, tmp_path)}[kind]()
    template = chat_template(tok)
    assert isinstance(template, JinjaTemplate if kind == "pretrained" else MarkerTemplate)
    seq = encode_chat(template, check_messages(CONVERSATION, "x"))
    end = "<|im_end|>" if kind == "pretrained" else "<|end|>"
    assert _responses(tok, seq) == ["2 + 2 = 4. Answer: 4" + end, "4 * 3 = 12. Answer: 12" + end]
    # BOS in front where inference reads one: fullband's templates write it; this ChatML template does not and the
    # tokenizer adds none, so neither training nor the prompt has it (as transformers' apply_chat_template)
    assert (seq.ids[0] == tok.bos_id) == (kind != "pretrained")
    # fed: the response tokens the model generates (not the end marker, which is read with the next prompt)
    fed_text = tok.decode([i for i, f in zip(seq.ids, seq.fed) if f], skip_special=False)
    assert fed_text == "2 + 2 = 4. Answer: 4" + "4 * 3 = 12. Answer: 12"
    starts = [t + 1 for t in range(len(seq.ids) - 1) if seq.targets[t] != IGNORE and
              (t == 0 or seq.targets[t - 1] == IGNORE)]
    for s in starts:  # a response's first token is fed, its end marker is not, nothing before it is
        assert seq.fed[s] and not seq.fed[s - 1]
    assert sum(seq.fed) == seq.loss_tokens - 2  # every learned token but the two end markers' positions
    # the inference prompt is the conversation so far with the generation prompt, as training renders it
    prompt = chat_prompt(tok, CONVERSATION["messages"][:2])
    assert seq.ids[: len(prompt)] == prompt
    if kind == "pretrained":
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(tmp_path / "pretrained").apply_chat_template(
            CONVERSATION["messages"][:1], add_generation_prompt=True)
        assert chat_prompt(tok, CONVERSATION["messages"][:1]) == list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_vocabularies_grow_save_and_reload(bpe, tmp_path):
    plain = ByteTokenizer()
    chat = plain.with_chat_tokens()
    assert chat.vocab_size == 263 and chat.chat_ids == {"<|system|>": 259, "<|user|>": 260, "<|assistant|>": 261,
                                                         "<|end|>": 262}
    assert chat.stop_ids == (257, 262) and plain.stop_ids == (257,)
    assert chat.fingerprint != plain.fingerprint
    assert "chat_tokens" not in plain._payload()  # a plain byte vocabulary keeps its old fingerprint
    chat.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.chat_ids == chat.chat_ids and again.fingerprint == chat.fingerprint
    assert chat.decode([260, 104, 105, 262], skip_special=False) == "<|user|>hi<|end|>"
    grown = bpe.with_chat_tokens()
    assert grown.vocab_size == bpe.vocab_size + 4 and bpe.chat_ids is None
    assert sorted(grown.chat_ids.values()) == list(range(bpe.vocab_size, bpe.vocab_size + 4))
    assert grown.encode("<|user|>", bos=False) != [grown.chat_ids["<|user|>"]]  # text never becomes a marker
    (tmp_path / "bpe").mkdir()
    grown.save(tmp_path / "bpe")
    assert load_tokenizer(tmp_path / "bpe").chat_ids == grown.chat_ids
    with pytest.raises(DataError, match="neither a chat template nor fullband's chat markers"):
        chat_template(plain)


def test_the_jinja_form_of_the_marker_template_gives_the_same_ids_and_refuses_the_same_roles():
    transformers = pytest.importorskip("transformers")
    tok = ByteTokenizer(chat=True)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.to_hf(), bos_token="<bos>", eos_token="<eos>",
                                                pad_token="<pad>", chat_template=MARKER_JINJA)
    for n in (2, 4):
        msgs = CONVERSATION["messages"][:n]
        ours = chat_prompt(tok, msgs)
        theirs = fast.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        theirs = theirs if isinstance(theirs, list) else theirs["input_ids"]
        assert list(theirs) == ours
    # a role without a marker is refused, with chat data's sentence, wherever the folder's template renders it
    # (transformers, vLLM's chat API), not written as text
    bad = [CONVERSATION["messages"][0], {"role": "wizard", "content": "x"}]
    with pytest.raises(DataError) as ours:
        chat_prompt(tok, bad)
    with pytest.raises(Exception) as theirs:
        fast.apply_chat_template(bad, add_generation_prompt=True, tokenize=False)
    assert str(theirs.value) == str(ours.value) == \
        "messages[1]: unknown role 'wizard'; accepted: system, user, assistant"


def test_a_conversation_read_to_answer_it_may_hold_an_empty_reply():
    """A model may reply with its end marker alone (fullband chat keeps such a turn, a server gets it back): read
    to answer, the conversation renders it (its end marker, plain); training data still has nothing to learn from it."""
    tok = ByteTokenizer(chat=True)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "?"}]
    ids, spans = fed_chat_prompt(tok, chat)
    assert ids == chat_prompt(tok, chat) and spans == [] and ids.count(tok.chat_ids["<|end|>"]) == 3
    with pytest.raises(DataError, match="x: message 1: empty assistant turn"):
        check_messages({"messages": [*chat, {"role": "assistant", "content": "ok"}]}, "x")


def test_packing_keeps_conversations_whole_and_counts_what_it_drops():
    tok = ByteTokenizer(chat=True)
    template = chat_template(tok)
    from fullband.data.chat.arithmetic import arithmetic_chats

    seqs = [encode_chat(template, check_messages(o, "x")) for o in arithmetic_chats(60, seed=3)]
    packed = pack_chats(iter(seqs), 200, tok.pad_id)
    kept = [s for s in seqs if len(s) <= 200]
    assert packed.dropped == len(seqs) - len(kept) > 0 and packed.conversations == len(kept)
    # read the conversations back from the windows: split at BOS, padding off
    back = []
    for row, targets, fed in zip(packed.ids, packed.targets, packed.fed):
        starts = list(np.flatnonzero(row == tok.bos_id)) + [int((row != tok.pad_id).sum())]
        assert starts[0] == 0 and (row[starts[-1]:] == tok.pad_id).all()
        assert (targets[starts[-1]:] == IGNORE).all() and not fed[starts[-1]:].any()
        back += [(list(row[a:b]), list(targets[a:b]), list(fed[a:b])) for a, b in zip(starts, starts[1:])]
    assert sorted(back) == sorted((s.ids, s.targets, s.fed) for s in kept)  # each whole, once
    wide = pack_chats(iter(seqs), 1024, tok.pad_id)
    assert wide.conversations == len(seqs) and wide.ids.shape[0] <= sum(map(len, seqs)) // 1024 + 2  # dense
    cut = pack_chats(iter(seqs), 200, tok.pad_id, too_long="truncate")
    assert cut.truncated == len(seqs) - len(kept) and cut.dropped == 0
    with pytest.raises(DataError, match="no conversation fits a window of seq_len=8"):
        pack_chats(iter(seqs), 8, tok.pad_id)


def test_the_chat_sampler_reads_prompts_plainly_or_fed_and_replays_exactly():
    tok = ByteTokenizer(chat=True)
    from fullband.data.chat.arithmetic import arithmetic_chats

    template = chat_template(tok)
    packed = pack_chats((encode_chat(template, check_messages(o, "x")) for o in arithmetic_chats(200)), 256,
                        tok.pad_id)
    sampler = ChatSampler(packed, 8, 4, seed=5, fused_prompts=0.5)
    fused_rows = soft_rows = 0
    for step in range(20):
        for micro in range(2):
            inputs, targets, plain = sampler.batch(step, micro)
            w = sampler.windows(step, micro)
            assert torch.equal(inputs, torch.from_numpy(packed.ids[w]))
            for r in range(4):
                starts = torch.from_numpy(packed.start[w[r]])  # each conversation's first position (its BOS here)
                assert torch.equal(starts, inputs[r] == tok.bos_id) and bool(plain[r][starts].all())
                if torch.equal(plain[r], starts):
                    fused_rows += 1  # FUSED prefill: every position fed but each conversation's first
                else:
                    soft_rows += 1
                    assert torch.equal(plain[r], torch.from_numpy(~packed.fed[w[r]]))
            # two processes with half the micro-batch each read the same samples, with the same draws
            halves = [ChatSampler(packed, 8, 2, seed=5, fused_prompts=0.5, rank=r, world_size=2).batch(step, micro)
                      for r in (0, 1)]
            for a, *b in zip((inputs, targets, plain), *halves):
                assert torch.equal(a, torch.cat(b))
    assert 0.3 < fused_rows / (fused_rows + soft_rows) < 0.7


def test_fused_input_of_the_first_response_token_is_the_one_generate_builds():
    """The stack input at a response's first token, in the last training pass, equals the input the decode step
    builds for it after the prompt is read as SOFT (plain prompt rows) / FUSED k (fed prompt rows) reads it."""
    from fullband import FullbandLM, ModelConfig, generate

    tok = ByteTokenizer(chat=True)
    torch.manual_seed(0)
    model = FullbandLM(ModelConfig(vocab_size=263, d_model=64, n_layers=2, n_heads=4, max_seq_len=128,
                                   bos_token_id=256, init_std=0.1)).eval()
    seq = encode_chat(chat_template(tok), check_messages(
        {"messages": [{"role": "user", "content": "Ana has 3 pens."}, {"role": "assistant", "content": "ok"}]}, "x"))
    first = next(t for t in range(len(seq.ids)) if seq.fed[t])
    prompt, answer = seq.ids[:first], seq.ids[first]
    ids = torch.tensor([seq.ids])
    seen = []
    # the stack input, as block 0's first norm reads it (in a whole-sequence pass and in a decode step)
    hook = model.blocks[0].attn_norm.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    for passes, mode, k, plain in [(2, "soft", 0, ~torch.tensor([seq.fed])), (3, "soft", 0, ~torch.tensor([seq.fed])),
                                   (2, "fused", 0, None), (3, "fused", 1, None), (4, "fused", 2, None)]:
        seen.clear()
        with torch.no_grad():
            model(ids, passes=passes, plain_mask=plain)
        trained = seen[-1][0, first]
        seen.clear()
        generate(model, [prompt], 2, mode=mode, prefill_passes=k, forced_tokens=[[answer, answer]])
        decoded = seen[-1][0, 0]  # the decode step that reads the first response token
        torch.testing.assert_close(trained, decoded, atol=2e-5, rtol=1e-4)
    hook.remove()


# ---------------------------------------------------------------------- training on chat data
CHAT_RECIPE = """
[model]
vocab_size = {vocab}
d_model = 32
n_layers = 2
n_heads = 2
max_seq_len = 256
jitter = 0.02
prefix_mixin_prob = 0.2

[data]
format = "chat"
corpus = "{corpus}"
tokenizer = "byte"
val_percent = 10.0
fused_prompts = 0.5

[train]
steps = {steps}
seq_len = 256
global_batch_tokens = 1024
micro_batch = 2
passes = {passes}
warmup_steps = 2
cooldown_fraction = 0.3
init_from = "{init_from}"

[optim]
lr = 0.02
adam_lr = 0.003

[log]
run_dir = "{run_dir}"
eval_every = 4
eval_windows = 4
eval_passes = [1, 2, 3]
ckpt_every = {ckpt_every}
keep_last = 3
progress = false
"""


def chat_recipe(tmp_path, name, *, steps=6, init_from="", corpus="arithmetic:300", ckpt_every=3, vocab=263,
                passes='[{until = 0.3, probs = {"1" = 1.0}}, {until = 1.0, probs = {"2" = 0.5, "3" = 0.5}}]'):
    path = tmp_path / f"{name}.toml"
    path.write_text(CHAT_RECIPE.format(vocab=vocab, corpus=corpus, steps=steps, passes=passes,
                                       init_from=init_from, run_dir=tmp_path / name, ckpt_every=ckpt_every))
    return path


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory, corpus, cache):
    """A micro text model (byte vocabulary, 259 ids) to fine-tune from."""
    from conftest import write_config
    from fullband.train.config import load_run_config
    from fullband.train.trainer import train

    root = tmp_path_factory.mktemp("base")
    cfg = load_run_config(write_config(root, corpus, cache, "base", steps=4, ckpt_every=4),
                          ['model.max_seq_len=256'])
    train(cfg)
    return root / "base" / "step_000004"


def test_sft_warm_starts_grows_the_vocabulary_and_learns_on_assistant_tokens(tmp_path, base_checkpoint, capsys):
    from fullband import FullbandLM
    from fullband.train.config import load_run_config
    from fullband.train.trainer import Trainer

    cfg = load_run_config(chat_recipe(tmp_path, "sft", steps=8, init_from=base_checkpoint))
    trainer = Trainer(cfg)
    try:
        base = FullbandLM.load(base_checkpoint)
        model = trainer.model
        assert trainer.warm_started["grown"] == {"embed.weight": [259, 263]}
        with torch.no_grad():  # old rows copied, the four markers start at the mean embedding
            assert torch.equal(model.embed.weight[:259], base.embed.weight)
            assert torch.allclose(model.embed.weight[259:], base.embed.weight.mean(0).expand(4, -1))
            assert torch.equal(model.blocks[0].mlp.w_in.weight, base.blocks[0].mlp.w_in.weight)
        result = trainer.run()
    finally:
        trainer.close()
    out = capsys.readouterr().out
    assert "embed.weight grown 259 -> 263 rows" in out
    assert "chat data (train): " in out and "conversations in" in out and "dropped" in out
    tuned = FullbandLM.load(tmp_path / "sft" / "step_000008")
    assert tuned.config.vocab_size == 263
    tok = load_tokenizer(tmp_path / "sft" / "step_000008")
    assert tok.chat_ids and tok.stop_ids == (257, 262)
    assert set(result["eval"]) == {"1", "2", "3"}
    rows = losses(tmp_path / "sft")
    assert len(rows) == 8 and rows[-1][0] < rows[0][0]


def test_chat_training_resumes_bitwise_after_sigkill(tmp_path, base_checkpoint):
    from test_train import cli

    whole = chat_recipe(tmp_path, "whole", steps=60, init_from=base_checkpoint, ckpt_every=0)  # saves at the end
    part = chat_recipe(tmp_path, "part", steps=60, init_from=base_checkpoint, ckpt_every=2)
    ref = cli("train", str(whole))  # the uninterrupted run, beside the victim (one thread each)
    victim = cli("train", str(part))
    deadline = time.time() + 300
    while not (tmp_path / "part" / "step_000006").exists():
        assert victim.poll() is None and time.time() < deadline, victim.stderr.read() if victim.poll() else "timeout"
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not (tmp_path / "part" / "step_000060").exists()
    resumed = cli("train", str(part), "--resume", str(tmp_path / "part"))
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    assert "resumed from" in out
    _, err = ref.communicate(timeout=600)
    assert ref.returncode == 0, err
    assert losses(tmp_path / "part") == losses(tmp_path / "whole")
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "whole" / "step_000060" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "step_000060" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_chat_data_errors_name_file_and_line(tmp_path, base_checkpoint):
    from fullband.train.config import load_run_config
    from fullband.train.trainer import train

    data = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data.write_text(json.dumps(good) + "\n" + json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(DataError, match=f"{data}:2: message 0: unknown role 'robot'"):
        train(load_run_config(chat_recipe(tmp_path, "bad", corpus=str(data))))
    assert not (tmp_path / "bad").exists()  # nothing written
    with pytest.raises(ConfigError, match="data.tokenizer='bpe' trains a tokenizer on text, not on chat data"):
        load_run_config(chat_recipe(tmp_path, "bpe"), ['data.tokenizer="bpe"'])
    with pytest.raises(ConfigError, match="model.vocab_size=259 is smaller than the tokenizer's 263 ids"):
        train(load_run_config(chat_recipe(tmp_path, "small", vocab=259)))
    write_chat_jsonl([good] * 3, tmp_path / "three.jsonl")
    assert len((tmp_path / "three.jsonl").read_text().splitlines()) == 3


def test_log_eval_chats_reads_a_chat_set_at_every_evaluation(tmp_path, base_checkpoint, corpus, cache, capsys):
    """log.eval_chats: the chat set's assistant-token loss at each of log.eval_passes, logged at every evaluation; the
    one-pass read equals each conversation's STANDARD read, averaged (each is read in a window of its own); a run
    whose tokenizer has no chat template is refused before it writes anything."""
    from conftest import write_config
    from fullband import FullbandLM
    from fullband.data.chat.messages import as_message
    from fullband.data.chat.templates import chat_template, encode_chat
    from fullband.model.mode import DecodeMode
    from fullband.model.objective import ntp
    from fullband.train.config import load_run_config
    from fullband.train.trainer import train

    chats = [{"messages": [{"role": "user", "content": f"Question {i}: " + "what is seven plus five? " * n},
                           {"role": "assistant", "content": f"Reply {i}: seven and five make twelve. " * n}]}
             for i, n in enumerate((1, 1, 3))]  # packed into windows of the longest, the two short ones would share
    write_chat_jsonl(chats, tmp_path / "held.jsonl")
    train(load_run_config(chat_recipe(tmp_path, "sft", steps=8, init_from=base_checkpoint),
                          [f'log.eval_chats="{tmp_path / "held.jsonl"}"']))
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval" in r]
    assert [r["step"] for r in evals] == [4, 8] and all(set(r["eval_chats"]) == {"1", "2", "3"} for r in evals)
    assert evals[0]["eval_chats"] != evals[1]["eval_chats"]
    assert "; chats: " in capsys.readouterr().out
    model, tok = FullbandLM.load(tmp_path / "sft" / "step_000008").eval(), load_tokenizer(tmp_path / "sft" / "step_000008")
    template, reads = chat_template(tok), []
    with torch.no_grad():
        for chat in chats:
            seq = encode_chat(template, [as_message(m, "chat") for m in chat["messages"]])
            out = model.read(torch.tensor([seq.ids]), DecodeMode("standard"), return_logits=True)
            reads.append(float(ntp(out.logits, torch.tensor([seq.targets]))))
    assert evals[-1]["eval_chats"]["1"] == pytest.approx(sum(reads) / 3, rel=1e-5)

    text = write_config(tmp_path, corpus, cache, "text")  # a byte tokenizer: no chat template
    with pytest.raises(ConfigError, match=r"log.eval_chats=.* its tokenizer has none"):
        train(load_run_config(text, [f'log.eval_chats="{tmp_path / "held.jsonl"}"']))
    assert not (tmp_path / "text").exists()
    with pytest.raises(ConfigError, match=r"log.eval_chats='.*missing.jsonl': chat corpus not found: .*accepted: "):
        train(load_run_config(chat_recipe(tmp_path, "missing"), [f'log.eval_chats="{tmp_path / "missing.jsonl"}"']))
    assert not (tmp_path / "missing").exists()
    with pytest.raises(ConfigError, match=r"log.eval_chats=3 must be str"):
        load_run_config(text, ["log.eval_chats=3"])


def test_eval_chat_scores_final_answers_per_mode(tmp_path, base_checkpoint):
    """`fullband eval chat` on a micro chat model: one row per mode, accuracy a share of items equal to a direct
    per-item check of the answers it returns, and references that are the conversations' own answers."""
    from fullband.data.chat.arithmetic import arithmetic_chats, final_answer
    from fullband.eval.commands import eval_chat
    from fullband.train.config import load_run_config
    from fullband.train.trainer import train

    train(load_run_config(chat_recipe(tmp_path, "sft", steps=4, init_from=base_checkpoint)))
    data = write_chat_jsonl(arithmetic_chats(12, seed=9), tmp_path / "held.jsonl")
    res = eval_chat(tmp_path / "sft" / "step_000004", data, modes=["standard", "soft", "fused:2"], max_new_tokens=24,
                    batch_size=5, out=tmp_path / "eval", progress=False)
    assert [r["mode"] for r in res["rows"]] == ["standard", "soft", "fused k=2"]
    from fullband.data.chat.templates import chat_prompt

    tok = load_tokenizer(tmp_path / "sft" / "step_000004")
    kept = [c for c in arithmetic_chats(12, seed=9) if len(chat_prompt(tok, c["messages"][:-1])) + 24 <= 256]
    assert res["n"] == len(kept) and res["skipped"] == 12 - len(kept) >= 1  # one two-turn prompt is too long
    refs = [final_answer(c["messages"][-1]["content"]) for c in kept]
    assert res["references"] == refs
    for r in res["rows"]:
        assert r["accuracy"] == pytest.approx(np.mean([final_answer(a) == f for a, f in zip(r["answers"], refs)]))
        assert 1 <= r["tokens"] <= 24
    assert res["rows"][0]["accuracy_diff"] == 0 and (tmp_path / "eval" / "chat.png").is_file()
    assert json.loads((tmp_path / "eval" / "chat.json").read_text())["rows"][1]["mode"] == "soft"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "hello"}]}) + "\n")
    with pytest.raises(DataError, match="no final 'Answer: ...' line"):
        eval_chat(tmp_path / "sft" / "step_000004", bad, out=tmp_path / "eval2")
    # a corpus spec: its held-out split, as the run split it
    from fullband.data.chat.sources import chat_conversations
    from fullband.eval.chat import held_out_items

    split = json.loads((tmp_path / "sft" / "run.json").read_text())["data"]
    spec = held_out_items(split["corpus"], val_percent=split["val_percent"])
    assert spec == held_out_items(write_chat_jsonl([{"messages": [{"role": m.role, "content": m.content} for m in c]}
                                                    for c in chat_conversations(split["corpus"], "val",
                                                                                split["val_percent"])],
                                                   tmp_path / "val.jsonl")) and spec


def test_reproduce_sft_writes_a_report(tmp_path, corpus, cache):
    from conftest import write_config
    from fullband.reproduce import reproduce

    base = write_config(tmp_path, corpus, cache, "base", steps=3, ckpt_every=0)
    small = ["train.steps=3", "train.warmup_steps=1", "train.seq_len=256", "train.global_batch_tokens=512",
             "train.micro_batch=2", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=256"]
    out = reproduce("sft", root=tmp_path / "runs", docs=tmp_path / "docs", base=str(base), seeds=1,
                    extra=[*small, f'data.cache_dir="{cache}"'], sft_extra=['data.corpus="arithmetic:300"'],
                    held_out=8, max_new_tokens=16)
    text = out.read_text()
    assert text.startswith("# Reproduction: sft") and "| model | decoding | exact match |" in text
    for mode in ("standard", "soft", "fused k=1", "fused k=2"):
        assert f"| sft | {mode} |" in text
    assert "| standard-sft | standard |" in text and "**Outcome.**" in text
    assert (tmp_path / "docs" / "sft" / "fbt" / "chat.png").is_file()
