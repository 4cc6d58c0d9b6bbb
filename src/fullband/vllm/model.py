"""A full-bandwidth model inside vLLM: latent feedback decoding on vLLM's paged KV cache, continuous batching,
chunked prefill, tensor parallelism and OpenAI-compatible server, checked token for token against
`fullband.generate` (tests/test_vllm.py).

How the fed-back state is kept (the paper's appendix D on vLLM's own extension points). On the V1 model runner,
each request's latest top state lives in one persistent buffer, `state`, a row per row of vLLM's persistent batch,
allocated with the model (fixed address). vLLM tells a logits processor about every request that enters the batch
(with its SamplingParams and prompt), leaves it, or moves between rows, before each forward; RequestTracker
(fullband.vllm.tracker) is that processor: it keeps each row's mode, prompt length and FUSED prompt, and moves the
state rows with their requests. On Model Runner V2 (CUDA), the model's own ModelState (get_model_state_cls,
fullband.vllm.runner_v2) keeps the same by V2's request index, which never moves, and hands the forward this step's
requests (`fullband_batch`). Either way the forward maps its packed rows to requests with the attention metadata's
`query_start_loc`, gathers each fed row's previous state, runs the gated fusion inside forward, and writes each
request's last row back (fullband.vllm.plan: the same step plan on both runners). A finished request's row is taken
by the next one. With prefix caching the state each KV block's last position leaves is kept too, by block id
(`block_state`): a request that reads blocks from the cache and goes on with a fed position reads it there.

Why not the alternatives: vLLM's EAGLE / MTP proposers hand hidden states from the target model to the drafter
within one step, not from one step to the next; its Mamba state cache lives in KV blocks keyed by token ids (what
prefix caching keys blocks by, so fullband's scheduler adds how the positions were read: fullband.vllm.scheduler).
The engine hook picks the runner (fullband.vllm.engine.model_runner): V2 needs Triton kernels that vLLM's CPU
build cannot run, so V1 is the runner tested end to end here, and V2 only on a GPU (benchmarks/gpu_check.py runs
tests/test_vllm.py on it: docs/vllm-v2.md).

Where vLLM's machinery meets the state (modes, FUSED prompts, chunked prefill, prefix caching, preemption,
n > 1, CUDA graphs, what is not served; each case is tested): docs/serving.md, "What it computes"."""

from __future__ import annotations

