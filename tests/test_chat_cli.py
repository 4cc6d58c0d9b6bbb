"""`fullband chat` in a real pseudo-terminal (prompt, streaming, summary line, /commands, Ctrl-C, Ctrl-D), and
ChatSession's turn bookkeeping against the exact SOFT reading of the whole conversation."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest
import torch

from fullband import FullbandLM, ModelConfig
from fullband.chat import ChatSession
from fullband.data.tokenizer import ByteTokenizer

SUMMARY = re.compile(rb"\[(\d+) tokens, ([^\]\r\n]+?), [\d.]+ tok/s, (end|length|interrupted|context)"
                     rb"(, conversation re-read)?\]")
# the child takes the pty as its controlling terminal (so ^C and ^D typed there reach it), then runs the CLI
# the terminal becomes the chat's controlling terminal, and SIGINT its default action: a test run started in the
# background (`cmd &` in a script) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
CTTY = ("import fcntl, os, signal, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
        "signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.executable, [sys.executable, '-m', 'fullband.cli', 'chat', *sys.argv[1:]])")
LONG_SEED = 124  # --temperature 1: this model's first answer to "hello" runs ~800 tokens before its end token


def new_model() -> FullbandLM:
    torch.manual_seed(0)
    return FullbandLM(ModelConfig(vocab_size=263, d_model=64, n_layers=2, n_heads=4, max_seq_len=1024,
                                  bos_token_id=256))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: more threads only contend with the CLI children (and run slower on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat") / "model"
    new_model().save(folder, tokenizer=ByteTokenizer(chat=True))
    return folder


@pytest.fixture(scope="module")
def readback_seed(checkpoint):
    """A sampling seed whose first 8-token answer reads back as the same ids. A random model mostly writes
    invalid UTF-8 and marker ids, which the rendered conversation does not reproduce, and then the next turn
    (rightly) reads the whole conversation again; keeping the cache needs an answer that round-trips."""
    model, tok = FullbandLM.load(checkpoint).eval(), ByteTokenizer(chat=True)
    for seed in range(300):
        s = ChatSession(model, tok, max_new_tokens=8, temperature=1.0, seed=seed)
        for text in ("hello", "again"):
            "".join(s.reply(text))
        if not s.last.reread:
            return seed
    pytest.fail("no seed in 0..299 gives an answer that reads back unchanged")


class Terminal:
    """`fullband chat ARGS` on a pseudo-terminal; every read has a deadline, so a hang fails the test."""

    def __init__(self, *args: str) -> None:
        self.fd, slave = pty.openpty()
        env = dict(os.environ, OMP_NUM_THREADS="1", TERM="dumb")
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", CTTY, *args], stdin=slave, stdout=slave,
                                         stderr=slave, env=env, start_new_session=True)
        finally:
            os.close(slave)
        self.buf, self.pos = b"", 0

    def _read(self, deadline: float, what: str) -> bool:
        ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"timed out waiting for {what}; output so far: {self.buf[-3000:]!r}")
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            data = b""
        self.buf += data
        return bool(data)

    def expect(self, pattern: bytes | re.Pattern, timeout: float = 60.0) -> re.Match:
        rx = re.compile(pattern, re.DOTALL) if isinstance(pattern, bytes) else pattern
        deadline = time.monotonic() + timeout
        while not (m := rx.search(self.buf, self.pos)):
            if not self._read(deadline, repr(rx.pattern)):
                raise AssertionError(f"the chat ended (rc={self.proc.poll()}) before {rx.pattern!r}; output: "
                                     f"{self.buf[-3000:]!r}")
        self.pos = m.end()
        return m

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def say(self, text: str) -> re.Match:
        """Type a message at the prompt -> the match of its answer's summary line."""
        self.send(text.encode() + b"\r")
        self.expect(b"assistant> ")
        summary = self.expect(SUMMARY)
        self.expect(b"you> ")
        return summary

    def exit_status(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while self._read(deadline, "the chat to exit"):
            pass
        return self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        os.close(self.fd)


@pytest.fixture
def chat(checkpoint):
    started = []

    def start(*args: str) -> Terminal:
        term = Terminal("--checkpoint", str(checkpoint), *args)
        started.append(term)
        term.expect(b"fullband chat: .*?you> ")
        return term

    yield start
    for term in started:
        term.close()


def test_chat_answers_and_keeps_the_conversation(chat, readback_seed):
    term = chat("--max-new-tokens", "8", "--temperature", "1", "--seed", str(readback_seed))
    first = term.say("hello")
    assert 1 <= int(first[1]) <= 8 and first[2] == b"soft" and first[4]  # the first turn is a prefill
    second = term.say("and then?")
    assert second[2] == b"soft" and second[3] in (b"end", b"length")
    assert second[4] is None, second[0]  # SOFT keeps its cache and state: only the new turn was read
    term.send(b"/exit\r")
    assert term.exit_status() == 0


def test_chat_commands(chat):
    term = chat("--max-new-tokens", "16")
    term.send(b"/mode fused:2\r")
    term.expect(rb"\(mode: fused k=2\)")
    term.expect(b"you> ")
    summary = term.say("hello")
    assert summary[2] == b"fused k=2" and summary[4], summary[0]  # FUSED reads the conversation again
    assert summary[3] in (b"end", b"length")
    term.send(b"/mode bogus\r")
    term.expect(rb"\(error: [^\r\n]*bogus")
    term.expect(b"you> ")
    assert term.proc.poll() is None
    term.send(b"/reset\r")
    term.expect(rb"\(new conversation\)")
    term.expect(b"you> ")
    term.send(b"/help\r")
    term.expect(b"commands: /mode")
    term.expect(b"you> ")
    assert term.say("again")[2] == b"fused k=2"  # the mode outlives /reset
    term.send(b"\x04")  # Ctrl-D at the prompt
    assert term.exit_status() == 0


def test_ctrl_c_stops_an_answer_and_keeps_the_session(chat):
    term = chat("--max-new-tokens", "900", "--temperature", "1", "--seed", str(LONG_SEED))
    term.send(b"hello\r")
    term.expect(b"assistant> ")
    term.expect(b".")  # the answer is streaming
    term.send(b"\x03")
    stopped = term.expect(SUMMARY)
    assert stopped[3] == b"interrupted", stopped[0]
    assert 0 < int(stopped[1]) < 900
    term.expect(b"you> ")
    summary = term.say("go on")  # the same process answers the next message
    assert summary[3] in (b"end", b"length") and summary[2] == b"soft"
    term.send(b"/exit\r")
    assert term.exit_status() == 0


def test_ctrl_c_at_any_point_of_an_answer_keeps_the_session(chat):
    term = chat("--max-new-tokens", "900", "--temperature", "1", "--seed", str(LONG_SEED))
    for delay, presses in ((0, 1), (0.001, 2), (0.01, 1), (0.05, 2), (0.2, 1)):  # in the prefill, mid-answer, twice
        term.send(b"hello\r")
        term.expect(b"assistant> ")
        time.sleep(delay)
        term.send(b"\x03" * presses)
        term.expect(SUMMARY)
        term.expect(b"you> ")
        time.sleep(0.3)  # a key typed before input() reads again is lost with the ^C (the terminal's own rule)
    term.send("/mode fused:\u00b2\r".encode())  # a Unicode digit: refused by name, the session goes on
    term.expect(rb"\(error: mode 'fused:\xc2\xb2' is not MODE or fused:K")
    term.expect(b"you> ")
    assert term.say("go on")[3] in (b"end", b"length", b"context")
    term.send(b"/exit\r")
    assert term.exit_status() == 0
    assert b"Traceback" not in term.buf


def test_ctrl_c_at_the_prompt_does_not_exit(chat):
    term = chat()
    # input() (no readline) misses a SIGINT that lands between writing "you> " and blocking in read(), until the
    # next key: a person is never that fast, a test can be. So wait a moment, and try again if it was missed.
    for _ in range(3):
        time.sleep(0.3)
        term.send(b"\x03")
        try:
            term.expect(b"you> ", timeout=5)
            break
        except AssertionError:
            assert term.proc.poll() is None, "Ctrl-C at the prompt ended the chat"
    else:
        pytest.fail(f"no new prompt after Ctrl-C: {term.buf[-500:]!r}")
    term.send(b"/exit\r")
    assert term.exit_status() == 0


class ReadBack(ByteTokenizer):
    """Bytes and marker ids as single characters, so that every answer reads back as the ids sampled (the random
    model's bytes are rarely valid UTF-8) and the session keeps its cache between turns."""

    def encode(self, text, *, bos=True, eos=False):
        return [self.bos_id] * bos + [ord(c) for c in text] + [self.eos_id] * eos

    def decode(self, ids, *, skip_special=True):
        return "".join(map(chr, ids))


def test_session_turns_equal_the_soft_reading_of_the_conversation():
    model = new_model().eval()
    session = ChatSession(model, ReadBack(chat=True), mode="soft", max_new_tokens=12)
    answers = []  # (first position, sampled ids, how many of them were fed)
    for text, reread in (("hello", True), ("tell me more", False)):
        "".join(session.reply(text))
        turn = session.last
        assert turn.reread is reread and turn.ids and turn.stopped in ("end", "length")
        fed = len(turn.ids) - (turn.stopped != "length")  # the end token is read with the next prompt
        start = len(session.read) - fed
        assert session.read[start:] == turn.ids[:fed]
        answers.append((start, turn.ids, fed))
    ids = session.read + session.last.ids[answers[-1][2]:]  # with the final unread token, if any
    plain = [True] * len(ids)
    for start, answer, fed in answers:
        assert ids[start:start + len(answer)] == answer
        plain[start:start + fed] = [False] * fed
    with torch.no_grad():
        out = model.recurrent_forward(torch.tensor([ids]), plain_mask=torch.tensor([plain]))
    predicted = out.logits[0].argmax(-1).tolist()
    for start, answer, _ in answers:
        assert predicted[start - 1:start - 1 + len(answer)] == answer


def test_a_conversation_read_fed_is_the_session_s_cache():
    """fed_chat_prompt + generate(fed=...) read a whole conversation as ChatSession read it turn by turn (SOFT,
    float64): the same keys and values at every position (replies fed, the first stopped by its length, the second
    by <|end|>, whose embedding here is that of a byte the model writes, scaled up to win where it would; prompts
    and end markers plain), so the same next reply; a plain read of the same ids differs."""
    from fullband import fed_chat_prompt
    from fullband.decode.generate import generate, prefill
    from fullband.errors import InputError
    from fullband.model.mode import DecodeMode

    model, tok = new_model().double().eval(), ReadBack(chat=True)
    with torch.no_grad():
        model.embed.weight[262] = model.embed.weight[110] * 1.01  # (tied head) <|end|> where 110 would be written
    session = ChatSession(model, tok, mode="soft")
    stopped = []
    for text, most in (("hello", 4), ("tell me more", 10), ("and then?", 10)):
        session.max_new_tokens = most
        "".join(session.reply(text))
        stopped.append(session.last.stopped)
    ids, spans = fed_chat_prompt(tok, session.messages[:-1])  # the conversation before the third reply
    assert session.last.reread is False and ids == session.read[:len(ids)]
    replies = [m.content for m in session.messages if m.role == "assistant"][:2]
    assert [ids[a:b] for a, b in spans] == [tok.encode(r, bos=False) for r in replies]
    assert stopped == ["length", "end", "end"] and [len(r) for r in replies] == [4, 5]  # all 4 fed; 5 and <|end|>
    fed = torch.zeros(1, len(ids), dtype=torch.bool)
    for a, b in spans:
        fed[0, a:b] = True
    n, mode, prompt = len(ids), DecodeMode("soft"), torch.tensor([ids])

    def gap(fed_mask):
        with torch.no_grad():
            state, _ = prefill(model, prompt, torch.tensor([n]), mode, room=1, fed=fed_mask)
        return max(float((a[:, :n] - b[:, :n]).abs().max())
                   for a, b in zip(state.cache.k + state.cache.v, session.state.cache.k + session.state.cache.v))

    assert gap(fed) < 1e-10 and gap(None) > 1e-3
    assert generate(model, [ids], 10, fed=[spans], stop_tokens=tok.stop_ids) == [session.last.ids]
    with pytest.raises(InputError, match="fed prompt positions are for mode 'soft'"):
        generate(model, [ids], 2, mode="fused", fed=[spans])
    with pytest.raises(InputError, match=r"fed\[0\]=\[\(5, 3\)\] is invalid"):
        generate(model, [ids], 2, fed=[[(5, 3)]])


def test_chat_on_a_folder_without_a_chat_template_is_one_line(tmp_path, capsys):
    """A base model (a byte vocabulary without chat markers, no template) asked to chat: one line, before any turn."""
    from conftest import tiny_model
    from fullband import ByteTokenizer
    from fullband.cli import main

    tiny_model().save(tmp_path / "base", tokenizer=ByteTokenizer())
    assert main(["chat", "--checkpoint", str(tmp_path / "base")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "neither a chat template nor fullband's chat markers" in err


@pytest.mark.parametrize("args, label", [
    (["--mode", "fused:2"], "fused k=2"),
    (["--mode", "fused", "--prefill-passes", "2"], "fused k=2"),  # the older spelling of fused:2
    (["--mode", "fused:2", "--prefill-passes", "2"], "fused k=2"),
    (["--mode", "fused:auto"], "fused auto tol=0.001"),
])
def test_chat_takes_every_spelling_of_a_mode(checkpoint, args, label, monkeypatch, capsys):
    from fullband.cli import main

    monkeypatch.setattr("builtins.input", lambda prompt: (_ for _ in ()).throw(EOFError))  # Ctrl-D at once
    assert main(["chat", "--checkpoint", str(checkpoint), *args]) == 0
    assert f"({label}); /help for commands" in capsys.readouterr().out


def test_chat_refuses_a_mode_and_prefill_passes_that_disagree(checkpoint, capsys):
    from fullband.cli import main

    assert main(["chat", "--checkpoint", str(checkpoint), "--mode", "fused:2", "--prefill-passes", "3"]) == 2
    assert capsys.readouterr().err == ("fullband chat: error: --mode fused:2 and --prefill-passes 3 disagree (fused:2 "
                                       "is --prefill-passes 2); accepted: one of them, e.g. --mode fused:2 alone\n")
