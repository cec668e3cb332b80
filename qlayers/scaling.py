"""Scale computation and the `QTensor` pytree.

Convention: a *scale* in qlayers is always the dequantization factor, so a
quantized tensor means ``x ~= decode(payload) * scale``. Transformer Engine's
multiplier ``s = (max / amax) / 2**margin`` is ``1 / scale`` here.

Granularities (the scaling unit, along the quantization axis ``axis``, which
is the contraction axis of the GEMM that consumes the tensor):

* ``tensor``: one FP32 scale (shape ``()``).
* ``row``: one FP32 scale per slice along ``axis`` (per row of a GEMM operand).
* ``tile``: 1 x ``block_size`` tiles along ``axis`` (DeepSeek-V3 activations).
* ``block``: ``block_size`` x ``block_size`` blocks over ``axis`` and the other
  of the two trailing dims (DeepSeek-V3 weights).
* ``mx``: OCP MX blocks of ``block_size`` (32) along ``axis``, one E8M0 scale
  each, stored as uint8 codes.

Scale rules (``amax`` = max |x| over the unit):

* ``te`` (Transformer Engine): multiplier ``s = (max / amax) / 2**margin``,
  one correctly rounded FP32 division; payload ``sat(x * s)``; stored scale
  ``1 / s`` (TE's ``scale_inv``). ``pow2`` rounds ``s`` down to a power of
  two. A zero amax gives ``s = 1``.
* ``deepseek`` (DeepSeek-V3 / DeepGEMM): stored scale
  ``max(amax, 1e-4) / max``, correctly rounded; payload ``sat(x * (1 /
  scale))``; ``pow2`` rounds the scale up to a power of two (UE8M0). With
  the 1e-4 floor a unit whose amax is below 1e-4 keeps only E4M3's
  subnormal steps of 1e-4 / 448 * 2**-9, and values below half of one
  (about 2.2e-10 for E4M3) quantize to zero.
* ``mx_floor``: OCP MX v1.0 sec. 6.3: ``2**(floor(log2 amax) - emax_elem)``.
* ``mx_rceil``: ``2**ceil(log2(amax / max))`` (the exponent of ``amax / max``
  rounded up when its mantissa is non-zero; the rule of TE/cuBLAS).
  Both MX rules read exponents off the bits, give code 0 (2**-127) to an
  all-zero block and the NaN code 0xFF to a block holding Inf or NaN.

Non-finite values: every amax is an integer max of the magnitude bits, in
which a NaN ranks above +Inf and is read back as +Inf (a float max on XLA:CPU
can drop a NaN; see `_max_magnitude`), and a unit (tensor, row, tile, block) whose
amax is not finite gets a NaN scale, so the GEMMs that read it give
non-finite outputs, which a training step detects and skips. Divisions are
computed so that they are the IEEE FP32 quotient on every platform (XLA
rewrites ``a / const`` as ``a * fl(1 / const)``, and XLA:GPU divides with
``div.full.f32``); see `divide_rn` and `rdivide_rn`. FP32 subnormals are
read as zero by XLA on CPU (not worked around); elsewhere they are kept.

Non-multiple shapes are padded with zeros up to the block grid; the payload
keeps the padded shape (``QTensor.padded_shape``) and ``QTensor.shape`` is the
original one.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qlayers import formats
from qlayers.formats import Format

__all__ = [
    "QuantSpec",
    "QTensor",
    "quantize",
    "amax",
    "te_scale",
    "te_multiplier",
    "divide_rn",
    "rdivide_rn",
    "rdivide_rn_integer",
    "check_fields",
    "e8m0_decode",
    "ScaleState",
    "init_scale_state",
    "history_amax",
    "delayed_amax",
    "update_scales",
    "merge_amax",
    "mx_scale_codes",
]

Granularity = Literal["tensor", "row", "tile", "block", "mx"]
ScaleRule = Literal["te", "deepseek", "mx_floor", "mx_rceil"]

_MX_BLOCK = 32
_DEFAULT_BLOCK = {"tile": 128, "block": 128, "mx": _MX_BLOCK}
_DEFAULT_RULE = {"tensor": "te", "row": "te", "tile": "deepseek",
                 "block": "deepseek", "mx": "mx_rceil"}
# DeepSeek-V3's floor on the amax of a tile/block before dividing by max.
_DEEPSEEK_AMAX_FLOOR = 1e-4
_MX_ELEMENT_FORMATS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")


def _type_name(tp) -> str:
  if typing.get_origin(tp) is Literal:
    return " | ".join(repr(a) for a in typing.get_args(tp))
  if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
    return " or ".join(_type_name(a) for a in typing.get_args(tp))
  return "None" if tp is type(None) else tp.__name__


def _matches(value, tp) -> bool:
  if typing.get_origin(tp) is Literal:
    return any(type(value) is type(a) and value == a
               for a in typing.get_args(tp))
  if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
    return any(_matches(value, a) for a in typing.get_args(tp))
  if tp is bool:
    return isinstance(value, (bool, np.bool_))
  if tp is int:  # bool is an int subclass; True is not a length
    return (isinstance(value, (int, np.integer))
            and not isinstance(value, (bool, np.bool_)))
  if tp is typing.Any:
    return True
  return isinstance(value, tp)


def check_fields(obj) -> None:
  """Checks every field of the dataclass ``obj`` against its annotation.

  The one type check of `QuantSpec`, `qlayers.recipe.GemmRecipe` and
  `qlayers.recipe.Recipe`: ``bool`` fields take only booleans (not the
  string ``"false"``), ``int`` fields refuse booleans, ``Literal`` fields
  take their listed values only. Raises TypeError (wrong type) or ValueError
  (a value not listed) naming the field.
  """
  hints = typing.get_type_hints(type(obj))
  for f in dataclasses.fields(obj):
    value, tp = getattr(obj, f.name), hints[f.name]
    if not _matches(value, tp):
      # Right type, value not among a Literal's: a ValueError.
      error = (ValueError if any(type(value) is type(a)
                                 for a in _literal_values(tp)) else TypeError)
      raise error(
          f"{type(obj).__name__}.{f.name} must be {_type_name(tp)}, got "
          f"{value!r} ({type(value).__name__}).")


def _literal_values(tp) -> tuple:
  if typing.get_origin(tp) is Literal:
    return typing.get_args(tp)
  if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
    return sum((_literal_values(a) for a in typing.get_args(tp)), ())
  return ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantSpec:
  """How to quantize one GEMM operand.

  Attributes:
    format: element format name (see `qlayers.formats.FORMATS`).
    granularity: ``tensor`` | ``row`` | ``tile`` | ``block`` | ``mx``.
    block_size: tile/block length (default 128); MX blocks are 32, the
      only size OCP MX v1.0 defines. Not allowed for tensor/row.
    scale_rule: ``te`` | ``deepseek`` | ``mx_floor`` | ``mx_rceil``;
      defaults by granularity (te, te, deepseek, deepseek, mx_rceil).
    margin: TE margin (scale multiplied by ``2**margin``), ``te`` rule only.
    pow2: power-of-two scales (``te`` and ``deepseek`` rules).
    rounding: ``nearest`` (RNE) or ``stochastic``.

  Example:
    >>> spec = QuantSpec(format="e4m3", granularity="mx")
    >>> spec.block_size, spec.scale_rule
    (32, 'mx_rceil')
  """

  format: str = "e4m3"
  granularity: Granularity = "tensor"
  block_size: int | None = None
  scale_rule: ScaleRule | None = None
  margin: int = 0
  pow2: bool = False
  rounding: Literal["nearest", "stochastic"] = "nearest"

  def __post_init__(self):
    if isinstance(self.format, Format):
      object.__setattr__(self, "format", self.format.name)
    check_fields(self)
    fmt = formats.get_format(self.format)
    object.__setattr__(self, "format", fmt.name)
    if fmt is formats.E8M0:
      raise ValueError("E8M0 is a scale format, not an element format.")
    gran = self.granularity
    if self.block_size is None:
      object.__setattr__(self, "block_size", _DEFAULT_BLOCK.get(gran))
    elif gran not in _DEFAULT_BLOCK:
      raise ValueError(f"block_size applies to tile/block/mx granularity, not "
                       f"{gran!r}; drop it.")
    if self.scale_rule is None:
      object.__setattr__(self, "scale_rule", _DEFAULT_RULE[gran])
    rule = self.scale_rule
    if (gran == "mx") != rule.startswith("mx_"):
      raise ValueError(
          f"scale_rule {rule!r} does not fit granularity {gran!r}: MX "
          "granularity takes mx_floor/mx_rceil, the others te/deepseek.")
    if gran == "mx" and fmt.name not in _MX_ELEMENT_FORMATS:
      raise ValueError(f"{fmt.name} is not an OCP MX element format; use one "
                       f"of {_MX_ELEMENT_FORMATS}.")
    if fmt.packed and gran != "mx":
      raise ValueError(
          f"{fmt.name} has {fmt.bits} bits and needs block scales: use "
          "granularity='mx'.")
    if gran == "mx" and self.block_size != _MX_BLOCK:
      # OCP MX v1.0: every concrete MX-compliant format (MXFP8/6/4, MXINT8)
      # has block size k = 32, and the MX GEMM kernels take nothing else.
      raise ValueError(f"block_size must be {_MX_BLOCK} for granularity 'mx' "
                       f"(OCP MX v1.0 fixes the block size), got "
                       f"{self.block_size}.")
    if gran in _DEFAULT_BLOCK and self.block_size <= 0:
      raise ValueError(f"block_size must be positive, got {self.block_size}.")
    if not 0 <= self.margin <= _MAX_MARGIN:
      raise ValueError(f"margin must be in [0, {_MAX_MARGIN}], got "
                       f"{self.margin}.")
    if self.margin and rule != "te":
      raise ValueError("margin applies to the 'te' scale rule only.")
    if self.pow2 and rule.startswith("mx_"):
      raise ValueError("MX scales are powers of two already; drop pow2.")

  @property
  def fmt(self) -> Format:
    return formats.get_format(self.format)

  @property
  def stochastic(self) -> bool:
    return self.rounding == "stochastic"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
  """A quantized tensor: payload + scales + how they were made.

  Attributes:
    payload: FP8 array, or packed uint8 codes for FP6/FP4 (packed along the
      last axis), in the padded shape.
    scale: dequantization factors: FP32 of shape ``()`` (tensor), a
      keep-dims block grid (row/tile/block), or uint8 E8M0 codes (mx).
    format: element format name.
    granularity: see `QuantSpec`.
    block: per-dim block lengths of the scale grid (``None`` per tensor).
    axis: the axis quantized along (the contraction axis of its GEMM).
    shape: the original, unpadded shape.
    transposed: the tensor was transposed before quantizing, so ``shape``
      is the transpose of the caller's operand (contraction-last layouts).
  """

  payload: jax.Array
  scale: jax.Array
  format: str = dataclasses.field(metadata=dict(static=True))
  granularity: str = dataclasses.field(metadata=dict(static=True))
  block: tuple[int, ...] | None = dataclasses.field(metadata=dict(static=True))
  axis: int = dataclasses.field(metadata=dict(static=True))
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  transposed: bool = dataclasses.field(default=False,
                                       metadata=dict(static=True))

  @property
  def fmt(self) -> Format:
    return formats.get_format(self.format)

  @property
  def padded_shape(self) -> tuple[int, ...]:
    if self.block is None:
      return self.shape
    return _padded_shape(self.shape, self.block)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def elements(self, dtype=jnp.float32) -> jax.Array:
    """The decoded payload (unscaled), in the padded shape."""
    fmt = self.fmt
    if fmt.packed:
      return formats.decode(formats.unpack(self.payload, fmt), fmt, dtype)
    return self.payload.astype(dtype)

  def scale_values(self) -> jax.Array:
    """Scales as FP32 (E8M0 codes decoded)."""
    if self.granularity == "mx":
      return e8m0_decode(self.scale)
    return self.scale

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``decode(payload) * scale`` in ``dtype``, cropped to ``shape``."""
    values = self.elements(jnp.float32)
    scale = self.scale_values()
    if self.block is None:
      out = values * scale
    else:
      out = _apply_blocks(values, scale, self.block, jnp.multiply)
      out = out[tuple(slice(0, n) for n in self.shape)]
    return out.astype(dtype)


