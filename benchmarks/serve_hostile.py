"""A hostile user against `fullband serve` (vLLM's OpenAI server) on loopback: malformed, wrong-typed and huge
requests, misspelt per-request keys, chat on a base folder, then 48 concurrent streams in three modes with half of
them cancelled after their first chunk; each line says what the server answered. Bounded: every request has a
timeout, and the server is stopped at the end.

    .venv-vllm/bin/python benchmarks/serve_hostile.py     # make serve-env builds .venv-vllm
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

from fullband import ByteTokenizer, FullbandLM, ModelConfig
from fullband.hf.convert import convert

COMPLETIONS = "/v1/completions"
BASE = {"model": "fb", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
HOSTILE = [  # (what, path, body)
    ("chat on a base folder", "/v1/chat/completions",
     {"model": "fb", "messages": [{"role": "user", "content": "hi"}]}),
    ("misspelt per-request key", COMPLETIONS, {**BASE, "vllm_xargs": {"feedbackmode": "fused"}}),
    ("prefill_passes 10**12", COMPLETIONS,
     {**BASE, "vllm_xargs": {"feedback_mode": "fused", "prefill_passes": 10**12}}),
    ("malformed JSON", COMPLETIONS, "{not json"),
    ("a JSON list body", COMPLETIONS, "[]"),
    ("prompt of the wrong type", COMPLETIONS, {**BASE, "prompt": {"a": 1}}),
    ("token id beyond the vocabulary", COMPLETIONS, {**BASE, "prompt": [10**6]}),
    ("negative token id", COMPLETIONS, {**BASE, "prompt": [-1]}),
    ("prompt of 10**6 tokens", COMPLETIONS, {**BASE, "prompt": [5] * 10**6}),
    ("50 MB text prompt", COMPLETIONS, {**BASE, "prompt": "a" * (50 * 2**20)}),
    ("max_tokens 10**9", COMPLETIONS, {**BASE, "max_tokens": 10**9}),
    ("n = 10**5", COMPLETIONS, {**BASE, "n": 10**5}),
    ("temperature -1", COMPLETIONS, {**BASE, "temperature": -1}),
    ("logprobs 10**6", COMPLETIONS, {**BASE, "logprobs": 10**6}),
    ("empty prompt", COMPLETIONS, {**BASE, "prompt": []}),
    ("100,000-deep nesting", COMPLETIONS, "[" * 100_000 + "]" * 100_000),
]
FUSED = {**BASE, "max_tokens": 16, "vllm_xargs": {"feedback_mode": "fused", "prefill_passes": 2}}


def start_server(root: Path) -> tuple[subprocess.Popen, int]:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=259, d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=256,
                      bos_token_id=256)
    FullbandLM(cfg).eval().save(root / "native", tokenizer=ByteTokenizer())  # a base model: no chat template
    convert(root / "native", root / "hf", to="hf")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(Path(sys.executable).parent / "fullband"), "serve", str(root / "hf"), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
           "--max-num-seqs", "32", "--seed", "0", "--served-model-name", "fb"]
    proc = subprocess.Popen(cmd, stdout=open(root / "server.log", "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    t0 = time.monotonic()
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            print(f"server up in {time.monotonic() - t0:.0f} s")
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() - t0 > 300:
                proc.kill()
                sys.exit((root / "server.log").read_text()[-3000:])
            time.sleep(1)


def post(port: int, path: str, body) -> tuple[int | None, str, float]:
    data = body if isinstance(body, str) else json.dumps(body)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.monotonic()
    try:
        conn.request("POST", path, body=data.encode(), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read().decode(errors="replace"), time.monotonic() - t0
    except Exception as err:  # noqa: BLE001 -- reported as the outcome
        return None, f"{type(err).__name__}: {err}", time.monotonic() - t0
    finally:
        conn.close()


def message(status: int | None, text: str) -> str:
    if status == 200:
        return text[:100]
    try:
        return str(json.loads(text).get("error", {}).get("message", text))
    except (ValueError, AttributeError):
        return text


def stream(port: int, i: int, cancel: bool, results: dict, lock: threading.Lock) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {**BASE, "prompt": [5 + i % 7, 6, 7], "max_tokens": 64, "stream": True, "ignore_eos": True,
            "vllm_xargs": {"feedback_mode": ["standard", "soft", "fused"][i % 3]}}
    try:
        conn.request("POST", COMPLETIONS, body=json.dumps(body), headers={"Content-Type": "application/json"})
        response, chunks = conn.getresponse(), 0
        while line := response.readline():
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                chunks += 1
                if cancel:  # hang up after the first chunk
                    conn.sock.shutdown(socket.SHUT_RDWR)
                    break
        outcome = ("cancelled" if cancel else "done", chunks)
    except Exception as err:  # noqa: BLE001 -- reported as the outcome
        outcome = ("error", f"{type(err).__name__}: {err}")
    finally:
        conn.close()
    with lock:
        results[i] = outcome


def main() -> None:
    proc, port = start_server(Path(tempfile.mkdtemp(prefix="serve-hostile-")))
    try:
        for what, path, body in HOSTILE:
            status, text, dt = post(port, path, body)
            print(f"{what:<32} -> {status} in {dt:.1f} s: {message(status, text)[:240]}")
        before = post(port, COMPLETIONS, FUSED)
        results, lock = {}, threading.Lock()
        t0 = time.monotonic()
        threads = [threading.Thread(target=stream, args=(port, i, i % 2 == 1, results, lock)) for i in range(48)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(400)
        done = [v for v in results.values() if v[0] == "done"]
        errors = [v for v in results.values() if v[0] == "error"]
        print(f"48 concurrent streams in {time.monotonic() - t0:.0f} s: {sum(v[1] == 64 for v in done)} of 24 "
              f"complete with 64 tokens, {sum(v[0] == 'cancelled' for v in results.values())} cancelled, "
              f"{len(errors)} errors {errors[:3]}")
        after = post(port, COMPLETIONS, FUSED)
        same = json.loads(after[1])["choices"][0]["text"] == json.loads(before[1])["choices"][0]["text"]
        print(f"a FUSED k=2 request after the streams gives the same text as before them: {same}; "
              f"server alive: {proc.poll() is None}")
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
