"""qlayers/threefry.py: JAX's partitionable Threefry uniforms, elementwise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qlayers import formats
from qlayers import threefry


@pytest.mark.parametrize("shape", [(7,), (33, 65), (4, 8, 16)])
def test_uniform_at_is_jax_random_uniform_bit_for_bit(shape):
  size = int(np.prod(shape))
  for key in (jax.random.key(0), formats.rounding_key(jnp.uint32(9),
                                                       jnp.uint32(123456))):
    k0, k1 = threefry.key_words(key)
    got = jax.jit(threefry.uniform_at)(
        k0, k1, jnp.arange(size, dtype=jnp.uint32)).reshape(shape)
    want = jax.random.uniform(key, shape, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                  np.asarray(want).view(np.uint32))


def test_uniform_at_a_far_index_and_raw_key_words():
  key = jax.random.key(3)
  raw = jax.random.key_data(key)
  i = jnp.uint32(300_001)  # one entry of an array, alone
  got = threefry.uniform_at(*threefry.key_words(raw), i)
  bits = jax.random.bits(key, (300_002,), jnp.uint32)[-1]
  want = jax.lax.bitcast_convert_type((bits >> 9) | 0x3F800000,
                                      jnp.float32) - 1.0
  assert got == want


def test_key_words_refuses_other_keys():
  with pytest.raises(ValueError, match="two uint32 words"):
    threefry.key_words(jnp.zeros((4,), jnp.uint32))
