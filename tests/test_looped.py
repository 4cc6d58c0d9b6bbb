"""Looped depth (model.loop_start / loop_stop / loops / loop_train; the Huginn / Ouro rival): the forward equals
the group run r times written by hand from the block modules, cached decoding equals an uncached recompute with a
KV cache slot per repetition, r = 1 is the unlooped model bit for bit, latent feedback on a looped stack stays
exact, training with a randomised r resumes bitwise (its FLOPs counted at each step's r) and trains the same in two
DDP processes as in one, folders round-trip, and the other runtimes refuse by name."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_resume_is_bitwise, losses, random_ids, tiny_model, write_config
from fullband import FullbandLM, generate
from fullband.errors import ConfigError, InputError
from fullband.model.config import ModelConfig, require_default_layers
from fullband.train.schedule import sample_loops
from test_decode import _steps, _uncached_logits

LOOPED = {
    "middle": dict(fusion="none", loop_start=1, loop_stop=3, loops=3),
    "whole-stack": dict(fusion="none", loop_start=0, loop_stop=4, loops=2),
    "top-block": dict(fusion="none", loop_start=3, loop_stop=4, loops=4),
    "with-feedback": dict(loop_start=1, loop_stop=3, loops=2),  # the paper's fusion on a looped stack
    "looped-source": dict(loop_start=1, loop_stop=3, loops=2, feedback_target=1, feedback_source=2,
                          feedback="residual", fusion="additive"),
    "loop-below-target": dict(loop_start=0, loop_stop=2, loops=3, feedback_target=2, fusion="concat"),
}


def _model(name: str | None, seed: int = 0, **changes) -> FullbandLM:
    """A 4-block float64 model with the looped setting `name` (None: unlooped)."""
    settings = {**(LOOPED[name] if name else {}), **changes}
    return tiny_model(seed, n_layers=4, d_model=32, n_heads=4, n_kv_heads=2, **settings).double()


def _by_hand(model: FullbandLM, ids: torch.Tensor, loops: int) -> torch.Tensor:
    """One plain pass without the core, its cache or _blocks: embedding -> the blocks below the group -> the group
    `loops` times -> the blocks above -> final norm -> head; -> logits (B, T, V)."""
    cfg, blocks = model.config, model.blocks
    x = model.norm_in(model.embed(ids))
    cos, sin = model.rotary.prefix(ids.shape[1], x.dtype)
    a, b = cfg.loop_start, cfg.loop_stop
    for i in list(range(a)) + list(range(a, b)) * loops + list(range(b, cfg.n_layers)):
        x = blocks[i](x, cos, sin)
    return model.head(model.norm_out(x))


@pytest.mark.parametrize("name", ["middle", "whole-stack", "top-block", "with-feedback"])
def test_the_looped_forward_is_the_group_run_r_times_by_hand(name):
    model, ids = _model(name), random_ids(2, 9)
    with torch.no_grad():
        assert (model(ids).logits - _by_hand(model, ids, model.config.loops)).abs().max() < 1e-12
        with model.looping(5):  # test-time depth beyond the config's
            assert (model(ids).logits - _by_hand(model, ids, 5)).abs().max() < 1e-12
            assert model.new_cache(1, 4).k.__len__() == 4 + 4 * model.config.loop_size
        assert model.loops == model.config.loops  # restored


def test_one_loop_is_the_unlooped_model_bit_for_bit():
    ids, prompt = random_ids(2, 9), random_ids(1, 6, seed=4)[0].tolist()
    for name in ("middle", "with-feedback"):
        plain, once = _model(None, fusion=LOOPED[name].get("fusion", "gated")), _model(name, loops=1)
        a, b = plain.state_dict(), once.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # no new weights, same init
        looped = _model(name)
        passes = 1 if name == "middle" else 3
        with torch.no_grad(), looped.looping(1):
            for m in (once, looped):
                assert torch.equal(m(ids, passes=passes).logits, plain(ids, passes=passes).logits)
            mode = "standard" if name == "middle" else "soft"
            assert _steps(looped, prompt, mode)[1].equal(_steps(plain, prompt, mode)[1])


@pytest.mark.parametrize("name", list(LOOPED))
def test_cached_decoding_equals_an_uncached_recompute(name):
    model = _model(name)
    prompt = random_ids(1, 7, seed=3)[0].tolist()
    runs = (("standard", [1]),) if not model.config.has_feedback else (("soft", [1]), ("exact", [1]), ("fused", [2]))
    for mode, ks in runs:
        for k in ks:
            tokens, logits = _steps(model, prompt, mode, k)
            ref = _uncached_logits(model, prompt, tokens, mode, k)
            assert (logits - ref).abs().max().item() < 1e-9, (mode, k)
    # a ragged batch decodes each row as it decodes alone
    rows = [prompt, prompt[:4]]
    mode = "soft" if model.config.has_feedback else "standard"
    assert generate(model, rows, 5, mode=mode) == [generate(model, [r], 5, mode=mode)[0] for r in rows]


@pytest.mark.parametrize("name", ["with-feedback", "looped-source", "loop-below-target"])
def test_latent_feedback_on_a_looped_stack_stays_exact(name):
    model, ids = _model(name), random_ids(2, 8, seed=2)
    with torch.no_grad():
        exact = model.recurrent_forward(ids)
        jacobi = model(ids, passes=ids.shape[1])
        fewer = model(ids, passes=2)
    assert (jacobi.logits - exact.logits).abs().max() < 1e-10 and (jacobi.hidden - exact.hidden).abs().max() < 1e-10
    assert (fewer.logits[:, 2:] - exact.logits[:, 2:]).abs().max() > 1e-6  # the state is really read


def test_a_cache_holds_the_slots_of_its_r():
    model = _model("middle")
    cache = model.new_cache(1, 8)
    assert len(cache.k) == 4 + 2 * 2  # n_layers + (loops - 1) G
    with torch.no_grad(), model.looping(4), pytest.raises(InputError, match="holds 8 layer slots.*loops=4 needs 10"):
        model(random_ids(1, 5), cache=cache)
    with pytest.raises(InputError, match="loops=0"), model.looping(0):
        pass
    with pytest.raises(InputError, match="loops=2 needs a looped group"), _model(None).looping(2):
        pass


def test_the_cost_of_a_looped_token():
    cfg = ModelConfig(n_layers=8, loop_start=2, loop_stop=6, loops=3)
    assert cfg.loop_cost() == (8 + 2 * 4) / 8 == 2.0 and cfg.loop_cost(1) == 1.0
    assert ModelConfig(n_layers=8).loop_cost() == 1.0


def test_r_per_step_is_a_function_of_seed_and_step():
    fixed = ModelConfig(n_layers=4, loop_start=1, loop_stop=3, loops=4)
    uniform = fixed.replace(loop_train="uniform")
    assert {sample_loops(fixed, s, 0) for s in range(50)} == {4}
    draws = [sample_loops(uniform, s, 0) for s in range(200)]
    assert set(draws) == {1, 2, 3, 4} and draws == [sample_loops(uniform, s, 0) for s in range(200)]
    assert draws != [sample_loops(uniform, s, 1) for s in range(200)]
    assert sample_loops(ModelConfig(), 3, 0) == 1


LOOPED_MODEL = """vocab_size = 259
d_model = 32
n_layers = 3
n_heads = 2
max_seq_len = 128
fusion = "none"
loop_start = 1
loop_stop = 2
loops = 3
loop_train = "uniform\""""


