#!/usr/bin/env bash
# The prepared GPU check (see benchmarks/gpu.py): FP8/BF16 GEMM TFLOP/s and
# the cuBLASLt FP8 custom call, MXFP8 via lax.scaled_dot, the quantized layer
# forward+backward, and the transformer train step, in about 8 minutes.
#
#   bash benchmarks/gpu.sh                # on the GPU machine
#   bash benchmarks/gpu.sh --cpu-smoke    # tiny sizes on CPU, every path
#
# Python: $PYTHON if set, else .venv/bin/python if present, else python3. It
# needs jax with its CUDA plugin (e.g. `pip install "jax[cuda12]"`) and
# the packages of pyproject.toml; the repository root goes on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY=python3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Hard stop a little after the script's own 480 s budget (smoke: 1200 s).
limit=540
for a in "$@"; do
  if [ "$a" = "--cpu-smoke" ]; then limit=1320; fi
done
exec timeout -k 10 "$limit" "$PY" benchmarks/gpu.py "$@"
