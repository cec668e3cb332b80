"""Stochastic rounding's random bytes, eight to a Threefry-2x32 hash, as
elementwise arithmetic that XLA and a GPU kernel run alike.

The element at flat index ``i`` of an array draws byte ``i % 8`` of the
Threefry-2x32 hash of the key and the 64-bit counter ``i // 8`` (bytes 0-3:
the first output word's, low byte first; 4-7: the second's), and its
magnitude rounds up when its fraction of a grid step plus ``(byte + 1/2) /
256`` reaches one (`qlayers.formats.round_on_grid`). `random_bytes` draws
them for a whole array (the XLA path of `qlayers.formats.round_to_format`,
through `bytes_at`); `eighths_at` for the elements a kernel holds, eight
arrays to a hash (`qlayers.cast_transpose`), so the kernel rounds with the
bits XLA would draw, without a random-bits array in memory.

Eight bits per element is what Blackwell's own stochastic conversions take
(PTX ``cvt.rs.satfinite`` to FP8/FP6/FP4 vectors: one 32-bit word of random
bits per four values; PTX ISA 8.7), and one hash for eight elements is an
eighth of the integer work of a hash per element (`jax.random.uniform`'s).
The half step centres the 256 levels: a value rounds up with probability
within 1/512 of its distance from the grid point below (over the spacing),
and exactly that on average over its position between two grid points.

The hash is Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC 2011), its rotation distances and key
schedule as JAX implements them (`jax.extend.random.threefry2x32_p`); the
counter makes the bits a function of the element's place alone, so any
layout, shard or reshape of an array draws the same bits for it (inside
``jax.shard_map`` a device sees only its part, numbered from 0: there
`qlayers.operands` folds the device's index into the key instead).
"""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp

__all__ = ["BYTES", "key_words", "hash_words", "hash_bytes", "counter_words",
           "eighths_at", "bytes_at", "random_bytes"]

# Elements per hash: one byte each of its two 32-bit output words.
BYTES = 8

# Threefry-2x32's rotation distances, alternating in groups of four rounds,
# and its key-schedule parity constant.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


def key_words(key: jax.Array) -> jax.Array:
  """The two uint32 words of a Threefry PRNG ``key`` (typed or raw). A typed
  key of another implementation (``rbg``) gives the two words it draws.

  Example:
    >>> key_words(jax.random.key(0)).shape
    (2,)
  """
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    data = jax.random.key_data(key)
    if data.shape != (2,):
      return jax.random.bits(key, (2,), jnp.uint32)
    key = data
  if key.shape != (2,) or key.dtype != jnp.uint32:
    raise ValueError(f"A Threefry-2x32 key is two uint32 words; got "
                     f"{key.dtype}{list(key.shape)}.")
  return key


def _rotl(x, d: int):
  return (x << jnp.uint32(d)) | (x >> jnp.uint32(32 - d))


def hash_words(k0, k1, c0, c1, rotl=None) -> tuple[jax.Array, jax.Array]:
  """Threefry-2x32 (20 rounds) of the counter words ``(c0, c1)`` under the
  key words ``(k0, k1)``, elementwise: its two output words. ``rotl(x,
  d)``: how a GPU kernel rotates a word left by ``d`` bits (None: two
  shifts and an or).

  Example:
    >>> x0, x1 = hash_words(jnp.uint32(0), jnp.uint32(0), jnp.uint32(0),
    ...                     jnp.uint32(0))
    >>> hex(int(x0)), hex(int(x1))  # the paper's known-answer test
    ('0x6b200159', '0x99ba4efe')
  """
  rotl = rotl or _rotl
  k0, k1 = jnp.asarray(k0, jnp.uint32), jnp.asarray(k1, jnp.uint32)
  ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(_PARITY))
  x0 = jnp.asarray(c0, jnp.uint32) + ks[0]
  x1 = jnp.asarray(c1, jnp.uint32) + ks[1]
  for group in range(5):
    for r in _ROTATIONS[group % 2]:
      x0 = x0 + x1
      x1 = rotl(x1, r) ^ x0
    x0 = x0 + ks[(group + 1) % 3]
    x1 = x1 + (ks[(group + 2) % 3] + jnp.uint32(group + 1))  # one key word
  return x0, x1


def _mul_wide(a, b) -> tuple[jax.Array, jax.Array]:
  """The 64-bit product of uint32 ``a`` and ``b`` as ``(high, low)`` words,
  from 16-bit halves (no 64-bit integers needed)."""
  half = jnp.uint32(0xFFFF)
  a_lo, a_hi, b_lo, b_hi = a & half, a >> 16, b & half, b >> 16
  low = a_lo * b_lo
  mid = a_lo * b_hi
  mid2 = mid + a_hi * b_lo
  mid_carry = (mid2 < mid).astype(jnp.uint32)
  out_lo = low + (mid2 << 16)
  carry = (out_lo < low).astype(jnp.uint32)
  out_hi = a_hi * b_hi + (mid2 >> 16) + (mid_carry << 16) + carry
  return out_hi, out_lo


def counter_words(row, col, width) -> tuple[jax.Array, jax.Array]:
  """``row * width + col`` (uint32 operands) as a 64-bit counter's ``(high,
  low)`` words: the hash counter of row ``row`` and column ``col`` of an
  array whose rows hold ``width`` hashes.

  Example:
    >>> hi, lo = counter_words(jnp.uint32(2**31), jnp.uint32(5), 6)
    >>> int(hi) * 2**32 + int(lo) == 2**31 * 6 + 5
    True
  """
  row, col = jnp.asarray(row, jnp.uint32), jnp.asarray(col, jnp.uint32)
  hi, lo = _mul_wide(row, jnp.asarray(width, jnp.uint32))
  out_lo = lo + col
  return hi + (out_lo < lo).astype(jnp.uint32), out_lo


