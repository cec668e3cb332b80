"""qlayers.inspect.collect: nothing cached on the loss function, and the
statistics read the operand the GEMM consumed (its BF16 rounding kept)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import qlayers

_factor = 1.0  # read by `_scaled_loss`; the tests rebind it


def _scaled_loss(m, x):
  return _factor * jnp.mean(m(x).astype(jnp.float32) ** 2)


def test_collect_reads_a_rebound_global_anew():
  global _factor
  layer = qlayers.QuantDense(64, 32, recipe="fp8_current", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (8, 64))
  losses = []
  try:
    for _factor in (1.0, 3.0):
      losses.append(qlayers.inspect.collect(layer, _scaled_loss, x).loss)
  finally:
    _factor = 1.0
  assert losses[1] == pytest.approx(3.0 * losses[0], rel=1e-6)


class _Scaled(nnx.Module):
  """A BF16 QuantDense whose input is computed in FP32 inside the graph
  (``x * c``) and rounded to BF16 by the layer."""

  def __init__(self, rngs):
    self.lin = qlayers.QuantDense(64, 32, recipe="mxfp8", dtype=jnp.bfloat16,
                                  rngs=rngs)

  def __call__(self, x, c):
    return self.lin(x * c)


def test_mxfp8_never_saturates_on_an_input_rounded_to_bf16():
  """The max of each block of 32 is 1.75 (1 + 2**-9) in FP32, which rounds
  to 1.75 in BF16: RCEIL gives the scale 1.75 / 448 = 2**-8 exactly. Read in
  FP32 (a statistic that recomputed the input without its BF16 rounding)
  the max would exceed 448 and count as saturated."""
  x = jax.random.uniform(jax.random.key(3), (32, 64))
  x = x.at[:, ::32].set(1.0 + 2.0**-9)
  rep = qlayers.inspect.collect(_Scaled(nnx.Rngs(0)),
                                lambda m, x, c: jnp.mean(
                                    m(x, c).astype(jnp.float32) ** 2),
                                x, jnp.float32(1.75))
  assert [r.role for r in rep.rows] == ["x", "w", "g"]
  for row in rep.rows:
    assert row.saturated == 0.0, row.role
    for gemm, st in row.gemms.items():
      assert st["saturated"] == 0.0, (row.role, gemm)
  amax = rep.row("lin", "x").amax
  assert amax == 1.75 == float(jnp.asarray(amax, jnp.bfloat16))
  for st in rep.row("lin", "x").gemms.values():
    assert st["amax"] == 1.75 and st["scale"] == 2.0**-8
