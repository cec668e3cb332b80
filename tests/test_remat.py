"""qlayers.remat_policy: under jax.checkpoint only quantized GEMM inputs (and
the names asked for) are saved for the backward pass."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import qlayers
from qlayers.ops import WGRAD_INPUT_NAME

M, D, H1, H2, OUT = 24, 64, 96, 80, 48
_QUANT = ("float8", "uint8")


def _stack(recipe):
  rngs = nnx.Rngs(0)
  return nnx.List([
      qlayers.QuantDense(a, b, recipe=recipe, dtype=jnp.bfloat16, rngs=rngs)
      for a, b in ((D, H1), (H1, H2), (H2, OUT))])


def _loss_fn(graphdef, extra_name=None):
  def f(params, rest, x):
    layers = nnx.merge(graphdef, params, rest)
    h = x
    for i, layer in enumerate(layers):
      h = layer(h)
      if i < len(layers) - 1:
        h = jax.nn.gelu(h)
        if extra_name is not None and i == 0:
          h = checkpoint_name(h, extra_name)
    return jnp.sum(h.astype(jnp.float32) ** 2)
  return f


@functools.cache
def _residuals(recipe, names=(), remat=True, extra_name=None):
  """What the jitted VJP saves for the backward pass (the leaves of its
  residual function, outputs of one compile) and that compile's output bytes.
  Cached: the fp8_current residuals under the plain policy are also the
  baseline of `test_policy_saves_named_extras`."""
  layers = _stack(recipe)
  graphdef, params, rest = nnx.split(layers, nnx.Param, ...)
  params, rest = nnx.as_pure(params), nnx.as_pure(rest)
  x = jax.random.normal(jax.random.key(1), (M, D), jnp.float32)
  f = _loss_fn(graphdef, extra_name)
  if remat:
    f = jax.checkpoint(f, policy=qlayers.remat_policy(*names))
  g = lambda p, x: f(p, rest, x)
  residuals = jax.jit(lambda p, x: jax.vjp(g, p, x)[1]).lower(
      params, x).compile()
  saved = jax.tree.leaves(residuals(params, x))
  return saved, params, x, residuals.memory_analysis().output_size_in_bytes


def _is_input(leaf, params, x):
  """A leaf that is one of the function's inputs (saved as they are)."""
  for a in jax.tree.leaves(params) + [x]:
    if a.shape == leaf.shape and a.dtype == leaf.dtype and bool(
        jnp.array_equal(a, leaf)):
      return True
  return False


def _wide_activations(saved, params, x):
  """Floating leaves of activation size that are not the inputs."""
  return [r for r in saved
          if jnp.issubdtype(r.dtype, jnp.floating)
          and not str(r.dtype).startswith("float8")
          and r.size >= M * min(D, H1, H2, OUT)
          and not _is_input(r, params, x)]


def _quantized(saved):
  return [r for r in saved if str(r.dtype).startswith(_QUANT)]


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8", "mxfp4"])
def test_policy_saves_only_quantized_gemm_inputs(recipe):
  rec = qlayers.recipe(recipe)
  saved, params, x, _ = _residuals(recipe)
  assert _wide_activations(saved, params, x) == []
  # Every saved byte is an input, a quantized GEMM input, or a small scale.
  inputs = [r for r in saved if _is_input(r, params, x)]
  quant = _quantized(saved)
  quant_ids = {id(r) for r in quant}
  small = [r for r in saved if r.size * r.dtype.itemsize <= 4096
           and not _is_input(r, params, x) and id(r) not in quant_ids]
  assert len(inputs) + len(quant) + len(small) == len(saved)
  # One quantized copy of each layer's input: M x K elements at the recipe's
  # storage cost (payload plus scales).
  bpe = qlayers.scaling.bytes_per_element(rec.wgrad.lhs)
  want = sum(M * k * bpe for k in (D, H1, H2))
  got = sum(r.size * r.dtype.itemsize for r in quant + small
            if r.ndim >= 1)
  pad = 32 / M if rec.wgrad.lhs.granularity == "mx" else 1.0  # M padded
  assert want * 0.99 <= got <= want * pad * 1.01 + 4096, (got, want)


def test_without_policy_wide_activations_are_saved():
  """The check above is not vacuous: no remat saves the GELU internals."""
  saved, params, x, _ = _residuals("fp8_current", remat=False)
  assert _wide_activations(saved, params, x)


def test_policy_saves_named_extras():
  saved, params, x, with_extra = _residuals("fp8_current", ("h1",),
                                            extra_name="h1")
  wide = _wide_activations(saved, params, x)
  assert [(r.shape, str(r.dtype)) for r in wide] == [((M, H1), "bfloat16")]
  # An unsaved name changes nothing: the plain policy's residuals.
  _, _, _, without = _residuals("fp8_current")
  assert M * H1 * 2 <= with_extra - without <= M * H1 * 2 + 64


def test_policy_is_save_only_these_names():
  policy = qlayers.remat_policy("block_in")
  assert WGRAD_INPUT_NAME == "qlayers_wgrad_x"
  with pytest.raises(TypeError, match="checkpoint names"):
    qlayers.remat_policy(3)
  # Same behaviour as the stock policy on a function with both names.
  def f(x):
    a = checkpoint_name(jnp.sin(x), WGRAD_INPUT_NAME)
    b = checkpoint_name(jnp.cos(a), "block_in")
    c = checkpoint_name(jnp.sin(b), "other")
    return jnp.sum(jnp.sin(c))
  x = jnp.arange(4.0)
  ours = jax.tree.leaves(jax.vjp(jax.checkpoint(f, policy=policy), x)[1])
  stock = jax.tree.leaves(jax.vjp(jax.checkpoint(
      f, policy=jax.checkpoint_policies.save_only_these_names(
          WGRAD_INPUT_NAME, "block_in")), x)[1])
  assert len(ours) == len(stock)
  for a, b in zip(ours, stock):
    np.testing.assert_array_equal(a, b)
