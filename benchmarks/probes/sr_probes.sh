#!/usr/bin/env bash
# What the stochastically rounded 4-bit cast kernels would predict with
# Blackwell's own stochastic conversion and/or with random bits that cost
# nothing: each patch beside this script applied to a throwaway worktree of
# the commit it was written against, then gpu_compile.py on the Llama-3-8B
# block for B200 (benchmarks/RESULTS.md, "What the 4-bit stochastic kernels
# could reach"). Probes, not library code:
#   sr_hardware.patch            PTX cvt.rs.satfinite.e2m1x4.f32 rounds,
#                                fed the same Threefry words (its bits on a
#                                GPU are not checked against the CPU's);
#   sr_free_bits.patch           the shipped rounding, each hash replaced by
#                                two integer instructions (not random);
#   sr_free_words.patch          on top of sr_hardware.patch, its words
#                                replaced as sr_free_bits.patch replaces
#                                the bytes: both changes.
# Their kernels' values are not meant to be right: only their instruction
# counts, and so the predictions, are read.
#
#   bash benchmarks/probes/sr_probes.sh OUT_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=$(mkdir -p "${1:?usage: sr_probes.sh OUT_DIR}" && cd "$1" && pwd)
base=43e205a  # the commit the patches apply to
py="$repo/.venv-gpu/bin/python"
# The GPU target files, where gpu_compile.py looks for them from this
# checkout ($QLAYERS_GPU_TARGETS, else shared/gpu-targets here or up to two
# folders above): the worktrees lie elsewhere.
targets=${QLAYERS_GPU_TARGETS:-}
for dir in "$repo" "$repo/.." "$repo/../.."; do
  if [ -z "$targets" ] && [ -d "$dir/shared/gpu-targets" ]; then
    targets=$(cd "$dir/shared/gpu-targets" && pwd)
  fi
done
if [ -z "$targets" ] || [ ! -x "$py" ]; then
  echo "sr_probes.sh needs .venv-gpu (bash scripts/setup-gpu-compile) and" \
       "the GPU target files (\$QLAYERS_GPU_TARGETS)" >&2
  exit 2
fi
tree=
compile=
cleanup() {
  # The compile and its worker process (its own process group): the
  # worktree's gpu_compile.py is the old one, which leaves its worker
  # running when it is stopped.
  if [ -n "$compile" ]; then
    kill -- -"$compile" 2>/dev/null || true
    wait "$compile" || true
  fi
  if [ -n "$tree" ]; then git -C "$repo" worktree remove --force "$tree"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for probe in none sr_hardware sr_free_bits sr_hardware_free_bits; do
  tree=$(mktemp -d)
  git -C "$repo" worktree add --detach --quiet "$tree" "$base"
  case "$probe" in  # the patches, applied in turn
    none) patches=() ;;
    sr_hardware_free_bits) patches=(sr_hardware sr_free_words) ;;
    *) patches=("$probe") ;;
  esac
  for patch in "${patches[@]}"; do
    git -C "$tree" apply "$here/$patch.patch"
  done
  # In the background, so that a signal reaches this script's trap at once,
  # and in a process group of its own (setsid), so that the trap stops it.
  (cd "$tree" && PYTHONPATH="$tree" JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 exec \
     setsid "$py" benchmarks/gpu_compile.py --targets b200 --triton off \
     --programs llama3-8b --recipes bf16,mxfp4,nvfp4 --ffi-dir '' \
     --targets-dir "$targets" --json "$out/$probe.json" \
     > "$out/$probe.txt" 2>&1) &
  compile=$!
  wait "$compile"
  compile=
  cleanup
  tree=
  echo "$probe:"
  grep -E '^\| (mxfp4|nvfp4) \| [0-9]+ ' "$out/$probe.txt" | cut -d'|' -f2,9,10,12,14
done
