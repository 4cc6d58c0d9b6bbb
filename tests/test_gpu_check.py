"""benchmarks/gpu_check.py's CPU dry run (`--device cpu --quick`): every row runs at its toy size, prints its
figures in the table (the vLLM row: skipped, with why), and a row made to fail is printed as FAILED with its reason
while the others still run."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_cpu_run_prints_every_row_and_survives_a_failing_one(tmp_path):
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + (os.pathsep + path if path else ""),
           "VLLM_PYTHON": sys.executable}  # the vLLM row's interpreter: this one
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--out", str(tmp_path), "--fail", "nccl"], capture_output=True, text=True, env=env)
    assert done.returncode == 1, done.stdout + done.stderr  # one row failed
    table = [line.strip("| ").split(" | ") for line in done.stdout.splitlines() if line.startswith("| ")]
    assert table[0] == ["check", "result", "est. s (GPU)", "seconds", "figures"]
    rows = {name: (result, note) for name, result, _, _, note in table[1:]}
    assert list(rows) == ["vllm v2", "train", "nccl", "decode", "bench", "d20 k=1", "d20 k=2"]
    if importlib.util.find_spec("vllm") is None:
        assert rows["vllm v2"] == ("ok", f"skipped: vLLM not installed ({sys.executable})")
    else:  # vLLM's CPU build, or a CPU run
        assert rows["vllm v2"][1].startswith("skipped: Model Runner V2 runs on CUDA; this run is on cpu")
    assert rows["nccl"] == ("FAILED", "RuntimeError: made to fail by --fail 'nccl'")
    assert all(result == "ok" for name, (result, _) in rows.items() if name != "nccl"), done.stdout
    bench = rows["bench"][1]
    for batch in (1, 8):
        assert re.search(rf"b{batch}: STANDARD [\d,]+ tok/s, SOFT [+-]\d+\.\d% \(alternating steps [+-]\d+\.\d%\), "
                         r"FUSED k=1 [+-]\d+\.\d%", bench), bench
    one, two = rows["d20 k=1"][1], rows["d20 k=2"][1]
    assert one.startswith("D 64, 2 layers, 2 heads of 32, vocabulary 512 untied") and "batch 2 x 64" in one
    for note in (one, two):
        assert re.search(r"[\d,]+ tokens/s \(\d+\.\d ms/step", note), note
        assert re.search(r"6\*N\*k = [\d.e-]+ G, N = \d+\.\dM non-embedding", note), note
        assert re.search(r"train_flops [\d.e-]+ G, causal attention / [\d.e-]+ G with dense attention", note), note
    assert re.search(r"step \d+\.\d\dx the one-pass step", two), two
    assert "anchors at d20" in done.stdout and "47.6% MFU on H100s" in done.stdout
