"""benchmarks/collectives.py reads collectives from optimized HLO text."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import collectives  # noqa: E402  pylint: disable=g-import-not-at-top


def test_combined_collective_with_index_comments():
  # XLA's combiners merge collectives into one with a tuple type; from the
  # sixth element on it prints "/*index=N*/" before each.
  line = ("  %all-reduce.1 = (f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, "
          "f32[4]{0}, /*index=5*/bf16[8,2]{1,0}) all-reduce(f32[4]{0} %a), "
          "replica_groups={}, to_apply=%add")
  assert collectives.summary(line) == {"all-reduce": {"f32": 80, "bf16": 32}}


def test_async_start_counts_the_result_once():
  text = "\n".join([
      "  %s = (u8[1,2]{1,0}, u8[8,2]{1,0}) all-gather-start(u8[1,2]{1,0} %p)",
      "  %d = u8[8,2]{1,0} all-gather-done((u8[1,2]{1,0}, u8[8,2]{1,0}) %s)",
      "  ROOT %g = f32[8,2]{1,0} all-gather(f32[1,2]{1,0} %q), dimensions={0}"])
  assert collectives.summary(text) == {"all-gather": {"u8": 16, "f32": 64}}
