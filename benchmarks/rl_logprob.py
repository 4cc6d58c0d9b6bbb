"""The log-probability study (fullband.rl.study): exact / jacobi:K / replay on the same sampled responses.

For each decoding mode, responses are sampled by the decode engine (temperature 1) to prompts cut from the Python
standard library's source; each path then computes their log-probabilities and gradient. Reported: the value error
against exact (nats/token, mean and largest), the gradient's cosine with the exact gradient, the median time of a
forward + backward and its ratio to exact's (alternated in one process), and the memory autograd saved for backward.

    python benchmarks/rl_logprob.py --checkpoint runs/demo/code/step_000100   # the demo's code LM (make demo)
    python benchmarks/rl_logprob.py --json docs/benchmarks/rl-logprob-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path


def prompts_from_stdlib(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    files = sorted(Path(os.__file__).parent.glob("*.py"))
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        text = rng.choice(files).read_text(errors="replace")
        if len(text) > 4 * length:
            start = rng.randrange(len(text) - 2 * length)
            out.append(tokenizer.encode(text[start:start + length]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="runs/demo/code/step_000100", help="a model folder or checkpoint")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-chars", type=int, default=48)
    p.add_argument("--new", type=int, default=32, help="response tokens sampled per prompt")
    p.add_argument("--modes", nargs="+", default=["soft", "fused:2"])
    p.add_argument("--paths", nargs="+", default=["exact", "jacobi:1", "jacobi:2", "jacobi:3", "jacobi:8", "jacobi:34",
                                                    "replay"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()

    from fullband.data.tokenizer import load_tokenizer
    from fullband.decode.sampling import Sampling
    from fullband.loader import load_model
    from fullband.machine import hardware
    from fullband.rl.study import logprob_study

    model = load_model(args.checkpoint)
    tokenizer = load_tokenizer(args.checkpoint)
    prompts = prompts_from_stdlib(tokenizer, args.prompts, args.prompt_chars, args.seed)
    print(f"{args.checkpoint}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; {hardware()}; "
          f"{args.prompts} prompts, {args.new} sampled tokens each")
    rows = logprob_study(model, prompts, args.new, modes=args.modes, paths=args.paths,
                         sampling=Sampling(temperature=1.0, seed=args.seed), repeats=args.repeats)
    head = f"{'mode':<10} {'path':<10} {'mean err':>10} {'max err':>10} {'grad cos':>9} {'s/step':>8} {'x exact':>8} " \
           f"{'saved MiB':>10}"
    print(head)
    for r in rows:
        print(f"{r['mode']:<10} {r['path']:<10} {r['mean_error']:>10.2e} {r['max_error']:>10.2e} "
              f"{r['grad_cosine']:>9.4f} {r['seconds']:>8.3f} {r['time_vs_exact']:>8.2f} {r['saved_mib']:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": hardware(), "checkpoint": args.checkpoint, "settings": vars(args), "rows": rows},
                      f, indent=2)


if __name__ == "__main__":
    main()
