"""QuantLinearGeneral and QuantEinsum as drop-ins for nnx.LinearGeneral and
nnx.Einsum: Params, outputs, gradients, and the shapes they refuse."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qlayers
from qlayers.layers.general import einsum_gemm_plan
from _support.helpers import DENSE_FLOORS, param_signature
from _support.numerics import sqnr_db


def np_normal(std, seed=0):
  """An initializer drawing from NumPy, the same values for the same shape
  (so a stock layer and its twin start alike); random init in JAX would
  compile a program per shape, which dominates small tests."""
  return lambda key, shape, dtype=jnp.float32: (
      std * np.random.default_rng(seed).standard_normal(shape)).astype(dtype)


INIT = dict(kernel_init=np_normal(0.2), bias_init=np_normal(1.0))
X = jax.random.normal(jax.random.key(2), (2, 3, 4, 16))

# (stock layer, its quantized twin given a recipe, input)
CASES = {
    "general_in2": (
        lambda: nnx.LinearGeneral((4, 16), 8, axis=(-2, -1), **INIT,
                                  rngs=nnx.Rngs(0)),
        lambda r: qlayers.QuantLinearGeneral((4, 16), 8, axis=(-2, -1),
                                             recipe=r, **INIT,
                                             rngs=nnx.Rngs(0)),
        X),
    "general_out2": (
        lambda: nnx.LinearGeneral(16, (2, 5), **INIT, rngs=nnx.Rngs(0)),
        lambda r: qlayers.QuantLinearGeneral(16, (2, 5), recipe=r, **INIT,
                                             rngs=nnx.Rngs(0)),
        X),
    "einsum": (
        lambda: nnx.Einsum("btd,dnh->bnth", (16, 4, 8), (4, 8), **INIT,
                           rngs=nnx.Rngs(0)),
        lambda r: qlayers.QuantEinsum("btd,dnh->bnth", (16, 4, 8), (4, 8),
                                      recipe=r, **INIT, rngs=nnx.Rngs(0)),
        X[0]),
    "einsum_ellipsis": (
        lambda: nnx.Einsum("...hd,hdo->...o", (4, 16, 8), (8,), **INIT,
                           rngs=nnx.Rngs(0)),
        lambda r: qlayers.QuantEinsum("...hd,hdo->...o", (4, 16, 8), (8,),
                                      recipe=r, **INIT, rngs=nnx.Rngs(0)),
        X),
}


@pytest.mark.parametrize("case", CASES)
def test_same_params_as_the_stock_layer_both_ways(case):
  make_stock, make_quant, _ = CASES[case]
  stock, quant = make_stock(), make_quant("fp8_delayed")
  assert param_signature(quant) == param_signature(stock)
  # Values neither started from: stock -> quantized -> stock, exactly.
  new = jax.tree.map(lambda p: p + 1.0, nnx.state(stock, nnx.Param))
  nnx.update(quant, new)
  back = make_stock()
  nnx.update(back, nnx.state(quant, nnx.Param))
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(nnx.state(back))):
    np.testing.assert_array_equal(a, b)
  assert not set(nnx.state(quant, nnx.Param)) & {"quant"}


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8"])
@pytest.mark.parametrize("case", CASES)
def test_output_against_the_stock_layer(case, recipe):
  """Within the recipe's forward SQNR floor of the stock (FP32) layer, and
  the same shape and dtype."""
  make_stock, make_quant, x = CASES[case]
  ref, got = make_stock()(x), make_quant(recipe)(x)
  assert got.shape == ref.shape and got.dtype == ref.dtype
  assert sqnr_db(ref, got) >= DENSE_FLOORS[recipe], case


def test_linear_general_is_the_dense_gemm_on_flattened_operands():
  """Contracting (4, 16) into 8 is exactly QuantDense(64, 8) on the
  flattened input: same quantized GEMM, same bits."""
  q = CASES["general_in2"][1]("fp8_current")
  dense = qlayers.QuantDense(64, 8, recipe="fp8_current", **INIT,
                             rngs=nnx.Rngs(0))
  dense.kernel[...] = q.kernel[...].reshape(64, 8)
  dense.bias[...] = q.bias[...]
  np.testing.assert_array_equal(np.asarray(q(X)),
                                np.asarray(dense(X.reshape(2, 3, 64))))


def test_einsum_gradients_match_dense():
  init = dict(kernel_init=np_normal(0.2), rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(4), (3, 5, 64))
  ein = qlayers.QuantEinsum("btd,dnh->bnth", (64, 4, 8), None,
                            recipe="fp8_current", **init)
  dense = qlayers.QuantDense(64, 32, use_bias=False, recipe="fp8_current",
                             **init)
  dense.kernel[...] = ein.kernel[...].reshape(64, 32)

  def f_ein(m, x):
    return jnp.sum(m(x) ** 2)

  def f_dense(m, x):
    y = m(x).reshape(3, 5, 4, 8).transpose(0, 2, 1, 3)
    return jnp.sum(y ** 2)

  ge = nnx.jit(nnx.grad(f_ein, argnums=(0, 1)))(ein, x)
  gd = nnx.jit(nnx.grad(f_dense, argnums=(0, 1)))(dense, x)
  np.testing.assert_array_equal(np.asarray(ge[1]), np.asarray(gd[1]))
  np.testing.assert_array_equal(
      np.asarray(ge[0]["kernel"][...]).reshape(64, 32),
      np.asarray(gd[0]["kernel"][...]))


def test_einsum_plan_rejects_non_gemms():
  assert einsum_gemm_plan("btd,dnh->btnh")[3:] == (["d"], ["n", "h"])
  for eq, why in [("btd,bd->bt", "batch dims"),
                  ("btd,dh->bh", "one operand only"),
                  ("bii,ih->bh", "repeats an index"),
                  ("bd,...->b", "kernel term has '...'"),
                  ("bd,dh", "explicit")]:
    with pytest.raises(ValueError, match=re.escape(why)):
      einsum_gemm_plan(eq)


def test_bad_shapes_are_refused_naming_the_layer():
  lg = CASES["general_in2"][1]("fp8_current")
  with pytest.raises(ValueError, match=r"QuantLinearGeneral expects input "
                     r"dims \(4, 16\) at axis \(-2, -1\), got shape"):
    lg(jnp.ones((2, 4, 15)))
  # A scalar, or a rank below the contracted axes: the TypeError
  # nnx.LinearGeneral gives (it raised ZeroDivisionError).
  for x in (jnp.float32(1.0), jnp.ones((16,))):
    with pytest.raises(TypeError):
      CASES["general_in2"][0]()(x)
    with pytest.raises(TypeError, match=r"QuantLinearGeneral contracts axis "
                       r"\(-2, -1\) of sizes \(4, 16\)"):
      lg(x)
  with pytest.raises(ValueError, match="batch_axis"):
    qlayers.QuantLinearGeneral(16, 8, batch_axis={0: 2}, rngs=nnx.Rngs(0))
  ein = CASES["einsum"][1]("fp8_current")
  with pytest.raises(ValueError, match=r"index 'd' is 15 in the input but "
                     r"16 in the kernel"):
    ein(jnp.ones((2, 3, 15)))
  # A scalar: the ValueError nnx.Einsum gives, naming the layer.
  with pytest.raises(ValueError):
    CASES["einsum"][0]()(jnp.float32(1.0))
  with pytest.raises(ValueError, match=r"QuantEinsum 'btd,dnh->bnth' does "
                     r"not fit input \(\)"):
    ein(jnp.float32(1.0))
  with pytest.raises(ValueError, match="names 3 kernel dims"):
    qlayers.QuantEinsum("btd,dnh->btnh", (16, 4), rngs=nnx.Rngs(0))


def test_an_injected_op_is_refused_not_dropped():
  """A drop-in never calls a custom ``dot_general`` / ``einsum_op``: it
  refuses one rather than ignore it."""
  dot = lambda *a, **k: jax.lax.dot_general(*a, **k)  # noqa: E731
  makers = [
      lambda: qlayers.QuantDense(16, 8, dot_general=dot, rngs=nnx.Rngs(0)),
      lambda: qlayers.QuantLinearGeneral(16, 8, dot_general=dot,
                                         rngs=nnx.Rngs(0)),
      lambda: qlayers.QuantEinsum("bd,dh->bh", (16, 8), rngs=nnx.Rngs(0),
                                  einsum_op=lambda *a, **k: None),
  ]
  for make, op in zip(makers, ("dot_general", "dot_general", "einsum_op")):
    with pytest.raises(ValueError, match=f"would never call the {op}"):
      make()
  qlayers.QuantDense(16, 8, dot_general=jax.lax.dot_general,
                     rngs=nnx.Rngs(0))  # jax's own is what it runs anyway


def test_linear_general_checks_the_local_kernel():
  """Inside jax.shard_map a kernel split along K is a shard of
  ``in_features``: the input is checked against the kernel the layer holds
  (as nnx.LinearGeneral does), not the global in_features, and the GEMM is
  the one a layer of the shard's size computes."""
  full = qlayers.QuantLinearGeneral(64, (2, 4), recipe="fp8_current",
                                    use_bias=False, rngs=nnx.Rngs(0))
  shard = qlayers.QuantLinearGeneral(16, (2, 4), recipe="fp8_current",
                                     use_bias=False, rngs=nnx.Rngs(1))
  shard.kernel[...] = full.kernel[...][:16]
  full.kernel = nnx.Param(full.kernel[...][:16])  # what a shard holds
  x = jax.random.normal(jax.random.key(0), (3, 16))
  np.testing.assert_array_equal(np.asarray(full(x)), np.asarray(shard(x)))


