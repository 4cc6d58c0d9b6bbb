"""A checkpoint folder is checked before anything is allocated: sizes against the weights file's own header,
weights floating point and finite, config values finite and bounded, missing keys named. `fullband doctor`
says what is wrong with a folder, a checkpoint or a run."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from conftest import tiny_model, write_config
from fullband import ByteTokenizer, CheckpointError, FullbandLM
from fullband.cli import main

# A subprocess with its address space capped: loading a hostile folder must fail with a CheckpointError, not by
# allocating what the folder asks for (without the cap, the old loader took 24 GB and was killed by the kernel).
LOAD_CAPPED = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
from fullband import FullbandLM
from fullband.errors import CheckpointError
try:
    FullbandLM.load(sys.argv[1])
except CheckpointError as err:
    print("REFUSED:", err)
    sys.exit(0)
except BaseException as err:
    print("OTHER:", type(err).__name__, str(err)[:300])
    sys.exit(1)
print("LOADED")
sys.exit(1)
"""


def tamper(folder: Path, change) -> Path:
    data = json.loads((folder / "config.json").read_text())
    change(data)
    (folder / "config.json").write_text(json.dumps(data))
    return folder


@pytest.fixture
def saved(tmp_path) -> Path:
    return tiny_model().save(tmp_path / "ckpt", tokenizer=ByteTokenizer())


@pytest.mark.parametrize("change, words", [
    (lambda d: d.update(hf_config={"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80,
                                   "intermediate_size": 28672, "vocab_size": 128256, "num_attention_heads": 64}),
     ["describe different models", "d_model: 8192 in hf_config, 64 in model"]),
    (lambda d: d["model"].update(max_seq_len=10**12), ["max_seq_len=1000000000000", "<= 1048576"]),
    (lambda d: d["model"].update(n_layers=10**6), ["n_layers=1000000", "holds 2 layers"]),
])
def test_hostile_sizes_are_refused_before_anything_is_allocated(saved, change, words):
    tamper(saved, change)
    done = subprocess.run([sys.executable, "-c", LOAD_CAPPED, str(saved)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("REFUSED:"), (done.stdout, done.stderr[-2000:])
    for w in words:
        assert w in done.stdout, done.stdout


@pytest.mark.parametrize("change, match", [
    (lambda d: d["model"].update(rope_theta=float("inf")), r"rope_theta=inf is not a finite number"),
    (lambda d: d["model"].update(norm_eps=float("nan")), r"norm_eps=nan is not a finite number"),
    (lambda d: d.update(format_version="1"), r"format_version='1' is invalid; accepted: an integer"),
    (lambda d: d.update(files=["model.safetensors"]), r"'files' is not a record of files"),
])
def test_invalid_config_values_in_a_folder(saved, change, match):
    tamper(saved, change)
    with pytest.raises(CheckpointError, match=match):
        FullbandLM.load(saved)


def test_missing_config_keys_are_named(saved):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FullbandLM.load(saved)  # a complete folder: no warning
    tamper(saved, lambda d: [d["model"].pop(k) for k in ("rope_theta", "norm_eps")])
    with pytest.warns(UserWarning, match=r"does not set 2 model field\(s\); defaults used: rope_theta=10000.0, "
                                         r"norm_eps=1e-06"):
        FullbandLM.load(saved)


def rewrite_weights(folder: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    change(state)
    save_file(state, str(folder / "model.safetensors"))
    tamper(folder, lambda d: d.pop("files", None))  # as if written by a tool that records nothing


def test_non_finite_weights_are_refused_with_their_names(saved, tmp_path, capsys):
    def poison(state):
        state["blocks.1.mlp.w_down.weight"][0, 0] = float("nan")
        state["embed.weight"][3, 3] = float("inf")

    rewrite_weights(saved, poison)
    with pytest.raises(CheckpointError, match=r"NaN or infinite values in blocks.1.mlp.w_down.weight, embed.weight"):
        FullbandLM.load(saved)
    assert main(["generate", "--checkpoint", str(saved), "--prompt", "x", "--max-new-tokens", "4"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "NaN or infinite" in captured.err


def test_integer_tensors_are_not_cast_to_weights(saved):
    rewrite_weights(saved, lambda s: s.update({"norm_out.weight": torch.ones(64, dtype=torch.int64)}))
    with pytest.raises(CheckpointError, match=r"non-floating-point tensors norm_out.weight \(I64\)"):
        FullbandLM.load(saved)


def test_truncated_weights_are_caught_by_the_recorded_size(saved):
    blob = (saved / "model.safetensors").read_bytes()
    (saved / "model.safetensors").write_bytes(blob[:-100])
    with pytest.raises(CheckpointError, match=r"corrupted or truncated: model.safetensors has \d+ bytes, \d+ recorded"):
        FullbandLM.load(saved)


# ---------------------------------------------------------------------- fullband doctor
def test_doctor_on_a_healthy_and_a_damaged_model_folder(saved, capsys, tmp_path):
    assert main(["doctor", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "3 files match the sizes and sha256 recorded at save time" not in out  # config.json is not its own record
    assert "2 files match the sizes and sha256 recorded at save time" in out and "verdict: healthy" in out
    blob = bytearray((saved / "model.safetensors").read_bytes())
    blob[-5] ^= 0xFF  # one flipped byte: same size, other contents
    (saved / "model.safetensors").write_bytes(bytes(blob))
    assert main(["doctor", str(saved), "--json", str(tmp_path / "report.json")]) == 1
    out = capsys.readouterr().out
    assert "FAIL  model.safetensors: model.safetensors does not match the sha256 recorded at save time" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["failed"] and report["kind"] == "model folder"
    assert main(["doctor", str(saved), "--quick"]) == 0  # sizes only: the flip is not seen, and says so
    assert "hashes not checked" in capsys.readouterr().out


def test_doctor_on_a_run_directory(tmp_path, corpus, cache, capsys):
    from fullband.train.config import load_run_config
    from fullband.train.trainer import train

    config = write_config(tmp_path, corpus, cache, steps=6, ckpt_every=2, keep_last=3)
    train(load_run_config(config))
    run = tmp_path / "run"
    assert main(["doctor", str(run)]) == 0
    assert "verdict: finished: step_000006 is the final checkpoint, and it is healthy" in capsys.readouterr().out
    (run / ".step_000008.tmp").mkdir()
    (run / "step_000006" / "optimizer.pt").write_bytes(b"\0" * 10)
    assert main(["doctor", str(run)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  step_000006/optimizer.pt: optimizer.pt has 10 bytes" in out
    assert "warn  .step_000008.tmp: a half-written checkpoint" in out
    assert "verdict: the latest checkpoint is damaged; resumable from step_000004" in out
    # and resuming from the one doctor names works
    train(load_run_config(config), resume=run / "step_000004")


def test_doctor_on_what_is_not_a_fullband_folder(tmp_path, capsys):
    (tmp_path / "x.txt").write_text("hi")
    assert main(["doctor", str(tmp_path)]) == 1
    assert "not a fullband folder" in capsys.readouterr().out
    assert main(["doctor", str(tmp_path / "nope")]) == 1
