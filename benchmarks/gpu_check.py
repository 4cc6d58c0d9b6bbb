"""One pass over every CUDA path fullband has, and training steps at nanochat's d20 shape set against reference
figures (run by benchmarks/gpu_check.sh on a GPU machine), printed as one table. The rows, with the time each is
estimated to take on one H100-class GPU (BUDGET_S; about 10 minutes in all, the most the check may take):

  vllm v2  (120 s, a guess: not yet run on a GPU) tests/test_vllm.py's token-for-token tests against
           fullband.generate (every mode on a ragged batch, modes mixed in one batch, fed states returned, chunked
           prefill with prefix caching, preemption) on vLLM's Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1), and
           that the workers ran V2 with fullband's model state (fullband.vllm.runner_v2). Run first, in its own
           process (vLLM takes most of the GPU's memory), with the interpreter in $VLLM_PYTHON, else .venv-vllm's,
           else this one; skipped, as a row, where that interpreter has no vLLM, a vLLM without V2, or a vLLM
           that is not a CUDA build (vLLM's CPU build runs V1 only), and on a CPU run
  train    (150 s) a few steps of configs/small.toml in bfloat16 autocast with compiled blocks and the 75/22/3 pass
           schedule (NorMuon's Newton-Schulz runs in bfloat16 on CUDA): tokens/s and MFU (6 N k FLOPs per token,
           N every parameter); most of the time is the tokenizer, the data and compiling
  nccl     (10 s) a process group on the NCCL backend and an all-reduce (one process: the collective path, not
           bandwidth)
  decode   (20 s) greedy decoding on CUDA in every mode, float32, tokens compared with the CPU float32 reference
  bench    (90 s) `fullband bench decode --device cuda` at the paper-1b shape (configs/paper-1b.toml, bfloat16),
           batch 1 and 8: STANDARD tokens/s and the decode overhead of SOFT and FUSED k=1 over STANDARD, every
           mode timed side by side in one process (SOFT also from alternating single steps)
  d20 k=1  (120 s) the d20-like shape: D 1280, 20 layers, 10 heads of 128, sequence 2048, nanochat's vocabulary of
           65,536 with untied embeddings as nanochat's (fullband's defaults otherwise: SwiGLU d_ff 3456, QK-norm,
           gated fusion; 568M parameters); a random-token micro-batch of 4 x 2048 (D20_WINDOWS), the blocks compiled
           as the trainer compiles them (fullband.train.build), bfloat16 autocast. A step is the forward and
           backward of fullband.model.objective with k = 1 and the NorMuon + AdamW update (constant learning
           rate, no clipping); a few warm-up steps (the first compiles), then timed steps (median, CUDA
           synchronised): tokens/s, MFU, peak memory (torch.cuda.max_memory_allocated, reset before the row;
           weights, gradients and optimizer state included)
  d20 k=2  (90 s) the same with two-pass steps (the second pass may compile again), and the step-time ratio over
           the one-pass step

MFU is FLOPs per token x tokens/s over the GPU's dense bfloat16 peak (PEAK_TFLOPS), the FLOPs counted three ways:
6 N k (N the non-embedding parameters: every one but the input embedding's, so the blocks, the untied LM head and
the fusion; attention not counted), fullband.model.flops.train_flops (matrix products and causal attention, the
fusion on the second pass only) and the same with attention over all T keys, which is nanochat's estimate_flops
(6 N + 12 layers D T per token and pass). Figures to compare with (ANCHORS, printed under the table): the paper author's
nanochat-based reproduction at d20 on A100s, ~60% bfloat16 MFU for one pass, a two-pass step 1.95x the
one-pass step, peak memory 41.6 -> 74.8 GB (at that run's micro-batch: memory grows with it); nanochat's own d20
run, 47.6% MFU on H100s.

Each row is guarded: one that raises (out of memory, a compile error, a missing kernel) is printed as FAILED with
a one-line reason and the next row runs; the table is printed at the end in any case. `--fail ROW` makes a row
raise before it starts (to see that path work). `--device cpu --quick` runs the same script at toy sizes on a CPU
(what CI-like machines can check of it): the d20 rows at D 64, 2 layers, 2 heads, vocabulary 512, sequence 64,
float32, not compiled; the bench row on the tiny preset in float32.
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
# (matched in order against torch.cuda.get_device_name: the first name it contains wins, so the more specific first)
PEAK_TFLOPS = {"GH200": 989.0, "H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0,
               "A10": 125.0, "L4": 121.0}
# estimated seconds of each row on one H100-class GPU (module docstring); the table prints them beside the times
BUDGET_S = {"vllm v2": 120, "train": 150, "nccl": 10, "decode": 20, "bench": 90, "d20 k=1": 120, "d20 k=2": 90}
D20_WINDOWS = 4  # sequences of 2048 per d20 step: the two-pass step fits an 80 GB card with room to spare
ANCHORS = ("anchors at d20: the paper author's nanochat-based reproduction on A100s, ~60% bfloat16 MFU for one pass, "
           "a two-pass step 1.95x the one-pass step, peak memory 41.6 -> 74.8 GB (at its own micro-batch); nanochat "
           "d20, 47.6% MFU on H100s. nanochat counts FLOPs as the 'dense attention' MFU above does.")


def cli(*args: str, log: Path) -> subprocess.CompletedProcess:
    with open(log, "w") as f:
        return subprocess.run([sys.executable, "-m", "fullband.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                              cwd=ROOT, check=False)


def peak_tflops(device: str) -> float | None:
    """The dense bfloat16 peak of this GPU (PEAK_TFLOPS), None on a CPU or a GPU not listed."""
    name = torch.cuda.get_device_name(0) if device == "cuda" else ""
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def mfu(flops_per_s: float, peak: float | None) -> str:
    return f"{100 * flops_per_s / (peak * 1e12):.1f}%" if peak else "n/a"


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
    return {"ok": True, "note": f"{tok_s:,.0f} tokens/s, mean k {mean_k:.2f}, {n / 1e6:.1f}M params, MFU "
                                f"{mfu(flops, peak_tflops(device))} (6*N*k FLOPs/token), {wall:.0f}s incl. data and "
                                "compile"}


# the token-for-token vLLM tests the V2 row runs (pytest -k), and its time limit
VLLM_V2_TESTS = ("ragged_batch or mixes_modes or the_model_runner_the_plugin_chose or fed_states_are_returned or "
                 "chunked_prefill or preemption")
VLLM_V2_LIMIT_S = 420


def vllm_python() -> str:
    """The interpreter for the vLLM row: $VLLM_PYTHON, else `make test`'s .venv-vllm, else this one."""
    venv = ROOT / ".venv-vllm" / "bin" / "python"
    return os.environ.get("VLLM_PYTHON") or (str(venv) if venv.exists() else sys.executable)