def test_recipe_fprop_out_dtype_is_every_layer_output_dtype(tmp_path):
  """A recipe's ``[fprop] out_dtype`` is the output dtype of every drop-in
  and op form; ``preferred_element_type`` still wins over it."""
  path = tmp_path / "bf16_out.toml"
  path.write_text('scaling = "current"\n[defaults]\ngranularity = "tensor"\n'
                  '[fprop]\nout_dtype = "bfloat16"\nx = { format = "e4m3" }\n'
                  'w = { format = "e4m3" }\n')
  r = qlayers.recipe(path)
  x = jnp.ones((4, 16), jnp.float32)
  rngs = nnx.Rngs(0)
  outs = {
      "QuantDense": qlayers.QuantDense(16, 8, recipe=r, rngs=rngs)(x),
      "QuantLinearGeneral": qlayers.QuantLinearGeneral(
          16, 8, recipe=r, rngs=rngs)(x),
      "QuantEinsum": qlayers.QuantEinsum("bd,dh->bh", (16, 8), (8,),
                                         recipe=r, rngs=rngs)(x),
      "ops.dot_general": qlayers.ops.dot_general(r)(
          x, jnp.ones((16, 8)), (((1,), (0,)), ((), ()))),
      "ops.ragged_dot": qlayers.ops.ragged_dot(r)(
          x, jnp.ones((2, 16, 8)), jnp.array([1, 3])),
      "QuantExperts": qlayers.QuantExperts(2, 16, 8, recipe=r, rngs=rngs)(
          x, jnp.array([1, 3])),
  }
  assert {k: v.dtype for k, v in outs.items()} == {
      k: jnp.bfloat16 for k in outs}
  wide = qlayers.QuantDense(16, 8, recipe=r, preferred_element_type=
                            jnp.float32, rngs=rngs)(x)
  assert wide.dtype == jnp.float32
  # Without it, the (promoted) input dtype, as nnx.Linear gives.
  assert qlayers.QuantDense(16, 8, recipe="fp8_current", rngs=rngs)(
      x).dtype == jnp.float32
