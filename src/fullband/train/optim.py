"""Optimizers: NorMuon for hidden 2-D matrices, AdamW for the rest, routed by a table of name patterns.
`build_optimizer(model, OptimConfig)` returns one CompositeOptimizer whose param groups carry base_lr / base_wd."""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fullband.errors import ConfigError
from fullband.validate import MAX_LR, boolean, choice, integer, number
from fullband.model.config import ModelConfig
from fullband.model.weights import SPLITS, WEIGHTS, Weight

OPTIMIZERS = ("normuon", "adamw")  # OptimConfig.name
ROUTE_OPTIMIZERS = ("normuon", "adam")  # Route.optimizer
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz (Keller Jordan's Muon)
NS_EPS = 1e-7  # guards the Frobenius normalisation before Newton-Schulz
RMS_MATCH = 0.2  # NorMuon rescales its update to Adam's typical per-entry RMS


@dataclass
class OptimConfig:
    """Optimizer hyperparameters (docs/method.md, section 9). `lr` / `weight_decay` are NorMuon's, for hidden
    matrices; `adam_*` are for everything else. With name="adamw" every parameter uses AdamW at `adam_lr`,
    matrices keeping `weight_decay`. `grad_clip` (0 = off) is applied by the trainer."""

    name: str = "normuon"  # "normuon": NorMuon for hidden matrices, Adam for the rest (the routing table); "adamw":
    # AdamW everywhere at adam_lr
    lr: float = 1e-2  # NorMuon's learning rate (hidden matrices)
    weight_decay: float = 0.01  # NorMuon's decoupled weight decay (with adamw: the matrices')
    momentum: float = 0.95  # NorMuon's momentum (beta1)
    nesterov: bool = True  # NorMuon: Nesterov momentum
    beta2: float = 0.95  # NorMuon's per-neuron second moment decay
    ns_steps: int = 5  # NorMuon's Newton-Schulz iterations
    eps: float = 1e-8  # NorMuon's epsilon
    adam_lr: float = 5e-4  # Adam's learning rate (embeddings, gains; every weight with adamw)
    adam_betas: tuple[float, float] = (0.9, 0.95)  # Adam's [beta1, beta2]
    adam_eps: float = 1e-8  # Adam's epsilon
    adam_weight_decay: float = 0.0  # Adam's weight decay
    grad_clip: float = 1.0  # the gradient norm is clipped to this (0: off)
    feedback_lr_mult: float = 1.0  # the feedback weights' (fusion.*, norm_in) learning rate, times their route's

    def __post_init__(self) -> None:
        choice("optim.name", self.name, OPTIMIZERS)
        number("optim.feedback_lr_mult", self.feedback_lr_mult, low=0.0, high=1e6, low_open=True)
        for name in ("lr", "adam_lr"):
            number(f"optim.{name}", getattr(self, name), low=0.0, high=MAX_LR, low_open=True)
        for name in ("eps", "adam_eps"):
            number(f"optim.{name}", getattr(self, name), low=0.0, low_open=True)
        for name in ("weight_decay", "adam_weight_decay", "grad_clip"):
            number(f"optim.{name}", getattr(self, name), low=0.0)
        for name in ("momentum", "beta2"):
            number(f"optim.{name}", getattr(self, name), low=0.0, high=1.0, high_open=True)
        boolean("optim.nesterov", self.nesterov)
        integer("optim.ns_steps", self.ns_steps, 1)
        betas = self.adam_betas
        if not isinstance(betas, list | tuple) or len(betas) != 2:
            raise ConfigError(f"optim.adam_betas={betas!r} is invalid; accepted: two numbers [beta1, beta2]")
        for i, beta in enumerate(betas):
            number(f"optim.adam_betas[{i}]", beta, low=0.0, high=1.0, high_open=True)
        self.adam_betas = (float(betas[0]), float(betas[1]))  # TOML gives a list


# ---------------------------------------------------------------- the routing table
@dataclass(frozen=True)
class Route:
    """One row of the routing table: parameters whose (unwrapped) name matches `pattern` go to `optimizer`
    with lr = base lr * lr_mult and weight decay = base wd * wd_mult. The base lr is cfg.lr for NorMuon and
    cfg.adam_lr for Adam; the base wd is cfg.weight_decay when `decay` is "matrix" and cfg.adam_weight_decay
    when it is "adam" (default: "matrix" for NorMuon routes, "adam" for Adam routes). `splits` names how a
    fused matrix is cut by rows into the logical matrices NorMuon orthogonalises separately (see SPLITS)."""

    pattern: str
    optimizer: str
    lr_mult: float = 1.0
    wd_mult: float = 1.0
    splits: str | None = None
    decay: str | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in ROUTE_OPTIMIZERS:
            raise ConfigError(f"route {self.pattern!r}: optimizer={self.optimizer!r}; "
                              f"accepted: {', '.join(ROUTE_OPTIMIZERS)}")
        if self.splits is not None and self.splits not in SPLITS:
            raise ConfigError(f"route {self.pattern!r}: splits={self.splits!r}; accepted: {', '.join(SPLITS)} or None")
        if self.decay is None:
            object.__setattr__(self, "decay", "matrix" if self.optimizer == "normuon" else "adam")
        if self.decay not in ("matrix", "adam"):
            raise ConfigError(f"route {self.pattern!r}: decay={self.decay!r}; accepted: matrix, adam")
        try:  # fail at table definition, not at the first lookup
            re.compile(self.pattern)
        except re.error as err:
            raise ConfigError(f"route pattern {self.pattern!r} is not a valid regular expression: {err}") from None


def _native_route(w: Weight) -> Route:
    """A weight-table row's route: matrices on NorMuon, split as the row says; the rest on Adam, gains and offsets
    never decayed (decay pulls gains toward 0, not toward their init of 1)."""
    if w.kind in ("matrix", "fusion", "latent"):
        return Route(w.pattern, "normuon", splits=w.splits)
    return Route(w.pattern, "adam", wd_mult=0.0 if w.kind in ("gain", "offset") else 1.0)


NORMUON_ROUTES: tuple[Route, ...] = tuple(_native_route(w) for w in WEIGHTS)


def _on_adamw(routes: tuple[Route, ...]) -> tuple[Route, ...]:
    """name="adamw": the same rows, every one on AdamW; matrices keep the matrix weight decay."""
    return tuple(dataclasses.replace(r, optimizer="adam", splits=None, decay=r.decay) for r in routes)


ROUTES: dict[str, tuple[Route, ...]] = {"normuon": NORMUON_ROUTES, "adamw": _on_adamw(NORMUON_ROUTES)}

# A pretrained Hugging Face model wrapped with latent feedback (model.hf_path): its own weights continue on
# AdamW (adam_lr; their layout differs per architecture, e.g. GPT-2 stores Conv1D weights transposed, so no
# per-matrix NorMuon split applies); the new fusion weights (and a latent head) are routed as in a native model (AdamW under
# optim.name="adamw"). Norm gains and biases never decay.
_HF_NORMS = r"^hf\..*(norm|ln_[0-9f]|layernorm)[^.]*\.(weight|bias)$"
HF_ROUTES: tuple[Route, ...] = (
    *(_native_route(w) for w in WEIGHTS if w.name.startswith(("fusion.", "latent_head."))),
    Route(r"^norm_in\.weight$", "adam", wd_mult=0.0),
    Route(_HF_NORMS, "adam", wd_mult=0.0),
    Route(r"^hf\..*\.bias$", "adam", wd_mult=0.0),
    Route(r"^hf\.", "adam", decay="matrix"),
)
HF_ROUTE_TABLES: dict[str, tuple[Route, ...]] = {"normuon": HF_ROUTES, "adamw": _on_adamw(HF_ROUTES)}

# the weights latent feedback adds to a decoder (a warm start trains them fresh: optim.feedback_lr_mult)
FEEDBACK_WEIGHTS = ("fusion.", "norm_in.", "latent_head.")

# Segments wrappers insert into parameter names (DDP, torch.compile, activation checkpointing, FSDP1).
_WRAPPER_SEGMENTS = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def canonical_name(name: str) -> str:
    """The parameter's name in a bare FullbandLM: wrapper segments removed."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def assign_routes(named_params: Iterable[tuple[str, Tensor]], routes: Iterable[Route]) -> list[tuple[str, Tensor, int]]:
    """(canonical name, parameter, index of the first matching route) for each trainable parameter; a
    parameter that matches no route is an error naming it."""
    routes = list(routes)
    compiled = [re.compile(r.pattern) for r in routes]
    out = []
    for raw, p in named_params:
        if not p.requires_grad:  # frozen parameters belong to no optimizer
            continue
        name = canonical_name(raw)
        index = next((i for i, rx in enumerate(compiled) if rx.search(name)), None)
        if index is None:
            patterns = ", ".join(r.pattern for r in routes)
            raise ConfigError(f"parameter {name!r} (shape {tuple(p.shape)}) matches no optimizer route; add a Route "
                              f"for it to the table in fullband.train.optim; patterns: {patterns}")
        out.append((name, p, index))
    return out


def param_groups(model: nn.Module, cfg: OptimConfig, routes: Iterable[Route] | None = None) -> dict[str, list[dict]]:
    """{"normuon": groups, "adam": groups}: one group per route that matched something, in table order."""
    routes = list(ROUTES[cfg.name] if routes is None else routes)
    assigned = assign_routes(model.named_parameters(), routes)
    model_cfg = next((m.config for m in (model, getattr(model, "module", None), getattr(model, "_orig_mod", None))
                      if isinstance(getattr(m, "config", None), ModelConfig)), None)  # under DDP / compile wrappers
    groups: dict[str, list[dict]] = {"normuon": [], "adam": []}
    for index, route in enumerate(routes):
        members = [(name, p) for name, p, i in assigned if i == index]
        if not members:
            continue
        lr = (cfg.lr if route.optimizer == "normuon" else cfg.adam_lr) * route.lr_mult
        if all(name.startswith(FEEDBACK_WEIGHTS) for name, _ in members):  # a route of the feedback weights
            lr *= cfg.feedback_lr_mult
        wd = (cfg.weight_decay if route.decay == "matrix" else cfg.adam_weight_decay) * route.wd_mult
        group: dict[str, Any] = {"params": [p for _, p in members], "names": [name for name, _ in members],
                                 "route": route.pattern, "lr": lr, "weight_decay": wd, "base_lr": lr, "base_wd": wd}
        if route.optimizer == "normuon":
            if route.splits is not None and model_cfg is None:
                raise ConfigError(f"route {route.pattern!r} splits fused matrices by the model config "
                                  f"({route.splits!r}), but {type(model).__name__} has no ModelConfig at .config")
            group["splits"] = None if route.splits is None else SPLITS[route.splits](model_cfg)
        groups[route.optimizer].append(group)
    _check_disjoint(groups["normuon"] + groups["adam"])
    return groups


def _check_disjoint(groups: list[dict]) -> None:
    seen: dict[int, str] = {}
    for group in groups:
        for name, p in zip(group["names"], group["params"]):
            if id(p) in seen:
                raise ConfigError(f"parameter {name!r} is in two optimizer groups (also as {seen[id(p)]!r})")
            seen[id(p)] = name


# ---------------------------------------------------------------- NorMuon
def newton_schulz5(g: Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> Tensor:
    """Approximate U V^T of g = U S V^T with the quintic Newton-Schulz iteration; singular values land in
    roughly [0.7, 1.2] rather than exactly 1, which trains as well and needs only `steps` matmul rounds."""
    a, b, c = NS_COEFFS
    x = g.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + NS_EPS)  # Frobenius >= spectral norm, so all sv <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x


def neuron_normalize(o: Tensor, v: Tensor, beta2: float, eps: float) -> Tensor:
    """Ô = O / (sqrt(v) + eps) after v <- beta2 v + (1 - beta2) mean_cols(O ⊙ O); v (rows, 1) is updated in
    place (in its own dtype), o (rows, cols) is float32."""
    v32 = v.float().lerp_(o.square().mean(dim=1, keepdim=True), 1 - beta2)
    v.copy_(v32)
    return o / (v32.sqrt() + eps)


def normuon_update(m: Tensor, v: Tensor, *, lr: float, beta2: float, eps: float, ns_steps: int,
                   splits: tuple[int, ...] | None = None, ns_dtype: torch.dtype = torch.float32) -> Tensor:
    """The float32 step η̂·Ô for a momentum-like matrix m (rows, cols), one row block of `splits` at a time:
    each block is orthogonalised, neuron-normalised with its rows of v, and rescaled to RMS 0.2 * lr."""
    sizes = list(splits) if splits else [m.shape[0]]
    parts = []
    for mb, vb in zip(m.split(sizes, dim=0), v.split(sizes, dim=0)):
        o = newton_schulz5(mb, ns_steps, ns_dtype).float()
        o_hat = neuron_normalize(o, vb, beta2, eps)
        # ||η̂ Ô||_F / sqrt(rows * cols) = 0.2 lr: Adam-like per-entry RMS, so Adam's lr intuitions carry over
        scale = RMS_MATCH * lr * math.sqrt(o.numel()) / o_hat.norm().clamp_min(1e-30)
        parts.append(o_hat * scale)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class NorMuon(torch.optim.Optimizer):
    """NorMuon (Li et al. 2025): Muon's orthogonalised momentum with an Adam-like second moment per output
    neuron (row), rescaled to Adam's update RMS. For each 2-D parameter W with gradient G:

        M <- beta1 M + (1 - beta1) G;  U = (1 - beta1) G + beta1 M if nesterov else M
        O = NewtonSchulz5(U);  v <- beta2 v + (1 - beta2) mean_cols(O ⊙ O);  Ô = O / (sqrt(v) + eps)
        W <- W - lr wd W - η̂ Ô,  η̂ = 0.2 lr sqrt(rows cols) / ||Ô||_F

    A group's `splits` (row sizes) cuts a fused matrix into blocks, each orthogonalised and rescaled on its
    own. State (`momentum_buffer`, `second_moment` (rows, 1)) is kept in the parameter's dtype, as torch's
    Adam does, so a state_dict round trip is exact. DTensor (FSDP2) parameters: the momentum is gathered,
    the update computed on the full matrix on every rank, and each rank applies its own shard."""

    def __init__(self, params: Iterable[Tensor] | Iterable[dict], lr: float = 1e-2, weight_decay: float = 0.0,
                 momentum: float = 0.95, nesterov: bool = True, beta2: float = 0.95, ns_steps: int = 5,
                 eps: float = 1e-8, *, ns_dtype: torch.dtype | None = None) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, beta2=beta2,
                        ns_steps=ns_steps, eps=eps, splits=None)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype  # None: bfloat16 on CUDA (as Muon), float32 elsewhere
        for group in self.param_groups:
            group.setdefault("base_lr", group["lr"])
            group.setdefault("base_wd", group["weight_decay"])
            for p in group["params"]:
                _check_matrix(p, group["splits"])

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # a DTensor can only exist once its module is loaded, so this check never imports it (0.5 s)
        dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                    # one value per output row, full length on every rank (also for a sharded parameter)
                    state["second_moment"] = torch.zeros(p.shape[0], 1, dtype=p.dtype, device=p.grad.device)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                u = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                sharded = dtensor is not None and isinstance(p, dtensor)
                ns_dtype = self.ns_dtype or (torch.bfloat16 if p.device.type == "cuda" else torch.float32)
                update = normuon_update(u.full_tensor() if sharded else u, state["second_moment"], lr=group["lr"],
                                        beta2=group["beta2"], eps=group["eps"], ns_steps=group["ns_steps"],
                                        splits=group["splits"], ns_dtype=ns_dtype)
                if sharded:
                    update = _local_shard(update.to(p.dtype), p)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.sub_(update.to(p.dtype))
        return loss


def _check_matrix(p: Tensor, splits: tuple[int, ...] | None) -> None:
    if p.ndim != 2:
        raise ConfigError(f"NorMuon takes 2-D matrices; got a parameter of shape {tuple(p.shape)} (route it to Adam)")
    if splits is not None and (sum(splits) != p.shape[0] or min(splits) < 1):
        raise ConfigError(f"splits={tuple(splits)} do not cut a ({p.shape[0]}, {p.shape[1]}) matrix by rows; "
                          f"accepted: positive row counts summing to {p.shape[0]}")


def _local_shard(update: Tensor, p: Tensor) -> Tensor:
    """The DTensor holding `update` (identical on every rank) laid out like parameter p, without communication."""
    from torch.distributed.tensor import distribute_tensor

    try:  # every rank already holds the full update: slice locally instead of scattering from rank 0
        return distribute_tensor(update, p.device_mesh, p.placements, src_data_rank=None)
    except TypeError:  # torch < 2.7 has no src_data_rank; the scatter gives the same values
        return distribute_tensor(update, p.device_mesh, p.placements)


class CompositeOptimizer:
    """NorMuon and AdamW stepped together; `param_groups` lists both so LR / WD scaling is uniform:
    `for g in opt.param_groups: g["lr"] = g["base_lr"] * factor`."""

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ConfigError("CompositeOptimizer needs at least one optimizer (no parameter was routed)")
        self.optimizers = dict(optimizers)

    @property
    def normuon(self) -> NorMuon | None:
        return self.optimizers.get("normuon")

    @property
    def adam(self) -> torch.optim.AdamW | None:
        return self.optimizers.get("adam")

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """Every inner optimizer's step; the first runs `closure` (if any) before it steps and returns its loss."""
        first, *rest = self.optimizers.values()
        loss = first.step(closure)
        for opt in rest:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, dict]:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: Mapping[str, dict]) -> None:
        """Restore every inner optimizer; group hyperparameters (lr, base_lr, ...) come from the saved state."""
        if set(state) != set(self.optimizers):
            raise ConfigError(f"optimizer state holds {sorted(state)} but this optimizer has "
                              f"{sorted(self.optimizers)}; was it saved with a different optim.name?")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state[name])

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}: {len(opt.param_groups)} groups" for name, opt in self.optimizers.items())
        return f"CompositeOptimizer({inner})"


