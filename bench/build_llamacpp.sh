#!/usr/bin/env bash
# Build llama.cpp's llama-bench, the second peer of `strata bench` (bench/llamacpp_peer.py).
#
#   bash bench/build_llamacpp.sh SRC_DIR BUILD_DIR [cuda|cpu]
#
# SRC_DIR: a llama.cpp source tree (the GPU machines have no network: carry one, e.g. the
# vendor/llama.cpp of the llama-cpp-python sdist from PyPI). Only llama-bench and what it links
# are built; CUDA for compute capability 9.0 (Hopper) unless CUDA_ARCHITECTURES says otherwise.
# Prints the binary's path on its last line.
#
# CUDA_ROOT=DIR builds against that toolkit (bench/cuda_toolkit_pypi.sh makes one from PyPI)
# on a machine with no GPU, as a binary to carry to the GPU machine: no host-CPU-specific code,
# libstdc++ linked in, sm_90 machine code only. There it needs libcudart.so.13 and
# libcublas.so.13 on LD_LIBRARY_PATH (torch's nvidia/cu13/lib has both) and libgomp.so.1.
set -euo pipefail
SRC=${1:?usage: bench/build_llamacpp.sh SRC_DIR BUILD_DIR [cuda|cpu]}
BUILD=${2:?usage: bench/build_llamacpp.sh SRC_DIR BUILD_DIR [cuda|cpu]}
KIND=${3:-cuda}
native=ON
[ -n "${CUDA_ROOT:-}" ] && native=OFF
args=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=$native
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=${LLAMA_BUILD_EXAMPLES:-OFF} -DLLAMA_BUILD_SERVER=OFF
      -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_HTML=OFF -DLLAMA_CURL=OFF)
if [ -n "${CUDA_ROOT:-}" ]; then
  export PATH="$CUDA_ROOT/bin:$PATH"
  args+=("-DCUDAToolkit_ROOT=$CUDA_ROOT" "-DCMAKE_CUDA_COMPILER=$CUDA_ROOT/bin/nvcc"
         "-DCMAKE_EXE_LINKER_FLAGS=-static-libstdc++ -static-libgcc")
fi
case "$KIND" in
  cuda) args+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES:-90}") ;;
  cpu) ;;
  *) echo "build_llamacpp: KIND must be cuda or cpu, not $KIND" >&2; exit 2 ;;
esac
cmake -S "$SRC" -B "$BUILD" "${args[@]}" > "$BUILD.configure.log" 2>&1 || {
  tail -20 "$BUILD.configure.log" >&2; exit 1; }
# LLAMA_TARGETS: more tools from the same build, e.g. "llama-bench llama-batched-bench" for the
# batching peer (issue 22); the first one's path is printed.
read -r -a targets <<< "${LLAMA_TARGETS:-llama-bench}"
cmake --build "$BUILD" --target "${targets[@]}" -j "$(nproc)"
echo "$BUILD/bin/${targets[0]}"