def vllm_platform(python: str) -> str:
    """What the interpreter's vLLM can run: "cuda", another platform's name, "no vLLM" or "no V2"."""
    probe = ("import importlib.util as u, sys\n"
             "if u.find_spec('vllm') is None: print('no vLLM'); sys.exit()\n"
             "if u.find_spec('vllm.v1.worker.gpu.model_states') is None: print('no V2'); sys.exit()\n"
             "from vllm.platforms import current_platform; print(current_platform.device_type)")
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{python} could not say what its vLLM runs on: {one_line(RuntimeError(done.stderr))}")
    return lines[-1]


def check_vllm_v2(out: Path, device: str) -> dict:
    python = vllm_python()
    where = vllm_platform(python)
    if where == "no vLLM":
        return {"ok": True, "note": f"skipped: vLLM not installed ({python})"}
    if where == "no V2":
        return {"ok": True, "note": f"skipped: this vLLM has no Model Runner V2 ({python})"}
    if device != "cuda" or where != "cuda":
        return {"ok": True, "note": f"skipped: Model Runner V2 runs on CUDA; this run is on {device}, its vLLM "
                                    f"({python}) on {where}"}
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "1",
           "PYTHONPATH": str(ROOT / "src") + (os.pathsep + path if path else "")}
    log = out / "vllm-v2.log"
    try:
        with open(log, "w") as f:
            done = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_vllm.py", "-k",
                                   VLLM_V2_TESTS], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, check=False,
                                  timeout=VLLM_V2_LIMIT_S)
    except subprocess.TimeoutExpired:
        return {"ok": False, "note": f"tests/test_vllm.py on V2 ran past {VLLM_V2_LIMIT_S}s; see {log}"}
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    summary = next((line.strip("= ") for line in reversed(lines) if " passed" in line or " failed" in line
                    or " error" in line), "no pytest summary")
    return {"ok": done.returncode == 0, "note": f"tests/test_vllm.py on Model Runner V2: {summary}; see {log}"}


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
    config, dtype = ("tiny", "float32") if quick else ("configs/paper-1b.toml", "bfloat16")
    args = ["--config", config, "--batch-sizes", "1", "8", "--dtypes", dtype, "--device", device]
    args += ["--repeats", "1", "--new-tokens", "8"] if quick else ["--repeats", "3"]
    done = cli("bench", "decode", *args, "--no-hf", "--json", str(out / "bench.json"), log=out / "bench.log")
    if done.returncode != 0:
        return {"ok": False, "note": f"fullband bench decode exited {done.returncode}; see {out / 'bench.log'}"}
    result = json.loads((out / "bench.json").read_text())

    def pct(key: str) -> str:
        return f"{100 * result[key]:+.1f}%"

    cells = [(r["dtype"], r["batch"], r["tokens_per_s"]) for r in result["rows"] if r["variant"] == "standard"]
    return {"ok": True, "note": f"{config} {dtype} on {result['device']}, over STANDARD: " + "; ".join(
        f"b{b}: STANDARD {v:,.0f} tok/s, SOFT {pct(f'soft_overhead/{d}/b{b}')} (alternating steps "
        f"{pct(f'soft_overhead_paired_steps/{d}/b{b}')}), FUSED k=1 {pct(f'fused_decode_overhead/{d}/b{b}')}"
        for d, b, v in cells) + f" (SOFT's theory {pct('theory_soft_overhead')})"}


