#!/usr/bin/env bash
# Interleaved A/B of one train step's trace, lower and compile: a worktree
# of an older commit (default 7ad2f6f, before the GEMM bodies were jitted as
# a trace cache) against this checkout, one fresh `compile.py measure`
# process each, ROUNDS rounds (benchmarks/RESULTS.md, "A quantized GEMM
# traced once per signature"). Prints per round and tree: trace s, lower s,
# compile s, compile CPU s, HLO instructions.
#
#   bash benchmarks/probes/trace_cache_ab.sh [TARGET [VARIANT [ROUNDS [OLD]]]]
#   bash benchmarks/probes/trace_cache_ab.sh h200 qlayers/fp8_delayed 4
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
target=${1:-h200}
variant=${2:-qlayers/fp8_delayed}
rounds=${3:-4}
old=${4:-7ad2f6f}
py="$repo/.venv-gpu/bin/python"
# The GPU target files, as sr_probes.sh finds them.
targets=${QLAYERS_GPU_TARGETS:-}
for dir in "$repo" "$repo/.." "$repo/../.."; do
  if [ -z "$targets" ] && [ -d "$dir/shared/gpu-targets" ]; then
    targets=$(cd "$dir/shared/gpu-targets" && pwd)
  fi
done
if [ -z "$targets" ] || [ ! -x "$py" ]; then
  echo "trace_cache_ab.sh needs .venv-gpu (bash scripts/setup-gpu-compile)" \
       "and the GPU target files (\$QLAYERS_GPU_TARGETS)" >&2
  exit 2
fi
tree=$(mktemp -d)
trap 'git -C "$repo" worktree remove --force "$tree"' EXIT
git -C "$repo" worktree add --detach --quiet "$tree" "$old"
measure() {  # $1: the tree whose qlayers and benchmarks run (first on the path)
  (cd "$1" && PYTHONPATH="$1:$1/benchmarks" JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \
     "$py" benchmarks/compile.py measure --model gpt-d256 --blocks 8 \
     --target "$target" --targets-dir "$targets" --optimizer examples \
     --variant "$variant" 2>/dev/null) \
    | sed -n 's/^COMPILE_RESULT //p' \
    | "$py" -c 'import json, sys; r = json.load(sys.stdin); print(*(
        f"{r[k]:.2f}" for k in ("trace_s", "lower_s", "compile_s",
                                 "compile_cpu_s")), r["hlo_instructions"])'
}
echo "round tree trace_s lower_s compile_s compile_cpu_s hlo_instructions"
for i in $(seq "$rounds"); do
  echo "$i $old $(measure "$tree")"
  echo "$i HEAD $(measure "$repo")"
done
