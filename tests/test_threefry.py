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


def test_rounding_keys_are_the_counters_and_draw_apart():
  # A GEMM's key is its (seed, step) pair itself, for one GEMM or a stack
  # of experts, and whatever the default PRNG implementation.
  keys = jax.vmap(formats.rounding_key)(
      jnp.repeat(jnp.arange(4, dtype=jnp.uint32), 4),
      jnp.tile(jnp.arange(4, dtype=jnp.uint32), 4))
  np.testing.assert_array_equal(
      np.asarray(jax.random.key_data(keys)),
      np.stack([np.repeat(np.arange(4), 4), np.tile(np.arange(4), 4)], 1))
  with jax.default_prng_impl("rbg"):
    assert threefry.key_words(formats.rounding_key(1, 2)).tolist() == [1, 2]
  # Neighbouring seeds and steps draw unrelated uniforms.
  draws = np.asarray(jax.vmap(lambda k: jax.random.uniform(k, (256,)))(keys))
  assert len({d.tobytes() for d in draws}) == 16
  corr = np.corrcoef(draws)[np.triu_indices(16, 1)]
  assert np.abs(corr).max() < 0.3  # 256 draws: |r| of independent ~ 0.06
  with pytest.raises(TypeError, match="integer counters"):
    formats.rounding_key(jnp.float32(1.5), 0)
  with pytest.raises(ValueError, match="one shape"):
    formats.rounding_key(jnp.arange(3, dtype=jnp.uint32), jnp.uint32(0))
