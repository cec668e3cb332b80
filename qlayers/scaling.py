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

Scale rules:

* ``te``: ``scale = amax * 2**margin / max`` (TE convention); optional
  power-of-two (``pow2``: the multiplier rounded down, so the scale rounds
  up). A zero amax gives scale 1; a non-finite amax a NaN scale (the
  operand holds Inf/NaN, and so does every GEMM of it).
* ``deepseek``: ``scale = max(amax, 1e-4) / max`` (DeepSeek-V3 report, sec.
  3.3), or with ``pow2`` the same rounded up to a power of two (UE8M0).
* ``mx_floor``: OCP MX v1.0 sec. 6.3: ``2**(floor(log2 amax) - emax_elem)``.
* ``mx_rceil``: ``2**ceil(log2(amax / max))`` (round the exponent of
  ``amax / max`` up when its mantissa is non-zero; the rule of TE/cuBLAS).
  Both MX rules give code 0 (2**-127) to an all-zero block and the NaN code
  0xFF to a block holding Inf or NaN.

Non-multiple shapes are padded with zeros up to the block grid; the payload
keeps the padded shape (``QTensor.padded_shape``) and ``QTensor.shape`` is the
original one.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from qlayers import formats
from qlayers.formats import Format

__all__ = [
    "QuantSpec",
    "QTensor",
    "quantize",
    "amax",
    "te_scale",
    "e8m0_decode",
    "ScaleState",
    "init_scale_state",
    "history_amax",
    "delayed_amax",
    "update_scales",
    "mx_scale_codes",
]

Granularity = Literal["tensor", "row", "tile", "block", "mx"]
ScaleRule = Literal["te", "deepseek", "mx_floor", "mx_rceil"]

_DEFAULT_BLOCK = {"tile": 128, "block": 128, "mx": 32}
_DEFAULT_RULE = {"tensor": "te", "row": "te", "tile": "deepseek",
                 "block": "deepseek", "mx": "mx_rceil"}
