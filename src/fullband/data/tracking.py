"""Serial state-tracking tasks (issue 14): seeded, offline generators of examples whose answer needs a state
updated serially along the input, where a fixed-depth transformer is expected to stop generalising in length
and a recurrence can go on.

Every example is text: the input symbols, then the query token QUERY; the label is one character that never
appears in the input (the input's alphabet and the label's are disjoint), so nothing can be copied.

  parity     a bit string ("0110...=");                   label: its parity ("e" even, "o" odd)
  counter    increments in 0..p-1 as letters a.. ("cab..="); label: their sum mod p, as a digit
  s5         a word over two generators of S5 (x: the transposition (0 1), y: the 5-cycle (0 1 2 3 4)),
             composed left to right, F = g1 . g2 . ... . gn ("xyyx...="); label: F(0) as a digit. Reading left
             to right, F(0) = g1(g2(...gn(0))) needs the whole composed permutation at every step: the word
             problem of S5, the classic case fixed-depth transformers cannot solve in general.
  registers  writes "Rv" (register R in A..H gets the digit v) with scratch symbols between them, then a
             register name ("A3.C1..B7A2 .. B="); label: the last value written to it, as a letter a..j
             (appendix F's multi-register last-write task, with many registers and long scratch).

`length` counts the input's steps (bits, increments, generators, writes); test lengths are multiples of the
training length L: L, 2L, 4L, 8L."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from fullband.errors import InputError
from fullband.validate import integer, number

QUERY = "="
TASKS = ("parity", "counter", "s5", "registers")
COUNTER_P = 5
REGISTERS = "ABCDEFGH"
SCRATCH = "."  # filler between writes (registers)
TEST_MULTIPLES = (1, 2, 4, 8)

# S5: permutations as tuples p with p[i] the image of i
_X = (1, 0, 2, 3, 4)  # the transposition (0 1)
_Y = (1, 2, 3, 4, 0)  # the 5-cycle 0 -> 1 -> 2 -> 3 -> 4 -> 0
S5_GENERATORS = {"x": _X, "y": _Y}


@dataclass(frozen=True)
class Example:
    text: str  # the input and the query token
    label: str  # one character, never in any input of the task
    length: int  # steps in the input


def labels(task: str) -> tuple[str, ...]:
    """The label alphabet of `task` (disjoint from its inputs')."""
    return {"parity": ("e", "o"), "counter": tuple(str(i) for i in range(COUNTER_P)),
            "s5": tuple(str(i) for i in range(5)), "registers": tuple("abcdefghij")}[_task(task)]


def _task(task: str) -> str:
    if task not in TASKS:
        raise InputError(f"task={task!r} is unknown; accepted: {', '.join(TASKS)}")
    return task


def compose(p: tuple[int, ...], q: tuple[int, ...]) -> tuple[int, ...]:
    """(p . q)(i) = p(q(i))."""
    return tuple(p[q[i]] for i in range(len(q)))


def make_example(task: str, length: int, rng: random.Random, repeat: float = 0.0) -> Example:
    """One example of `task` with `length` input steps, drawn from `rng`. `repeat` > 0: each step after the first
    repeats the step before it with that probability (else it is drawn afresh), so inputs hold longer runs of one
    symbol; 0 draws every step independently (and draws from `rng` exactly as before repeat existed)."""
    integer("length", length, 1, error=InputError)
    task = _task(task)

    def steps(draw):
        out = []
        for i in range(length):
            out.append(out[-1] if i and repeat and rng.random() < repeat else draw())
        return out

    if task == "parity":
        bits = steps(lambda: rng.randint(0, 1))
        return Example("".join(map(str, bits)) + QUERY, "eo"[sum(bits) % 2], length)
    if task == "counter":
        incs = steps(lambda: rng.randrange(COUNTER_P))
        return Example("".join(chr(ord("a") + i) for i in incs) + QUERY, str(sum(incs) % COUNTER_P), length)
    if task == "s5":
        word = steps(lambda: rng.choice("xy"))
        f = tuple(range(5))
        for g in word:
            f = compose(f, S5_GENERATORS[g])
        return Example("".join(word) + QUERY, str(f[0]), length)
    # registers: `length` writes, scratch between them, the query names a register written at least once
    parts, last = [], {}
    for reg, val, scratch in steps(lambda: (rng.choice(REGISTERS), rng.randrange(10), rng.randint(0, 3))):
        last[reg] = val
        parts.append(reg + str(val) + SCRATCH * scratch)
    reg = rng.choice(sorted(last))
    return Example("".join(parts) + reg + QUERY, "abcdefghij"[last[reg]], length)


def examples(task: str, n: int, *, min_length: int = 1, max_length: int, seed: int = 0,
             repeat: float = 0.0) -> list[Example]:
    """`n` examples with lengths uniform in [min_length, max_length], deterministic from (task, seed) (and `repeat`,
    make_example's)."""
    integer("n", n, 1, error=InputError)
    number("repeat", repeat, low=0, high=1, high_open=True, error=InputError)
    integer("min_length", min_length, 1, error=InputError)
    integer("max_length", max_length, min_length, error=InputError)
    return list(_drawn(_task(task), n, min_length, max_length, seed, float(repeat)))


@functools.lru_cache(maxsize=8, typed=True)
def _drawn(task: str, n: int, min_length: int, max_length: int, seed: int, repeat: float) -> tuple[Example, ...]:
    """examples()' draw, kept for the process (a study trains many runs on one task's data: drawing 50,000 examples
    takes about a second in pure Python; Example is frozen, so the runs share them safely)."""
    rng = random.Random(f"{task}:{seed}")
    return tuple(make_example(task, rng.randint(min_length, max_length), rng, repeat) for _ in range(n))


def longest_tokens(task: str, length: int) -> int:
    """The most tokens an example of `length` steps takes in a byte vocabulary: BOS, the input (registers: a write
    and up to 3 scratch symbols per step, then the register asked for), the query and the label."""
    return 2 + (length * 5 + 1 if _task(task) == "registers" else length) + 1


def check_fits(task: str, length: int, room: int, what: str) -> None:
    """InputError, before any example is made, when examples of `length` steps cannot fit `room` positions."""
    if longest_tokens(task, length) > room:
        fits = max((n for n in range(1, room + 1) if longest_tokens(task, n) <= room), default=0)
        raise InputError(f"{what}: {task} examples of {length:,} steps take up to {longest_tokens(task, length):,} "
                         f"tokens, more than the {room} positions there are; accepted: at most {fits} steps")


def length_sets(task: str, train_length: int, n: int, *, seed: int = 1) -> dict[int, list[Example]]:
    """Fixed-length test sets at L, 2L, 4L, 8L (L = train_length), from a seed the training data does not use."""
    return {m * train_length: examples(task, n, min_length=m * train_length, max_length=m * train_length,
                                       seed=seed * 1000 + m) for m in TEST_MULTIPLES}


def label_ids(tokenizer, task: str) -> list[int]:
    """The token id of each label character (each must be one token of the vocabulary)."""
    out = []
    for char in labels(task):
        ids = tokenizer.encode(char, bos=False)
        if len(ids) != 1:
            raise InputError(f"the tokenizer reads the label {char!r} of task {task!r} as {len(ids)} tokens; "
                             "accepted: a vocabulary where each label is one token")
        out.append(ids[0])
    return out


# ---------------------------------------------------------------------------------------------------- training data
TRAIN_EXAMPLES = 50_000
VAL_EXAMPLES = 1_000


def parse_spec(spec: str) -> tuple[str, int]:
    """'parity:32' -> ('parity', 32): the task and its longest training input (`data.corpus` of a tracking run)."""
    task, _, length = str(spec).partition(":")
    if task not in TASKS or not (length.isascii() and length.isdigit()) or int(length) < 1:
        raise InputError(f"tracking corpus {spec!r}; accepted: TASK:L with TASK one of {', '.join(TASKS)} and L >= 1 "
                         "the longest training input (e.g. 'parity:32')")
    return task, int(length)


def training_sequences(spec: str, split: str, tokenizer, room: int | None = None, repeat: float = 0.0):
    """The ChatSequences of a tracking corpus's split: BOS, the input and query, the label; the loss falls on the
    label only. Train: TRAIN_EXAMPLES with lengths uniform in [1, L]; val: VAL_EXAMPLES, another seed; both with
    `repeat` (data.repeat: make_example's). The test sets (length_sets) always draw every step independently."""
    from fullband.data.chat.templates import IGNORE, ChatSequence

    task, length = parse_spec(spec)
    answer = dict(zip(labels(task), label_ids(tokenizer, task)))
    if room is not None:
        check_fits(task, length, room, f"tracking corpus {spec!r} (train.seq_len={room}: examples are packed whole)")
    n, seed = (TRAIN_EXAMPLES, 0) if split == "train" else (VAL_EXAMPLES, 7)
    for e in examples(task, n, max_length=length, seed=seed, repeat=repeat):
        ids = tokenizer.encode(e.text, bos=True) + [answer[e.label]]
        targets = [IGNORE] * (len(ids) - 2) + [answer[e.label], IGNORE]
        yield ChatSequence(ids, targets, [True] * len(ids))
