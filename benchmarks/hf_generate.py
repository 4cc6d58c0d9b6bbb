"""What the transformers adapter costs: `FullbandForCausalLM.generate` vs `fullband.generate` on the same weights.

    python benchmarks/hf_generate.py [--config bench-91m] [--mode soft] [--prompt 64] [--new 48] [--repeats 5]

Both decode greedily from the same prompt (their tokens are checked equal first); the two are timed alternately
in one process and the medians compared, so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fullband import generate
from fullband.hf import FullbandForCausalLM
from fullband.model.decoder import FullbandLM
from fullband.presets import load_model_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="bench-91m", help="a model preset or .toml (default bench-91m)")
    p.add_argument("--mode", default="soft", choices=("standard", "soft", "fused", "exact"))
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--new", type=int, default=48, help="new tokens (default 48)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args()

    torch.manual_seed(0)
    native = FullbandLM(load_model_config(args.config, None)).eval().to(getattr(torch, args.dtype))
    hf = FullbandForCausalLM.from_native(native)
    prompt = torch.randint(0, min(256, native.config.vocab_size), (1, args.prompt))

    def ours():
        return generate(native, prompt.tolist(), args.new, mode=args.mode)

    def theirs():
        out = hf.generate(prompt, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                          feedback_mode=args.mode)
        return out[:, args.prompt:].tolist()

    if ours() != theirs():
        raise SystemExit("the two decoders disagree; this benchmark compares equal work only")
    times: dict[str, list[float]] = {"fullband.generate": [], "FullbandForCausalLM.generate": []}
    for _ in range(args.repeats):
        for name, fn in (("fullband.generate", ours), ("FullbandForCausalLM.generate", theirs)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"{args.config}, {args.dtype}, batch 1, {args.mode}, prompt {args.prompt}, {args.new} new tokens, "
          f"median of {args.repeats} alternating runs:")
    for name, t in med.items():
        print(f"  {name:30s} {args.new / t:7.1f} tok/s (end to end)")
    print(f"  time ratio HF adapter / native: {med['FullbandForCausalLM.generate'] / med['fullband.generate']:.3f}")


if __name__ == "__main__":
    main()
