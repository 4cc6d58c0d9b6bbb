"""GGUF files in, bad ones refused: an architecture fullband does not convert, a truncated file, a tensor type the
reader does not know, a file that is not GGUF. Each is one line naming the file and what is accepted, and nothing
is written. The files are tiny GGUFs written here with the `gguf` package."""

from __future__ import annotations

import numpy as np
import pytest

from fullband.cli import main

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")


def write_gguf(path, arch: str = "llama") -> None:
    """A tiny GGUF file: an architecture, a few tensors (F32 and Q8_0), no tokenizer."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((16, 32), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 32), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _type_offset(path) -> int:
    """The byte offset of the first tensor's type field in the file's tensor infos."""
    reader = gguf.GGUFReader(str(path))
    part = reader.tensors[0].field.parts[4]  # name length, name, n_dims, dims, type, offset
    return part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0]


def refused(capsys, src, dst, *more) -> str:
    capsys.readouterr()
    assert main(["convert", str(src), str(dst), *more]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fullband convert: error: ")
    assert not dst.exists()
    return err


def test_a_readable_gguf_header_is_described(tmp_path):
    from fullband.gguf_file import inspect_gguf

    write_gguf(tmp_path / "m.gguf")
    info = inspect_gguf(tmp_path / "m.gguf")
    assert info["architecture"] == "llama" and info["tensor_types"] == {"F32": 2, "Q8_0": 1}


def test_another_architecture_is_refused_by_name(tmp_path, capsys):
    write_gguf(tmp_path / "q.gguf", arch="qwen2")
    err = refused(capsys, tmp_path / "q.gguf", tmp_path / "out")
    assert "general.architecture='qwen2'" in err and "reads llama GGUF files" in err and "model.hf_path" in err


def test_a_truncated_gguf_is_refused(tmp_path, capsys):
    write_gguf(tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 100])
    err = refused(capsys, tmp_path / "cut.gguf", tmp_path / "out")
    assert "cut.gguf" in err and "truncated" in err
    (tmp_path / "head.gguf").write_bytes(data[:40])  # cut inside the header
    assert "not a readable GGUF file" in refused(capsys, tmp_path / "head.gguf", tmp_path / "out")


def test_an_unknown_tensor_type_is_refused(tmp_path, capsys):
    write_gguf(tmp_path / "m.gguf")
    data = bytearray((tmp_path / "m.gguf").read_bytes())
    at = _type_offset(tmp_path / "m.gguf")
    data[at: at + 4] = (250).to_bytes(4, "little")  # no GGML type has this number
    (tmp_path / "odd.gguf").write_bytes(bytes(data))
    err = refused(capsys, tmp_path / "odd.gguf", tmp_path / "out")
    assert "250" in err and "tensor type" in err


def test_not_a_gguf_file_and_a_missing_one(tmp_path, capsys):
    (tmp_path / "x.gguf").write_text("hello, not a model")
    assert "GGUF magic" in refused(capsys, tmp_path / "x.gguf", tmp_path / "out")
    assert "does not exist" in refused(capsys, tmp_path / "none.gguf", tmp_path / "out")
