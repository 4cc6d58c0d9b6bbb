"""Jacobi stability (the paper's Fig. 3 / Fig. 10): iterate the fused pass map many times on validation
windows and track loss, update size ||h^(k) - h^(k-1)|| and distance to the exact recurrence; plus a
contraction diagnostic: how much the linearised pass map amplifies a perturbation per pass.

For windows of T positions the iterate is exact after T passes (position t is final after t + 1), so
k > T repeats the fixed point bit for bit; the sweep stops computing there and reports it as converged."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm.auto import tqdm

from fullband.model.objective import ntp

KS = (1, 2, 3, 5, 10, 30, 100, 300, 1000)
_EXACTLY_ZERO = 2.0**-149  # the smallest float32 above zero: only an update of exactly zero is below it


class PassMap:
    """h -> (fed-back state, top) of one fused pass that reads h (the model's own jacobi_pass, with the token
    inputs and plain positions of `input_ids` fixed): the map forward iterates."""

    def __init__(self, model, input_ids: Tensor) -> None:
        self.model = model
        self.e = model.embed_inputs(input_ids)
        self.plain = model.plain_of(input_ids)

    def first(self) -> tuple[Tensor, Tensor]:
        return self.model.jacobi_pass(self.e)

    def __call__(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return self.model.jacobi_pass(self.e, h, self.plain)


@dataclass
class SweepResult:
    ks: list[int]
    loss: list[float]  # mean NTP loss (nats/token) after k passes
    loss_stderr: list[float]
    update_rms: list[float]  # RMS of h^(k) - h^(k-1) (k = 1: RMS of h^(1) itself)
    exact_rms: list[float | None]  # RMS of h^(k) - h_exact
    update_curve: list[float] = field(default_factory=list)  # update RMS at every k = 1..max (for the plot)
    converged_at: int | None = None  # first k whose update was exactly zero in every window
    exact_loss: float | None = None


@torch.no_grad()
def jacobi_sweep(model, batches, ks=KS, *, exact: bool = True, progress: bool = False) -> SweepResult:
    """Iterate the pass map up to max(ks) times on every (inputs, targets) batch."""
    ks = sorted(set(int(k) for k in ks))
    if ks[0] < 1:
        raise ValueError(f"pass counts must be >= 1, got {ks}")
    model.eval()
    kmax = ks[-1]
    device = next(model.parameters()).device
    per_window = {k: [] for k in ks}
    upd_sq = torch.zeros(kmax, dtype=torch.float64)
    exact_sq = {k: 0.0 for k in ks}
    exact_losses: list[Tensor] = []
    count, converged = 0, []
    bar = tqdm(total=len(batches), desc="stability sweep", unit="batch", disable=not progress)
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        h_exact = None
        if exact:
            ref = model.recurrent_forward(inputs)
            h_exact = ref.hidden
            exact_losses.append(_window_nll(ref.logits, targets))
        last: dict = {}

        def each_pass(j: int, h: Tensor, top: Tensor) -> None:
            k = j + 1
            prev = last.get("h")
            delta = h.double().pow(2).sum().item() if prev is None else (h - prev).double().pow(2).sum().item()
            upd_sq[k - 1] += delta
            if prev is not None and delta == 0.0 and "done" not in last:
                last["done"] = k
            last.update(h=h, k=k)
            if k in per_window:
                record(k, h, top)

        def record(k: int, h: Tensor, top: Tensor) -> None:
            per_window[k].append(_window_nll(model.head(top), targets))
            if h_exact is not None:
                exact_sq[k] += (h - h_exact).double().pow(2).sum().item()

        # the loop stops once an update is exactly zero: the fixed point, repeated bit for bit by every later pass
        h, top, used, _ = model.iterate(model.embed_inputs(inputs), model.plain_of(inputs), kmax, tol=_EXACTLY_ZERO,
                                        each_pass=each_pass)
        for k in ks:
            if k > used:
                record(k, h, top)
        converged.append(last.get("done"))
        count += h.numel()
        bar.update(1)
    bar.close()
    losses = {k: torch.cat(v).double() for k, v in per_window.items()}
    n = next(iter(losses.values())).numel()
    return SweepResult(ks=ks, loss=[float(losses[k].mean()) for k in ks],
                       loss_stderr=[float(losses[k].std() / math.sqrt(n)) if n > 1 else float("nan") for k in ks],
                       update_rms=[math.sqrt(float(upd_sq[k - 1]) / count) for k in ks],
                       exact_rms=[math.sqrt(exact_sq[k] / count) if exact else None for k in ks],
                       update_curve=[math.sqrt(float(v) / count) for v in upd_sq],
                       converged_at=max(converged) if all(c is not None for c in converged) else None,
                       exact_loss=float(torch.cat(exact_losses).double().mean()) if exact_losses else None)


def _window_nll(logits: Tensor, targets: Tensor) -> Tensor:
    return ntp(logits, targets, reduction="none").view(targets.shape).mean(dim=1).cpu()


@dataclass
class Contraction:
    horizons: list[int]
    growth: list[float]  # (||J^k v|| / ||v||)^(1/k), worst over the probe vectors: < 1 means perturbations shrink
    lipschitz: float  # ||J||_2 by power iteration on J^T J: the largest one-pass amplification


def contraction(model, inputs: Tensor, *, horizons=(1, 2, 4, 8, 16, 32), vectors: int = 3, power_iters: int = 20,
                seed: int = 0) -> Contraction:
    """Linearise the pass map F at the exact fixed point h* (J = dF/dh there) and measure perturbation growth.

    J is nilpotent (position t reads only earlier states), so its spectral radius is 0 and J^T = 0 for T
    positions; what decides whether long feedback horizons are stable is the finite-horizon growth
    (||J^k v|| / ||v||)^(1/k) for k well below T, and the one-pass gain ||J||_2. Forward-mode JVPs give J v,
    reverse mode J^T u. power_iters = 0 skips the gain (lipschitz is then nan)."""
    from torch.func import jvp, vjp
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model.eval()
    device = next(model.parameters()).device
    inputs = inputs.to(device)
    with torch.no_grad():
        h_star = model.recurrent_forward(inputs).hidden
    pm = PassMap(model, inputs)

    def fmap(h: Tensor) -> Tensor:
        with sdpa_kernel([SDPBackend.MATH]):  # the fused CPU attention kernel has no forward-mode derivative
            return pm(h)[0]

    growth = []
    for k in horizons:  # forward mode needs no autograd graph
        # each horizon's directions come from (seed, k) alone: its growth is the same whichever horizons are asked
        g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + k)
        worst = 0.0
        for _ in range(vectors):
            v = torch.randn(h_star.shape, generator=g).to(device, h_star.dtype)
            v0 = v.norm()
            with torch.no_grad():
                for _ in range(k):
                    _, v = jvp(fmap, (h_star,), (v,))
            worst = max(worst, float((v.norm() / v0) ** (1.0 / k)) if v.norm() > 0 else 0.0)
        growth.append(worst)
    if power_iters == 0:  # the growth alone (the adaptive pass schedule's measurement)
        return Contraction(horizons=list(horizons), growth=growth, lipschitz=float("nan"))
    g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003)
    u = torch.randn(h_star.shape, generator=g).to(device, h_star.dtype)
    u = u / u.norm()
    sigma = 0.0
    _, pullback = vjp(fmap, h_star)
    for _ in range(power_iters):
        with torch.no_grad():
            _, ju = jvp(fmap, (h_star,), (u,))
        (jtju,) = pullback(ju)
        jtju = jtju.detach()
        sigma = float(jtju.norm().sqrt())
        u = jtju / jtju.norm().clamp_min(1e-30)
    return Contraction(horizons=list(horizons), growth=growth, lipschitz=sigma)


@torch.no_grad()
def state_contribution(model, batches) -> dict[str, float]:
    """How much one fused pass relies on the fed-back state: held-out loss with the true states, with states
    taken from another window of the batch (rolled), and with zero states, next to the plain pass. A model
    that ignores its state loses nothing when the states are swapped."""
    model.eval()
    device = next(model.parameters()).device
    sums = {"standard": 0.0, "fused": 0.0, "swapped": 0.0, "zero": 0.0}
    count = 0
    for inputs, targets in batches:
        if inputs.shape[0] < 2:
            raise ValueError("state_contribution needs batches of at least 2 windows (states are swapped within)")
        inputs, targets = inputs.to(device), targets.to(device)
        pm = PassMap(model, inputs)
        h, top = pm.first()
        for name, state in (("fused", h), ("swapped", h.roll(1, dims=0)), ("zero", torch.zeros_like(h))):
            sums[name] += float(_window_nll(model.head(pm(state)[1]), targets).sum())
        sums["standard"] += float(_window_nll(model.head(top), targets).sum())
        count += inputs.shape[0]
    out = {k: v / count for k, v in sums.items()}
    out["swap_penalty"] = out["swapped"] - out["fused"]
    return out


@torch.no_grad()
def pass_residuals(model, inputs: Tensor, ks) -> dict[int, float]:
    """The fixed-point residual after k passes for each k in `ks` (>= 2): RMS(h^(k) - h^(k-1)) / RMS(h^(k)) over
    `inputs`, h the fed-back state (0 once the iterate is exact: past T passes for T positions)."""
    ks = sorted(set(int(k) for k in ks))
    if ks[0] < 2:
        raise ValueError(f"a residual needs two passes: k >= 2, got {ks}")
    model.eval()
    inputs = inputs.to(next(model.parameters()).device)
    out: dict[int, float] = {}
    last: list[Tensor] = []

    def each_pass(j: int, h: Tensor, top: Tensor) -> None:
        if j + 1 in ks:
            out[j + 1] = relative_residual(h, last[0])
        last[:] = [h]

    model.iterate(model.embed_inputs(inputs), model.plain_of(inputs), ks[-1], tol=_EXACTLY_ZERO, each_pass=each_pass)
    return {k: out.get(k, 0.0) for k in ks}  # past the exact fixed point every update is zero


def relative_residual(h: Tensor, prev: Tensor) -> float:
    """The fixed-point residual of a pass: RMS(h - prev) / RMS(h) over every position and channel (the adaptive
    schedule and the stability gate read it)."""
    return float((h - prev).double().pow(2).mean().sqrt() / h.double().pow(2).mean().sqrt())
