"""The transformers classes (FullbandConfig, FullbandForCausalLM) against the native model: logits, save /
from_pretrained through the Auto classes, HF `generate` in every feedback mode (greedy = fullband.generate token
for token, ragged left-padded batches, sampling, beam search with the fed-back state reordered with the beams),
and `fullband convert` both ways."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_model
from fullband import generate
from fullband.decode.score import score
from fullband.errors import CheckpointError, ConfigError, InputError
from fullband.model.objective import objective
from fullband.model.mode import DecodeMode

transformers = pytest.importorskip("transformers")
from fullband.hf import FeedbackCache, FullbandConfig, FullbandForCausalLM  # noqa: E402

MODES = ("standard", "soft", "fused", "exact")


@pytest.fixture(scope="module")
def pair():
    native = tiny_model(seed=4)
    return native, FullbandForCausalLM.from_native(native).eval()


def _left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def test_to_native_copies_float64_weights_bitwise():
    hf = FullbandForCausalLM.from_native(tiny_model(seed=4).double())
    with torch.no_grad():  # values float32 cannot hold
        for p in hf.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0), dtype=p.dtype))
    native = hf.to_native()
    a, b = hf.model.state_dict(), native.state_dict()
    assert next(native.parameters()).dtype == torch.float64 and all(torch.equal(a[k], b[k]) for k in a)


def test_forward_is_the_native_model_in_every_mode(pair):
    native, hf = pair
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, native(ids).logits)  # standard / soft: one pass
        assert torch.equal(hf(ids, feedback_mode="fused", prefill_passes=2).logits, native(ids, passes=3).logits)
        assert torch.equal(hf(ids, passes=4).logits, native(ids, passes=4).logits)
        exact = hf(ids, feedback_mode="exact", use_cache=False).logits
    assert torch.allclose(exact, native.recurrent_forward(ids).logits, atol=1e-6)
    # labels: transformers' shifted loss; with passes > 1 the multi-pass objective of the native model
    with torch.no_grad():
        loss = hf(ids, labels=ids).loss
        ref = torch.nn.functional.cross_entropy(native(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        assert torch.allclose(loss, ref, atol=1e-6)
        targets = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
        assert torch.allclose(hf(ids, labels=ids, passes=3).loss, objective(native, ids, targets, 3).loss)
        # passes beyond the sequence length repeat its fixed point: the same objective, without running them
        assert torch.allclose(hf(ids, labels=ids, passes=60).loss, objective(native, ids, targets, 60).loss)


def test_padded_rows_score_as_alone(pair):
    native, hf = pair
    prompts = [[256, 5, 6, 7, 8, 9], [256, 40, 41], [256, 3, 4, 5, 6, 7, 8, 9]]
    ids, mask = _left_pad(prompts)
    right = torch.tensor([p + [0] * (8 - len(p)) for p in prompts])
    with torch.no_grad():
        left_out = hf(ids, attention_mask=mask, feedback_mode="fused", prefill_passes=1).logits
        right_out = hf(right, attention_mask=(right != 0).long() | (torch.arange(8) == 0), feedback_mode="fused",
                       prefill_passes=1).logits
        for row, p in enumerate(prompts):
            alone = native(torch.tensor([p]), passes=2).logits[0]
            assert torch.allclose(left_out[row, 8 - len(p):], alone, atol=1e-5)
            assert torch.allclose(right_out[row, : len(p)], alone, atol=1e-5)
            assert left_out[row, : 8 - len(p)].abs().sum() == 0  # padding gets zero logits


def test_save_pretrained_round_trip_through_the_auto_classes(pair, tmp_path):
    native, hf = pair
    hf.save_pretrained(tmp_path / "m")
    data = json.loads((tmp_path / "m" / "config.json").read_text())
    assert data["model_type"] == "fullband" and data["d_model"] == 64 and data["feedback_mode"] == "soft"
    config = transformers.AutoConfig.from_pretrained(tmp_path / "m")
    assert isinstance(config, FullbandConfig) and config.to_model_config() == native.config
    assert config.hidden_size == 64 and config.num_hidden_layers == 2  # standard aliases
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert isinstance(loaded, FullbandForCausalLM)
    a, b = hf.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the RoPE tables are not in the file; from_pretrained must rebuild them
    assert torch.equal(loaded.model.rotary.cos, native.rotary.cos)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(ids, feedback_mode="fused").logits, hf(ids, feedback_mode="fused").logits)
    from fullband.hf.llama import dtype_kwarg

    bf16 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", **dtype_kwarg(torch.bfloat16))
    assert bf16.model.embed.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("mode", MODES)
def test_greedy_generate_equals_fullband_generate(pair, mode):
    native, hf = pair
    prompts = [[256, 5, 6, 7, 8, 9, 10], [256, 40, 41], [256, 3, 4, 5, 6]]
    ids, mask = _left_pad(prompts)
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                      feedback_mode=mode, prefill_passes=2)
    assert out[:, ids.shape[1]:].tolist() == generate(native, prompts, 10, mode=mode, prefill_passes=2)
    same = torch.tensor([prompts[0], [256, 9, 8, 7, 6, 5, 4]])
    out = hf.generate(same, max_new_tokens=10, min_new_tokens=10, do_sample=False, feedback_mode=mode,
                      prefill_passes=2)
    assert out[:, 7:].tolist() == generate(native, same.tolist(), 10, mode=mode, prefill_passes=2)


def test_config_default_mode_drives_generate(pair):
    native, hf = pair
    prompt = torch.tensor([[256, 11, 12, 13]])
    default = hf.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)[:, 4:]
    assert default.tolist() == generate(native, prompt.tolist(), 6)  # both default to soft, 1 prefill pass
    hf.config.feedback_mode, hf.config.prefill_passes = "fused", 3
    try:
        fused = hf.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)[:, 4:]
    finally:
        hf.config.feedback_mode, hf.config.prefill_passes = "soft", 1
    assert fused.tolist() == generate(native, prompt.tolist(), 6, mode="fused", prefill_passes=3)


def test_sampling_and_num_return_sequences(pair):
    native, hf = pair
    prompts = [[256, 5, 6, 7, 8], [256, 40, 41]]
    ids, mask = _left_pad(prompts)
    # top_k=1 sampling is greedy whatever the temperature: the sampled path sees the mode's logits
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=True, top_k=1,
                      temperature=1.7, num_return_sequences=2, feedback_mode="fused", prefill_passes=1)
    assert out.shape == (4, 5 + 8)
    greedy = generate(native, prompts, 8, mode="fused", prefill_passes=1)
    assert out[:, 5:].tolist() == [greedy[0], greedy[0], greedy[1], greedy[1]]
    torch.manual_seed(7)
    a = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, num_return_sequences=3)
    torch.manual_seed(7)
    b = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, num_return_sequences=3)
    assert a.shape[0] == 6 and torch.equal(a, b)
    assert len({tuple(r) for r in a[:, 5:].tolist()}) > 1  # sampling at temperature 1 varies


@pytest.mark.parametrize("mode", ["soft", "fused"])
def test_beam_search_carries_each_beams_state(pair, mode, monkeypatch):
    native, hf = pair
    prompt = [256, 5, 6, 7, 8, 9, 10]

    def beams():
        r = hf.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, num_beams=4,
                        num_return_sequences=4, do_sample=False, length_penalty=0.0, feedback_mode=mode,
                        prefill_passes=2, output_scores=True, return_dict_in_generate=True)
        seqs = r.sequences[:, len(prompt):].tolist()
        ref = [score(native, [prompt], [s], mode=mode, prefill_passes=2)[0][0] for s in seqs]
        return torch.tensor(ref, dtype=torch.float64), r.sequences_scores.double()

    # with length_penalty 0 a beam's score is its summed log-probability, which must be the teacher-forced
    # score of the same tokens decoded in the same mode
    ref, got = beams()
    assert torch.allclose(got, ref, atol=1e-4)
    # the check can fail: a cache that reorders keys and values but not the fed-back state
    keep = FeedbackCache.reorder_cache

    def kv_only(self, beam_idx):
        state = self.state
        keep(self, beam_idx)
        self.state = state

    monkeypatch.setattr(FeedbackCache, "reorder_cache", kv_only)
    ref, got = beams()
    assert not torch.allclose(got, ref, atol=1e-4)


def test_cache_select_and_repeat_move_the_state_with_the_rows(pair):
    native, hf = pair
    ids = torch.randint(0, 256, (3, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = hf(ids, use_cache=True, feedback_mode="soft")
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        state, k0 = cache.state.clone(), cache.kv.k[0].clone()
        cache.reorder_cache(torch.tensor([2, 0, 1]))
        assert torch.equal(cache.state, state[[2, 0, 1]]) and torch.equal(cache.kv.k[0], k0[[2, 0, 1]])
        cache.batch_repeat_interleave(2)
        assert cache.batch_size == 6 and torch.equal(cache.state, state[[2, 2, 0, 0, 1, 1]])
        cache.batch_select_indices(torch.tensor([0, 2, 4]))
        step = hf(torch.tensor([[7], [8], [9]]), cache=cache, feedback_mode="soft").logits[:, -1]
        plain = hf(torch.cat([ids[[2, 0, 1]], torch.tensor([[7], [8], [9]])], 1), feedback_mode="exact",
                   use_cache=False)
    # one cached soft step after a plain prompt = the recurrence with a plain prefix of 6, uncached
    ref = native.recurrent_forward(torch.cat([ids[[2, 0, 1]], torch.tensor([[7], [8], [9]])], 1),
                                   plain_prefix=6).logits[:, -1]
    assert torch.allclose(step, ref, atol=1e-5)
    assert plain.logits.shape == (3, 7, 259)
    with pytest.raises(InputError, match="cannot be cropped"):
        cache.crop(3)


def test_a_mode_spelled_fused_k_is_read_as_name_and_passes(pair):
    """DecodeMode.parse's spellings in the config and per call: "fused:2" is ("fused", 2), stored that way."""
    _, hf = pair
    cfg = FullbandConfig(feedback_mode="fused:2")
    assert (cfg.feedback_mode, cfg.prefill_passes) == ("fused", 2) and cfg.decode_mode() == DecodeMode("fused", 2)
    assert (FullbandConfig(feedback_mode="fused:auto").prefill_passes, cfg.decode_mode("fused:3").prefill_passes) == (
        "auto", 3)
    ids = torch.tensor([[256, 1, 2, 3]])
    assert torch.equal(hf(ids, feedback_mode="fused:2").logits, hf(ids, feedback_mode="fused", prefill_passes=2).logits)


