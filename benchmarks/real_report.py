"""The speed report of `make bench-real`, computed from its JSON files: decode (fullband, transformers, llama.cpp,
the machine's bounds), training steps against transformers', vLLM's plugin against vLLM's Llama, each against the
goal the issue set. Markdown on stdout.

    python benchmarks/real_report.py docs/benchmarks/real-smollm2 > docs/benchmarks/real-smollm2.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(folder: Path, name: str) -> dict | None:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def decode_table(dec: dict, llama: dict | None) -> list[str]:
    bound = {(r["threads"], r["batch"]): r["tokens_per_s"] for r in dec["rows"]
             if r["variant"] == "streaming read of the weights"}
    rows = [(r["threads"], r["batch"], r["variant"], r["tokens_per_s"]) for r in dec["rows"]]
    for r in (llama or {}).get("rows", []):
        rows.append((r["threads"], r["batch"], f"llama.cpp {r['type']} ({r['model_bytes'] / 2**20:.0f} MiB)",
                     r["decode_tok_s"]))
    out = ["| threads | batch | engine | decode tok/s | x the F32 read bound |", "|---|---|---|---|---|"]
    for threads, batch, name, tps in sorted(rows, key=lambda r: (r[0], r[1])):
        b = bound.get((threads, batch))
        out.append(f"| {threads} | {batch} | {name} | {tps:.1f} | {tps / b:.2f} |" if b else
                   f"| {threads} | {batch} | {name} | {tps:.1f} | |")
    return out


def get(dec: dict, threads: int, batch: int, variant: str) -> float | None:
    for r in dec["rows"]:
        if (r["threads"], r["batch"], r["variant"]) == (threads, batch, variant):
            return r["tokens_per_s"]
    return None


def main(folder: str) -> None:
    root = Path(folder)
    dec, train, llama, vllm, soft = (load(root, n) for n in ("decode", "train", "llamacpp", "vllm", "vllm-soft"))
    print("# Speed on a real model: SmolLM2-135M-Instruct\n")
    print("Written by `make bench-real` (`benchmarks/real_report.py` from the JSON files in "
          f"`{root.as_posix()}/`). float32 unless a row says otherwise.\n")
    if dec:
        print(f"Machine: {dec['machine']}.\n")
        print(f"## Decode ({dec['prompt_len']}-token prompts, {dec['new_tokens']} new tokens, greedy)\n")
        print("Tokens/s of the decode steps (prefill excluded; transformers' generate end to end). The read bound is "
              "the machine's streaming read of the weights one decode step reads "
              f"({dec['weight_bytes_per_step'] / 2**20:.0f} MiB in float32: every block's matrices and the tied head), "
              "timed as a sum over them; at batch B it is B tokens per read.\n")
        print("\n".join(decode_table(dec, llama)))
        if llama:
            m = llama["machine"]
            print(f"\nllama.cpp: llama-cpp-python {m.get('llama_cpp_python')} (built here from source; its KV cache in "
                  f"F16, its defaults); load average at its start {m['load_average'][0]:.2f}, at its end "
                  f"{m['load_average_end'][0]:.2f}.")
        print("\n### Goals\n")
        theory = dec["theory_soft_overhead"]
        for key, paired in dec["soft_overhead_paired_steps"].items():
            t, b = key[1:].split("/b")
            ok = "met" if paired <= 0.01 else "missed"
            print(f"- SOFT over STANDARD, {t} thread(s), batch {b}: {100 * paired:+.2f}% (goal <= +1%: {ok}; theory "
                  f"{100 * theory:+.2f}%).")
        print("\n  Each: the median over 400 pairs of decode steps, one of each mode, the order swapped every pair. Whole "
              "generations in the table differ by up to 5% either way between modes that run the same steps (FUSED and "
              "SOFT decode alike): the machine's drift, not the modes.\n")
        for t in sorted({r["threads"] for r in dec["rows"]}):
            read = get(dec, t, 1, "streaming read of the weights")
            parts = [f"{name} {get(dec, t, 1, name) / read:.2f}" for name in
                     ("fullband standard", "transformers generate", "weight mat-vec chain (torch)") if get(dec, t, 1, name)]
            f32 = [r["decode_tok_s"] for r in (llama or {}).get("rows", []) if (r["threads"], r["batch"], r["type"]) ==
                   (t, 1, "F32")]
            if f32:
                parts.append(f"llama.cpp F32 {f32[0] / read:.2f}")
            print(f"- Batch 1, {t} thread(s), as a fraction of the read bound: " + ", ".join(parts) + ".")
    if train:
        print(f"\n## Training steps ({train['batch']} x {train['seq_len']} tokens, forward + backward, "
              f"{train['threads']} threads)\n")
        print("| variant | s / step | x transformers' one-pass step | per pass | goal |")
        print("|---|---|---|---|---|")
        for r in train["rows"]:
            goal = "" if r["variant"] == "transformers" else (
                f"<= {1.03 * r['passes']:.2f}x: {'met' if r['vs_transformers'] <= 1.03 * r['passes'] else 'missed'}")
            print(f"| {r['variant']} | {r['seconds']:.2f} | {r['vs_transformers']:.3f} | "
                  f"{r['vs_transformers'] / r['passes']:.3f} | {goal} |")
        kept = "kept in the process" if train.get("freed_memory_kept") else "returned to the kernel (glibc's default)"
        print(f"\nFreed memory {kept} (`fullband.machine.restart_keeping_freed_memory`).")
    if vllm:
        print(f"\n## vLLM (CPU build): the plugin against vLLM's own Llama, {vllm['new_tokens']} new tokens per "
              "request, greedy\n")
        print(f"Both start orders, fresh engines each, {vllm['reps']} interleaved repetitions; the geometric mean of the "
              f"two orders. Load average at the start: {vllm['load_average'][0]:.2f}.\n")
        print("| concurrent requests | vLLM's Llama tok/s | plugin STANDARD speed / vLLM's Llama | goal |")
        print("|---|---|---|---|")
        for b in sorted({int(k.rsplit("_b", 1)[1]) for k in vllm if k.startswith("standard_vs_llama_b")}):
            speed = vllm[f"standard_vs_llama_b{b}"]
            llama = [v for k, v in vllm.items() if k.startswith(f"llama_tok_s_b{b}_")]
            print(f"| {b} | {min(llama):.0f} to {max(llama):.0f} | {speed:.3f}x | >= 0.97x: "
                  f"{'met' if speed >= 0.97 else 'missed'} |")
    if soft:
        print(f"\nSOFT over STANDARD inside the plugin (one engine, the mode per request; whole generations of "
              f"{soft['new_tokens']} tokens, {soft['reps']} interleaved repetitions, median ratio): "
              + ", ".join(f"{b} request(s) {100 * soft[f'soft_vs_standard_b{b}']:+.2f}%" for b in
                          sorted(int(k.rsplit('_b', 1)[1]) for k in soft if k.startswith("soft_vs_standard_b")))
              + f" (theory {100 * soft['theory_soft_overhead']:+.2f}%; goal <= +1%).")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks/real-smollm2")
