"""Torch's thread count on a busy machine: batch-1 STANDARD decode of the bench-91m shape (tokens/s) and a training
step of configs/tiny.toml's model (ms/step) with 1 and 2 threads, on an idle machine and with one core kept busy by
another process (a spinning Python loop). Each figure is measured in a fresh process; the rows of one load run
back to back.

    python benchmarks/threads.py [--json docs/benchmarks/threads-cpu.json]

Why: fullband picks torch's threads from the cores that are free (fullband.machine, for every command); this is
the measurement behind that choice.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, statistics, sys, time, torch
import fullband as fb
from fullband.model.objective import objective
what = sys.argv[1]
torch.manual_seed(0)
if what == "decode":
    cfg = fb.ModelConfig(vocab_size=8192, d_model=768, n_layers=12, n_heads=12, d_ff=2048, max_seq_len=2048)
    model = fb.FullbandLM(cfg).eval()
    prompt = torch.randint(0, 8192, (1, 32))
    fb.generate(model, prompt, 4, mode="standard")
    times = []
    for _ in range(3):
        it = fb.stream(model, prompt, 33, mode="standard")
        next(it)
        t0 = time.perf_counter()
        for s in it:
            s.tokens.tolist()
        times.append((time.perf_counter() - t0) / 32)
    print(json.dumps({"value": 1 / statistics.median(times), "unit": "tok/s"}))
else:
    cfg = fb.ModelConfig(vocab_size=259, d_model=128, n_layers=4, n_heads=4, max_seq_len=512, bos_token_id=256)
    model = fb.FullbandLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (32, 257))
    times = []
    for i in range(6):
        t0 = time.perf_counter()
        loss = objective(model, ids[:, :-1], ids[:, 1:], 1).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"value": statistics.median(times[2:]) * 1e3, "unit": "ms/step"}))
"""


def measure(what: str, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "FULLBAND_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", CHILD, what], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    from fullband.machine import hardware

    print(hardware())
    print(f"{'load':<16} {'threads':>7} {'decode tok/s':>13} {'train ms/step':>14}")
    rows = []
    for load in ("idle", "one core busy"):
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load != "idle" else None
        try:
            for threads in (1, 2):
                decode, step = measure("decode", threads), measure("train", threads)
                rows.append({"load": load, "threads": threads, "decode_tok_s": decode["value"],
                             "train_ms_per_step": step["value"]})
                print(f"{load:<16} {threads:>7} {decode['value']:>13.1f} {step['value']:>14.0f}", flush=True)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": hardware(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