# ----------------------------------------------------------------------------
# Blocks


def _normalize_axis(axis: int, ndim: int) -> int:
  if not -ndim <= axis < ndim:
    raise ValueError(f"axis {axis} out of range for a rank-{ndim} tensor.")
  return axis % ndim


def block_shape(shape: tuple[int, ...], spec: QuantSpec,
                axis: int) -> tuple[int, ...] | None:
  """Per-dim block lengths of the scale grid of ``spec`` on ``shape``."""
  ndim = len(shape)
  if spec.granularity == "tensor":
    return None
  block = [1] * ndim
  if spec.granularity == "row":
    block[axis] = shape[axis]
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


def _padded_shape(shape, block):
  return tuple(-(-n // b) * b for n, b in zip(shape, block))


def _split_blocks(x: jax.Array, block: tuple[int, ...]) -> jax.Array:
  """(n0*b0, n1*b1, ...) -> (n0, b0, n1, b1, ...), leaving dims with b == 1
  unsplit (size-1 dims give XLA layouts it relays out element by element)."""
  dims = []
  for n, b in zip(x.shape, block):
    dims += [n] if b == 1 else [n // b, b]
  return x.reshape(dims)


def _block_axes(block: tuple[int, ...]) -> tuple[int, ...]:
  """Axes of `_split_blocks`' output that run within a block."""
  axes, i = [], 0
  for b in block:
    if b != 1:
      axes.append(i + 1)
    i += 1 if b == 1 else 2
  return tuple(axes)


def _apply_blocks(values, scale, block, op):
  """op(values, scale) with one scale per block; values in padded shape."""
  split = _split_blocks(values, block)
  s = scale.reshape([d for n, b in zip(scale.shape, block)
                     for d in ((n,) if b == 1 else (n, 1))])
  return op(split, s).reshape(values.shape)


def _block_amax(x: jax.Array, block: tuple[int, ...]) -> jax.Array:
  """max |x| per block; +Inf for a block holding Inf or NaN (see `amax`)."""
  return _max_magnitude(_split_blocks(x, block), _block_axes(block))


def _pad(x: jax.Array, padded: tuple[int, ...]) -> jax.Array:
  if padded == x.shape:
    return x
  return jnp.pad(x, [(0, p - n) for n, p in zip(x.shape, padded)])


# ----------------------------------------------------------------------------
# Scale rules


def _magnitude_bits(x: jax.Array) -> jax.Array:
  """The bits of ``|x|`` as unsigned integers (same width as ``x``).

  For non-negative IEEE floats the order of the bit patterns as unsigned
  integers is the order of the values, and every NaN (exponent all ones,
  mantissa non-zero) lies above +Inf: an integer max of these is the bits
  of max |x|, or a NaN pattern, which `_amax_from_bits` maps to +Inf.
  """
  utype = np.dtype(f"uint{np.dtype(x.dtype).itemsize * 8}")
  sign = 1 << (utype.itemsize * 8 - 1)
  return jax.lax.bitcast_convert_type(x, utype) & utype.type(sign - 1)


def _amax_from_bits(top: jax.Array, dtype) -> jax.Array:
  """Reduced `_magnitude_bits` as ``dtype`` values, NaN patterns as +Inf."""
  inf = np.array(np.inf, dtype).view(top.dtype)
  return jax.lax.bitcast_convert_type(jnp.minimum(top, inf), dtype)


def _chunk(n: int) -> int:
  """The largest divisor of ``n`` that is at most 32."""
  return next(k for k in range(min(n, 32), 0, -1) if n % k == 0)


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
  mags = _magnitude_bits(x)

  def default(mags):
    return _amax_from_bits(jnp.max(mags, axis=axes), dtype)

  def cpu(mags):
    if not axes:
      return _amax_from_bits(mags, dtype)
    last = axes[-1]
    n = mags.shape[last]
    k = _chunk(n)
    split = mags.reshape(*mags.shape[:last], n // k, k, *mags.shape[last + 1:])
    part = _amax_from_bits(jnp.max(split, axis=last + 1), dtype)
    return jnp.max(part, axis=axes)

  return jax.lax.platform_dependent(mags, cpu=cpu, default=default)


def amax(x: jax.Array) -> jax.Array:
  """max |x| as FP32; +Inf if ``x`` holds any Inf or NaN (see
  `_max_magnitude`)."""
  return _max_magnitude(x, tuple(range(x.ndim))).astype(jnp.float32)


def _bits(v: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(v.astype(jnp.float32), jnp.uint32)


def _from_bits(b: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(b.astype(jnp.uint32), jnp.float32)


def _f32_fields(value: float) -> tuple[int, int]:
  """(unbiased exponent, 23-bit mantissa field) of a normal FP32 constant."""
  b = int(np.float32(value).view(np.uint32))
  return ((b >> 23) & 0xFF) - 127, b & 0x7FFFFF


_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal, 2**-126
# Largest TE margin for which max * 2**-margin and 2**margin are normal FP32
# for every element format (max >= 6), so a zero amax gives s = 1 exactly.
_MAX_MARGIN = 126


def _pow2_ceil(v: jax.Array) -> jax.Array:
  """Smallest power of two >= v, for positive normal FP32 v, from its bits.

  The exponent field plus one when the mantissa is non-zero (DeepGEMM's
  ``ceil_to_ue8m0``, deep_gemm/utils/math.py); exact, no log2/exp2.
  """
  b = _bits(v)
  e = ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0).astype(jnp.uint32)
  return _from_bits(e << 23)


def _odd_part(value: float) -> tuple[int, int]:
  """(n, k) with ``value = n * 2**k``, ``n`` odd (positive finite ``value``)."""
  num, den = float(value).as_integer_ratio()
  if value <= 0 or den & (den - 1):
    raise ValueError(f"expected a positive finite constant, got {value}.")
  tz = (num & -num).bit_length() - 1
  return num >> tz, tz - (den.bit_length() - 1)


def divide_rn(a: jax.Array, divisor: float) -> jax.Array:
  """``a / divisor`` correctly rounded (RNE) in FP32, for a constant divisor.

  XLA rewrites a division by a constant (or by any broadcast scalar) into a
  multiplication by its FP32 reciprocal, which is 1 ulp off the quotient for
  about half of all ``a`` when the divisor is not a power of two (448, say).
  This divides the 24-bit significand of ``a`` by the divisor's odd part in
  integer arithmetic (exact on every platform) and rounds the quotient to
  nearest even from its remainder. Positive normal ``a`` with a normal
  quotient take this path; zero, subnormal, non-finite or out-of-range values
  fall back to the plain division.

  Args:
    a: FP32 array.
    divisor: positive finite Python number whose odd part is below 128
      (every element format's max is: 448 = 7 * 2**6, 57344 = 7 * 2**13,
      240 = 15 * 2**4, ...).
  """
  a = jnp.asarray(a, jnp.float32)
  n, k = _odd_part(divisor)  # divisor = n * 2**k, n odd
  if n == 1:
    return a * (2.0**-k)  # a power of two: exact
  if n >= 128:
    raise ValueError(f"divide_rn supports odd parts below 128; {divisor} has "
                     f"{n}.")
  bits = _bits(a)
  ea = ((bits >> 23) & 0xFF).astype(jnp.int32)
  sig = (bits & 0x7FFFFF) | 0x800000  # a = sig * 2**(ea - 150)
  # sig * 2**s / n has 25 or 26 bits (n in (2**(b-1), 2**b)); the numerator
  # stays below 2**(25 + b) <= 2**32.
  s = n.bit_length() + 1
  wide = sig << s
  q = wide // n
  rem = wide - q * n
  t = jnp.where(q >= (1 << 25), 2, 1).astype(jnp.uint32)
  keep = q >> t
  dropped = q & ((jnp.uint32(1) << t) - 1)
  half = jnp.uint32(1) << (t - 1)
  up = (dropped > half) | ((dropped == half) & ((rem != 0) | ((keep & 1) != 0)))
  keep = keep + up.astype(jnp.uint32)
  carry = keep >> 24  # rounding reached 2**24: one more binade
  keep = jnp.where(carry != 0, keep >> 1, keep)
  e = ea - k - s + t.astype(jnp.int32) + carry.astype(jnp.int32)
  exact = _from_bits((e.astype(jnp.uint32) << 23) | (keep & 0x7FFFFF))
  fast = (ea >= 1) & (ea <= 254) & (e >= 1) & (e <= 254)
  return jnp.where(fast, exact, a / divisor)


def rdivide_rn(numerator: float, b: jax.Array) -> jax.Array:
  """``numerator / b`` correctly rounded (RNE) in FP32, for a constant numerator.

  XLA:CPU divides with the IEEE instruction, so the CPU lowering is the plain
  division. XLA:GPU lowers an FP32 division to PTX ``div.full.f32`` (an
  approximation within 2 ulp), not the IEEE ``div.rn.f32`` that Transformer
  Engine's ``__fdiv_rn`` is, so every other platform long-divides in integer
  steps (`rdivide_rn_integer`). The branches are chosen by
  ``lax.platform_dependent``: a program lowered for one platform holds only
  its own.

  Args:
    numerator: positive finite Python number with an odd part below 128
      (448, 57344, 240, 1.0, ...).
    b: FP32 array.
  """
  _check_numerator(numerator)
  b = jnp.asarray(b, jnp.float32)

  def cpu(b):
    # |q| < 2**-126 needs b > numerator * 2**126, and b < 2**128: only a
    # numerator below 4 can give a subnormal quotient.
    if numerator >= 4:
      return numerator / b
    n, k = _odd_part(numerator)
    if n == 1:
      # numerator = 2**k: |fl(2**k / b)| < 2**-126 exactly when |b| >
      # 2**(k + 126) (just above, the quotient is within 2**-172 of the
      # largest subnormal), so such b become +-Inf and the division gives
      # the signed zero itself; the flush then fuses into the division
      # instead of into each consumer of the quotient.
      b = jnp.where(jnp.abs(b) > 2.0**(k + 126), b * jnp.inf, b)
      return numerator / b
    return _flush_subnormal(numerator / b)

  return jax.lax.platform_dependent(
      b, cpu=cpu, default=functools.partial(rdivide_rn_integer, numerator))


def _flush_subnormal(v: jax.Array) -> jax.Array:
  """``v`` with subnormals replaced by signed zeros.

  XLA:CPU computes with subnormals flushed, but a quotient that LLVM folds
  at compile time (``1 / select(c, FLT_MAX, x)`` becomes a select of
  ``1 / FLT_MAX``) keeps its subnormal; this makes both read as zero.
  """
  return jnp.where(jnp.abs(v) < _F32_TINY, v * 0.0, v)


def _check_numerator(numerator: float) -> tuple[int, int]:
  n, k = _odd_part(numerator)
  if n >= 128:
    raise ValueError(f"rdivide_rn supports odd parts below 128; {numerator} "
                     f"has {n}.")
  return n, k


def rdivide_rn_integer(numerator: float, b: jax.Array) -> jax.Array:
  """`rdivide_rn` on any platform, from integer operations only.

  Long-divides ``n * 2**48`` (``numerator = n * 2**k``, ``n`` odd) by the
  24-bit significand of ``b`` in base-256 integer steps and rounds to nearest
  even from the remainder: the IEEE quotient wherever the platform's own
  division is not. Positive normal ``b`` with a normal quotient take this
  path; anything else (negative, zero, subnormal, non-finite, an overflowing
  or subnormal quotient) falls back to the plain division.
  """
  n, k = _check_numerator(numerator)
  b = jnp.asarray(b, jnp.float32)
  bits = _bits(b)
  eb = ((bits >> 23) & 0xFF).astype(jnp.int32)
  sig = (bits & 0x7FFFFF) | 0x800000  # b = sig * 2**(eb - 150)
  # q = floor(n * 2**48 / sig), one base-256 digit at a time: remainders stay
  # below 2**24, so (rem << 8) fits uint32; q < 2n * 2**24 < 2**32.
  rem = jnp.full(sig.shape, n << 24, jnp.uint32)
  q = jnp.zeros(sig.shape, jnp.uint32)
  for i in range(4):
    if i:
      rem = rem << 8
    digit = rem // sig
    rem = rem - digit * sig
    q = (q << 8) | digit
  t = (8 - jax.lax.clz(q)).astype(jnp.uint32)  # bits beyond 24: 1..8
  keep = q >> t
  dropped = q & ((jnp.uint32(1) << t) - 1)
  half = jnp.uint32(1) << (t - 1)
  up = (dropped > half) | ((dropped == half) & ((rem != 0) | ((keep & 1) != 0)))
  keep = keep + up.astype(jnp.uint32)
  carry = keep >> 24
  keep = jnp.where(carry != 0, keep >> 1, keep)
  # numerator / b = q * 2**(k - eb + 102), q ~ keep * 2**(t + carry).
  e = t.astype(jnp.int32) + carry.astype(jnp.int32) + k - eb + 252
  exact = _from_bits((e.astype(jnp.uint32) << 23) | (keep & 0x7FFFFF))
  positive = (bits >> 31) == 0
  fast = positive & (eb >= 1) & (eb <= 254) & (e >= 1) & (e <= 254)
  return jnp.where(fast, exact, numerator / b)


def te_multiplier(amax_value: jax.Array, fmt: Format, *, margin: int = 0,
                  pow2: bool = False) -> jax.Array:
  """Transformer Engine's quantization multiplier ``s`` (payload ``x * s``).

  ``s = (max / amax) / 2**margin`` with one correctly rounded FP32 division,
  as TE computes it (transformer_engine/common/recipe/recipe_common.cuh,
  ``compute_scale_from_amax``: ``__fdiv_rn(max_fp8, amax)``; the delayed
  recipe's ``fp8_max / amax / 2**margin``). ``pow2`` clears the mantissa
  bits, rounding ``s`` down to a power of two, as TE does. A zero amax gives
  ``s = 1``; an amax so small that ``max / amax`` overflows gives the FP32
  max (TE's ``value_for_inf``); a non-finite amax (the unit holds Inf or
  NaN) gives NaN, which makes the payload, and any GEMM of it, non-finite.
  """
  if not 0 <= margin <= _MAX_MARGIN:
    raise ValueError(f"margin must be in [0, {_MAX_MARGIN}], got {margin}.")
  a = jnp.asarray(amax_value, jnp.float32)
  # Special amaxes are replaced before the division, so the quotient needs
  # one clamp: zero by max * 2**-margin (then s = 2**margin * 2**-margin = 1
  # exactly), Inf/NaN by NaN (XLA's min propagates NaN). An amax is never
  # negative; for one the clamp leaves -Inf (max / -tiny) as it is.
  a0 = jnp.where(a == 0, fmt.max * 2.0**-margin, a)
  if not pow2:
    a0 = jnp.where(jnp.isfinite(a), a0, jnp.nan)
  s = rdivide_rn(fmt.max, a0)
  s = jnp.minimum(s * (2.0**-margin), _F32_MAX)  # / 2**margin, exactly
  if pow2:
    # Clearing the mantissa would turn a NaN into Inf: NaN comes after.
    s = _from_bits(_bits(s) & jnp.uint32(0xFF800000))
    s = jnp.where(jnp.isfinite(a), s, jnp.nan)
  return s


def te_scale(amax_value: jax.Array, fmt: Format, *, margin: int = 0,
             pow2: bool = False) -> jax.Array:
  """TE per-tensor scale as a dequantization factor: ``1 / te_multiplier``.

  This is TE's ``scale_inv`` (FP32 reciprocal of the multiplier); 1 for a
  zero amax, NaN for a non-finite one.
  """
  return rdivide_rn(1.0, te_multiplier(amax_value, fmt, margin=margin,
                                       pow2=pow2))


def _deepseek_scale(a: jax.Array, fmt: Format, pow2: bool) -> jax.Array:
  """DeepSeek-V3 tile/block scale ``max(amax, 1e-4) / max`` (dequantization
  factor), correctly rounded, as DeepGEMM's reference casts compute it
  (deep_gemm/utils/math.py: ``amax.clamp(1e-4) / 448.0``); ``pow2``: rounded
  up to a power of two (UE8M0). NaN for a unit holding Inf or NaN."""
  s = divide_rn(jnp.maximum(a, _DEEPSEEK_AMAX_FLOOR), fmt.max)
  if pow2:
    s = _pow2_ceil(s)
  return jnp.where(jnp.isfinite(a), s, jnp.nan)


def mx_scale_codes(amax_value: jax.Array, fmt: Format,
                   rule: str = "mx_rceil") -> jax.Array:
  """E8M0 codes (uint8) of MX block scales from per-block amax.

  FLOOR (OCP MX v1.0 sec. 6.3): ``e = floor(log2 amax) - emax_elem``.
  RCEIL: ``e = ceil(log2(amax / max))``: the exponent of ``amax / max``,
  plus one when its mantissa is non-zero. Both are read off the bits of
  ``amax`` (and of the constant ``max``): ``amax / max`` is never formed, so
  a quotient below the FP32 normal range (amax under ~5e-36 for E4M3, which
  XLA:CPU flushes to zero) cannot lose its exponent. For a normal quotient
  this is the FP32-quotient rule exactly: ``fl(amax / max) > 2**k`` iff
  ``amax > max * 2**k``. Exponents clamp to [-127, 127]; zero blocks get
  code 0 (2**-127); Inf/NaN blocks get 0xFF.
  """
  bits = _bits(amax_value)
  eb = (bits >> 23) & 0xFF  # biased: floor(log2 a) + 127; 0 for zero
  # code = max(e + 127, 0) with e the unbiased scale exponent, in unsigned
  # arithmetic: max(eb + d, k) - k for e + 127 = eb + d - k. A finite amax
  # never reaches the upper clamp (eb <= 254, k >= 2: every element format's
  # max is at least 4), and zero or subnormal amaxes (eb = 0) give code 0.
  if rule == "mx_floor":
    k = fmt.emax
    code = jnp.maximum(eb, k) - k
  elif rule == "mx_rceil":
    k, m_max = _f32_fields(fmt.max)
    above = ((bits & 0x7FFFFF) > m_max).astype(jnp.uint32)
    code = jnp.maximum(eb + above, k) - k
  else:
    raise ValueError(f"{rule!r} is not an MX scale rule.")
  code = jnp.where(eb == 255, 255, code)  # Inf or NaN
  return code.astype(jnp.uint8)


def e8m0_decode(codes: jax.Array) -> jax.Array:
  """FP32 values ``2**(code - 127)``, from bits; code 0xFF is NaN.

  Never ``astype(float8_e8m0fnu)`` a float: that rounds to nearest and maps 0
  to NaN. Code 0 is the FP32 subnormal 2**-127, which XLA:CPU reads as 0, so
  on CPU a block scaled by it (amax below ~2**-118) dequantizes to zeros.
  """
  c = codes.astype(jnp.uint32)
  return jnp.where(c == 255, jnp.nan, _from_bits(_e8m0_bits(c)))


def _e8m0_bits(c: jax.Array) -> jax.Array:
  """FP32 bits of ``2**(c - 127)`` for uint32 ``c`` in [0, 254]: the exponent
  field ``c``, or for code 0 the subnormal 2**-127 (0x400000, the only
  pattern below 0x800000 that it can be)."""
  return jnp.maximum(c << 23, jnp.uint32(0x400000))


# ----------------------------------------------------------------------------
# Delayed scaling


class ScaleState(NamedTuple):
  """Delayed-scaling state of one operand role: plain FP32 arrays.

  Attributes:
    amax_history: ``(..., history_len)`` amaxes of completed steps, index 0
      the most recent (0: a step that saw nothing finite). Leading axes stack
      the state of layers made under ``nnx.vmap``.
    amax: ``(...)`` running max |x| of the current step (every use of the
      role max-combines into it).

  The scale itself is not stored: each use derives it from the history for
  its own operand's format and margin (`delayed_amax`, then `quantize`), so
  two GEMMs that quantize one role to different formats each get their own.
  """

  amax_history: jax.Array
  amax: jax.Array


def init_scale_state(history_len: int,
                     batch_shape: tuple[int, ...] = ()) -> ScaleState:
  """A fresh `ScaleState` (empty history, zero running amax)."""
  return ScaleState(jnp.zeros((*batch_shape, history_len), jnp.float32),
                    jnp.zeros(batch_shape, jnp.float32))


def history_amax(history: jax.Array, algo: str = "max") -> jax.Array:
  """The amax a delayed scale is computed from (0 while the history is empty).

  ``algo`` is ``max`` (over the whole history) or ``most_recent``: the most
  recent non-zero entry, so a step that recorded nothing keeps the scale of
  the step before (Transformer Engine keeps the previous scale then).
  """
  if algo == "max":
    return jnp.max(history, axis=-1)
  if algo == "most_recent":
    seen = history != 0
    first = jnp.argmax(seen, axis=-1)
    latest = jnp.take_along_axis(history, first[..., None], axis=-1)[..., 0]
    return jnp.where(jnp.any(seen, axis=-1), latest, 0.0)
  raise ValueError(f"Unknown amax_compute_algo {algo!r}.")


def delayed_amax(state: ScaleState, current: jax.Array,
                 algo: str = "max", stored: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
  """One use of a delayed-scaling role: ``(amax to scale by, new running amax)``.

  The amax to scale by comes from the history of completed steps; while the
  history is still empty (the first step), it is the running amax of this
  step including ``current``, so the first step does not quantize with a
  scale of 1 (which flushes small gradients in E5M2). A non-finite
  ``current`` (the operand holds Inf/NaN) is returned as the amax to scale
  by, which makes the quantized operand, and so its GEMM, non-finite, but it
  never enters the running amax. ``stored`` is `history_amax` of the
  state's history when the caller has it already.
  """
  current = jnp.asarray(current, jnp.float32)
  finite = jnp.isfinite(current)
  running = jnp.where(finite, jnp.maximum(state.amax, current), state.amax)
  if stored is None:
    stored = history_amax(state.amax_history, algo)
  use = jnp.where(stored > 0, stored, running)
  return jnp.where(finite, use, current), running


def merge_amax(running: jax.Array, gradient: jax.Array) -> jax.Array:
  """A running amax with a gradient amax written into it, by max; a
  non-finite gradient amax carries no information and reads as 0."""
  gradient = gradient.astype(running.dtype)
  return jnp.maximum(running, jnp.where(jnp.isfinite(gradient), gradient, 0.0))


def update_scales(state: ScaleState) -> ScaleState:
  """Ends a step: the running amax enters the history (rolled one step, index
  0 most recent) and is cleared.

  A non-finite running amax is recorded as 0 ("no information"), so one bad
  step cannot poison the next ``history_len`` scales. Leading axes (stacked
  layers) are batched.
  """
  a = jnp.asarray(state.amax, jnp.float32)
  a = jnp.where(jnp.isfinite(a), a, 0.0)
  # One concatenate, not a roll and an indexed set (a scatter, which XLA
  # expands and simplifies again: once per role of every layer).
  history = jnp.concatenate([a[..., None], state.amax_history[..., :-1]],
                            axis=-1)
  return ScaleState(history, jnp.zeros_like(state.amax))


# ----------------------------------------------------------------------------
# Quantize


def _cast(values, fmt: Format, key):
  """Saturating cast of pre-scaled values to the payload representation."""
  codes = formats.cast(values, fmt, key=key)
  if fmt.packed:
    return formats.pack(codes, fmt)
  return codes


def quantize(x: jax.Array, spec: QuantSpec, axis: int = -1, *,
             tensor_amax: jax.Array | None = None,
             key: jax.Array | None = None) -> QTensor:
  """Quantizes ``x`` along ``axis`` following ``spec``.

  Args:
    x: high-precision input (FP32/BF16/FP16).
    spec: format, granularity and scale rule.
    axis: the axis quantized along (the contraction axis of its GEMM).
    tensor_amax: per-tensor granularity only: the amax the scale is computed
      from (delayed scaling passes the one of its history); ``max |x|``
      (current scaling) when omitted. A non-finite amax gives a NaN scale, so
      the operand, and any GEMM of it, is non-finite.
    key: PRNG key, required when ``spec.rounding == "stochastic"``.

  Returns:
    A `QTensor` whose ``dequantize()`` approximates ``x``.

  Example:
    >>> import jax.numpy as jnp
    >>> qt = quantize(jnp.ones((4, 64)), QuantSpec(format="e2m1",
    ...                                            granularity="mx"))
    >>> qt.payload.shape, qt.scale.shape
    ((4, 32), (4, 2))
  """
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"quantize expects a floating-point input, got {x.dtype}.")
  fmt = spec.fmt
  axis = _normalize_axis(axis, x.ndim)
  if spec.stochastic and key is None:
    raise ValueError("Stochastic rounding needs a PRNG `key`.")
  if fmt.packed and axis != x.ndim - 1:
    raise ValueError(
        f"{fmt.name} payloads are packed along the last axis: quantize along "
        f"axis -1 (got axis {axis}); transpose the tensor first.")
  xf = x.astype(jnp.float32)
  block = block_shape(x.shape, spec, axis)

  # Amaxes are taken of ``x`` in its own dtype (exact: max |x| is one of its
  # values), so XLA fuses the FP32 upcast into each consumer instead of
  # materializing an FP32 copy of ``x``.
  if block is None:
    a = amax(x) if tensor_amax is None else jnp.asarray(tensor_amax,
                                                         jnp.float32)
    mult, scale = _unit_scales(a, spec)
    payload = _cast(xf * mult, fmt, key)
    return QTensor(payload, scale, fmt.name, spec.granularity, None, axis,
                   tuple(x.shape))

  if tensor_amax is not None:
    raise ValueError("tensor_amax applies to per-tensor granularity only.")
  padded = _padded_shape(x.shape, block)
  xp = _pad(xf, padded)
  block_amax = _block_amax(_pad(x, padded), block).astype(jnp.float32)
  mult, scale = _unit_scales(block_amax, spec)
  payload = _cast(_apply_blocks(xp, mult, block, jnp.multiply), fmt, key)
  return QTensor(payload, scale, fmt.name, spec.granularity, block, axis,
                 tuple(x.shape))


# Jitted so that an eager `quantize` compiles the scale rule once per (grid
# shape, spec) rather than each of its integer steps; inlined under jit.
@functools.partial(jax.jit, static_argnums=1)
def _unit_scales(a: jax.Array, spec: QuantSpec) -> tuple[jax.Array, jax.Array]:
  """(multiplier applied to ``x``, stored scale) per scaling unit of amax ``a``.

  * ``te``: multiplier ``s`` = `te_multiplier`, stored ``1 / s`` (TE's
    ``scale_inv``).
  * ``deepseek``: stored ``s`` = `_deepseek_scale`, multiplier ``1 / s``
    (DeepGEMM's casts: ``x * (1.0 / sf)``; DeepSeek-V3's inference kernel
    divides, ``x / s``, which can differ by 1 ulp before the cast).
  * MX: stored E8M0 code, multiplier ``2**-e`` (exact); 0 for a NaN code (the
    scale carries the NaN).
  """
  fmt = spec.fmt
  if spec.scale_rule == "te":
    mult = te_multiplier(a, fmt, margin=spec.margin, pow2=spec.pow2)
    return mult, rdivide_rn(1.0, mult)
  if spec.scale_rule == "deepseek":
    scale = _deepseek_scale(a, fmt, spec.pow2)
    return rdivide_rn(1.0, scale), scale
  codes = mx_scale_codes(a, fmt, spec.scale_rule)
  # 2**-e = 2**(127 - code), the E8M0 value of code 254 - code, exact; code
  # 255 wraps around (uint32) and is replaced.
  mult = _from_bits(_e8m0_bits(254 - codes.astype(jnp.uint32)))
  return jnp.where(codes == 255, 0.0, mult), codes


def bytes_per_element(spec: QuantSpec | None, compute_bytes: int = 2) -> float:
  """Storage bytes per element of a quantized operand (payload + scales)."""
  if spec is None:
    return float(compute_bytes)
  fmt = spec.fmt
  b = fmt.bits / 8
  if spec.granularity == "mx":
    return b + 1 / spec.block_size
  if spec.granularity in ("tile",):
    return b + 4 / spec.block_size
  if spec.granularity == "block":
    return b + 4 / spec.block_size**2
  return b

