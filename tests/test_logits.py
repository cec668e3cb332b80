"""QuantLogits: untied and tied heads, and the chunked cross-entropy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qlayers
from qlayers import ops
from qlayers import scaling as S
from _support.helpers import (
    DEFAULT_FLOOR, DENSE_FLOORS, delayed, optax_rules, pure, param_signature,
    train_step, weighted_sum)
from _support.numerics import sqnr_db


class TiedLM(nnx.Module):

  def __init__(self, vocab, d, rngs, **kw):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.head = qlayers.QuantLogits(embed=self.embed, **kw)


def test_logits_default_wide_and_untied_is_linear():
  head = qlayers.QuantLogits(16, 50, rngs=nnx.Rngs(0))
  assert not head.recipe.quantized and not nnx.state(head.quant)
  lin = nnx.Linear(16, 50, use_bias=False, rngs=nnx.Rngs(0))
  assert param_signature(head) == param_signature(lin)
  nnx.update(head, nnx.state(lin, nnx.Param))
  x = jax.random.normal(jax.random.key(0), (2, 3, 16))
  y = head(x)
  assert y.dtype == jnp.float32 and y.shape == (2, 3, 50)
  assert 40 < sqnr_db(lin(x), y) < 100  # BF16 operands, FP32 accumulation
  xb = x.astype(jnp.bfloat16)
  hb = qlayers.QuantLogits(16, 50, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert hb(xb).dtype == jnp.float32
  with pytest.raises(ValueError, match="last dim 16"):
    head(jnp.ones((2, 15)))


def test_logits_tied_to_embedding():
  lm = TiedLM(50, 16, nnx.Rngs(0))
  assert lm.head.tied
  assert list(pure(nnx.state(lm, nnx.Param))) == ["embed/embedding"]
  x = jax.random.normal(jax.random.key(0), (2, 3, 16))
  assert sqnr_db(lm.embed.attend(x), lm.head(x)) > 40
  tokens = jnp.array([[1, 4, 2], [7, 7, 0]])
  labels = jnp.array([[4, 2, 9], [7, 0, 3]])

  def loss_fn(lm):
    return lm.head.loss(lm.embed(tokens), labels, chunk_size=2)

  def ref(table):
    logits = table[tokens] @ table.T
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.mean(lse - jnp.take_along_axis(logits, labels[..., None],
                                              axis=-1)[..., 0])

  loss, grads = qlayers.value_and_grad(loss_fn)(lm)
  table = lm.embed.embedding[...]
  want_loss, want_grad = jax.value_and_grad(ref)(table)
  # The "bf16" head: BF16 operands, FP32 accumulation (and FP32 gradients).
  np.testing.assert_allclose(loss, want_loss, rtol=1e-3)
  g = grads["embed"]["embedding"][...]
  # Rows reached only through the tied head still get a gradient.
  assert np.all(np.abs(np.asarray(g)[[3, 9, 20]]).sum(-1) > 0)
  assert sqnr_db(want_grad, g) > 40
  with pytest.raises(ValueError, match="tied embedding"):
    qlayers.QuantLogits(16, 49, embed=lm.embed)


def _lm_loss_inputs(seq, d=16, vocab=64):
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (2, seq, d))
  labels = jax.random.randint(k[1], (2, seq), 0, vocab)
  mask = jax.random.bernoulli(k[2], 0.8, (2, seq))
  return x, labels, mask


# 12 does not divide the sequence (40): the last chunk is padded.
@pytest.mark.parametrize("tied,chunk", [(False, 12), (True, 8)])
def test_chunked_loss_equals_full(tied, chunk):
  if tied:
    model = TiedLM(64, 16, nnx.Rngs(0))
  else:
    model = nnx.Dict(head=qlayers.QuantLogits(
        16, 64, use_bias=True, bias_init=nnx.initializers.normal(1.0),
        rngs=nnx.Rngs(0)))
  x, labels, mask = _lm_loss_inputs(40)

  def loss_fn(model, x, chunk_size):
    return model.head.loss(x, labels, chunk_size=chunk_size, mask=mask)

  vg = nnx.jit(nnx.value_and_grad(loss_fn, argnums=(0, 1)),
               static_argnums=2)
  full, (gm_full, gx_full) = vg(model, x, None)
  part, (gm_part, gx_part) = vg(model, x, chunk)
  logits = model.head(x)
  ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
      logits, labels[..., None], -1)[..., 0]
  m = mask.astype(jnp.float32)
  np.testing.assert_allclose(full, jnp.sum(ce * m) / jnp.sum(m), rtol=1e-6)
  np.testing.assert_allclose(part, full, rtol=1e-6)
  np.testing.assert_allclose(gx_part, gx_full, rtol=1e-5, atol=1e-7)
  a, b = pure(gm_part), pure(gm_full)
  assert a.keys() == b.keys() and a
  for k in a:
    np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7)
  assert np.all(np.asarray(gx_full)[~np.asarray(mask)] == 0)


def test_masked_labels_may_be_anything_and_unmasked_ones_must_fit():
  """Padding labels (the vocabulary size, -100) at masked positions change
  neither the loss nor its gradients; an unmasked one outside the
  vocabulary makes the loss NaN instead of picking another class."""
  head = qlayers.QuantLogits(16, 64, rngs=nnx.Rngs(0))
  x, labels, mask = _lm_loss_inputs(12)
  vg = nnx.value_and_grad(lambda h, y: h.loss(x, y, mask=mask, chunk_size=5))
  want, g_want = vg(head, labels)
  for pad in (64, -100):
    got, g_got = vg(head, jnp.where(mask, labels, pad))
    assert float(got) == float(want)
    np.testing.assert_array_equal(g_got["kernel"][...],
                                  g_want["kernel"][...])
  i = np.argwhere(np.asarray(mask))[0]
  for bad in (64, -1):
    assert np.isnan(float(head.loss(x, labels.at[tuple(i)].set(bad),
                                    mask=mask)))


def test_chunked_loss_memory():
  batch, seq, d, vocab = 1, 512, 16, 4096
  head = qlayers.QuantLogits(d, vocab, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(head)
  x = jnp.zeros((batch, seq, d))
  labels = jnp.zeros((batch, seq), jnp.int32)

  def temp_bytes(chunk_size):
    def f(params, x):
      return nnx.merge(graphdef, params).loss(x, labels, chunk_size=chunk_size)
    c = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(
        params, x).compile()
    return c.memory_analysis().temp_size_in_bytes

  full, chunked = temp_bytes(None), temp_bytes(32)
  logits_bytes = batch * seq * vocab * 4
  assert full >= logits_bytes
  assert chunked < logits_bytes / 4
  assert chunked < full / 8


def test_quantized_chunked_loss_carries_state():
  r = delayed()
  x, labels, mask = _lm_loss_inputs(40)
  out = {}
  for chunk in (None, 8):
    head = qlayers.QuantLogits(16, 64, rngs=nnx.Rngs(0), recipe=r)
    loss, grads = qlayers.value_and_grad(
        lambda h: h.loss(x, labels, chunk_size=chunk, mask=mask))(head)
    out[chunk] = (loss, float(grads["quant"]["g_amax"][...]),
                  float(head.quant.x_amax[...]),
                  float(head.quant.w_amax[...]))
  (l0, g0, x0, w0), (l1, g1, x1, w1) = out[None], out[8]
  assert x0 == x1 == float(jnp.max(jnp.abs(x)))
  assert w0 == w1 > 0
  assert g0 > 0 and abs(g1 - g0) <= 0.05 * g0
  assert abs(float(l1) - float(l0)) <= 0.02 * float(l0)


def test_logits_rank0_input_is_a_type_error():
  """A scalar gets the TypeError nnx.Linear gives, naming the head and the
  shape it expects (it was an IndexError), untied or tied, and in loss."""
  embed = nnx.Embed(50, 16, rngs=nnx.Rngs(0))
  for head in (qlayers.QuantLogits(16, 50, rngs=nnx.Rngs(0)),
               qlayers.QuantLogits(embed=embed, recipe="fp8_current")):
    with pytest.raises(TypeError, match=r"QuantLogits expects inputs of "
                       r"shape \(\.\.\., 16\), got a scalar"):
      head(jnp.float32(1.0))
    with pytest.raises(TypeError, match="got a scalar"):
      head.loss(jnp.float32(1.0), jnp.zeros((), jnp.int32))


def test_wrong_embed_and_chunk_size_are_named():
  with pytest.raises(TypeError, match="embed must be the nnx.Embed"):
    qlayers.QuantLogits(embed=nnx.Linear(4, 8, rngs=nnx.Rngs(0)))
  head = qlayers.QuantLogits(8, 16, rngs=nnx.Rngs(0))
  x, labels = jnp.ones((1, 4, 8)), jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(TypeError, match="chunk_size must be an int"):
    head.loss(x, labels, chunk_size=2.0)
  np.testing.assert_allclose(head.loss(x, labels, chunk_size=np.int64(2)),
                             head.loss(x, labels), rtol=1e-6)