# DeepSeek-V3's floor on the amax of a tile/block before dividing by max.
_DEEPSEEK_AMAX_FLOOR = 1e-4
_MX_ELEMENT_FORMATS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantSpec:
  """How to quantize one GEMM operand.

  Attributes:
    format: element format name (see `qlayers.formats.FORMATS`).
    granularity: ``tensor`` | ``row`` | ``tile`` | ``block`` | ``mx``.
    block_size: tile/block/MX block length (defaults 128/128/32).
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
    fmt = formats.get_format(self.format)
    object.__setattr__(self, "format", fmt.name)
    if fmt is formats.E8M0:
      raise ValueError("E8M0 is a scale format, not an element format.")
    if self.granularity not in _DEFAULT_RULE:
      raise ValueError(
          f"Unknown granularity {self.granularity!r}; expected one of "
          f"{sorted(_DEFAULT_RULE)}.")
    if self.block_size is None:
      object.__setattr__(self, "block_size",
                         _DEFAULT_BLOCK.get(self.granularity))
    if self.scale_rule is None:
      object.__setattr__(self, "scale_rule", _DEFAULT_RULE[self.granularity])
    rule, gran = self.scale_rule, self.granularity
    if rule not in ("te", "deepseek", "mx_floor", "mx_rceil"):
      raise ValueError(f"Unknown scale_rule {rule!r}.")
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
    if gran in _DEFAULT_BLOCK and (self.block_size is None
                                   or self.block_size <= 0):
      raise ValueError(f"block_size must be positive, got {self.block_size}.")
    if fmt.bits == 6 and gran == "mx" and self.block_size % 4:
      raise ValueError("FP6 packs 4 values in 3 bytes: block_size must be a "
                       "multiple of 4.")
    if self.margin < 0:
      raise ValueError(f"margin must be >= 0, got {self.margin}.")
    if self.margin and rule != "te":
      raise ValueError("margin applies to the 'te' scale rule only.")
    if self.pow2 and rule.startswith("mx_"):
      raise ValueError("MX scales are powers of two already; drop pow2.")
    if self.rounding not in ("nearest", "stochastic"):
      raise ValueError(f"Unknown rounding {self.rounding!r}.")

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
  return jnp.max(_split_blocks(jnp.abs(x), block), axis=_block_axes(block))


def _pad(x: jax.Array, padded: tuple[int, ...]) -> jax.Array:
  if padded == x.shape:
    return x
  return jnp.pad(x, [(0, p - n) for n, p in zip(x.shape, padded)])


# ----------------------------------------------------------------------------
# Scale rules


def amax(x: jax.Array) -> jax.Array:
  """max |x| as FP32 (NaN if ``x`` holds a NaN)."""
  return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _pow2_up(v: jax.Array) -> jax.Array:
  """Smallest power of two >= v (for positive finite v), exactly."""
  m, e = jnp.frexp(v)  # v = m * 2**e, m in [0.5, 1)
  e = jnp.where(m == 0.5, e - 1, e)
  return jnp.ldexp(jnp.ones_like(v), e)


def te_scale(amax_value: jax.Array, prev_scale: jax.Array, fmt: Format, *,
             margin: int = 0, pow2: bool = False) -> jax.Array:
  """TE per-tensor scale (dequantization factor) from ``amax``.

  ``scale = amax * 2**margin / max``; zero or non-finite amax keeps
  ``prev_scale``. With ``pow2`` the scale is rounded up to a power of two (the
  TE multiplier rounded down).
  """
  a = jnp.asarray(amax_value, jnp.float32)
  s = a * (2.0**margin) / fmt.max
  if pow2:
    s = _pow2_up(s)
  ok = (a > 0) & jnp.isfinite(a) & (s > 0) & jnp.isfinite(s)
  return jnp.where(ok, s, jnp.asarray(prev_scale, jnp.float32))


def _deepseek_scale(a: jax.Array, fmt: Format, pow2: bool) -> jax.Array:
  s = jnp.maximum(a, _DEEPSEEK_AMAX_FLOOR) / fmt.max
  if pow2:
    s = _pow2_up(s)
  return jnp.where(jnp.isfinite(a), s, 1.0).astype(jnp.float32)


def mx_scale_codes(amax_value: jax.Array, fmt: Format,
                   rule: str = "mx_rceil") -> jax.Array:
  """E8M0 codes (uint8) of MX block scales from per-block amax.

  FLOOR (OCP MX v1.0): ``e = floor(log2 amax) - emax_elem``.
  RCEIL: ``e = ceil(log2(amax / max))`` with ``amax / max`` an FP32 division.
  Zero blocks get code 0 (2**-127); Inf/NaN blocks get 0xFF.
  """
  a = amax_value.astype(jnp.float32)
  if rule == "mx_floor":
    _, e = jnp.frexp(a)
    e = e - 1 - fmt.emax
  elif rule == "mx_rceil":
    m, e = jnp.frexp(a / fmt.max)
    e = jnp.where(m == 0.5, e - 1, e)
  else:
    raise ValueError(f"{rule!r} is not an MX scale rule.")
  code = jnp.clip(e, -127, 127) + 127
  code = jnp.where(a == 0, 0, code)
  code = jnp.where(jnp.isfinite(a), code, 255)
  return code.astype(jnp.uint8)


def e8m0_decode(codes: jax.Array) -> jax.Array:
  """FP32 values ``2**(code - 127)``; code 0xFF is NaN.

  Never ``astype(float8_e8m0fnu)`` a float: that rounds to nearest and maps 0
  to NaN. Note XLA on CPU flushes FP32 subnormals, so code 0 (2**-127) reads
  as 0 there; its blocks are all-zero anyway.
  """
  c = codes.astype(jnp.int32)
  v = jnp.ldexp(jnp.ones(c.shape, jnp.float32), c - 127)
  return jnp.where(c == 255, jnp.nan, v)


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
                 algo: str = "max") -> tuple[jax.Array, jax.Array]:
  """One use of a delayed-scaling role: ``(amax to scale by, new running amax)``.

  The amax to scale by comes from the history of completed steps; while the
  history is still empty (the first step), it is the running amax of this
  step including ``current``, so the first step does not quantize with a
  scale of 1 (which flushes small gradients in E5M2). A non-finite
  ``current`` (the operand holds Inf/NaN) is returned as the amax to scale
  by, which makes the quantized operand, and so its GEMM, non-finite, but it
  never enters the running amax.
  """
  current = jnp.asarray(current, jnp.float32)
  finite = jnp.isfinite(current)
  running = jnp.where(finite, jnp.maximum(state.amax, current), state.amax)
  stored = history_amax(state.amax_history, algo)
  use = jnp.where(stored > 0, stored, running)
  return jnp.where(finite, use, current), running


def update_scales(state: ScaleState) -> ScaleState:
  """Ends a step: the running amax enters the history (rolled one step, index
  0 most recent) and is cleared.

  A non-finite running amax is recorded as 0 ("no information"), so one bad
  step cannot poison the next ``history_len`` scales. Leading axes (stacked
  layers) are batched.
  """
  a = jnp.asarray(state.amax, jnp.float32)
  a = jnp.where(jnp.isfinite(a), a, 0.0)
  history = jnp.roll(state.amax_history, 1, axis=-1).at[..., 0].set(a)
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
    scale = te_scale(a, 1.0, fmt, margin=spec.margin, pow2=spec.pow2)
    scale = jnp.where(jnp.isfinite(a), scale, jnp.nan)
    payload = _cast(xf * (1.0 / scale), fmt, key)
    return QTensor(payload, scale, fmt.name, spec.granularity, None, axis,
                   tuple(x.shape))

  if tensor_amax is not None:
    raise ValueError("tensor_amax applies to per-tensor granularity only.")
  padded = _padded_shape(x.shape, block)
  xp = _pad(xf, padded)
  block_amax = _block_amax(_pad(x, padded), block).astype(jnp.float32)
  if spec.granularity == "mx":
    scale = mx_scale_codes(block_amax, fmt, spec.scale_rule)
    inv = e8m0_decode(254 - scale.astype(jnp.int32))  # 2**-e, exact
    inv = jnp.where(scale == 255, 0.0, inv)
  else:
    if spec.scale_rule == "te":
      scale = te_scale(block_amax, 1.0, fmt, margin=spec.margin,
                       pow2=spec.pow2)
    else:
      scale = _deepseek_scale(block_amax, fmt, spec.pow2)
    inv = 1.0 / scale
  payload = _cast(_apply_blocks(xp, inv, block, jnp.multiply), fmt, key)
  return QTensor(payload, scale, fmt.name, spec.granularity, block, axis,
                 tuple(x.shape))


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

