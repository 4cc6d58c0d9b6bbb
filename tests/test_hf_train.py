"""`fullband train` warm-started from a pretrained Hugging Face model (`model.hf_path`): tiny random Llama and
GPT-2 folders with their own tokenizer (built here, nothing downloaded) are wrapped with latent feedback and
trained with the multi-pass objective; checkpoints reload as the wrapped model, decode in every mode and
resume exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fullband import load_model
from fullband.errors import CheckpointError, ConfigError
from fullband.train.config import load_run_config
from fullband.train.trainer import Trainer, train

from conftest import assert_resume_is_bitwise, losses, torchrun, write_config  # and the corpus and cache fixtures

transformers = pytest.importorskip("transformers")

HF_PASSES = '[{until = 0.3, probs = {"1" = 1.0}}, {until = 1.0, probs = {"2" = 0.6, "3" = 0.4}}]'


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory, corpus):
    """Tiny random Llama and GPT-2 folders with a BPE tokenizer trained on the test corpus."""
    from fullband.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("hf")
    texts = [p.read_text(errors="ignore") for p in sorted(Path(corpus).glob("*.py"))[:10]]
    tok = train_bpe(texts, 320, show_progress=False)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf_tokenizer, bos_token="<bos>",
                                                eos_token="<eos>", pad_token="<pad>")
    torch.manual_seed(0)
    models = {
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1,
            tie_word_embeddings=False)),
        "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=1)),
    }
    for name, model in models.items():
        model.save_pretrained(root / name)
        fast.save_pretrained(root / name)
    return root


def recipe(tmp_path, corpus, cache, hf_path, name="run", steps=6) -> Path:
    """The micro recipe of conftest with the model named by hf_path (its sizes replace the [model] ones)."""
    return write_config(tmp_path, corpus, cache, name, steps=steps, ckpt_every=3, keep_last=3, passes=HF_PASSES,
                        model=f'hf_path = "{hf_path}"\njitter = 0.02\nprefix_mixin_prob = 0.5')


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_train_from_a_pretrained_hf_model(tmp_path, corpus, cache, hf_folders, kind):
    from fullband import FullbandLM
    from fullband.data.tokenizer import PretrainedTokenizer, load_tokenizer
    from fullband.hf import LatentFeedback

    hf_path = hf_folders / kind
    cfg = load_run_config(recipe(tmp_path, corpus, cache, hf_path))
    result = train(cfg)
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss_pass" in r]
    assert [r["k"] for r in steps][:2] == [1, 1] and {r["k"] for r in steps[2:]} <= {2, 3}
    assert all(len(r["loss_pass"]) == r["k"] for r in steps)
    assert set(result["eval"]) == {"1", "2"}
    saved = json.loads((run / "run.json").read_text())["model"]
    assert saved["hf_path"] == str(hf_path) and saved["d_model"] == 64 and saved["vocab_size"] == 320
    assert saved["bos_token_id"] == 0  # the pretrained tokenizer's BOS
    # the checkpoint reloads as the wrapped model, with the trained weights (FullbandLM.load is for native models)
    model = load_model(run / "step_000006")
    with pytest.raises(CheckpointError, match="fullband.load_model"):
        FullbandLM.load(run / "step_000006")
    assert isinstance(model, LatentFeedback) and type(model.hf).__name__ == type(
        transformers.AutoModelForCausalLM.from_pretrained(hf_path)).__name__
    weights = load_file(str(run / "step_000006" / "model.safetensors"))
    original = load_file(str(hf_path / "model.safetensors"))
    first = next(k for k in original if k.endswith("weight") and original[k].ndim == 2)
    assert not torch.equal(weights["hf." + first], original[first])  # the HF weights trained too
    assert {"fusion.w_u.weight", "fusion.w_g.weight", "norm_in.weight"} <= set(weights)
    tok = load_tokenizer(run / "step_000006")
    assert isinstance(tok, PretrainedTokenizer) and tok.bos_id == 0 and tok.eos_id == 1
    model.eval()
    ids = torch.tensor([tok.encode("def f(x):\n    return")])
    with torch.no_grad():
        rebuilt = transformers.AutoModelForCausalLM.from_pretrained(hf_path)
        rebuilt.load_state_dict({k[3:]: v for k, v in weights.items() if k.startswith("hf.")}, strict=False)
        assert torch.allclose(model(ids, passes=1).logits, rebuilt.eval()(ids).logits, atol=1e-5)
        jacobi = model(ids, passes=ids.shape[1] + 1).hidden
    assert torch.allclose(jacobi, model.recurrent_forward(ids).hidden, atol=1e-4)
    for mode in ("standard", "soft", "fused", "exact"):
        assert model.generate(ids, 5, mode=mode, prefill_passes=2).shape == (1, 5)


def test_hf_run_resumes_bitwise(tmp_path, corpus, cache, hf_folders, monkeypatch):
    hf_path = hf_folders / "gpt2"
    whole, part = (recipe(tmp_path, corpus, cache, hf_path, name, steps=9) for name in ("whole", "part"))
    assert_resume_is_bitwise(whole, part, monkeypatch, stop_before=4, last="step_000009")  # resumes at step 3


def test_hf_routes_put_every_weight_in_one_group(hf_folders):
    from fullband.hf.feedback import from_pretrained
    from fullband.train.optim import HF_ROUTE_TABLES, OptimConfig, routing_report

    for kind in ("llama", "gpt2"):
        model = from_pretrained(str(hf_folders / kind))
        rows = routing_report(model, OptimConfig(), HF_ROUTE_TABLES["normuon"])
        names = [r[0] for r in rows]
        assert sorted(names) == sorted(n for n, p in model.named_parameters())
        kinds = {name: (opt, wd) for name, opt, _, wd in rows}
        assert kinds["fusion.w_u.weight"][0] == "normuon"
        assert all(opt == "adam" for name, (opt, _) in kinds.items() if name.startswith("hf."))
        norms = [n for n in names if "norm" in n or ".ln_" in n or n.endswith(".bias")]
        assert norms and all(kinds[n][1] == 0.0 for n in norms)


def test_hf_path_bad_input(tmp_path, corpus, cache, hf_folders):
    with pytest.raises(ConfigError, match="model.hf_path='.*nowhere' is not a Hugging Face model folder"):
        train(load_run_config(recipe(tmp_path, corpus, cache, tmp_path / "nowhere")))
    path = recipe(tmp_path, corpus, cache, hf_folders / "gpt2")
    with pytest.raises(ConfigError, match="both name a warm start"):
        train(load_run_config(path, ["train.init_from=somewhere"]))
    with pytest.raises(ConfigError, match=r"train.seq_len=256 exceeds the context of .* \(128 positions\)"):
        train(load_run_config(path, ["train.seq_len=256", "train.global_batch_tokens=1024", "train.micro_batch=2"]))
    assert not (tmp_path / "run").exists()


def test_hf_run_under_two_process_ddp_matches_one_process(tmp_path, corpus, cache, hf_folders):
    hf_path = hf_folders / "gpt2"  # GPT-2 has dropout layers: the trainer turns them off, so ranks agree
    one = recipe(tmp_path, corpus, cache, hf_path, "one", steps=5)
    two = recipe(tmp_path, corpus, cache, hf_path, "two", steps=5)
    train(load_run_config(one, ["train.micro_batch=2"]))
    done = torchrun(["-m", "fullband.cli", "train", str(two), "--set", "train.micro_batch=2"])
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(a) == len(b) == 5 and any(len(x) > 1 for x in a)
    for x, y in zip(a, b):
        assert len(x) == len(y) and max(abs(p - q) for p, q in zip(x, y)) <= 1e-5, (x, y)


def test_hf_run_with_activation_checkpointing_gives_the_same_losses(tmp_path, corpus, cache, hf_folders):
    """With the block match on, whose forward hooks see a wrapped block's output once (its recompute not again)."""
    hf_path = hf_folders / "llama"
    match = ["train.block_match=1.0"]
    plain = train(load_run_config(recipe(tmp_path, corpus, cache, hf_path, "plain", steps=4), match))
    trainer = Trainer(load_run_config(recipe(tmp_path, corpus, cache, hf_path, "ckpt", steps=4),
                                      ["train.activation_checkpointing=true", *match]))
    try:
        assert all(type(block).__name__ == "CheckpointWrapper" for block in trainer.model.blocks)
        trainer.run()
    finally:
        trainer.close()
    a, b = losses(tmp_path / "plain"), losses(tmp_path / "ckpt")
    assert len(a) == 4 and all(abs(x - y) <= 1e-6 for r, s in zip(a, b) for x, y in zip(r, s))
    assert plain["steps"] == 4
    terms = [[json.loads(line).get("block_match") for line in (tmp_path / run / "metrics.jsonl").read_text()
              .splitlines() if "loss_pass" in line] for run in ("plain", "ckpt")]
    assert any(t > 0 for t in terms[0]) and all(abs(x - y) <= 1e-6 for x, y in zip(*terms))


