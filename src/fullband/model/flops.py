"""Analytic cost of a ModelConfig: parameters, FLOPs per token (one pass, a training step, a decode step, a
prefill) and KV-cache bytes per token, counted from the config alone (no model is built).

Convention: matrix products only, a multiply-add = 2 FLOPs, so a weight matrix of n entries costs 2 n FLOPs per
token it is applied to; norms, RoPE, softmax, the gates' sigmoids and elementwise products are not counted (they
are O(D) per token against the products' O(D^2)). Attention costs 2 * 2 * D * ctx per layer per token (scores
q.k and the weighted sum of v over ctx keys, all H heads: H * Dh = D). `context="causal"` counts the keys a
position actually sees (t + 1 at position t, at most the window on a sliding-window layer), averaged over the
sequence; `context="dense"` counts every query against all T keys, as a dense kernel (and torch's FlopCounterMode)
does. Training = forward + backward, and backward = 2x forward, so a step costs 3x its forward (under ponder
less the backward of what is not trained: below); activation checkpointing recomputes the blocks' forward once
more (not counted here).

What runs per token (fullband.model.core, model.objective): the blocks below feedback_target once per forward
(their output is the plain input every pass reads), the blocks from the target up once per pass, the fusion on
every pass after the first (over all positions: plain ones are selected afterwards), and the LM head once per
scored pass (the objective scores every pass's logits; an inference read needs it only for one), and, with the
next-latent term on (train.latent_loss), the latent head once per pass (no decoder reads it).

Ponder slots (ponder = true, PonderLM-2; model.decoder's FullbandLM.jacobi_pass, step): pass 1 is the plain model
over the T positions; every later pass runs the interleaved sequence of 2 T slots [x_0, z_0, x_1, z_1, ...], two
slots' products per token, slot s attending to its s + 1 keys (`context="dense"`: all 2 T), with no fusion. The LM
head reads T positions in every pass (pass 1's token slots, a later pass's ponder slots). The objective computes
every pass's logits but trains the last pass alone: the last head's backward is counted, the earlier heads'
forward only; the backward runs through every pass's blocks (the fed states keep their gradients), through the
last pass's alone with detach_between_passes. A generated token takes two cached steps, its token slot attending
to 2 ctx - 1 keys and its ponder slot to 2 ctx, and holds two KV slots."""

from __future__ import annotations

from fullband.model.config import ModelConfig
from fullband.model.mode import DecodeMode

# Each fusion's weight matrices in units of D^2 (every entry is used once per fed token) and its other parameters
# in units of D, plus a constant (T2MLR: two gate biases of D and two ReZero scalars).
FUSION_MATRICES = {"gated": 2, "additive": 1, "concat": 2, "t2mlr": 5, "none": 0}
FUSION_EXTRA = {"t2mlr": (2, 2)}
CONTEXTS = ("causal", "dense")
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


def fusion_params(cfg: ModelConfig) -> int:
    """Parameters the fusion adds to a standard model of the same width and depth."""
    per_d, const = FUSION_EXTRA.get(cfg.fusion, (0, 0))
    return FUSION_MATRICES[cfg.fusion] * cfg.d_model**2 + per_d * cfg.d_model + const


def _block_matrices(cfg: ModelConfig) -> int:
    """Weight-matrix entries of one block: wqkv, wo, the attention output gates, SwiGLU's w_in and w_down."""
    D, Dh = cfg.d_model, cfg.head_dim
    attn = D * (cfg.n_heads + 2 * cfg.n_kv_heads) * Dh + cfg.n_heads * Dh * D
    gate = D * cfg.n_heads if cfg.attn_gate else 0
    return attn + gate + 3 * D * cfg.d_ff


