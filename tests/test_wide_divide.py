"""The FP64 route of the correctly rounded FP32 division
(qlayers.wide_divide): special values, transforms, refused numerators.
Every significand is compared with NumPy's IEEE FP32 division in
tests/test_scale_rules.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qlayers.wide_divide import rdivide_wide


def test_special_and_random_divisors_match_ieee_fp32():
  """Random bit patterns (normal ones: XLA on CPU reads subnormals as zero)
  and the special values give NumPy's FP32 quotient bit for bit."""
  bits = np.random.default_rng(0).integers(0, 2**32, 200_000, np.uint64)
  b = bits.astype(np.uint32).view(np.float32)
  b = b[(np.abs(b) >= 2.0**-126) | ~np.isfinite(b)]
  b = np.concatenate([b, np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -3.0,
                                   2.0**127, 448.0], np.float32)])
  for numerator in (1.0, 448.0, 57344.0, 2688.0):
    got = np.asarray(jax.jit(lambda v, n=numerator: rdivide_wide(n, v))(b))
    with np.errstate(all="ignore"):
      want = np.float32(numerator) / b
    keep = np.abs(want) >= 2.0**-126  # CPU flushes subnormal quotients
    keep |= ~np.isfinite(want) | (want == 0)
    np.testing.assert_array_equal(got[keep].view(np.uint32),
                                  want[keep].view(np.uint32))


def test_vmap_and_grad():
  b = jnp.array([2.0, 4.0, 7.0], jnp.float32)
  np.testing.assert_array_equal(jax.vmap(lambda v: rdivide_wide(448.0, v))(b),
                                np.float32(448.0) / np.asarray(b))
  grad = jax.grad(lambda v: rdivide_wide(2.0, v))(jnp.float32(4.0))
  assert float(grad) == -0.125


def test_refuses_what_it_cannot_divide_exactly():
  with pytest.raises(ValueError, match="odd part is below 128.*255"):
    rdivide_wide(255.0, jnp.ones(2))
  with pytest.raises(ValueError, match="finite numerator >= 1, got 0.5"):
    rdivide_wide(0.5, jnp.ones(2))
  with pytest.raises(TypeError, match="divides float32, got bfloat16"):
    rdivide_wide(448.0, jnp.ones(2, jnp.bfloat16))


def test_keeps_the_manual_axes_it_varies_over():
  """Under shard_map the quotient varies over the operand's mesh axes, as
  the CPU branch's plain division does (the branches' types must match)."""
  from jax.sharding import AxisType, PartitionSpec as P
  from qlayers import scale_rules
  mesh = jax.make_mesh((1,), ("d",), axis_types=(AxisType.Auto,))
  b = jnp.arange(1.0, 9.0, dtype=jnp.float32).reshape(8, 1)
  got = jax.jit(jax.shard_map(lambda v: scale_rules.rdivide_rn(448.0, v),
                              mesh=mesh, in_specs=P("d"), out_specs=P("d")))(b)
  np.testing.assert_array_equal(np.asarray(got), np.float32(448.0) / b)
