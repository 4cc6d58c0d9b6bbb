"""llama.cpp's side of the decode benchmark: greedy decode speed of GGUF models through llama-cpp-python's low-level
API, for each model x threads x batch.

Batch B is B sequences (seq_ids 0..B-1) decoded together: one llama_decode per step holds one token of each. Batch 1
takes the same path. Each row: the prompt (`--prompt-len` fixed token ids, a different window of one English text
per sequence) read in one llama_decode (prefill, timed apart), then `--new-tokens` decode steps, each a llama_decode
of the B last tokens and a greedy argmax of their logits. Decode tokens/s = B x new-tokens / the steps' time (the
prefill excluded). Repetitions are interleaved (round r times every row once); the table gives medians.

Then one correctness check at batch 1: the greedy tokens of the F32 model (general.file_type 0; else the first
model) for a short prompt, printed to compare with another implementation's greedy tokens.

Run with the llama.cpp environment (`make llama-env`; this script imports llama_cpp and numpy only):
  .venv-llama/bin/python benchmarks/llamacpp_decode.py --model a.Q4_1.gguf --model a.F32.gguf --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import llama_cpp as lc

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
        "from Mainz, combined movable metal type, oil-based ink and a wooden screw press into a system that could "
        "produce books quickly and cheaply. Within a few decades, printing shops had spread to more than two hundred "
        "cities across Europe, and millions of copies of books, pamphlets and broadsheets were in circulation. The "
        "new technology changed how people learned, argued and worshipped, and it helped to standardise spelling "
        "and grammar in many languages. Scholars could compare identical copies of a text for the first time, "
        "which made it easier to correct errors and build on the work of others.")

FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 15: "Q4_K_M", 17: "Q5_K_M",
              18: "Q6_K", 32: "BF16"}


@lc.llama_log_callback
def _log(level, text, user_data):  # llama.cpp's errors only (its info lines would bury the table)
    if level == 4:  # GGML_LOG_LEVEL_ERROR
        sys.stderr.write(text.decode("utf-8", "replace"))


def cpu_model() -> str:  # fullband.machine.cpu_model's rule: this environment has no fullband (nor torch)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict:
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()),
            "python": platform.python_version(), "llama_cpp_python": lc.__version__,
            "llama_cpp_system_info": lc.llama_print_system_info().decode().strip()}


class Model:
    """A GGUF model loaded once (mmap); contexts are made per row."""

    def __init__(self, path: str):
        self.path = path
        params = lc.llama_model_default_params()
        params.use_extra_bufts = False  # llama.cpp's AMX matmul on repacked Q4 / Q8 weights crashes on AMX Xeons
        self.ptr = lc.llama_model_load_from_file(path.encode(), params)
        if not self.ptr:
            raise SystemExit(f"llama.cpp could not load {path}")
        self.vocab = lc.llama_model_get_vocab(self.ptr)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        buf = ctypes.create_string_buffer(64)
        ft = int(buf.value) if lc.llama_model_meta_val_str(self.ptr, b"general.file_type", buf, 64) > 0 else None
        self.file_type = ft
        self.type = FILE_TYPES.get(ft, str(ft))
        self.bytes = lc.llama_model_size(self.ptr)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`, with a BOS only where the file's metadata asks for one (add_special)."""
        raw = text.encode()
        out = (lc.llama_token * (len(raw) + 8))()
        n = lc.llama_tokenize(self.vocab, raw, len(raw), out, len(out), True, False)
        if n < 0:
            raise RuntimeError(f"tokenize failed ({n})")
        return list(out[:n])

    def piece(self, token: int) -> str:
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:max(n, 0)].decode("utf-8", "replace")

    def free(self) -> None:
        lc.llama_model_free(self.ptr)