def test_bad_input_is_named(pair):
    native, hf = pair
    ids = torch.tensor([[256, 1, 2]])
    with pytest.raises(ConfigError, match="feedback_mode='fussed'.*did you mean 'fused'"):
        hf(ids, feedback_mode="fussed")
    with pytest.raises(ConfigError, match="prefill_passes=-1"):
        hf(ids, prefill_passes=-1)
    with pytest.raises(InputError, match="inputs_embeds cannot be used"):
        hf(inputs_embeds=torch.zeros(1, 3, 64))
    with pytest.raises(InputError, match="continues only its own FeedbackCache; got DynamicCache"):
        hf(ids, cache=transformers.DynamicCache())
    with pytest.raises(InputError, match="use_cache=False.*feedback_mode='soft'"):
        hf.generate(ids, max_new_tokens=2, use_cache=False)
    assert hf.generate(ids, max_new_tokens=2, min_new_tokens=2, use_cache=False, do_sample=False,
                       feedback_mode="standard").tolist() == [ids[0].tolist() + generate(native, ids.tolist(), 2,
                                                                                       mode="standard")[0]]
    with pytest.raises(InputError, match="contiguous run of real tokens"):
        hf(ids, attention_mask=torch.tensor([[1, 0, 1]]))
    with pytest.raises(InputError, match="token id 300 is out of range"):
        hf(torch.tensor([[256, 300]]))
    with pytest.raises(ConfigError, match="d_model=65 is not divisible by n_heads=4"):
        FullbandConfig(d_model=65, n_heads=4)
    with pytest.raises(ConfigError, match="feedback_mode='greedy'"):
        FullbandConfig(feedback_mode="greedy")
    with pytest.raises(ConfigError, match="mode 'fused:2' and prefill_passes=3 disagree"):
        FullbandConfig(feedback_mode="fused:2", prefill_passes=3)
    none = FullbandForCausalLM.from_native(tiny_model(fusion="none"))
    with pytest.raises(InputError, match="needs feedback weights"):
        none(ids, feedback_mode="soft")
    assert none(ids, feedback_mode="standard").logits.shape == (1, 3, 259)


