"""What a reproduction finds, per training seed, and what holds across seeds (`fullband reproduce --seeds N`).

An experiment's report records its headline numbers in `settings.findings` as it computes them: plain values (a
loss, an accuracy), paired differences (with their within-run standard error, so each seed has its own verdict) and
claims (a yes / no the report decides, e.g. "solves 8L"). reproduce() runs the report once per seed and opens it
with `across_seeds`: every finding's mean, min-max and standard error across seeds beside the within-run standard
error, and each verdict counted over the seeds."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

KINDS = ("value", "diff", "claim")
FINDINGS_FILE = "findings.json"  # in each seed's figure folder: what its report recorded
SEEDS_FILE = "seeds.json"  # in the report's folder: the findings across seeds (the robustness report reads them)


def shown(diff: float, se: float) -> bool:
    """Whether a paired difference is 2 standard errors or more from zero (never with a nan or infinite s.e.)."""
    return not (diff == 0 or abs(diff) < 2 * se or not math.isfinite(se))


@dataclass
class Finding:
    kind: str  # value | diff | claim
    value: float  # a claim: 1.0 when it holds
    se: float | None = None  # the within-run standard error (None: the report gives none)
    fmt: str = ".4f"  # how the value is written
    up: str = "higher"  # a difference's words for its two directions
    down: str = "lower"

    def verdict(self) -> str | None:
        """This seed's verdict: a difference's direction when it is shown (2 standard errors), "none" when not;
        a claim's "holds" / "fails"; None for a plain value."""
        if self.kind == "diff":
            return (self.up if self.value > 0 else self.down) if shown(self.value, self.se or 0.0) else "none"
        if self.kind == "claim":
            return "holds" if self.value else "fails"
        return None


@dataclass
class Findings:
    """A report's findings for one seed, by name in the order recorded (a name recorded again replaces it)."""

    items: dict[str, Finding] = field(default_factory=dict)

    def value(self, what: str, value: float, se: float | None = None, fmt: str = ".4f") -> None:
        self.items[what] = Finding("value", float(value), _se(se), fmt)

    def diff(self, what: str, diff: float, se: float, *, up: str = "higher", down: str = "lower",
             fmt: str = "+.4f") -> None:
        """A paired difference (a - b) and its within-run standard error; `up` / `down` name its directions."""
        self.items[what] = Finding("diff", float(diff), _se(se), fmt, up, down)

    def claim(self, what: str, holds: bool) -> None:
        self.items[what] = Finding("claim", 1.0 if holds else 0.0, fmt="")

    def to_data(self) -> dict:
        return {what: asdict(f) for what, f in self.items.items()}

    @classmethod
    def from_data(cls, data: dict) -> "Findings":
        return cls({what: Finding(**f) for what, f in data.items()})


def _se(se: float | None) -> float | None:
    return None if se is None else float(se)


@dataclass
class Across:
    """One finding over the seeds that recorded it."""

    what: str
    kind: str
    values: list[float]  # per seed, in seed order
    seeds: list[int]
    mean: float
    low: float
    high: float
    se: float  # across seeds (nan under two seeds)
    within: float | None  # the mean within-run standard error
    verdict: str  # counted over the seeds ("" for a plain value)
    fmt: str

    def cell(self, v: float) -> str:
        return ("holds" if v else "fails") if self.kind == "claim" else format(v, self.fmt)


def across(per_seed: dict[int, Findings]) -> list[Across]:
    """Every finding's spread and verdict across the seeds in `per_seed` ({seed: its findings}), in the order the
    first seed recorded them (findings only some seeds recorded come last)."""
    order = list(dict.fromkeys(w for f in per_seed.values() for w in f.items))
    out = []
    for what in order:
        got = [(s, f.items[what]) for s, f in sorted(per_seed.items()) if what in f.items]
        values = [f.value for _, f in got]
        first = got[0][1]
        n = len(values)
        mean = sum(values) / n
        se = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else float("nan")
        ses = [f.se for _, f in got if f.se is not None and math.isfinite(f.se)]
        out.append(Across(what, first.kind, values, [s for s, _ in got], mean, min(values), max(values), se,
                          sum(ses) / len(ses) if ses else None, _counted([f.verdict() for _, f in got], first),
                          first.fmt.lstrip("+") if first.kind == "value" else first.fmt))
    return out


def _counted(verdicts: list[str | None], first: Finding) -> str:
    """The verdicts of the seeds in words: unanimous ones as such, a split one by counts."""
    n = len(verdicts)
    if first.kind == "value":
        return ""
    if first.kind == "claim":
        k = verdicts.count("holds")
        return f"holds in {'every seed' if k == n else f'{k} of {n} seeds'}" if k else f"fails in every seed ({n})"
    counts = {v: verdicts.count(v) for v in dict.fromkeys(verdicts)}
    if len(counts) == 1:
        v = verdicts[0]
        return (f"no difference shown in any seed ({n})" if v == "none"
                else f"{v} in every seed ({n} of {n}, each 2+ standard errors)")
    words = {"none": "no difference shown"}
    return "mixed: " + ", ".join(f"{words.get(v, v)} in {c}" for v, c in counts.items()) + f" of {n} seeds"


def across_lines(rows: list[Across], seeds: list[int]) -> list[str]:
    """The report's "Across seeds" table."""
    if not rows:
        return ["This experiment records no findings across seeds.", ""]
    lines = [f"Training seeds {', '.join(map(str, seeds))}: each row is one finding of the report, its value in every "
             "seed, the mean, the range (min - max) and the standard error across seeds, beside the mean standard "
             "error within one run (over the evaluation's items: windows, examples, prompts). A verdict is counted "
             "over the seeds: a difference is shown in a seed when it is 2 or more of that seed's standard errors "
             "from zero; a claim is the report's own test, applied to each seed.", "",
             "| finding | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | min - max | s.e. across seeds | "
             "s.e. within a run | across seeds |",
             "|---|" + "---|" * (len(seeds) + 5)]
    for r in rows:
        by_seed = dict(zip(r.seeds, r.values))
        cells = [r.cell(by_seed[s]) if s in by_seed else "-" for s in seeds]
        if r.kind == "claim":
            stats = [f"{r.mean:.2f}", "", "", ""]
        else:
            stats = [format(r.mean, r.fmt), f"{format(r.low, r.fmt)} - {format(r.high, r.fmt)}",
                     "-" if not math.isfinite(r.se) else format(r.se, r.fmt.lstrip("+")),
                     "-" if r.within is None else format(r.within, r.fmt.lstrip("+"))]
        lines.append(f"| {r.what} | " + " | ".join(cells + stats) + f" | {r.verdict} |")
    return lines + [""]
