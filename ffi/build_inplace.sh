#!/usr/bin/env bash
# Build the native CPU kernels and copy libqlayers_cpu.so into qlayers/, so a
# source checkout works with PYTHONPATH=<repo> (no pip install needed).
#
#   bash ffi/build_inplace.sh            # CPU library (CUDA/ROCm too if found)
#   PYTHON=/path/to/python bash ffi/build_inplace.sh
#   QLAYERS_CMAKE_ARGS="-DQLAYERS_ENABLE_CUDA=OFF" bash ffi/build_inplace.sh
#
# The Python used (default: <repo>/.venv/bin/python, else python3) must have
# jax installed: it provides the XLA FFI headers.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$repo/.venv/bin/python" ]]; then python="$repo/.venv/bin/python"; else python=python3; fi
fi
build="${QLAYERS_BUILD_DIR:-$repo/build/inplace}"
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi

cmake -S "$repo" -B "$build" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$(command -v "$python")" \
  ${QLAYERS_CMAKE_ARGS:-}
cmake --build "$build" --parallel "$(nproc 2>/dev/null || echo 2)"
cmake --install "$build" --prefix "$repo/qlayers" --component qlayers_native
echo "qlayers: native libraries installed into $repo/qlayers/"
