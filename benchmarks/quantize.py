"""Time of the native CPU quantize kernels against XLA's form in the same run.

Usage (from the repository root)::

  python benchmarks/quantize.py                  # [2048, 2048], bf16 and f32
  python benchmarks/quantize.py --shape 4096,1024 --runs 50

For per-tensor E4M3 (TE rule) and MXFP8 E4M3 blocks along axis 0 and 1, the
quantize alone (payload) and quantize + dequantize to BF16 are jitted twice:
with `qlayers.native_quantize` (its CPU kernels) and with
`qlayers.scaling.quantize` (XLA's fused ops). Then the passes that have a
kernel of their own: a delayed-scaling use (history max, amax choice and
quantize; `native_quantize.quantize_delayed` against `scaling.delayed_amax`
+ `quantize`), and the BF16 copy of an MXFP8 operand that the CPU MX GEMM
multiplies, as stored and transposed (`native_quantize.dequantize` against
``QTensor.dequantize``). Median wall ms over ``--runs`` calls after a
warm-up; markdown to stdout.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from amax import median_ms
from qlayers import native_quantize, scaling
from qlayers.scaling import QuantSpec

CASES = (("per-tensor e4m3", QuantSpec(format="e4m3", granularity="tensor"), 1),
         ("mxfp8 axis 0", QuantSpec(format="e4m3", granularity="mx"), 0),
         ("mxfp8 axis 1", QuantSpec(format="e4m3", granularity="mx"), 1))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shape", default="2048,2048",
                 help="rows,cols of the quantized tensor")
  p.add_argument("--runs", type=int, default=20)
  args = p.parse_args(argv)
  shape = tuple(int(n) for n in args.shape.split(","))
  ok, why = native_quantize.applies(jnp.zeros(shape, jnp.bfloat16), CASES[0][1])
  if not ok:
    raise SystemExit(f"the native quantize does not apply here: {why}")
  print(f"| input | case | pass | XLA ms | native ms | native / XLA |\n"
        f"|---|---|---|---:|---:|---:|")
  for dtype in (jnp.bfloat16, jnp.float32):
    x = jax.random.normal(jax.random.key(0), shape, dtype)
    for name, spec, axis in CASES:
      for what in ("quantize", "quantize + dequantize"):
        ms = []
        for quantize in (scaling.quantize, native_quantize.quantize):
          def fn(x, quantize=quantize):
            q = quantize(x, spec, axis)
            return q.payload if what == "quantize" else q.dequantize(
                jnp.bfloat16)
          ms.append(median_ms(jax.jit(fn), x, args.runs))
        _row(dtype, shape, name, what, ms)
    _delayed_rows(x, shape, args.runs)
  _dequantize_rows(shape, args.runs)
  return 0


def _row(dtype, shape, name, what, ms) -> None:
  print(f"| {jnp.dtype(dtype).name}{list(shape)} | {name} | {what} | "
        f"{ms[0]:.2f} | {ms[1]:.2f} | {ms[1] / ms[0]:.2f}x |")


def _delayed_rows(x, shape, runs: int) -> None:
  """One delayed-scaling use (a seen history of 1024 steps)."""
  spec = CASES[0][1]
  history = jnp.zeros(1024, jnp.float32).at[3].set(2.0)
  running = jnp.float32(0.5)

  def xla(x, h, r):
    use, run = scaling.delayed_amax(scaling.ScaleState(h, r), scaling.amax(x))
    return scaling.quantize(x, spec, 1, amax=use).payload, use, run

  def native(x, h, r):
    q, use, run = native_quantize.quantize_delayed(x, spec, h, r, 1)
    return q.payload, use, run

  ms = [median_ms(jax.jit(lambda x, f=f: f(x, history, running)), x, runs)
        for f in (xla, native)]
  _row(x.dtype, shape, "per-tensor e4m3, delayed", "delayed use + quantize",
       ms)


def _dequantize_rows(shape, runs: int) -> None:
  """The MXFP8 GEMM operand's BF16 copy, from a quantized BF16 tensor."""
  x = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
  for name, spec, axis in CASES[1:]:
    q = jax.jit(lambda x, spec=spec, axis=axis: scaling.quantize(
        x, spec, axis))(x)
    for transpose in (False, True):
      def xla(q, t=transpose):
        out = q.dequantize(jnp.bfloat16)
        return out.T if t else out

      def native(q, t=transpose):
        return native_quantize.dequantize(q, transpose=t)

      ms = [median_ms(jax.jit(f), q, runs) for f in (xla, native)]
      _row(jnp.bfloat16, shape, name, "dequantize to BF16"
           + (", transposed" if transpose else ""), ms)


if __name__ == "__main__":
  raise SystemExit(main())
