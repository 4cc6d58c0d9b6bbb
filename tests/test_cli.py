"""The `fullband` command end to end: init a checkpoint, stream a generation, run the decode benchmark."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fullband.cli import main


def test_init_and_generate_every_mode(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["init", "--config", "tiny", "--set", "n_layers=2", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model"]["n_layers"] == 2
    for mode in ("standard", "soft", "fused", "exact"):
        capsys.readouterr()
        code = main(["generate", "--checkpoint", str(out), "--prompt", "def f(x):", "--mode", mode,
                     "--max-new-tokens", "12", "--ignore-eos", "--echo"])
        assert code == 0
        captured = capsys.readouterr()
        assert captured.out.startswith("def f(x):")
        assert f"12 tokens, {mode}" in captured.err


def test_generate_sampling_is_seeded(tmp_path, capsys):
    out = tmp_path / "ckpt"
    main(["init", "--config", "tiny", "--out", str(out)])
    texts = []
    for _ in range(2):
        capsys.readouterr()
        main(["generate", "--checkpoint", str(out), "--prompt", "x", "--temperature", "1.0", "--top-k", "50",
              "--seed", "3", "--max-new-tokens", "20", "--ignore-eos"])
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]


def test_errors_are_one_line_messages(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "does not exist" in err and "Traceback" not in err
    out = tmp_path / "ckpt"
    main(["init", "--config", "tiny", "--out", str(out)])
    assert main(["generate", "--checkpoint", str(out), "--prompt", "x", "--mode", "fast"]) == 2
    assert "mode='fast'" in capsys.readouterr().err
    assert main(["init", "--config", "tiny", "--set", "n_layer=3", "--out", str(tmp_path / "x")]) == 2
    assert "did you mean 'n_layers'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert main(["init", "--config", "tyni", "--out", str(tmp_path / "y")]) == 2
    assert "did you mean 'tiny'" in capsys.readouterr().err



def test_generate_takes_fused_k_as_its_mode(tmp_path, capsys):
    """One spelling of a mode at every CLI edge: --mode fused:2 is --mode fused --prefill-passes 2 (the older
    spelling, kept; refused in one line when the two disagree), --mode fused:auto is adaptive prefill."""
    out = tmp_path / "ckpt"
    main(["init", "--config", "tiny", "--out", str(out)])
    gen = ["generate", "--checkpoint", str(out), "--prompt", "def f(x):", "--max-new-tokens", "6", "--ignore-eos"]
    texts = set()
    for args in (["--mode", "fused:2"], ["--mode", "fused", "--prefill-passes", "2"],
                 ["--mode", "fused:2", "--prefill-passes", "2"]):
        capsys.readouterr()
        assert main([*gen, *args]) == 0
        captured = capsys.readouterr()
        assert "6 tokens, fused k=2," in captured.err
        texts.add(captured.out)
    assert len(texts) == 1
    for args in (["--mode", "fused:auto", "--prefill-tol", "0.01"], ["--mode", "fused", "--prefill-passes", "auto",
                                                                     "--prefill-tol", "0.01"]):
        assert main([*gen, *args]) == 0
        assert "6 tokens, fused auto tol=0.01," in capsys.readouterr().err
    for args, err in ((["--mode", "fused:2", "--prefill-passes", "3"], "--mode fused:2 and --prefill-passes 3 disagree "
                       "(fused:2 is --prefill-passes 2); accepted: one of them, e.g. --mode fused:2 alone"),
                      (["--mode", "fused:auto", "--prefill-passes", "4"], "--mode fused:auto and --prefill-passes 4 "
                       "disagree (fused:auto is --prefill-passes auto)"),
                      (["--mode", "soft:2"], "mode 'soft:2': only fused takes prefill passes (fused:K)"),
                      (["--mode", "fused:x"], "mode 'fused:x' is not MODE or fused:K (e.g. fused:2, fused:auto)")):
        assert main([*gen, *args]) == 2
        last = capsys.readouterr().err
        assert last.startswith(f"fullband generate: error: {err}") and last.count("\n") == 1, last


@pytest.mark.parametrize("args", [
    ["generate-length", "--prompts", "p.jsonl"], ["chat", "--data", "arithmetic"], ["tracking", "--task", "parity"],
])
def test_eval_modes_are_read_as_generate_reads_them(args, tmp_path, monkeypatch, capsys):
    """eval's --modes take fused:K and fused:auto (DecodeMode.parse), and a bad one is one line before any work."""
    from fullband.cli import build_parser
    from fullband.model.mode import DecodeMode

    parsed = build_parser().parse_args(["eval", *args, "--checkpoint", "c", "--modes", "fused:2", "fused:auto"])
    assert [DecodeMode.parse(m) for m in parsed.modes] == [DecodeMode("fused", 2), DecodeMode("fused", "auto")]
    monkeypatch.chdir(tmp_path)
    assert main(["eval", *args, "--checkpoint", "c", "--out", "out", "--modes", "fused:2", "fused:x"]) == 2
    assert "error: mode 'fused:x' is not MODE or fused:K" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, flag", [
    (["reproduce", "compare", "--scale", ""], "--scale"),  # read as the default: the 6-hour study started
    (["reproduce", "stability", "--root", ""], "--root"),
    (["bench", "cost", "--schedule", ""], "--schedule"),
    (["bench", "cost", "--json", ""], "--json"),
    (["bench", "decode", "--model", ""], "--model"),
    (["eval", "loss", "--checkpoint", "ckpt", "--out", ""], "--out"),
    (["chat", "--checkpoint", "ckpt", "--system", ""], "--system"),
    (["train", "configs/tiny.toml", "--resume", ""], "--resume"),
    (["convert", "ckpt", ""], "dst"),
])
def test_an_empty_value_is_refused_not_read_as_the_default(args, flag, tmp_path, monkeypatch, capsys):
    """'' (a script's unset variable) is refused at parse time, before any work, on every text option; the two
    options where an empty text means something of its own take it."""
    from fullband.cli import build_parser

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: argument {flag}: '' is empty; accepted: a non-empty value" in last, last
    assert not list(tmp_path.iterdir())  # nothing started
    parsed = build_parser().parse_args(["generate", "--checkpoint", "ckpt", "--prompt", ""])
    assert parsed.prompt == "" and build_parser().parse_args(["eval", "generate-length", "--checkpoint", "c",
                                                              "--prompts", "p", "--stop-text", ""]).stop_text == ""


