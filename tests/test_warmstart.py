"""Latent feedback added to a pretrained model (issue 34): the warm-start options (the fusion's initialisation, the
blend curriculum, training a part of the model and its memory), a micro warm start from a tiny random Llama that
resumes bit for bit after SIGKILL, and `fullband reproduce warmstart --scale micro` end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fullband.errors import ConfigError, InputError
from fullband.model.decoder import FullbandLM
from fullband.train.config import load_run_config
from fullband.train.schedule import blend_weight

from conftest import assert_resume_is_bitwise, losses, random_ids, tiny_config, tiny_model, write_config


# ---------------------------------------------------------------------- the fusion's initialisation
def test_identity_initialisation_feeds_the_normalised_previous_state_at_step_0():
    """fusion_init = "identity" with fusion_gate_scale = 0: W_U = I and every gate sigmoid(0) = 1/2, so a fed
    position's input is norm_in(h / 2) = norm_in(h) whatever the token."""
    model = tiny_model(fusion_init="identity", fusion_gate_scale=0.0)
    assert torch.equal(model.fusion.w_u.weight, torch.eye(model.config.d_model))
    assert torch.equal(model.fusion.w_g.weight, torch.zeros_like(model.fusion.w_g.weight))
    e = model.embed_inputs(random_ids(2, 6))
    h = torch.randn(2, 6, model.config.d_model)
    torch.testing.assert_close(model.fuse(e, h), model.norm_in(h / 2), rtol=0, atol=1e-6)


def test_gate_scale_scales_the_gate_start_and_nothing_else():
    a, b = tiny_model(seed=3), tiny_model(seed=3, fusion_gate_scale=0.25)
    assert torch.equal(b.fusion.w_g.weight, a.fusion.w_g.weight * 0.25)
    assert torch.equal(b.fusion.w_u.weight, a.fusion.w_u.weight)
    identity = tiny_model(fusion="additive", fusion_init="identity")
    assert torch.equal(identity.fusion.w_h.weight, torch.eye(identity.config.d_model))


@pytest.mark.parametrize("changes, message", [
    ({"fusion_init": "eye"}, "fusion_init='eye' is invalid; accepted: random, identity"),
    ({"fusion": "concat", "fusion_init": "identity"}, "fusion 'gated' (W_U) or 'additive' (W) has one"),
    ({"fusion_gate_scale": -1.0}, "fusion_gate_scale=-1.0 is invalid"),
    ({"fusion": "additive", "fusion_gate_scale": 2.0}, "scales the gate of fusion 'gated'"),
])
def test_initialisation_options_are_validated(changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tiny_config(**changes)


# ---------------------------------------------------------------------- the blend curriculum
def test_blend_weight_rises_from_0_to_1_and_stays():
    assert [blend_weight(s, 10, 0.5) for s in range(7)] == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0]
    assert blend_weight(0, 10, 0.0) == 1.0  # off: the paper's input from the first step


def test_blended_input_is_the_lerp_of_plain_and_fused_and_is_restored():
    model = tiny_model().eval()
    x = random_ids(2, 9)
    with torch.no_grad():
        plain = model(x, passes=1).logits
        fused = model(x, passes=2).logits
        with model.blended(0.0):
            assert torch.equal(model(x, passes=2).logits, plain)  # a = 0: every pass is the plain model
        with model.blended(1.0):
            assert torch.equal(model(x, passes=2).logits, fused)
        e = model.embed_inputs(x)
        h = torch.randn_like(e)
        with model.blended(0.3):
            got = model.pass_inputs(e, h, None)
        assert torch.equal(got, torch.lerp(e, model.fuse(e, h), 0.3))
    assert model.feed_blend == 1.0 and torch.equal(model(x, passes=2).logits, fused)
    with pytest.raises(InputError, match="blend weight=1.5 is invalid"):
        with model.blended(1.5):
            pass