class D20:
    """The two d20 rows' shared run, built by the first row that needs it: the model and its optimizer
    (fullband.train.build, as a run builds them: on the device, the blocks compiled on CUDA), one random-token
    micro-batch, and each row's median step time (the two-pass row reports its ratio to the one-pass step)."""

    def __init__(self, device: str, quick: bool) -> None:
        self.device, self.quick = device, quick
        self.built = None
        self.step_s: dict[int, float] = {}

    def config(self):
        """The d20-like run config (module docstring); --quick: the toy stand-in."""
        from fullband.model.config import ModelConfig
        from fullband.train.config import RunConfig, TrainConfig

        if self.quick:
            model = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=2, max_seq_len=64, tie_embeddings=False)
        else:
            model = ModelConfig(vocab_size=65536, d_model=1280, n_layers=20, n_heads=10, max_seq_len=2048,
                                tie_embeddings=False)
        windows, cuda = (2 if self.quick else D20_WINDOWS), self.device == "cuda"
        train = TrainConfig(seq_len=model.max_seq_len, micro_batch=windows, device=self.device, compile=cuda,
                            global_batch_tokens=windows * model.max_seq_len, dtype="bfloat16" if cuda else "float32")
        return RunConfig(model=model, train=train)

    def build(self):
        from fullband.train.build import build
        from fullband.train.parallel import init_distributed

        cfg = self.config()
        d = init_distributed(cfg.train.device)
        built = build(cfg, d, warm=False)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.train.seq_len), generator=g)
        return cfg, built.model, built.optimizer, ids.to(d.device)

    def row(self, k: int) -> dict:
        from fullband.model.flops import train_flops
        from fullband.model.objective import objective
        from fullband.train.trainer import _autocast

        if self.built is None:
            self.built = self.build()
        cfg, model, optimizer, ids = self.built
        cuda = ids.device.type == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        targets, gen = ids.roll(-1, 1), torch.Generator(device=ids.device).manual_seed(k)
        warmup, steps = (1, 2) if self.quick else (4, 20)  # the first step compiles
        optimizer.zero_grad(set_to_none=True)  # what a failed row left behind is not this row's memory
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for i in range(warmup + steps):
            sync()
            t0 = time.perf_counter()
            with _autocast(cfg.train.dtype, ids.device):  # as the trainer runs a micro-batch
                objective(model, ids, targets, k, generator=gen).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        self.step_s[k] = step_s = statistics.median(times)
        tok_s = ids.numel() / step_s
        m, seq, peak = cfg.model, cfg.train.seq_len, peak_tflops(self.device)
        n = model.num_params() - model.embed.weight.numel()
        causal, dense = (train_flops(m, k, seq_len=seq, context=c) for c in ("causal", "dense"))
        if k == 1:
            head = (f"D {m.d_model}, {m.n_layers} layers, {m.n_heads} heads of {m.head_dim}, vocabulary "
                    f"{m.vocab_size:,} untied, {model.num_params() / 1e6:.1f}M params; ")
            ratio = ""
        else:
            head = ""
            ratio = (f", step {step_s / self.step_s[1]:.2f}x the one-pass step" if 1 in self.step_s
                     else ", no one-pass step to compare with (its row failed)")
        memory = f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else "peak memory: CUDA only"
        compiled = ", blocks compiled" if cfg.train.compile else ""
        return {"ok": True, "note": f"{head}batch {ids.shape[0]} x {seq} random tokens, {cfg.train.dtype}{compiled}: "
                                    f"{tok_s:,.0f} tokens/s ({1000 * step_s:.1f} ms/step, median of {steps}{ratio}); "
                                    f"MFU {mfu(6 * n * k * tok_s, peak)} / {mfu(causal * tok_s, peak)} / "
                                    f"{mfu(dense * tok_s, peak)} (FLOPs per token: 6*N*k = {6 * n * k / 1e9:.3g} G, "
                                    f"N = {n / 1e6:.1f}M non-embedding, no attention / train_flops {causal / 1e9:.3g} "
                                    f"G, causal attention / {dense / 1e9:.3g} G with dense attention); {memory}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="toy sizes (for a CPU dry run of the script itself)")
    p.add_argument("--out", default=None, help="where runs and logs go (default: a temporary folder)")
    p.add_argument("--fail", choices=list(BUDGET_S), help="make this row raise before it starts (checks the guard)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here; run it on a GPU machine (or --device cpu --quick)")
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="fullband-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU {gpu}; logs under {out}; estimated "
          f"{sum(BUDGET_S.values()) / 60:.0f} minutes on one H100-class GPU", flush=True)
    d20 = D20(args.device, args.quick)
    checks = {"vllm v2": lambda: check_vllm_v2(out, args.device),
              "train": lambda: check_train(out, args.device, args.quick),
              "nccl": lambda: check_nccl(args.device),
              "decode": lambda: check_decode(args.device),
              "bench": lambda: check_bench(out, args.device, args.quick),
              "d20 k=1": lambda: d20.row(1),
              "d20 k=2": lambda: d20.row(2)}
    rows = []
    for name, check in checks.items():
        t0 = time.perf_counter()
        try:
            if name == args.fail:
                raise RuntimeError(f"made to fail by --fail {name!r}")
            res = check()
        except Exception as err:  # one failing path must not hide the others
            res = {"ok": False, "note": one_line(err)}
        rows.append((name, res["ok"], time.perf_counter() - t0, res["note"]))
        print(f"  {name}: {'ok' if res['ok'] else 'FAILED'} ({rows[-1][2]:.0f}s)", flush=True)
    print("\n| check | result | est. s (GPU) | seconds | figures |\n|---|---|---|---|---|")
    for name, ok, secs, note in rows:
        print(f"| {name} | {'ok' if ok else 'FAILED'} | {BUDGET_S[name]} | {secs:.0f} | {note} |")
    print(f"\n{ANCHORS}")
    return 0 if all(ok for _, ok, _, _ in rows) else 1


def one_line(err: Exception, limit: int = 300) -> str:
    """An exception as one table cell: its type and the first line of its message (compile errors run to pages),
    at most `limit` characters."""
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    text = f"{type(err).__name__}: {first}".replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


if __name__ == "__main__":
    sys.exit(main())
