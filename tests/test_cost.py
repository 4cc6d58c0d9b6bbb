"""The cost counter (fullband.model.flops) against a hand count, torch's FlopCounterMode and the real model's
parameters and cache; `fullband bench cost` end to end on a micro config."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from fullband import FullbandLM, ModelConfig
from fullband.bench.cost import standard_of
from fullband.cli import main
from fullband.model import flops
from fullband.model.mode import DecodeMode
from fullband.model.objective import objective

HAND = dict(vocab_size=16, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=16, max_seq_len=8)


def test_hand_count():
    """V 16, D 8, L 2, H 2, Hk 1 (Dh 4), F 16, T 4, gated, tied; per token, one layer:
         wqkv  2 * 8 * (2 + 2*1) * 4 = 256      wo   2 * 8 * 8 = 128
         attention 2 * 2 * 8 * ctx, causal ctx = (1 + 2 + 3 + 4) / 4 = 2.5 -> 80
         SwiGLU 2 * (8 * 32 + 16 * 8) = 768                     layer = 1232, two layers 2464
       head 2 * 16 * 8 = 256; gated fusion 2 * 2 * 8 * 8 = 256.
       one-pass forward 2464 + 256 = 2720; a 2-pass training step 3 * (2 * 2464 + 256 + 2 * 256) = 17088;
       FUSED k=1 prefill 2 * 2464 + 256 = 5184 per prompt token; a SOFT decode step at 5 keys
       2 * (256 + 128 + 2*2*8*5 + 768) + 256 + 256 = 3136; KV 2 * 2 * 1 * 4 * 4 bytes = 64;
       parameters 16*8 + 2*8 (norm_in, norm_out) + 2 * (8*16 + 8*8 + 2*8 + 3*4 + 3*8*16) + 2*8*8 = 1480."""
    cfg = ModelConfig(**HAND)
    assert flops.forward_flops(cfg, 1, seq_len=4) == 2720
    assert flops.train_flops(cfg, 2, seq_len=4) == 17088
    assert flops.prefill_flops(cfg, DecodeMode("fused", 1), 4) == 5184
    assert flops.decode_flops(cfg, DecodeMode("soft"), 5) == 3136
    assert flops.decode_flops(cfg, DecodeMode("standard"), 5) == 3136 - 256
    assert flops.kv_bytes_per_token(cfg) == 64
    assert flops.param_count(cfg) == 1480 == FullbandLM(cfg).num_params()


def _torch_flops(fn) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # the math path: bmm, counted
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("changes", [
    {}, {"fusion": "t2mlr", "n_kv_heads": 2, "attn_gate": True},
    {"fusion": "concat", "feedback_target": 1, "feedback_source": 1, "feedback": "residual", "tie_embeddings": False},
    {"fusion": "additive", "n_layers": 3, "sliding_window": 2, "global_every": 3},
    {"n_layers": 3, "loop_start": 1, "loop_stop": 3, "loops": 2},  # a looped group: its blocks run r times
])
def test_matches_flop_counter_mode(changes):
    """Torch counts every matrix product (the fusion runs at all positions of a fed pass: plain ones are picked
    afterwards) and attention densely: our count with context="dense" agrees exactly, forward and training."""
    cfg = ModelConfig(**{**HAND, **changes})
    torch.manual_seed(0)
    model = FullbandLM(cfg).eval()
    B, T = 2, 6
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    for passes in (1, 3):
        got = _torch_flops(lambda: model(ids, passes=passes))
        assert got == B * T * flops.forward_flops(cfg, passes, seq_len=T, context="dense")
    model.train()
    got = _torch_flops(lambda: objective(model, ids, ids, 2).loss.backward())
    assert got == B * T * flops.train_flops(cfg, 2, seq_len=T, context="dense")
    # the causal count differs by the masked keys alone: 4 D L (T - (T + 1) / 2) per token and pass
    one = flops.forward_flops(cfg, 1, seq_len=T, context="dense") - flops.forward_flops(cfg, 1, seq_len=T)
    window = cfg.sliding_window or T
    masked = sum(flops.repeats(cfg, i) * (T - min(t + 1, window if cfg.is_local(i) else T))
                 for i in range(cfg.n_layers) for t in range(T)) / T
    assert one == pytest.approx(4 * cfg.d_model * masked)


@pytest.mark.parametrize("fusion", ["gated", "additive", "concat", "t2mlr"])
def test_params_added_and_kv_bytes(fusion):
    cfg = ModelConfig(**{**HAND, "fusion": fusion, "qk_norm": fusion != "concat"})
    model, standard = FullbandLM(cfg), FullbandLM(standard_of(cfg))
    assert flops.param_count(cfg) == model.num_params()
    assert flops.fusion_params(cfg) == model.num_params() - standard.num_params()
    for dtype in ("float32", "bfloat16"):
        cache = model.to(getattr(torch, dtype)).new_cache(3, 5)
        held = sum(t.numel() * t.element_size() for t in [*cache.k, *cache.v])
        assert flops.kv_bytes_per_token(cfg, dtype) == held / (3 * 5)


MICRO = ["--config", "configs/tiny.toml", "--set", "d_model=32", "--set", "n_layers=2", "--set", "n_heads=2",
         "--passes", "1", "2", "--batch", "2", "--seq-len", "16", "--prompt-len", "6", "--new-tokens", "3",
         "--batch-sizes", "1", "2", "--repeats", "1", "--no-progress"]


def _ratios(rows):
    return [r["time_vs_standard"] for r in rows if r["time_vs_standard"] is not None]


def test_cli_table_and_json(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert main(["bench", "cost", *MICRO, "--schedule", "three-pass", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for line in ("machine: ", "parameters: standard", "KV cache: ", "training step", "decode per token",
                 "prefill of the 6-token prompt", "FUSED k=1", "three-pass"):
        assert line in text
    result = json.loads(out.read_text())
    assert result["params_added"] == 2 * 32 * 32
    assert [r["variant"] for r in result["rows"]] == ["standard model", "k=1", "k=2", "three-pass"]
    assert len(result["decode"]) == len(result["prefill"]) == 2 * 5  # two batches: baseline + 4 modes
    ratios = _ratios(result["rows"]) + _ratios(result["decode"]) + _ratios(result["prefill"])
    assert len(ratios) == 3 + 10 + 10 and all(math.isfinite(r) and r > 0 for r in ratios)
    assert [round(r["flops_vs_standard"], 2) for r in result["rows"]][1:] == [1.0, 2.05, 3.1]
    # the same command may replace its own results; a file of anything else is refused, untouched
    assert main(["bench", "cost", *MICRO, "--json", str(out)]) == 0
    other = tmp_path / "notes.json"
    other.write_text('{"notes": 1}')
    assert main(["bench", "cost", *MICRO, "--json", str(other)]) == 2
    assert other.read_text() == '{"notes": 1}'


@pytest.mark.parametrize("args, message", [
    (["--set", "fusion=none"], "fusion='none' trains with one pass only"),
    (["--seq-len", "4096"], "--seq-len = 4096 exceeds max_seq_len=512"),
    (["--set", "fusion=sum"], "fusion"),
    (["--config", "nope"], "neither a preset"),
])
def test_cli_bad_input(args, message, capsys):
    assert main(["bench", "cost", *MICRO, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("fullband bench: error:")


# Every case in one process with its address space capped: a size that is not checked fails by allocating (a raw
# out-of-memory traceback, or the kernel's killer), not by filling the machine.
SIZES_CAPPED = """
import contextlib, io, json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
from fullband.cli import main
out = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    out.append([code, [line for line in err.getvalue().splitlines() if "busy with other" not in line]])
print(json.dumps(out))
"""


def test_sizes_past_memory_or_the_pass_cap_are_refused_before_anything_is_allocated():
    """bench cost's --set sizes, --batch, --batch-sizes and --passes are checked against the memory they take (and
    --passes / --prefill-passes against the fixed point's cap, as generate's passes are) before a model is built;
    so are init's, bench decode's and bench train's (one line each, nothing written)."""
    import subprocess
    import sys

    tiny = ["bench", "cost", "--config", "tiny"]
    cases = [([*tiny, "--passes", "1000000"], "--passes 1000000 is above the cap of 512"),
             ([*tiny, "--set", "d_model=65536"], "bench cost needs about"),
             ([*tiny, "--set", "n_layers=100000"], "bench cost needs about"),
             ([*tiny, "--set", "vocab_size=10000000000"], "bench cost needs about"),
             ([*tiny, "--batch", "1000000000"], "bench cost needs about"),
             ([*tiny, "--batch-sizes", "1000000000"], "bench cost needs about"),
             ([*tiny, "--prefill-passes", "100000"], "prefill_passes=100000 is above the cap of max_seq_len=512"),
             (["init", "--config", "tiny", "--set", "n_layers=100000", "--out", "/nonexistent/m"], "the model needs"),
             (["bench", "decode", "--config", "tiny", "--set", "d_model=65536"], "bench decode needs about"),
             (["bench", "train", "--set", "model.vocab_size=10000000000"], "bench train needs about")]
    done = subprocess.run([sys.executable, "-c", SIZES_CAPPED, json.dumps([args for args, _ in cases])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for (args, words), (code, err) in zip(cases, json.loads(done.stdout.strip().splitlines()[-1])):
        assert code == 2 and len(err) == 1 and words in err[0], (args, err)
        assert "needs about" not in words or "nothing was allocated" in err[0]


def test_cli_bad_counts(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "cost", "--passes", "0"])
    assert exit_.value.code == 2 and "out of range" in capsys.readouterr().err


def test_a_looped_model_counts_its_repetitions():
    cfg = ModelConfig(**{**HAND, "n_layers": 3, "loop_start": 1, "loop_stop": 3, "loops": 3})
    cache = FullbandLM(cfg).new_cache(2, 5)
    held = sum(t.numel() * t.element_size() for t in [*cache.k, *cache.v])
    assert flops.kv_bytes_per_token(cfg) == held / (2 * 5)  # a KV slot per repetition
    plain = ModelConfig(**{**HAND, "n_layers": 3})
    per_block = (flops.forward_flops(plain, seq_len=4) - flops.head_flops(plain)) / 3
    assert flops.forward_flops(cfg, seq_len=4) - flops.head_flops(cfg) == pytest.approx(
        per_block * 3 * cfg.loop_cost())  # (L + (r - 1) G) / L of the unlooped blocks
    uniform = ModelConfig(**{**HAND, "n_layers": 3, "loop_start": 1, "loop_stop": 3, "loops": 3,
                             "loop_train": "uniform"})
    assert flops.train_loops(uniform) == 2.0 and flops.train_loops(cfg) == 3
    # a step's own r (the trainer's count) against the run's mean r (the default)
    assert flops.train_flops(uniform, 2, seq_len=4, loops=3) == flops.train_flops(cfg, 2, seq_len=4)
    assert flops.train_flops(uniform, 2, seq_len=4) == flops.train_flops(uniform, 2, seq_len=4, loops=2)
    assert flops.train_flops(uniform, 2, seq_len=4, loops=1) == flops.train_flops(plain, 2, seq_len=4)


PONDER = dict(ponder=True, fusion="none", jitter=0.0, prefix_mixin_prob=0.0)


def test_hand_count_of_a_ponder_model():
    """HAND with ponder slots, T 4; per layer the products are 256 + 128 + 768 = 1152 per slot and attention
    2 * 2 * 8 = 32 per key. Pass 1 (plain, T slots) as test_hand_count: 2464. A later pass runs 8 slots seeing
    1..8 keys: per token 2 * 1152 + 32 * (1 + ... + 8) / 4 = 2592 per layer, 5184 for both; head 256, no fusion.
       forward k=3 (one head) 2464 + 2 * 5184 + 256 = 13088
       training k=3: forward with every pass's head 2464 + 2 * 5184 + 3 * 256 = 13600, backward 2 x (the blocks
         of every pass and the last head) 2 * 13088: 39776; with detach_between_passes the backward covers the
         last pass alone: 13600 + 2 * (5184 + 256) = 24480
       prefill FUSED k=1 (2 passes) 2464 + 5184 = 7648; FUSED k=4 runs 5 passes (the fixed point of 4 tokens)
         2464 + 4 * 5184 = 23200, FUSED k=9 as many; EXACT two steps per token (keys 2t + 1, 2t + 2) 5184
       decode at 5 keys: slots at 9 and 10 keys, 2 * (2 * 1152 + 32 * 19) = 5824 + head 256 = 6080, every mode
       KV 2 layers x 2 slots x 2 x 1 x 4 x 4 bytes = 128; parameters the standard model's, test_hand_count's
       1480 less its fusion's 128 = 1352."""
    cfg = ModelConfig(**HAND, **PONDER)
    assert flops.forward_flops(cfg, 1, seq_len=4) == 2720
    assert flops.ponder_pass_flops(cfg, 4) == 5184
    assert flops.forward_flops(cfg, 3, seq_len=4) == 13088
    assert flops.train_flops(cfg, 3, seq_len=4) == 39776
    assert flops.train_flops(cfg.replace(detach_between_passes=True), 3, seq_len=4) == 24480
    assert flops.train_flops(cfg.replace(detach_between_passes=True), 1, seq_len=4) == 3 * 2720
    with pytest.raises(ValueError, match="passes=2.5: a ponder model with detach_between_passes"):
        flops.train_flops(cfg.replace(detach_between_passes=True), 2.5, seq_len=4)
    assert flops.prefill_flops(cfg, DecodeMode("fused", 1), 4) == 7648
    assert flops.prefill_flops(cfg, DecodeMode("fused", 4), 4) == 23200
    assert flops.prefill_flops(cfg, DecodeMode("fused", 9), 4) == 23200
    assert flops.prefill_flops(cfg, DecodeMode("exact"), 4) == 5184
    assert all(flops.decode_flops(cfg, DecodeMode(m), 5) == 6080 for m in ("fused", "exact"))
    assert flops.kv_bytes_per_token(cfg) == 128 and flops.state_bytes_per_row(cfg) == 0
    assert flops.param_count(cfg) == 1352 == FullbandLM(cfg).num_params()
    cache = FullbandLM(cfg).new_cache(3, 5)
    assert sum(t.numel() * t.element_size() for t in [*cache.k, *cache.v]) == 128 * 3 * 5


@pytest.mark.parametrize("changes", [{}, {"n_kv_heads": 2, "attn_gate": True, "tie_embeddings": False},
                                     {"detach_between_passes": True}])
def test_a_ponder_model_matches_flop_counter_mode(changes):
    """Torch's count of the ponder model's forward (a later pass over 2 T slots, dense attention over all of them)
    and of a training step (every pass's logits, the last one's loss) equals ours with context="dense"."""
    cfg = ModelConfig(**{**HAND, **PONDER, **changes})
    torch.manual_seed(0)
    model = FullbandLM(cfg).eval()
    B, T = 2, 5
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    for passes in (1, 2, 4):
        got = _torch_flops(lambda: model(ids, passes=passes))
        assert got == B * T * flops.forward_flops(cfg, passes, seq_len=T, context="dense")
    model.train()
    for passes in (1, 3):
        got = _torch_flops(lambda: objective(model, ids, ids, passes).loss.backward())
        assert got == B * T * flops.train_flops(cfg, passes, seq_len=T, context="dense")


def test_cli_costs_a_ponder_model_in_its_own_modes(tmp_path, capsys):
    """A ponder model against the standard model (no ponder slots), timed in FUSED k=1 and EXACT (it refuses
    one-pass prompt reads); a looped model's standard has no loop."""
    out = tmp_path / "cost.json"
    ponder = [f"--set={k}={str(v).lower()}" for k, v in PONDER.items()]
    args = [*MICRO[:MICRO.index("--passes")], "--passes", "2", *MICRO[MICRO.index("--batch"):]]
    args[args.index("--batch-sizes") + 1: args.index("--batch-sizes") + 3] = ["1"]
    assert main(["bench", "cost", *args, *ponder, "--json", str(out)]) == 0
    assert "ponder slots (PonderLM-2)" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["decode"]] == ["standard model", "FUSED k=1", "EXACT"]
    assert result["params_added"] == 0 and result["kv_bytes_per_token"] == 2 * result["kv_bytes_per_token_standard"]
    cfg = ModelConfig.from_dict(result["config"])
    assert result["rows"][1]["flops_per_token"] == flops.train_flops(cfg, 2, seq_len=16)
    assert [r["flops_per_token"] for r in result["prefill"]][1:] == [
        flops.prefill_flops(cfg, DecodeMode("fused", 1), 6), flops.prefill_flops(cfg, DecodeMode("exact"), 6)]
    looped = ModelConfig(**{**HAND, "n_layers": 3, "loop_start": 1, "loop_stop": 3, "loops": 3,
                            "loop_train": "uniform"})
    assert standard_of(looped) == ModelConfig(**{**HAND, "n_layers": 3, "fusion": "none"})
    assert standard_of(cfg) == cfg.replace(ponder=False)
