"""Scaling units: the block grid of a granularity, and max |x| over each unit.

A *unit* is what one scale covers, along the quantization axis ``axis`` (the
contraction axis of the GEMM that consumes the tensor):

* ``tensor``: the whole tensor (no grid: `block_shape` is ``None``).
* ``row``: one slice along ``axis`` (per row of a GEMM operand).
* ``tile``: 1 x ``block_size`` along ``axis`` (DeepSeek-V3 activations).
* ``block``: ``block_size`` x ``block_size`` over ``axis`` and the other of
  the two trailing dims (DeepSeek-V3 weights).
* ``mx``: ``block_size`` (32) along ``axis`` (OCP MX).

Shapes that are not multiples of the grid are padded with zeros up to it
(`padded_shape`, `pad_to`); scales are kept-dims grids, one entry per block.

Every amax is an integer max of the magnitude bits, in which a NaN ranks
above +Inf and is read back as +Inf (a float max on XLA:CPU can drop a NaN;
see `_max_magnitude`), so a unit holding Inf or NaN has amax +Inf.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from qlayers import sharding


__all__ = ["normalize_axis", "block_shape", "padded_shape", "pad_to",
           "apply_blocks", "block_amax", "amax"]


def normalize_axis(axis: int, ndim: int) -> int:
  """``axis`` in ``[0, ndim)``; ValueError naming it when out of range.

  Example:
    >>> normalize_axis(-1, 3)
    2
  """
  if not -ndim <= axis < ndim:
    raise ValueError(f"axis {axis} out of range for a rank-{ndim} tensor.")
  return axis % ndim


def block_shape(shape: tuple[int, ...], spec,
                axis: int) -> tuple[int, ...] | None:
  """Per-dim block lengths of the scale grid of ``spec`` (a
  `qlayers.scaling.QuantSpec`) on ``shape``.

  Example:
    >>> from qlayers.scaling import QuantSpec
    >>> block_shape((256, 384), QuantSpec(granularity="block"), 1)
    (128, 128)
    >>> block_shape((4, 64), QuantSpec(granularity="mx"), 1)
    (1, 32)
  """
  ndim = len(shape)
  if spec.granularity == "tensor":
    return None
  block = [1] * ndim
  if spec.granularity == "row":
    block[axis] = max(shape[axis], 1)  # an empty row: one (empty) block
    return tuple(block)
  block[axis] = spec.block_size
  if spec.granularity == "block":
    if ndim < 2 or axis < ndim - 2:
      raise ValueError(
          "128x128 block scaling needs the quantization axis to be one of "
          f"the two trailing dims; got axis {axis} of shape {shape}.")
    other = ndim - 2 if axis == ndim - 1 else ndim - 1
    block[other] = spec.block_size
  return tuple(block)


def padded_shape(shape, block):
  """``shape`` rounded up to whole blocks of ``block``.

  Example:
    >>> padded_shape((5, 70), (1, 32))
    (5, 96)
  """
  return tuple(-(-n // b) * b for n, b in zip(shape, block))


def _split_blocks(x: jax.Array, block: tuple[int, ...]) -> jax.Array:
  """(n0*b0, n1*b1, ...) -> (n0, b0, n1, b1, ...), leaving dims with b == 1
  unsplit (size-1 dims give XLA layouts it relays out element by element).
  One dim per reshape: JAX infers the sharding of a reshape that splits
  one dim of an array sharded over explicit mesh axes, not of one that
  splits two (a frozen kernel's 16 x 16 or 128 x 128 blocks)."""
  at = 0
  for n, b in zip(x.shape, block):
    if b != 1:
      x = x.reshape(*x.shape[:at], n // b, b, *x.shape[at + 1:])
      at += 1
    at += 1
  return x


def _merge_blocks(x: jax.Array, block: tuple[int, ...]) -> jax.Array:
  """`_split_blocks`' inverse, one dim per reshape as it splits them."""
  at = 0
  for b in block:
    if b != 1:
      x = x.reshape(*x.shape[:at], x.shape[at] * b, *x.shape[at + 2:])
    at += 1
  return x


def _block_axes(block: tuple[int, ...]) -> tuple[int, ...]:
  """Axes of `_split_blocks`' output that run within a block."""
  axes, i = [], 0
  for b in block:
    if b != 1:
      axes.append(i + 1)
    i += 1 if b == 1 else 2
  return tuple(axes)


def apply_blocks(values, scale, block, op):
  """op(values, scale) with one scale per block; values in padded shape.

  Example:
    >>> import jax.numpy as jnp
    >>> apply_blocks(jnp.ones((1, 4)), jnp.array([[2.0, 3.0]]), (1, 2),
    ...              jnp.multiply)
    Array([[2., 2., 3., 3.]], dtype=float32)
  """
  split = _split_blocks(values, block)
  s, at = scale, 0
  for b in block:  # a size-1 dim after each split one
    if b != 1:
      s = jnp.expand_dims(s, at + 1)
      at += 1
    at += 1
  return _merge_blocks(op(split, s), block)


def block_amax(x: jax.Array, block: tuple[int, ...]) -> jax.Array:
  """max |x| per block, as a kept-dims grid in ``x``'s dtype (FP32 below 16
  bits); +Inf for a block holding Inf or NaN. ``x`` in padded shape.

  Example:
    >>> import jax.numpy as jnp
    >>> block_amax(jnp.arange(-4.0, 4.0).reshape(2, 4), (1, 2))
    Array([[4., 2.],
           [1., 3.]], dtype=float32)
  """
  return _max_magnitude(_split_blocks(x, block), _block_axes(block))


def pad_to(x: jax.Array, padded: tuple[int, ...]) -> jax.Array:
  """``x`` zero-padded at the end of each dim up to ``padded``.

  Example:
    >>> import jax.numpy as jnp
    >>> pad_to(jnp.ones((1, 2)), (1, 4))
    Array([[1., 1., 0., 0.]], dtype=float32)
  """
  if padded == x.shape:
    return x
  return jnp.pad(x, [(0, p - n) for n, p in zip(x.shape, padded)])


def magnitude_bits(x: jax.Array) -> jax.Array:
  """The bits of ``|x|`` as unsigned integers (same width as ``x``).

  For non-negative IEEE floats the order of the bit patterns as unsigned
  integers is the order of the values, and every NaN (exponent all ones,
  mantissa non-zero) lies above +Inf: an integer max of these is the bits
  of max |x|, or a NaN pattern, which `amax_from_bits` maps to +Inf.
  """
  utype = np.dtype(f"uint{np.dtype(x.dtype).itemsize * 8}")
  sign = 1 << (utype.itemsize * 8 - 1)
  return jax.lax.bitcast_convert_type(x, utype) & utype.type(sign - 1)


def amax_from_bits(top: jax.Array, dtype) -> jax.Array:
  """Reduced `magnitude_bits` as ``dtype`` values, NaN patterns as +Inf."""
  inf = np.array(np.inf, dtype).view(top.dtype)
  return jax.lax.bitcast_convert_type(jnp.minimum(top, inf), dtype)


def max_of_bits(mags: jax.Array, dtype, axis=None) -> jax.Array:
  """`amax_from_bits` of the max of ``mags`` over ``axis``, NaN patterns
  clamped to +Inf before the max (the same result: the clamp is monotone),
  so that on XLA:GPU the clamp is part of the reduction's kernel rather
  than a kernel of its own after it."""
  inf = np.array(np.inf, dtype).view(mags.dtype)
  return jax.lax.bitcast_convert_type(
      jnp.max(jnp.minimum(mags, inf), axis=axis), dtype)


def _chunk(n: int) -> int:
  """The largest divisor of ``n`` that is at most 32 (1 for an empty dim)."""
  return next((k for k in range(min(n, 32), 0, -1) if n % k == 0), 1)


def _max_magnitude(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
  """max |x| over ``axes``, in ``x``'s dtype (FP32 for formats under 16
  bits, which have no Inf); +Inf where the reduced values hold Inf or NaN.

  No float comparison reads ``x``: XLA:CPU's vectorized float max reduction
  drops a NaN of an FP32 array of 4096 or more elements unless it is the
  last of its block, and its YNNPACK reduction takes no NaN-to-Inf select
  (one more elementwise pass). The magnitude bits are max-reduced as
  unsigned integers instead, exact on every platform. XLA:CPU fuses an
  integer reduction into its producer only over at most 32 elements (longer
  ones become unfused reduce-window trees), so there the last reduced axis
  is split into chunks of at most 32: an integer max over each chunk, fused
  with the bit operations in one pass over ``x``, then a float max (of
  NaN-free values, 1/32 as many) over the rest. Elsewhere (XLA:GPU fuses
  any reduction with its producers) it is one integer reduction.
  """
  if jnp.finfo(x.dtype).bits < 16:
    x = x.astype(jnp.float32)
  dtype = x.dtype
  axes = tuple(sorted(a % x.ndim for a in axes))
  if any(x.shape[a] == 0 for a in axes):  # nothing reduced: 0 (max's floor)
    return jnp.zeros([n for a, n in enumerate(x.shape) if a not in axes],
                     dtype)
  mags = magnitude_bits(x)

  def default(mags):
    return max_of_bits(mags, dtype, axes)

  def cpu(mags):
    if not axes:
      return amax_from_bits(mags, dtype)
    last = axes[-1]
    n = mags.shape[last]
    if not isinstance(n, int):  # a symbolic dim (jax.export): no chunks
      return default(mags)
    # Chunks within each device's part where explicit axes split the dim
    # (a reshape across parts has no sharding JAX can infer).
    k = _chunk(n // sharding.explicit_shards(mags, last))
    split = mags.reshape(*mags.shape[:last], n // k, k, *mags.shape[last + 1:])
    part = amax_from_bits(jnp.max(split, axis=last + 1), dtype)
    return jnp.max(part, axis=axes)

  return jax.lax.platform_dependent(mags, cpu=cpu, default=default)


def amax(x: jax.Array) -> jax.Array:
  """max |x| as FP32; +Inf if ``x`` holds any Inf or NaN (see
  `_max_magnitude`).

  Example:
    >>> import jax.numpy as jnp
    >>> amax(jnp.array([1.0, -3.0, 2.0], jnp.bfloat16))
    Array(3., dtype=float32)
    >>> amax(jnp.array([1.0, jnp.nan]))
    Array(inf, dtype=float32)
  """
  return _max_magnitude(x, tuple(range(x.ndim))).astype(jnp.float32)