def test_bench_decode_smoke(tmp_path):
    report = tmp_path / "bench.json"
    code = main(["bench", "decode", "--config", "tiny", "--batch-sizes", "1", "2", "--dtypes", "float32",
                 "--new-tokens", "6", "--prompt-len", "8", "--repeats", "1", "--no-hf", "--json", str(report)])
    assert code == 0
    result = json.loads(report.read_text())
    variants = {(r["batch"], r["variant"]) for r in result["rows"]}
    assert {(1, "standard"), (1, "soft"), (2, "fused(k=1)"), (1, "matmul bound"), (2, "matmul bound (7/layer)")} <= variants
    assert all(r["tokens_per_s"] > 0 for r in result["rows"])
    assert 0 < result["theory_soft_overhead"] < 1
    assert result["device"] == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_decode_on_a_short_context_keeps_its_paired_steps_within_it(capsys):
    """The paired STANDARD / SOFT steps ran 400 positions past the prompt whatever max_seq_len was (an IndexError
    of the RoPE table); they stop at max_seq_len now, and a prompt + new tokens past it is one line."""
    args = ["bench", "decode", "--config", "tiny", "--set", "max_seq_len=24", "--batch-sizes", "1", "--dtypes",
            "float32", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1", "--no-hf"]
    assert main(args) == 0
    assert "soft_overhead_paired_steps/float32/b1" in capsys.readouterr().out
    assert main([*args, "--new-tokens", "17"]) == 2
    assert "--prompt-len + --new-tokens = 25 exceeds max_seq_len=24" in capsys.readouterr().err


def test_bench_decode_refuses_a_missing_device(tmp_path, capsys):
    report = tmp_path / "bench.json"
    assert main(["bench", "decode", "--config", "tiny", "--device", "cuda", "--json", str(report)]) == 2
    assert "--device 'cuda': CUDA is not available on this machine; accepted: cpu" in capsys.readouterr().err
    assert not report.exists()


@pytest.mark.parametrize("args", [
    ["--help"], ["generate", "--help"], ["bench", "decode", "--help"], ["bench", "train", "--help"], ["bench", "cost", "--help"],
    ["train", "--help"], ["tokenizer", "train", "--help"], ["eval", "loss", "--help"], ["eval", "probe", "--help"],
    ["reproduce", "--help"], ["demo", "--help"],
])
def test_every_command_s_help(args, capsys):
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 0 and f"usage: fullband {' '.join(args[:-1])}".strip() in capsys.readouterr().out


def test_the_console_script_runs_as_a_module():
    """`python -m fullband.cli` (what the console script calls), in a process of its own: the commands' help above
    is read in this one, each child costing seconds of imports."""
    code = ("import sys, runpy; sys.argv = ['fullband', '--help']\ntry:\n    runpy.run_module('fullband.cli', "
            "run_name='__main__')\nexcept SystemExit as done:\n    print('exit', done.code, 'transformers' in "
            "sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and "usage: fullband" in done.stdout and "reproduce" in done.stdout
    # building the parser leaves transformers unread (seconds of every command's start): a registry's choices
    # (convert's --to, --gguf-type) are read at parse time, and the help names each of them
    assert done.stdout.rstrip().endswith("exit 0 False"), done.stdout[-200:]


def test_convert_s_help_names_every_choice_its_registries_accept(capsys):
    from fullband.hf.convert import TARGETS
    from fullband.hf.gguf_out import GGUF_TYPES

    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"target layout: {', '.join(TARGETS[:-1])} or {TARGETS[-1]} (" in text
    assert f"tensor type: {', '.join(GGUF_TYPES[:-1])} or {GGUF_TYPES[-1]} (" in text
    with pytest.raises(SystemExit):
        main(["convert", "a", "b", "--to", "onnx"])
    assert "invalid choice: 'onnx' (choose from 'hf', 'native', 'gguf')" in capsys.readouterr().err


def test_tokenizer_train_command(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"m{i}.py").write_text(f"def function_{i}(value):\n    return value * {i} + len('text')\n" * 20)
    out = tmp_path / "tok"
    code = main(["tokenizer", "train", "--corpus", str(corpus), "--vocab-size", "300", "--out", str(out),
                 "--no-progress", "--val-percent", "20"])
    assert code == 0
    from fullband import load_tokenizer

    tok = load_tokenizer(out)
    assert tok.kind == "bpe" and tok.vocab_size <= 300
    assert tok.decode(tok.encode("def function_3(value):")) == "def function_3(value):"
    assert "BPE" in capsys.readouterr().out