def test_a_path_that_is_not_a_transformers_folder_of_ours_is_named(pair, tmp_path):
    """transformers' own errors do not say what to do (a native folder: a size-mismatch report, or 'Unrecognized
    model'; a missing path: 'Repo id must be in the form ...'); from_pretrained names the path and the fix, in one
    line."""
    pair[0].save(tmp_path / "native")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    cases = {"native": r"is a native fullband folder.*`fullband convert \S*native OUT --to hf`",
             "missing": "does not exist; accepted: a transformers folder of ours", "notes.txt": "is a file",
             "empty": "has no readable config.json", "llama": "holds model_type='llama', not 'fullband'"}
    for load in (FullbandForCausalLM.from_pretrained, FullbandConfig.from_pretrained):
        for name, words in cases.items():
            with pytest.raises(CheckpointError, match=words) as err:
                load(tmp_path / name)
            assert "\n" not in str(err.value) and str(err.value).startswith(f"{load.__qualname__}: ")


# ---------------------------------------------------------------------- fullband convert
def test_convert_native_to_hf_and_back_is_bitwise(tmp_path):
    from fullband.cli import main
    from fullband.data.tokenizer import ByteTokenizer, load_tokenizer
    from fullband.model.decoder import FullbandLM

    native = tiny_model(seed=5)
    native.save(tmp_path / "native", tokenizer=ByteTokenizer())
    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "hf")]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids, feedback_mode="fused").logits, native(ids, passes=2).logits)
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back = FullbandLM.load(tmp_path / "back")
    a, b = native.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert isinstance(load_tokenizer(tmp_path / "back"), ByteTokenizer)
    # refusals: an existing destination, a same-format conversion
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        from fullband.hf.convert import convert

        convert(tmp_path / "native", tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "x"), "--to", "hf"]) == 2
    assert not (tmp_path / "x").exists()


