"""`fullband eval WHAT`: the paper's diagnostics on a checkpoint (fullband.eval.commands), each writing WHAT.json and
WHAT.png."""


import argparse
import inspect
from pathlib import Path

from fullband.cli.args import Command, count, opt, tolerance, unescape
from fullband.data import synthetic, tracking
from fullband.eval.commands import CHAT_MODES
from fullband.eval.probe import PREFILLS
from fullband.eval.stability import KS
from fullband.eval.tracking import DEFAULT_MODES
from fullband.model.mode import DecodeMode


def cmd_eval(args: argparse.Namespace) -> int:
    """fullband.eval.commands.eval_WHAT, given the options of its parameters' names (--modes: decoding modes, read by
    DecodeMode.parse, but for a probe's prefills)."""
    from fullband.eval import commands

    what = args.what.replace("-", "_")
    commands.report.check_out(args.out or Path(args.checkpoint) / "eval", what)  # before the work
    given = vars(args)
    if given.get("modes") is not None and what != "probe":
        given["modes"] = [DecodeMode.parse(m) for m in args.modes]
    if "stop_text" in given:
        given["stop_text"] = unescape(args.stop_text, "--stop-text")
    run = getattr(commands, f"eval_{what}")
    run(**{name: value for name, value in given.items() if name in inspect.signature(run).parameters})
    return 0


def _words(values) -> str:
    return " ".join(map(str, values))


COMMON = (
    opt("--checkpoint", required=True, help="a model folder (e.g. runs/tiny/step_000200)"),
    opt("--out", help="where to write WHAT.json / WHAT.png (default: CHECKPOINT/eval)"),
)
DATA = (
    opt("--corpus", help="held-out data (default: the run's corpus, validation split)"),
    opt("--val-percent", type=float, default=None, help="the share of the corpus held out and scored, by file "
        "(default: the run's, else 1; 100 scores the whole corpus)"),
    opt("--seq-len", type=count(1), default=256), opt("--batch-size", type=count(1), default=16),
)
WHAT = (
    Command("loss", "held-out loss: STANDARD, FUSED k=1..K, exact", cmd_eval, ( *COMMON, *DATA,
        opt("--windows", type=count(0), default=256, help="validation windows (0 = all)"),
        opt("--max-prefill", type=count(0), default=3),
        opt("--no-exact", action="store_false", dest="exact", help="skip the (slow) exact recurrence"),
        opt("--auto", type=tolerance, nargs="*", default=[], metavar="TOL", dest="auto_tols",
            help="also adaptive prefill: iterate until the RMS update < TOL"),
    )),
    Command("stability", "iterate the pass map to k = 1000 (Fig. 3)", cmd_eval, ( *COMMON, *DATA,
        opt("--windows", type=count(0), default=32),
        opt("--ks", type=count(1), nargs="+", default=None, help=f"pass counts (default {_words(KS)})"),
    )),
    Command("probe", "linear probes on synthetic state tracking (Fig. 7)", cmd_eval, ( *COMMON,
        opt("--tasks", nargs="+", default=["completion", "memory"], choices=synthetic.TASKS),
        opt("--modes", nargs="+", default=list(PREFILLS), choices=PREFILLS),
        opt("--suffix", type=count(1), default=8, help="k of the k-step suffix recurrence"),
        opt("--scratch", type=count(0), nargs="+", default=None,
            help=f"scratch update counts (default {_words(synthetic.SCRATCH)})"),
    )),
    Command("generate-length", "median generated length and accuracy per mode", cmd_eval, ( *COMMON,
        opt("--prompts", required=True, help="JSONL with 'prompt' (and optional 'answer') per line"),
        opt("--modes", nargs="+", default=["standard", "soft", "fused:1"], help="MODE or fused:K"),
        opt("--max-new-tokens", type=count(1), default=256),
        opt("--stop-text", default="\\n", help="the answer is the text before this (default: newline)"),
    )),
    Command("chat", "exact match of the final answer and reply length per mode", cmd_eval, ( *COMMON,
        opt("--data", required=True, help="held-out chat JSONL ({\"messages\": [...]} per line), or a chat corpus "
            "(arithmetic, a folder, hf:NAME) whose held-out split is scored as the run split it; the last assistant "
            "turn of each is the reference, its 'Answer: N' line is scored"),
        opt("--modes", nargs="+", default=list(CHAT_MODES), help="MODE or fused:K"),
        opt("--max-new-tokens", type=count(1), default=192), opt("--batch-size", type=count(1), default=16),
        opt("--limit", type=count(1), default=None, help="score only the first N conversations"),
    )),
    Command("tracking", "state tracking accuracy by input length and mode", cmd_eval, ( *COMMON,
        opt("--task", choices=tracking.TASKS, help="default: the task the run trained on"),
        opt("--train-length", type=count(1), help="L, the longest training input (default: the run's); tested at L, "
            "2L, 4L, 8L"),
        opt("--n", type=count(1), default=200, help="examples per length"),
        opt("--modes", nargs="+", default=None, help=f"MODE or fused:K (default: {_words(DEFAULT_MODES)})"),
        opt("--batch-size", type=count(1), default=32),
    ), description="--checkpoint may also be a `fullband convert --to hf` folder or a Llama folder (read as "
                   "`fullband convert` reads it); give --task and --train-length for any folder that is not from a "
                   "tracking run"),
)
EVAL = Command("eval", "the paper's diagnostics on a checkpoint", WHAT, sub=("what", "WHAT"))