def test_every_tool_loads_a_wrapped_checkpoint(tmp_path, corpus, cache, hf_folders):
    """One loader: `fullband eval` and the harness model read a model.hf_path run's checkpoint like a native one and
    decode it on the same engine (a score through the harness equals fullband.decode.score on the loaded model)."""
    from fullband.decode.score import score
    from fullband.eval.commands import load
    from fullband.hf import LatentFeedback

    train(load_run_config(recipe(tmp_path, corpus, cache, hf_folders / "gpt2", steps=3)))
    ckpt = tmp_path / "run" / "step_000003"
    model, tok = load(ckpt)
    assert isinstance(model, LatentFeedback)
    lmeval = pytest.importorskip("fullband.lmeval") if pytest.importorskip("lm_eval") else None
    harness = lmeval.FullbandHarnessLM(checkpoint=str(ckpt), mode="fused", prefill_passes=1)
    context, continuation = tok.encode("def f(x):", bos=True), tok.encode(" return x", bos=False)
    want = score(model, [context], [continuation], mode="fused", prefill_passes=1)[0]
    assert harness._score([(context, continuation)])[0] == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("damage, said", [("drop", "has no weight for"), ("nan", "holds 1 non-finite value")])
def test_model_hf_path_refuses_a_folder_transformers_would_start_partly_fresh(tmp_path, corpus, cache, hf_folders,
                                                                               damage, said):
    """A pretrained folder missing a weight (transformers would initialise it fresh and say so in its loading report)
    or holding a NaN: model.hf_path refuses it in one line before the first step, as convert and init_from do."""
    import shutil

    from safetensors.torch import save_file

    folder = tmp_path / "gpt2"
    shutil.copytree(hf_folders / "gpt2", folder)
    weights = load_file(str(folder / "model.safetensors"))
    name = next(k for k in weights if k.endswith("h.1.mlp.c_proj.weight"))
    if damage == "drop":
        del weights[name]
    else:
        weights[name][0, 0] = float("nan")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=said):
        Trainer(load_run_config(recipe(tmp_path, corpus, cache, folder)))
    assert not (tmp_path / "run").exists()