def test_training_with_a_randomised_r_resumes_bitwise(tmp_path, corpus, cache, monkeypatch):
    import itertools
    import json

    from fullband.train.config import load_run_config

    whole, part = (write_config(tmp_path, corpus, cache, name, steps=7, ckpt_every=3, keep_last=3,
                                model=LOOPED_MODEL, passes='"none"') for name in ("whole", "part"))
    assert_resume_is_bitwise(whole, part, monkeypatch, stop_before=4, last="step_000007")  # resumes at step 3
    rows = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss_pass" in row]
    r = [row["loops"] for row in steps]
    assert len(r) == 7 and len(set(r)) > 1  # r was drawn per step
    # the FLOPs of each step at its own r (k = 1 here), cumulative; the same after the resume (checked above)
    from fullband.model.flops import train_flops

    model = ModelConfig.from_dict(json.loads((tmp_path / "whole" / "run.json").read_text())["model"])
    per_step = [256 * train_flops(model, 1, seq_len=32, loops=x) for x in r]
    assert [row["flops"] for row in steps] == list(itertools.accumulate(per_step)) and len(set(per_step)) > 1
    # a checkpoint written before FLOPs were counted: a resume counts its steps again from (seed, step), exactly
    from fullband.train import checkpoint as ckpt
    from fullband.train.trainer import train

    save = ckpt.save_checkpoint

    def save_without_flops(run_dir, step, model, optimizer, state, **kw):
        return save(run_dir, step, model, optimizer, {k: v for k, v in state.items() if k != "flops"}, **kw)

    monkeypatch.setattr(ckpt, "save_checkpoint", save_without_flops)
    old = write_config(tmp_path, corpus, cache, "old", steps=3, ckpt_every=3, model=LOOPED_MODEL, passes='"none"')
    train(load_run_config(old))
    assert "flops" not in json.loads((tmp_path / "old" / "step_000003" / "trainer.json").read_text())
    assert train(load_run_config(old), resume=tmp_path / "old")["flops"] == steps[2]["flops"]
    back = FullbandLM.load(tmp_path / "whole" / "step_000007")
    assert back.config.loops == 3 and back.config.loop_train == "uniform"
    # a looped model without fusion weights trains one pass: a multi-pass schedule is refused by name
    bad = write_config(tmp_path, corpus, cache, "bad", model=LOOPED_MODEL)
    with pytest.raises(ConfigError, match="train.passes=.*looped model with model.fusion='none'"):
        load_run_config(bad)


