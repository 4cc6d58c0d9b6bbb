"""`fullband convert | serve | doctor`: what is done with a model folder besides decoding it."""


import argparse
import json

from fullband.cli.args import Command, Registry, check_json_out, dtype, opt
from fullband.validate import DTYPES


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert a checkpoint folder between the native and the transformers layout (or a Llama into either)."""
    from fullband.hf.convert import convert
    from fullband.hf.llama import _transformers

    _transformers()
    kind, target = convert(args.src, args.dst, to=args.to, dtype=None if args.dtype is None else dtype(args.dtype),
                           fusion=args.fusion, overwrite=args.overwrite)
    how = {"hf": "load with AutoModelForCausalLM.from_pretrained (after `import fullband.hf`)",
           "native": "load with FullbandLM.load or --checkpoint"}[target]
    print(f"converted {kind} {args.src} -> {target} {args.dst}; {how}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """vLLM's OpenAI-compatible server on a transformers fullband folder (fullband.vllm.serve)."""
    from fullband.vllm.serve import serve

    serve(args.folder, args.options)
    return 0  # not reached: the process is now vLLM's server


def cmd_doctor(args: argparse.Namespace) -> int:
    """Check a model folder, training checkpoint or run directory; exit status 1 when something is damaged."""
    from fullband.doctor import diagnose

    check_json_out(args.json, key="findings")
    report = diagnose(args.path, hashes=not args.quick)
    print(report.format())
    if args.json:
        from fullband.files import replace_file

        replace_file(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
    return 1 if report.failed else 0


CONVERT = Command("convert", "native checkpoint <-> transformers folder (a Llama folder into either)", cmd_convert, (
    opt("src", help="a native checkpoint, a transformers fullband folder or a LlamaForCausalLM folder"),
    opt("dst", help="folder to write (must not exist or be empty unless --overwrite)"),
    opt("--to", choices=Registry("fullband.hf.convert", "TARGETS"),
        help="target layout (default: the other one; native for a Llama)"),
    opt("--dtype", choices=DTYPES, help="cast the weights (default: keep)"),
    opt("--fusion", default="gated", help="fusion of the new feedback weights when converting a Llama"),
    opt("--overwrite", action="store_true", help="replace a non-empty destination"),
))
SERVE = Command("serve", "vLLM's OpenAI-compatible server on a transformers folder (fullband[vllm])", cmd_serve, (
    opt("folder", help="a transformers fullband folder (fullband convert ... --to hf, save_pretrained)"),
    opt("options", nargs=argparse.REMAINDER, help="passed to vLLM's server (--port, --dtype, ...)"),
))
DOCTOR = Command("doctor", "check a model folder, training checkpoint or run directory (read only)", cmd_doctor, (
    opt("path", help="a run directory, a step_NNNNNN checkpoint, a model folder or a transformers folder"),
    opt("--quick", action="store_true", help="compare file sizes only, not the sha256 of every file"),
    opt("--json", help="also write the findings to this JSON file"),
))