def build_optimizer(model: nn.Module, cfg: OptimConfig, routes: Iterable[Route] | None = None) -> CompositeOptimizer:
    """Route the model's trainable parameters (table ROUTES[cfg.name] unless `routes` is given) to NorMuon
    and AdamW; the returned optimizer's groups carry lr, weight_decay, base_lr, base_wd, names, route."""
    groups = param_groups(model, cfg, routes)
    optimizers: dict[str, torch.optim.Optimizer] = {}
    if groups["normuon"]:
        optimizers["normuon"] = NorMuon(groups["normuon"], lr=cfg.lr, weight_decay=cfg.weight_decay,
                                        momentum=cfg.momentum, nesterov=cfg.nesterov, beta2=cfg.beta2,
                                        ns_steps=cfg.ns_steps, eps=cfg.eps)
    if groups["adam"]:
        optimizers["adam"] = torch.optim.AdamW(groups["adam"], lr=cfg.adam_lr, betas=cfg.adam_betas, eps=cfg.adam_eps,
                                               weight_decay=cfg.adam_weight_decay)
    return CompositeOptimizer(optimizers)


def routing_report(model: nn.Module, cfg: OptimConfig,
                   routes: Iterable[Route] | None = None) -> list[tuple[str, str, float, float]]:
    """(parameter name, "normuon" | "adam", base lr, base weight decay) per trainable parameter, for logging."""
    groups = param_groups(model, cfg, routes)
    rows = [(name, kind, group["base_lr"], group["base_wd"])
            for kind in ("normuon", "adam") for group in groups[kind] for name in group["names"]]
    order = {canonical_name(name): i for i, (name, _) in enumerate(model.named_parameters())}
    return sorted(rows, key=lambda row: order.get(row[0], len(order)))
