"""A full-bandwidth model inside vLLM: latent feedback decoding on vLLM's paged KV cache, continuous batching,
chunked prefill, tensor parallelism and OpenAI-compatible server, checked token for token against
`fullband.generate` (tests/test_vllm.py).

How the fed-back state is kept (the paper's appendix D on vLLM's own extension points). Each request's latest
top state lives in one persistent buffer, `state`, a row per row of vLLM's persistent batch, allocated with the
model (fixed address). vLLM tells a logits processor about every request that enters the batch (with its
SamplingParams and prompt), leaves it, or moves between rows, before each forward; RequestTracker
(fullband.vllm.tracker) is that processor: it keeps each row's mode, prompt length and FUSED prompt, and moves
the state rows with their requests. The forward maps its packed rows to batch rows with the attention
metadata's `query_start_loc`, gathers each fed row's previous state, runs the gated fusion inside forward, and
writes each request's last row back. A finished request's row is taken by the next one, so nothing needs
dropping. With prefix caching the state each KV block's last position leaves is kept too, by block id
(`block_state`): a request that reads blocks from the cache and goes on with a fed position reads it there.

Why not the alternatives: vLLM's EAGLE / MTP proposers hand hidden states from the target model to the drafter
within one step, not from one step to the next; its Mamba state cache lives in KV blocks keyed by token ids (what
prefix caching keys blocks by, so fullband's scheduler adds how the positions were read: fullband.vllm.scheduler);
model runner V2's ModelState hook would fit as well, but V2 needs
Triton kernels that vLLM's CPU build cannot run, so this is the path that runs, and is tested, everywhere (the
engine hook selects runner V1 for fullband folders).

Where vLLM's machinery meets the state (modes, FUSED prompts, chunked prefill, prefix caching, preemption,
n > 1, CUDA graphs, what is not served; each case is tested): README.md's "Serving" table."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                               RowParallelLinear)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.utils import maybe_prefix
from vllm.sequence import IntermediateTensors
from vllm.forward_context import get_forward_context

from fullband.errors import ConfigError
from fullband.model.attention import _attend, window_mask
from fullband.model.config import ModelConfig
from fullband.model.core import FeedbackModel, plain_positions
from fullband.model.fusion import build_fusion
from fullband.model.layers import RMSNorm as NativeRMSNorm
from fullband.model.weights import lookup, named, split
from fullband.vllm.engine import default_mode_of, model_config_of
from fullband.vllm.tracker import FUSED, SERVED, STANDARD, RequestTracker

# ---------------------------------------------------------------------------------------------------- the layers
class FeedbackAttention(nn.Module):
    """Grouped-query attention with optional per-head QK-RMSNorm gains and per-head output gates; heads are split
    over tensor-parallel ranks by vLLM's parallel linears."""

    def __init__(self, cfg: ModelConfig, layer: int, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        rank = get_tensor_model_parallel_rank()
        if cfg.n_heads % tp:
            raise ConfigError(f"n_heads={cfg.n_heads} is not divisible by tensor_parallel_size={tp}")
        if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
            raise ConfigError(f"n_kv_heads={cfg.n_kv_heads} and tensor_parallel_size={tp}: one must divide the other")
        self.n_heads = cfg.n_heads // tp
        self.n_kv_heads = max(1, cfg.n_kv_heads // tp)
        self.head_dim = Dh = cfg.head_dim
        self.eps = cfg.norm_eps
        self.q_size, self.kv_size = self.n_heads * Dh, self.n_kv_heads * Dh
        # this rank's slice of the query heads and key heads (key heads are replicated when tp > n_kv_heads)
        self.q_heads = (rank * self.n_heads, (rank + 1) * self.n_heads)
        kv_rank = rank * cfg.n_kv_heads // tp if tp > cfg.n_kv_heads else rank
        self.kv_heads = (kv_rank * self.n_kv_heads, (kv_rank + 1) * self.n_kv_heads)
        self.total_heads = cfg.n_heads
        self.qkv_proj = QKVParallelLinear(cfg.d_model, Dh, cfg.n_heads, cfg.n_kv_heads, bias=False,
                                          quant_config=vllm_config.quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(cfg.n_heads * Dh, cfg.d_model, bias=False,
                                        quant_config=vllm_config.quant_config, prefix=f"{prefix}.o_proj")
        self.qk_gain = None
        if cfg.qk_norm:
            self.qk_gain = nn.Parameter(torch.ones(self.n_heads + self.n_kv_heads, Dh), requires_grad=False)
            self.qk_gain.weight_loader = self._load_qk_gain
        self.gate = ColumnParallelLinear(cfg.d_model, cfg.n_heads, bias=False, gather_output=False,
                                         prefix=f"{prefix}.gate") if cfg.attn_gate else None
        self.rotary = get_rope(Dh, max_position=cfg.max_seq_len, is_neox_style=True,
                               rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default"})
        self.window = cfg.sliding_window if cfg.is_local(layer) else None
        self.attn = Attention(self.n_heads, Dh, Dh**-0.5, num_kv_heads=self.n_kv_heads,
                              cache_config=vllm_config.cache_config, quant_config=vllm_config.quant_config,
                              per_layer_sliding_window=self.window, prefix=f"{prefix}.attn")
        backend = self.attn.attn_backend  # some (CPU_ATTN) accept any head size here and fail at the first request
        if not backend.supports_head_size(Dh):
            raise ValueError(f"head_dim={Dh} (d_model / n_heads) is not supported by vLLM's {backend.get_name()} "
                             f"attention here; accepted: {', '.join(map(str, backend.get_supported_head_sizes()))}")

    def _load_qk_gain(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """The checkpoint's (n_heads + n_kv_heads, Dh) gains -> this rank's query heads and key heads."""
        q = loaded[self.q_heads[0]:self.q_heads[1]]
        k = loaded[self.total_heads + self.kv_heads[0]:self.total_heads + self.kv_heads[1]]
        param.data.copy_(torch.cat([q, k]).to(param.dtype))

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, D) -> q (N, H*Dh), k, v (N, Hk*Dh): normalised (with the per-head gains) and rotated."""
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_gain is not None:
            N, H, Hk, Dh = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
            qk = torch.cat([q.view(N, H, Dh), k.view(N, Hk, Dh)], dim=1)
            qk = F.rms_norm(qk.float(), (Dh,), None, self.eps).to(x.dtype) * self.qk_gain
            q, k = qk[:, :H].reshape(N, H * Dh), qk[:, H:].reshape(N, Hk * Dh)
        return (*self.rotary(positions, q, k), v)

    def output(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            gate, _ = self.gate(x)
            y = (y.view(-1, self.n_heads, self.head_dim) * torch.sigmoid(gate)[..., None]).view(y.shape)
        out, _ = self.o_proj(y)
        return out

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x, positions)
        return self.output(x, self.attn(q, k, v))

    def dense(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One sequence (T, D) from position 0 with plain causal attention (no cache)."""
        q, k, v = self.project(x, positions)
        T, H, Dh = x.shape[0], self.n_heads, self.head_dim
        qh, kh, vh = (t.view(1, T, -1, Dh).transpose(1, 2) for t in (q, k, v))
        mask = window_mask(positions, positions, self.window) if self.window is not None and self.window < T else None
        y = _attend(qh, kh, vh, causal=mask is None, mask=mask)[0]
        return self.output(x, y.transpose(0, 1).reshape(T, H * Dh))


class FeedbackMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.gate_up = MergedColumnParallelLinear(cfg.d_model, [cfg.d_ff] * 2, bias=False,
                                                  quant_config=vllm_config.quant_config, prefix=f"{prefix}.gate_up")
        self.down = RowParallelLinear(cfg.d_ff, cfg.d_model, bias=False, quant_config=vllm_config.quant_config,
                                      prefix=f"{prefix}.down")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up(x)
        out, _ = self.down(self.act(gate_up))
        return out


class FeedbackBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = FeedbackAttention(cfg, layer, vllm_config, f"{prefix}.attn")
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = FeedbackMLP(cfg, vllm_config, f"{prefix}.mlp")

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block on vLLM's residual stream: returns (this block's MLP output, the stream before it);
        their sum is the block's output (added by the next norm, as vLLM's fused add + RMSNorm does)."""
        if residual is None:
            h, residual = self.attn_norm(x), x
        else:
            h, residual = self.attn_norm(x, residual)
        h, residual = self.mlp_norm(self.attn(positions, h), residual)
        return self.mlp(h), residual

    def dense(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.dense(positions, self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


@support_torch_compile(dynamic_arg_dims={"positions": 0, "inputs_embeds": 0})
class FeedbackStack(nn.Module):
    """The transformer stack on given inputs (the fused or plain embeddings): what torch.compile and CUDA graphs
    capture. Returns the final-norm output (feedback="final": also the fed-back state), or (the pre-norm
    residual stream, the final-norm output) for feedback="residual"."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        cfg = model_config_of(vllm_config.model_config.hf_config)
        self.feedback = cfg.feedback
        self.blocks = nn.ModuleList(FeedbackBlock(cfg, i, vllm_config, f"{prefix}.blocks.{i}")
                                    for i in range(cfg.n_layers))
        self.norm_out = RMSNorm(cfg.d_model, eps=cfg.norm_eps)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x, residual = inputs_embeds, None
        for block in self.blocks:
            x, residual = block(positions, x, residual)
        top, x = self.norm_out(x, residual)
        return top if self.feedback == "final" else (x, top)

    def dense(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence through every block with plain causal attention -> (state, top)."""
        for block in self.blocks:
            x = block.dense(positions, x)
        top = self.norm_out(x)
        return (top if self.feedback == "final" else x), top


# ---------------------------------------------------------------------------------------------------- the step plan
@dataclass
class DenseJob:
    """A FUSED prompt with positions in this step's chunk: passes 1..J-1 run over the whole prompt at its first
    chunk (kept for its later chunks), and the chunk's prompt rows take pass J's inputs from them, so every chunk
    writes pass J's keys and values itself (a cached prefix of them is what it would write)."""

    prompt: list[int]
    passes: int  # Jacobi passes over the prompt (1 + k, at most its length)
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


def plan_step(tracker: RequestTracker, qsl: list[int], starts: list[int], ids: np.ndarray | None,
              bos_token_id: int | None, device: torch.device, slots: np.ndarray | None = None,
              block_size: int = 0, block_at=None) -> StepPlan:
    """The plan of one step: packed rows qsl[i]:qsl[i+1] are the chunk of batch row i, from position starts[i];
    ids (N,) the packed rows' tokens (None: unknown, no BOS rule). With prefix caching: slots (N,) the rows' KV
    slots (vLLM's slot_mapping) in blocks of block_size, block_at(i, j) the id of batch row i's j-th block."""
    R = len(starts)
    bounds = np.asarray(qsl, dtype=np.int64)
    plan = StepPlan(rows=R, last_rows=torch.from_numpy(bounds[1:] - 1).to(device))
    prompt_len, start = tracker.prompt_len[:R], np.asarray(starts, dtype=np.int64)
    end = start + np.diff(bounds)
    row = np.repeat(np.arange(R), np.diff(bounds))  # each packed row's request
    offset = np.arange(bounds[-1]) - bounds[row]  # its place in the chunk
    pos = start[row] + offset
    # SOFT / FUSED requests feed their generated positions: past the prompt, which is read plainly (a FUSED
    # prompt's own passes are planned below) but for a SOFT request's fed spans (a conversation's replies), and
    # not where the plain rule says otherwise (a BOS)
    prompt = pos < prompt_len[row]
    for i in np.nonzero(tracker.has_fed[:R])[0]:
        rows_i = slice(bounds[i], bounds[i + 1])
        for a, b in tracker.fed[i]:
            prompt[rows_i] &= (pos[rows_i] < a) | (pos[rows_i] >= b)
    plain = plain_positions(ids, pos, bos_token_id if ids is not None else None, mask=prompt)
    fed = (tracker.mode[:R][row] != STANDARD) & ~plain
    # fed rows whose predecessor is computed in this same step (recomputed outputs, fed prompt spans): iterated,
    # one more pass per such row (core.fed_passes)
    chain = np.nonzero(fed & (offset > 0))[0]
    for i in np.nonzero((tracker.mode[:R] == FUSED) & (np.minimum(tracker.passes[:R], prompt_len) > 1)
                        & (start < prompt_len))[0]:  # a chunk of a FUSED prompt
        P, first = int(prompt_len[i]), int(start[i])
        plan.dense.append(DenseJob(prompt=tracker.prompts[i], passes=min(int(tracker.passes[i]), P), start=first,
                                   first_row=int(bounds[i]), rows=min(P, int(end[i])) - first, batch_row=int(i),
                                   last=P <= end[i]))
    plan.any_feed = bool(fed.any()) or bool(plan.dense)
    sampling = np.nonzero(tracker.keeps_states[:R] & (end >= prompt_len))[0]  # vectorised: this runs every step
    plan.sampled = [(int(i), int(end[i]) - 1) for i in sampling]
    source = chain - 1
    if slots is not None:
        chain, source = _cached_states(plan, tracker, fed, bounds, start, chain, source, slots, block_size, block_at,
                                       device)
    if chain.size:
        plan.chain_rows = torch.from_numpy(chain).to(device)
        plan.chain_from = torch.from_numpy(source).to(device)
        crossed = bool((row[source] != row[chain]).any())  # a chain through another request: its passes add up
        plan.iterate = int(chain.size) if crossed else int(np.bincount(row[chain]).max())
    rows = np.nonzero(fed)[0]
    if plan.dense or chain.size:  # the rare paths read every row
        plan.token_req = torch.from_numpy(row).to(device)
        plan.token_feed = torch.from_numpy(fed).to(device)
    elif rows.size:
        plan.fed_rows = torch.from_numpy(rows).to(device)
        plan.fed_reqs = torch.from_numpy(row[rows]).to(device)
    return plan


def _cached_states(plan: StepPlan, tracker: RequestTracker, fed: np.ndarray, bounds: np.ndarray, start: np.ndarray,
                   chain: np.ndarray, source: np.ndarray, slots: np.ndarray, size: int, block_at, device):
    """The plan's part in the block states: which rows end a block (store), and where a request whose state row
    holds nothing yet (a new or resumed one, after a cache hit) gets the state its first, fed, position reads: the
    kept state of the cached block before it (restore), or, when that block's last position is computed in this
    very step (vLLM caches a block when its last token is scheduled), that row, as a chain link. -> chain, source."""
    R = len(start)
    ends = np.nonzero((slots >= 0) & (slots % size == size - 1))[0]
    first = bounds[:-1]
    fresh = np.nonzero(tracker.fresh[:R] & (start > 0) & (start % size == 0) & (first < bounds[1:]))[0]
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
        reqs, blocks = zip(*restore)
        plan.restore_reqs = torch.tensor(reqs, device=device)
        plan.restore_blocks = torch.tensor(blocks, device=device)
        plan.blocks = max(plan.blocks, max(blocks) + 1)
    if links:
        to, frm = (np.asarray(v, dtype=np.int64) for v in zip(*links))
        chain, source = np.concatenate([chain, to]), np.concatenate([source, frm])
    return chain, source


# ---------------------------------------------------------------------------------------------------- the model
class DensePrompt(FeedbackModel):
    """The served model's whole-prompt path as the method's core sees a runtime: its own layers over one sequence
    from position 0 with plain causal attention (no paged cache), so a FUSED prompt's passes are the core's pass
    loop. It holds no weights of its own: everything is the served model's."""

    def __init__(self, served: "FullbandForCausalLM") -> None:
        super().__init__()
        object.__setattr__(self, "served", served)  # not a submodule: its weights are the served model's

    @property
    def config(self) -> ModelConfig:
        return self.served.cfg

    @property
    def fusion(self) -> nn.Module | None:
        return self.served.fusion

    @property
    def norm_in(self) -> nn.Module:
        return self.served.norm_in

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.served.embed(input_ids)

    def stack(self, x: torch.Tensor, cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        state, top = self.served.model.dense(torch.arange(x.shape[1], device=x.device), x[0])
        return state[None], top[None]


class FullbandForCausalLM(nn.Module):
    """vLLM's model class for folders of architecture FullbandForCausalLM (`fullband convert --to hf`,
    `save_pretrained`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = vllm_config.model_config.hf_config
        self.cfg = cfg = model_config_of(hf_config)
        # this (worker) process's request tracker reads the folder's rules (the engine hook told the frontend's)
        SERVED.configure(has_feedback=cfg.has_feedback, default=default_mode_of(hf_config), max_passes=cfg.max_seq_len)
        if not get_pp_group().is_first_rank or not get_pp_group().is_last_rank:
            raise ConfigError("pipeline parallelism is not supported with latent feedback (use tensor parallelism)")
        # global layers must not inherit the model-level window vLLM reads from config.json's sliding_window
        vllm_config.cache_config.sliding_window = None
        self.config = hf_config
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, prefix=maybe_prefix(prefix, "embed"))
        # the fusion (replicated on every rank: 2·D² weights) and the input norm are the native modules
        self.norm_in = NativeRMSNorm(cfg.d_model, cfg.norm_eps)
        self.fusion = build_fusion(cfg.fusion, cfg.d_model)
        self.model = FeedbackStack(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.d_model, prefix=maybe_prefix(prefix, "lm_head"))
        if cfg.tie_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.embed)
        self.logits_processor = LogitsProcessor(cfg.vocab_size)
        # each batch row's latest fed-back state; rows move with their requests (the request tracker)
        self.register_buffer("state", torch.zeros(vllm_config.scheduler_config.max_num_seqs, cfg.d_model,
                                                  dtype=vllm_config.model_config.dtype), persistent=False)
        # with prefix caching, the state of each KV block's last position, by block id (grown to the ids seen)
        self.block_state = torch.zeros(0, cfg.d_model, dtype=vllm_config.model_config.dtype)
        self.caching = bool(cfg.has_feedback and vllm_config.cache_config.enable_prefix_caching)
        self.cache_config = vllm_config.cache_config
        object.__setattr__(self, "core", DensePrompt(self))  # the method's rules over this model's layers
        self._metadata: dict = {}

    # ------------------------------------------------------------ vLLM interface
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        core = self.core
        plain = core.plain_input(self.embed(input_ids) if inputs_embeds is None else inputs_embeds)
        plan = self._plan(positions, input_ids)
        if plan is not None and plan.blocks > self.block_state.shape[0]:  # grown to the block ids seen
            grown = self.state.new_zeros(max(plan.blocks, 2 * self.block_state.shape[0]), self.cfg.d_model)
            grown[:self.block_state.shape[0]] = self.block_state
            self.block_state = grown
        if plan is not None and plan.restore_reqs is not None:
            self.state[plan.restore_reqs] = self.block_state[plan.restore_blocks]
        x, prev, feed = plain, None, None
        if plan is not None and plan.any_feed and not (plan.dense or plan.iterate):
            # the common step (decoding, plain prompts): fuse the fed rows only, from their requests' states
            rows = plan.fed_rows
            x = plain.index_copy(0, rows, core.fuse(plain[rows], self.state[plan.fed_reqs]))
        elif plan is not None and plan.any_feed:
            prev, feed = self.state[plan.token_req], plan.token_feed.clone()
            for job in plan.dense:
                self._dense_prefill(job, prev, feed)
            x = core.pass_inputs(plain, prev, ~feed)
        state, top = self._stack(positions, x)
        for _ in range(plan.iterate if plan is not None else 0):
            prev = prev.clone()
            prev[plan.chain_rows] = state[plan.chain_from].to(prev.dtype)
            state, top = self._stack(positions, core.pass_inputs(plain, prev, ~feed))
        if plan is not None:  # a real step (profile and warm-up runs leave the states alone)
            self.state[:plan.rows] = state[plan.last_rows].to(self.state.dtype)
            SERVED.tracker.fresh[:plan.rows] = False
            if plan.store_rows is not None:
                self.block_state[plan.store_blocks] = state[plan.store_rows].to(self.block_state.dtype)
            if plan.sampled:  # the state each token sampled from these rows will read; one copy to the host
                rows = self.state[[row for row, _ in plan.sampled]].cpu()
                for (row, pos), kept in zip(plan.sampled, rows):
                    SERVED.kept_states.setdefault(SERVED.tracker.states_key[row], {})[pos] = kept
        return top

    def _stack(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fed-back state, final-norm output) of the compiled stack on inputs x."""
        out = self.model(None, positions, None, x)
        return (out, out) if self.cfg.feedback == "final" else out

    def _plan(self, positions: torch.Tensor, input_ids: torch.Tensor | None) -> StepPlan | None:
        """This step's plan from vLLM's attention metadata (query_start_loc) and the tracked requests; None when
        nothing is fed and no state needs keeping: a run with no requests (profiling, warm-up), or a batch of
        STANDARD requests only."""
        tracker = SERVED.tracker
        metadata = get_forward_context().attn_metadata
        if tracker is None or not isinstance(metadata, dict):
            return None
        SERVED.state = self.state
        md = metadata.get(self.model.blocks[0].attn.attn.layer_name)
        if md is None or tracker.batch_size == 0:
            return None
        R = min(tracker.batch_size, md.query_start_loc.shape[0] - 1)
        if not tracker.mode[:R].any() and not self.caching:  # only STANDARD requests: nothing is fed, no state
            return None  # is read later (with prefix caching, their blocks' states may be)
        qsl = md.query_start_loc[:R + 1].tolist()
        starts = positions.index_select(0, md.query_start_loc[:R].to(positions.device, torch.long)).tolist()
        ids = None if input_ids is None else input_ids[:qsl[-1]].cpu().numpy()
        self._metadata = metadata
        if not self.caching:
            return plan_step(tracker, qsl, starts, ids, self.cfg.bos_token_id, positions.device)
        if not (hasattr(md, "slot_mapping") and hasattr(md, "block_table")):
            raise ConfigError(f"prefix caching with latent feedback keeps each block's last state by the attention "
                              f"metadata's slot_mapping and block_table, which {type(md).__name__} lacks; serve with "
                              "--no-enable-prefix-caching")
        slots = md.slot_mapping[:qsl[-1]].cpu().numpy()
        return plan_step(tracker, qsl, starts, ids, self.cfg.bos_token_id, positions.device, slots,
                         self.cache_config.block_size, lambda i, j: int(md.block_table[i, j]))

    # ------------------------------------------------------------ a FUSED prompt
    def _dense_prefill(self, job: DenseJob, prev: torch.Tensor, feed: torch.Tensor) -> None:
        """A chunk of a FUSED prompt: passes 1..J-1 over all its positions (the core's pass loop on DensePrompt) at
        its first chunk, kept in the tracker until its last; the chunk's rows take pass J's inputs (prev, feed set in
        place)."""
        core, tracker = self.core, SERVED.tracker
        kept = tracker.fused[job.batch_row]
        if kept is None:
            ids = torch.tensor([job.prompt], dtype=torch.long, device=prev.device)  # (1, T)
            e, plain = core.embed_inputs(ids), core.plain_of(ids)
            kept = core.iterate(e, plain, job.passes - 1)[0][0], plain[0]
        tracker.fused[job.batch_row] = None if job.last else kept
        state, plain = kept
        rows = slice(job.first_row, job.first_row + job.rows)
        chunk = torch.arange(job.start, job.start + job.rows, device=prev.device)
        prev[rows] = state[(chunk - 1).clamp(min=0)].to(prev.dtype)
        feed[rows] = ~plain[chunk]

    # ------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Names as the transformers folder holds them (`model.` + the native names), placed by the weight table
        (fullband.model.weights: each native weight's served name and row blocks)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            native = name.removeprefix("model.")
            try:
                w, layer = lookup(native)
            except KeyError:
                raise ConfigError(f"checkpoint tensor {name!r} is not a fullband weight") from None
            target = named(w, layer, w.serving_name)
            if self.cfg.tie_embeddings and target == "lm_head.weight":
                continue
            if target not in params:
                raise ConfigError(f"checkpoint tensor {name!r} has no place in the served model (mapped to {target!r})")
            param = params[target]
            loader = getattr(param, "weight_loader", default_weight_loader)
            if w.splits is None:
                loader(param, tensor)
            else:
                for shard, rows in zip(SHARD_IDS[w.splits], split(w, tensor, self.cfg)):
                    loader(param, rows, shard)
            loaded.add(target)
        missing = {n for n in params if n not in loaded and not (self.cfg.tie_embeddings and n == "lm_head.weight")}
        if missing:
            raise ConfigError(f"the checkpoint lacks {len(missing)} tensor(s) the model needs: {sorted(missing)[:6]}")
        return set(params)


# how vLLM's merged linears name the row blocks of a fused matrix (fullband.model.weights.SPLITS) in their loaders
SHARD_IDS = {"qkv": ("q", "k", "v"), "gate_up": (0, 1)}
