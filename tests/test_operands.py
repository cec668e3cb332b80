"""qlayers.operands: how each GEMM operand is made from its wide tensor."""

import jax
import jax.numpy as jnp
import numpy as np

import qlayers
from qlayers import scaling as S
from qlayers.dispatch import Operand
from qlayers.operands import operand


def _bits(q):
  return np.asarray(jax.lax.bitcast_convert_type(q.payload, jnp.uint8))


def test_elementwise_copy_equals_the_rows_copy_bit_for_bit():
  """A per-tensor copy of x (..., K) is made of x itself (only the payload
  flattened): the same payload, scale and metadata as a copy of its rows."""
  x = jax.random.normal(jax.random.key(0), (2, 5, 64)) * 3
  spec = S.QuantSpec(format="e4m3", granularity="tensor")
  got = operand(x, Operand(spec, 1))
  want = S.quantize(x.reshape(10, 64), spec, 1)
  np.testing.assert_array_equal(_bits(got), _bits(want))
  assert float(got.scale) == float(want.scale)
  assert (got.axis, got.shape) == (1, (10, 64))


def test_contraction_last_operands_are_quantized_transposed():
  """A packed format quantized along axis 0 is made of the transpose and
  says so; a wide operand is the rows cast to the compute dtype."""
  w = jax.random.normal(jax.random.key(1), (64, 32))
  spec = qlayers.recipe("mxfp4").fprop.rhs
  op = Operand.make(spec, 0)
  assert op.tn
  q = operand(w, op)
  assert q.transposed and q.axis == 1 and q.shape == (32, 64)
  np.testing.assert_array_equal(
      np.asarray(q.payload), np.asarray(S.quantize(w.T, spec, 1).payload))
  wide = operand(jnp.ones((2, 3, 8)), Operand(None, 1), dtype=jnp.bfloat16)
  assert wide.shape == (6, 8) and wide.dtype == jnp.bfloat16


def test_given_amax_sets_the_per_tensor_scale():
  """The delayed amax given is the one the scale comes from (E4M3: the
  dequantization factor amax / 448)."""
  x = jnp.ones((4, 32))
  spec = S.QuantSpec(format="e4m3", granularity="tensor")
  q = operand(x, Operand(spec, 1), amax=jnp.float32(448.0 * 4))
  assert float(q.scale) == 4.0

