"""retype_gguf: the shipped SmolLM2-135M-Instruct Q4_1 file rewritten as F32 holds exactly gguf's dequantized
tensors and the same metadata; F16 keeps 1-D tensors F32; an existing file is not replaced unless asked. No
llama.cpp needed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'fullband[gguf]')")
from gguf.quants import dequantize, quantize  # noqa: E402

from fullband.bench.gguf_types import retype_gguf  # noqa: E402


def kv(reader) -> dict:
    """Every key/value but the header's pseudo-fields (GGUF.version, tensor and key counts)."""
    return {k: (list(f.types), f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def test_f32_of_the_shipped_file_is_gguf_dequantize_exactly(smollm2_gguf, tmp_path):
    src = smollm2_gguf
    dst = retype_gguf(src, tmp_path / "SmolLM2-135M-Instruct.F32.gguf", "F32")
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(dst)

    meta_a, meta_b = kv(a), kv(b)
    assert list(meta_a) == list(meta_b)  # every key, in the same order
    assert meta_b.pop("general.file_type") == ([gguf.GGUFValueType.UINT32], int(gguf.LlamaFileType.ALL_F32))
    meta_a.pop("general.file_type")
    assert meta_a == meta_b  # tokenizer, chat template, architecture fields: the same types and values

    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    assert len(b.tensors) == 272
    for ta, tb in zip(a.tensors, b.tensors):
        assert list(ta.shape) == list(tb.shape), ta.name
        assert tb.tensor_type == gguf.GGMLQuantizationType.F32, tb.name
    assert {t.tensor_type.name for t in a.tensors} == {"Q8_0", "Q4_1", "F32"}
    # Checked value by value: the Q8_0 embedding, Q4_1 matrices of the first and last block, a norm.
    by_name = {t.name: (t, u) for t, u in zip(a.tensors, b.tensors)}
    for name in ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.29.attn_v.weight",
                 "blk.29.ffn_norm.weight", "output_norm.weight"]:
        ta, tb = by_name[name]
        expected = dequantize(ta.data, ta.tensor_type)
        assert tb.data.dtype == np.float32 and tb.data.shape == expected.shape, name
        assert np.array_equal(tb.data, expected), name


def small_gguf(path: Path) -> Path:
    """A two-tensor llama-like file: a Q8_0 matrix and an F32 norm."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    w.add_tensor("blk.0.attn_q.weight", quantize(rng.standard_normal((4, 64), dtype=np.float32),
                                                 gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_f16_keeps_1d_tensors_f32_and_says_mostly_f16(tmp_path):
    src = small_gguf(tmp_path / "small.Q8_0.gguf")
    a = gguf.GGUFReader(src)
    b = gguf.GGUFReader(retype_gguf(src, tmp_path / "small.F16.gguf", "F16"))
    assert b.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_F16)
    assert b.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    (qa, na), (qb, nb) = a.tensors, b.tensors
    assert qb.tensor_type == gguf.GGMLQuantizationType.F16 and nb.tensor_type == gguf.GGMLQuantizationType.F32
    assert np.array_equal(qb.data, dequantize(qa.data, qa.tensor_type).astype(np.float16))
    assert np.array_equal(nb.data, na.data)


def test_refuses_to_replace_a_file_unless_told(tmp_path):
    src = small_gguf(tmp_path / "small.Q8_0.gguf")
    dst = tmp_path / "small.F32.gguf"
    dst.write_bytes(b"someone's file")
    with pytest.raises(FileExistsError):
        retype_gguf(src, dst, "F32")
    assert dst.read_bytes() == b"someone's file"
    with pytest.raises(ValueError, match="dtype"):
        retype_gguf(src, tmp_path / "x.gguf", "Q4_0")
    retype_gguf(src, dst, "F32", overwrite=True)
    assert gguf.GGUFReader(dst).fields["general.file_type"].contents() == int(gguf.LlamaFileType.ALL_F32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.F32.gguf", "small.Q8_0.gguf"]  # no temp file left
