#!/usr/bin/env bash
# Build the cuBLASLt target (libqlayers_cuda.so) next to the CPU library.
# Not part of the default CI; needs nvcc (CUDA >= 12.8 for MX types; cuBLAS
# >= 12.9 for the sm_90 row-wise and blockwise kernels) and the
# cuBLASLt headers + library, found in this order:
#   1. $QLAYERS_CUBLASLT_ROOT (a dir with include/cublasLt.h and lib/libcublasLt.so*)
#      (only its cublas*.h headers are used: a wheel's CUDA runtime headers
#      would shadow those of nvcc, see ffi/CMakeLists.txt)
#   2. the nvidia-cublas wheel in the Python env (site-packages/nvidia/cu13 or
#      nvidia/cublas), e.g. from `pip install nvidia-cublas` or jax[cuda13]
#   3. /usr/local/cuda
#
#   bash ffi/build_cuda.sh              # build only (build/cuda/ffi/)
#   INSTALL=1 bash ffi/build_cuda.sh    # also copy the libraries into qlayers/
#   CUDA_ARCHS="90;100" bash ffi/build_cuda.sh
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  # .venv-gpu (scripts/setup-gpu-compile) has the nvidia-cublas wheel.
  for cand in "$repo/.venv-gpu/bin/python" "$repo/.venv/bin/python"; do
    if [[ -x "$cand" ]]; then python="$cand"; break; fi
  done
  python="${python:-python3}"
fi
# CMake runs from the build folder: give it an absolute interpreter path.
python="$("$python" -c 'import sys; print(sys.executable)')"
build="${QLAYERS_BUILD_DIR:-$repo/build/cuda}"

root="${QLAYERS_CUBLASLT_ROOT:-}"
if [[ -z "$root" ]]; then
  root="$("$python" - <<'PY'
import importlib.util, pathlib
spec = importlib.util.find_spec("nvidia")
for base in (spec.submodule_search_locations if spec else []):
    for sub in ("cu13", "cublas"):
        p = pathlib.Path(base) / sub
        if (p / "include" / "cublasLt.h").exists():
            print(p)
            raise SystemExit
PY
)"
fi
if [[ -z "$root" && -f /usr/local/cuda/include/cublasLt.h ]]; then root=/usr/local/cuda; fi
if [[ -z "$root" ]]; then
  echo "build_cuda.sh: cuBLASLt not found; pip install nvidia-cublas or set QLAYERS_CUBLASLT_ROOT" >&2
  exit 1
fi
if ! command -v nvcc >/dev/null 2>&1; then
  echo "build_cuda.sh: nvcc not found on PATH" >&2
  exit 1
fi
echo "build_cuda.sh: cuBLASLt from $root, $(nvcc --version | tail -1)"

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
cmake -S "$repo" -B "$build" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$python" \
  -DQLAYERS_ENABLE_CUDA=ON \
  -DQLAYERS_CUBLASLT_ROOT="$root" \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-89;90;100}"
cmake --build "$build" --parallel "$(nproc 2>/dev/null || echo 2)"
lib="$build/ffi/libqlayers_cuda.so"
if [[ ! -f "$lib" ]]; then
  echo "build_cuda.sh: $lib was not built (see the CMake output above)" >&2
  exit 1
fi
nm -D --defined-only "$lib" | grep -q QlayersGemmMxGpu
handlers="$(nm -D --defined-only "$lib" | awk '/ Qlayers/ {print $3}' | tr '\n' ' ')"
echo "build_cuda.sh: built $lib ($handlers)"
if [[ "${INSTALL:-0}" == 1 ]]; then
  cmake --install "$build" --prefix "$repo/qlayers" --component qlayers_native
fi
