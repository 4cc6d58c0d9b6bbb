"""The embedded demo (`make demo`): a tiny byte-level model, its checkpoint, and a generation in every mode.

Until the training pipeline lands the model is randomly initialised, so the samples are noise; what the
demo shows is the machinery: one checkpoint, four decoding modes, and the exactness checks behind them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from fullband.data.tokenizer import ByteTokenizer
from fullband.decode.generate import MODES, generate
from fullband.model.decoder import FullbandLM
from fullband.presets import load_model_config

PROMPT = "def fibonacci(n):\n    "


def run_demo(out: str | Path = "runs/demo") -> int:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = load_model_config("tiny")
    model = FullbandLM(cfg).eval()
    tok = ByteTokenizer()
    ckpt = model.save(out / "checkpoint", tokenizer=tok)
    model = FullbandLM.load(ckpt)
    print(f"model: {model.num_params() / 1e6:.2f}M parameters "
          f"(fusion {(model.num_params() - model.num_params(fusion=False)) / 1e3:.1f}K), checkpoint {ckpt}")

    ids = torch.tensor([tok.encode(PROMPT)])
    with torch.inference_mode():
        jacobi = model(ids, passes=ids.shape[1] + 1).hidden
        exact = model.recurrent_forward(ids).hidden
    gap = (jacobi - exact).abs().max().item()
    print(f"Jacobi fixed point ({ids.shape[1] + 1} passes) vs exact recurrence: max |diff| = {gap:.2e}")

    samples = {}
    for mode in MODES:
        t0 = time.perf_counter()
        new = generate(model, ids, 48, mode=mode, prefill_passes=1, stop_tokens=[tok.eos_id])[0]
        dt = time.perf_counter() - t0
        samples[mode] = tok.decode(new)
        print(f"--- {mode:<8} ({len(new)} tokens, {len(new) / dt:.0f} tok/s): {samples[mode]!r}")
    (out / "samples.json").write_text(json.dumps({"prompt": PROMPT, "samples": samples, "jacobi_gap": gap}, indent=2))
    print(f"(random weights: the text is noise until a model is trained) wrote {out / 'samples.json'}")
    return 0
