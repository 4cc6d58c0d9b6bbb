"""The step plan of fullband's vLLM model: what one forward does beyond an ordinary transformer step, from the
packed batch's layout and each row's Read (DecodeMode.read, made when the request is admitted). No vLLM import:
the plan is tested against the native model's reading in the main suite (tests/test_vllm_plan.py), and the
served model (fullband.vllm.model) carries it out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from fullband.model.core import FeedbackModel, plain_positions, shift_right
from fullband.model.mode import DecodeMode


class Rows:
    """Each row of vLLM's persistent batch as the plan reads it: the Read its request was admitted with, spread
    over arrays (one entry per row, read vectorised every step) and moved with the requests (RequestTracker)."""

    ARRAYS = ("feeds", "passes", "dense", "prompt_len", "keeps_states", "has_fed", "fresh")
    LISTS = ("prompts", "fused", "states_key", "fed")

    def __init__(self, n: int) -> None:
        self.feeds = np.zeros(n, dtype=bool)  # generated positions are fed (every mode but STANDARD)
        self.passes = np.ones(n, dtype=np.int64)  # the prompt's Jacobi passes (Read.passes)
        self.dense = np.zeros(n, dtype=bool)  # the prompt itself is fed, over passes > 1 (FUSED): DenseJobs
        self.prompt_len = np.zeros(n, dtype=np.int64)
        self.prompts: list[list[int] | None] = [None] * n  # a dense row's prompt tokens
        self.fused: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n  # a dense prompt's kept passes
        self.states_key: list[str | None] = [None] * n  # where a row's fed states go (SERVED.kept_states)
        self.keeps_states = np.zeros(n, dtype=bool)  # the rows that have a states_key (read every step)
        self.fed: list[tuple[tuple[int, int], ...]] = [()] * n  # prompt spans read fed (a SOFT request's fed_spans)
        self.has_fed = np.zeros(n, dtype=bool)
        self.fresh = np.zeros(n, dtype=bool)  # added since its last step: its state row holds nothing of its own
        self.batch_size = 0

    def add(self, index: int, mode: DecodeMode, prompt, runs: tuple[tuple[int, int], ...],
            states_key: str | None = None) -> None:
        """Row `index` takes a request in `mode` with `prompt` tokens, fed `runs` (requests.fed_runs), states_key."""
        P = len(prompt or ())
        fed = tuple(run for run in runs if run[0] < P)  # the prompt's
        read = mode.read(P, sum(min(b, P) - a for a, b in fed))
        self.feeds[index], self.passes[index], self.prompt_len[index] = mode.feeds_state, read.passes, P
        self.dense[index] = not read.plain_prompt and read.passes > 1
        self.prompts[index] = list(prompt) if self.dense[index] else None
        self.fused[index], self.states_key[index] = None, states_key
        self.keeps_states[index] = states_key is not None
        self.fed[index], self.has_fed[index], self.fresh[index] = fed, bool(fed), True

    def remove(self, index: int) -> None:
        """What a finished or aborted request kept goes with it."""
        self.prompts[index], self.fused[index], self.states_key[index] = None, None, None
        self.keeps_states[index] = False

    def move(self, rows: list[int], to: list[int]) -> None:
        for name in self.ARRAYS:
            arr = getattr(self, name)
            arr[to] = arr[rows]
        for name in self.LISTS:
            values = getattr(self, name)
            moving = [values[r] for r in rows]
            for r, v in zip(to, moving):
                values[r] = v

    def take(self, index: np.ndarray) -> Rows:
        """Copies of rows `index`, in that order (row i of the result is row index[i]): a step's requests in packed
        order, from a runner that keeps each request at one index for its life (Slots)."""
        out = Rows.__new__(Rows)
        for name in self.ARRAYS:
            setattr(out, name, getattr(self, name)[index])
        for name in self.LISTS:
            values = getattr(self, name)
            setattr(out, name, [values[i] for i in index])
        out.batch_size = len(index)
        return out


class Slots(Rows):
    """The requests of a runner that keeps each at one index for its whole life (vLLM's Model Runner V2: its
    request index; fullband.vllm.runner_v2) as the plan reads them, with their fed-back states: row i is index i's
    Read and `state[i]` its latest state. Nothing moves; a step reads and writes its requests through `batch`."""

    def __init__(self, n: int, d: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(n)
        self.state = torch.zeros(n, d, dtype=dtype, device=device)  # (n, D) each index's latest fed-back state
        self.index: dict[str, int] = {}  # request id -> its index

    def admit(self, req_id: str, index: int, mode: DecodeMode, prompt, runs: tuple[tuple[int, int], ...],
              states_key: str | None = None) -> None:
        """Index `index` takes request `req_id`, new or resumed after preemption (either way it reads its prompt
        again, as V1's tracker has it read), with Rows.add's arguments; its state row is zeroed, so nothing of the
        index's previous holder is left in it."""
        self.release(req_id)
        self.index[req_id] = index
        self.add(index, mode, prompt, runs, states_key)
        self.state[index] = 0

    def release(self, req_id: str) -> None:
        """A finished, aborted or preempted request: what it kept goes with it (its index may be taken next)."""
        index = self.index.pop(req_id, None)
        if index is not None:
            self.remove(index)

    def batch(self, req_ids: list[str], index, device_index: torch.Tensor | None = None) -> SlotBatch | None:
        """This step's requests: packed request i is req_ids[i], at index[i] (`device_index`: the same indices on the
        state's device, or None to copy them there). None unless they are the requests admitted at those indices:
        a dummy run (profiling, CUDA-graph capture, an idle data-parallel rank) reads and writes no state."""
        index = np.asarray(index, dtype=np.int64)
        if len(req_ids) != len(index) or any(self.index.get(r) != i for r, i in zip(req_ids, index.tolist())):
            return None
        if device_index is None:
            device_index = torch.from_numpy(index).to(self.state.device)
        return SlotBatch(self, index, device_index)


class SlotBatch:
    """One step's requests on Slots, as the step plan reads them: `rows` (row i: packed request i's Read, a copy),
    `state()` their states gathered in packed order, `write` the new ones scattered back to their indices."""

    def __init__(self, slots: Slots, index: np.ndarray, device_index: torch.Tensor) -> None:
        self.slots, self.index, self.device_index = slots, index, device_index
        self.rows = slots.take(index)

    def state(self) -> torch.Tensor:
        """(R, D) the states the packed requests read: a copy, so the plan may overwrite rows of it (restores)."""
        return self.slots.state[self.device_index]

    def write(self, plan: StepPlan, new: torch.Tensor) -> torch.Tensor:
        """After the step on states `new` (N, D): each request's last state to its index, and what the step changed
        of its Read (a FUSED prompt's kept passes; none is fresh any more). -> the last states (R, D), packed order."""
        last = new[plan.last_rows].to(self.slots.state.dtype)
        self.slots.state[self.device_index] = last
        self.slots.fresh[self.index] = False
        for job in plan.dense:
            self.slots.fused[self.index[job.batch_row]] = self.rows.fused[job.batch_row]
        return last


class BatchRows:
    """One step's requests on vLLM's V1 persistent batch (RequestTracker), with SlotBatch's interface: there the
    batch rows are in packed order already, and the model's state buffer has a row per batch row."""

    def __init__(self, rows: Rows, state: torch.Tensor) -> None:
        self.rows, self._state = rows, state

    def state(self) -> torch.Tensor:
        return self._state

    def write(self, plan: StepPlan, new: torch.Tensor) -> torch.Tensor:
        last = new[plan.last_rows].to(self._state.dtype)
        self._state[:plan.rows] = last
        self.rows.fresh[:plan.rows] = False
        return last


@dataclass
class DenseJob:
    """A FUSED prompt with positions in this step's chunk: passes 1..J-1 run over the whole prompt at its first
    chunk (kept for its later chunks), and the chunk's prompt rows take pass J's inputs from them, so every chunk
    writes pass J's keys and values itself (a cached prefix of them is what it would write)."""

    prompt: list[int]
    passes: int  # Jacobi passes over the prompt (its Read's: 1 + k, at most its length)
    start: int  # first position of this step's chunk
    first_row: int  # the chunk's first row in the packed batch
    rows: int  # rows of the chunk that are prompt positions
    batch_row: int  # the request's row in this step's batch (its tracker row)
    last: bool  # the prompt's last chunk (its kept passes are dropped after it)


@dataclass
class StepPlan:
    """What this step's forward does beyond one plain pass, from the batch layout and the tracked requests."""

    rows: int  # requests in the batch
    last_rows: torch.Tensor  # (rows,) each request's last packed row: its new state goes back to its row
    any_feed: bool = False  # some row is fused (else the step is an ordinary transformer step)
    token_req: torch.Tensor | None = None  # (N,) the state row each packed row reads
    token_feed: torch.Tensor | None = None  # (N,) whether it is fused
    fed_rows: torch.Tensor | None = None  # the fused rows
    fed_reqs: torch.Tensor | None = None  # the state row each of them reads
    dense: list[DenseJob] = field(default_factory=list)
    iterate: int = 0  # extra passes for rows fed by a row of the same step (recomputed outputs, fed spans)
    chain_rows: torch.Tensor | None = None  # those rows
    chain_from: torch.Tensor | None = None  # the row each of them reads (row - 1 in its chunk, or another request's)
    sampled: list[tuple[int, int]] = field(default_factory=list)  # (batch row, position) of rows whose states are
    #                                         kept (fullband_states) and that sample a token from this step
    # prefix caching: the state of each cached block's last position, kept by block id (a block's keys and values
    # do not hold it), written for every row that ends a block and read by a request whose first computed position
    # is fed and follows a cached block (its own state row has none: a new or resumed request)
    store_rows: torch.Tensor | None = None  # rows that end a block
    store_blocks: torch.Tensor | None = None  # their blocks
    restore_reqs: torch.Tensor | None = None  # batch rows whose state comes from a block's kept state
    restore_blocks: torch.Tensor | None = None  # those blocks
    blocks: int = 0  # 1 + the largest block id the plan reads or writes


class Blocks(NamedTuple):
    """Prefix caching's layout of a step: the packed rows' KV slots (vLLM's slot_mapping) in blocks of `size`, and
    at(i, j) the id of batch row i's j-th block."""

    slots: np.ndarray
    size: int
    at: Callable[[int, int], int]


def plan_step(rows: Rows, qsl: list[int], starts: list[int], ids: np.ndarray | None, bos_token_id: int | None,
              device: torch.device, blocks: Blocks | None = None) -> StepPlan:
    """The plan of one step: packed rows qsl[i]:qsl[i+1] are the chunk of batch row i, from position starts[i];
    ids (N,) the packed rows' tokens (None: unknown, no BOS rule); `blocks` with prefix caching."""
    R = len(starts)
    bounds = np.asarray(qsl, dtype=np.int64)
    plan = StepPlan(rows=R, last_rows=torch.from_numpy(bounds[1:] - 1).to(device))
    prompt_len, start = rows.prompt_len[:R], np.asarray(starts, dtype=np.int64)
    end = start + np.diff(bounds)
    row = np.repeat(np.arange(R), np.diff(bounds))  # each packed row's request
    offset = np.arange(bounds[-1]) - bounds[row]  # its place in the chunk
    pos = start[row] + offset
    # SOFT / FUSED requests feed their generated positions: past the prompt, which is read plainly (a FUSED
    # prompt's own passes are planned below) but for a SOFT request's fed spans (a conversation's replies), and
    # not where the plain rule says otherwise (a BOS)
    prompt = pos < prompt_len[row]
    for i in np.nonzero(rows.has_fed[:R])[0]:
        rows_i = slice(bounds[i], bounds[i + 1])
        for a, b in rows.fed[i]:
            prompt[rows_i] &= (pos[rows_i] < a) | (pos[rows_i] >= b)
    plain = plain_positions(ids, pos, bos_token_id if ids is not None else None, mask=prompt)
    fed = rows.feeds[:R][row] & ~plain
    # fed rows whose predecessor is computed in this same step (recomputed outputs, fed prompt spans): iterated,
    # one more pass per such row (as DecodeMode.read counts fed positions)
    chain = np.nonzero(fed & (offset > 0))[0]
    for i in np.nonzero(rows.dense[:R] & (start < prompt_len))[0]:  # a chunk of a FUSED prompt
        P, first = int(prompt_len[i]), int(start[i])
        plan.dense.append(DenseJob(prompt=rows.prompts[i], passes=int(rows.passes[i]), start=first,
                                   first_row=int(bounds[i]), rows=min(P, int(end[i])) - first, batch_row=int(i),
                                   last=P <= end[i]))
    plan.any_feed = bool(fed.any()) or bool(plan.dense)
    sampling = np.nonzero(rows.keeps_states[:R] & (end >= prompt_len))[0]  # vectorised: this runs every step
    plan.sampled = [(int(i), int(end[i]) - 1) for i in sampling]
    source = chain - 1
    if blocks is not None:
        chain, source = _cached_states(plan, rows, fed, bounds, start, chain, blocks, device)
    if chain.size:
        plan.chain_rows = torch.from_numpy(chain).to(device)
        plan.chain_from = torch.from_numpy(source).to(device)
        crossed = bool((row[source] != row[chain]).any())  # a chain through another request: its passes add up
        plan.iterate = int(chain.size) if crossed else int(np.bincount(row[chain]).max())
    fed_rows = np.nonzero(fed)[0]
    if plan.dense or chain.size:  # the rare paths read every row
        plan.token_req = torch.from_numpy(row).to(device)
        plan.token_feed = torch.from_numpy(fed).to(device)
    elif fed_rows.size:
        plan.fed_rows = torch.from_numpy(fed_rows).to(device)
        plan.fed_reqs = torch.from_numpy(row[fed_rows]).to(device)
    return plan


def _cached_states(plan: StepPlan, rows: Rows, fed: np.ndarray, bounds: np.ndarray, start: np.ndarray,
                   chain: np.ndarray, blocks: Blocks, device) -> tuple[np.ndarray, np.ndarray]:
    """The plan's part in the block states: which rows end a block (store), and where a request whose state row
    holds nothing yet (a new or resumed one, after a cache hit) gets the state its first, fed, position reads: the
    kept state of the cached block before it (restore), or, when that block's last position is computed in this
    very step (vLLM caches a block when its last token is scheduled), that row, as a chain link. -> chain, source."""
    R, (slots, size, block_at) = len(start), blocks
    source = chain - 1
    ends = np.nonzero((slots >= 0) & (slots % size == size - 1))[0]
    first = bounds[:-1]
    fresh = np.nonzero(rows.fresh[:R] & (start > 0) & (start % size == 0) & (first < bounds[1:]))[0]
    fresh = fresh[fed[first[fresh]]]
    restore: list[tuple[int, int]] = []
    links: list[tuple[int, int]] = []
    for i in fresh:
        block = int(block_at(int(i), int(start[i]) // size - 1))
        here = np.nonzero(slots == block * size + size - 1)[0]
        if here.size:
            links.append((int(first[i]), int(here[0])))
        else:
            restore.append((int(i), block))
    if ends.size:
        plan.store_rows = torch.from_numpy(ends).to(device)
        plan.store_blocks = torch.from_numpy(slots[ends] // size).to(device)
        plan.blocks = int(slots[ends].max()) // size + 1
    if restore:
        reqs, ids = zip(*restore)
        plan.restore_reqs = torch.tensor(reqs, device=device)
        plan.restore_blocks = torch.tensor(ids, device=device)
        plan.blocks = max(plan.blocks, max(ids) + 1)
    if links:
        to, frm = (np.asarray(v, dtype=np.int64) for v in zip(*links))
        chain, source = np.concatenate([chain, to]), np.concatenate([source, frm])
    return chain, source


# ---------------------------------------------------------------------------------------------------- carrying it out
def run_step(plan: StepPlan, core: FeedbackModel, stack: Callable, plain: torch.Tensor, state: torch.Tensor,
             rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Carry out `plan` on the packed rows' plain inputs (N, D): `core` is the method's rules over the runtime's
    layers (fuse, pass_inputs, a FUSED prompt's pass loop), `stack(x)` the runtime's stack over the packed rows ->
    (state, top), `state` (rows, D) each batch row's fed-back state. -> the last pass's (state, top) (N, D)."""
    x, prev, feed = plain, None, None
    if plan.any_feed and not (plan.dense or plan.iterate):
        # the common step (decoding, plain prompts): fuse the fed rows only, from their requests' states
        x = plain.index_copy(0, plan.fed_rows, core.fuse(plain[plan.fed_rows], state[plan.fed_reqs]))
    elif plan.any_feed:
        prev, feed = state[plan.token_req], plan.token_feed.clone()
        for job in plan.dense:
            _dense_prefill(job, core, rows, prev, feed)
        x = core.pass_inputs(plain, prev, ~feed)
    new, top = stack(x)
    for _ in range(plan.iterate):
        prev = prev.clone()
        prev[plan.chain_rows] = new[plan.chain_from].to(prev.dtype)
        new, top = stack(core.pass_inputs(plain, prev, ~feed))
    return new, top


def _dense_prefill(job: DenseJob, core: FeedbackModel, rows: Rows, prev: torch.Tensor, feed: torch.Tensor) -> None:
    """A chunk of a FUSED prompt: passes 1..J-1 over all its positions (the core's pass loop) at its first chunk,
    kept in `rows` until its last; the chunk's rows take pass J's inputs (prev, feed set in place)."""
    kept = rows.fused[job.batch_row]
    if kept is None:
        ids = torch.tensor([job.prompt], dtype=torch.long, device=prev.device)  # (1, T)
        e, plain = core.embed_inputs(ids), core.plain_of(ids)
        kept = shift_right(core.iterate(e, plain, job.passes - 1)[0])[0], plain[0]  # what each position reads
    rows.fused[job.batch_row] = None if job.last else kept
    read, plain = kept
    chunk = slice(job.start, job.start + job.rows)
    at = slice(job.first_row, job.first_row + job.rows)
    prev[at] = read[chunk].to(prev.dtype)
    feed[at] = ~plain[chunk]
