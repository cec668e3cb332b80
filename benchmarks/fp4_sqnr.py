"""SQNR of each GEMM of a quantized matmul (Fprop y, Dgrad dx, Wgrad dw)
against FP64, for the 4-bit recipes, on Gaussian data and on Gaussian data
with 0.1% outliers 30x larger (the data of tests/test_ops.py).

  python benchmarks/fp4_sqnr.py [--recipes nvfp4,mxfp4,...] [--seeds 3]

Prints a markdown table of the mean over seeds (dB).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import qlayers
from qlayers import ops

M, K, N = 1024, 512, 512
RECIPES = "mxfp4,mxfp4_rht,mxfp4_mlperf,nvfp4,mxfp8"


def _data(key, outliers: bool):
  kx, kw, kg, ko = jax.random.split(key, 4)
  x = jax.random.normal(kx, (M, K))
  w = jax.random.normal(kw, (K, N)) * K**-0.5
  g = jax.random.normal(kg, (M, N)) * 1e-3
  if outliers:
    x, w, g = (jnp.where(jax.random.bernoulli(k, 0.001, t.shape), 30 * t, t)
               for k, t in zip(jax.random.split(ko, 3), (x, w, g)))
  return x, w, g


def _db(ref, got) -> float:
  ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
  return float(20 * np.log10(np.linalg.norm(ref) / np.linalg.norm(ref - got)))


def sqnr(name: str, seed: int, outliers: bool) -> tuple[float, float, float]:
  x, w, g = _data(jax.random.key(seed), outliers)
  r = qlayers.recipe(name)
  key = jax.random.key(1000 + seed)

  @jax.jit
  def run(x, w, g):
    y, vjp = jax.vjp(lambda x, w: ops.quantized_matmul(
        x, w, r, None, key=key)[0], x, w)
    return (y, *vjp(g))

  y, dx, dw = run(x, w, g)
  x64, w64, g64 = (np.asarray(t, np.float64) for t in (x, w, g))
  return (_db(x64 @ w64, y), _db(g64 @ w64.T, dx), _db(x64.T @ g64, dw))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--recipes", default=RECIPES)
  p.add_argument("--seeds", type=int, default=3)
  args = p.parse_args()
  if args.seeds < 1:
    p.error(f"--seeds must be >= 1, got {args.seeds}")
  for name in args.recipes.split(","):  # every name before any run
    try:
      qlayers.recipe(name)
    except (ValueError, FileNotFoundError) as e:
      p.error(str(e))
  print("| recipe | data | Fprop y | Dgrad dx | Wgrad dw |")
  print("|---|---|---|---|---|")
  for name in args.recipes.split(","):
    for outliers in (False, True):
      got = np.mean([sqnr(name, s, outliers) for s in range(args.seeds)],
                    axis=0)
      data = "0.1% outliers x30" if outliers else "Gaussian"
      print(f"| `{name}` | {data} | " + " | ".join(f"{v:.2f}" for v in got)
            + " |", flush=True)


if __name__ == "__main__":
  main()
