#!/usr/bin/env bash
# Every CUDA path of fullband once and training steps at nanochat's d20 shape, printed as one table (see
# benchmarks/gpu_check.py); about 10 minutes on one H100-class GPU. The vLLM row runs tests/test_vllm.py on Model
# Runner V2 with $VLLM_PYTHON (default: .venv-vllm's python; a CUDA build of vLLM), and is skipped without one.
# On a GPU machine with PyTorch nothing needs installing: src/ goes on PYTHONPATH. `--device cpu --quick` is a
# toy-sized dry run of the script itself on any machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" benchmarks/gpu_check.py "$@"
