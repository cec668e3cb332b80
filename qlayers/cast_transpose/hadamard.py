"""The Hadamard transform alone in one pass, for the recipes whose
transformed operands XLA quantizes (`transform`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from qlayers import hadamard as hadamard_lib
from qlayers import partition
from qlayers.cast_transpose import _base
from qlayers.cast_transpose.nvfp4 import NV_BLOCK

__all__ = ["transform_supported", "transform"]


def _butterfly_last(y):
  """`qlayers.hadamard.butterfly` along the last axis (16) of a kernel's
  array, with the same pairs and order of additions: each stage pairs
  elements ``r`` and ``r + 8`` and writes their sum and difference to
  ``2r`` and ``2r + 1``, so after the four stages (the pairs ``h = 8, 4,
  2, 1`` apart of the in-place transform, in turn) each element is back in
  its place. Splits and joins of a trailing axis of 2 are what Triton has
  instead of slices."""
  lead, n = y.shape[:-1], y.shape[-1]
  for _ in range(n.bit_length() - 1):
    pairs = jnp.swapaxes(y.reshape(*lead, 2, n // 2), -1, -2)
    a, b = (p[..., 0] for p in jnp.split(pairs, 2, axis=-1))
    y = jnp.stack([a + b, a - b], axis=-1).reshape(*lead, n)
  return y


def _signs_last(shape):
  """`qlayers.hadamard.random_signs` (of the last axis' length) along the
  last axis of ``shape``, from an iota and a 32-bit mask per 32 signs (a
  kernel has no array constants)."""
  negative = hadamard_lib.random_signs(shape[-1]) < 0
  k = jax.lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1)
  flip = jnp.zeros(shape, jnp.uint32)
  for word in range(0, shape[-1], 32):
    mask = sum(1 << i for i, neg in enumerate(negative[word:word + 32])
               if neg)
    bits = (jnp.uint32(mask) >> ((k - word) & 31)) & 1
    flip = jnp.where((k >= word) & (k < word + 32), bits, flip)
  return 1.0 - 2.0 * flip.astype(jnp.float32)


def _transform_last(y):
  """`qlayers.hadamard.transform` along the last axis of a kernel's FP32
  array: the signs, the butterfly, the factor."""
  size = y.shape[-1]
  return _butterfly_last(y * _signs_last(y.shape)) * hadamard_lib.norm(size)


def transform_supported(shape: tuple[int, ...], size: int, axis: int
                        ) -> bool:
  """Whether `transform` takes a ``shape`` tensor: 2-D, the transformed
  axis a multiple of ``size`` (one of `qlayers.hadamard.SIZES`), the other
  (axis 0) a multiple of 16."""
  return (len(shape) == 2 and axis in (0, 1) and size in hadamard_lib.SIZES
          and shape[axis] % size == 0
          and (axis == 1 or shape[1] % NV_BLOCK == 0))


def _transform_kernel(t_ref, o_ref, *, axis: int):
  v = t_ref[...].astype(jnp.float32)
  if axis == 1:
    o_ref[...] = _transform_last(v)
  else:  # [g, k, c]: the transformed axis made the last one and back
    o_ref[...] = jnp.transpose(
        _transform_last(jnp.transpose(v, (0, 2, 1))), (0, 2, 1))


@functools.partial(jax.jit, static_argnames=("size", "axis", "interpret"))
def transform(t: jax.Array, size: int, axis: int = 0, *,
              interpret: bool = False) -> jax.Array:
  """`qlayers.hadamard.transform` of ``t`` in one pass, bit for bit: FP32
  ``Q t`` along ``axis``. XLA writes each stage of the butterfly to memory
  (it will not fuse one into the next: every output would recompute its
  whole tree), so on NVIDIA GPUs the transformed operand of a recipe's
  Hadamard GEMMs is this kernel's, read once and written once.

  Example:
    >>> import jax.numpy as jnp
    >>> from qlayers import hadamard
    >>> t = jnp.arange(64.0 * 32).reshape(64, 32)
    >>> bool((transform(t, 32, interpret=True)
    ...       == hadamard.transform(t, 32)).all())
    True
  """
  if not transform_supported(t.shape, size, axis):
    raise ValueError(f"transform takes a 2-D tensor whose axis {axis} is a "
                     f"multiple of {size} (a size of "
                     f"{hadamard_lib.SIZES}) and, for axis 0, whose columns "
                     f"are a multiple of {NV_BLOCK}; got {t.shape}.")
  # Each device transforms its shard: whole blocks of ``size`` along the
  # axis, whole tiles of 16 across it for axis 0.
  block = (size, NV_BLOCK) if axis == 0 else (1, size)
  return partition.cast(_transform_call, (size, axis, interpret), t,
                        layouts=(partition.LIKE_T,), block=block)[0]


def _transform_call(shape: tuple[int, int], size: int, axis: int,
                    interpret: bool):
  """`transform`'s kernel for a ``shape`` tensor."""
  pl, plt = _base.pallas()
  rows, cols = shape
  if axis == 1:
    rt = math.gcd(rows, max(1, 1024 // size))
    spec = pl.BlockSpec((rt, size), lambda i, j: (i, j))
    grid = (rows // rt, cols // size)
    view = lambda t: t  # noqa: E731
    view_shape = shape
  else:
    n = math.gcd(rows // size, max(1, 256 // size))
    spec = pl.BlockSpec((n, size, NV_BLOCK), lambda i, j: (i, 0, j))
    grid = (rows // (n * size), cols // NV_BLOCK)
    view = lambda t: t.reshape(rows // size, size, cols)  # noqa: E731
    view_shape = (rows // size, size, cols)
  call = pl.pallas_call(
      functools.partial(_transform_kernel, axis=axis), grid=grid,
      in_specs=[spec], out_specs=spec,
      out_shape=jax.ShapeDtypeStruct(view_shape, jnp.float32),
      compiler_params=plt.CompilerParams(num_warps=4),
      interpret=interpret, name="qlayers_hadamard_transform")
  return lambda t: (call(view(t)).reshape(rows, cols),)
