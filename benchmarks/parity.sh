#!/bin/bash
# 4-bit training parity against BF16 on the Shakespeare GPT (examples/train_lm.py
# defaults: d=128, 4 blocks, 300 steps of 32x128 bytes), 3 seeds, one JSON per
# invocation (a stopped run keeps what finished), then one --merge table:
#   bf16, mxfp4, mxfp4 + the rules inspect.sensitivity proposes (measured in
#   the first invocation, replayed from its rules file), mxfp4_mlperf, nvfp4,
#   nvfp4 + the layers its paper keeps in BF16 (rules file $NVFP4_RULES).
# Every recipe run of a seed is compared with the bf16 run of that seed.
#
#   bash benchmarks/parity.sh [OUT] [SEEDS]       # default out/parity "0 1 2"
#
# Then the fine-tune: SmolLM2-135M, nvfp4 against bf16 (see RESULTS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/parity}
SEEDS=${2:-0 1 2}
NVFP4_RULES=${NVFP4_RULES:-$OUT/nvfp4_rules.json}
RUN=(env PYTHONPATH=. .venv/bin/python -u examples/train_lm.py
     --sample-tokens 0 --no-progress)
mkdir -p "$OUT"

# The nvfp4 BF16 layers as a rules file (the recipe's companion rule set).
if [ ! -f "$NVFP4_RULES" ]; then
  PYTHONPATH=. .venv/bin/python - "$NVFP4_RULES" <<'EOF'
import sys
import qlayers
from qlayers import recipe_rules
rules = recipe_rules.nvfp4_wide_blocks(4)
qlayers.inspect.save_rules(rules, sys.argv[1])
print("nvfp4 BF16 layers:", [r.pattern for r in rules])
EOF
fi

for s in $SEEDS; do
  "${RUN[@]}" --recipes mxfp4,mxfp4_mlperf,nvfp4 --seeds "$s" \
      --out "$OUT/s$s" --json "$OUT/s$s/results.json"
  if [ ! -f "$OUT/wide/rules_mxfp4+wide.json" ]; then
    "${RUN[@]}" --recipes mxfp4+wide --keep-wide auto --no-baseline-run \
        --seeds "$s" --out "$OUT/wide" --json "$OUT/wide_s$s.json"
  else
    "${RUN[@]}" --recipes mxfp4+wide --no-baseline-run --seeds "$s" \
        --keep-wide "@$OUT/wide/rules_mxfp4+wide.json" \
        --out "$OUT/wide" --json "$OUT/wide_s$s.json"
  fi
  "${RUN[@]}" --recipes nvfp4+wide --keep-wide "@$NVFP4_RULES" \
      --no-baseline-run --seeds "$s" --out "$OUT/nvwide" \
      --json "$OUT/nvwide_s$s.json"
done
files=$(ls "$OUT"/s*/results.json "$OUT"/wide_s*.json "$OUT"/nvwide_s*.json \
        | paste -sd,)
# The issue's goals: nvfp4 (+ its BF16 layers) and mxfp4 + rules within 1%.
"${RUN[@]}" --merge "$files" --tolerance 1 \
    --tolerances mxfp4=3,mxfp4_rht=3,mxfp4_mlperf=3,mxfp4+wide=1 \
    --out "$OUT/merged" --json "$OUT/merged/results.json"
