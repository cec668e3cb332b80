"""Time of the NaN-safe amax against a plain ``max(abs(x))`` in the same run.

Usage (from the repository root)::

  python benchmarks/amax.py                 # [4096, 4096], bf16 and f32
  python benchmarks/amax.py --shape 8192,4096 --runs 50

`qlayers.scaling.amax` (max |x| of the whole tensor, +Inf when it holds Inf
or NaN) and the MX block amax (``blocks.block_amax`` over blocks of 1x32)
are jitted and timed on one random tensor per dtype: median wall ms over
``--runs`` calls after a warm-up. ``jnp.max(jnp.abs(x))`` (which may drop a
NaN on XLA:CPU) is the reference of the ratio column. Markdown to stdout.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from qlayers import blocks
from qlayers import scaling


def median_ms(fn, x, runs: int) -> float:
  jax.block_until_ready(fn(x))
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(x))
    times.append(time.perf_counter() - t0)
  return float(np.median(times)) * 1e3


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shape", default="4096,4096",
                 help="comma-separated 2-D shape (last dim a multiple of 32)")
  p.add_argument("--runs", type=int, default=20)
  args = p.parse_args(argv)
  try:
    shape = tuple(int(v) for v in args.shape.split(","))
  except ValueError:
    p.error(f"--shape takes whole numbers, got {args.shape!r}")
  if len(shape) != 2 or shape[1] % 32 or min(shape) <= 0:
    p.error(f"--shape must be 2-D with a last dim divisible by 32, got {shape}")
  if args.runs < 1:
    p.error("--runs must be positive")
  x = jax.random.normal(jax.random.key(0), shape, jnp.float32)
  fns = {
      "jnp.max(jnp.abs(x)) (reference)": jax.jit(lambda v: jnp.max(jnp.abs(v))),
      "scaling.amax": jax.jit(scaling.amax),
      "MX block amax (1x32)": jax.jit(
          lambda v: blocks.block_amax(v, (1, 32))),
  }
  print(f"amax of a {shape} tensor on {jax.default_backend()}, median of "
        f"{args.runs} runs (jax {jax.__version__})\n")
  print("| dtype | function | ms | vs reference |")
  print("|---|---|---:|---:|")
  for dtype in (jnp.bfloat16, jnp.float32):
    a = x.astype(dtype)
    ref = None
    for name, fn in fns.items():
      ms = median_ms(fn, a, args.runs)
      ref = ref or ms
      print(f"| {jnp.dtype(dtype).name} | {name} | {ms:.2f} | "
            f"{ms / ref:.2f}x |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
