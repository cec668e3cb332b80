#!/usr/bin/env bash
# The GPU check in one command, on a bare NVIDIA box with Python and pip:
#   1. jax with its CUDA plugin: $PYTHON if it has one, else .venv-gpu/
#      (made by scripts/setup-gpu-compile: jax[cuda12] or jax[cuda13] by the
#      driver's CUDA version, $QLAYERS_JAX_CUDA to choose);
#   2. checks that jax sees the GPU (exit 2 if not);
#   3. builds the native cuBLASLt kernels (ffi/build_cuda.sh) when nvcc is
#      there, for the attached GPU's architecture only;
#   4. runs benchmarks/gpu.py: the one-pass cast kernels' bits against the
#      CPU's, GEMMs, the layer, a small train step and one
#      train step of the Llama-3-8B block, every shipped recipe (nvfp4 and
#      deepseek_v3_ue8m0 included once they exist), inside its 8-minute
#      budget (hard stop a little after it).
#
#   bash benchmarks/gpu.sh                # on the GPU machine
#   bash benchmarks/gpu.sh --cpu-smoke    # tiny sizes on CPU, every path
#   bash benchmarks/gpu.sh --parts gemm --out /tmp/gpu
#   bash benchmarks/gpu.sh --parts env,block      # the 8B block alone
#
# Offline machines: point pip at a wheelhouse (PIP_FIND_LINKS=/wheels
# PIP_NO_INDEX=1) or pass a ready interpreter as $PYTHON.
set -uo pipefail
cd "$(dirname "$0")/.."
smoke=0
for a in "$@"; do
  if [ "$a" = "--cpu-smoke" ]; then smoke=1; fi
done
say() { echo "gpu.sh: $*" >&2; }
has_cuda_jax() {
  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 "$1" -c \
    "import importlib.util as u, jax; import sys; sys.exit(0 if any(u.find_spec(m) for m in ('jax_plugins.xla_cuda12', 'jax_plugins.xla_cuda13')) else 1)" \
    >/dev/null 2>&1
}

if [ "$smoke" = 1 ]; then
  PY=${PYTHON:-}
  if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
  fi
  export JAX_PLATFORMS=cpu
else
  PY=${PYTHON:-}
  if [ -z "$PY" ] || ! has_cuda_jax "$PY"; then
    if [ -x .venv-gpu/bin/python ] && has_cuda_jax .venv-gpu/bin/python; then
      PY=.venv-gpu/bin/python
    else
      if [ -z "${QLAYERS_JAX_CUDA:-}" ] && command -v nvidia-smi >/dev/null; then
        major=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -1)
        if [ -n "$major" ] && [ "$major" -lt 13 ]; then
          export QLAYERS_JAX_CUDA=cuda12
        fi
      fi
      say "installing jax[${QLAYERS_JAX_CUDA:-cuda13}] into .venv-gpu"
      t0=$SECONDS
      if ! bash scripts/setup-gpu-compile >&2; then
        say "could not install the CUDA jax wheels (offline? see the header)"
        exit 2
      fi
      say "installed in $((SECONDS - t0)) s"
      PY=.venv-gpu/bin/python
    fi
  fi
  devices=$("$PY" -c "import jax; print(' '.join(f'{d.platform}:{getattr(d, \"compute_capability\", \"\")}' for d in jax.devices()))" 2>/dev/null | tail -1)
  say "jax devices: ${devices:-none}"
  case "$devices" in
    *gpu:*|*cuda:*) ;;
    *) say "jax sees no GPU; nothing to measure (--cpu-smoke runs on CPU)"; exit 2 ;;
  esac
  cc=$(echo "$devices" | sed -n 's/.*:\([0-9]*\)\.\([0-9]*\).*/\1\2/p' | head -1)
  # The library goes into the package folder, where qlayers._native looks.
  if [ ! -f qlayers/libqlayers_cuda.so ]; then
    if command -v nvcc >/dev/null 2>&1; then
      t0=$SECONDS
      if PYTHON="$PY" CUDA_ARCHS="${cc:-90}" timeout 300 bash ffi/build_cuda.sh \
          > /tmp/qlayers_build_cuda.log 2>&1; then
        cp build/cuda/ffi/libqlayers_cuda.so qlayers/
        say "built the cuBLASLt kernels for sm_${cc:-90} in $((SECONDS - t0)) s"
      else
        say "ffi/build_cuda.sh failed (log: /tmp/qlayers_build_cuda.log);" \
            "the native GPU kernels are not measured"
        tail -5 /tmp/qlayers_build_cuda.log >&2
      fi
    else
      say "no nvcc: the native GPU kernels are not built or measured"
    fi
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Hard stop a little after gpu.py's own budget (480 s; smoke 1200 s).
limit=510
if [ "$smoke" = 1 ]; then limit=1230; fi
exec timeout -k 10 "$limit" "$PY" benchmarks/gpu.py "$@"
