"""Post-training under latent feedback: the log-probability of sampled responses (fullband.rl.logprob)."""

from fullband.rl.logprob import Rollout, logprobs, rollout

__all__ = ["Rollout", "logprobs", "rollout"]
