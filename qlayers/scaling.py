"""Quantizing one GEMM operand: `QuantSpec` says how, `quantize` does it,
`QTensor` holds the result (payload + scales + layout).

Convention: a *scale* in qlayers is always the dequantization factor, so a
quantized tensor means ``x ~= decode(payload) * scale``.

The pieces live in modules of one job each, and the names callers use are
re-exported here: the scaling units and their amax (`qlayers.blocks`: tensor,
row, 1 x 128 tiles, 128 x 128 blocks, MX blocks of 32), the scale rules
(`qlayers.scale_rules`: TE, DeepSeek-V3, MX FLOOR/RCEIL, bit-exact), delayed
scaling (`qlayers.delayed`) and the field type check (`qlayers.fields`).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Literal

import jax
import jax.numpy as jnp

from qlayers import blocks
from qlayers import formats
from qlayers import scale_rules
from qlayers.blocks import amax
from qlayers.blocks import block_shape
from qlayers.delayed import delayed_amax
from qlayers.delayed import history_amax
from qlayers.delayed import init_scale_state
from qlayers.delayed import merge_amax
from qlayers.delayed import ScaleState
from qlayers.delayed import update_scales
from qlayers.fields import check_fields
from qlayers.formats import Format
from qlayers.scale_rules import divide_rn
from qlayers.scale_rules import e8m0_decode
from qlayers.scale_rules import MAX_MARGIN
from qlayers.scale_rules import mx_scale_codes
from qlayers.scale_rules import rdivide_rn
from qlayers.scale_rules import rdivide_rn_integer
from qlayers.scale_rules import te_multiplier
from qlayers.scale_rules import te_scale

__all__ = [
    "QuantSpec",
    "QTensor",
    "quantize",
    "widened",
    "dequantized",
    "bytes_per_element",
    # Re-exported from qlayers.blocks, scale_rules, delayed and fields.
    "amax",
    "block_shape",
    "te_scale",
    "te_multiplier",
    "divide_rn",
    "rdivide_rn",
    "rdivide_rn_integer",
    "e8m0_decode",
    "mx_scale_codes",
    "ScaleState",
    "init_scale_state",
    "history_amax",
    "delayed_amax",
    "update_scales",
    "merge_amax",
    "check_fields",
]

Granularity = Literal["tensor", "row", "tile", "block", "mx"]
ScaleRule = Literal["te", "deepseek", "mx_floor", "mx_rceil", "nvfp4"]

_MX_BLOCK = 32
_DEFAULT_BLOCK = {"tile": 128, "block": 128, "mx": _MX_BLOCK}
_DEFAULT_RULE = {"tensor": "te", "row": "te", "tile": "deepseek",
                 "block": "deepseek", "mx": "mx_rceil"}
_MX_ELEMENT_FORMATS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")
# NVFP4 (arXiv 2509.25149; TE NVFP4BlockScaling): E2M1 elements, 16 along K
# per E4M3 block scale (1 x 16 tiles, or 16 x 16 blocks for weights).
_NVFP4_BLOCK = 16
# Tile/block lengths: powers of two (scale grids then align with the GEMM
# kernels' K tiles: 128 for DeepSeek-V3/DeepGEMM and cuBLASLt's VEC128 /
# BLK128x128, 32 for MX, 16 for NVFP4) up to 1024; every dim is padded to a
# multiple of the block, so a block of 100000 would ask for ~41 GB.
BLOCK_SIZES = tuple(2 ** i for i in range(4, 11))


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantSpec:
  """How to quantize one GEMM operand.

  Attributes:
    format: element format name (see `qlayers.formats.FORMATS`).
    granularity: ``tensor`` | ``row`` | ``tile`` | ``block`` | ``mx``.
    block_size: tile/block length (default 128; 16 for ``nvfp4``), a power
      of two from 16 to 1024 (`BLOCK_SIZES`); MX blocks are 32, the only size
      OCP MX v1.0 defines, and NVFP4 blocks 16. Not allowed for tensor/row.
    scale_rule: ``te`` | ``deepseek`` | ``mx_floor`` | ``mx_rceil`` |
      ``nvfp4``; defaults by granularity (te, te, deepseek, deepseek,
      mx_rceil). ``nvfp4`` (E2M1 with ``tile`` or ``block`` granularity):
      E4M3 scales per 1 x 16 tile or 16 x 16 block under a per-tensor FP32
      scale (`qlayers.scale_rules.nvfp4_scales`).
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
    nvfp4 = self.scale_rule == "nvfp4"
    if self.block_size is None:
      object.__setattr__(self, "block_size", _NVFP4_BLOCK if nvfp4 and gran
                         in _DEFAULT_BLOCK else _DEFAULT_BLOCK.get(gran))
    elif gran not in _DEFAULT_BLOCK:
      raise ValueError(f"block_size applies to tile/block/mx granularity, not "
                       f"{gran!r}; drop it.")
    if self.scale_rule is None:
      object.__setattr__(self, "scale_rule", _DEFAULT_RULE[gran])
    rule = self.scale_rule
    if (gran == "mx") != rule.startswith("mx_"):
      raise ValueError(
          f"scale_rule {rule!r} does not fit granularity {gran!r}: MX "
          "granularity takes mx_floor/mx_rceil, the others te/deepseek "
          "(nvfp4: tile/block).")
    if gran == "mx" and fmt.name not in _MX_ELEMENT_FORMATS:
      raise ValueError(f"{fmt.name} is not an OCP MX element format; use one "
                       f"of {_MX_ELEMENT_FORMATS}.")
    if nvfp4:
      if gran not in ("tile", "block") or fmt.name != "e2m1":
        raise ValueError(
            f"scale_rule 'nvfp4' takes format 'e2m1' with granularity 'tile' "
            f"(1 x 16) or 'block' (16 x 16), got {fmt.name} with {gran!r}.")
      if self.block_size != _NVFP4_BLOCK:
        raise ValueError(f"block_size must be {_NVFP4_BLOCK} for scale_rule "
                         f"'nvfp4' (NVFP4's block), got {self.block_size}.")
      if self.pow2:
        raise ValueError("NVFP4 block scales are E4M3; drop pow2.")
    if fmt.packed and gran != "mx" and not nvfp4:
      raise ValueError(
          f"{fmt.name} has {fmt.bits} bits and needs block scales: use "
          "granularity='mx' (or scale_rule='nvfp4' for E2M1).")
    if gran == "mx" and self.block_size != _MX_BLOCK:
      # OCP MX v1.0: every concrete MX-compliant format (MXFP8/6/4, MXINT8)
      # has block size k = 32, and the MX GEMM kernels take nothing else.
      raise ValueError(f"block_size must be {_MX_BLOCK} for granularity 'mx' "
                       f"(OCP MX v1.0 fixes the block size), got "
                       f"{self.block_size}.")
    if gran in ("tile", "block") and self.block_size not in BLOCK_SIZES:
      raise ValueError(f"block_size must be a power of two from "
                       f"{BLOCK_SIZES[0]} to {BLOCK_SIZES[-1]} (128 is "
                       f"DeepSeek-V3's), got {self.block_size}.")
    if not 0 <= self.margin <= MAX_MARGIN:
      raise ValueError(f"margin must be in [0, {MAX_MARGIN}], got "
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
      last axis), in the padded shape; or an FP6/FP4 tensor's values
      widened to an unpacked E4M3 array (`widened`), the payload cuDNN's
      block-scaled GEMM takes.
    scale: dequantization factors: FP32 of shape ``()`` (tensor), a
      keep-dims block grid (row/tile/block), or uint8 E8M0 codes (mx).
    format: element format name.
    granularity: see `QuantSpec`.
    block: per-dim block lengths of the scale grid (``None`` per tensor).
    axis: the axis quantized along (the contraction axis of its GEMM).
    shape: the original, unpadded shape.
    transposed: the tensor was transposed before quantizing, so ``shape``
      is the transpose of the caller's operand (contraction-last layouts).
    block_scale, tensor_scale: NVFP4 only (None otherwise): the two levels
      of ``scale`` kept apart for a native NVFP4 GEMM, the E4M3 block
      scales (``float8_e4m3fn``, the grid of ``scale``) and the per-tensor
      FP32 decode scale ``S_dec``; ``scale`` is ``f32(block_scale) *
      tensor_scale`` bit for bit. Code that replaces ``scale`` must
      replace or clear them too (``dataclasses.replace`` keeps them).
    dequantized: the payload holds ``dequantize(bfloat16)``'s values (in
      the padded shape; `dequantized`), for GEMMs that only ever read
      those: MX emulated without MX tensor cores. ``scale`` is kept.

  Example:
    >>> import jax.numpy as jnp
    >>> qt = quantize(jnp.ones((2, 40)), QuantSpec(granularity="mx"))
    >>> qt.payload.shape, qt.scale.shape, qt.block, qt.dequantize().shape
    ((2, 64), (2, 2), (1, 32), (2, 40))
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
  block_scale: jax.Array | None = None
  tensor_scale: jax.Array | None = None
  dequantized: bool = dataclasses.field(default=False,
                                        metadata=dict(static=True))

  @property
  def fmt(self) -> Format:
    return formats.get_format(self.format)

  @property
  def padded_shape(self) -> tuple[int, ...]:
    if self.block is None:
      return self.shape
    return blocks.padded_shape(self.shape, self.block)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def elements(self, dtype=jnp.float32) -> jax.Array:
    """The decoded payload (unscaled), in the padded shape."""
    if self.dequantized:
      raise ValueError("this QTensor holds dequantized values (`dequantized`)"
                       ", not its format's elements: use dequantize().")
    fmt = self.fmt
    if fmt.packed and self.payload.dtype == jnp.uint8:
      return formats.decode(formats.unpack(self.payload, fmt), fmt, dtype)
    return self.payload.astype(dtype)

  def scale_values(self) -> jax.Array:
    """Scales as FP32 (E8M0 codes decoded)."""
    if self.granularity == "mx":
      return scale_rules.e8m0_decode(self.scale)
    return self.scale

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``decode(payload) * scale`` in ``dtype``, cropped to ``shape``."""
    out = self._padded_values() if not self.dequantized else self.payload
    if self.block is not None:
      out = out[tuple(slice(0, n) for n in self.shape)]
    return out.astype(dtype)

  def _padded_values(self) -> jax.Array:
    """``decode(payload) * scale`` in FP32, in the padded shape."""
    values = self.elements(jnp.float32)
    scale = self.scale_values()
    if self.block is None:
      return values * scale
    return blocks.apply_blocks(values, scale, self.block, jnp.multiply)


def dequantized(q: QTensor) -> QTensor:
  """``q`` with its payload replaced by its BF16 dequantized values (the
  padded shape), for GEMMs that read nothing else (`QTensor.dequantized`):
  on GPUs the one-pass MX kernel writes them so, and the GEMM reads them
  without a dequantize pass of its own.

  Example:
    >>> import jax.numpy as jnp
    >>> q = quantize(jnp.full((1, 32), 3.0), QuantSpec(granularity="mx"))
    >>> d = dequantized(q)
    >>> d.payload.dtype, float(d.dequantize()[0, 0]), int(d.scale[0, 0])
    (dtype(bfloat16), 3.0, 120)
  """
  if q.dequantized:
    return q
  values = q._padded_values()  # noqa: SLF001
  return dataclasses.replace(q, payload=values.astype(jnp.bfloat16),
                             dequantized=True)


def widened(q: QTensor) -> QTensor:
  """``q`` with its packed FP6/FP4 codes as an unpacked E4M3 payload, exactly
  (every E2M1, E2M3 and E3M2 value is an E4M3 value): the operand cuDNN's
  block-scaled GEMM takes for them, as the GPU's one-pass MXFP6 kernel
  (`qlayers.cast_transpose.mx_cast_transpose`) writes it. Any other ``q``
  is returned as it is.

  Example:
    >>> import jax.numpy as jnp
    >>> q = quantize(jnp.array([[1.5, -28.0] * 16]),
    ...              QuantSpec(format="e3m2", granularity="mx"))
    >>> w = widened(q)
    >>> same = bool((w.dequantize() == q.dequantize()).all())
    >>> w.payload.dtype, w.payload.shape, same
    (dtype(float8_e4m3fn), (1, 32), True)
  """
  if not q.fmt.packed or q.payload.dtype != jnp.uint8 or q.dequantized:
    return q
  return dataclasses.replace(
      q, payload=q.elements(jnp.float32).astype(jnp.float8_e4m3fn))


def _cast(values, fmt: Format, key):
  """Saturating cast of pre-scaled values to the payload representation."""
  codes = formats.cast(values, fmt, key=key)
  if fmt.packed:
    return formats.pack(codes, fmt)
  return codes


def quantize(x: jax.Array, spec: QuantSpec, axis: int = -1, *,
             amax: jax.Array | None = None,
             key: jax.Array | None = None) -> QTensor:
  """Quantizes the operand ``x`` along ``axis`` as ``spec`` says.

  The one quantize entry point: every GEMM operand, whatever its recipe,
  granularity or scaling (current or delayed), is quantized by this.

  Args:
    x: FP32/BF16/FP16 array (jax or numpy) of any rank.
    spec: a `QuantSpec`: element format, granularity and scale rule.
    axis: the int axis quantized along: the contraction axis of the GEMM that
      consumes ``x``. FP6/FP4 payloads are packed along the last axis, so
      they need ``axis=-1`` (transpose first).
    amax: per-tensor granularity (and the per-tensor level of ``nvfp4``)
      only: a precomputed whole-tensor amax (FP32 scalar) to compute the
      scale from, instead of ``max |x|`` (current scaling, the default): the
      amax of a delayed-scaling history (`delayed_amax`), or under a mesh the
      global amax of a tensor of which ``x`` is the local shard. A
      non-finite amax gives a NaN scale, so the operand, and any GEMM of it,
      is non-finite.
    key: PRNG key for stochastic rounding; required when ``spec.rounding ==
      "stochastic"``. A key given rounds stochastically whatever
      ``spec.rounding`` says: pass ``None`` for round-to-nearest-even.

  Returns:
    A `QTensor` with ``shape == x.shape``, ``axis`` in ``[0, x.ndim)`` and:

    * ``payload``: ``x`` scaled and cast, zero-padded at the end of each dim
      to whole blocks (``padded_shape``): FP8 of that shape, or for FP6/FP4
      uint8 codes packed along the last axis (4 bits: 2 per byte; 6 bits: 4
      per 3 bytes).
    * ``scale``: dequantization factors: FP32 ``()`` per tensor; per row,
      tile or block an FP32 grid of ``x.ndim`` dims, ``padded_shape[i] //
      block[i]`` along dim ``i``; per MX block, that grid as uint8 E8M0
      codes.

    ``dequantize()`` approximates ``x`` in its own shape.

  Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.ones((4, 64))
    >>> qt = quantize(x, QuantSpec(format="e2m1", granularity="mx"))
    >>> qt.payload.shape, qt.scale.shape, qt.scale.dtype
    ((4, 32), (4, 2), dtype('uint8'))
    >>> qt = quantize(x, QuantSpec(format="e4m3"), amax=jnp.float32(2.0))
    >>> qt.scale, qt.dequantize().shape
    (Array(0.00446429, dtype=float32), (4, 64))
  """
  # Argument types first (Python checks at trace time, no ops): a wrong one
  # would otherwise fail deep inside, or (a float axis) be stored.
  if not isinstance(spec, QuantSpec):
    raise TypeError(f"quantize: spec must be a QuantSpec (e.g. "
                    f"QuantSpec(format='e4m3')), got {type(spec).__name__} "
                    f"{spec!r}.")
  if not (hasattr(x, "dtype") and hasattr(x, "shape")):
    raise TypeError(f"quantize: x must be an array (jax or numpy), got "
                    f"{type(x).__name__}; wrap it in jnp.asarray.")
  try:
    axis = operator.index(axis)
  except TypeError:
    raise TypeError(f"quantize: axis must be an int, got "
                    f"{type(axis).__name__} {axis!r}.") from None
  if amax is not None and jnp.shape(amax) != ():
    raise ValueError(f"quantize: amax must be a scalar (the whole tensor's "
                     f"amax), got shape {jnp.shape(amax)}.")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"quantize expects a floating-point input, got {x.dtype}.")
  fmt = spec.fmt
  axis = blocks.normalize_axis(axis, x.ndim)
  if spec.stochastic and key is None:
    raise ValueError("Stochastic rounding needs a PRNG `key`.")
  if fmt.packed and axis != x.ndim - 1:
    raise ValueError(
        f"{fmt.name} payloads are packed along the last axis: quantize along "
        f"axis -1 (got axis {axis}); transpose the tensor first.")
  block = blocks.block_shape(x.shape, spec, axis)
  nvfp4 = spec.scale_rule == "nvfp4"
  if block is not None and amax is not None and not nvfp4:
    raise ValueError(
        f"amax= applies to per-tensor granularity only, not "
        f"{spec.granularity!r} (and to scale_rule 'nvfp4', whose second "
        "level is per tensor): each block is scaled by its own amax.")
  return _quantize(x, spec, axis, amax, key)


# Jitted with the spec and axis static: a train step quantizes the same
# shapes in every layer, and jit traces and lowers each signature once
# (inlined into the caller's program, so the compiled program is the same).
@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize(x, spec: QuantSpec, axis: int, amax, key) -> QTensor:
  """`quantize` of checked arguments."""
  fmt = spec.fmt
  xf = x.astype(jnp.float32)
  block = blocks.block_shape(x.shape, spec, axis)

  # Amaxes are taken of ``x`` in its own dtype (exact: max |x| is one of its
  # values), so XLA fuses the FP32 upcast into each consumer instead of
  # materializing an FP32 copy of ``x``.
  if block is None:
    a = blocks.amax(x) if amax is None else jnp.asarray(amax, jnp.float32)
    mult, scale = scale_rules.unit_scales(a, spec)
    payload = _cast(xf * mult, fmt, key)
    return QTensor(payload, scale, fmt.name, spec.granularity, None, axis,
                   tuple(x.shape))

  nvfp4 = spec.scale_rule == "nvfp4"
  padded = blocks.padded_shape(x.shape, block)
  xp = blocks.pad_to(xf, padded)
  block_amax = blocks.block_amax(blocks.pad_to(x, padded),
                                 block).astype(jnp.float32)
  levels = {}
  if nvfp4:
    # The tensor's amax is the largest block amax (padding adds zeros).
    tensor_amax = jnp.asarray(
        amax if amax is not None else jnp.max(block_amax)
        if block_amax.size else 0.0, jnp.float32)
    mult, scale, e4m3 = scale_rules.nvfp4_scales(block_amax, tensor_amax)
    # The two levels apart (``scale`` is their product): S_dec as
    # `nvfp4_scales` computes it, and the E4M3 block scales (exact).
    levels = dict(block_scale=e4m3.astype(jnp.float8_e4m3fn),
                  tensor_scale=scale_rules.rdivide_rn(
                      1.0, scale_rules.nvfp4_encode_scale(tensor_amax)))
  else:
    mult, scale = scale_rules.unit_scales(block_amax, spec)
  payload = _cast(blocks.apply_blocks(
      xp, mult, block, _scale_packed if fmt.packed else jnp.multiply), fmt,
                  key)
  return QTensor(payload, scale, fmt.name, spec.granularity, block, axis,
                 tuple(x.shape), **levels)


def _scale_packed(x, mult):
  """``x * mult``, and zero where ``mult`` is 0: in a block with a NaN scale
  (its multiplier 0), whose FP4/FP6 codes are then all zero, whatever its
  Inf or NaN elements and the platform's NaN. (GPU kernels convert NaN to
  the largest code: `qlayers.cast_transpose`.)"""
  return jnp.where(mult == 0, 0.0, x * mult)


def bytes_per_element(spec: QuantSpec | None, compute_bytes: int = 2) -> float:
  """Storage bytes per element of a quantized operand (payload + scales).

  Example:
    >>> bytes_per_element(QuantSpec(format="e2m1", granularity="mx"))
    0.53125
  """
  if spec is None:
    return float(compute_bytes)
  fmt = spec.fmt
  b = fmt.bits / 8
  if spec.scale_rule == "nvfp4":  # E4M3 block scales (+ one FP32 scalar)
    return b + 1 / (spec.block_size * (spec.block_size
                                       if spec.granularity == "block" else 1))
  if spec.granularity == "mx":
    return b + 1 / spec.block_size
  if spec.granularity in ("tile",):
    return b + 4 / spec.block_size
  if spec.granularity == "block":
    return b + 4 / spec.block_size**2
  return b

