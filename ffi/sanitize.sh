#!/usr/bin/env bash
# Build the CPU kernels with AddressSanitizer + UndefinedBehaviorSanitizer and
# run the FFI tests against that build (the sanitizer runtime is preloaded
# into Python; pytest runs with --capture=no so a sanitizer report stays
# visible). Any out-of-bounds access, use-after-free or UB aborts the run.
#
#   bash ffi/sanitize.sh [extra pytest args]
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$repo/.venv/bin/python" ]]; then python="$repo/.venv/bin/python"; else python=python3; fi
fi
build="$repo/build/asan"
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi

cmake -S "$repo" -B "$build" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython_EXECUTABLE="$(command -v "$python")" \
  -DQLAYERS_SANITIZE=ON -DQLAYERS_ENABLE_CUDA=OFF -DQLAYERS_ENABLE_ROCM=OFF
cmake --build "$build" --parallel "$(nproc 2>/dev/null || echo 2)"

cxx="$(grep -E '^CMAKE_CXX_COMPILER:' "$build/CMakeCache.txt" | cut -d= -f2)"
asan="$("$cxx" -print-file-name=libasan.so)"
ubsan="$("$cxx" -print-file-name=libubsan.so)"
if [[ ! -f "$asan" ]]; then
  echo "sanitize.sh: $asan not found (install the compiler's libasan)" >&2
  exit 1
fi

export LD_PRELOAD="$asan:$ubsan"
# Python and jaxlib leak by design at exit; everything else is fatal.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:strict_string_checks=1:check_initialization_order=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
cd "$repo"
# The sanitizer build is loaded explicitly (qlayers._native.load) before
# pytest runs the kernel tests in the same process.
"$python" - "$build/ffi" "$@" <<'PY'
import sys
import pytest
from qlayers import _native
info = _native.load(sys.argv[1])["details"]["cpu"]
assert info["path"].startswith(sys.argv[1]), info
print("sanitize.sh: testing", info["path"], "-", info["info"])
sys.exit(pytest.main(["-q", "--capture=no", "-p", "no:cacheprovider",
                      "tests/test_ffi_kernels.py", "tests/test_ffi_errors.py",
                      *sys.argv[2:]]))
PY
echo "sanitize.sh: clean (ASan + UBSan)"
