"""GRPO through TRL's GRPOTrainer on a `fullband convert --to hf` folder (fullband.rl.trl) against the native
computation: one step's loss and every parameter's gradient equal group_advantages + rl.logprob's exact path +
policy_loss on the completions TRL sampled; the hook's per-token values equal the decode engine's own log-probs
(SOFT, FUSED k, STANDARD), and those of TRL's generate (on-policy); plain TRL does not score the fed ones."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from conftest import tiny_model
from fullband.data.tokenizer import ByteTokenizer
from fullband.decode.sampling import Sampling
from fullband.errors import CheckpointError, FullbandError, InputError
from fullband.model.mode import DecodeMode
from fullband.rl.logprob import Rollout, log_softmax, logprobs, rl_mode, rollout
from fullband.rl.objective import group_advantages, policy_loss

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from fullband.hf import FullbandForCausalLM  # noqa: E402
from fullband.rl.trl import FeedbackGRPOTrainer  # noqa: E402

G = 4  # generations per prompt
NEW = 6  # max completion length
STOPS = list(range(64))  # stop ids beside EOS, so that completions end at different lengths
PAD = 258  # the byte tokenizer's pad id (BOS 256, EOS 257)
PROMPTS = [[256, 5, 9, 12, 7], [256, 40], [256, 3, 3, 8, 1, 2, 90, 14]]  # ragged, for the hook tests


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from fullband.hf.convert import convert

    root = tmp_path_factory.mktemp("trl")
    tiny_model(seed=3, jitter=0.0).save(root / "native", tokenizer=ByteTokenizer())
    convert(root / "native", root / "hf", to="hf", dtype=torch.float64)  # float64: both sides agree to rounding
    return root / "hf"


def load(folder, mode: str) -> FullbandForCausalLM:
    dm = DecodeMode.parse(mode)
    model = FullbandForCausalLM.from_pretrained(folder, dtype=torch.float64)
    model.config.feedback_mode, model.config.prefill_passes = dm.name, dm.prefill_passes
    model.generation_config.eos_token_id = STOPS
    return model


def reward(completion_ids, **_) -> list[float]:
    return [float(sum(ids) % 5) for ids in completion_ids]


class Recording(FeedbackGRPOTrainer):
    """Keeps what one step saw: the generation batch (before TRL shuffles it), the loss and the gradients."""

    def _generate_and_score_completions(self, inputs):
        self.batch = super()._generate_and_score_completions(inputs)
        return self.batch

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return self.loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        out = super().training_step(model, inputs, num_items_in_batch)
        self.grads = {n.removeprefix("model."): p.grad.clone() for n, p in model.named_parameters()}
        return out


def trainer(folder, tmp_path, mode: str = "soft", cls=FeedbackGRPOTrainer, beta: float = 0.0, **config):
    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2 * G, num_generations=G,
                    max_completion_length=NEW, max_steps=1, learning_rate=1e-3, loss_type="dapo", epsilon=0.2,
                    epsilon_high=0.28, beta=beta, max_grad_norm=0.0, use_cpu=True, bf16=False, report_to="none",
                    save_strategy="no", disable_tqdm=True, gradient_checkpointing=False, seed=0,
                    use_bias_correction_kl=False)  # TRL 1.16's default multiplies the KL by the ratio; ours does not
    args = trl.GRPOConfig(**{**settings, **config})
    dataset = datasets.Dataset.from_dict({"prompt": ["ab", "hello w"]})
    return cls(model=load(folder, mode), reward_funcs=reward, args=args, train_dataset=dataset)


def trl_layout(prompts: list[list[int]], completions: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """TRL's rows: prompts left-padded, completions right-padded, and the attention mask."""
    P, C = max(map(len, prompts)), max(map(len, completions))
    ids = [[PAD] * (P - len(p)) + p + c + [PAD] * (C - len(c)) for p, c in zip(prompts, completions)]
    mask = [[0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (C - len(c)) for p, c in zip(prompts, completions)]
    return torch.tensor(ids), torch.tensor(mask), C


def rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


# ---------------------------------------------------------------------- one step: TRL == native
@pytest.mark.parametrize("mode,beta", [("soft", 0.0), ("fused:2", 0.0), ("fused:1", 0.1)])
def test_one_trl_grpo_step_equals_the_native_step(folder, tmp_path, mode, beta):
    t = trainer(folder, tmp_path, mode, cls=Recording, beta=beta)
    native = t.model.to_native()  # the weights before the step
    reference = None
    if beta:  # a reference away from the policy, so that the KL term and its gradient are not zero
        with torch.no_grad():
            g = torch.Generator().manual_seed(5)
            for p in t.ref_model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        reference = t.ref_model.to_native()
    t.train()

    b = t.batch
    prompts, responses = rows(b["prompt_ids"], b["prompt_mask"]), rows(b["completion_ids"], b["completion_mask"])
    assert len(prompts) == 2 * G and len({len(y) for y in responses}) > 1  # ragged completions
    r = Rollout(prompts, responses, torch.zeros(len(responses), max(map(len, responses))), torch.zeros(0),
                rl_mode(mode))
    rewards = torch.tensor(reward(responses), dtype=torch.float64)
    advantages = group_advantages(rewards, G, eps=1e-4)  # TRL's std + 1e-4
    torch.testing.assert_close(b["advantages"].double(), advantages, rtol=0, atol=1e-6)
    logp = logprobs(native, r, "exact")
    ref = None if reference is None else logprobs(reference, r, "exact").detach()
    expected = policy_loss(logp, logp.detach(), advantages, r.mask, clip_low=0.2, clip_high=0.28, ref=ref,
                           kl_coef=beta)
    expected.loss.backward()
    if beta:
        assert expected.kl > 1e-4  # the penalty takes part

    torch.testing.assert_close(t.loss.detach(), expected.loss.detach(), rtol=1e-6, atol=1e-9)
    grads = {n: p.grad for n, p in native.named_parameters()}
    assert grads.keys() == t.grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(t.grads[name], grad, rtol=1e-5, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")
    assert float(grads["fusion.w_u.weight"].abs().sum()) > 1e-6  # the fed states take part in the gradient


# ---------------------------------------------------------------------- the hook's values
@pytest.fixture(scope="module")
def trainers(folder, tmp_path_factory):
    return {m: trainer(folder, tmp_path_factory.mktemp(m.replace(":", "")), m)
            for m in ("standard", "soft", "fused:1", "fused:3")}


@pytest.mark.parametrize("mode", ["standard", "soft", "fused:1", "fused:3"])
def test_the_hook_returns_the_engines_fed_logprobs(trainers, mode):
    """TRL's layout of the decode engine's own samples -> the log-probs the engine computed while sampling them."""
    t = trainers[mode]
    native = t.model.model
    r = rollout(native, PROMPTS, NEW, mode=mode, sampling=Sampling(temperature=1.0, seed=11), stop_tokens=STOPS)
    assert len({len(y) for y in r.responses}) > 1
    ids, mask, C = trl_layout(r.prompts, r.responses)
    k = r.mode.fused_passes
    for path in ("exact", f"jacobi:{C + k}"):
        t.logprob = path
        logp, entropy, aux = t._get_per_token_logps_and_entropies(t.model, ids, mask, C, compute_entropy=True)
        assert aux is None and logp.shape == entropy.shape == (len(PROMPTS), C)
        torch.testing.assert_close(logp.detach(), r.logprobs[:, :C].double(), rtol=0, atol=1e-10)
        torch.testing.assert_close(logp.detach(), logprobs(native, r, "exact").detach(), rtol=0, atol=1e-10)
        assert (entropy[~r.mask[:, :C]] == 0).all() and (entropy[r.mask[:, :C]] > 0).all()
    t.logprob = "exact"
    with torch.no_grad():  # as TRL scores the old policy and the reference: constants
        chunked, _, _ = t._get_per_token_logps_and_entropies(t.model, ids, mask, C, batch_size=2)  # TRL's chunks
    assert logp.requires_grad and not chunked.requires_grad
    torch.testing.assert_close(chunked, logp.detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", ["soft", "fused:2"])
def test_trl_generation_is_on_policy(folder, tmp_path, mode):
    """What TRL's generate samples (FullbandForCausalLM.generate, TRL's generation config, temperature 0.7) is
    scored by the hook with the very distributions it was drawn from: log-probs and entropies at that temperature."""
    t = trainer(folder, tmp_path, mode, temperature=0.7)
    ids, mask, _ = trl_layout(PROMPTS, [[] for _ in PROMPTS])
    torch.manual_seed(2)
    out = t.model.generate(input_ids=ids, attention_mask=mask, generation_config=t.generation_config,
                           output_logits=True, return_dict_in_generate=True)
    new = out.sequences[:, ids.shape[1]:]
    stop = torch.isin(new, torch.tensor(t.eos_token_ids))
    end = torch.where(stop.any(1), stop.int().argmax(1) + 1, new.shape[1])  # TRL keeps up to the first stop
    completions = [row[:n].tolist() for row, n in zip(new, end)]
    assert len(set(map(len, completions))) > 1
    ids, mask, C = trl_layout(PROMPTS, completions)
    logp, entropy, _ = t._get_per_token_logps_and_entropies(t.model, ids, mask, C, compute_entropy=True)
    # the distributions generate sampled from (its logits come back in float32)
    dist = log_softmax(torch.stack(out.logits, 1)[:, :C].double() / 0.7)
    live = mask[:, -C:].bool()
    expected = torch.where(live, dist.gather(2, new[:, :C, None])[..., 0], 0.0)
    torch.testing.assert_close(logp, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, torch.where(live, -(dist.exp() * dist).sum(-1), 0.0), rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ["standard", "soft"])
def test_plain_trl_does_not_score_the_fed_logprobs(trainers, mode):
    """Without the override TRL cannot score a fed model: TRL 1.16's hook runs the backbone itself (its fused LM
    head) and fails on it; TRL's earlier hook, a causal forward over prompt + completion, reads the completion in
    one pass: right for STANDARD, wrong for SOFT (so the equalities above can fail)."""
    t = trainers[mode]
    r = rollout(t.model.model, PROMPTS, NEW, mode=mode, sampling=Sampling(temperature=1.0, seed=11))
    ids, mask, C = trl_layout(r.prompts, r.responses)
    fed, _, _ = t._get_per_token_logps_and_entropies(t.model, ids, mask, C)
    with pytest.raises(TypeError, match="attention_mask"):
        trl.GRPOTrainer._get_per_token_logps_and_entropies(t, t.model, ids, mask, C)
    with torch.no_grad():
        logits = t.model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -C - 1:-1]
    plain = torch.where(mask[:, -C:].bool(), log_softmax(logits).gather(2, ids[:, -C:, None])[..., 0], 0.0)
    gap = float((plain - fed.detach()).abs().max())
    assert gap < 1e-10 if mode == "standard" else gap > 1e-3, gap


# ---------------------------------------------------------------------- errors
def test_what_trl_cannot_give_is_refused(folder, tmp_path):
    with pytest.raises(InputError, match="replay"):
        FeedbackGRPOTrainer(model=None, logprob="replay")
    with pytest.raises(InputError, match="gradient_checkpointing=False"):
        trainer(folder, tmp_path, gradient_checkpointing=True)
    with pytest.raises(InputError, match="cannot be trained on-policy"):
        trainer(folder, tmp_path, "exact")
    with pytest.raises(InputError, match="use_transformers_continuous_batching is not supported"):
        trainer(folder, tmp_path, use_transformers_continuous_batching=True)
    t, ids, mask = trainer(folder, tmp_path), torch.tensor([[256, 5, 9]]), torch.ones(1, 3)
    with pytest.raises(InputError, match="trains a FullbandForCausalLM"):
        t._get_per_token_logps_and_entropies(torch.nn.Linear(1, 1), ids, mask, 1)
    with pytest.raises(InputError, match="prompts left-padded, completions right-padded"):
        t._get_per_token_logps_and_entropies(t.model, ids, torch.tensor([[1, 0, 1]]), 1)


def test_a_model_path_trl_cannot_load_is_named(tmp_path):
    """TRL loads a path with transformers, whose errors do not say what to do: a native folder ('Unrecognized
    model ... model_type'), a missing path ('Repo id must be in the form ...'), a file ('not a valid JSON file')."""
    tiny_model().save(tmp_path / "native")
    (tmp_path / "weights.bin").write_text("x")
    cases = {"native": r"is a native fullband folder.*`fullband convert \S*native OUT --to hf`",
             "missing": "does not exist", "weights.bin": "is a file, not a folder"}
    for name, words in cases.items():
        for call in (lambda p: FeedbackGRPOTrainer(model=p), lambda p: FeedbackGRPOTrainer(p)):
            with pytest.raises(CheckpointError, match=words) as err:
                call(str(tmp_path / name))
            assert "\n" not in str(err.value) and str(err.value).startswith("FeedbackGRPOTrainer(model=...): ")


def test_without_trl_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)
    monkeypatch.delitem(sys.modules, "fullband.rl.trl")
    with pytest.raises(FullbandError, match=r"pip install 'fullband\[trl\]'"):
        importlib.import_module("fullband.rl.trl")
