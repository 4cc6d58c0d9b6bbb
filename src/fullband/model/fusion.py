"""The fusion operator: how the previous position's top state h enters the next token's input.

`gated` is the paper's asymmetric gated unit, fuse(e, h) = (h W_U) * sigmoid(norm_in(e) W_G): the state is
the value path and the token only gates it, so a model cannot learn to ignore the state. `additive` and
`concat` exist for the ablation that shows why (METHOD.md section 2). The caller applies norm_in to the
result; here `e` is already norm_in(embedding).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fullband.model.layers import linear


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


FUSION_TYPES: dict[str, type[nn.Module]] = {
    "gated": GatedFusion,
    "additive": AdditiveFusion,
    "concat": ConcatFusion,
}


def build_fusion(kind: str, d_model: int) -> nn.Module | None:
    return None if kind == "none" else FUSION_TYPES[kind](d_model)
