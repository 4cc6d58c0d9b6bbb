"""benchmarks/llamacpp_decode.py runs end to end in .venv-llama (`make llama-env`) on the shipped Q4_1 file, at a
toy size: every row timed, the greedy check's ids written. Skipped where either is missing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
LLAMA_PYTHON = ROOT / ".venv-llama" / "bin" / "python"


def test_script_runs_every_row_and_the_greedy_check(smollm2_gguf, tmp_path):
    if not LLAMA_PYTHON.exists():
        pytest.skip("no .venv-llama (make llama-env builds it)")
    model = smollm2_gguf
    out = tmp_path / "llama.json"
    done = subprocess.run([str(LLAMA_PYTHON), str(ROOT / "benchmarks" / "llamacpp_decode.py"), "--model", str(model),
                           "--threads", "1", "--batch", "1", "2", "--prompt-len", "8", "--new-tokens", "4",
                           "--repeats", "1", "--check-tokens", "4", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(r["batch"], r["type"]) for r in report["rows"]] == [(1, "Q4_1"), (2, "Q4_1")]
    assert all(r["decode_tok_s"] > 0 and r["prefill_ms"] > 0 for r in report["rows"])
    check = report["check"]
    assert check["prompt_ids"] == [504, 3575, 282, 4649, 314]  # "The capital of France is", no BOS (the metadata's)
    assert len(check["greedy_ids"]) == 4 and str(check["greedy_ids"]) in done.stdout
    assert {"cpu", "load_average", "llama_cpp_python"} <= set(report["machine"])
