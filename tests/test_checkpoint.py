"""Checkpoints: round trip, and clear errors for missing, corrupted or mismatched files."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import random_ids, tiny_model
from fullband import ByteTokenizer, CheckpointError, FullbandLM, load_tokenizer


def test_roundtrip_is_exact(tmp_path):
    model = tiny_model(fusion="concat", feedback="residual")
    path = model.save(tmp_path / "ckpt", tokenizer=ByteTokenizer())
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    loaded = FullbandLM.load(path)
    assert loaded.config == model.config
    ids = random_ids(2, 20)
    with torch.no_grad():
        assert torch.equal(loaded(ids, passes=3).logits, model(ids, passes=3).logits)
    assert isinstance(load_tokenizer(path), ByteTokenizer)
    bf16 = FullbandLM.load(path, dtype=torch.bfloat16)
    assert next(bf16.parameters()).dtype == torch.bfloat16


def test_save_replaces_atomically_and_leaves_no_temp(tmp_path):
    a, b = tiny_model(seed=1), tiny_model(seed=2)
    a.save(tmp_path / "c")
    b.save(tmp_path / "c", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    loaded = FullbandLM.load(tmp_path / "c")
    assert torch.equal(loaded.embed.weight, b.embed.weight)


def test_failed_save_leaves_previous_checkpoint(tmp_path):
    a = tiny_model(seed=1)
    a.save(tmp_path / "c")

    class Broken:
        def save(self, directory):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        tiny_model(seed=2).save(tmp_path / "c", tokenizer=Broken(), overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert torch.equal(FullbandLM.load(tmp_path / "c").embed.weight, a.embed.weight)


@pytest.fixture
def saved(tmp_path):
    return tiny_model().save(tmp_path / "ckpt")


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        FullbandLM.load(tmp_path / "nope")


def test_missing_files(saved):
    (saved / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors is missing"):
        FullbandLM.load(saved)
    (saved / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        FullbandLM.load(saved)


def test_corrupted_config(saved):
    (saved / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupted"):
        FullbandLM.load(saved)


def test_invalid_config_values(saved):
    data = json.loads((saved / "config.json").read_text())
    data["model"]["n_heads"] = 5
    (saved / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="invalid model config.*n_heads=5"):
        FullbandLM.load(saved)


def test_truncated_weights(saved):
    blob = (saved / "model.safetensors").read_bytes()
    (saved / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        FullbandLM.load(saved)


def test_config_weights_mismatch(saved):
    data = json.loads((saved / "config.json").read_text())
    data["model"]["d_model"] = 128
    (saved / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"does not match config.json.*shape mismatch"):
        FullbandLM.load(saved)
    data["model"]["d_model"], data["model"]["fusion"] = 64, "none"
    (saved / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"unexpected tensors fusion.w_g.weight"):
        FullbandLM.load(saved)


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo' + \"✓\""
    ids = tok.encode(text, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and max(ids[1:-1]) < 256
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=False) == "<bos>" + text + "<eos>"
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a cut multi-byte character decodes with a replacement
