"""Synthetic state-tracking tasks of the paper's appendix F (docs/method.md, section 11): the label is fixed before a
final colon and never appears in the input; scratch updates that do not change it vary the length.

Each generator is deterministic from its seed and returns balanced examples with a group id for grouped
cross-validation (a group never straddles train and test folds)."""

from __future__ import annotations

import random
from dataclasses import dataclass

SCRATCH = (0, 8, 32, 128, 256)  # label-irrelevant updates appended to vary the length
TASKS = ("completion", "memory", "registers")


@dataclass(frozen=True)
class Example:
    task: str
    text: str  # ends with the shared final ':'
    label: str  # the answer word, never in `text`
    target: int  # 0 / 1
    group: str  # digit pair, scratch context or update schedule
    length: int  # scratch updates (completion, memory) or registers m (registers)


def completion_tracking(groups: int = 80, scratch: tuple[int, ...] = SCRATCH, seed: int = 0) -> list[Example]:
    """`required = a`, `completed = b`, `scratch = 7`, `scratch += 0` x n, `Status:` -> done if a == b else more.
    Each unordered pair {a, b} (a group) gives (a, a), (a, b), (b, a), (b, b): balanced done / more."""
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(100) for b in range(a + 1, 100)], groups)
    out = []
    for a, b in pairs:
        for req, done in ((a, a), (a, b), (b, a), (b, b)):
            for n in scratch:
                text = f"required = {req}\ncompleted = {done}\nscratch = 7\n" + "scratch += 0\n" * n + "Status:"
                same = req == done
                out.append(Example("completion", text, "done" if same else "more", int(same), f"pair-{a}-{b}", n))
    return out


def delayed_memory(groups: int = 128, scratch: tuple[int, ...] = SCRATCH, seed: int = 0) -> list[Example]:
    """`state = s` (s in {0, 1}), scratch ops x n, `# final state:` -> zero / one (the initial s). A group is one
    random scratch context (its first n ops for each length), with both values of s: balanced."""
    rng = random.Random(seed)
    ops = ("scratch ^= 0", "scratch ^= 1", "scratch += 0")
    out = []
    for g in range(groups):
        context = [rng.choice(ops) for _ in range(max(scratch))]
        for s in (0, 1):
            for n in scratch:
                body = "".join(op + "\n" for op in context[:n])
                text = f"state = {s}\n{body}# final state:"
                out.append(Example("memory", text, "one" if s else "zero", s, f"context-{g}", n))
    return out


def register_last_write(groups: int = 64, registers: tuple[int, ...] = (1, 2, 4, 8), writes: tuple[int, ...] = (2, 4, 8),
                        pad_to: int = 180, seed: int = 0) -> list[Example]:
    """Registers r0..r(m-1) get binary assignments (2/4/8 writes each, interleaved), scratch updates pad the text
    to ~pad_to characters, then `query = ri`, `Value:` -> the latest value written to ri. A group is one update
    schedule; it also appears with every value flipped, so labels are balanced."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        m = registers[g % len(registers)]
        w = writes[(g // len(registers)) % len(writes)]
        order = [r for r in range(m) for _ in range(w)]
        rng.shuffle(order)
        values = [rng.randint(0, 1) for _ in order]
        query = rng.randrange(m)
        last = [v for r, v in zip(order, values) if r == query][-1]
        for flip in (0, 1):
            text = "".join(f"r{r} = {v ^ flip}\n" for r, v in zip(order, values))
            tail = f"query = r{query}\nValue:"
            pad = max(0, (pad_to - len(text) - len(tail)) // len("scratch += 0\n"))
            text += "scratch += 0\n" * pad + tail
            target = last ^ flip
            out.append(Example("registers", text, str(target), target, f"schedule-{g}", m))
    return out


def make_task(task: str, seed: int = 0, scratch: tuple[int, ...] = SCRATCH) -> list[Example]:
    if task == "completion":
        return completion_tracking(scratch=scratch, seed=seed)
    if task == "memory":
        return delayed_memory(scratch=scratch, seed=seed)
    if task == "registers":
        return register_last_write(seed=seed)
    from fullband.errors import InputError, closest

    raise InputError(f"task={task!r} is unknown{closest(task, TASKS)}; accepted: {', '.join(TASKS)}")


def training_documents(n: int, seed: int = 1, tasks: tuple[str, ...] = TASKS,
                       scratch: tuple[int, ...] = SCRATCH, sep: str = "") -> list[str]:
    """Documents `text + sep + label` for mixing the tasks into a training corpus, from other seeds than the
    probe sets (seed 0), so the probed examples are new to the model. With the default `sep=""` the label
    follows the final ':' directly, so the ':' is the position that predicts it, as with the paper's BPE
    tokens (`:` then ` done`); a byte-level model would otherwise predict a space there."""
    rng = random.Random(seed)
    docs: list[str] = []
    round_ = 0
    while len(docs) < n:
        for task in tasks:
            docs += [f"{ex.text}{sep}{ex.label}\n"
                     for ex in make_task(task, seed=1000 * seed + round_ + 1, scratch=scratch)]
        round_ += 1
    rng.shuffle(docs)
    return docs[:n]