def param_count(cfg: ModelConfig) -> int:
    """Every parameter of FullbandLM(cfg) (== its num_params())."""
    D = cfg.d_model
    block = _block_matrices(cfg) + 2 * D + ((cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim if cfg.qk_norm else 0)
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * D
    return (cfg.vocab_size * D + 2 * D + cfg.n_layers * block + head + fusion_params(cfg)  # 2 D: norm_in, norm_out
            + latent_head_params(cfg))


def latent_head_params(cfg: ModelConfig) -> int:
    """Parameters of the next-latent predictor (model.latent_head): D^2 for "linear", else 0."""
    return cfg.d_model**2 if cfg.latent_head == "linear" else 0


def _block(cfg: ModelConfig, layer: int, keys: float) -> float:
    """Forward FLOPs of block `layer` for one position attending to `keys` keys (before its window)."""
    window = cfg.sliding_window if cfg.is_local(layer) else None
    return 2 * _block_matrices(cfg) + 4 * cfg.d_model * (keys if window is None else min(keys, window))


def block_flops(cfg: ModelConfig, layer: int, seq_len: int, context: str = "causal") -> float:
    """Forward FLOPs per token of block `layer` over a causal sequence of seq_len positions."""
    if context not in CONTEXTS:
        raise ValueError(f"context={context!r}; accepted: {', '.join(CONTEXTS)}")
    if context == "dense":  # a dense kernel scores every key, masked or not, also on a sliding-window layer
        return 2 * _block_matrices(cfg) + 4 * cfg.d_model * seq_len
    return sum(_block(cfg, layer, t + 1) for t in range(seq_len)) / seq_len


def repeats(cfg: ModelConfig, layer: int, loops: float | None = None) -> float:
    """How many times block `layer` runs per pass: `loops` (default config.loops) inside a looped group, else 1."""
    inside = cfg.has_loop and cfg.loop_start <= layer < cfg.loop_stop
    return (cfg.loops if loops is None else loops) if inside else 1


def train_loops(cfg: ModelConfig) -> float:
    """The mean r a training step runs a looped group with (loop_train: fixed r = loops, uniform U{1..loops})."""
    return cfg.loops if cfg.loop_train == "fixed" else (cfg.loops + 1) / 2


def fusion_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per fed token of the fusion: 2 per weight-matrix entry."""
    return 2 * FUSION_MATRICES[cfg.fusion] * cfg.d_model**2


def latent_head_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of the next-latent predictor (model.latent_head), applied once per pass when
    train.latent_loss is on: 2 per entry of its matrix."""
    return 2 * latent_head_params(cfg)


def head_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of the LM head (tied or not: a V x D product)."""
    return 2 * cfg.vocab_size * cfg.d_model


def _blocks(cfg: ModelConfig, layers: range, seq_len: int, context: str, loops: float | None) -> float:
    """Forward FLOPs per token of blocks `layers` over seq_len positions, a looped block's repetitions included."""
    return sum(repeats(cfg, i, loops) * block_flops(cfg, i, seq_len, context) for i in layers)


def ponder_pass_flops(cfg: ModelConfig, seq_len: int, context: str = "causal") -> float:
    """Forward FLOPs per token of a pass after the first under ponder, its LM head not included: the stack over
    the 2 seq_len interleaved slots, slots_per_token (2) of them per token."""
    slots = cfg.slots_per_token
    return slots * _blocks(cfg, range(cfg.n_layers), slots * seq_len, context, None)


def forward_flops(cfg: ModelConfig, passes: float = 1, *, seq_len: int, heads: float = 1,
                  context: str = "causal", loops: float | None = None) -> float:
    """Forward FLOPs per token of `passes` Jacobi passes over seq_len positions: the blocks below feedback_target
    once, the others `passes` times (a looped group's `loops` times each, default config.loops), the fusion
    passes - 1 times, the LM head `heads` times; under ponder, pass 1 the plain stack and every later pass
    ponder_pass_flops. Affine in passes and heads, so a schedule's mean pass count gives its mean cost."""
    target = cfg.feedback_target
    lower = _blocks(cfg, range(target), seq_len, context, loops)
    stack = _blocks(cfg, range(target, cfg.n_layers), seq_len, context, loops)
    later = ponder_pass_flops(cfg, seq_len, context) if cfg.ponder else stack + fusion_flops(cfg)
    return lower + stack + (passes - 1) * later + heads * head_flops(cfg)


def train_flops(cfg: ModelConfig, passes: float, *, seq_len: int, context: str = "causal",
                loops: float | None = None, latent: bool = False, anchor: bool = False) -> float:
    """Training FLOPs per token of a k-pass step (or a schedule's mean k) whose looped group runs `loops` times
    (r; default train_loops(cfg), a step's mean): 3x the forward, every pass scored. Under ponder the forward
    computes every pass's logits and the backward (2x) covers the last head and the blocks of every pass (with
    detach_between_passes, of the last pass alone: then `passes` must be a whole k, since the cost of the last pass
    depends on whether it is the plain one). `latent` (train.latent_loss > 0): plus the latent head on every pass,
    forward and backward (3 latent_head_flops per pass). `anchor` (train.anchor > 0): plus the frozen starting
    model's forward, one plain pass with its head (no backward)."""
    loops = train_loops(cfg) if loops is None else loops
    extra = 3 * passes * latent_head_flops(cfg) if latent else 0
    if anchor:
        extra += forward_flops(cfg, 1, seq_len=seq_len, heads=1, context=context)
    return extra + _train_flops(cfg, passes, seq_len=seq_len, context=context, loops=loops)


def _train_flops(cfg: ModelConfig, passes: float, *, seq_len: int, context: str, loops: float) -> float:
    """train_flops without the latent head."""
    if not cfg.ponder:
        return 3 * forward_flops(cfg, passes, seq_len=seq_len, heads=passes, context=context, loops=loops)
    forward = forward_flops(cfg, passes, seq_len=seq_len, heads=passes, context=context)
    if not cfg.detach_between_passes:
        return forward + 2 * forward_flops(cfg, passes, seq_len=seq_len, heads=1, context=context)
    if passes != int(passes):
        raise ValueError(f"passes={passes}: a ponder model with detach_between_passes = true trains its last pass "
                         "alone, the plain one at k = 1 and a ponder pass above, so a mean k does not give the mean "
                         "cost; accepted: a whole number of passes (count each k of a schedule)")
    last = ponder_pass_flops(cfg, seq_len, context) if passes > 1 else forward_flops(cfg, 1, seq_len=seq_len,
                                                                                       heads=0, context=context)
    return forward + 2 * (last + head_flops(cfg))


def prefill_flops(cfg: ModelConfig, mode: DecodeMode, prompt_len: int, context: str = "causal") -> float:
    """FLOPs per prompt token of reading a prompt in `mode` (its LM head row that picks the first token is
    counted with the generated tokens): STANDARD / SOFT one pass, FUSED k 1 + k passes (at most, under tol; never
    more than the prompt's exact_passes), EXACT the recurrence: one pass's products plus the fusion at every fed
    position, one position at a time (so causal whatever `context` says; under ponder a token's two steps, which
    are a ponder pass's products)."""
    read = mode.read(prompt_len, fixed_point=cfg.exact_passes(prompt_len))
    if read.exact:  # positions 1..T-1 are fed; the step at position t attends to its t + 1 keys
        one = (ponder_pass_flops(cfg, prompt_len) if cfg.ponder
               else forward_flops(cfg, 1, seq_len=prompt_len, heads=0))
        return one + fusion_flops(cfg) * (prompt_len - 1) / prompt_len
    return forward_flops(cfg, read.passes, seq_len=prompt_len, heads=0, context=context)


def decode_flops(cfg: ModelConfig, mode: DecodeMode, context: int) -> float:
    """FLOPs of one generated token attending to `context` keys (its own position included): every block and
    the head, plus the fusion in a mode that feeds generated positions (all but STANDARD). Under ponder a token is
    two cached steps through every block, its token slot attending to 2 context - 1 keys and its ponder slot (which
    the head reads) to 2 context."""
    slots = cfg.slots_per_token
    blocks = sum(repeats(cfg, i) * _block(cfg, i, slots * context - s) for i in range(cfg.n_layers)
                 for s in range(slots))
    return blocks + head_flops(cfg) + (fusion_flops(cfg) if mode.feeds_state else 0)


def kv_bytes_per_token(cfg: ModelConfig, dtype: str = "float32") -> int:
    """KV-cache bytes one position holds: every block run's key and value (a looped block's per repetition),
    n_kv_heads x head_dim each, in each of the token's slots (two under ponder)."""
    runs = sum(repeats(cfg, i) for i in range(cfg.n_layers))
    return int(runs) * cfg.slots_per_token * 2 * cfg.n_kv_heads * cfg.head_dim * DTYPE_BYTES[dtype]


def state_bytes_per_row(cfg: ModelConfig, dtype: str = "float32") -> int:
    """What a feedback mode carries beside the cache: one D-vector per row (not per position); nothing under ponder
    (a ponder slot reads its own token's state, within the token's steps)."""
    return cfg.d_model * DTYPE_BYTES[dtype] if cfg.has_feedback and not cfg.ponder else 0
