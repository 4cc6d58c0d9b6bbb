"""One pass over every CUDA path fullband has (run by benchmarks/gpu_check.sh on a GPU machine, ~5 minutes on one
GPU), printed as one table:

  train    a few steps of configs/small.toml in bfloat16 autocast with compiled blocks and the 75/22/3 pass
           schedule (NorMuon's Newton-Schulz runs in bfloat16 on CUDA): tokens/s and MFU
  nccl     a process group on the NCCL backend and an all-reduce (one process: the collective path, not bandwidth)
  decode   greedy decoding on CUDA in every mode, float32, tokens compared with the CPU float32 reference
  bench    `fullband bench decode` at the paper-1b shape (bfloat16): tokens/s and SOFT overhead over STANDARD

`--device cpu --quick` runs the same script at toy sizes on a CPU (what CI-like machines can check of it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# dense bfloat16 peak of the GPUs we know (TFLOP/s); MFU is reported only for these
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0}


def cli(*args: str, log: Path) -> subprocess.CompletedProcess:
    with open(log, "w") as f:
        return subprocess.run([sys.executable, "-m", "fullband.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                              cwd=ROOT, check=False)


def check_train(out: Path, device: str, quick: bool) -> dict:
    run = out / "train"
    steps = 12 if quick else 40
    sets = [f"train.steps={steps}", "train.warmup_steps=2", f'train.device="{device}"', 'train.passes="one-two-three"',
            f'log.run_dir="{run}"', "log.eval_every=0", "log.ckpt_every=0", "log.progress=false",
            f'data.cache_dir="{out / "cache"}"']
    if device == "cuda":
        sets += ['train.dtype="bfloat16"', "train.compile=true"]
    if quick:
        sets += ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "train.seq_len=64",
                 "train.global_batch_tokens=512", "train.micro_batch=8", 'data.tokenizer="byte"', "model.vocab_size=259",
                 'data.corpus="' + str(Path(os.__file__).parent / "json") + '"']
    t0 = time.perf_counter()
    done = cli("train", "configs/small.toml", *[a for s in sets for a in ("--set", s)], log=out / "train.log")
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        return {"ok": False, "note": f"fullband train exited {done.returncode}; see {out / 'train.log'}"}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss_pass" in r][steps // 2:]  # past compilation and warmup
    tok_s = statistics.median(r["tok_per_s"] for r in rows)
    mean_k = statistics.fmean(r["k"] for r in rows)
    from fullband.model.decoder import FullbandLM
    from fullband.train.config import load_run_config

    cfg = load_run_config(run / "run.json")
    with torch.device("meta"):
        n = FullbandLM(cfg.model).num_params()
    flops = 6 * n * tok_s * mean_k  # per training token: forward + backward of k passes (attention not counted)
    name = torch.cuda.get_device_name(0) if device == "cuda" else ""
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    mfu = f"{100 * flops / (peak * 1e12):.1f}%" if peak else "n/a"
    return {"ok": True, "note": f"{tok_s:,.0f} tokens/s, mean k {mean_k:.2f}, {n / 1e6:.1f}M params, MFU {mfu} "
                                f"(6*N*k FLOPs/token), {wall:.0f}s incl. data and compile"}


def check_nccl(device: str) -> dict:
    if device != "cuda":
        return {"ok": True, "note": "skipped (CPU run)"}
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("nccl", rank=0, world_size=1)
    x = torch.arange(4, device="cuda", dtype=torch.float32)
    dist.all_reduce(x)
    dist.destroy_process_group()
    return {"ok": bool(torch.equal(x.cpu(), torch.arange(4.0))), "note": "init + all_reduce on the NCCL backend"}


def check_decode(device: str) -> dict:
    from fullband import FullbandLM, ModelConfig, generate

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=4, max_seq_len=256, bos_token_id=0)
    cpu = FullbandLM(cfg).eval()
    dev = FullbandLM(cfg).to(device).eval()
    dev.load_state_dict(cpu.state_dict())
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (9, 17, 5)]  # ragged
    notes, ok = [], True
    for mode, k in (("standard", 0), ("soft", 0), ("fused", 1), ("fused", "auto"), ("exact", 0)):
        a = generate(cpu, prompts, 24, mode=mode, prefill_passes=k)
        b = generate(dev, prompts, 24, mode=mode, prefill_passes=k)
        same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
        total = sum(len(r) for r in a)
        ok &= same == total
        notes.append(f"{mode}{'' if mode != 'fused' else f':{k}'} {same}/{total}")
    return {"ok": ok, "note": "greedy tokens equal to CPU float32: " + ", ".join(notes)}


def check_bench(out: Path, device: str, quick: bool) -> dict:
    if quick:
        args = ["--config", "tiny", "--batch-sizes", "1", "--dtypes", "float32", "--repeats", "1", "--new-tokens", "8"]
    else:
        args = ["--config", "configs/paper-1b.toml", "--batch-sizes", "1", "8", "--dtypes", "bfloat16", "--repeats", "3"]
    done = cli("bench", "decode", *args, "--no-hf", "--json", str(out / "bench.json"), log=out / "bench.log")
    if done.returncode != 0:
        return {"ok": False, "note": f"fullband bench decode exited {done.returncode}; see {out / 'bench.log'}"}
    result = json.loads((out / "bench.json").read_text())
    std = {(r["dtype"], r["batch"]): r["tokens_per_s"] for r in result["rows"] if r["variant"] == "standard"}
    soft = {k: v for k, v in result.items() if k.startswith("soft_overhead/")}
    return {"ok": True, "note": "STANDARD " + ", ".join(f"{d} b{b}: {v:,.0f} tok/s" for (d, b), v in std.items())
                                + "; SOFT overhead " + ", ".join(f"{k.split('/', 1)[1]}: {100 * v:+.1f}%"
                                                                 for k, v in soft.items())
                                + f" (theory {100 * result['theory_soft_overhead']:+.1f}%)"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="toy sizes (for a CPU dry run of the script itself)")
    p.add_argument("--out", default=None, help="where runs and logs go (default: a temporary folder)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here; run it on a GPU machine (or --device cpu --quick)")
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="fullband-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU {gpu}; logs under {out}", flush=True)
    rows = []
    for name, check in (("train", lambda: check_train(out, args.device, args.quick)),
                        ("nccl", lambda: check_nccl(args.device)),
                        ("decode", lambda: check_decode(args.device)),
                        ("bench", lambda: check_bench(out, args.device, args.quick))):
        t0 = time.perf_counter()
        try:
            res = check()
        except Exception as err:  # one failing path must not hide the others
            res = {"ok": False, "note": f"{type(err).__name__}: {err}"}
        rows.append((name, res["ok"], time.perf_counter() - t0, res["note"]))
        print(f"  {name}: {'ok' if res['ok'] else 'FAILED'} ({rows[-1][2]:.0f}s)", flush=True)
    print("\n| check | result | seconds | figures |\n|---|---|---|---|")
    for name, ok, secs, note in rows:
        print(f"| {name} | {'ok' if ok else 'FAILED'} | {secs:.0f} | {note} |")
    return 0 if all(ok for _, ok, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
