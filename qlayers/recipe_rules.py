"""Companions of the FP4 recipes that live outside a recipe file: the rules
of the layers a recipe keeps wide, and per-layer stochastic-rounding seeds.

NVIDIA's NVFP4 recipe (arXiv 2509.25149) keeps a few linear layers in BF16:
about 16% of its 12B hybrid model's, the first and mostly the last blocks
(the final blocks are the most sensitive in its ablations). A recipe file
describes one GEMM, so the choice of layers is a rule set for
`qlayers.quantize` (`nvfp4_wide_blocks`), used beside the default rules that
keep embeddings and the output head wide.

A recipe with ``sr_key = "step"`` keys each GEMM's stochastic rounding by
``(sr_seed, sr_step)`` (`qlayers.QuantGemm.rounding_key`); `seed_rounding`
gives every GEMM of a model its own seed, from its module path, so layers of
equal shapes do not draw the same bits.
"""

from __future__ import annotations

from qlayers.convert import DEFAULT_RULES, Rule
from qlayers.layers.core import seed_rounding

__all__ = ["nvfp4_wide_blocks", "seed_rounding"]

# The paper's 12B model: 62 blocks, 2 leading and 8 final blocks in BF16
# (10 of 62, the ~16% of linear layers it reports), as we read it.
_PAPER_BLOCKS, _PAPER_FIRST, _PAPER_LAST = 62, 2, 8


def nvfp4_wide_blocks(num_blocks: int, *, first: int | None = None,
                      last: int | None = None,
                      block: str = r"(^|/)blocks/{i}/") -> tuple[Rule, ...]:
  """Rules keeping the first ``first`` and last ``last`` of ``num_blocks``
  transformer blocks wide (BF16), followed by `qlayers.convert.DEFAULT_RULES`.

  Args:
    num_blocks: transformer blocks of the model.
    first, last: blocks kept wide at each end; default: the paper's share
      (2 and 8 of 62 blocks) scaled to ``num_blocks``, at least one last
      block.
    block: regular expression of one block's module path, with ``{i}`` for
      its index (default ``blocks/{i}/``, as ``nnx.List`` names it).

  Example:
    >>> import qlayers
    >>> from qlayers.recipe_rules import nvfp4_wide_blocks
    >>> rules = nvfp4_wide_blocks(6)
    >>> [r.pattern for r in rules[:-2]]
    ['(^|/)blocks/5/']
    >>> rules[0].matches("blocks/5/mlp/up"), rules[0].recipe
    (True, None)
  """
  if num_blocks < 1:
    raise ValueError(f"num_blocks must be >= 1, got {num_blocks}.")
  if first is None:
    first = round(num_blocks * _PAPER_FIRST / _PAPER_BLOCKS)
  if last is None:
    last = max(1, round(num_blocks * _PAPER_LAST / _PAPER_BLOCKS))
  if first < 0 or last < 0 or first + last > num_blocks:
    raise ValueError(f"first={first} and last={last} blocks do not fit in "
                     f"{num_blocks} blocks.")
  if "{i}" not in block:
    raise ValueError(f"block pattern {block!r} needs '{{i}}' for the index.")
  keep = list(range(first)) + list(range(num_blocks - last, num_blocks))
  return tuple(Rule(pattern=block.replace("{i}", str(i)), recipe=None)
               for i in keep) + DEFAULT_RULES
