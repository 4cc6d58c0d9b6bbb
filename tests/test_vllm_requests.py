"""The serving rules that need no vLLM: per-request modes and `fullband serve`'s checks (tests/test_vllm.py runs
the vLLM model itself, in .venv-vllm)."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from conftest import tiny_model

from fullband.cli import main
from fullband.model.mode import DecodeMode
from fullband.errors import FullbandError, InputError
from fullband.vllm.requests import (GENERATED, block_keys, fed_runs, http_request, request_mode,
                                    served_default)

SOFT = DecodeMode("soft")


def test_request_modes_over_the_folder_default():
    assert request_mode(None, SOFT) == DecodeMode("soft")
    assert request_mode({}, DecodeMode("fused", 3)) == DecodeMode("fused", 3)
    assert request_mode({"feedback_mode": "standard"}, DecodeMode("fused", 3)) == DecodeMode("standard")
    assert request_mode({"feedback_mode": "fused"}, DecodeMode("fused", 3)) == DecodeMode("fused", 3)
    assert request_mode({"feedback_mode": "fused"}, SOFT) == DecodeMode("fused", 1)
    assert request_mode({"feedback_mode": "fused", "prefill_passes": 0}, SOFT) == DecodeMode("fused", 0)
    assert request_mode({"prefill_passes": 4}, DecodeMode("fused", 1)) == DecodeMode("fused", 4)
    assert request_mode({"other_plugin_key": 1}, SOFT) == SOFT  # keys of others are left alone
    # every spelling DecodeMode.parse reads: fused:K, and the folder's default written that way
    assert request_mode({"feedback_mode": "fused:3"}, DecodeMode("fused", 1)) == DecodeMode("fused", 3)
    assert request_mode({"feedback_mode": "fused:2", "prefill_passes": 2}, SOFT) == DecodeMode("fused", 2)
    assert served_default("fused:2", 1, has_feedback=True) == DecodeMode("fused", 2)


@pytest.mark.parametrize("extra,message", [
    ({"feedback_mode": "bogus"}, "feedback_mode='bogus' is not a serving mode; accepted: standard, soft, fused"),
    ({"feedback_mode": "exact"}, "feedback_mode='exact' is not a serving mode"),
    ({"feedback_mode": 3}, "feedback_mode=3 is not a serving mode"),
    ({"feedback_mode": "fused", "prefill_passes": -1}, "prefill_passes=-1 is invalid; accepted: an integer >= 0"),
    ({"feedback_mode": "fused", "prefill_passes": 2.5}, "prefill_passes=2.5 must be an integer (got float)"),
    ({"feedback_mode": "fused", "prefill_passes": True}, "prefill_passes=True must be an integer (got bool)"),
    ({"feedback_mode": "fused", "prefill_passes": "auto"}, "prefill_passes='auto' is invalid"),
    ({"feedback_mode": "fused", "prefill_passes": 2000}, "prefill_passes=2000 is above the cap of max_seq_len=1024"),
    ({"feedback_mode": "fused:auto"}, "feedback_mode='fused:auto' is invalid (adaptive prefill is not served)"),
    ({"feedback_mode": "fused:2", "prefill_passes": 3}, "mode 'fused:2' and prefill_passes=3 disagree"),
    ({"feedback_mode": "soft:2"}, "mode 'soft:2': only fused takes prefill passes (fused:K)"),
    ({"prefill_passes": 2}, "applies to feedback_mode='fused' only (the request asks for 'soft')"),
    ({"feedback_mod": "fused"}, "unknown request key 'feedback_mod' (did you mean 'feedback_mode'?)"),
    ({"prefill_pass": 2}, "unknown request key 'prefill_pass' (did you mean 'prefill_passes'?)"),
])
def test_bad_request_modes_are_named(extra, message):
    with pytest.raises(InputError, match=re.escape(message)):
        request_mode(extra, SOFT, max_passes=1024)


def test_a_model_without_feedback_weights_serves_standard_only():
    assert served_default("soft", 1, has_feedback=False) == DecodeMode("standard")
    with pytest.raises(InputError, match="needs feedback weights; this model has fusion='none'"):
        request_mode({"feedback_mode": "soft"}, DecodeMode("standard"), has_feedback=False)
    with pytest.raises(InputError, match="prefill_passes='auto'"):
        served_default("fused", "auto", has_feedback=True)


def test_serve_refuses_a_native_folder_with_the_command_to_convert_it(tmp_path, model, capsys):
    model.save(tmp_path / "native")
    assert main(["serve", str(tmp_path / "native"), "--port", "8000"]) == 2
    err = capsys.readouterr().err
    assert "is a native folder" in err and f"fullband convert {tmp_path / 'native'} OUT --to hf" in err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_serve_without_vllm_says_how_to_install_it(tmp_path, model, capsys):
    from fullband.hf.modeling import FullbandForCausalLM

    FullbandForCausalLM.from_native(model).save_pretrained(tmp_path / "hf")
    assert main(["serve", str(tmp_path / "hf")]) == 2
    assert "vLLM is not installed here: pip install 'fullband[vllm]'" in capsys.readouterr().err


def test_serving_a_folder_without_a_chat_template_says_what_chat_requests_will_meet(tmp_path, model):
    from fullband import ByteTokenizer
    from fullband.hf.convert import convert
    from fullband.vllm.serve import chat_note

    for chat in (False, True):  # a chat vocabulary's markers need embedding rows: a model of 263 ids
        (tiny_model(vocab_size=263) if chat else model).save(tmp_path / f"native{chat}",
                                                              tokenizer=ByteTokenizer(chat=chat))
        convert(tmp_path / f"native{chat}", tmp_path / f"hf{chat}", to="hf")
    assert "has no chat template (a base model): instruction-tune it first" in chat_note(
        tmp_path / "hfFalse", ["--port", "8000"])
    assert chat_note(tmp_path / "hfFalse", ["--chat-template", "t.jinja"]) is None
    assert chat_note(tmp_path / "hfTrue", []) is None


def test_a_chat_request_to_a_base_folder_meets_our_sentence(tmp_path, model, monkeypatch):
    transformers = pytest.importorskip("transformers")
    import jinja2

    from fullband import ByteTokenizer
    from fullband.hf.convert import convert
    from fullband.vllm import serve

    model.save(tmp_path / "native", tokenizer=ByteTokenizer())
    convert(tmp_path / "native", tmp_path / "hf", to="hf")
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: object())  # as if vLLM were installed
    command = serve.server_command(tmp_path / "hf", ["--port", "8000"])
    template = command[command.index("--chat-template") + 1]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    with pytest.raises(jinja2.TemplateError, match="has no chat template .a base model.: instruction-tune it first"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template, tokenize=False)
    chat = tmp_path / "chat"
    tiny_model(vocab_size=263).save(chat / "native", tokenizer=ByteTokenizer(chat=True))
    convert(chat / "native", chat / "hf", to="hf")
    command = serve.server_command(chat / "hf", ["--port", "8000"])
    assert "--chat-template" not in command
    assert command[command.index("--middleware") + 1] == "fullband.vllm.chat.ServedRequests"  # checks, fed chats


def test_serve_sizes_the_cpu_kv_cache_to_the_memory_free(tmp_path, model, monkeypatch):
    from fullband.errors import ConfigError
    from fullband.hf.modeling import FullbandForCausalLM
    from fullband.vllm.serve import KV_OPTION, kv_cache_option

    FullbandForCausalLM.from_native(model).save_pretrained(tmp_path / "hf")
    cfg = model.config
    per_token = cfg.n_layers * 2 * cfg.n_kv_heads * (cfg.d_model // cfg.n_heads) * 4  # float32 keys and values
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    opts = ["--max-model-len", "64", "--max-num-seqs", "8"]
    mib = 2**20
    # room for 8 sequences of 64 tokens, rounded up to a MiB
    assert kv_cache_option(tmp_path / "hf", opts, cpu=True, available=2**34) == \
        [KV_OPTION, str(-(-per_token * 64 * 8 // mib) * mib)]
    # at most half of what is free
    big = ["--max-model-len", "64", "--max-num-seqs", "100000"]
    assert kv_cache_option(tmp_path / "hf", big, cpu=True, available=2**28) == [KV_OPTION, str(2**27)]
    # set already, or on a GPU: vLLM's own sizing
    assert kv_cache_option(tmp_path / "hf", [*opts, f"{KV_OPTION}=1000"], cpu=True, available=2**34) == []
    assert kv_cache_option(tmp_path / "hf", opts, cpu=False, available=2**34) == []
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert kv_cache_option(tmp_path / "hf", opts, cpu=True, available=2**34) == []
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    with pytest.raises(ConfigError, match=r"the KV cache of one 64-token sequence needs .* half the free memory"):
        kv_cache_option(tmp_path / "hf", opts, cpu=True, available=per_token * 64)


def test_a_cached_block_is_keyed_by_how_its_positions_were_read():
    """The prompt's read on the first block (plain for one pass, fused:K for 1 + K passes); which positions were
    fed (fed prompt spans, generated positions in a mode that feeds them) on every block that holds some: the same
    for the request that generated them and a later one that declares them fed, never for a plain read."""
    soft, standard, fused2, fused0 = SOFT, DecodeMode("standard"), DecodeMode("fused", 2), DecodeMode("fused", 0)
    assert [m.read(40).key for m in (soft, standard, fused2, fused0)] == ["plain", "plain", "fused:2", "plain"]
    gen = fed_runs(soft, None, 40)  # a SOFT request generating from position 40
    assert gen == ((40, GENERATED),) and fed_runs(standard, None, 40) == ()
    assert block_keys(soft, gen, 0, 32) == (("fullband-read", "plain"),)
    assert block_keys(soft, gen, 32, 64) == (("fullband-fed", ((8, 32),)),)
    assert block_keys(soft, gen, 64, 96) == (("fullband-fed", ((0, 32),)),)
    assert block_keys(soft, fed_runs(soft, None, 64), 32, 64) == ()  # all prompt: only the first block says its read
    assert block_keys(fused2, fed_runs(fused2, None, 10), 0, 32) == (("fullband-read", "fused:2"),
                                                                      ("fullband-fed", ((10, 32),)))
    # the next turn re-sends the 40-token prompt, a 30-token reply and 20 new tokens, the reply declared fed (flat,
    # as vllm_xargs carries it over HTTP): its blocks are the generating request's, a plain read's are not
    turn = fed_runs(soft, {"fed_spans": [40, 70]}, 90)
    assert turn == ((40, 70), (90, GENERATED))
    assert [block_keys(soft, turn, s, s + 32) for s in (0, 32)] == [block_keys(soft, gen, s, s + 32) for s in (0, 32)]
    assert block_keys(soft, turn, 64, 96) == (("fullband-fed", ((0, 6), (26, 32))),)
    assert block_keys(soft, fed_runs(soft, None, 90), 32, 64) == ()
    assert fed_runs(soft, {"fed_spans": [[1, 3], [3, 5], [80, 99]]}, 90) == ((1, 5), (80, GENERATED))  # merged


@pytest.mark.parametrize("extra,message", [
    ({"fed_spans": [3]}, "fed_spans=[3] is invalid"),
    ({"fed_spans": [[5, 3]]}, "fed_spans=[[5, 3]] is invalid at [5, 3]; accepted: a list of [start, end) pairs"),
    ({"fed_spans": [4, 9, 8, 12]}, "is invalid at [8, 12]"),  # overlapping
    ({"fed_spans": "1-3"}, "fed_spans='1-3' is invalid"),
    ({"fed_spans": [[1, 3]], "feedback_mode": "fused"}, "fed prompt positions are for mode 'soft'"),
    ({"fed_spans": [[1, 3]], "feedback_mode": "standard"}, "standard feeds nothing"),
    ({"fed_span": [1, 3]}, "did you mean 'fed_spans'?"),
])
def test_bad_fed_spans_are_refused_by_name(extra, message):
    with pytest.raises(InputError, match=re.escape(message)):
        request_mode(extra, SOFT)
    assert request_mode({"fed_spans": [[1, 3], [5, 9]]}, SOFT) == request_mode({"fed_spans": []}, SOFT) == SOFT


def test_a_request_asks_for_its_fed_states_by_a_key():
    assert request_mode({"fullband_states": "k1"}, SOFT) == SOFT
    assert request_mode({"feedback_mode": "fused", "fullband_states": "k1"}, SOFT) == DecodeMode("fused", 1)
    for extra, message in (({"fullband_states": ""}, "fullband_states='' is invalid"),
                           ({"fullband_states": 3}, "fullband_states=3 is invalid"),
                           ({"feedback_mode": "standard", "fullband_states": "k"}, "'standard', which feeds none")):
        with pytest.raises(InputError, match=re.escape(message)):
            request_mode(extra, SOFT)


def test_a_fed_states_key_is_admitted_only_where_this_process_issued_it():
    """The workers keep a keyed request's fed states until generate_with_states collects them, so the frontend
    admits only the keys it issued, and a server, which issues none, admits none: nothing outlives the request."""
    assert request_mode({"fullband_states": "k1"}, SOFT, issued={"k1"}) == SOFT
    assert request_mode({"fullband_states": "k1"}, SOFT) == SOFT  # the worker, the scheduler: admitted already
    for issued in ((), {"k2"}):
        with pytest.raises(InputError, match=re.escape("fullband_states='k1' was not set by "
                                                       "fullband.vllm.generate_with_states in this process")):
            request_mode({"fullband_states": "k1"}, SOFT, issued=issued)


def _body(**fields) -> bytes:
    return json.dumps(fields).encode()  # ensure_ascii: a lone surrogate travels as its \ud800 escape


def test_a_served_request_s_fed_spans_may_be_nested_and_are_written_flat_for_vllm():
    data, changed = http_request("/v1/completions", _body(prompt="x", vllm_xargs={"fed_spans": [[0, 2], [3, 5]]}),
                                 SOFT)
    assert changed and data == {"prompt": "x", "vllm_xargs": {"fed_spans": [0, 2, 3, 5]}}
    for xargs in ({"fed_spans": [0, 2]}, {"fed_spans": []}, {"feedback_mode": "soft"}, {"other_plugin_key": [[1]]}):
        assert http_request("/v1/completions", _body(vllm_xargs=xargs), SOFT) == ({"vllm_xargs": xargs}, False)
    assert http_request("/v1/completions", b"", SOFT) == (None, False)  # an empty body: vLLM answers it


@pytest.mark.parametrize("path,fields,message", [
    # vllm_xargs values vLLM's schema refuses with its own errors (or reads otherwise: true as 1)
    ("/v1/completions", {"vllm_xargs": {"fed_spans": {"a": 1}}}, "fed_spans={'a': 1} is invalid at 'a'; accepted: "
     "a list of [start, end) pairs"),
    ("/v1/completions", {"vllm_xargs": {"fed_spans": None}}, "fed_spans=None is invalid; accepted: a list of"),
    ("/v1/chat/completions", {"vllm_xargs": {"feedback_mode": None}}, "feedback_mode=None is not a serving mode"),
    ("/v1/completions", {"vllm_xargs": {"feedback_mode": "fused", "prefill_passes": True}},
     "prefill_passes=True must be an integer (got bool)"),
    ("/v1/responses", {"vllm_xargs": {"fullband_states": "abc"}}, "fullband_states='abc' was not set by "
     "fullband.vllm.generate_with_states in this process"),
    # messages, as chat data's are checked, on each path that renders them with the chat template
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]},
     "messages[1]: unknown role 'wizard'; accepted: system, user, assistant"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0]: unknown role 'tool'"),
    ("/v1/chat/completions/render", {"messages": [{"role": "user"}]},
     "messages[0] (user): 'content' must be a string, got NoneType"),
    ("/v1/chat/completions/batch", {"messages": [[{"role": "user", "content": "a"}], [{"role": "developer",
                                                                                       "content": "b"}]]},
     "messages[1][0]: unknown role 'developer'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0]: content part 0 is 'image_url'; accepted: text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": [{"type": "text", "text": "x"}]}]},
     "messages[0]: unknown role 'wizard'"),
    # text that is not Unicode, anywhere in the body
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "lone surrogate"),
    ("/v1/completions", {"prompt": "a\udc80", "stop": ["x"]}, "lone surrogate"),
])
def test_a_bad_served_request_meets_fullband_s_sentence(path, fields, message):
    with pytest.raises(FullbandError, match=re.escape(message)):
        http_request(path, _body(**fields), SOFT)


def test_a_served_conversation_may_hold_an_empty_reply_and_other_paths_keep_their_messages():
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
            {"role": "user", "content": "and?"}]
    assert http_request("/v1/chat/completions", _body(messages=chat), SOFT) == ({"messages": chat}, False)
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    assert http_request("/v1/chat/completions", _body(messages=parts), SOFT) == ({"messages": parts}, False)  # OpenAI's
    anthropic = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]  # vLLM's schema reads these
    assert http_request("/v1/messages", _body(messages=anthropic), SOFT) == ({"messages": anthropic}, False)
    with pytest.raises(InputError, match=re.escape("the request body is not UTF-8 text (invalid byte 0xff at byte "
                                                   "12); accepted: UTF-8")):
        http_request("/v1/completions", b'{"prompt": "\xff"}', SOFT)