def test_blend_until_is_validated(tmp_path, corpus, cache):
    path = write_config(tmp_path, corpus, cache)
    with pytest.raises(ConfigError, match="0 <= train.blend_until < 1"):
        load_run_config(path, ["train.blend_until=1.0"])
    with pytest.raises(ConfigError, match="never feeds a state"):
        load_run_config(path, ["train.blend_until=0.5", 'train.passes="none"'])


def test_a_blended_run_starts_at_the_plain_model_logs_its_weight_and_resumes_bitwise(tmp_path, corpus, cache,
                                                                                     monkeypatch):
    """Step 1 of a blended run (a = 0) reads every pass plainly: its pass losses are equal; a is logged and rises
    to 1 at blend_until x steps; a resume equals the uninterrupted run bit for bit."""
    sets = dict(steps=10, ckpt_every=3, passes='"three-pass"')
    whole, part = (write_config(tmp_path, corpus, cache, name, **sets) for name in ("whole", "part"))
    for path in (whole, part):
        path.write_text(path.read_text().replace("[train]\n", "[train]\nblend_until = 0.5\n"))
    assert_resume_is_bitwise(whole, part, monkeypatch, stop_before=7, last="step_000010")
    rows = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss_pass" in r]
    assert [r["blend"] for r in steps] == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert len(set(steps[0]["loss_pass"])) == 1 and len(set(steps[-1]["loss_pass"])) > 1
    from fullband.train.rundir import MUST_MATCH

    assert "train.blend_until" in MUST_MATCH


# ---------------------------------------------------------------------- a part trained, and its memory
def test_memory_counts_gradients_and_optimizer_state_of_the_trained_weights_only(tmp_path, corpus, cache):
    from fullband.train.build import trained_weights
    from fullband.train.trainer import step_estimate

    path = write_config(tmp_path, corpus, cache)
    everything = load_run_config(path)
    part = load_run_config(path, ['train.trainable=["fusion.*", "norm_in.*"]'])
    model = FullbandLM(part.model)
    expected = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("fusion.", "norm_in.")))
    assert trained_weights(part) == expected and trained_weights(everything) is None
    a, b = step_estimate(everything, torch.device("cpu")), step_estimate(part, torch.device("cpu"))
    assert b.gradients == 4 * expected and b.optimizer == 4 * 2 * expected
    assert b.weights == a.weights and b.activations == a.activations and b.total < a.total


# ---------------------------------------------------------------------- a micro warm start from a tiny Llama
@pytest.fixture(scope="module")
def tiny_llama(smollm2_gguf, tmp_path_factory):
    """A tiny random Llama (2 blocks, D 64) with SmolLM2's tokenizer and chat template, as a transformers folder,
    and a small real-text corpus (pydoc_data's prose)."""
    import transformers
    from pydoc_data.topics import topics

    root = tmp_path_factory.mktemp("tiny-llama")
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, tie_word_embeddings=True,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    llama = transformers.LlamaForCausalLM(cfg)
    llama.save_pretrained(root / "llama")
    tok.save_pretrained(root / "llama")
    write_gguf(llama, smollm2_gguf, root / "llama.gguf")
    text = root / "prose"
    text.mkdir()
    for i, name in enumerate(sorted(topics)[:24]):
        (text / f"{i:02d}.txt").write_text(topics[name][:3000])
    return root