def test_the_anchor_holds_the_pretrained_hf_model(tmp_path, corpus, cache, hf_folders):
    """train.anchor with model.hf_path: the frozen copy is the pretrained HF model as the run starts from it (every
    HF weight equal to the folder's), no step moves it, and the term is logged."""
    from fullband.train.config import load_run_config

    hf_path = hf_folders / "llama"
    path = recipe(tmp_path, corpus, cache, hf_path, "anchored", steps=3)
    path.write_text(path.read_text().replace("[train]\n", "[train]\nanchor = 1.0\n", 1))
    trainer = Trainer(load_run_config(path))
    original = load_file(str(hf_path / "model.safetensors"))
    frozen = trainer.anchor.state_dict()
    assert all(torch.equal(frozen["hf." + k], v) for k, v in original.items() if "hf." + k in frozen)
    assert sum("hf." + k in frozen for k in original) >= len(original) - 1  # a tied head may be stored once
    try:
        trainer.run()
    finally:
        trainer.close()
    assert all(torch.equal(frozen[k], v) for k, v in trainer.anchor.state_dict().items())
    rows = [json.loads(line) for line in (tmp_path / "anchored" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss_pass" in r]
    assert [r["anchor_weight"] for r in steps] == pytest.approx([1.0, 2 / 3, 1 / 3])
    assert all(r["anchor"] >= 0 for r in steps) and any(r["anchor"] > 0 for r in steps if r["k"] > 1)
