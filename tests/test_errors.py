"""Bad input gets a FullbandError subclass whose message names the field, the value and what is accepted."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import random_ids, tiny_model
from fullband import ConfigError, InputError, ModelConfig, generate, stream


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"d_model": 100, "n_heads": 3}, ["d_model=100", "n_heads=3", "divisible"]),
        ({"d_model": 0}, ["d_model=0", ">= 1"]),
        ({"n_layers": -2}, ["n_layers=-2", ">= 1"]),
        ({"n_heads": 8, "n_kv_heads": 3, "d_model": 64}, ["n_kv_heads=3", "n_heads=8", "divisor"]),
        ({"vocab_size": 2.5}, ["vocab_size=2.5", "integer"]),
        ({"fusion": "gatd"}, ["fusion='gatd'", "did you mean 'gated'", "additive"]),
        ({"feedback": "top"}, ["feedback='top'", "final", "residual"]),
        ({"prefix_mixin_prob": 1.5}, ["prefix_mixin_prob=1.5", "<= 1"]),
        ({"jitter": -0.1}, ["jitter=-0.1", ">= 0"]),
        ({"qk_norm": "yes"}, ["qk_norm='yes'", "true or false"]),
        ({"bos_token_id": 999}, ["bos_token_id=999", "vocab_size=259"]),
        ({"d_model": 36, "n_heads": 4}, ["head_dim", "9", "even"]),
    ],
)
def test_invalid_config_values(changes, words):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**{"vocab_size": 259, **changes})
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_unknown_config_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"unknown model field 'n_layer'.*did you mean 'n_layers'"):
        ModelConfig.from_dict({"n_layer": 4})


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"mode": "sotf"}, ["mode='sotf'", "did you mean 'soft'", "standard, soft, fused, exact"]),
        ({"mode": "fused", "prefill_passes": -1}, ["prefill_passes=-1", ">= 0"]),
        ({"max_new_tokens": 0}, ["max_new_tokens=0", ">= 1"]),
        ({"temperature": -1.0}, ["temperature=-1.0", ">= 0"]),
        ({"top_p": 0.0}, ["top_p=0.0", "0 < top_p <= 1"]),
        ({"top_k": 0}, ["top_k=0", ">= 1"]),
        ({"stop_tokens": [400]}, ["stop token 400", "vocab_size=259"]),
    ],
)
def test_invalid_generate_arguments(model, kwargs, words):
    args = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(InputError) as info:
        stream(model, [[1, 2, 3]], args.pop("max_new_tokens"), **args)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize(
    "prompts, words",
    [
        ([[1, 2], []], ["prompt 1 is empty"]),
        ([], ["prompts is empty"]),
        ([[1, 2, 300]], ["prompt 0 has token id 300", "vocab_size=259"]),
        ([[1, -3]], ["token id -3"]),
        ([1, 2, 3], ["list of token-id sequences", "[ids]"]),
        ("hello", ["list of token-id sequences"]),
        ([[1.5, 2.0]], ["integer token ids"]),
    ],
)
def test_invalid_prompts(model, prompts, words):
    with pytest.raises(InputError) as info:
        generate(model, prompts, 3)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_prompt_plus_new_tokens_longer_than_max_seq_len(model):
    prompt = [[1] * 150]
    with pytest.raises(InputError, match=r"prompt length 150 \+ max_new_tokens 20 = 170 exceeds max_seq_len=160.*at most 10"):
        generate(model, prompt, 20)


def test_forward_rejects_bad_ids_and_passes(model):
    with pytest.raises(InputError, match="token id 259 is out of range"):
        model(torch.tensor([[1, 259]]))
    with pytest.raises(InputError, match="integer tensor of shape"):
        model(torch.zeros(1, 4))
    with pytest.raises(InputError, match="exceeds max_seq_len=160"):
        model(random_ids(1, 161))
    with pytest.raises(InputError, match="passes=0 is invalid"):
        model(random_ids(1, 4), passes=0)
    with pytest.raises(InputError, match="must be a torch.Tensor"):
        model([[1, 2]])


def test_an_untested_runtime_version_is_refused_with_the_range(monkeypatch):
    """vLLM, TRL and llama-cpp-python are reached into where they change between minor releases: another version
    is refused where fullband starts using it, with the range and both ways on."""
    from fullband.errors import FullbandError
    from fullband.version import ALLOW_UNTESTED, TESTED, check_tested, release

    monkeypatch.delenv(ALLOW_UNTESTED, raising=False)
    assert release("0.32.1.dev3+cpu") == (0, 32, 1)
    assert check_tested("vllm", "0.32.1.dev3+cpu", "x") == "0.32.1.dev3+cpu"
    for package, (low, high) in TESTED.items():
        said = (f"is tested with {package} >={low},<{high}; {high} is installed. Install the tested range "
                f"(pip install '{package}>={low},<{high}'), or set {ALLOW_UNTESTED}=1")
        with pytest.raises(FullbandError, match=re.escape(said)):
            check_tested(package, high, "fullband's plugin")
    monkeypatch.setenv(ALLOW_UNTESTED, "1")
    assert check_tested("vllm", "0.40.0", "x") == "0.40.0"
