"""The 4-bit training recipes end to end: nvfp4 and mxfp4_mlperf load with
the fields their files promise, and a tiny model converted by
`qlayers.quantize` learns under each."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qlayers
from qlayers.recipe_rules import seed_rounding


def test_mxfp4_mlperf_fields():
  r = qlayers.recipe("mxfp4_mlperf")
  assert (r.fprop.hadamard, r.dgrad.hadamard, r.wgrad.hadamard) == (0, 16, 16)
  for spec in r.specs().values():
    assert (spec.format, spec.granularity, spec.block_size, spec.scale_rule,
            spec.rounding) == ("e2m1", "mx", 32, "mx_rceil", "nearest")
  assert not r.stochastic and r.sr_key == "data"


def test_fp4_recipes_are_listed():
  assert {"nvfp4", "mxfp4_mlperf"} <= set(qlayers.available_recipes())


class _MLP(nnx.Module):

  def __init__(self, rngs):
    self.up = nnx.Linear(64, 128, rngs=rngs)
    self.down = nnx.Linear(128, 64, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4_mlperf"])
def test_tiny_model_trains(name, optax_promotion):
  del optax_promotion
  model = _MLP(nnx.Rngs(0))
  report = qlayers.quantize(model, name)
  assert [c.recipe for c in report.converted] == [name, name], report
  seed_rounding(model)
  opt = qlayers.Optimizer(model, optax.adam(3e-3))
  kx, ka = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (128, 64))
  y = jnp.tanh(x @ jax.random.normal(ka, (64, 64)) / 8)

  @nnx.jit
  def step(model, opt):
    loss, grads = qlayers.value_and_grad(
        lambda m: jnp.mean((m(x).astype(jnp.float32) - y) ** 2))(model)
    opt.update(model, grads)
    return loss

  losses = [float(step(model, opt)) for _ in range(12)]
  assert np.isfinite(losses).all()
  assert losses[-1] < 0.6 * losses[0], losses
