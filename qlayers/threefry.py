"""JAX's uniform numbers as elementwise arithmetic a GPU kernel can run.

Stochastic rounding draws ``jax.random.uniform(key, shape)``: with JAX's
partitionable Threefry (``jax_threefry_partitionable``, the default), the
number at flat index ``i`` of ``shape`` is Threefry-2x32 of the key and the
counter ``(i >> 32, i & 0xFFFFFFFF)``, its two output words XORed, the top
23 bits made a float in [1, 2), minus one. `uniform_at` computes exactly
that from ``i`` with uint32 adds, rotations and XORs, so a Pallas kernel
(`qlayers.cast_transpose`) rounds with the bits `qlayers.formats` draws,
without a random-bits array in memory. The rotation distances and the key
schedule are Threefry-2x32's with 20 rounds (Salmon et al., "Parallel
random numbers: as easy as 1, 2, 3", SC 2011), as JAX implements it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["key_words", "uniform_at"]

# Threefry-2x32's rotation distances, alternating in groups of four rounds,
# and its key-schedule parity constant.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


def key_words(key: jax.Array) -> jax.Array:
  """The two uint32 words of a Threefry PRNG ``key`` (typed or raw).

  Example:
    >>> key_words(jax.random.key(0)).shape
    (2,)
  """
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  if key.shape != (2,) or key.dtype != jnp.uint32:
    raise ValueError(f"A Threefry-2x32 key is two uint32 words; got "
                     f"{key.dtype}{list(key.shape)}.")
  return key


def _rotl(x, d: int):
  return (x << jnp.uint32(d)) | (x >> jnp.uint32(32 - d))


def uniform_at(k0, k1, index) -> jax.Array:
  """``jax.random.uniform(key, shape).ravel()[index]`` for uint32 flat
  ``index`` (arrays of fewer than 2**32 elements) and key words ``k0, k1``
  (`key_words`): FP32 in [0, 1).

  Example:
    >>> key = jax.random.key(7)
    >>> k0, k1 = key_words(key)
    >>> u = uniform_at(k0, k1, jnp.arange(12, dtype=jnp.uint32))
    >>> bool((u == jax.random.uniform(key, (3, 4)).ravel()).all())
    True
  """
  k0, k1 = jnp.asarray(k0, jnp.uint32), jnp.asarray(k1, jnp.uint32)
  ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(_PARITY))
  index = jnp.asarray(index, jnp.uint32)
  x0, x1 = jnp.zeros_like(index) + ks[0], index + ks[1]  # counter (0, i)
  for group in range(5):
    for r in _ROTATIONS[group % 2]:
      x0 = x0 + x1
      x1 = _rotl(x1, r) ^ x0
    x0 = x0 + ks[(group + 1) % 3]
    x1 = x1 + ks[(group + 2) % 3] + jnp.uint32(group + 1)
  bits = ((x0 ^ x1) >> jnp.uint32(9)) | jnp.uint32(0x3F800000)
  return jax.lax.bitcast_convert_type(bits, jnp.float32) - jnp.float32(1.0)
