"""ModelConfig: every architectural and multi-pass knob of a full-bandwidth model, validated on construction.

The resolved config travels with every checkpoint (`config.json`), so a folder always describes itself."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fullband.errors import ConfigError, closest
from fullband.validate import boolean, choice, integer, number

FUSIONS = ("gated", "additive", "concat", "t2mlr", "none")
FUSION_INITS = ("random", "identity")
# RoPE tables cover max_seq_len positions and are built with the model: 2**20 positions is already 1 GiB of tables
# at head_dim 128. A longer context is refused rather than allocated (a hostile config.json must not ask for TBs).
MAX_SEQ_LEN = 2**20
FEEDBACKS = ("final", "residual")
LOOP_TRAINS = ("fixed", "uniform")
LATENT_HEADS = ("none", "linear")
# A looped group runs `loops` times per token and keeps a KV cache per repetition: the cap keeps a hostile
# config.json from asking for an unbounded forward (Huginn reports up to 64 recurrences at test time).
MAX_LOOPS = 256


@dataclass
class ModelConfig:
    """Architecture of a decoder-only full-bandwidth LM.

    Fusion variants (docs/method.md, section 2): `gated` (h W_U) * sigmoid(norm_in(e) W_G) (the paper's),
    `additive` norm_in(e) + h W, `concat` [norm_in(e); h] W, and `none` (a standard transformer with no
    feedback weights, usable only with one pass). `feedback` picks which top state is fed back:
    `final` (after the final RMSNorm, the vector the tied LM head reads) or `residual` (before it). `t2mlr` is
    T2MLR's gated recurrent mixer (fullband.model.fusion.T2MLRFusion), for the rivals comparison.

    Where the state leaves and enters the stack (docs/method.md, section 4): the output of block `feedback_source`
    (0-based; null: the top block, the state `feedback` picks) at position t - 1 is fused into the input of block
    `feedback_target` (default 0: the stack input) at position t. Blocks below the target never read the state:
    they run once per forward, and their output is the plain input the fusion reads. A source below the top feeds
    its residual-stream output (feedback = "residual"). Defaults: the paper's model; T2MLR-like and LRT-like
    settings in docs/model.md ("Where the state is taken and where it enters").

    Looped depth (docs/method.md, section 4; a separate option, the Huginn / Ouro rival): blocks [`loop_start`,
    `loop_stop`) run `loops` times per token (r at inference), each repetition reusing the group's weights with its
    own KV cache, the group's output fed straight back into its input (a plain repeat: no new weights, and r = 1
    is the unlooped model). `loop_train` draws r per training step: "fixed" (r = loops) or "uniform"
    (r ~ U{1..loops}, from (seed, step)). Default: no loop.

    `ponder` (PonderLM-2, docs/method.md section 4; its own mechanism, the rival with interleaved inputs): every
    token t gets a second position in the sequence, its ponder slot, whose input is the state the token's own slot
    produced; the sequence is [x_0, z_0, x_1, z_1, ...] (input length and KV cache doubled, both slots at rotary
    position t) and z_t predicts token t + 1. Pass 1 is the plain model; pass j > 1 runs the interleaved sequence
    with z_t fed the state of pass j - 1, and only the last pass is trained. It takes no fusion weights and no other
    mechanism (fusion = "none", default layers, no loop, no sliding window, no jitter or prefix mixin).

    `input_norm` (default true): plain positions take norm_in(embedding), as in the paper. False makes the plain
    stack input the raw embedding, as in Llama-style models (so a converted Llama checkpoint computes exactly what
    it did); fused inputs still pass through norm_in, and the gate then reads a gain-free RMS-normalised
    embedding. `tie_embeddings` (default true) shares the embedding with the LM head; false adds `lm_head`.

    `latent_head` (docs/method.md, section 6): "linear" adds `latent_head`, a D x D matrix that predicts the next
    position's fed-back state from this one's, for the training objective's next-latent term (train.latent_loss);
    decoding never reads it. Default "none": no such weights."""

    vocab_size: int = 259  # tokens in the vocabulary: the embedding's rows
    d_model: int = 256  # D, the width of the residual stream
    n_layers: int = 4  # L, transformer blocks
    n_heads: int = 4  # attention heads (d_model / n_heads, the head size, must be even for RoPE)
    n_kv_heads: int | None = None  # key / value heads (GQA, a divisor of n_heads); null: n_heads
    d_ff: int | None = None  # SwiGLU's hidden width; null: 8/3 D rounded up to a multiple of 64
    max_seq_len: int = 1024  # positions the RoPE tables cover (at most 2**20)
    rope_theta: float = 10000.0  # RoPE's base
    norm_eps: float = 1e-6  # RMSNorm's epsilon
    qk_norm: bool = True  # RMSNorm on each head's queries and keys
    attn_gate: bool = False  # per-head output gate sigmoid(x W) on each head's attention output (paper 1B)
    sliding_window: int | None = None  # local attention span (positions) for layers that are not global
    global_every: int = 0  # with sliding_window: every Nth layer (N, 2N, ...) attends to everything
    init_std: float = 0.02  # initial weights' standard deviation; residual-branch outputs start at init_std / sqrt(2L)
    fusion: str = "gated"  # how the fed state meets the token (docs/method.md, section 2): gated (the paper's),
    # additive, concat, t2mlr (T2MLR's mixer) or none (a standard transformer, one pass only)
    fusion_init: str = "random"  # the fresh fusion's initialisation (a warm start's new weights): "random" (every
    # matrix Normal(0, 1/sqrt(D))) or "identity" (the state's value path W_U, or additive's W, starts at the identity:
    # the fed input is the normalised previous state)
    fusion_gate_scale: float = 1.0  # multiplies the gate matrix W_G's random start (0: every gate starts at
    # sigmoid(0) = 1/2, the same for every token)
    feedback: str = "final"  # the state fed back: "final" (after the final RMSNorm, what the LM head reads) or
    # "residual" (the residual stream before it; required for a source below the top)
    feedback_source: int | None = None  # the block whose output is fed back; None: the top
    feedback_target: int = 0  # the block at whose input the state is fused
    loop_start: int | None = None  # the looped group [loop_start, loop_stop); None: no loop
    loop_stop: int | None = None  # the looped group's end (exclusive); None: no loop
    loops: int = 1  # repetitions of the group per token at inference (r)
    loop_train: str = "fixed"  # r per training step: "fixed" (= loops) or "uniform" (U{1..loops})
    ponder: bool = False  # PonderLM-2: each token gets a second (ponder) slot whose input is its own top state
    bos_token_id: int | None = None  # positions holding this token are document starts and always take the plain
    # embedding
    input_norm: bool = True  # plain positions take norm_in(embedding), as in the paper; false: the raw embedding, as
    # in Llama (fused inputs still pass through norm_in)
    tie_embeddings: bool = True  # the LM head shares the embedding; false adds lm_head
    hf_path: str = ""  # a Hugging Face causal LM (a folder, or a hub id when online) that `fullband train` wraps with
    # latent feedback (fullband.hf.add_latent_feedback); the sizes above then come from that model
    feedback_trained: bool = True  # whether the feedback weights were trained: false for a model converted from a
    # standard checkpoint (a Llama, a GGUF file) whose fusion is freshly initialised, so its decoders default to
    # STANDARD (default_mode) until a multi-pass training run sets it
    jitter: float = 0.02  # training: uniform noise U(-jitter, jitter) on the fed state (inactive in eval mode)
    prefix_mixin_prob: float = 0.5  # training: per sequence, the probability that passes after the first read a
    # random prefix plainly (docs/method.md, section 7; inactive in eval mode)
    detach_between_passes: bool = False  # training: cut the gradient between passes
    pass_loss_weight: float = 1.0  # lambda in NTP(pass 1) + lambda * mean(NTP(passes 2..k))
    latent_head: str = "none"  # "linear": the next-latent predictor train.latent_loss trains (not read by decoding)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            integer(name, getattr(self, name), 1)
        if self.max_seq_len > MAX_SEQ_LEN:
            raise ConfigError(f"max_seq_len={self.max_seq_len} is out of range; accepted: 1 <= max_seq_len <= "
                              f"{MAX_SEQ_LEN} (2**20; the RoPE tables are built for every position)")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        integer("n_kv_heads", self.n_kv_heads, 1)
        if self.d_ff is None:  # SwiGLU near a 4x GELU MLP's parameter count: 8/3 * D, rounded up to a multiple of 64
            self.d_ff = -(-(8 * self.d_model // 3) // 64) * 64
        integer("d_ff", self.d_ff, 1)
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                              f"accepted: n_heads dividing d_model (e.g. {_divisors_hint(self.d_model)})")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}; "
                              f"accepted: a divisor of n_heads (e.g. {_divisors_hint(self.n_heads)})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim = d_model / n_heads = {self.head_dim} is odd; RoPE needs an even head_dim")
        for name in ("rope_theta", "norm_eps", "init_std"):
            number(name, getattr(self, name), low=0, low_open=True)
        for name in ("jitter", "pass_loss_weight", "fusion_gate_scale"):
            number(name, getattr(self, name), low=0)
        number("prefix_mixin_prob", self.prefix_mixin_prob, low=0, high=1)
        if self.sliding_window is not None:
            integer("sliding_window", self.sliding_window, 1)
        integer("global_every", self.global_every, 0)
        if not isinstance(self.hf_path, str):
            raise ConfigError(f"hf_path={self.hf_path!r} must be a string (a folder or a hub id; empty: none)")
        for name in ("qk_norm", "attn_gate", "detach_between_passes", "input_norm", "tie_embeddings", "ponder",
                     "feedback_trained"):
            boolean(name, getattr(self, name))
        choice("fusion", self.fusion, FUSIONS)
        self._check_fusion_init()
        choice("feedback", self.feedback, FEEDBACKS)
        choice("latent_head", self.latent_head, LATENT_HEADS)
        self._check_feedback_layers()
        self._check_loop()
        self._check_ponder()
        if self.bos_token_id is not None:
            integer("bos_token_id", self.bos_token_id, 0)
            if self.bos_token_id >= self.vocab_size:
                raise ConfigError(f"bos_token_id={self.bos_token_id} is outside the vocabulary; "
                                  f"accepted: 0 <= bos_token_id < vocab_size={self.vocab_size}, or null")

    def _check_feedback_layers(self) -> None:
        top = self.n_layers - 1
        integer("feedback_target", self.feedback_target, 0, below=self.n_layers)
        if self.feedback_source is None:
            return
        integer("feedback_source", self.feedback_source, 0)
        if not self.feedback_target <= self.feedback_source <= top:
            raise ConfigError(f"feedback_source={self.feedback_source} is out of range; accepted: feedback_target="
                              f"{self.feedback_target} <= feedback_source <= {top} (n_layers={self.n_layers}; a "
                              "source below the target would feed a function of the tokens only), or null (the top)")
        if self.feedback_source < top and self.feedback == "final":
            raise ConfigError(f"feedback_source={self.feedback_source} is below the top block ({top}): its state is "
                              'the residual stream after it; accepted with it: feedback = "residual" ("final" is the '
                              "top's final-norm output)")

    def _check_fusion_init(self) -> None:
        choice("fusion_init", self.fusion_init, FUSION_INITS)
        if self.fusion_init == "identity" and self.fusion not in ("gated", "additive"):
            raise ConfigError(f"fusion_init='identity' starts a value path at the identity: fusion 'gated' (W_U) or "
                              f"'additive' (W) has one; fusion={self.fusion!r} does not (accepted: "
                              "fusion_init='random')")
        if self.fusion_gate_scale != 1.0 and self.fusion != "gated":
            raise ConfigError(f"fusion_gate_scale={self.fusion_gate_scale} scales the gate of fusion 'gated'; "
                              f"fusion={self.fusion!r} has none (accepted: 1.0)")

    def _check_loop(self) -> None:
        choice("loop_train", self.loop_train, LOOP_TRAINS)
        integer("loops", self.loops, 1, below=MAX_LOOPS + 1)
        if self.loop_start is None and self.loop_stop is None:
            if self.loops > 1 or self.loop_train != "fixed":
                raise ConfigError(f"loops={self.loops}, loop_train={self.loop_train!r} need a looped group; accepted "
                                  "with them: loop_start and loop_stop (blocks [loop_start, loop_stop) repeat)")
            return
        if self.loop_start is None or self.loop_stop is None:
            raise ConfigError(f"loop_start={self.loop_start}, loop_stop={self.loop_stop}: give both (the group is "
                              "blocks [loop_start, loop_stop)) or neither (no loop)")
        integer("loop_start", self.loop_start, 0)
        integer("loop_stop", self.loop_stop, 0)
        if not self.loop_start < self.loop_stop <= self.n_layers:
            raise ConfigError(f"loop_start={self.loop_start}, loop_stop={self.loop_stop} is not a group of blocks; "
                              f"accepted: 0 <= loop_start < loop_stop <= n_layers={self.n_layers}")
        if self.loop_start < self.feedback_target < self.loop_stop:
            raise ConfigError(f"the looped group [{self.loop_start}, {self.loop_stop}) straddles feedback_target="
                              f"{self.feedback_target}; accepted: a group wholly below it (loop_stop <= "
                              f"{self.feedback_target}) or from it up (loop_start >= {self.feedback_target})")

    def _check_ponder(self) -> None:
        if not self.ponder:
            return
        needs = {"fusion": (self.fusion, "none"), "feedback_source": (self.feedback_source, None),
                 "feedback_target": (self.feedback_target, 0), "loop_start": (self.loop_start, None),
                 "sliding_window": (self.sliding_window, None), "jitter": (self.jitter, 0),
                 "prefix_mixin_prob": (self.prefix_mixin_prob, 0), "pass_loss_weight": (self.pass_loss_weight, 1)}
        bad = [f"{name}={_show(got)}" for name, (got, want) in needs.items() if got != want]
        if bad:
            accepted = ", ".join(f"{name} = {_show(want)}" for name, (_, want) in needs.items())
            raise ConfigError(f"ponder=true (PonderLM-2's ponder slots) is its own mechanism; got {', '.join(bad)}; "
                              f"accepted with it: {accepted}")

    @property
    def has_loop(self) -> bool:
        """Whether a group of blocks repeats per token (loop_start / loop_stop)."""
        return self.loop_start is not None

    @property
    def loop_size(self) -> int:
        """G, the blocks in the looped group (0 without one)."""
        return self.loop_stop - self.loop_start if self.has_loop else 0

    def loop_cost(self, loops: int | None = None) -> float:
        """A token's block compute at r loops (default: loops) over the unlooped model's: (L + (r - 1) G) / L."""
        r = self.loops if loops is None else loops
        return (self.n_layers + (r - 1) * self.loop_size) / self.n_layers

    @property
    def source_layer(self) -> int:
        """The block whose output is fed back (feedback_source, or the top)."""
        return self.n_layers - 1 if self.feedback_source is None else self.feedback_source

    @property
    def default_layers(self) -> bool:
        """Whether the state leaves the top block and enters block 0 (the paper's model; every runtime runs it)."""
        return self.source_layer == self.n_layers - 1 and self.feedback_target == 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def is_local(self, layer: int) -> bool:
        """Whether block `layer` (0-based) uses sliding-window attention."""
        return self.sliding_window is not None and not (self.global_every and (layer + 1) % self.global_every == 0)

    @property
    def slots_per_token(self) -> int:
        """Sequence positions, and KV cache slots, a token takes: 2 under ponder (its token slot and its ponder
        slot), else 1."""
        return 2 if self.ponder else 1

    def exact_passes(self, length: int) -> int:
        """Jacobi passes after which `length` positions are at the fixed point: position t is final after t + 1;
        under ponder pass j's ponder slots read the token slots of pass j - 1, so one more (length + 1)."""
        return length + 1 if self.ponder else length

    @property
    def has_feedback(self) -> bool:
        """Whether a pass after the first reads a state: fusion weights, or ponder slots."""
        return self.fusion != "none" or self.ponder

    @property
    def feedback_ready(self) -> bool:
        """Whether a mode that feeds the state is worth running by default: feedback weights that were trained."""
        return self.has_feedback and self.feedback_trained

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> "ModelConfig":
        """Build from a mapping; unknown keys are an error that names the key and the closest valid one."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping of model fields, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in names:
                raise ConfigError(f"{source}: unknown model field {key!r}{closest(key, names)}; accepted: "
                                  f"{', '.join(names)}")
        return cls(**data)

    def replace(self, **changes: Any) -> "ModelConfig":
        return ModelConfig.from_dict({**self.to_dict(), **changes})


def require_one_slot(cfg: ModelConfig, runtime: str) -> None:
    """Raise ConfigError if cfg has ponder slots: `runtime` runs one position per token (the native FullbandLM runs
    PonderLM-2's two)."""
    if getattr(cfg, "ponder", False):
        raise ConfigError(f"{runtime} runs one position per token; got ponder=true (PonderLM-2: two per token, a KV "
                          "cache of 2 T); accepted: ponder = false (the native FullbandLM runs ponder slots)")


def require_default_layers(cfg: ModelConfig, runtime: str) -> None:
    """Raise ConfigError unless cfg feeds the top state into block 0, loops no group and has no ponder slots:
    `runtime` runs only that (the native FullbandLM runs any feedback_source / feedback_target, a loop, ponder)."""
    require_one_slot(cfg, runtime)
    if cfg.has_loop:
        raise ConfigError(f"{runtime} runs every block once per token; got loop_start={cfg.loop_start}, loop_stop="
                          f"{cfg.loop_stop} (loops={cfg.loops}); accepted: loop_start = loop_stop = null (the native "
                          "FullbandLM runs a looped group)")
    if not cfg.default_layers:
        raise ConfigError(f"{runtime} feeds the top state into block 0 only; got feedback_source="
                          f"{cfg.feedback_source}, feedback_target={cfg.feedback_target}; accepted: feedback_source = "
                          "null (or n_layers - 1) and feedback_target = 0 (the native FullbandLM runs any)")


def _show(value: Any) -> str:
    """A config value as the TOML reader writes it: null, "text", 1.0."""
    return "null" if value is None else f'"{value}"' if isinstance(value, str) else repr(value)


def _divisors_hint(n: int) -> str:
    divs = [d for d in range(1, min(n, 64) + 1) if n % d == 0]
    return ", ".join(str(d) for d in divs[-6:])
