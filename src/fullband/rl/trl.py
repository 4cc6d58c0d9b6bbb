"""GRPO with TRL's GRPOTrainer on a transformers folder of ours (`fullband convert --to hf`), scored by the fed
log-probabilities: FeedbackGRPOTrainer replaces the one hook TRL scores completions with (policy, old policy and
reference alike) by fullband.rl.logprob in the model's feedback mode (config.feedback_mode / prefill_passes).

TRL still samples (FullbandForCausalLM.generate decodes in that same mode, so rollouts are on-policy), rewards,
standardises and computes its loss. Tested with TRL 1.16.0; needs `pip install 'fullband[trl]'`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fullband.errors import InputError, MissingPackage
# importing fullband.hf registers FullbandForCausalLM: TRL loads folders by path
from fullband.hf.modeling import FullbandForCausalLM, check_pretrained
from fullband.rl.logprob import Rollout, parse_path, rl_mode, scores
from fullband.version import check_tested

try:
    from trl import GRPOTrainer
except ImportError:
    raise MissingPackage("GRPO through TRL needs trl: pip install 'fullband[trl]'") from None


class FeedbackGRPOTrainer(GRPOTrainer):
    """trl.GRPOTrainer whose per-token log-probabilities are the fed ones (docs/rl.md, "GRPO with TRL").

    `logprob`: "exact" (the decode engine, teacher-forced; the default) or "jacobi:K" (K parallel passes; equal to
    exact once K >= the completion length, + k for FUSED k). "replay" needs the states recorded while sampling,
    which TRL's generation does not keep."""

    def __init__(self, *args: Any, logprob: str = "exact", **kwargs: Any) -> None:
        import trl

        check_tested("trl", trl.__version__, "FeedbackGRPOTrainer")
        if parse_path(logprob)[0] == "replay":
            raise InputError("logprob='replay' needs the fed states recorded while sampling, which TRL's generation "
                             "does not keep (and which rollouts from older weights, as TRL's AsyncGRPOTrainer or "
                             "num_iterations > 1 train on, would hold stale); accepted: exact, jacobi:K")
        self.logprob = logprob
        check_pretrained(args[0] if args else kwargs.get("model"), "FeedbackGRPOTrainer(model=...)")
        super().__init__(*args, **kwargs)
        _native(self.model)  # a FullbandForCausalLM, or say so
        config = self.model.config
        # the policy's mode reads every model's completions, the reference's too (its folder may say another)
        self.feedback_mode = rl_mode(config.decode_mode())
        if self.args.gradient_checkpointing:  # GRPOConfig's default; transformers would refuse it at train()
            raise InputError("FullbandForCausalLM has no transformers activation checkpointing; set "
                             "GRPOConfig(gradient_checkpointing=False)")
        # on-policy only where the samples come from FullbandForCausalLM.generate, the way they are scored
        other = [name for name, on in (("use_vllm", self.use_vllm), ("use_transformers_continuous_batching",
                 self.use_transformers_continuous_batching), ("tools", bool(self.tools))) if on]
        if other:
            raise InputError(f"FeedbackGRPOTrainer samples with transformers' generate in the feedback mode; "
                             f"{', '.join(other)} is not supported (the completions would not be scored as sampled)")

    def _get_per_token_logps_and_entropies(self, model, input_ids: Tensor, attention_mask: Tensor,
                                           logits_to_keep: int, batch_size: int | None = None,
                                           compute_entropy: bool = False, compute_aux_loss: bool = False,
                                           **multimodal: Any) -> tuple[Tensor, Tensor | None, None]:
        """TRL's rows (B, P + C): prompts left-padded, completions (the last logits_to_keep = C columns)
        right-padded, attention_mask marking real tokens -> each completion token's fed log-probability at TRL's
        temperature (B, C), its entropy (B, C) when asked, and no router loss; 0 on padding."""
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given or compute_aux_loss:
            raise InputError(f"FeedbackGRPOTrainer scores text only; got {given or ['a router (MoE) loss']}")
        native = _native(self.accelerator.unwrap_model(model))
        real = attention_mask.bool()
        P = input_ids.shape[1] - logits_to_keep
        if bool((real[:, 1:P] < real[:, : P - 1]).any() or (real[:, P + 1:] > real[:, P:-1]).any()):
            raise InputError("FeedbackGRPOTrainer expects TRL's layout: prompts left-padded, completions right-padded")
        rows = [(row[:P][m[:P]].tolist(), row[P:][m[P:]].tolist()) for row, m in zip(input_ids, real)]
        step = batch_size or len(rows)
        logps, entropies = [], []
        for i in range(0, len(rows), step):
            chunk = rows[i: i + step]
            # exact and jacobi:K read a Rollout's prompts, responses and mode; its logprobs only give the width C
            rollout = Rollout([p for p, _ in chunk], [y for _, y in chunk], torch.zeros(len(chunk), logits_to_keep),
                              torch.zeros(0), self.feedback_mode)
            grad = torch.is_grad_enabled()  # TRL scores the old policy and the reference under no_grad
            with self.accelerator.autocast():
                logp, entropy = scores(native, rollout, self.logprob, temperature=self.temperature)
            # the exact path differentiates whatever the caller's mode: constants stay constants
            logps.append(logp if grad else logp.detach())
            entropies.append(entropy if grad else entropy.detach())
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None


def _native(model) -> Any:
    """The native model (a FeedbackModel) inside a FullbandForCausalLM."""
    if not isinstance(model, FullbandForCausalLM):
        raise InputError(f"FeedbackGRPOTrainer trains a FullbandForCausalLM (a `fullband convert --to hf` folder); "
                         f"got {type(model).__name__}")
    return model.model
