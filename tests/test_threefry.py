"""qlayers/threefry.py: stochastic rounding's random bytes, eight to a
hash."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import random as jax_random

from qlayers import formats
from qlayers import threefry


def _jax_hash(key, c0, c1):
  """JAX's own Threefry-2x32 of counter words ``(c0, c1)``."""
  k0, k1 = threefry.key_words(key)
  return jax_random.threefry2x32_p.bind(k0, k1, jnp.asarray(c0, jnp.uint32),
                                        jnp.asarray(c1, jnp.uint32))


def _reference(key, size, first=0):
  """The bytes of flat indices ``first .. first + size - 1``, spelled out:
  byte ``i % 8`` of JAX's hash of counter ``i // 8``, low byte of the first
  word first."""
  i = np.arange(first, first + size, dtype=np.uint64)
  counter = i // 8
  x0, x1 = (np.asarray(w, np.uint64) for w in _jax_hash(
      key, (counter >> 32).astype(np.uint32),
      (counter & 0xFFFFFFFF).astype(np.uint32)))
  byte = (i % 8).astype(np.uint64)
  word = np.where(byte < 4, x0, x1)
  return ((word >> ((byte % 4) * 8)) & 0xFF).astype(np.uint32)


def test_hash_is_jax_threefry_bit_for_bit():
  rng = np.random.default_rng(0)
  c0, c1 = (rng.integers(0, 2**32, 1000, dtype=np.uint64).astype(np.uint32)
            for _ in range(2))
  for key in (jax.random.key(0), formats.rounding_key(jnp.uint32(9),
                                                       jnp.uint32(123456))):
    got = jax.jit(threefry.hash_words)(*threefry.key_words(key), c0, c1)
    want = _jax_hash(key, c0, c1)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_counter_words_are_the_64_bit_product_and_sum():
  rng = np.random.default_rng(1)
  row, col = (rng.integers(0, 2**32, 4000, dtype=np.uint64) for _ in range(2))
  for width in (1, 6, 2**16 + 3, 2**32 - 1):
    hi, lo = threefry.counter_words(row.astype(np.uint32),
                                    col.astype(np.uint32), width)
    want = [int(r) * width + int(c) for r, c in zip(row, col)]
    got = [int(h) << 32 | int(l) for h, l in zip(np.asarray(hi),
                                                   np.asarray(lo))]
    assert got == want


@pytest.mark.parametrize("shape", [(7,), (33, 65), (3, 40), (4, 8, 16)])
def test_bytes_are_eight_to_a_hash_at_each_flat_index(shape):
  key = formats.rounding_key(jnp.uint32(3), jnp.uint32(77))
  got = np.asarray(jax.jit(threefry.random_bytes, static_argnums=1)(key,
                                                                    shape))
  np.testing.assert_array_equal(
      got.ravel(), _reference(key, int(np.prod(shape))))


def test_bytes_depend_on_the_flat_index_alone():
  # Any reshape of an array draws the same bits for each element.
  key = jax.random.key(5)
  flat = np.asarray(threefry.random_bytes(key, (1024,)))
  for shape in ((4, 8, 32), (32, 32), (2, 512), (1024, 1), (8, 128)):
    np.testing.assert_array_equal(
        np.asarray(threefry.random_bytes(key, shape)).ravel(), flat)


def test_bytes_at_far_places_carry_into_the_counters_high_word():
  # Rows of a 2**35-element gradient: the counters pass 2**32.
  key = jax.random.key(11)
  width = 2**15  # hashes per row: 2**18 columns
  row = jnp.array([[0], [2**17 - 1], [2**17 + 5]], jnp.uint32)
  col = jnp.array([[width - 2, width - 1]], jnp.uint32)
  got = np.asarray(threefry.bytes_at(*threefry.key_words(key), row, col,
                                     width))
  for r in range(3):
    first = (int(row[r, 0]) * width + int(col[0, 0])) * 8
    np.testing.assert_array_equal(got[r], _reference(key, 16, first))


def test_bytes_are_even_over_their_256_values():
  b = np.asarray(threefry.random_bytes(jax.random.key(2), (512, 512)))
  assert b.dtype == np.uint32 and b.max() < 256
  counts = np.bincount(b.ravel(), minlength=256)
  expected = b.size / 256
  chi2 = ((counts - expected) ** 2 / expected).sum()
  assert chi2 < 350  # 255 degrees of freedom: mean 255, sd 22.6
  # Neighbouring bytes of one hash are unrelated.
  pairs = b.reshape(-1, 8)
  corr = np.corrcoef(pairs.T.astype(np.float64))[np.triu_indices(8, 1)]
  assert np.abs(corr).max() < 0.02  # 32768 draws: |r| ~ 0.006


def test_key_words_of_raw_threefry_and_other_keys():
  raw = jax.random.key_data(jax.random.key(3))
  assert threefry.key_words(raw).tolist() == raw.tolist()
  with jax.default_prng_impl("rbg"):
    rbg = jax.random.key(3)
  words = threefry.key_words(rbg)
  assert words.shape == (2,) and words.dtype == jnp.uint32
  np.testing.assert_array_equal(words, threefry.key_words(rbg))
  with pytest.raises(ValueError, match="two uint32 words"):
    threefry.key_words(jnp.zeros((4,), jnp.uint32))


def test_bytes_refuse_counts_past_32_bit_rows():
  with pytest.raises(ValueError, match="rows of"):
    jax.eval_shape(lambda k: threefry.random_bytes(k, (2**16, 2**16, 8)),
                   jax.random.key(0))


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
  draws = np.asarray(jax.vmap(lambda k: threefry.random_bytes(k, (256,)))(
      keys)).astype(np.float64)
  assert len({d.tobytes() for d in draws}) == 16
  corr = np.corrcoef(draws)[np.triu_indices(16, 1)]
  assert np.abs(corr).max() < 0.3  # 256 draws: |r| of independent ~ 0.06
  with pytest.raises(TypeError, match="integer counters"):
    formats.rounding_key(jnp.float32(1.5), 0)
  with pytest.raises(ValueError, match="one shape"):
    formats.rounding_key(jnp.arange(3, dtype=jnp.uint32), jnp.uint32(0))


def test_eighths_are_the_bytes_of_every_eighth_element():
  """`eighths_at`'s array j holds the byte of element 8c + j, at places
  past 2**32 elements too: the kernels' draws are `random_bytes`'."""
  k0, k1 = threefry.key_words(jax.random.key(11))
  rows = jnp.array([[0], [3], [2**31 + 5]], jnp.uint32)
  cols = jnp.arange(4, dtype=jnp.uint32)[None, :]
  want = np.asarray(threefry.bytes_at(k0, k1, rows, cols, 2**29))
  got = threefry.eighths_at(k0, k1, rows, cols, 2**29)
  assert len(got) == threefry.BYTES
  for j, b in enumerate(got):
    np.testing.assert_array_equal(np.asarray(b), want[:, j::8])
