"""Chat vocabularies through transformers: a converted folder's tokenizer renders a conversation with
`apply_chat_template` to exactly fullband's chat prompt ids, and `AutoModelForCausalLM.generate` stops a turn at
the chat stop ids (EOS, <|end|>) where `fullband.generate` does, token for token in every decode mode; the public
helper `fullband.apply_chat_template` is the same prompt."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

import fullband
from fullband import ByteTokenizer, FullbandLM, ModelConfig, generate
from fullband.data.chat.templates import chat_prompt
from fullband.data.tokenizer import train_bpe

transformers = pytest.importorskip("transformers")
from fullband.hf.convert import convert  # noqa: E402

import fullband.hf  # noqa: E402, F401  (registers model_type "fullband" with the Auto classes)

ONE_TURN = [{"role": "user", "content": "What is 2 + 2?"}]
THREE = [{"role": "user", "content": "Ana has 3 pens."},
         {"role": "assistant", "content": "Noted: 3 pens."},
         {"role": "user", "content": "She gets 2 more. How many now?"}]
SYSTEM = [{"role": "system", "content": "Answer briefly."}, *ONE_TURN]
CONVERSATIONS = {"one_turn": ONE_TURN, "three": THREE, "system": SYSTEM}
MODES = (("soft", 1), ("standard", 1), ("fused", 2))
NEW = 40


def _model(vocab_size: int, bos: int, seed: int) -> FullbandLM:
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=vocab_size, d_model=64, n_layers=2, n_heads=4, max_seq_len=128,
                         bos_token_id=bos, init_std=0.1)
    return FullbandLM(config).eval()


def _bpe():
    """A small BPE trained on a few stdlib sources, with the chat markers."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(lib / name).read_text(encoding="utf-8") for name in ("textwrap.py", "shlex.py", "bisect.py")]
    return train_bpe(texts, 400, show_progress=False).with_chat_tokens()


@pytest.fixture(scope="module", params=["byte", "bpe"])
def converted(request, tmp_path_factory):
    """(native model, its tokenizer, the converted folder) for a byte and a BPE chat vocabulary."""
    tmp = tmp_path_factory.mktemp(f"chat_hf_{request.param}")
    tokenizer = ByteTokenizer(chat=True) if request.param == "byte" else _bpe()
    assert tokenizer.chat_ids
    native = _model(tokenizer.vocab_size, tokenizer.bos_id, seed=5)
    native.save(tmp / "native", tokenizer=tokenizer)
    convert(tmp / "native", tmp / "hf", to="hf")
    return native, tokenizer, tmp / "hf"


def test_byte_chat_vocabulary_ids():
    tok = ByteTokenizer(chat=True)
    assert tok.vocab_size == 263 and tok.stop_ids == (257, 262)
    assert chat_prompt(tok, ONE_TURN) == [256, 260, *ONE_TURN[0]["content"].encode(), 262, 261]


def test_converted_folder_declares_the_chat_stops(converted):
    _, tokenizer, hf_dir = converted
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["eos_token_id"] == list(tokenizer.stop_ids)
    assert len(tokenizer.stop_ids) == 2 and tokenizer.stop_ids[1] == tokenizer.chat_ids["<|end|>"]


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_auto_tokenizer_renders_fullbands_chat_prompt(converted, name):
    _, tokenizer, hf_dir = converted
    messages = CONVERSATIONS[name]
    auto = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert auto.chat_template
    ids = auto.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    expected = chat_prompt(tokenizer, messages)
    assert list(ids) == expected
    assert expected[0] == tokenizer.bos_id and expected[-1] == tokenizer.chat_ids["<|assistant|>"]
    # the rendered text, tokenised by the same tokenizer, is the same ids (the markers are special tokens)
    text = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert auto(text, add_special_tokens=False)["input_ids"] == expected


@pytest.mark.parametrize("mode,k", MODES)
def test_auto_model_generate_stops_a_turn_like_fullband_generate(converted, mode, k):
    native, tokenizer, hf_dir = converted
    auto = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert list(model.generation_config.eos_token_id) == list(tokenizer.stop_ids)
    stops = set(tokenizer.stop_ids)
    for messages in CONVERSATIONS.values():
        ids = auto.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        prompt = torch.tensor([list(ids)])
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                             feedback_mode=mode, prefill_passes=k, pad_token_id=tokenizer.pad_id)
        theirs = out[0, prompt.shape[1]:].tolist()
        ours = generate(native, [list(ids)], NEW, mode=mode, prefill_passes=k, stop_tokens=list(tokenizer.stop_ids))[0]
        assert theirs == ours
        # a generation ends at its first stop token (kept) or after NEW tokens, never later
        first = next((i for i, t in enumerate(ours) if t in stops), None)
        assert len(ours) == (NEW if first is None else first + 1)


def test_some_turns_end_at_a_stop_token(converted):
    """The comparison above means something only if turns do end early: with this seed some of them stop at a
    chat stop id before NEW tokens, in both vocabularies."""
    native, tokenizer, _ = converted
    early = []
    for mode, k in MODES:
        for messages in CONVERSATIONS.values():
            out = generate(native, [chat_prompt(tokenizer, messages)], NEW, mode=mode, prefill_passes=k,
                           stop_tokens=list(tokenizer.stop_ids))[0]
            if len(out) < NEW:
                assert out[-1] in tokenizer.stop_ids
                early.append((mode, len(out)))
    assert early


def test_public_apply_chat_template_then_generate(converted):
    native, tokenizer, _ = converted
    assert "apply_chat_template" in fullband.__all__
    assert fullband.apply_chat_template is chat_prompt
    for messages in CONVERSATIONS.values():
        ids = fullband.apply_chat_template(tokenizer, messages)
        assert ids == chat_prompt(tokenizer, messages)
        out = fullband.generate(native, [ids], NEW, stop_tokens=tokenizer.stop_ids)[0]
        stopped = [i for i, t in enumerate(out) if t in tokenizer.stop_ids]
        assert stopped in ([], [len(out) - 1]) and (stopped or len(out) == NEW)  # ends at its first stop, if any


def test_public_apply_chat_template_needs_a_chat_vocabulary():
    with pytest.raises(fullband.FullbandError, match="chat markers"):
        fullband.apply_chat_template(ByteTokenizer(), ONE_TURN)
