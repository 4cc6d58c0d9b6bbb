"""The fusion operator: how the previous position's top state h enters the next token's input.

`gated` is the paper's asymmetric gated unit, fuse(e, h) = (h W_U) * sigmoid(norm_in(e) W_G): the state is
the value path and the token only gates it, so a model cannot learn to ignore the state. `additive` and
`concat` exist for the ablation that shows why (docs/method.md, section 2); `t2mlr` is a rival's mixer (T2MLR), for
the compute-matched comparison. Shipped as source with every
transformers folder (fullband.hf.remote): it imports only other shipped modules."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fullband.model.layers import linear, rms_norm


class GatedFusion(nn.Module):
    """(h W_U) * sigmoid(e W_G): exactly 2 D^2 weights."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.w_u = nn.Linear(d_model, d_model, bias=False)
        self.w_g = nn.Linear(d_model, d_model, bias=False)

    def forward(self, e: Tensor, h: Tensor) -> Tensor:
        return linear(h, self.w_u.weight) * torch.sigmoid(linear(e, self.w_g.weight))


class AdditiveFusion(nn.Module):
    """e + h W: D^2 weights; a warm-started model can drive W to zero and ignore the state."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.w_h = nn.Linear(d_model, d_model, bias=False)

    def forward(self, e: Tensor, h: Tensor) -> Tensor:
        return e + linear(h, self.w_h.weight)


class ConcatFusion(nn.Module):
    """[e; h] W with W: 2D -> D, 2 D^2 weights."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.w_cat = nn.Linear(2 * d_model, d_model, bias=False)

    def forward(self, e: Tensor, h: Tensor) -> Tensor:
        return linear(torch.cat([e, h], dim=-1), self.w_cat.weight)


class T2MLRFusion(nn.Module):
    """T2MLR's gated recurrent mixer (princeton-pli/T2MLR, their `gated` module with the linear state projection and
    learnable gates, the setting of their FineWeb runs):
        x + tanh(a_h) sigmoid([x; h] W_gh + b_gh) * (h W_P) + tanh(a_x) sigmoid([x; h] W_gx + b_gx) * x
    5 D^2 weights. Unlike ours it is residual: it adds to its input x (the stream at the target block, at its own
    scale, not renormalised) and both gates read both streams; the ReZero scales a_h, a_x start at 0, so an untrained
    mixer passes x through (a warm-started model starts as it was). DECISION: gate biases start at 0 (theirs take
    a configurable or random start; at a = 0 it does not matter)."""

    residual = True  # fused_input: no norm_in around it, and it reads the raw stream

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.w_p = nn.Linear(d_model, d_model, bias=False)
        self.w_gh = nn.Linear(2 * d_model, d_model)
        self.w_gx = nn.Linear(2 * d_model, d_model)
        self.scale_h = nn.Parameter(torch.zeros(1))
        self.scale_x = nn.Parameter(torch.zeros(1))

    def forward(self, x: Tensor, h: Tensor) -> Tensor:
        both = torch.cat([x, h], dim=-1)
        fed = torch.sigmoid(linear(both, self.w_gh.weight) + self.w_gh.bias) * linear(h, self.w_p.weight)
        kept = torch.sigmoid(linear(both, self.w_gx.weight) + self.w_gx.bias) * x
        return x + torch.tanh(self.scale_h) * fed + torch.tanh(self.scale_x) * kept


FUSION_TYPES: dict[str, type[nn.Module]] = {"gated": GatedFusion, "additive": AdditiveFusion, "concat": ConcatFusion,
                                            "t2mlr": T2MLRFusion}


def build_fusion(kind: str, d_model: int) -> nn.Module | None:
    return None if kind == "none" else FUSION_TYPES[kind](d_model)


def fused_input(fusion: nn.Module, norm_in: nn.Module, e: Tensor, prev: Tensor, *, normalise_gate: bool) -> Tensor:
    """The input of the target block at a fed-back position: norm_in(fuse(e, prev)) (which positions are fed is
    fullband.model.core's rule). `normalise_gate`: e is not norm_in's output (a raw embedding, or the stream at a
    target block above 0), so the fusion reads a gain-free RMS-normalised copy of it. A residual mixer (T2MLR's)
    reads e as it is and is its own output."""
    if getattr(fusion, "residual", False):
        return fusion(e, prev.to(e.dtype))
    gate_in = rms_norm(e, None, norm_in.eps) if normalise_gate else e
    return norm_in(fusion(gate_in, prev.to(e.dtype)))


def embedding_rms(weight: Tensor) -> float:
    """Mean RMS of the embedding rows: the gain that puts fused inputs at the scale of a model's raw embeddings."""
    return float(weight.float().pow(2).mean(-1).sqrt().mean())
