#!/usr/bin/env bash
# Build llama.cpp's `llama-bench` (the reference for benchmarks/bench_default.py and bench_ar.py), or another of its
# tools: TARGET=llama-diffusion-cli (the reference for benchmarks/bench_gguf_vs_llama.py).
#
# PyPI has no llama-bench binary, so this builds it from the llama.cpp sources vendored in the llama-cpp-python
# sdist (vendor/llama.cpp). Idempotent: when the binary exists it only prints its path.
#
# Usage: benchmarks/build_llama_bench.sh [CACHE_DIR]      (default: ~/.cache/unmask/llama.cpp)
# Env:   JOBS (default 1: the build is slow but does not starve a training run), NICE (default 19),
#        LLAMA_CPP_PYTHON_VERSION (pin the sdist, e.g. 0.3.16; default: the newest), PYTHON (default: python3),
#        TARGET (the cmake target and binary name; default llama-bench), SOURCES_ONLY=1 (fetch and unpack the sdist,
#        print the llama.cpp source directory, build nothing: what tests/engine/test_gguf_llama_converter.py needs),
#        AMX=0 (build for this CPU without its AMX instructions, into build-noamx/ and bin/${TARGET}-noamx, beside the
#        default build: on the VM measured, ggml's AMX Q8_0/Q4 kernels die with SIGILL at `tileloadd` although the
#        kernel grants AMX (oneDNN's AMX kernels run there); F16 does not use them. The rest of -march=native
#        stays, so the quantized matmuls take ggml's AVX512-VNNI path instead).
# Prints the binary's path as the last line of stdout. Needs a C/C++ compiler; cmake comes from PyPI if missing.
set -euo pipefail

CACHE_DIR="${1:-${HOME}/.cache/unmask/llama.cpp}"
JOBS="${JOBS:-1}"
NICE="${NICE:-19}"
PYTHON="${PYTHON:-python3}"
TARGET="${TARGET:-llama-bench}"
AMX="${AMX:-1}"
BIN="${CACHE_DIR}/bin/${TARGET}"
build="${CACHE_DIR}/build"
isa_flags=""
if [[ "${AMX}" == 0 ]]; then
    BIN="${CACHE_DIR}/bin/${TARGET}-noamx"
    build="${CACHE_DIR}/build-noamx"
    # explicit -mno-* flags win over -march=native in either order (gcc and clang), so __AMX_INT8__ stays undefined
    isa_flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi

if [[ "${SOURCES_ONLY:-0}" != 1 && -x "${BIN}" ]]; then
    echo "${BIN}"
    exit 0
fi
mkdir -p "${CACHE_DIR}/src" "${CACHE_DIR}/bin"

# 1. the sdist (no binary wheels, no dependencies)
spec="llama-cpp-python"
[[ -n "${LLAMA_CPP_PYTHON_VERSION:-}" ]] && spec="llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION}"
sdist="$(ls "${CACHE_DIR}"/src/llama_cpp_python-*.tar.gz 2>/dev/null | head -n1 || true)"
if [[ -z "${sdist}" ]]; then
    "${PYTHON}" -m pip download --no-binary :all: --no-deps -d "${CACHE_DIR}/src" "${spec}" >&2
    sdist="$(ls "${CACHE_DIR}"/src/llama_cpp_python-*.tar.gz | head -n1)"
fi

# 2. unpack it once; its vendored llama.cpp is the source tree
top="${CACHE_DIR}/src/$(basename "${sdist}" .tar.gz)"
if [[ ! -d "${top}" ]]; then
    tar -xzf "${sdist}" -C "${CACHE_DIR}/src"
fi
src="${top}/vendor/llama.cpp"
if [[ ! -f "${src}/CMakeLists.txt" ]]; then
    echo "error: ${src}/CMakeLists.txt missing: the sdist ${sdist} has no vendored llama.cpp" >&2
    exit 1
fi

if [[ "${SOURCES_ONLY:-0}" == 1 ]]; then
    echo "${src}"
    exit 0
fi

# 3. cmake (from PyPI when the system has none)
CMAKE="$(command -v cmake || true)"
if [[ -z "${CMAKE}" ]]; then
    "${PYTHON}" -m pip install --target "${CACHE_DIR}/cmake" cmake >&2
    CMAKE="${CACHE_DIR}/cmake/bin/cmake"
    export PYTHONPATH="${CACHE_DIR}/cmake${PYTHONPATH:+:${PYTHONPATH}}"
fi

# 4. configure + build only the ${TARGET} target
nice -n "${NICE}" "${CMAKE}" -S "${src}" -B "${build}" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="${isa_flags}" -DCMAKE_CXX_FLAGS="${isa_flags}" >&2
nice -n "${NICE}" "${CMAKE}" --build "${build}" --target "${TARGET}" -j "${JOBS}" >&2

found="$(find "${build}" -type f -name "${TARGET}" -perm -u+x | head -n1)"
if [[ -z "${found}" ]]; then
    echo "error: the build finished but no ${TARGET} binary is under ${build}" >&2
    exit 1
fi
cp "${found}" "${BIN}.tmp" && mv "${BIN}.tmp" "${BIN}"
echo "${BIN}"
