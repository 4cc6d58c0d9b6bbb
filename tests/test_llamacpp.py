"""GGUF out and the llama.cpp engine (fullband.llamacpp). The file's round trip and refusals run here; llama.cpp's
decoding runs in .venv-llama (`make llama-env`: llama-cpp-python is built from source there) through
tests/llamacpp_parity.py, and is skipped where that environment is missing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from fullband.data.tokenizer import ByteTokenizer
from fullband.errors import ConfigError, InputError

gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package (pip install 'fullband[gguf]')")
from fullband.llamacpp import export_gguf, sidecar_path  # noqa: E402
from fullband.gguf_file import SIDECAR_KEY  # noqa: E402
from fullband.hf.gguf_out import read_sidecar, to_gguf_rotary  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LLAMA_PYTHON = ROOT / ".venv-llama" / "bin" / "python"
LLAMA_STYLE = dict(qk_norm=False, input_norm=False, tie_embeddings=False, n_kv_heads=2)


def llama_style(seed: int = 0, **changes):
    return tiny_model(seed, **{**LLAMA_STYLE, **changes}).eval()


def test_rotary_layout_pairs_the_halves_of_each_head():
    w = torch.arange(8.0)[:, None]  # 2 heads of 4 rows: (0 1 | 2 3), (4 5 | 6 7)
    assert to_gguf_rotary(w, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.parametrize("changes", [{}, {"input_norm": True, "tie_embeddings": True}, {"fusion": "none"}])
def test_the_round_trip_through_gguf_is_bitwise(changes, tmp_path):
    """fullband -> GGUF (+ sidecar) -> transformers' GGUF reader -> fullband (fullband convert): every weight and the
    config as they were, in float32."""
    from fullband import load_model
    from fullband.hf.convert import convert

    model = llama_style(**changes)
    out = export_gguf(model, tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    assert sidecar_path(out).is_file()
    convert(out, tmp_path / "back")
    back = load_model(tmp_path / "back")
    want, got = model.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    assert back.config == model.config


def test_types_and_metadata(tmp_path):
    model = llama_style(d_model=64, n_heads=4)
    for kind, want in (("F32", "F32"), ("F16", "F16"), ("Q8_0", "Q8_0")):
        out = export_gguf(model, tmp_path / f"m-{kind}.gguf", tokenizer=ByteTokenizer(), dtype=kind)
        reader = gguf.GGUFReader(str(out))
        types = {t.name: t.tensor_type.name for t in reader.tensors}
        assert types["blk.0.attn_q.weight"] == want and types["output_norm.weight"] == "F32"
        assert reader.fields["general.architecture"].contents() == "llama"
        assert reader.fields[SIDECAR_KEY].contents() == sidecar_path(out).name
        tensors, meta = read_sidecar(out)
        assert sorted(tensors) == ["fusion.w_g.weight", "fusion.w_u.weight", "norm_in.weight"]
        assert all(t.dtype == torch.float32 for t in tensors.values())
        assert json.loads(meta["config"])["d_model"] == 64
        assert '"fullband_tokenizer": "byte"' in json.loads(meta["tokenizer"])["tokenizer.json"]


@pytest.mark.parametrize("changes,message", [
    ({"ponder": True, "fusion": "none", "jitter": 0, "prefix_mixin_prob": 0}, "ponder=True is not supported"),
    ({"loop_start": 0, "loop_stop": 1, "loops": 2}, "loop_start=0 is not supported"),
    ({"qk_norm": True}, "qk_norm=True is not supported (llama.cpp's llama graph has no per-head q/k norm)"),
    ({"feedback": "residual"}, "feedback='residual' is not supported"),
    ({"feedback_target": 1}, "feedback_target=1 is not supported"),
    ({"fusion": "t2mlr"}, "fusion='t2mlr' is not supported"),
])
def test_what_llama_cpp_cannot_run_is_refused_in_one_line(changes, message, tmp_path):
    model = tiny_model(**{**LLAMA_STYLE, **changes})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        export_gguf(model, tmp_path / "m.gguf")
    assert "\n" not in str(err.value) and list(tmp_path.iterdir()) == []


def test_bad_requests_are_named_and_nothing_is_replaced(tmp_path):
    with pytest.raises(ConfigError, match="GGUF export writes a native FullbandLM; got Linear"):
        export_gguf(torch.nn.Linear(2, 2), tmp_path / "m.gguf")
    model = llama_style()
    with pytest.raises(InputError, match="GGUF type 'Q4_K' is unknown; accepted: F32, F16, Q8_0"):
        export_gguf(model, tmp_path / "m.gguf", dtype="Q4_K")
    (tmp_path / "m.gguf").write_text("mine")
    with pytest.raises(InputError, match="exists; pass --overwrite"):
        export_gguf(model, tmp_path / "m.gguf")
    assert (tmp_path / "m.gguf").read_text() == "mine"


needs_llama = pytest.mark.skipif(not LLAMA_PYTHON.exists(),
                                 reason="no .venv-llama (make llama-env builds llama-cpp-python there)")


def _parity(native: Path, out: Path, *args: str) -> dict:
    done = subprocess.run([str(LLAMA_PYTHON), str(ROOT / "tests" / "llamacpp_parity.py"), str(native), str(out),
                           *args], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@needs_llama
@pytest.mark.parametrize("changes", [{}, {"input_norm": True}])
def test_llama_cpp_decodes_every_mode_as_fullband_does(changes, tmp_path):
    """A tiny model's GGUF file on llama.cpp: greedy tokens equal fullband.generate in every mode (F32), also with
    the host step compiled (compile=True: torch.compile around llama.cpp's call)."""
    model = llama_style(**changes)
    model.save(tmp_path / "native", tokenizer=ByteTokenizer())
    result = _parity(tmp_path / "native", tmp_path, "--tokens", "24", "--compiled", "soft")
    assert result["llamacpp"]["F32"] == result["native"]
    assert result["compiled"]["F32"]["soft"] == result["native"]["soft"]
    assert result["tokenizer_ids"] == result["prompt"]  # the byte tokenizer, from the sidecar


@needs_llama
def test_llama_cpp_decodes_the_real_model_as_fullband_does(smollm2_native, tmp_path):
    """SmolLM2-135M (its feedback weights as conversion starts them) written as F32 GGUF: llama.cpp's tokens equal
    fullband.generate's in every mode. F16 and Q8_0 files round the weights: their STANDARD tokens agree for the
    first 8 (measured on this prompt: all 16 in F16 and Q8_0, every mode in F16; the untrained feedback modes of
    Q8_0 part from the F32 ones after 3 tokens), so only STANDARD is decoded on them."""
    result = _parity(smollm2_native, tmp_path, "--tokens", "16", "--types", "F32", "F16", "Q8_0",
                     "--modes", "standard", "soft", "fused:2", "exact", "--rounded-modes", "standard")
    assert result["llamacpp"]["F32"] == result["native"]
    assert result["tokenizer_ids"] == result["prompt"]  # the model's BPE tokenizer, from the sidecar
    for kind in ("F16", "Q8_0"):
        assert result["llamacpp"][kind]["standard"][:8] == result["native"]["standard"][:8], kind


def test_fullband_convert_writes_and_reads_gguf_files(tmp_path, capsys):
    """`fullband convert DIR OUT.gguf --gguf-type T` and back; --dtype (a folder's cast) is refused for a GGUF file."""
    from fullband.cli import main

    llama_style().save(tmp_path / "native", tokenizer=ByteTokenizer())
    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "m.gguf"), "--gguf-type", "Q8_0"]) == 0
    assert "-> gguf" in capsys.readouterr().out and sidecar_path(tmp_path / "m.gguf").is_file()
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    assert {t.name: t.tensor_type.name for t in reader.tensors}["blk.0.ffn_down.weight"] == "Q8_0"
    assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "back")]) == 0
    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "n.gguf"), "--dtype", "float16"]) == 2
    assert "a GGUF file's precision is gguf_type (--gguf-type)" in capsys.readouterr().err
    assert not (tmp_path / "n.gguf").exists()


