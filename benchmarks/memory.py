"""Saved-for-backward bytes per recipe, and the memory equation.

Usage (from the repository root)::

  python benchmarks/memory.py block                  # d=1024 ff=4096 T=1024 B=4
  python benchmarks/memory.py block --attention fused --json mem.json
  python benchmarks/memory.py calc --params 70e9 --fsdp 8 --recipe mxfp4 \\
      --saved-elems 2e9 --wide-elems 1e9
  python benchmarks/memory.py calc --check-seed
  python benchmarks/memory.py remat --stream-dtype float32,bfloat16

One command per module:

* ``block`` (``memory_block.py``): one pre-norm transformer block of
  ``benchmarks/models.py`` per recipe, converted with ``qlayers.quantize``;
  the compiled residual and step sizes (``memory_analysis()``), and every
  residual classified by the name or the named region that saved it
  (GEMM inputs, LayerNorm, attention, GELU, weights, ...), against the seed
  arithmetic.
* ``remat`` (``memory_remat.py``): the same block under ``jax.checkpoint``
  with a names-only policy (``qlayers.remat_policy()`` and its BF16
  counterpart).
* ``calc`` (``memory_calc.py``): the seed's memory equation.

``memory_common.py`` holds the tagged block, the compile step, the residual
listing (``jax.ad_checkpoint.print_saved_residuals``) and the report header.
Nothing is executed: every byte count is from a compiled program or a trace.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
  sys.path.insert(0, str(_HERE))
# An installed qlayers wins; otherwise the source tree next to benchmarks/.
sys.path.append(str(_HERE.parent))

import memory_block  # noqa: E402
import memory_calc  # noqa: E402
import memory_remat  # noqa: E402

_COMMANDS = {"block": memory_block.run, "remat": memory_remat.run,
             "calc": memory_calc.run}


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  memory_block.add_parser(sub)
  memory_remat.add_parser(sub)
  memory_calc.add_parser(sub)
  return p


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  return _COMMANDS[args.cmd](args)


if __name__ == "__main__":
  sys.exit(main())
