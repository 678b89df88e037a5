#!/usr/bin/env bash
# A CUDA 13.0 toolkit assembled from NVIDIA's PyPI wheels, for building llama-bench on a machine
# with no GPU and no system CUDA (bench/build_llamacpp.sh, CUDA_ROOT=...): nvcc, the runtime,
# cuBLAS and CCCL, plus a stub libcuda.so to link against (the driver's own libcuda.so.1 is
# loaded at run time on the GPU machine).
#
#   bash bench/cuda_toolkit_pypi.sh DIR        # prints the toolkit root on its last line
#
# About 0.5 GB of wheels. Stays at 13.0: the H200 machines' driver and nvcc are 13.0.
set -euo pipefail
DIR=${1:?usage: bench/cuda_toolkit_pypi.sh DIR}
mkdir -p "$DIR"
python3 -m pip download -q --no-deps -d "$DIR/wheels" \
    "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" \
    "nvidia-cublas==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*"
python3 -m pip install -q --no-deps --no-index --target "$DIR/site" "$DIR"/wheels/*.whl
ROOT="$DIR/site/nvidia/cu13"
# CMake's FindCUDAToolkit and the linker look for the unversioned names and lib64/.
for lib in cudart cublas cublasLt; do ln -sf "lib$lib.so.13" "$ROOT/lib/lib$lib.so"; done
ln -sfn lib "$ROOT/lib64"
# ggml-cuda calls these driver entry points (its virtual-memory pool); a stub that only
# satisfies the linker, named as the real library is.
mkdir -p "$ROOT/lib/stubs"
printf '%s\n' cuDeviceGet cuDeviceGetAttribute cuGetErrorString cuMemAddressFree \
    cuMemAddressReserve cuMemCreate cuMemGetAllocationGranularity cuMemMap cuMemRelease \
    cuMemSetAccess cuMemUnmap cuGetProcAddress cuGetProcAddress_v2 cuDriverGetVersion cuInit \
  | awk '{print "int " $1 "(void) { return 999; }"}' > "$DIR/cuda_stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$ROOT/lib/stubs/libcuda.so" "$DIR/cuda_stub.c"
"$ROOT/bin/nvcc" --version | tail -1 >&2
echo "$ROOT"
