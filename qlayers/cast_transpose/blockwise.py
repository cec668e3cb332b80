"""Block-scaled FP8 and FP6 copies of ``t (R, C)``: MX blocks of 32,
DeepSeek-V3's 1 x 128 tiles and 128 x 128 weight blocks.

The two copies of an MX operand differ in more than layout: one has a scale
per 32 elements of a row, the other per 32 of a column. Each is otherwise a
pass of its own over the wide tensor; `mx_cast_transpose` reads a 32 x 32
tile once and writes both copies (the column-blocked one transposed,
contraction-last as cuDNN's block-scaled GEMM takes it) and their E8M0
scales; for MXFP6 it writes each FP6 value as the E4M3 value it is, the
payload cuDNN's block-scaled GEMM takes (`qlayers.scaling.widened`). With
128 x 128 tiles it makes DeepSeek-V3's 1 x 128 tile copies, with
power-of-two scales (`deepseek_v3_ue8m0`, which Blackwell runs as MXFP8) or
with DeepSeek-V3's own (`deepseek_v3` on Hopper's blockwise GEMM: the
scale's division by the format's max in integer steps, its reciprocal by
PTX ``rcp.rn.f32``), and `block_cast_transpose` the 128 x 128 weight
blocks in both layouts.

The payloads are written as uint32 words of four bytes, which XLA views as
the bytes (`qlayers.cast_transpose._lanes.words_to_bytes`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qlayers import formats
from qlayers import partition
from qlayers import scale_rules
from qlayers.cast_transpose import _base
from qlayers.cast_transpose import _lanes
from qlayers.formats import Format

__all__ = ["MX_BLOCK", "TILE_BLOCK", "mx_supported", "mx_cast_transpose",
           "block_cast_transpose"]


MX_BLOCK = 32
TILE_BLOCK = 128


def mx_supported(shape: tuple[int, ...], fmt: Format, block_size: int) -> bool:
  """Whether `mx_cast_transpose` takes a 2-D ``shape`` tensor: whole
  ``block_size`` x ``block_size`` tiles of an FP8 element format in blocks
  of 32 (MX) or 128 (DeepSeek-V3 tiles), or of an FP6 one in blocks of 32
  (MXFP6)."""
  return (((block_size in (MX_BLOCK, TILE_BLOCK) and _base.is_fp8(fmt))
           or (block_size == MX_BLOCK and fmt.bits == 6))
          and _base.whole_tiles(shape, block_size))


def _block_scale(mag_max, fmt: Format, rule: str, interpret: bool):
  """(multiplier, what the QTensor stores: `_base.scales_out`'s input) of the
  blocks whose magnitude-bits max is ``mag_max``; `_block_values` or
  `_block_words` casts the scaled values.

  ``rule`` ``mx_floor``/``mx_rceil``: `qlayers.scale_rules.unit_scales` for
  MX (a NaN code multiplies by 0). ``deepseek_pow2``: DeepSeek-V3's scale
  ``max(amax, 1e-4) / 448`` correctly rounded, then up to a power of two
  (`scale_rules.deepseek_scale` with ``pow2``). That power is the RCEIL
  exponent of ``max(amax, 1e-4)``: an FP32 ``m`` has ``fl(m / max) <= 2**k``
  exactly when ``m <= max * 2**k`` (the next FP32 above ``max * 2**k`` is
  more than half an ulp of ``2**k`` away from it once divided), so it is
  read off the bits too; a non-finite tile multiplies by NaN, as the
  division by its NaN scale does. ``deepseek``: DeepSeek-V3's own FP32
  scale (`scale_rules.deepseek_scale`: its division by the constant is
  integer steps, which Triton compiles), multiplied by its correctly
  rounded reciprocal, as `scale_rules.unit_scales`; NaN for a non-finite
  tile.
  """
  if rule == "deepseek":
    scale = scale_rules.deepseek_scale(
        jax.lax.bitcast_convert_type(mag_max, jnp.float32), fmt, pow2=False)
    return _base.reciprocal(scale, interpret), scale
  return _base.pow2_multiplier(mag_max, fmt, rule)


def _block_values(x, mult, fmt: Format, interpret: bool):
  """The payload of scaled FP32 ``x`` (multiplier ``mult``): its saturating
  FP8 cast, or for FP6 its grid's values as E4M3
  (`qlayers.scaling.widened`; zeros in a block with a NaN scale)."""
  if fmt.bits == 6:
    return _lanes.zero_where_nan_scale(formats.round_on_grid(x, fmt),
                                 mult).astype(jnp.float8_e4m3fn)
  return _base.saturating_cast(x, fmt, interpret)


def _block_words(x, mult, fmt: Format, interpret: bool, hardware: bool):
  """`_block_values` of ``x (..., 4m)`` as uint32 words of four payload
  bytes along the last axis (byte ``j`` of word ``i``: element ``4i +
  j``), ``(..., m)``."""
  return _block_word(_lanes.quarters_last(x), mult, fmt, interpret, hardware)


# PTX's two-value conversions put their first source in the high half of
# the result (PTX ISA, cvt: ".e4m3x2", ".e2m3x2"), so the odd element goes
# first. FP6 NaN converts to the largest positive value (CUDA's cuda_fp6.hpp
# says so of its host twin); a kernel's NaN comes only from a block with a
# NaN scale, whose FP6 payload it writes as zeros
# (`_lanes.zero_where_nan_scale`).
_FP8X4 = ("{ .reg .b16 lo, hi; "
          "cvt.rn.satfinite.FMTx2.f32 lo, $2, $1; "
          "cvt.rn.satfinite.FMTx2.f32 hi, $4, $3; "
          "mov.b32 $0, {lo, hi}; }")
# FP6 to FP16 and FP16 to E4M3 are exact.
_FP6X4 = ("{ .reg .b16 p0, p1, lo, hi; .reg .b32 h0, h1; "
          "cvt.rn.satfinite.FMTx2.f32 p0, $2, $1; "
          "cvt.rn.f16x2.FMTx2 h0, p0; "
          "cvt.rn.satfinite.e4m3x2.f16x2 lo, h0; "
          "cvt.rn.satfinite.FMTx2.f32 p1, $4, $3; "
          "cvt.rn.f16x2.FMTx2 h1, p1; "
          "cvt.rn.satfinite.e4m3x2.f16x2 hi, h1; "
          "mov.b32 $0, {lo, hi}; }")


def _block_word(parts, mult, fmt: Format, interpret: bool, hardware: bool):
  """`_block_values` of four FP32 arrays as one uint32 array, ``parts[j]``
  in byte ``j``. ``hardware``: by PTX conversions, two per word
  (`_FP8X4`; FP6 through FP16, `_FP6X4`)."""
  if not hardware:
    return functools.reduce(jnp.bitwise_or, (
        jax.lax.bitcast_convert_type(_block_values(
            p, mult, fmt, interpret), jnp.uint8).astype(jnp.uint32) << (8 * j)
        for j, p in enumerate(parts)))
  from jax.experimental.pallas import triton as plgpu
  ptx = (_FP6X4 if fmt.bits == 6 else _FP8X4).replace("FMT", fmt.name)
  (w,) = plgpu.elementwise_inline_asm(
      ptx, args=list(parts), constraints="=r" + ",f" * 4, pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(parts[0].shape, jnp.int32)])
  w = jax.lax.bitcast_convert_type(w, jnp.uint32)
  return _lanes.zero_where_nan_scale(w, mult) if fmt.bits == 6 else w


def _block_kernel(t_ref, q_ref, s_ref, qt_ref, st_ref, *, fmt: Format,
                  rule: str, interpret: bool, dequantized=(False, False),
                  hardware: bool = False):
  """One ``b x b`` tile ``v``: the copy of ``v`` and that of ``v.T``
  (`write_copy`)."""
  v = t_ref[...].astype(jnp.float32)
  for y, q, sc, dq in ((v, q_ref, s_ref, dequantized[0]),
                       (v.T, qt_ref, st_ref, dequantized[1])):
    write_copy(y, q, sc, fmt=fmt, rule=rule, interpret=interpret,
               dequantized=dq, hardware=hardware)


def write_copy(y, q, sc, *, fmt: Format, rule: str, interpret: bool,
               dequantized: bool = False, hardware: bool = False):
  """Writes the copy of FP32 ``y (b, b)`` along its rows' blocks to ``q``,
  as words of four payload bytes (`_block_words`) or dequantized to BF16,
  and its scales to ``sc``."""
  b = y.shape[0]
  if dequantized or fmt.bits == 8:
    # FP8 (and DeepSeek's tiles) by reductions: apart, MXFP8's blocks save
    # 10% of the kernel's instructions (0.5% of a predicted step) for
    # nearly three times the train step's traced operations, which its
    # compile time pays (benchmarks/RESULTS.md).
    # Block amaxes from the magnitude bits, as qlayers.blocks does: exact,
    # and an Inf or NaN element gives the 0xFF code.
    mult, s = _block_scale(jnp.max(_base.fp32_bits(y), axis=1, keepdims=True),
                           fmt, rule, interpret)
    x = y * mult
    q[...] = (_dequantized(_block_values(x, mult, fmt, interpret), s)
              if dequantized else _block_words(x, mult, fmt, interpret,
                                               hardware))
    sc[...] = _base.scales_out(s, rule)
    return
  # An MXFP6 block's 32 elements apart: its amax and words in registers.
  parts = _lanes.split_last(y)
  mag = functools.reduce(jnp.maximum,
                         (_base.fp32_bits(p) for p in parts))
  mult, s = _block_scale(mag, fmt, rule, interpret)
  q[...] = _lanes.join_last([
      _block_word([p * mult for p in parts[k:k + 4]], mult, fmt, interpret,
                  hardware) for k in range(0, b, 4)])
  sc[...] = _base.scales_out(s, rule)[:, None]


def _dequantized(q, codes):
  """BF16 ``q * 2**(code - 127)`` (its block's E8M0 scale; NaN for code
  255), as `qlayers.scaling.dequantized` computes it: the product in FP32,
  then rounded to BF16."""
  return (q.astype(jnp.float32) * scale_rules.e8m0_decode(codes)
          ).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("fmt", "rule", "block_size",
                                             "dequantized", "interpret"))
def mx_cast_transpose(t: jax.Array, fmt: Format | str, rule: str, *,
                      block_size: int = MX_BLOCK,
                      dequantized: tuple[bool, bool] = (False, False),
                      interpret: bool = False):
  """Both block-scaled copies of ``t (R, C)`` in one pass: ``(q, s, qt, st)``.

  ``q (R, C)`` with scales ``s (R, C / b)`` is ``t`` quantized along its
  rows' ``b``-blocks (`qlayers.scaling.quantize` along axis 1); ``qt (C, R)``
  with ``st (C, R / b)`` is ``t`` quantized along its columns' blocks (along
  axis 0), transposed. ``dequantized`` (for ``q``, for ``qt``; MX rules):
  that copy holds its BF16 dequantized values instead
  (`qlayers.scaling.dequantized`), for a GEMM on a GPU without MX tensor
  cores.

  Args:
    t: 2-D BF16/FP16/FP32 array, both dims multiples of ``block_size``.
    fmt: an FP8 element format (``"e4m3"``, ``"e5m2"``), or FP6
      (``"e2m3"``, ``"e3m2"``; MX rules), whose values are written as E4M3:
      `qlayers.scaling.widened`'s payload.
    rule: ``"mx_floor"``/``"mx_rceil"`` (MX: E8M0 codes, blocks of 32),
      ``"deepseek"`` (DeepSeek-V3 tiles of 128, `deepseek_v3`: FP32 scales)
      or ``"deepseek_pow2"`` (the same with power-of-two scales,
      `deepseek_v3_ue8m0`).
    block_size: 32 (MX) or 128 (DeepSeek-V3 tiles).
    interpret: run in Pallas' interpreter (any platform; for tests).

  Example:
    >>> import jax.numpy as jnp
    >>> q, s, qt, st = mx_cast_transpose(jnp.ones((32, 64)), "e4m3",
    ...                                  "mx_rceil", interpret=True)
    >>> s.shape, qt.shape, st.shape, int(s[0, 0])
    ((32, 2), (64, 32), (64, 1), 119)
  """
  fmt = formats.get_format(fmt)
  b = block_size
  if not mx_supported(t.shape, fmt, b):
    raise ValueError(f"mx_cast_transpose takes a 2-D tensor whose dims are "
                     f"multiples of its blocks ({MX_BLOCK} or {TILE_BLOCK}, "
                     f"got {b}) and an FP8 format (FP6: blocks of "
                     f"{MX_BLOCK}); got {t.shape} and {fmt.name}.")
  dequantized = tuple(bool(d) for d in dequantized)
  if len(dequantized) != 2:
    raise ValueError(f"mx_cast_transpose's dequantized takes one flag per "
                     f"copy (2), got {dequantized!r}.")
  if (fmt.bits == 6 or any(dequantized)) and not rule.startswith("mx_"):
    raise ValueError(f"mx_cast_transpose takes FP6 or dequantized copies "
                     f"with an MX scale rule ('mx_rceil', 'mx_floor'), got "
                     f"{rule!r}.")
  q, s, qt, st = partition.cast(
      _mx_call, (fmt, rule, b, dequantized,
                 _base.ptx_converts(fmt, interpret), interpret), t,
      layouts=(((("r", 1), ("c", 1)) if dequantized[0] else
                (("r", 1), ("c", 4))), (("r", 1), ("c", b)),
               ((("c", 1), ("r", 1)) if dequantized[1] else
                (("c", 1), ("r", 4))), (("c", 1), ("r", b))), block=(b, b))
  payload = _base.payload_dtype(fmt)
  q, qt = (p if d else jax.lax.bitcast_convert_type(
      _lanes.words_to_bytes(p), payload)
           for p, d in ((q, dequantized[0]), (qt, dequantized[1])))
  return q, s, qt, st


def _mx_call(shape: tuple[int, int], fmt: Format, rule: str, b: int,
             dequantized: tuple[bool, bool], hardware: bool,
             interpret: bool):
  """`mx_cast_transpose`'s kernel for a ``shape`` tensor: each copy as
  words of four payload bytes, or dequantized (BF16)."""
  pl, plt = _base.pallas()
  rows, cols = shape
  sdtype = jnp.float32 if rule.startswith("deepseek") else jnp.uint8

  def copy(r, c, dq):  # an (r, c) copy's shape and dtype, its tiles' shape
    return (jax.ShapeDtypeStruct((r, c), jnp.bfloat16), (b, b)) if dq else (
        jax.ShapeDtypeStruct((r, c // 4), jnp.uint32), (b, b // 4))

  (q, q_tile), (qt, qt_tile) = (copy(rows, cols, dequantized[0]),
                                copy(cols, rows, dequantized[1]))
  return pl.pallas_call(
      functools.partial(_block_kernel, fmt=fmt, rule=rule,
                        interpret=interpret, dequantized=dequantized,
                        hardware=hardware),
      grid=(rows // b, cols // b),
      in_specs=[pl.BlockSpec((b, b), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec(q_tile, lambda i, j: (i, j)),
                 pl.BlockSpec((b, 1), lambda i, j: (i, j)),
                 pl.BlockSpec(qt_tile, lambda i, j: (j, i)),
                 pl.BlockSpec((b, 1), lambda i, j: (j, i))],
      out_shape=[q, jax.ShapeDtypeStruct((rows, cols // b), sdtype),
                 qt, jax.ShapeDtypeStruct((cols, rows // b), sdtype)],
      compiler_params=plt.CompilerParams(num_warps=1 if b <= 32 else 8),
      interpret=interpret, name="qlayers_mx_cast_transpose")


def _square_kernel(t_ref, q_ref, s_ref, qt_ref, *, fmt: Format, rule: str,
                   interpret: bool):
  v = t_ref[...].astype(jnp.float32)
  mag = jax.lax.bitcast_convert_type(v, jnp.uint32) & 0x7FFFFFFF
  tile_max = jnp.max(jnp.max(mag, axis=1, keepdims=True), axis=0,
                     keepdims=True)
  mult, c = _block_scale(tile_max, fmt, rule, interpret)
  q = _block_values(v * mult, mult, fmt, interpret)
  q_ref[...] = q
  qt_ref[...] = q.T
  s_ref[...] = _base.scales_out(c, rule)


@functools.partial(jax.jit, static_argnames=("fmt", "block_size", "pow2",
                                             "interpret"))
def block_cast_transpose(t: jax.Array, fmt: Format | str, *,
                         block_size: int = TILE_BLOCK, pow2: bool = True,
                         interpret: bool = False):
  """``t (R, C)`` quantized in square ``block_size`` blocks with
  DeepSeek-V3's scales (``pow2``: power-of-two, `deepseek_v3_ue8m0`'s
  weights; else `deepseek_v3`'s), in both layouts at once: ``(q, s, qt)``,
  ``s (R / b, C / b)`` FP32.

  Square blocks quantize ``t`` and ``t.T`` alike, so one scale per block
  serves both copies (`qlayers.scaling.quantize` along either axis).

  Example:
    >>> import jax.numpy as jnp
    >>> q, s, qt = block_cast_transpose(jnp.ones((128, 256)), "e4m3",
    ...                                 interpret=True)
    >>> s.shape, qt.shape, float(s[0, 0]) == 2.0**-8
    ((1, 2), (256, 128), True)
  """
  fmt = formats.get_format(fmt)
  b = block_size
  if not mx_supported(t.shape, fmt, b) or b != TILE_BLOCK:
    raise ValueError(f"block_cast_transpose takes a 2-D tensor whose dims "
                     f"are multiples of {TILE_BLOCK} and an FP8 format; got "
                     f"{t.shape}, blocks of {b} and {fmt.name}.")
  return tuple(partition.cast(
      _block_call, (fmt, pow2, interpret), t,
      layouts=(partition.LIKE_T, (("r", b), ("c", b)), partition.LIKE_T_T),
      block=(b, b)))


def _block_call(shape: tuple[int, int], fmt: Format, pow2: bool,
                interpret: bool):
  """`block_cast_transpose`'s kernel for a ``shape`` tensor."""
  pl, plt = _base.pallas()
  rows, cols = shape
  b = TILE_BLOCK
  return pl.pallas_call(
      functools.partial(_square_kernel, fmt=fmt,
                        rule="deepseek_pow2" if pow2 else "deepseek",
                        interpret=interpret),
      grid=(rows // b, cols // b),
      in_specs=[pl.BlockSpec((b, b), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((b, b), lambda i, j: (i, j)),
                 pl.BlockSpec((1, 1), lambda i, j: (i, j)),
                 pl.BlockSpec((b, b), lambda i, j: (j, i))],
      out_shape=[jax.ShapeDtypeStruct((rows, cols), fmt.dtype),
                 jax.ShapeDtypeStruct((rows // b, cols // b), jnp.float32),
                 jax.ShapeDtypeStruct((cols, rows), fmt.dtype)],
      compiler_params=plt.CompilerParams(num_warps=8),
      interpret=interpret, name="qlayers_block_cast_transpose")
