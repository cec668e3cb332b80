"""qlayers.sharding on one device: the gather switch."""

import jax
import jax.numpy as jnp

from qlayers import sharding


def test_gather_switch_is_part_of_the_jit_cache_key():
  """A step jitted with the payload gathers on retraces under
  gather_payloads(False) instead of silently reusing the first trace."""
  step = jax.jit(lambda x: x + (1.0 if sharding.quantized_gather() else 2.0))
  x = jnp.zeros(())
  assert float(step(x)) == 1.0
  with sharding.gather_payloads(False):
    assert float(step(x)) == 2.0
  assert float(step(x)) == 1.0

