"""GGUF files in, bad ones refused: an architecture fullband does not convert, a truncated file, a tensor type the
reader does not know, a file that is not GGUF. Each is one line naming the file and what is accepted, and nothing
is written. The files are tiny GGUFs written here with the `gguf` package."""

from __future__ import annotations

import numpy as np
import pytest

from fullband.cli import main

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")


LAYOUT = {"attn_norm": (32,), "ffn_norm": (32,), "attn_q": (32, 32), "attn_k": (32, 32), "attn_v": (32, 32),
          "attn_output": (32, 32), "ffn_gate": (64, 32), "ffn_down": (32, 64)}  # numpy order (outer first)


def write_gguf(path, arch: str = "llama", *, header: dict | None = None, skip: tuple[str, ...] = (),
               nan: str | None = None) -> None:
    """A tiny GGUF file: an architecture, one block of the llama layout (F32, and Q8_0 for ffn_up), no tokenizer;
    `header` replaces header sizes ({"block_count": 10**6}), `skip` leaves tensors out, `nan` puts a NaN in one."""
    sizes = {"block_count": 1, "context_length": 64, "embedding_length": 32, "feed_forward_length": 64,
             "attention.head_count": 2, "vocab_size": 16, **(header or {})}
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in sizes.items():
        w.add_uint32(f"{arch}.{key}", value)
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": rng.standard_normal((16, 32), dtype=np.float32),
               "output_norm.weight": np.ones(32, dtype=np.float32),
               **{f"blk.0.{name}.weight": rng.standard_normal(shape, dtype=np.float32) * 0.1
                  for name, shape in LAYOUT.items()}}
    if nan is not None:
        tensors[nan].flat[3] = np.nan
    for name, data in tensors.items():
        if name not in skip:
            w.add_tensor(name, data)
    if "blk.0.ffn_up.weight" not in skip:
        q8 = gguf.quants.quantize(rng.standard_normal((64, 32), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
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
    assert info["architecture"] == "llama" and info["tensor_types"] == {"F32": 10, "Q8_0": 1}
    assert info["sizes"] == {"blocks": 1, "width": 32, "ffn": 64, "heads": 2, "kv_heads": 2, "vocab": 16}


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


def test_a_gguf_missing_a_tensor_or_with_a_nan_is_refused_not_started_fresh(tmp_path, capsys):
    """transformers would start a missing weight fresh, and read a NaN as it is: convert refuses both in one line,
    as train.init_from does (the same readers), and writes nothing."""
    write_gguf(tmp_path / "hole.gguf", skip=("blk.0.ffn_down.weight",))
    err = refused(capsys, tmp_path / "hole.gguf", tmp_path / "out")
    assert "lacks tensor blk.0.ffn_down.weight that its header implies" in err
    write_gguf(tmp_path / "nan.gguf", nan="blk.0.attn_q.weight")
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "nan.gguf"), str(tmp_path / "out")]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after transformers' own progress bars: the file was read
    assert last.endswith("weight model.layers.0.self_attn.q_proj.weight holds 1 non-finite value (NaN or infinity); "
                         "accepted: finite weights") and "fullband convert: error: " in last
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("header, said", [
    ({"block_count": 10**6}, "llama.block_count=1000000; accepted: an integer 1 <= llama.block_count <= 512"),
    ({"block_count": 2}, "lacks tensors blk.1.attn_norm.weight, blk.1.ffn_norm.weight, blk.1.attn_q.weight and 6 "
                         "more that its header implies (llama.block_count=2"),
    ({"embedding_length": 2**20}, "llama.embedding_length=1048576; accepted: an integer 1 <= "
                                  "llama.embedding_length <= 65,536"),
    ({"vocab_size": 100}, "tensor token_embd.weight has shape [32, 16] (GGUF order, innermost first), the header "
                          "implies [32, 100]"),
    ({"attention.head_count": 3}, "head_count dividing embedding_length"),
    ({"embedding_length": 16}, "tensor token_embd.weight has shape [32, 16]"),
])
def test_a_header_that_does_not_describe_its_tensors_is_refused_before_allocating(header, said, tmp_path, capsys):
    import time

    write_gguf(tmp_path / "bad.gguf", header=header)
    t0 = time.perf_counter()
    err = refused(capsys, tmp_path / "bad.gguf", tmp_path / "out")
    assert said in err and time.perf_counter() - t0 < 30


def test_train_init_from_refuses_a_gguf_the_converter_refuses(tmp_path):
    from fullband.errors import ConfigError
    from fullband.train.build import warm_start
    from fullband.model.decoder import FullbandLM
    from conftest import tiny_config

    write_gguf(tmp_path / "hole.gguf", skip=("blk.0.attn_v.weight",))
    with pytest.raises(ConfigError, match="lacks tensor blk.0.attn_v.weight"):
        warm_start(FullbandLM(tiny_config()), str(tmp_path / "hole.gguf"))


def test_a_benchmark_of_another_architecture_is_refused_by_name(tmp_path, capsys):
    write_gguf(tmp_path / "g.gguf", arch="gpt2")
    for args in (["decode", "--model", str(tmp_path / "g.gguf")], ["train", "--model", str(tmp_path / "g.gguf")]):
        capsys.readouterr()
        assert main(["bench", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "general.architecture='gpt2'; bench --model reads llama GGUF files" in err, err


def test_inside_parsed_once_each_file_version_is_parsed_once_whoever_reads_it(tmp_path):
    """The header check and transformers' readers (config, tokenizer, weights) each build a GGUFReader of the file,
    seconds each for a real vocabulary: inside `parsed_once` they share one per file version, and gguf's
    tensor-name map (built per module by transformers' weight reader) is built once; outside it nothing is shared."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from fullband.gguf_file import parsed_once

    path = tmp_path / "m.gguf"
    write_gguf(path)
    built = []
    real = gguf.GGUFReader

    class Counting(real):
        def __init__(self, *args, **kwargs):
            built.append(args[1] if len(args) > 1 else kwargs.get("mode", "r"))
            super().__init__(*args, **kwargs)

    gguf.GGUFReader = Counting
    try:
        with parsed_once():
            first = gguf.GGUFReader(str(path))
            assert gguf.GGUFReader(path) is first and len(built) == 1  # a str or a Path: the same file
            assert load_gguf_checkpoint(str(path))["config"]["model_type"] == "llama" and len(built) == 1
            assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 1) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 1)
            assert gguf.GGUFReader(str(path), "r+") is not first and built == ["r", "r+"]  # a writer is never shared
            write_gguf(path, header={"rope.dimension_count": 16})  # another version of the file: parsed anew
            assert gguf.GGUFReader(str(path)) is not first and len(built) == 3
        assert gguf.GGUFReader is Counting  # as it was
        assert gguf.GGUFReader(str(path)) is not gguf.GGUFReader(str(path)) and len(built) == 5
    finally:
        gguf.GGUFReader = real
