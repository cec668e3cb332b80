"""qlayers.operands: how each GEMM operand is made from its wide tensor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_a_gpu_pair_warns_when_several_gpus_have_no_mesh(monkeypatch):
  """The one-pass kernel without a partitioning rule (DeepSeek-V3's
  128 x 128 weight blocks), traced with several GPUs attached and no mesh
  set, says how to keep the program sharded; kernels with a rule
  (`partition.cast`: per tensor, MX, row-wise), one GPU, or no kernel say
  nothing."""
  from qlayers import operands, sharding, table  # noqa: PLC0415
  square = qlayers.recipe("deepseek_v3").fprop.rhs
  t = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)

  def trace(spec, first=None):
    return jax.jit(lambda t: operands.operand_pair(
        t, Operand(spec, 1), first)).trace(t)

  with_rule = [(qlayers.recipe(r).fprop.lhs, second)
               for r, second in (("fp8_current", False), ("mxfp8", True),
                                 ("fp8_rowwise", True))]
  with table.target_arch("sm_90"):
    assert operands.pairable(t, Operand(square, 1))
    trace(square)  # one GPU here: warnings are errors in this suite
    monkeypatch.setattr(sharding, "_several_gpus", lambda: True)
    with pytest.warns(UserWarning, match="jax.set_mesh"):
      trace(square)
  with table.target_arch("sm_100"):
    for spec, second in with_rule:  # partitionable: no warning
      first = Operand(spec, 0) if second else None
      assert operands.pairable(t, Operand(spec, 1), first)
      trace(spec, first)
  trace(square)  # no GPU target: no kernel, no warning
