"""`fullband reproduce compare`: latent feedback against its rivals in one codebase (the same data, tokenizer,
optimizer, schedule and evaluation), at the same width and depth, and against standard transformers at the same
training compute (more steps, or a deeper model).

The methods (docs/method.md, section 4): ours (the top state into block 0, gated), a T2MLR-like setting (a middle
block's residual stream into an earlier block through their mixer), an LRT-like setting (a high block's stream into
block 0, additive), looped depth (a block group run r times per token, r random in training), PonderLM-2 (a ponder
slot per token fed its own state), and the standard transformer. Measured: cost (counted FLOPs, measured step and
decode times as ratios, KV bytes), held-out loss against tokens and FLOPs in two regimes (fresh data; a fixed unique
corpus repeated, where the standard model gains little from more steps), and serial state tracking at L..8L.

Every run is resumable and reused; `budget` (minutes) stops starting new runs, and the report then covers the
finished ones and lists the rest, so the study can be finished over several invocations. Evaluations are kept
beside the report (newer than their checkpoint: reused), and so is a record of each finished run (its command, its
training time and its held-out curve, `records/<name>.json`): a run whose checkpoints are gone (another machine, a
fresh clone) is reused from its record and evaluations, and trained again only when its command changed.

plan.py: the rival methods, the scales and the runs (equal tokens, equal FLOPs); evaluate.py: the kept evaluations;
report.py: training within the budget, the tables, the figures and the summary."""

from fullband.reproduce.compare.plan import METHODS, RIVALS, SCALES, _mean_passes, check, plan, runs  # noqa: F401
from fullband.reproduce.compare.report import report
from fullband.reproduce.runner import Experiment

__all__ = ["EXPERIMENT", "METHODS", "RIVALS", "SCALES", "plan"]

EXPERIMENT = Experiment("compare", runs, report, check, seeds=2)  # about 8 h a seed on 2 cores
