"""What a decoding mode means, written once: how the prompt is read (one plain pass, 1 + k Jacobi passes, or the
exact recurrence) and whether generated positions are fed the previous top state.

  standard  one plain pass over the prompt; generated positions take plain embeddings (an ordinary LM)
  soft      one plain pass over the prompt; each generated position takes fuse(e_t, h_{t-1})
  fused     1 + k Jacobi passes over the prompt (k = prefill_passes; with `tol`, fewer once every row's RMS state
            update is below tol: adaptive prefill, at most k), then as soft
  exact     the exact recurrence over the prompt, then as soft (the ground truth)

Shipped as source with every transformers folder (fullband.hf.remote): it imports only other shipped modules."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import InitVar, dataclass

from fullband.errors import FullbandError, InputError
from fullband.validate import ascii_int, choice, integer, number

MODES = ("standard", "soft", "fused", "exact")
AUTO = "auto"  # the spelling of adaptive prefill at the edges (CLI, lm-eval, generate's prefill_passes)
AUTO_TOL, AUTO_MAX = 1e-3, 32  # adaptive prefill's defaults: tolerance and most fused passes


@dataclass(frozen=True)
class Read:
    """How a mode reads a prompt (DecodeMode.read): every runtime asks this value instead of deciding."""

    passes: int  # Jacobi passes over the prompt; 0: the exact recurrence, token by token
    tol: float | None  # stop the passes once every row's RMS state update is below tol (adaptive FUSED)
    plain_prompt: bool  # the prompt's positions (but fed spans) stay plain beside the model's rule: a one-pass read
    key: str  # what a prompt's keys and values depend on besides its tokens: "plain", "fused:K", "exact"
    rereads: bool  # a new chat turn reads the whole conversation again (FUSED), not only its new tokens

    @property
    def exact(self) -> bool:
        return self.passes == 0

    def plain(self, prompt):
        """The positions this read keeps plain beside the model's rule, from a prompt mask (B, T) (the prompt, or
        the part of it not fed): the mask for a one-pass read, None (nothing more) when the prompt is fed."""
        return prompt if self.plain_prompt else None


@dataclass(frozen=True)
class DecodeMode:
    """A decoding mode with its prefill settings, validated on construction (InputError naming the field).

    `prefill_passes` is k, the fused Jacobi passes over the prompt after the plain one; with `tol` they stop early
    once every row's RMS state update is below tol (adaptive prefill: "until the update is below tol, at most k").
    The older spelling DecodeMode("fused", "auto", tol=..., max_passes=...) is read as DecodeMode("fused",
    max_passes, tol=tol)."""

    name: str = "soft"
    prefill_passes: int = 1
    tol: float | None = None
    max_passes: InitVar[int | None] = None  # only with prefill_passes="auto" (the older spelling)

    def __post_init__(self, max_passes: int | None) -> None:
        choice("mode", self.name, MODES, error=InputError)
        if self.prefill_passes == AUTO:
            object.__setattr__(self, "prefill_passes", AUTO_MAX if max_passes is None else max_passes)
            object.__setattr__(self, "tol", AUTO_TOL if self.tol is None else self.tol)
            integer("max_prefill_passes", self.prefill_passes, 1, error=InputError)
        elif isinstance(self.prefill_passes, str):
            raise InputError(f"prefill_passes={self.prefill_passes!r} is invalid; accepted: an integer >= 0 or 'auto'")
        elif max_passes is not None:
            raise InputError("max_passes goes with prefill_passes='auto'; give the cap as prefill_passes and the "
                             "tolerance as tol: DecodeMode('fused', K, tol=TOL)")
        integer("prefill_passes", self.prefill_passes, 0, error=InputError)
        object.__setattr__(self, "prefill_passes", int(self.prefill_passes))
        if self.tol is not None:
            number("prefill_tol", self.tol, low=0, low_open=True, error=InputError)

    @classmethod
    def parse(cls, mode: str | Mapping | DecodeMode = "soft", prefill_passes: int | str | None = None, *,
              tol: float | None = None, max_passes: int | None = None, error: type[FullbandError] = InputError,
              field: str = "mode", default_passes: int | str | None = None) -> DecodeMode:
        """A DecodeMode from any spelling users give it: a DecodeMode (returned as it is when no part is given);
        'soft', 'fused', 'fused:2', 'fused:auto'; a mapping of feedback_mode / prefill_passes (an HF config, lm-eval
        or vLLM extra args). prefill_passes is an integer or "auto" (adaptive, with `tol` and `max_passes`, defaults
        1e-3 and 32). `default_passes`: the passes a bare "fused" takes when none are given (a served folder's or a
        config's default; else 1). `error` is the class raised, `field` the name the caller gives the mode (e.g.
        feedback_mode)."""
        if isinstance(mode, Mapping):
            mode, prefill_passes = mode.get("feedback_mode", "soft"), mode.get("prefill_passes", prefill_passes)
        if isinstance(mode, DecodeMode):
            if prefill_passes is None and tol is None and max_passes is None:
                return mode
            mode = mode.name
        if isinstance(mode, str) and ":" in mode:
            name, _, k = mode.partition(":")
            if k != AUTO and not (k.isascii() and k.isdigit()):
                raise error(f"mode {mode!r} is not MODE or fused:K (e.g. fused:2, fused:auto)")
            if name != "fused":
                raise error(f"mode {mode!r}: only fused takes prefill passes (fused:K); accepted: {', '.join(MODES)}")
            if prefill_passes is not None and str(prefill_passes) != k:
                raise error(f"mode {mode!r} and prefill_passes={prefill_passes!r} disagree; give the passes once "
                            "(fused:K)")
            mode, prefill_passes = name, k if k == AUTO else int(k)
        choice(field, mode, MODES, error=error)
        if prefill_passes is None and mode == "fused":
            prefill_passes = default_passes  # a bare "fused" takes the default's passes (a folder's, a config's)
        passes = 1 if prefill_passes is None else prefill_passes
        if isinstance(passes, str) and (n := ascii_int(passes.strip())) is not None:
            passes = n  # "2" from a command line or lm-eval's model_args
        try:
            if passes == AUTO:
                return cls(mode, AUTO_MAX if max_passes is None else max_passes, AUTO_TOL if tol is None else tol)
            return cls(mode, passes)
        except InputError as err:
            if error is InputError:
                raise
            raise error(str(err)) from None

    of = parse  # the older name

    @classmethod
    def from_passes(cls, passes: int) -> DecodeMode:
        """The mode whose prompt read is `passes` Jacobi passes: STANDARD for 1, FUSED with passes - 1 else."""
        integer("passes", passes, 1, error=InputError)
        return cls("standard") if passes == 1 else cls("fused", passes - 1)

    # ---------------------------------------------------------------- how it reads a prompt
    def read(self, length: int, fed: int = 0, *, fixed_point: int | None = None, what: str = "fed prompt positions",
             error: type[FullbandError] = InputError) -> Read:
        """How this mode reads a `length`-token prompt whose rows hold at most `fed` positions read as they were
        generated (SOFT's fed spans: a conversation's earlier replies). `fixed_point`: the Jacobi passes after which
        the prompt is exact (the model's exact_passes(length); default length). The one place this is decided:

          EXACT        the recurrence (passes 0)
          fed spans    SOFT only: 1 + fed passes, each fed position one more (position t is exact one pass after
                       t - 1 when fed, in the same pass when plain), the rest of the prompt plain
          the others   1 + k passes (STANDARD / SOFT k = 0), FUSED stopping early on `tol`; a one-pass read keeps
                       the prompt plain

        and never more than `fixed_point` passes: past the fixed point a pass recomputes the prompt unchanged."""
        cap = max(1, length if fixed_point is None else fixed_point)
        rereads = self.name == "fused"
        if fed:
            if not self.reads_fed_spans:
                raise error(f"{what}: fed prompt positions are for mode 'soft' (a plain prompt, fed replies), not "
                            f"{self.label!r}: standard feeds nothing, fused and exact read the whole prompt fed")
            return Read(min(1 + fed, cap), None, True, "plain", rereads)
        if self.exact:
            return Read(0, None, False, "exact", rereads)
        return Read(min(self.passes, cap), self.tolerance, self.passes == 1,
                    "plain" if self.passes == 1 else f"fused:{self.fused_passes}", rereads)

    # ---------------------------------------------------------------- what the mode means
    @property
    def feeds_state(self) -> bool:
        """Whether generated positions are fused with the previous position's top state."""
        return self.name != "standard"

    @property
    def reads_fed_spans(self) -> bool:
        """Whether a prompt may hold positions read as they were generated (SOFT: a plain prompt, fed replies)."""
        return self.name == "soft"

    @property
    def exact(self) -> bool:
        """Whether the prompt runs through the exact recurrence (token by token) instead of Jacobi passes."""
        return self.name == "exact"

    @property
    def fused_passes(self) -> int:
        """Fused Jacobi passes over the prompt after the plain one (with `tol`: the most it may run)."""
        return self.prefill_passes if self.name == "fused" else 0

    @property
    def passes(self) -> int:
        """Jacobi passes over the prompt: 1 + fused_passes (the exact mode's recurrence is not counted here)."""
        return 1 + self.fused_passes

    @property
    def tolerance(self) -> float | None:
        """The adaptive-prefill tolerance (FUSED with `tol`), else None."""
        return self.tol if self.name == "fused" else None

    @property
    def adaptive(self) -> bool:
        return self.tolerance is not None

    @property
    def label(self) -> str:
        """'standard', 'soft', 'exact', 'fused k=2', 'fused auto tol=0.001'."""
        if self.name != "fused":
            return self.name
        return f"fused auto tol={self.tol:g}" if self.adaptive else f"fused k={self.prefill_passes}"

    def check(self, config, error: type[FullbandError] = InputError, *, weights: bool = True) -> DecodeMode:
        """Refuse what `config` (a ModelConfig) cannot run: more fused passes than max_seq_len (a prompt is exact
        after as many passes as it has tokens), (weights=True) a feedback mode without fusion weights, and a ponder
        model's one-pass prompt (standard, soft, fused:0)."""
        if weights and self.feeds_state and not config.has_feedback:
            raise error(f"mode={self.name!r} needs feedback weights; this model has fusion='none' (use mode='standard')")
        if getattr(config, "ponder", False) and not (self.exact or self.fused_passes):
            raise error(f"mode={self.label!r}: a ponder model (PonderLM-2) reads a prompt into two slots per token, "
                        "which a single plain pass does not write; accepted: fused with prefill_passes >= 1 "
                        "(PonderLM-2's own prefill is fused:4) or exact")
        name = "max_prefill_passes" if self.adaptive else "prefill_passes"
        if self.fused_passes > config.max_seq_len:
            raise error(f"{name}={self.fused_passes} is above the cap of max_seq_len={config.max_seq_len}: a prompt "
                        f"is exact after as many passes as it has tokens, so more cannot change anything; accepted: "
                        f"0 <= {name} <= {config.max_seq_len}")
        return self


def default_mode(config) -> DecodeMode:
    """The mode a decoder runs when none is asked for: SOFT for a model whose feedback weights were trained
    (ModelConfig.feedback_ready), STANDARD for a model without feedback weights or with freshly initialised ones
    (a converted Llama or GGUF file, until a multi-pass training run): fed through untrained weights, its state
    would turn the model's text into noise."""
    return DecodeMode("soft") if getattr(config, "feedback_ready", True) else DecodeMode("standard")


def default_note(config) -> str | None:
    """What to tell a user whose model decodes STANDARD by default because its feedback weights are untrained."""
    if getattr(config, "has_feedback", False) and not getattr(config, "feedback_trained", True):
        return ("mode standard: this model's feedback weights are untrained (converted from a standard model; "
                "feedback_trained = false), so it decodes as the original model. Train it with several passes "
                "(fullband train), or pass --mode soft to feed the untrained state anyway")
    return None