class Row:
    """One model x threads x batch: a context with room for `batch` sequences of prompt + new tokens."""

    def __init__(self, model: Model, threads: int, batch: int, prompts: list[list[int]], new_tokens: int):
        self.model, self.threads, self.batch, self.prompts, self.new_tokens = model, threads, batch, prompts, new_tokens
        per_seq = -(-(len(prompts[0]) + new_tokens + 1) // 256) * 256  # llama.cpp pads contexts to 256
        params = lc.llama_context_default_params()
        params.n_ctx = batch * per_seq
        params.n_seq_max = batch
        params.n_batch = params.n_ubatch = max(batch * len(prompts[0]), batch, 512)
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(model.ptr, params)
        if not self.ctx:
            raise SystemExit(f"llama.cpp could not make a context ({model.path}, batch {batch})")
        if lc.llama_n_ctx(self.ctx) < batch * per_seq:
            raise SystemExit(f"context of {lc.llama_n_ctx(self.ctx)} tokens < {batch} x {per_seq}")
        self.mem = lc.llama_get_memory(self.ctx)
        self.prefill_batch = lc.llama_batch_init(batch * len(prompts[0]), 0, 1)
        self.step_batch = lc.llama_batch_init(batch, 0, 1)
        self.prefill_ms: list[float] = []
        self.tok_s: list[float] = []

    @staticmethod
    def _fill(b, tokens: list[int], positions: list[int], seqs: list[int], outputs: list[bool]) -> None:
        b.n_tokens = len(tokens)
        for i, (t, p, s, o) in enumerate(zip(tokens, positions, seqs, outputs)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = t, p, 1, s, o

    def _decode(self, b) -> np.ndarray:
        """Run the batch; the greedy next token of each sequence (the outputs are one per sequence, in order)."""
        rc = lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        logits = np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(self.batch, self.model.n_vocab))
        return logits.argmax(axis=1)

    def run(self, new_tokens: int | None = None, record: bool = True) -> list[list[int]]:
        """Prefill, then `new_tokens` greedy steps; returns each sequence's generated ids (new_tokens + 1 of them:
        the prefill's and one per step)."""
        steps = self.new_tokens if new_tokens is None else new_tokens
        lc.llama_memory_clear(self.mem, True)
        n = len(self.prompts[0])
        self._fill(self.prefill_batch, [t for p in self.prompts for t in p],
                   [i for _ in self.prompts for i in range(n)], [s for s in range(self.batch) for _ in range(n)],
                   [i == n - 1 for _ in self.prompts for i in range(n)])
        start = time.perf_counter()
        nxt = self._decode(self.prefill_batch)
        prefill = time.perf_counter() - start
        out = [[int(t)] for t in nxt]
        seqs = list(range(self.batch))
        start = time.perf_counter()
        for step in range(steps):
            self._fill(self.step_batch, [int(t) for t in nxt], [n + step] * self.batch, seqs, [True] * self.batch)
            nxt = self._decode(self.step_batch)
            for row, t in zip(out, nxt):
                row.append(int(t))
        elapsed = time.perf_counter() - start
        if record:
            self.prefill_ms.append(prefill * 1e3)
            self.tok_s.append(self.batch * steps / elapsed)
        return out

    def free(self) -> None:
        lc.llama_batch_free(self.prefill_batch)
        lc.llama_batch_free(self.step_batch)
        lc.llama_free(self.ctx)


def prompts_for(model: Model, batch: int, length: int) -> list[list[int]]:
    """`batch` prompts of `length` ids: windows of the fixed text starting one token apart, so the sequences differ."""
    ids = model.tokenize(TEXT)
    while len(ids) < length + batch:
        ids = ids + ids
    return [ids[b:b + length] for b in range(batch)]


def check(model: Model, threads: int, prompt: str, new_tokens: int) -> dict:
    ids = model.tokenize(prompt)
    row = Row(model, threads, 1, [ids], new_tokens - 1)
    try:
        out = row.run(record=False)[0]
    finally:
        row.free()
    return {"model": model.path, "prompt": prompt, "prompt_ids": ids, "greedy_ids": out,
            "text": "".join(model.piece(t) for t in out)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True, help="a GGUF file (repeatable)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check-prompt", default="The capital of France is")
    ap.add_argument("--check-tokens", type=int, default=16)
    ap.add_argument("--json", help="write the rows and the machine here")
    args = ap.parse_args(argv)
    if min(args.threads + args.batch + [args.prompt_len, args.new_tokens, args.repeats, args.check_tokens]) < 1:
        ap.error("threads, batch, prompt length, new tokens, repeats and check tokens must be >= 1")

    lc.llama_log_set(_log, ctypes.c_void_p(0))
    lc.llama_backend_init()
    start_machine = machine()
    models = [Model(p) for p in args.model]
    rows = [Row(m, t, b, prompts_for(m, b, args.prompt_len), args.new_tokens)
            for m in models for t in args.threads for b in args.batch]
    print(f"{start_machine['cpu']}, {start_machine['cpu_count']} cores, load average "
          f"{' '.join(f'{x:.2f}' for x in start_machine['load_average'])}; llama-cpp-python {lc.__version__}",
          flush=True)
    for row in rows:  # warm-up: page the weights in, size the compute buffers
        row.run(new_tokens=4, record=False)
    round_load = []  # the 1-minute load average after each round (this process counts in it)
    for r in range(args.repeats):
        for row in rows:
            row.run()
        round_load.append(os.getloadavg()[0])
        print(f"round {r + 1}/{args.repeats} done, load average {round_load[-1]:.2f}", flush=True)

    out_rows = []
    header = f"{'model':<44} {'type':>6} {'threads':>7} {'batch':>5} {'decode tok/s':>12} {'prefill ms':>10}"
    print(header)
    print("-" * len(header))
    for row in rows:
        rec = {"model": row.model.path, "type": row.model.type, "file_type": row.model.file_type,
               "model_bytes": row.model.bytes, "threads": row.threads, "batch": row.batch,
               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
               "decode_tok_s": statistics.median(row.tok_s), "prefill_ms": statistics.median(row.prefill_ms),
               "decode_tok_s_all": row.tok_s, "prefill_ms_all": row.prefill_ms}
        out_rows.append(rec)
        print(f"{Path(row.model.path).name[-44:]:<44} {row.model.type:>6} {row.threads:>7} {row.batch:>5} "
              f"{rec['decode_tok_s']:>12.1f} {rec['prefill_ms']:>10.1f}")
    for row in rows:
        row.free()

    target = next((m for m in models if m.file_type == 0), models[0])
    result = check(target, args.threads[0], args.check_prompt, args.check_tokens)
    print(f"\ngreedy check ({Path(target.path).name}, batch 1, {args.threads[0]} thread(s)): "
          f"{args.check_prompt!r}\n  prompt ids: {result['prompt_ids']}\n  greedy ids: {result['greedy_ids']}\n"
          f"  text: {result['text']!r}")
    for m in models:
        m.free()

    end_machine = machine()
    start_machine["load_average_rounds"] = round_load
    start_machine["load_average_end"] = end_machine["load_average"]
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": out_rows, "check": result, "machine": start_machine,
                                               "args": vars(args)}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