def test_two_process_ddp_with_a_randomised_r_matches_one_process(tmp_path, corpus, cache):
    """r is drawn from (seed, step) alone, so both ranks run the step's r and two processes train what one does."""
    import json

    from test_train import assert_same_losses, train_in_one_and_two_processes

    model = LOOPED_MODEL.replace("loops = 3", "loops = 4")  # seed 0 draws r = 4, 3, 4, 4
    runs = train_in_one_and_two_processes(tmp_path, corpus, cache, steps=4, micro=2, model=model, passes='"none"')
    rows = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] for run in runs]
    r = [[row["loops"] for row in run if "loops" in row] for run in rows]
    assert r[0] == r[1] and len(r[0]) == 4 and len(set(r[0])) > 1
    assert [row["flops"] for row in rows[0]] == [row["flops"] for row in rows[1]]
    assert_same_losses(*(losses(run) for run in runs))


def test_folders_round_trip_and_the_transformers_class_runs_the_loop(tmp_path):
    from fullband.hf.convert import convert

    model, ids = _model("with-feedback").float(), random_ids(2, 8)
    model.save(tmp_path / "native")
    back = FullbandLM.load(tmp_path / "native")
    assert back.config == model.config and back.loops == 2
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    transformers = pytest.importorskip("transformers")
    convert(tmp_path / "native", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = ids[:1, :5]
    with torch.no_grad():
        assert torch.equal(hf(ids, feedback_mode="fused", prefill_passes=2).logits, model(ids, passes=3).logits)
        out = hf.generate(prompt, max_new_tokens=5, do_sample=False, feedback_mode="soft")
    assert out[0, 5:].tolist() == generate(model, [prompt[0].tolist()], 5, mode="soft")[0]


def test_other_runtimes_refuse_a_looped_model_by_name():
    cfg = ModelConfig(n_layers=4, loop_start=1, loop_stop=3, loops=2)
    with pytest.raises(ConfigError, match="fullband's vLLM model runs every block once.*loop_start=1, loop_stop=3"):
        require_default_layers(cfg, "fullband's vLLM model")
    transformers = pytest.importorskip("transformers")
    from fullband.hf import add_latent_feedback

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50,
                                                                     bos_token_id=0, eos_token_id=0))
    with pytest.raises(ConfigError, match="add_latent_feedback .*loop_start=0, loop_stop=2"):
        add_latent_feedback(gpt2, config=ModelConfig(n_layers=2, loop_start=0, loop_stop=2, loops=2))


@pytest.mark.parametrize("bad, match", [
    (dict(loop_start=1), "loop_start=1, loop_stop=None: give both"),
    (dict(loop_start=2, loop_stop=2), r"loop_start=2, loop_stop=2 is not a group.*0 <= loop_start < loop_stop"),
    (dict(loop_start=1, loop_stop=5), "loop_stop=5 is not a group"),
    (dict(loop_start=-1, loop_stop=2), "loop_start=-1"),
    (dict(loops=3), "loops=3, loop_train='fixed' need a looped group"),
    (dict(loop_train="uniform"), "need a looped group"),
    (dict(loop_start=0, loop_stop=2, loops=0), "loops=0 is invalid"),
    (dict(loop_start=0, loop_stop=2, loops=10**6), "loops=1000000 is invalid; accepted: an integer 1 <= loops < 257"),
    (dict(loop_start=0, loop_stop=2, loop_train="poisson"), "loop_train"),
    (dict(loop_start=0, loop_stop=3, feedback_target=2), r"\[0, 3\) straddles feedback_target=2"),
])
def test_loop_settings_are_checked_by_name(bad, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(n_layers=4, **bad)