from collections.abc import Iterable

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
from fullband.model.core import FeedbackModel
from fullband.model.fusion import build_fusion
from fullband.model.layers import RMSNorm as NativeRMSNorm
from fullband.model.weights import lookup, named, split
from fullband.vllm.engine import default_mode_of, model_config_of
from fullband.vllm.plan import BatchRows, Blocks, Rows, SlotBatch, StepPlan, plan_step, run_step
from fullband.vllm.tracker import SERVED

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
        # on V1, each batch row's latest fed-back state; rows move with their requests (the request tracker)
        self.register_buffer("state", torch.zeros(vllm_config.scheduler_config.max_num_seqs, cfg.d_model,
                                                  dtype=vllm_config.model_config.dtype), persistent=False)
        # with prefix caching, the state of each KV block's last position, by block id (grown to the ids seen)
        self.block_state = torch.zeros(0, cfg.d_model, dtype=vllm_config.model_config.dtype)
        self.caching = bool(cfg.has_feedback and vllm_config.cache_config.enable_prefix_caching)
        self.cache_config = vllm_config.cache_config
        object.__setattr__(self, "core", DensePrompt(self))  # the method's rules over this model's layers

    # ------------------------------------------------------------ vLLM interface
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None, fullband_batch: SlotBatch | None = None,
                **_: object) -> torch.Tensor:
        """`fullband_batch`: this step's requests on Model Runner V2 (fullband.vllm.runner_v2 passes it); on V1 they
        are the request tracker's batch rows."""
        plain = self.core.plain_input(self.embed(input_ids) if inputs_embeds is None else inputs_embeds)
        batch = fullband_batch if fullband_batch is not None else self._batch_rows()
        plan = None if batch is None else self._plan(positions, input_ids, batch.rows)
        if plan is None:  # profile and warm-up runs, STANDARD-only batches: an ordinary step, no state kept
            return self._stack(positions, plain)[1]
        if plan.blocks > self.block_state.shape[0]:  # grown to the block ids seen
            grown = self.state.new_zeros(max(plan.blocks, 2 * self.block_state.shape[0]), self.cfg.d_model)
            grown[:self.block_state.shape[0]] = self.block_state
            self.block_state = grown
        state = batch.state()
        if plan.restore_reqs is not None:
            state[plan.restore_reqs] = self.block_state[plan.restore_blocks].to(state.dtype)
        new, top = run_step(plan, self.core, lambda x: self._stack(positions, x), plain, state, batch.rows)
        last = batch.write(plan, new)
        if plan.store_rows is not None:
            self.block_state[plan.store_blocks] = new[plan.store_rows].to(self.block_state.dtype)
        if plan.sampled:  # the state each token sampled from these rows will read; one copy to the host
            rows = last[[row for row, _ in plan.sampled]].cpu()
            for (row, pos), kept in zip(plan.sampled, rows):
                SERVED.kept_states.setdefault(batch.rows.states_key[row], {})[pos] = kept
        return top

    def _batch_rows(self) -> BatchRows | None:
        """This step's requests on the V1 runner: the request tracker's rows and the model's state buffer (None
        without a tracker: on Model Runner V2, a dummy run)."""
        if SERVED.tracker is None:
            return None
        SERVED.state = self.state  # the tracker moves its rows with the requests
        return BatchRows(SERVED.tracker, self.state)

    @staticmethod
    def get_model_state_cls():
        """Model Runner V2's per-model state (vLLM's resolve_model_state_cls asks for it; V1 never does): where the
        fed-back states live on V2 (fullband.vllm.runner_v2)."""
        from fullband.vllm.runner_v2 import FeedbackModelState

        return FeedbackModelState

    def _stack(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fed-back state, final-norm output) of the compiled stack on inputs x."""
        out = self.model(None, positions, None, x)
        return (out, out) if self.cfg.feedback == "final" else out

    def _plan(self, positions: torch.Tensor, input_ids: torch.Tensor | None, rows: Rows) -> StepPlan | None:
        """This step's plan from vLLM's attention metadata (query_start_loc) and the step's requests' `rows` (row i:
        packed request i); None when nothing is fed and no state needs keeping: a run with no requests (profiling,
        warm-up), or a batch of STANDARD requests only."""
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict):
            return None
        md = metadata.get(self.model.blocks[0].attn.attn.layer_name)
        if md is None or rows.batch_size == 0:
            return None
        R = min(rows.batch_size, md.query_start_loc.shape[0] - 1)
        if not rows.feeds[:R].any() and not self.caching:  # only STANDARD requests: nothing is fed, no state
            return None  # is read later (with prefix caching, their blocks' states may be)
        qsl = md.query_start_loc[:R + 1].tolist()
        starts = positions.index_select(0, md.query_start_loc[:R].to(positions.device, torch.long)).tolist()
        ids = None if input_ids is None else input_ids[:qsl[-1]].cpu().numpy()
        if not self.caching:
            return plan_step(rows, qsl, starts, ids, self.cfg.bos_token_id, positions.device)
        if not (hasattr(md, "slot_mapping") and hasattr(md, "block_table")):
            raise ConfigError(f"prefix caching with latent feedback keeps each block's last state by the attention "
                              f"metadata's slot_mapping and block_table, which {type(md).__name__} lacks; serve with "
                              "--no-enable-prefix-caching")
        blocks = Blocks(md.slot_mapping[:qsl[-1]].cpu().numpy(), self.cache_config.block_size,
                        lambda i, j: int(md.block_table[i, j]))
        return plan_step(rows, qsl, starts, ids, self.cfg.bos_token_id, positions.device, blocks)

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
            if (self.cfg.tie_embeddings and target == "lm_head.weight") or w.kind == "latent":
                continue  # a latent head trains the fed state; decoding never reads it
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
