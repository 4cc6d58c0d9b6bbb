"""What a decoding mode means, written once: how the prompt is read (one plain pass, 1 + k Jacobi passes, or the
exact recurrence) and whether generated positions are fed the previous top state.

  standard  one plain pass over the prompt; generated positions take plain embeddings (an ordinary LM)
  soft      one plain pass over the prompt; each generated position takes fuse(e_t, h_{t-1})
  fused     1 + k Jacobi passes over the prompt (k = prefill_passes, or "auto": until the RMS state update
            falls below tol, at most max_passes), then as soft
  exact     the exact recurrence over the prompt, then as soft (the ground truth)
"""

from __future__ import annotations

from dataclasses import dataclass

from fullband.errors import FullbandError, InputError
from fullband.validate import choice, integer, number

MODES = ("standard", "soft", "fused", "exact")


@dataclass(frozen=True)
class DecodeMode:
    """A decoding mode with its prefill settings, validated on construction (InputError naming the field)."""

    name: str = "soft"
    prefill_passes: int | str = 1  # fused: Jacobi passes over the prompt after the plain one, or "auto"
    tol: float = 1e-3  # "auto": stop once every row's RMS state update is below tol
    max_passes: int = 32  # "auto": at most this many fused passes

    def __post_init__(self) -> None:
        choice("mode", self.name, MODES, error=InputError)
        if self.prefill_passes == "auto":
            number("prefill_tol", self.tol, low=0, low_open=True, error=InputError)
            integer("max_prefill_passes", self.max_passes, 1, error=InputError)
        elif isinstance(self.prefill_passes, str):
            raise InputError(f"prefill_passes={self.prefill_passes!r} is invalid; accepted: an integer >= 0 or 'auto'")
        else:
            integer("prefill_passes", self.prefill_passes, 0, error=InputError)

    @classmethod
    def of(cls, mode: str | DecodeMode = "soft", prefill_passes: int | str = 1, *, tol: float = 1e-3,
           max_passes: int = 32, error: type[FullbandError] = InputError, field: str = "mode") -> DecodeMode:
        """A DecodeMode from its parts (a DecodeMode is returned as it is); `error` is the class raised, `field`
        the name the caller gives the mode (e.g. feedback_mode)."""
        if isinstance(mode, DecodeMode):
            return mode
        choice(field, mode, MODES, error=error)
        try:
            return cls(mode, prefill_passes, tol, max_passes)
        except InputError as err:
            if error is InputError:
                raise
            raise error(str(err)) from None

    @classmethod
    def from_passes(cls, passes: int) -> DecodeMode:
        """The mode whose prompt read is `passes` Jacobi passes: STANDARD for 1, FUSED with passes - 1 else."""
        integer("passes", passes, 1, error=InputError)
        return cls("standard") if passes == 1 else cls("fused", passes - 1)

    @classmethod
    def parse(cls, text: str) -> DecodeMode:
        """'soft', 'fused' (one prefill pass), 'fused:2', 'fused:auto' -> a DecodeMode."""
        name, _, k = text.partition(":")
        if not k:
            return cls(name, 1)
        if k != "auto" and not k.isdigit():
            raise InputError(f"mode {text!r} is not MODE or fused:K (e.g. fused:2, fused:auto)")
        if name != "fused":
            raise InputError(f"mode {text!r}: only fused takes prefill passes (fused:K); accepted: {', '.join(MODES)}")
        return cls(name, k if k == "auto" else int(k))

    # ---------------------------------------------------------------- what the mode means
    @property
    def feeds_state(self) -> bool:
        """Whether generated positions are fused with the previous position's top state."""
        return self.name != "standard"

    @property
    def exact(self) -> bool:
        """Whether the prompt runs through the exact recurrence (token by token) instead of Jacobi passes."""
        return self.name == "exact"

    @property
    def fused_passes(self) -> int:
        """Fused Jacobi passes over the prompt after the plain one (under "auto": the most it may run)."""
        if self.name != "fused":
            return 0
        return self.max_passes if self.prefill_passes == "auto" else self.prefill_passes

    @property
    def passes(self) -> int:
        """Jacobi passes over the prompt: 1 + fused_passes (the exact mode's recurrence is not counted here)."""
        return 1 + self.fused_passes

    @property
    def tolerance(self) -> float | None:
        """The adaptive-prefill tolerance ("auto" in fused mode), else None."""
        return self.tol if self.name == "fused" and self.prefill_passes == "auto" else None

    def prompt_passes(self, length: int) -> int:
        """Passes to run over prompts of `length` positions: a T-token prompt is exact (the fixed point) after T
        passes, so more would recompute it unchanged."""
        return min(self.passes, length)

    @property
    def label(self) -> str:
        """'standard', 'soft', 'exact', 'fused k=2', 'fused auto tol=0.001'."""
        if self.name != "fused":
            return self.name
        if self.prefill_passes == "auto":
            return f"fused auto tol={self.tol:g}"
        return f"fused k={self.prefill_passes}"

    def check(self, config, error: type[FullbandError] = InputError, *, weights: bool = True) -> DecodeMode:
        """Refuse what `config` (a ModelConfig) cannot run: more fused passes than max_seq_len (a prompt is exact
        after as many passes as it has tokens), and (weights=True) a feedback mode without fusion weights."""
        if weights and self.feeds_state and not config.has_feedback:
            raise error(f"mode={self.name!r} needs feedback weights; this model has fusion='none' (use mode='standard')")
        name = "max_prefill_passes" if self.prefill_passes == "auto" else "prefill_passes"
        if self.fused_passes > config.max_seq_len:
            raise error(f"{name}={self.fused_passes} is above the cap of max_seq_len={config.max_seq_len}: a prompt "
                        f"is exact after as many passes as it has tokens, so more cannot change anything; accepted: "
                        f"0 <= {name} <= {config.max_seq_len}")
        return self
