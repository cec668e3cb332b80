"""Quantized layers exported with a symbolic batch (`jax.export`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

import qlayers


def _exported(recipe, train, frozen=False):
  layer = nnx.Sequential(
      qlayers.QuantDense(64, 32, recipe=recipe, rngs=nnx.Rngs(0)))
  if frozen:
    qlayers.freeze(layer)
  if not train:
    layer.eval()
  graphdef, state = nnx.split(layer)

  def run(state, x):
    model = nnx.merge(graphdef, state)
    if not train:
      return model(x)
    return qlayers.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)

  b, = export.symbolic_shape("b")
  x = jax.ShapeDtypeStruct((b, 64), jnp.float32)
  return export.export(jax.jit(run))(state, x), run, state


# Each reaches a path that needed concrete rows: the plan (mxfp4's
# stochastic gradient copy), row-wise amaxes, FP6's 3-byte packing, FP4's.
@pytest.mark.parametrize("recipe, frozen", [
    ("mxfp4", False), ("fp8_rowwise", False), ("mxfp6", False),
    ("nvfp4", False), ("nvfp4", True), ("mxfp8", True)])
def test_forward_exported_with_a_symbolic_batch(recipe, frozen):
  exported, run, state = _exported(recipe, train=False, frozen=frozen)
  for rows in (3, 40):
    x = jax.random.normal(jax.random.key(rows), (rows, 64))
    np.testing.assert_array_equal(exported.call(state, x), run(state, x))


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_rowwise"])
def test_a_frozen_per_tensor_fp8_forward_exported_sums_in_fp32(recipe):
  # XLA's CPU compiler runs this exported GEMM (symbolic batch) on FP32
  # copies of its BF16-held FP8 operands, where the jitted one takes them
  # as BF16 with FP32 accumulation: the same products summed by another
  # kernel, last FP32 bits apart. Exported with a concrete batch: the bits.
  exported, run, state = _exported(recipe, train=False, frozen=True)
  x = jax.random.normal(jax.random.key(40), (40, 64))
  want = np.asarray(run(state, x))
  np.testing.assert_allclose(exported.call(state, x), want, rtol=0,
                             atol=2**-20 * np.abs(want).max())
  concrete = export.export(jax.jit(run))(state, x)
  np.testing.assert_array_equal(concrete.call(state, x), want)


def test_training_step_exported_with_a_symbolic_batch():
  exported, run, state = _exported("fp8_rowwise", train=True)
  x = jax.random.normal(jax.random.key(0), (24, 64))
  for got, want in zip(jax.tree.leaves(exported.call(state, x)),
                       jax.tree.leaves(run(state, x))):
    np.testing.assert_array_equal(got, want)


def test_stochastic_rounding_needs_a_concrete_batch():
  with pytest.raises(ValueError, match="needs concrete shapes"):
    _exported("mxfp4", train=True)