def test_every_tool_reads_a_transformers_folder_as_its_native_model(tmp_path, capsys):
    """One loader: load_model, `fullband generate` and `fullband eval loss` take the folder `convert --to hf` writes
    (weights read without transformers, checked before allocation) as they take the native folder it came from."""
    from fullband import load_model
    from fullband.cli import main
    from fullband.data.tokenizer import ByteTokenizer, load_tokenizer
    from fullband.eval.commands import eval_loss

    native = tiny_model(seed=7)
    native.save(tmp_path / "native", tokenizer=ByteTokenizer())
    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "hf")]) == 0
    loaded = load_model(tmp_path / "hf")
    a, b = native.state_dict(), loaded.state_dict()
    assert type(loaded) is type(native) and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert isinstance(load_tokenizer(tmp_path / "hf"), ByteTokenizer)
    outputs = []
    for folder in ("native", "hf"):
        capsys.readouterr()
        assert main(["generate", "--checkpoint", str(tmp_path / folder), "--prompt", "def f(", "--mode", "fused",
                     "--max-new-tokens", "8", "--ignore-eos"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def f(x):\n    return x + 1\n" * 200)
    losses = [eval_loss(tmp_path / folder, max_prefill=1, exact=False, seq_len=8, windows=4, batch_size=4,
                        corpus=str(corpus), out=tmp_path / f"eval-{folder}", progress=False)
              for folder in ("native", "hf")]
    assert [r["nats_per_token"] for r in losses[0]["rows"]] == [r["nats_per_token"] for r in losses[1]["rows"]]


def test_convert_keeps_a_bpe_tokenizer_usable_by_autotokenizer(tmp_path):
    from fullband.data.tokenizer import load_tokenizer, train_bpe
    from fullband.hf.convert import convert

    texts = ["def f(x):\n    return x + 1\n" * 20, "import os\nprint(os.getcwd())\n" * 20]
    tok = train_bpe(texts, 300, show_progress=False)
    native = tiny_model(seed=6, vocab_size=300, bos_token_id=tok.bos_id)
    native.save(tmp_path / "native", tokenizer=tok)
    convert(tmp_path / "native", tmp_path / "hf")
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def g(y):\n    return os.getcwd()\n"
    assert auto(text, add_special_tokens=False)["input_ids"] == tok.encode(text, bos=False)
    assert auto.bos_token_id == tok.bos_id and auto.eos_token_id == tok.eos_id
    # left padding: a padded batch of prompts ends where each prompt ends, as generate continues it
    batch = auto(["x", "def f(x):"], padding=True, add_special_tokens=False)
    assert auto.padding_side == "left" and batch["attention_mask"][0][-1] == 1 and batch["attention_mask"][0][0] == 0
    convert(tmp_path / "hf", tmp_path / "back")
    assert load_tokenizer(tmp_path / "back").encode(text) == tok.encode(text)


def test_convert_a_llama_folder_into_the_hf_class(tmp_path):
    from test_hf import tiny_llama

    from fullband.hf.convert import convert

    llama = tiny_llama(False, seed=2)
    llama.save_pretrained(tmp_path / "llama")
    assert convert(tmp_path / "llama", tmp_path / "fb", to="hf") == ("llama", "hf")
    fb = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fb").eval()
    ids = torch.randint(2, 101, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (fb(ids, feedback_mode="standard").logits - llama(ids).logits).abs().max().item()
    assert diff <= 1e-4
    ref = llama.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    out = fb.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, feedback_mode="standard")
    assert torch.equal(out, ref)


def test_saved_folder_loads_without_fullband_through_trust_remote_code(pair, tmp_path):
    import os
    import subprocess
    import sys

    native, hf = pair
    hf.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_fullband.FullbandForCausalLM"
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(8))
    targets = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    ref = {"ids": ids, "logits": native(ids, passes=3).logits.detach(),
           "tokens": torch.tensor(generate(native, ids.tolist(), 6, mode="fused", prefill_passes=2)),
           "loss": objective(native, ids, targets, 3).loss.detach()}
    torch.save(ref, tmp_path / "ref.pt")
    reader = f"""
import sys
sys.modules["fullband"] = None  # a machine without fullband: any import of it fails
import torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(tmp_path / "m")!r}, trust_remote_code=True)
ref = torch.load({str(tmp_path / "ref.pt")!r})
assert type(m).__module__.startswith("transformers_modules"), type(m).__module__
with torch.no_grad():
    diff = (m(ref["ids"], feedback_mode="fused", prefill_passes=2).logits - ref["logits"]).abs().max().item()
out = m.generate(ref["ids"], max_new_tokens=6, min_new_tokens=6, do_sample=False, feedback_mode="fused",
                 prefill_passes=2)[:, 9:]
with torch.no_grad():
    loss = m(ref["ids"], labels=ref["ids"], passes=3).loss  # the training objective is shipped too
m.save_pretrained({str(tmp_path / "again")!r})  # the shipped code saves itself again
print("DIFF", diff, "SAME", torch.equal(out, ref["tokens"]), "LOSS", torch.allclose(loss, ref["loss"]))
"""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", reader], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "DIFF 0.0 SAME True LOSS True" in done.stdout
    shipped = sorted(p.name for p in (tmp_path / "m").glob("*.py"))
    assert shipped == sorted(p.name for p in (tmp_path / "again").glob("*.py")) and "modeling_fullband.py" in shipped
    for name in shipped:
        assert (tmp_path / "again" / name).read_text() == (tmp_path / "m" / name).read_text(), name


def test_shipped_modules_import_only_each_other():
    """Every shipped file is its module's source with its fullband imports made relative, each to a shipped file;
    a shipped module that imported anything else of fullband would be refused when saving, not stubbed out."""
    import ast

    from fullband.hf import remote

    files = remote.shipped_files()
    assert set(files) == {remote.file_name(m) for m in remote.SHIPPED}
    for name, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert f"{node.module}.py" in files, (name, node.module)
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            assert not any(n.split(".")[0] == "fullband" for n in names), (name, names)
    with pytest.raises(RuntimeError, match="imports 'fullband.files', which is not shipped"):
        remote.shipped_source("fullband.folder")


def test_cache_grows_past_its_first_allocation(pair):
    native, hf = pair
    prompt = [[256, 7, 8]]  # the cache starts with room for 3 + 64 positions, then doubles (up to max_seq_len 160)
    out = hf.generate(torch.tensor(prompt), max_new_tokens=150, min_new_tokens=150, do_sample=False,
                      feedback_mode="soft", return_dict_in_generate=True)
    cache = out.cache if "cache" in out else out.past_key_values
    assert cache.kv.max_len == 160 and int(cache.positions[0]) == 152
    assert out.sequences[:, 3:].tolist() == generate(native, prompt, 150, mode="soft")
    with pytest.raises(InputError, match="exceeds max_seq_len=160"):
        hf.generate(torch.tensor(prompt), max_new_tokens=170, min_new_tokens=170, do_sample=False)


def test_convert_gives_a_byte_model_a_transformers_tokenizer_with_the_same_ids(tmp_path):
    """vLLM and transformers read text for a byte-level model through the tokenizer convert writes."""
    from fullband.data.tokenizer import ByteTokenizer, load_tokenizer
    from fullband.hf.convert import convert

    tiny_model(seed=7).save(tmp_path / "native", tokenizer=ByteTokenizer())
    convert(tmp_path / "native", tmp_path / "hf")
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    byte = ByteTokenizer()
    for text in ["def f(x):\n    return x + 1\n", "naïve café — ☃ 🐍", " \t\r\n\x00\x7f\xa0 spaces  ", ""]:
        assert auto(text)["input_ids"] == byte.encode(text)  # BOS in front, as fullband encodes
        assert auto.decode(byte.encode(text, bos=False)) == text
    assert auto.decode([0xE2, 0x9C]) == "\ufffd"  # a cut character, replaced as ByteTokenizer does
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (256, 257, 258)
    convert(tmp_path / "hf", tmp_path / "back")
    assert isinstance(load_tokenizer(tmp_path / "back"), ByteTokenizer)
