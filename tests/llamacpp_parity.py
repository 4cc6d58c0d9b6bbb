"""Run in .venv-llama by tests/test_llamacpp.py: fullband.generate on a model and on its GGUF file through llama.cpp
(fullband.llamacpp.LlamaCppModel), greedy, in every mode, and the ids each produced, as JSON on stdout.

  python tests/llamacpp_parity.py NATIVE_FOLDER OUT_DIR --tokens N [--types F32 F16 Q8_0] [--modes ...]
      [--rounded-modes ...] [--compiled ...]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("native")
    p.add_argument("out")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--types", nargs="+", default=["F32"])
    p.add_argument("--modes", nargs="+", default=["standard", "soft", "fused:1", "fused:3", "fused:auto", "exact"])
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--rounded-modes", nargs="+", default=None,
                   help="the modes decoded on the files other than F32 (default: --modes)")
    p.add_argument("--compiled", nargs="*", default=[], help="modes decoded on llama.cpp again with compile=True")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from fullband import generate, load_model
    from fullband.data.tokenizer import load_tokenizer
    from fullband.llamacpp import LlamaCppModel, export_gguf

    model, tokenizer = load_model(args.native).eval(), load_tokenizer(args.native)
    prompt = [tokenizer.encode(args.prompt)]
    result = {"prompt": prompt[0], "native": {}, "llamacpp": {}}
    for mode in args.modes:
        result["native"][mode] = generate(model, prompt, args.tokens, mode=mode)[0]
    for kind in args.types:
        path = export_gguf(model, Path(args.out) / f"model-{kind}.gguf", tokenizer=tokenizer, dtype=kind)
        engine = LlamaCppModel(path, threads=1, n_ctx=256)
        modes = args.modes if kind == "F32" or args.rounded_modes is None else args.rounded_modes
        result["llamacpp"][kind] = {mode: generate(engine, prompt, args.tokens, mode=mode)[0] for mode in modes}
        result.setdefault("compiled", {})[kind] = {
            mode: generate(engine, prompt, args.tokens, mode=mode, compile=True)[0] for mode in args.compiled}
        result.setdefault("tokenizer_ids", engine.tokenizer.encode(args.prompt))
        engine.close()
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
