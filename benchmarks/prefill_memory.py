"""Peak memory of a FUSED prefill against its number of passes (adaptive prefill that runs to its cap).

Each measurement runs in a fresh process: a model is built and warmed up, then one generation whose prompt is read
with 1 + K Jacobi passes; the figure is how far the process's peak resident memory rose during that call. The pass
loop keeps the current and the previous pass's states alive, so the figure should not grow with K; a loop that
kept every pass's state would grow by about one state per pass. Two columns: glibc's allocator as it comes (it may
keep freed blocks of this size in its heap, so the peak also shows fragmentation), and with its mmap threshold
fixed (MALLOC_MMAP_THRESHOLD_: every large tensor is mapped and unmapped, so the peak is the live memory).

    python benchmarks/prefill_memory.py                     # the installed fullband
    PYTHONPATH=OTHER/src python benchmarks/prefill_memory.py # another checkout, for a side-by-side

Uses only fullband.generate's public arguments, so any version of fullband runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, resource, sys, torch
import fullband as fb
torch.manual_seed(0)
torch.set_num_threads(int(sys.argv[5]))
B, T, D, K = (int(a) for a in sys.argv[1:5])
model = fb.FullbandLM(fb.ModelConfig(vocab_size=259, d_model=D, n_layers=1, n_heads=4, max_seq_len=T + 8)).eval()
prompts = torch.randint(0, 256, (B, T))
def run(k):
    step = next(fb.stream(model, prompts, 1, mode="fused", prefill_passes="auto", prefill_tol=1e-30,
                          max_prefill_passes=k))
    return step.prefill_passes
run(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
passes = run(K)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"passes": passes, "peak_rise_mib": (after - before) / 1024}))
"""


def measure(batch: int, length: int, width: int, fused: int, threads: int, *, live: bool) -> dict:
    env = {**os.environ, **({"MALLOC_MMAP_THRESHOLD_": "131072"} if live else {})}
    out = subprocess.run([sys.executable, "-c", CHILD, str(batch), str(length), str(width), str(fused), str(threads)],
                         capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--passes", type=int, nargs="+", default=[2, 32], help="fused passes K (the adaptive cap)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    import fullband
    from fullband.machine import hardware

    state = args.batch * args.length * args.width * 4 / 2**20
    print(f"fullband {fullband.__version__} from {fullband.__file__}; {hardware()} ({args.threads} in the runs)")
    print(f"prompts {args.batch} x {args.length}, d_model {args.width}: one pass's state is {state:.1f} MiB")
    print(f"{'fused passes':>12} {'passes run':>10} {'peak rise MiB':>14} {'live (fixed mmap) MiB':>22}")
    rows = []
    for k in args.passes:
        r = measure(args.batch, args.length, args.width, k, args.threads, live=False)
        live = measure(args.batch, args.length, args.width, k, args.threads, live=True)["peak_rise_mib"]
        rows.append({"fused_passes": k, **r, "live_peak_rise_mib": live, "state_mib": state})
        print(f"{k:>12} {r['passes']:>10} {r['peak_rise_mib']:>14.1f} {live:>22.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": hardware(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
