"""QuantEmbed: an nnx.Embed whose tied head (``attend``) is quantized."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qlayers
from qlayers.layers import QuantEmbed
from _support.helpers import DENSE_FLOORS, param_signature
from _support.numerics import sqnr_db

VOCAB, D = 96, 64
TOKENS = jnp.array([[1, 5, 7, 95], [0, 2, 7, 3]])
Q = jax.random.normal(jax.random.key(1), (2, 4, D))


def make(recipe="fp8_current", **kw):
  return QuantEmbed(VOCAB, D, recipe=recipe, rngs=nnx.Rngs(0), **kw)


def test_same_params_as_embed_both_ways():
  stock, quant = nnx.Embed(VOCAB, D, rngs=nnx.Rngs(0)), make("fp8_delayed")
  assert param_signature(quant) == param_signature(stock)
  new = jax.tree.map(lambda p: p + 1.0, nnx.state(stock, nnx.Param))
  nnx.update(quant, new)
  back = nnx.Embed(VOCAB, D, rngs=nnx.Rngs(1))
  nnx.update(back, nnx.state(quant, nnx.Param))
  np.testing.assert_array_equal(back.embedding[...],
                                new["embedding"][...])
  # The delayed state lives at quant, never as a Param.
  assert set(nnx.state(quant, qlayers.QuantVariable)) == {"quant"}


def test_lookup_is_the_stock_lookup():
  stock, quant = nnx.Embed(VOCAB, D, rngs=nnx.Rngs(0)), make()
  np.testing.assert_array_equal(quant(TOKENS), stock(TOKENS))


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8"])
def test_attend_against_the_stock_attend(recipe):
  stock, quant = nnx.Embed(VOCAB, D, rngs=nnx.Rngs(0)), make(recipe)
  ref, got = stock.attend(Q), quant.attend(Q)
  assert got.shape == ref.shape == (2, 4, VOCAB) and got.dtype == ref.dtype
  assert sqnr_db(ref, got) >= DENSE_FLOORS[recipe]


def test_attend_is_the_dense_gemm_against_the_table_and_trains_it():
  """``attend`` is QuantDense with kernel = table.T (same bits forward),
  and its gradient reaches the table as that kernel's, transposed."""
  emb = make()
  dense = qlayers.QuantDense(D, VOCAB, use_bias=False, recipe="fp8_current",
                             rngs=nnx.Rngs(0))
  dense.kernel[...] = emb.embedding[...].T
  np.testing.assert_array_equal(emb.attend(Q), dense(Q))
  ge = nnx.grad(lambda m: jnp.sum(m.attend(Q) ** 2))(emb)
  gd = nnx.grad(lambda m: jnp.sum(m(Q) ** 2))(dense)
  np.testing.assert_array_equal(np.asarray(ge["embedding"][...]),
                                np.asarray(gd["kernel"][...]).T)
  # Every row of the table is a logit's weight, so every row gets one.
  assert np.all(np.abs(np.asarray(ge["embedding"][...])).sum(axis=1) > 0)


def test_attend_refuses_bad_shapes_naming_the_layer():
  emb = make()
  with pytest.raises(ValueError, match=r"QuantEmbed\.attend expects queries "
                     rf"with last dim {D}, got shape \(2, 3\)"):
    emb.attend(jnp.ones((2, 3)))
  # A scalar broadcasts in nnx.Embed.attend; here it is an error (it was an
  # IndexError) as for every quantized GEMM of qlayers.
  with pytest.raises(TypeError, match=r"QuantEmbed\.attend expects queries "
                     rf"of shape \(\.\.\., {D}\), got a scalar"):
    emb.attend(jnp.float32(1.0))
