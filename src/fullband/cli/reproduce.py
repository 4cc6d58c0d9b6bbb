"""`fullband reproduce` and `fullband demo`: the paper's claims at small scale, and the embedded demo."""

from __future__ import annotations

import argparse

from fullband.cli.args import Command, opt
from fullband.errors import InputError
from fullband.reproduce import REGISTRY


def cmd_reproduce(args: argparse.Namespace) -> int:
    from fullband.reproduce import reproduce

    options = {}
    scaled = ("compare", "warmstart")  # the experiments that take --scale
    if args.scale is not None and args.experiment not in scaled:
        raise InputError(f"--scale applies to `fullband reproduce {' / '.join(scaled)}` only, not to "
                         f"{args.experiment!r}; accepted: drop it, or run one of those")
    if args.budget is not None and args.experiment != "compare":
        raise InputError(f"--budget applies to `fullband reproduce compare` only, not to {args.experiment!r}; "
                         "accepted: drop it, or run compare")
    if args.model is not None and args.experiment != "warmstart":
        raise InputError(f"--model applies to `fullband reproduce warmstart` only, not to {args.experiment!r}; "
                         "accepted: drop it, or run warmstart")
    if args.scale is not None:
        options["scale"] = args.scale
    if args.experiment == "compare" and (args.scale is not None or args.budget is not None):
        options = {"scale": "cpu" if args.scale is None else args.scale, "budget": args.budget}
        if args.budget is not None and not args.budget >= 0:
            raise InputError(f"--budget {args.budget}: accepted: minutes >= 0 (0 trains nothing new and reports the "
                             "finished runs)")
    if args.model is not None:
        options["model"] = args.model
    for exp in REGISTRY if args.experiment == "all" else [args.experiment]:
        reproduce(exp, root=args.root, docs=args.docs, **options)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from fullband.demo import run_demo

    return run_demo(args.out, quick=args.quick, race_config=args.race_config, code_config=args.config)


REPRODUCE = Command("reproduce", "the paper's claims at small scale: train, evaluate, write a report", cmd_reproduce, (
    opt("experiment", choices=[*REGISTRY, "all"]),
    opt("--root", default="runs/repro", help="where the runs go (finished ones are reused)"),
    opt("--docs", default="docs/results", help="where the report and figures go"),
    opt("--scale", default=None, help="compare: cpu (default, ~6 h on 2 cores), gpu-small (the same study, larger, "
        "on a GPU) or micro (a smoke test of the pipeline); warmstart: cpu (default, about 1 h 45 min on 2 cores), "
        "gpu or micro"),
    opt("--model", default=None, metavar="PATH", help="warmstart only: the pretrained Llama to add latent feedback to "
        "(a .gguf file or a transformers folder; default shipped:smollm2)"),
    opt("--budget", type=float, default=None, metavar="MIN", help="compare only: start no new run after MIN minutes, "
        "then report the finished runs and list the rest (a rerun goes on)"),
))
DEMO = Command("demo", "the embedded demo (what `make demo` runs): latent feedback vs a standard model", cmd_demo, (
    opt("--out", default="runs/demo", help="where everything goes (default runs/demo)"),
    opt("--config", default="configs/tiny.toml", help="the code LM's recipe (default configs/tiny.toml)"),
    opt("--race-config", default="configs/demo-parity.toml", help="the race's recipe"),
    opt("--quick", action="store_true", help="every phase in seconds (a check that it all runs)"),
), description="A race on running parity (a standard and a full-bandwidth model, scored beyond their training "
               "length), then the code LM on the Python standard library; a few minutes on a CPU. Finished phases "
               "are reused.")
