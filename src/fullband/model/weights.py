"""The native model's weights, named once: every parameter's name, what it is (so how it is initialised and which
optimizer takes it), how a fused matrix splits into the logical matrices it stacks, and where it comes from in a
Llama checkpoint and goes in vLLM's model. Read by initialisation, optimizer routing (fullband.train.optim),
from_llama, the vLLM loader and the decode benchmark.

Shipped as source with every transformers folder (fullband.hf.remote): it imports only other shipped modules."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fullband.model.config import ModelConfig


@dataclass(frozen=True)
class Weight:
    """One parameter of FullbandLM. "{i}" in a name stands for the block index.

    kind: embedding / head (Adam), gain (Adam, never decayed, initialised at 1), offset (a bias or a scale: Adam,
    never decayed, initialised at 0), matrix (a hidden matrix: NorMuon),
    fusion (the feedback matrices: NorMuon), latent (the next-latent predictor train.latent_loss trains: NorMuon,
    Normal(0, init_std), read by no decoder). `residual`: a residual branch's output matrix, initialised at
    init_std / sqrt(2 L) so the top state stays O(1) with depth. `splits`: the row blocks of a fused matrix (SPLITS),
    orthogonalised separately and read from separate Llama tensors. `llama`: the LlamaForCausalLM tensors it is
    made of, stacked by rows. `served`: its name in fullband's vLLM model (default: the native name)."""

    name: str
    kind: str
    residual: bool = False
    splits: str | None = None
    llama: tuple[str, ...] = ()
    served: str | None = None

    @property
    def pattern(self) -> str:
        """A regular expression matching the parameter's names (every block's, for a block weight)."""
        return "^" + re.escape(self.name).replace(re.escape("{i}"), r"(\d+)") + "$"

    @property
    def serving_name(self) -> str:
        return self.served or self.name


def _block(rest: str, kind: str, *, llama: tuple[str, ...] = (), served: str | None = None, **kw) -> Weight:
    return Weight(f"blocks.{{i}}.{rest}", kind, llama=tuple(f"model.layers.{{i}}.{n}" for n in llama),
                  served=f"model.blocks.{{i}}.{served or rest}", **kw)


WEIGHTS: tuple[Weight, ...] = (
    Weight("embed.weight", "embedding", llama=("model.embed_tokens.weight",)),
    Weight("lm_head.weight", "head", llama=("lm_head.weight",)),
    Weight("norm_in.weight", "gain"),  # a converted Llama has none: set to its embedding RMS
    Weight("norm_out.weight", "gain", llama=("model.norm.weight",), served="model.norm_out.weight"),
    Weight("fusion.w_u.weight", "fusion"),  # gated
    Weight("fusion.w_g.weight", "fusion"),
    Weight("fusion.w_h.weight", "fusion"),  # additive
    Weight("fusion.w_cat.weight", "fusion"),  # concat
    Weight("fusion.w_p.weight", "fusion"),  # t2mlr: the state's projection, its gate, the stream's gate
    Weight("fusion.w_gh.weight", "fusion"),
    Weight("fusion.w_gx.weight", "fusion"),
    Weight("fusion.w_gh.bias", "offset"),
    Weight("fusion.w_gx.bias", "offset"),
    Weight("fusion.scale_h", "offset"),  # ReZero scales: 0, so an untrained mixer passes its input through
    Weight("fusion.scale_x", "offset"),
    Weight("latent_head.weight", "latent"),  # model.latent_head = "linear"
    _block("attn_norm.weight", "gain", llama=("input_layernorm.weight",)),
    _block("mlp_norm.weight", "gain", llama=("post_attention_layernorm.weight",)),
    _block("attn.wqkv.weight", "matrix", splits="qkv", served="attn.qkv_proj.weight",
           llama=("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    _block("attn.qk_gain", "gain"),
    _block("attn.w_gate.weight", "matrix", served="attn.gate.weight"),
    _block("attn.wo.weight", "matrix", residual=True, served="attn.o_proj.weight", llama=("self_attn.o_proj.weight",)),
    _block("mlp.w_in.weight", "matrix", splits="gate_up", served="mlp.gate_up.weight",
           llama=("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    _block("mlp.w_down.weight", "matrix", residual=True, served="mlp.down.weight", llama=("mlp.down_proj.weight",)),
)

# Row blocks of fused matrices, from the model config: attention's q, k, v stacked by rows; the MLP's gate rows then
# up rows. Each block is a separate linear map.
SPLITS: dict[str, Callable[[ModelConfig], tuple[int, ...]]] = {
    "qkv": lambda c: (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim),
    "gate_up": lambda c: (c.d_ff, c.d_ff),
}

_PATTERNS = [(re.compile(w.pattern), w) for w in WEIGHTS]


def lookup(name: str) -> tuple[Weight, int | None]:
    """The table row of a native parameter name and its block index (None outside the blocks); KeyError when the
    name is not a FullbandLM parameter."""
    for rx, w in _PATTERNS:
        m = rx.match(name)
        if m:
            return w, (int(m.group(1)) if m.groups() else None)
    raise KeyError(f"{name!r} is not a FullbandLM parameter (fullband.model.weights.WEIGHTS)")


def named(w: Weight, layer: int | None, name: str | None = None) -> str:
    """`name` (default: w.name) with "{i}" filled in with the block index."""
    text = w.name if name is None else name
    return text if layer is None else text.replace("{i}", str(layer))


def split(w: Weight, tensor: Tensor, cfg: ModelConfig) -> list[Tensor]:
    """A fused matrix's row blocks (the matrix itself when it stacks nothing)."""
    return [tensor] if w.splits is None else list(tensor.split(SPLITS[w.splits](cfg)))


@torch.no_grad()
def init_parameter_(name: str, p: Tensor, cfg: ModelConfig) -> Tensor:
    """The initialisation of FullbandLM parameter `name`: gains at 1; offsets at 0; fusion matrices as
    init_fusion_weight_; residual outputs at init_std / sqrt(2 L); everything else Normal(0, init_std)."""
    w, _ = lookup(name)
    if w.kind == "gain":
        return nn.init.ones_(p)
    if w.kind == "offset":
        return nn.init.zeros_(p)
    if w.kind == "fusion":
        return init_fusion_weight_(p, name, cfg)
    std = cfg.init_std / (2 * cfg.n_layers) ** 0.5 if w.residual else cfg.init_std
    return nn.init.normal_(p, std=std)


@torch.no_grad()
def init_fusion_weight_(p: Tensor, name: str = "", cfg: ModelConfig | None = None) -> Tensor:
    """Fusion matrices at 1/sqrt(fan_in) (DECISION: the fused input starts at unit scale, gates spread over sigmoid's
    range); cfg.fusion_init = "identity" starts the value path (gated W_U, additive W) at the identity, and
    cfg.fusion_gate_scale scales the gate W_G's start (0: every gate at 1/2)."""
    if cfg is not None and cfg.fusion_init == "identity" and name in IDENTITY_INIT:
        return p.copy_(torch.eye(*p.shape, dtype=p.dtype, device=p.device))
    nn.init.normal_(p, std=p.shape[1] ** -0.5)
    return p.mul_(cfg.fusion_gate_scale) if cfg is not None and name == GATE else p


IDENTITY_INIT = ("fusion.w_u.weight", "fusion.w_h.weight")  # the value paths fusion_init = "identity" starts at I
GATE = "fusion.w_g.weight"
