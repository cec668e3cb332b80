"""A kernel's elements held apart: one array per element along the last
axis, so that a block's amax, Hadamard transform and words run in one
thread's registers with no exchanges across lanes (the FP6 and 4-bit
kernels). Triton has no strided slices: splits and joins of a trailing
axis of 2 stand in for them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qlayers import hadamard as hadamard_lib


def pairs_last(x):
  """``x (..., 2m)`` as its even and odd elements along the last axis, each
  ``(..., m)`` (a split of a trailing axis of 2: Triton has no strided
  slices)."""
  pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
  return tuple(p[..., 0] for p in jnp.split(pairs, 2, axis=-1))


def quarters_last(x):
  """``x (..., 4m)`` as the four ``(..., m)`` arrays of its elements ``4i +
  j``, ``j = 0..3`` in turn."""
  even, odd = pairs_last(x)
  (e0, e2), (e1, e3) = pairs_last(even), pairs_last(odd)
  return [e0, e1, e2, e3]


def split_last(x):
  """``x (..., n)`` as its ``n`` elements along the last axis, each an
  ``(..., 1)``-less array, in order (halvings of the trailing axis)."""
  parts = [x]
  while parts[0].shape[-1] > 1:
    parts = [half for p in parts for half in pairs_last(p)]
  n = x.shape[-1]
  bits = n.bit_length() - 1  # part k holds element k's bits reversed
  return [parts[int(f"{j:0{bits}b}"[::-1], 2)][..., 0] for j in range(n)]


def join_last(parts):
  """``n`` arrays (a power of two) -> ``(..., n)``, ``parts[j]`` at ``j``,
  by joins of pairs (the inverse of `split_last`)."""
  parts = [p[..., None] for p in parts]
  while len(parts) > 1:
    parts = [jnp.swapaxes(jnp.stack(parts[k:k + 2], axis=-1), -1, -2
                          ).reshape(*parts[k].shape[:-1], -1)
             for k in range(0, len(parts), 2)]
  return parts[0]


def words_to_bytes(words):
  """uint32 ``(..., m)`` -> its little-endian bytes ``(..., 4m)`` (in XLA,
  a view)."""
  b = jax.lax.bitcast_convert_type(words, jnp.uint8)
  return b.reshape(*words.shape[:-1], 4 * words.shape[-1])


def zero_where_nan_scale(payload, mult):
  """``payload`` with zeros in the blocks whose multiplier ``mult`` (one per
  row, broadcasting) is 0: those with a NaN scale (`qlayers.scaling`'s
  packed payloads hold zeros there)."""
  return jnp.where(mult == 0, jnp.zeros((), payload.dtype), payload)


def lane_groups_max(x, size: int):
  """The max of each ``size`` consecutive elements of 1-D ``x`` (a kernel's
  lanes), in each of them."""
  n = x.shape[0]
  m = jnp.max(x.reshape(n // size, size), axis=1, keepdims=True)
  return jnp.broadcast_to(m, (n // size, size)).reshape(n)


def transform_parts(parts, size: int, norm: bool = True):
  """`qlayers.hadamard.transform` over each ``size`` consecutive arrays of
  the list ``parts`` (a kernel's elements apart, `split_last`): the
  signs, `qlayers.hadamard.butterfly`'s stages (the same pairs and sums,
  in registers) and, with ``norm``, the factor."""
  signs = hadamard_lib.random_signs(size)
  factor = hadamard_lib.norm(size)
  out = []
  for start in range(0, len(parts), size):
    block = [-p if sign < 0 else p
             for p, sign in zip(parts[start:start + size], signs)]
    h = size // 2
    while h:
      for g in range(0, size, 2 * h):
        for i in range(g, g + h):
          block[i], block[i + h] = block[i] + block[i + h], block[i] - block[i + h]
      h //= 2
    out += [p * factor for p in block] if norm else block
  return out