def write_gguf(llama, shipped: Path, out: Path) -> Path:
    """`llama` (a LlamaForCausalLM) as an F32 GGUF file in llama.cpp's layout (its tensor names, q and k rows
    permuted as llama.cpp's converter permutes them), with the shipped file's tokenizer fields."""
    import gguf
    import numpy as np

    c = llama.config
    w = gguf.GGUFWriter(str(out), "llama")
    for key, value in (("block_count", c.num_hidden_layers), ("context_length", c.max_position_embeddings),
                       ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                       ("attention.head_count", c.num_attention_heads),
                       ("attention.head_count_kv", c.num_key_value_heads), ("vocab_size", c.vocab_size)):
        w.add_uint32(f"llama.{key}", value)
    rope = getattr(c, "rope_parameters", None) or {"rope_theta": c.rope_theta}
    w.add_float32("llama.rope.freq_base", float(rope["rope_theta"]))
    w.add_float32("llama.attention.layer_norm_rms_epsilon", float(c.rms_norm_eps))
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    for key, field in gguf.GGUFReader(str(shipped)).fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)

    def permute(t, heads):  # llama.cpp's rotary layout of q / k rows
        return t.reshape(heads, 2, t.shape[0] // heads // 2, t.shape[1]).swapaxes(1, 2).reshape(t.shape)

    names = {"self_attn.o_proj": "attn_output", "self_attn.v_proj": "attn_v", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    state = {k: v.detach().float().numpy() for k, v in llama.state_dict().items()}
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", state["model.norm.weight"])
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", np.ascontiguousarray(
            permute(state[pre + "self_attn.q_proj.weight"], c.num_attention_heads)))
        w.add_tensor(f"blk.{i}.attn_k.weight", np.ascontiguousarray(
            permute(state[pre + "self_attn.k_proj.weight"], c.num_key_value_heads)))
        for hf, cpp in names.items():
            w.add_tensor(f"blk.{i}.{cpp}.weight", state[pre + hf + ".weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_the_gguf_file_and_the_transformers_folder_warm_start_the_same_model(tiny_llama, tmp_path):
    """train.init_from takes the tiny Llama as a GGUF file or as a transformers folder: the same weights (STANDARD
    logits equal transformers' own Llama), the same tokenizer, and a warm-start step from either."""
    import transformers

    from fullband.train.trainer import train

    x = torch.tensor([[1, 520, 4042, 30, 2817, 8, 99]])
    with torch.no_grad():
        reference = transformers.LlamaForCausalLM.from_pretrained(tiny_llama / "llama")(x).logits
    for source in ("llama", "llama.gguf"):
        sets = _warm(tiny_llama, f"from-{source}", **{"train.init_from": f'"{tiny_llama / source}"',
                                                      "train.steps": 1, "log.ckpt_every": 1,
                                                      "log.run_dir": f'"{tmp_path / source}"'})
        result = train(load_run_config("configs/warmstart-smollm2.toml", sets))
        assert result["steps"] == 1
        from fullband.train.build import llama_model_config, warm_start

        model = FullbandLM(llama_model_config(load_run_config("configs/warmstart-smollm2.toml", sets)))
        assert "fusion.w_u.weight" in warm_start(model, str(tiny_llama / source))["fresh"]
        with torch.no_grad():
            assert (model.eval()(x).logits - reference).abs().max() < 1e-4, source
        from fullband import load_tokenizer

        tok = load_tokenizer(tmp_path / source / "step_000001")
        assert tok.vocab_size == 49152 and tok.stop_ids == (2,) and tok.chat_template


def test_a_conversion_is_reproducible_and_leaves_the_caller_s_random_stream(tiny_llama, tmp_path):
    """`fullband convert` of the same Llama twice: the same files, byte for byte (the fusion weights no Llama has are
    drawn from a fixed seed, not from whatever the process's random stream held), and the caller's stream untouched."""
    from fullband.hf.convert import convert

    for name in ("a", "b"):
        torch.manual_seed(len(name) * 7 + ord(name))  # a different stream at each conversion
        state = torch.get_rng_state()
        convert(tiny_llama / "llama.gguf", tmp_path / name)
        assert torch.equal(torch.get_rng_state(), state)
    for file in sorted(p.name for p in (tmp_path / "a").iterdir()):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file


def _warm(root: Path, name: str, **sets) -> list[str]:
    values = {"train.init_from": f'"{root / "llama"}"', "log.run_dir": f'"{root / name}"', "train.steps": 12,
              "train.seq_len": 32, "train.global_batch_tokens": 64, "train.micro_batch": 2,
              "train.warmup_steps": 1, "train.blend_until": 0.5, "train.passes": '"two-pass"',
              "train.trainable": '["fusion.*", "norm_in.*", "blocks.0.*"]', "optim.feedback_lr_mult": 10,
              "data.corpus": f'"{root / "prose"}"', "data.val_percent": 20, "data.cache_dir": f'"{root / "cache"}"',
              "log.eval_every": 0, "log.eval_windows": 2, "log.ckpt_every": 2, "log.keep_last": 2,
              "log.progress": "false", "model.fusion_init": '"identity"', **sets}
    return [f"{k}={v}" for k, v in values.items()]


def _cli(root: Path, name: str, *more: str) -> subprocess.Popen:
    sets = [arg for s in _warm(root, name, **{"train.block_match": 5.0}) for arg in ("--set", s)]
    return subprocess.Popen([sys.executable, "-m", "fullband.cli", "train", "configs/warmstart-smollm2.toml", *sets,
                             *more], env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_micro_warm_start_trains_a_part_and_resumes_bit_for_bit_after_sigkill(tiny_llama):
    """The warm-start recipe on a tiny Llama (a part trained, the blend, the identity start, the block match): frozen
    weights are bitwise the Llama's after training; a run killed after its second checkpoint and resumed equals the
    uninterrupted run bit for bit."""
    from safetensors.torch import load_file

    ref = _cli(tiny_llama, "whole")
    victim = _cli(tiny_llama, "part")
    deadline = time.time() + 120
    while not (tiny_llama / "part" / "step_000004").exists():
        assert victim.poll() is None and time.time() < deadline, victim.stderr.read() if victim.poll() else "timeout"
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not (tiny_llama / "part" / "step_000012").exists(), "the victim finished before it was killed"
    resumed = _cli(tiny_llama, "part", "--resume", str(tiny_llama / "part"))
    out, err = resumed.communicate(timeout=200)
    assert resumed.returncode == 0, err
    assert "resumed from" in out
    out, err = ref.communicate(timeout=200)
    assert ref.returncode == 0, err
    assert "training" in out and "weights (train.trainable" in out
    assert losses(tiny_llama / "part") == losses(tiny_llama / "whole")
    rows = [json.loads(line) for line in (tiny_llama / "part" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["block_match"] > 0 for r in rows if "loss_pass" in r and 2 <= r["step"] <= 6)  # blend, weight > 0
    a = load_file(str(tiny_llama / "whole" / "step_000012" / "model.safetensors"))
    b = load_file(str(tiny_llama / "part" / "step_000012" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    llama = load_file(str(tiny_llama / "llama" / "model.safetensors"))
    assert torch.equal(a["blocks.1.mlp.w_down.weight"], llama["model.layers.1.mlp.down_proj.weight"])  # frozen
    assert not torch.equal(a["blocks.0.mlp.w_down.weight"], llama["model.layers.0.mlp.down_proj.weight"])  # trained
    assert not torch.equal(a["fusion.w_u.weight"], torch.eye(64))


def test_reproduce_warmstart_micro_writes_the_report_and_a_rerun_reuses_every_run(tiny_llama, tmp_path, capsys):
    from fullband.reproduce import reproduce, warmstart

    extra = [f'data.corpus="{tiny_llama / "prose"}"', "data.val_percent=20",
             f'data.cache_dir="{tiny_llama / "cache"}"', "log.progress=false"]
    out = reproduce("warmstart", root=tmp_path / "runs", docs=tmp_path / "docs", scale="micro", seeds=1,
                    model=str(tiny_llama / "llama"), extra=extra)
    text = out.read_text()
    assert out.name == "warmstart-micro.md"
    for part in ("## Held-out loss by mode", "| feedback-only-blend |", "| everything-blend-distill |",
                 "| everything-blend-identity |", "- self-distillation (every weight, the blend): FUSED k=1 - STANDARD",
                 "| everything-blend-anchor |", "- the anchor (every weight, the blend): FUSED k=1 - STANDARD",
                 "| everything-blend-match |", "- the block match (every weight, the blend): FUSED k=1 - STANDARD",
                 "| everything-blend-additive |",
                 "- the additive fusion in place of the gate (every weight, the blend)",
                 "the difference of the gaps, paired by window, ", "| continued-2x |",
                 "SOFT-like (exact)",
                 "## Chat kept?", "## Does the warm-started pass map contract?", "## Outcome", "curves.png",
                 "fullband train configs/warmstart-smollm2.toml"):
        assert part in text, part
    assert (tmp_path / "docs" / "warmstart-micro" / "curves.png").is_file()
    first = capsys.readouterr().out
    assert first.count("== training ") == 12
    again = reproduce("warmstart", root=tmp_path / "runs", docs=tmp_path / "docs", scale="micro", seeds=1,
                      model=str(tiny_llama / "llama"), extra=extra)
    assert "== training " not in capsys.readouterr().out  # every run reused, every evaluation cached
    body = lambda t: t.split("\n", 4)[4]  # noqa: E731 (the header states this invocation's wall time)
    assert body(again.read_text()) == body(text)


def test_reproduce_warmstart_options_are_checked_before_anything_is_written(tmp_path):
    from fullband.cli import main

    with pytest.raises(InputError, match="--scale 'huge' is unknown"):
        from fullband.reproduce import reproduce

        reproduce("warmstart", root=tmp_path / "r", docs=tmp_path / "d", scale="huge")
    assert not (tmp_path / "r").exists() and not (tmp_path / "d").exists()
    assert main(["reproduce", "stability", "--model", "x.gguf", "--root", str(tmp_path / "r")]) != 0
    assert main(["reproduce", "warmstart", "--cooldown", "300", "--root", str(tmp_path / "r")]) != 0
    assert main(["reproduce", "warmstart", "--model", str(tmp_path / "none"), "--root", str(tmp_path / "r"),
                 "--docs", str(tmp_path / "d")]) != 0
    assert not (tmp_path / "r").exists() and not (tmp_path / "d").exists()


def test_reproduce_warmstart_long_extends_its_curve_invocation_by_invocation(tiny_llama, tmp_path, capsys):
    """Each invocation trains at most --budget minutes (here: one step), reports the curve so far and the latest
    checkpoint by mode; the next resumes the run and extends the curve; a larger budget finishes it."""
    from fullband.reproduce import reproduce, warmstart

    extra = [f'data.corpus="{tiny_llama / "prose"}"', "data.val_percent=20",
             f'data.cache_dir="{tiny_llama / "cache"}"', "log.progress=false"]
    args = dict(root=tmp_path / "runs", docs=tmp_path / "docs", scale="micro", seeds=1,
                model=str(tiny_llama / "llama"), extra=extra)
    for _ in range(2):
        text = reproduce("warmstart-long", budget=1e-9, **args).read_text()
    assert "**Trained so far: step 2 of 8 (128 tokens" in text
    assert "| 2 | 128 |" in text and "| 4 |" not in text  # the evaluation at step 2, the second invocation's
    assert "## The latest checkpoint by mode (128 tokens)" in text and "- Goal (both fed reads within 0.05" in text
    assert "stopped after step 2 of 8: train.stop_after_minutes=1e-09 passed" in capsys.readouterr().out
    text = reproduce("warmstart-long", budget=60, **args).read_text()
    assert "**Finished: 8 steps, 512 tokens.**" in text and "| 8 | 512 |" in text and "| 6 | 384 |" in text
    assert "FUSED k=1 - STANDARD went from " in text and "## Chat kept?" in text
    assert (tmp_path / "docs" / "warmstart-long-micro" / "gap.png").is_file()
    # the report's held-out chats read at every evaluation (log.eval_chats): the curve's two chat columns
    import json

    runs = tmp_path / "runs" / "warmstart-long-micro"
    rows = [json.loads(line) for line in (runs / "everything-blend-match" / "metrics.jsonl").read_text().splitlines()]
    chats = [r["eval_chats"] for r in rows if "eval" in r]
    assert len(chats) == 4 and all(set(c) == {"1", "2", "3"} for c in chats)
    assert f"| 8 | 512 | " in text and f" | {chats[-1]['1']:.4f} | {chats[-1]['2'] - chats[-1]['1']:+.3f} |" in text
    assert "## Chat at every evaluation" in text and "- Over the last 4 evaluation(s) (tokens 128 to 512)" in text
    assert (tmp_path / "docs" / "warmstart-long-micro" / "chat.png").is_file()
    held = [json.loads(line) for line in (runs / "held-out-chats.jsonl").read_text().splitlines()]
    assert held == warmstart.held_out_chats(2)
    # at step 2 the blend (to step 4) left no room for a cooled branch; at step 8 one cools down over 2 more steps
    assert "## The latest checkpoint by mode (512 tokens), and cooled (640 tokens)" in text
    assert "| cooled | 640 |" in text and "- Goal (both fed reads within 0.05 of STANDARD), cooled: " in text
    assert "| cooled | SOFT |" in text and "The cooled branch: its directory starts as a copy" in text
    # the branch resumed from the long run's step 8 equals its recipe trained from scratch, bit for bit
    from safetensors.torch import load_file

    from fullband.reproduce import warmstart_long as long
    from fullband.reproduce.runner import Settings, train_run

    branch = runs / "everything-blend-match-cooled-8"
    sets = long.branch_settings(runs / "everything-blend-match" / "step_000008", 2)["sets"]
    assert sets[:3] == ["train.steps=10", "train.cooldown_fraction=0.2", "train.stop_after_minutes=0.0"]
    scratch, _ = train_run(tmp_path / "scratch", long.runs()[0], Settings(extra=tuple(extra)),
                           [*long._overrides(long.SCALES["micro"], str(tiny_llama / "llama"), 60), *sets])
    assert scratch.name == "step_000010" and (branch / "step_000010").is_dir()
    mine, theirs = (load_file(str(c / "step_000010" / "model.safetensors")) for c in (branch, scratch.parent))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert (runs / "everything-blend-match" / "step_000008" / "model.safetensors").is_file()
    assert json.loads((branch / "run.json").read_text())["log"]["run_dir"] == str(branch)  # its own folder
    # --budget 0 trains nothing more; --cooldown cools over another length, on a branch of its own
    text = reproduce("warmstart-long", budget=0, cooldown=3, **args).read_text()
    assert "continued for 3 more steps" in text and "| cooled | 704 |" in text and "**Finished: 8 steps" in text
    assert f" --model {tiny_llama / 'llama'} --cooldown 3` (runs under" in text  # the options that change the report
    assert (runs / "everything-blend-match-cooled3-8" / "step_000011").is_dir() and (branch / "step_000010").is_dir()
    assert [c.name for c in (runs / "everything-blend-match").glob("step_*")] == ["step_000008"]
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(InputError, match=f"--budget {bad}: accepted: a finite number of minutes >= 0"):
            reproduce("warmstart-long", budget=bad, **args)
    for bad, why in ((0, "is invalid; accepted: an integer 1 <= --cooldown < 9"), (9, "is invalid"),
                     (1.5, r"must be an integer \(got float\)")):
        with pytest.raises(InputError, match=f"--cooldown={bad} {why}"):
            reproduce("warmstart-long", budget=0, cooldown=bad, **args)
    with pytest.raises(InputError, match="--budget 0 reads the run's latest checkpoint, and .* has none yet"):
        reproduce("warmstart-long", budget=0, **{**args, "root": tmp_path / "fresh"})
    assert not (tmp_path / "fresh" / "warmstart-long-micro" / "everything-blend-match").exists()


def test_reproduce_warmstart_keep_replays_the_pretrained_models_own_chat(tiny_llama, tmp_path):
    """The keep recipe: the pretrained model's replies to the replay's prompts written once (conversations, none of
    the report's questions), mixed in at 20% of the windows with the anchor; the curve read on the training corpus's
    own held-out windows; a rerun reuses the replay and extends the run (the rest of the report is warmstart-long's,
    tested above)."""
    import json

    from fullband.reproduce import reproduce, warmstart
    from fullband.reproduce import warmstart_keep as keep

    extra = ["data.val_percent=20", f'data.cache_dir="{tiny_llama / "cache"}"', "log.progress=false"]
    args = dict(root=tmp_path / "runs", docs=tmp_path / "docs", scale="micro", seeds=1,
                model=str(tiny_llama / "llama"), extra=extra, corpus=str(tiny_llama / "prose"))
    reproduce("warmstart-keep", budget=1e-9, **args)  # a step an invocation
    root = tmp_path / "runs" / "warmstart-keep-micro"
    stamp = (root / "replay.jsonl").stat().st_mtime_ns
    text = reproduce("warmstart-keep", budget=1e-9, **args).read_text()
    assert (root / "replay.jsonl").stat().st_mtime_ns == stamp  # reused, not sampled again
    rows = [json.loads(line) for line in (root / "replay.jsonl").read_text().splitlines()]
    asked = [r["messages"][0]["content"] for r in rows]
    assert len(rows) >= 3 and all(r["messages"][-1]["role"] == "assistant" for r in rows)
    held = {c["messages"][0]["content"] for c in warmstart.held_out_chats(256)}
    assert not held & set(asked) and any("Python" in q for q in asked)
    saved = json.loads((root / keep.NAME / "run.json").read_text())
    assert saved["data"]["corpus"] == [str(tiny_llama / "prose"), str(root / "replay.jsonl")]
    assert saved["data"]["shares"] == [0.8, 0.2] and saved["train"]["anchor"] == 1.0
    assert "The shipped warm-start recipe with a replay" in text and "**Trained so far: step 2 of 8" in text
    assert "Every run of this invocation also got `--set data.val_percent=20`, `--set data.cache_dir=" in text
    assert "Produced by `fullband reproduce warmstart-keep --scale micro --set data.val_percent=20 --set " in text
    prose = tiny_llama / "prose"
    assert f"held-out windows of `{prose}`" in text and f"Held-out windows of `{prose}` read as" in text
    metrics = [json.loads(line) for line in (root / keep.NAME / "metrics.jsonl").read_text().splitlines()]
    by = [m["eval_by_corpus"][str(tiny_llama / "prose")] for m in metrics if "eval" in m]
    assert "| 2 | 128 | " in text and f"{by[-1]['1']:.4f}" in text  # the curve: the training corpus's windows
    assert "## The latest checkpoint by mode (128 tokens)" in text and "## Chat kept?" in text
    with pytest.raises(InputError, match="corpus"):
        reproduce("warmstart-keep", budget=1, **{**args, "corpus": " "})
    with pytest.raises(InputError, match=r"holds the replies to 4 prompts .* asks for 6 other ones.*--replies 4"):
        reproduce("warmstart-keep", budget=1e-9, replies=6, **args)  # the run's corpus must not change under it
    assert (root / "replay.jsonl").stat().st_mtime_ns == stamp
    with pytest.raises(InputError, match="--budget 0 reads the run's latest checkpoint"):  # before any reply is sampled
        reproduce("warmstart-keep", budget=0, **{**args, "root": tmp_path / "fresh"})
    assert not (tmp_path / "fresh" / "warmstart-keep-micro" / "replay.jsonl").exists()
    assert keep.replay_spec("cpu", 1020) == keep.Replay(680, 340, 128) and keep.replay_spec("cpu", None).python == 100


def test_warmstart_keep_cools_on_another_mix_held_to_the_pretrained_model(tiny_llama, tmp_path):
    """--cooldown-replay: the cooled read is a run of its own from the latest checkpoint's weights (kept in a folder
    beside it), on a mix with the replay at that share, the anchor held to the pretrained model, the falling weights
    going on from where the long run had them; a rerun reuses it; the options are refused where they do not apply."""
    import json

    from safetensors.torch import load_file

    from fullband.reproduce import reproduce
    from fullband.reproduce import warmstart_keep as keep

    model = str(tiny_llama / "llama")
    extra = ["data.val_percent=20", f'data.cache_dir="{tiny_llama / "cache"}"', "log.progress=false"]
    args = dict(root=tmp_path / "runs", docs=tmp_path / "docs", scale="micro", seeds=1, model=model, extra=extra,
                corpus=str(tiny_llama / "prose"))
    root = tmp_path / "runs" / "warmstart-keep-micro"
    with pytest.raises(InputError, match=r"--cooldown-anchor 2 weighs .* accepted: with --cooldown-replay SHARE"):
        reproduce("warmstart-keep", budget=1, cooldown_anchor=2.0, **args)
    for share in (0, 1, 1.5):
        with pytest.raises(InputError,
                           match=rf"--cooldown-replay={share!r} is invalid; accepted: 0 < --cooldown-replay < 1"):
            reproduce("warmstart-keep", budget=1, cooldown_replay=share, **args)
    assert not root.exists()
    reproduce("warmstart-keep", budget=1e-9, **args)  # step 1: inside the blend (to step 4), so no cooled read
    text = reproduce("warmstart-keep", budget=0, cooldown_replay=0.5, **args).read_text()
    assert "No cooled read in this invocation: the latest checkpoint (step 1) is inside the blend curriculum" in text
    text = reproduce("warmstart-keep", budget=60, cooldown=3, cooldown_replay=0.5, cooldown_anchor=2.0,
                     **args).read_text()  # the run to its end (step 8), then 3 steps on the other mix
    name = f"{keep.NAME}-cooled3-replay0.5-anchor2-8"
    cooled, start = root / name, root / f"{name}-start"
    ckpt = root / keep.NAME / "step_000008"
    assert (cooled / "step_000003").is_dir() and sorted(p.name for p in start.iterdir()) == sorted(
        p.name for p in ckpt.iterdir())
    assert (start / "model.safetensors").stat().st_ino == (ckpt / "model.safetensors").stat().st_ino  # a link
    long_run = json.loads((root / keep.NAME / "run.json").read_text())
    saved = json.loads((cooled / "run.json").read_text())
    t = saved["train"]
    assert (t["init_from"], saved["data"]["tokenizer"], t["anchor_from"]) == (str(start), str(start), model)
    assert saved["data"]["shares"] == [0.5, 0.5] and t["anchor"] == 2.0 and t["steps"] == 3
    assert t["cooldown_fraction"] == 1.0 and t["blend_until"] == 0.0 and saved["model"] == long_run["model"]
    assert t["block_match"] == 0.0  # the long run's block match reached 0 at its last step, 8
    first = load_file(str(ckpt / "model.safetensors"))
    after = load_file(str(cooled / "step_000003" / "model.safetensors"))
    assert first.keys() == after.keys() and any(not torch.equal(first[k], after[k]) for k in first)
    assert "a run of its own from the checkpoint's weights" in text and "the replay at **50%**" in text
    assert "| cooled | 704 |" in text  # its tokens counted from the long run's start: 8 + 3 steps of 64
    assert f"kept in `{name}-start` beside it" in text and f'train.anchor_from=\\"{model}\\"' not in text
    assert "--cooldown 3 --cooldown-replay 0.5 --cooldown-anchor 2.0` (runs under" in text
    stamp = (cooled / "step_000003" / "model.safetensors").stat().st_mtime_ns
    reproduce("warmstart-keep", budget=0, cooldown=3, cooldown_replay=0.5, cooldown_anchor=2.0, **args)
    assert (cooled / "step_000003" / "model.safetensors").stat().st_mtime_ns == stamp  # reused
    from fullband.cli import main

    assert main(["reproduce", "warmstart-long", "--cooldown-replay", "0.5", "--budget", "0"]) == 2
