"""Chat data (issue 13, first part): reading and checking conversations, and the training sequence of a rendered
conversation (loss on assistant tokens only; fed positions where inference feeds the state)."""

from __future__ import annotations

import json

import pytest

from fullband.data.chat.messages import Message, read_chat_jsonl
from fullband.data.chat.templates import IGNORE, assemble
from fullband.errors import DataError


def write_jsonl(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_conversations_are_read_multi_turn_with_blank_lines_and_a_bom(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
                          {"role": "assistant", "content": "6"}]},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    path.write_text("\ufeff" + json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    got = list(read_chat_jsonl(path))
    assert [len(c) for c in got] == [5, 2]
    assert got[0][3] == Message("user", "and 3+3?")


@pytest.mark.parametrize("row,message", [
    ("{not json", "invalid JSON"),
    ([1, 2], "expected a JSON object with a 'messages' list, got list"),
    ({"turns": []}, "no 'messages' key (keys: turns)"),
    ({"messages": "hi"}, "'messages' must be a list"),
    ({"messages": [{"content": "x"}]}, "message 0: no 'role'; accepted: system, user, assistant"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "message 0: unknown role 'bot'"),
    ({"messages": [{"role": "user", "content": 3}]}, "message 0 (user): 'content' must be a string, got int"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  "}]},
     "message 1: empty assistant turn"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
])
def test_bad_conversations_are_errors_naming_file_and_line(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    write_jsonl(path, [good, row])
    with pytest.raises(DataError, match=f"{path}:2: ") as err:
        list(read_chat_jsonl(path))
    assert message in str(err.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl. does not exist"):
        list(read_chat_jsonl(tmp_path / "nope.jsonl"))


def test_loss_falls_exactly_on_response_tokens_and_fed_positions_are_the_generated_ones():
    # BOS=0; prompt [10, 11, 12] (12: the assistant marker), response [20, 21, 99] (99: the end marker), then a
    # second turn: prompt [13, 12], response [22, 99]
    seq = assemble([("prompt", [10, 11, 12]), ("response", [20, 21, 99]), ("prompt", [13, 12]),
                    ("response", [22, 99])], bos_id=0)
    assert seq.ids == [0, 10, 11, 12, 20, 21, 99, 13, 12, 22, 99]
    # the assistant marker predicts the first response token; the end marker predicts nothing
    assert seq.targets == [IGNORE, IGNORE, IGNORE, 20, 21, 99, IGNORE, IGNORE, 22, 99, IGNORE]
    assert seq.loss_tokens == 5
    # generated tokens are fed; the end marker and every prompt position are read plainly
    assert seq.fed == [False, False, False, False, True, True, False, False, False, True, False]


def test_every_target_is_the_next_token_and_no_prompt_token_is_learned():
    segments = [("prompt", [5, 6]), ("response", [7, 8, 9]), ("prompt", [6]), ("response", [1])]
    seq = assemble(segments, bos_id=None)
    response_positions = {2, 3, 4, 6}  # where 7, 8, 9 and 1 sit in ids [5, 6, 7, 8, 9, 6, 1]
    for t, target in enumerate(seq.targets):
        if t + 1 in response_positions:
            assert target == seq.ids[t + 1]
        else:
            assert target == IGNORE


def test_malformed_segments_are_refused():
    with pytest.raises(DataError, match="segment kind 'answer'"):
        assemble([("answer", [1])], bos_id=0)
    with pytest.raises(DataError, match="empty response segment"):
        assemble([("prompt", [1]), ("response", [])], bos_id=0)


def _check_worked_steps(text: str, start: int) -> int:
    """Every 'a op b = c.' step is right and continues from the previous result; returns the last result."""
    import re

    value = start
    for a, op, b, c in re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)\.", text):
        a, b, c = int(a), int(b), int(c)
        assert a == value
        assert c == {"+": a + b, "-": a - b, "*": a * b}[op] and c >= 0
        value = c
    return value


def test_the_synthetic_set_is_right_step_by_step_and_deterministic(tmp_path):
    import re

    from fullband.data.chat.arithmetic import arithmetic_chats, final_answer, write_chat_jsonl
    from fullband.data.chat.messages import check_messages

    chats = arithmetic_chats(300, seed=3)
    assert chats == arithmetic_chats(300, seed=3) and chats != arithmetic_chats(300, seed=4)
    two_turn = 0
    for i, chat in enumerate(chats):
        messages = check_messages(chat, f"conversation {i}")
        start = int(re.search(r"starts with (\d+)\.", messages[1].content).group(1))
        value = _check_worked_steps(messages[1].content, start)
        assert final_answer(messages[1].content) == str(value)
        assert f"Answer: {value}" not in messages[0].content  # the label is never in the question
        if len(messages) == 4:
            two_turn += 1
            value = _check_worked_steps(messages[3].content, value)  # the follow-up continues the first answer
            assert final_answer(messages[3].content) == str(value)
    assert 0.2 < two_turn / len(chats) < 0.4
    path = write_chat_jsonl(chats, tmp_path / "sft.jsonl")
    assert [[m.content for m in c] for c in read_chat_jsonl(path)] == [[m["content"] for m in c["messages"]]
                                                                       for c in chats]


def test_final_answer_reads_the_last_answer_line():
    from fullband.data.chat.arithmetic import final_answer

    assert final_answer("1 + 2 = 3. Answer: 3") == "3"
    assert final_answer("Answer: 4\nAnswer: 5\nmore text") == "5"
    assert final_answer("no answer here") is None
    assert final_answer("Answer: ") is None


def test_the_mixed_arithmetic_set_has_the_same_problems_at_three_lengths():
    from fullband.data.chat.arithmetic import STYLES, arithmetic_chats, final_answer
    from fullband.data.chat.sources import chat_conversations

    plain = arithmetic_chats(300, seed=4)
    assert plain == arithmetic_chats(300, seed=4, styles=("full",))  # the default set is unchanged
    mixed = arithmetic_chats(300, seed=4, styles=STYLES)
    lengths = {}
    for a, b in zip(plain, mixed):
        assert a["messages"][0] == b["messages"][0]  # the same question
        answer = b["messages"][1]["content"]
        assert final_answer(answer) == final_answer(a["messages"][1]["content"])
        style = "direct" if answer.startswith("Answer: ") else "full" if answer == a["messages"][1]["content"] \
            else "partial"
        lengths.setdefault(style, []).append(len(answer))
    mean = {s: sum(v) / len(v) for s, v in lengths.items()}
    assert set(mean) == set(STYLES) and mean["direct"] < mean["partial"] < mean["full"], mean
    assert min(len(v) for v in lengths.values()) > 60  # each style about a third
    assert sum(1 for _ in chat_conversations("arithmetic-mixed:50", "train", 2.0)) >= 45
    with pytest.raises(ValueError, match="accepted: a non-empty choice of full, partial, direct"):
        arithmetic_chats(2, styles=("short",))


def test_generate_replies_to_writes_the_model_s_own_replies_as_a_corpus_to_train_on(tmp_path, capsys):
    """`fullband generate --replies-to CHATS --out FILE`: each prompt (a conversation up to its last user turn) read
    with the model's template, its reply as `fullband.generate` gives it, written whole; the file is a corpus whose
    rows are conversations (data.corpus); bad arguments are refused before anything is written."""
    import torch

    from fullband import FullbandLM, ModelConfig
    from fullband.cli import main
    from fullband.decode.replies import reply_prompts
    from fullband.data.chat.templates import chat_prompt
    from fullband.data.corpus import Conversation, resolve_corpus
    from fullband.data.tokenizer import ByteTokenizer
    from fullband.decode.generate import generate

    torch.manual_seed(0)
    folder, tok = tmp_path / "model", ByteTokenizer(chat=True)
    model = FullbandLM(ModelConfig(vocab_size=263, d_model=32, n_layers=1, n_heads=2, max_seq_len=256,
                                   bos_token_id=256)).eval()
    model.save(folder, tokenizer=tok)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "5"}])))  # a reply after the last user turn is answered again
    out = tmp_path / "replies.jsonl"
    args = ["generate", "--checkpoint", str(folder), "--replies-to", str(chats), "--out", str(out), "--mode",
            "standard", "--max-new-tokens", "6", "--batch-size", "1", "--temperature", "1", "--seed", "3"]
    assert main(args) == 0
    assert f"wrote {out}: 2 conversations" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    prompts = reply_prompts(str(chats))
    assert [m.content for m in prompts[1]] == ["be brief", "2+2?"]
    for b, (row, prompt) in enumerate(zip(rows, prompts)):  # batch b samples with seed 3 + b
        ids = generate(model, [chat_prompt(tok, prompt)], 6, mode="standard", stop_tokens=list(tok.stop_ids),
                       temperature=1.0, seed=3 + b)[0]
        stopped = bool(ids) and ids[-1] in tok.stop_ids
        assert row["stopped"] == stopped and row["messages"][:-1] == [{"role": m.role, "content": m.content}
                                                                       for m in prompt]
        assert row["messages"][-1] == {"role": "assistant", "content": tok.decode(ids[:-1] if stopped else ids).strip()}
    docs = list(resolve_corpus(str(out), val_percent=0).documents("train"))
    assert len(docs) == 2 and all(isinstance(d, Conversation) for d in docs)
    before = out.read_text()
    for extra, said in ((["--overwrite", "--echo"], "--echo is for a --prompt's continuation"),
                        ([], "exists; pass --overwrite"),
                        (["--prompt", "x"], "needs one of --prompt TEXT")):
        assert main([*args, *extra]) == 2
        assert said in capsys.readouterr().err
    assert out.read_text() == before
    assert main(["generate", "--checkpoint", str(folder), "--replies-to", str(chats)]) == 2
    assert "--replies-to needs --out" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(folder), "--prompt", "x", "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "--out goes with --replies-to" in capsys.readouterr().err
    no_user = tmp_path / "no-user.jsonl"
    no_user.write_text(json.dumps({"messages": [{"role": "system", "content": "s"}]}) + "\n")
    assert main([*args[:4], str(no_user), "--out", str(tmp_path / "n.jsonl")]) == 2
    assert "no-user.jsonl:1: no user turn to reply to" in capsys.readouterr().err
    assert not (tmp_path / "n.jsonl").exists()