def hash_bytes(x0, x1) -> list[jax.Array]:
  """The eight bytes (uint32) of hash words ``x0, x1`` in the element order
  of the module docstring: ``x0``'s from its low byte, then ``x1``'s.

  Example:
    >>> [int(b) for b in hash_bytes(jnp.uint32(0x04030201), jnp.uint32(5))]
    [1, 2, 3, 4, 5, 0, 0, 0]
  """
  return [(word >> jnp.uint32(8 * k)) & jnp.uint32(0xFF)
          for word in (x0, x1) for k in range(4)]


def _spread(x0, x1) -> jax.Array:
  """Hash words ``(..., m)`` -> their bytes ``(..., 8 m)`` (uint32), in the
  element order of the module docstring: `hash_bytes` interleaved, by
  selects (a kernel joins only two arrays at a time)."""
  shape = x0.shape[:-1] + (x0.shape[-1], BYTES)
  byte = jax.lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1)
  word = jnp.where(byte < 4, x0[..., None], x1[..., None])
  bits = (word >> ((byte & 3) * 8)) & jnp.uint32(0xFF)
  return bits.reshape(x0.shape[:-1] + (x0.shape[-1] * BYTES,))


def eighths_at(k0, k1, row, col, width, rotl=None) -> list[jax.Array]:
  """`bytes_at` as eight arrays shaped as ``row`` and ``col`` broadcast:
  the ``j``-th holds the bytes of the elements ``8 col + j`` (`hash_bytes`
  of their hashes), as a kernel that splits its rows in eighths takes them
  (``rotl``: `hash_words`').

  Example:
    >>> key = jax.random.key(7)
    >>> cols = jnp.arange(2, dtype=jnp.uint32)
    >>> eighths = eighths_at(*key_words(key), jnp.uint32(0), cols, 2)
    >>> want = bytes_at(*key_words(key), jnp.uint32(0), cols, 2)
    >>> bool((eighths[3] == want[3::8]).all())
    True
  """
  return hash_bytes(*hash_words(k0, k1, *counter_words(row, col, width),
                                rotl=rotl))


def bytes_at(k0, k1, row, col, width) -> jax.Array:
  """The random bytes of the elements ``8 col`` to ``8 col + 7`` of row
  ``row`` of a 2-D array of ``8 width`` columns, under key words ``k0, k1``
  (`key_words`): for ``row, col`` of shape ``(..., m)``, a uint32 array
  ``(..., 8 m)`` in [0, 256), what `random_bytes` draws there.

  Example:
    >>> key = jax.random.key(7)
    >>> rows = jax.lax.broadcasted_iota(jnp.uint32, (3, 2), 0)
    >>> cols = jax.lax.broadcasted_iota(jnp.uint32, (3, 2), 1)
    >>> b = bytes_at(*key_words(key), rows, cols, 2)
    >>> bool((b == random_bytes(key, (3, 16))).all())
    True
  """
  return _spread(*hash_words(k0, k1, *counter_words(row, col, width)))


def random_bytes(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Stochastic rounding's random bytes (uint32 in [0, 256)) for an array
  of ``shape`` under a PRNG ``key`` (module docstring): byte ``i % 8`` of
  the hash of counter ``i // 8`` for the element at flat index ``i``. Drawn
  along the last axis, so each shard of an array sharded by its rows or
  its columns draws its own.

  Example:
    >>> b = random_bytes(jax.random.key(0), (4, 32))
    >>> b.shape, b.dtype, bool((b < 256).all())
    ((4, 32), dtype('uint32'), True)
  """
  try:
    shape = tuple(operator.index(d) for d in shape)
  except TypeError:
    raise ValueError(
        f"Stochastic rounding draws its bits by each element's place, which "
        f"needs concrete shapes; got {tuple(shape)} (a symbolic dim, from "
        f"jax.export?). Export the training step with concrete shapes, or "
        f"use a recipe that rounds to nearest.") from None
  k0, k1 = key_words(key)
  size = math.prod(shape)
  if not shape or shape[-1] % BYTES:  # the flat array, padded to 8s
    width = -(-size // BYTES)
    if width >= 2**32:
      raise ValueError(f"random_bytes counts {shape} in 32-bit columns; "
                       f"reshape "
                       f"its last axis to a multiple of {BYTES}.")
    col = jnp.arange(width, dtype=jnp.uint32)
    return bytes_at(k0, k1, jnp.uint32(0), col, width)[:size].reshape(shape)
  lead = shape[:-1]
  if math.prod(lead) >= 2**32:
    raise ValueError(f"random_bytes counts the rows of {shape} in 32 bits; "
                     f"got {math.prod(lead)} rows.")
  width = shape[-1] // BYTES
  grid = lead + (width,)
  row = jnp.zeros(grid, jnp.uint32)
  for axis, d in enumerate(lead):  # the flat row index, from the axes' iotas
    row = row * jnp.uint32(d) + jax.lax.broadcasted_iota(jnp.uint32, grid,
                                                         axis)
  col = jax.lax.broadcasted_iota(jnp.uint32, grid, len(grid) - 1)
  return bytes_at(k0, k1, row, col, width)