def test_llama_cpp_errors_reach_our_messages_and_its_info_lines_do_not():
    """ggml's log levels (ggml.h): INFO 2, WARN 3, ERROR 4, CONT 5 (continues the line before). The engine's
    messages quote the warnings and errors, never the INFO chatter a load prints before failing."""
    from collections import deque

    from fullband.llamacpp.model import LogKeeper

    kept = deque(maxlen=8)
    keep = LogKeeper(kept)
    for level, text in ((2, b"llama_model_loader: loaded meta data with 30 key-value pairs\n"), (5, b"  and more\n"),
                        (4, b"llama_model_load: error loading model: missing tensor 'blk.0.attn_q.weight'\n"),
                        (5, b"  while loading block 0\n"), (3, b"llama_init: warning: n_ctx is small\n"),
                        (1, b"debug\n"), (4, b"\n")):
        keep(level, text)
    assert list(kept) == ["llama_model_load: error loading model: missing tensor 'blk.0.attn_q.weight'",
                          "while loading block 0", "llama_init: warning: n_ctx is small"]


def test_a_sidecar_is_bound_to_its_gguf_file(tmp_path, capsys):
    """Each export writes one identity into the GGUF file and its sidecar: a sidecar another export wrote (the
    same sizes, or another width), put beside the file under its name, is refused in one line naming both files,
    by convert as by every reader of the pair (read_sidecar: convert, the llama.cpp engine, doctor)."""
    import shutil

    from fullband.cli import main
    from fullband.hf.gguf_out import export_gguf, read_sidecar

    export_gguf(llama_style(seed=0), tmp_path / "a.gguf", tokenizer=ByteTokenizer())
    export_gguf(llama_style(seed=1), tmp_path / "b.gguf", tokenizer=ByteTokenizer())
    export_gguf(llama_style(d_model=128), tmp_path / "wide.gguf", tokenizer=ByteTokenizer())
    assert read_sidecar(tmp_path / "a.gguf")[1]["pair"] == gguf.GGUFReader(str(tmp_path / "a.gguf")).fields[
        "fullband.pair"].contents()
    for other in ("b", "wide"):
        shutil.copy(sidecar_path(tmp_path / f"{other}.gguf"), sidecar_path(tmp_path / "a.gguf"))
        capsys.readouterr()
        assert main(["convert", str(tmp_path / "a.gguf"), str(tmp_path / "back")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "a.gguf' and its sidecar" in err and "are not one pair" in err, err
        assert f"which names '{other}.gguf'" in err and not (tmp_path / "back").exists()
        assert main(["doctor", str(tmp_path / "a.gguf")]) == 1
        out = capsys.readouterr().out
        assert "FAIL  a.feedback.safetensors:" in out and "are not one pair" in out and "verdict: damaged" in out
    assert main(["doctor", str(tmp_path / "b.gguf")]) == 0
    out = capsys.readouterr().out
    assert "ok    b.gguf: llama header, 21 tensors" in out and "the file's own feedback sidecar" in out, out


def test_a_user_s_file_at_any_temporary_name_survives_an_export(tmp_path):
    """Writers go through temporary files whose names no other file has: a user's `.OUT.gguf.tmp` (the name an
    export once used) and `.race.png.tmp` are left as they were."""
    from fullband.files import save_figure, plt
    from fullband.hf.gguf_out import export_gguf

    mine = {tmp_path / ".m.gguf.tmp": b"mine", tmp_path / ".m.feedback.safetensors.tmp": b"also mine",
            tmp_path / ".race.png.tmp": b"my figure"}
    for path, data in mine.items():
        path.write_bytes(data)
    export_gguf(llama_style(), tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    save_figure(plt().subplots()[0], tmp_path / "race.png")
    assert {p: p.read_bytes() for p in mine} == mine
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*(p.name for p in mine), "m.gguf", "m.feedback.safetensors", "race.png"])


def test_llama_cpp_thread_counts_it_would_crash_on_are_refused_first(tmp_path, capsys):
    """ggml holds at most GGML_MAX_N_THREADS = 512 threads (more crashed the process): refused in one line before
    llama.cpp is touched, whatever engine is installed."""
    from fullband.cli import main
    from fullband.llamacpp.model import LlamaCppModel

    for n in (513, 10**6):
        with pytest.raises(InputError, match=r"threads=\d+ for llama.cpp; accepted: 1 <= threads <= 512"):
            LlamaCppModel(tmp_path / "m.gguf", threads=n)
    assert main(["generate", "--checkpoint", str(tmp_path / "m.gguf"), "--engine", "llamacpp", "--threads", "600",
                 "--prompt", "x"]) == 2
    assert "accepted: 1 <= threads <= 512" in capsys.readouterr().err


def test_a_header_llama_cpp_would_assert_on_is_refused_before_it_loads(tmp_path, monkeypatch):
    """A Llama header of 10**6 blocks (llama.cpp aborts the process on its LLAMA_MAX_LAYERS assert): the engine
    checks the header first and refuses it in one line, llama.cpp never reading the file."""
    from fullband.llamacpp import model as engine
    from test_gguf import write_gguf

    write_gguf(tmp_path / "deep.gguf", header={"block_count": 10**6})
    monkeypatch.setattr(engine, "_llama_cpp", lambda verbose: object())  # no llama.cpp: it must not be needed
    with pytest.raises(ConfigError, match=r"llama\.block_count=1000000; accepted: an integer 1 <= "
                                          r"llama\.block_count <= 512"):
        engine.LlamaCppModel(tmp_path / "deep.gguf")
