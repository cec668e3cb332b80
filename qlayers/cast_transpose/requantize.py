"""An MX or NVFP4 copy requantized along its other axis, from its codes, in
one pass.

A frozen kernel (`qlayers.FrozenKernel`) stores the weight's copy for
Fprop, quantized along K. Dgrad contracts the weight over N, so a LoRA step
on a frozen base needs a second copy, quantized along N, of the same
values. Made by XLA's dequantization and the pair kernel
(`qlayers.cast_transpose.mx_cast_transpose`, `fp4_cast_transpose`), that
copy writes and reads the FP32 weight once more (11 bytes moved per weight
for MXFP8, against 2 here). `mx_requantize` reads each 32 x 32 tile of the
stored codes and their E8M0 scales once, decodes the values exactly in
FP32 (every MX value is one, as XLA's dequantization gives it: E4M3 by
Triton's conversion, E2M1 by Blackwell's or from the bits) and writes the
copy along the other axis with the pair kernels' own code
(`blockwise.write_copy`, `fp4.write_blocks`): the bits of
`qlayers.scaling.quantize` of the dequantized weight along N. MXFP6 codes,
packed four to three bytes (a tile row of 24 bytes, which Triton's
power-of-two blocks do not take), come widened to E4M3 by XLA first
(`qlayers.scaling.widened`), and the copy is written so too, as cuDNN's
GEMM takes it. `nvfp4_requantize` does the same for NVFP4's 16 x 16
blocks under the tensor amax that `nvfp4_amax` finds from the codes.
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
from qlayers.cast_transpose import blockwise
from qlayers.cast_transpose import fp4
from qlayers.cast_transpose import nvfp4
from qlayers.cast_transpose.blockwise import MX_BLOCK
from qlayers.formats import Format

__all__ = ["requantize_supported", "mx_requantize", "nvfp4_amax",
           "nvfp4_requantize"]


def requantize_supported(shape: tuple[int, ...], fmt: Format) -> bool:
  """Whether `mx_requantize` (`nvfp4_requantize`: E2M1) takes the stored
  values of a 2-D ``shape`` (unpacked): MXFP8 (E4M3), MXFP6 (E2M3, E3M2)
  or MXFP4 (E2M1) in whole 32 x 32 tiles."""
  return (fmt in (formats.E4M3, formats.E2M3, formats.E3M2, formats.E2M1)
          and _base.whole_tiles(shape, MX_BLOCK))


def _from_bits(bits):
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _e2m1_values(c):
  """FP32 values of E2M1 codes ``c`` (uint32, low four bits): exact, the
  sign of zero kept."""
  e, m = (c >> 1) & 3, c & 1
  normal = ((e + 126) << 23) | (m << 22)  # 2**(e - 1) * (1 + m / 2)
  bits = jnp.where(e == 0, m * jnp.uint32(0x3F000000), normal)  # 0 or 0.5
  return _from_bits(bits | ((c & 8) << 28))


# Blackwell's conversion of a byte's two E2M1 codes to FP16 (PTX ISA, cvt:
# ".e2m1x2", sm_100a; the high nibble to the high half), exact, the sign of
# zero kept.
_E2M1X2_TO_F16X2 = ("{ .reg .b8 c; cvt.u8.u32 c, $1; "
                    "cvt.rn.f16x2.e2m1x2 $0, c; }")


def _e2m1_pairs(codes, hardware: bool):
  """FP32 values of the low and high E2M1 code of each byte of ``codes``
  (uint32, one byte each): by `_E2M1X2_TO_F16X2` where ``hardware``, else
  from their bits (`_e2m1_values`); the same values."""
  if not hardware:
    return _e2m1_values(codes & 15), _e2m1_values(codes >> 4)
  from jax.experimental.pallas import triton as plgpu
  (h,) = plgpu.elementwise_inline_asm(
      _E2M1X2_TO_F16X2, args=[jax.lax.bitcast_convert_type(codes, jnp.int32)],
      constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(codes.shape, jnp.int32)])
  h = jax.lax.bitcast_convert_type(h, jnp.uint32)
  return tuple(
      jax.lax.bitcast_convert_type(half.astype(jnp.uint16),
                                   jnp.float16).astype(jnp.float32)
      for half in (h & 0xFFFF, h >> 16))


def _requantize_kernel(s_ref, t_ref, q_ref, sc_ref, *, fmt: Format,
                       rule: str, interpret: bool, hardware: bool):
  """One 32 x 32 tile of the stored copy (its bytes: E4M3 codes, FP6
  values as E4M3 codes, or two E2M1 codes each, low nibble first; E8M0
  scales, one per row): its values, then the copy of their transpose along
  its rows' blocks."""
  if fmt is not formats.E2M1:  # exact: Triton's conversion, two at a time
    v = t_ref[...].astype(jnp.float32)
  else:  # element 2k + j of a row: nibble j of byte k
    codes = t_ref[...].astype(jnp.uint32)
    v = _lanes.join_last(list(_e2m1_pairs(codes, hardware))).reshape(
        codes.shape[0], 2 * codes.shape[1])
  # `QTensor.dequantize`'s product, the values times their block's scale,
  # after the transpose: a scale per column there costs Triton a third
  # fewer instructions than a scale per row before it (SASS for sm_100).
  y = v.T * scale_rules.e8m0_decode(s_ref[...]).reshape(1, -1)
  if fmt is not formats.E2M1:
    blockwise.write_copy(y, q_ref, sc_ref, fmt=fmt, rule=rule,
                         interpret=interpret, hardware=hardware)
  else:
    parts = _lanes.split_last(y)
    mult, code = fp4.block_multiplier(parts, rule)
    fp4.write_blocks(parts, mult, code, q_ref, sc_ref, rule=rule,
                     hardware=hardware)


@functools.partial(jax.jit, static_argnames=("fmt", "rule", "interpret"))
def mx_requantize(payload: jax.Array, scale: jax.Array, fmt: Format | str,
                  rule: str, *, interpret: bool = False):
  """The MX copy along the columns of the values of an MX copy along the
  rows, from its codes: ``(qt, st)``.

  ``payload`` and ``scale`` are an ``(R, C)`` tensor's copy along axis 1 in
  blocks of 32 (`qlayers.scaling.quantize`: E4M3 codes ``(R, C)``, FP6
  values as E4M3 codes ``(R, C)`` (`qlayers.scaling.widened`), or E2M1
  codes packed two to a byte ``(R, C / 2)``; E8M0 scales ``(R, C /
  32)``). ``qt`` and ``st`` are the copy of its dequantized values along
  axis 0, transposed: `qlayers.scaling.quantize` of ``(C, R)`` along axis 1
  under ``rule`` (E4M3 ``(C, R)``, FP6 widened to E4M3 ``(C, R)`` or packed
  E2M1 ``(C, R / 2)``; scales ``(C, R / 32)``), the second copy
  `mx_cast_transpose` or `fp4_cast_transpose` makes of the dequantized
  values, bit for bit.

  Args:
    payload: E4M3 codes (MXFP8, or MXFP6 widened), or uint8 bytes of
      packed E2M1 codes.
    scale: uint8 E8M0 codes, one per 32 elements of a row.
    fmt: ``"e4m3"`` (MXFP8), ``"e2m3"``/``"e3m2"`` (MXFP6) or ``"e2m1"``
      (MXFP4).
    rule: the copy's scale rule, ``"mx_rceil"`` or ``"mx_floor"``.
    interpret: run in Pallas' interpreter (any platform; for tests).

  Example:
    >>> import jax.numpy as jnp
    >>> from qlayers import scaling
    >>> from qlayers.recipe import QuantSpec
    >>> w = jnp.arange(64 * 32.0).reshape(64, 32)
    >>> q = scaling.quantize(w, QuantSpec(granularity="mx"), 1)
    >>> qt, st = mx_requantize(q.payload, q.scale, "e4m3", "mx_rceil",
    ...                        interpret=True)
    >>> qt.shape, st.shape, qt.dtype
    ((32, 64), (32, 2), dtype(float8_e4m3fn))
  """
  fmt = formats.get_format(fmt)
  packed = fmt is formats.E2M1
  per_byte = 2 if packed else 1
  shape = (payload.shape[0], payload.shape[-1] * per_byte)
  want = jnp.uint8 if packed else jnp.float8_e4m3fn
  if (payload.ndim != 2 or payload.dtype != want
      or not requantize_supported(shape, fmt)):
    raise ValueError(f"mx_requantize takes the 2-D codes of an E4M3, FP6 "
                     f"(widened to E4M3) or E2M1 (packed, uint8) copy of "
                     f"whole {MX_BLOCK} x {MX_BLOCK} tiles; got "
                     f"{payload.shape} {payload.dtype} of {fmt.name}.")
  if scale.shape != (shape[0], shape[1] // MX_BLOCK):
    raise ValueError(f"mx_requantize takes one E8M0 scale per {MX_BLOCK} "
                     f"values of a row: {(shape[0], shape[1] // MX_BLOCK)} "
                     f"for codes {payload.shape}, got {scale.shape}.")
  if rule not in ("mx_rceil", "mx_floor"):
    raise ValueError(f"mx_requantize takes an MX scale rule ('mx_rceil', "
                     f"'mx_floor'), got {rule!r}.")
  params = (fmt, rule, _base.ptx_converts(fmt, interpret), interpret)
  # Each shard of whole tiles requantizes its own (`partition.cast`): the
  # copy's rows are the codes' columns (E2M1: twice their bytes).
  cols = (("2c", 1),) if packed else (("c", 1),)
  qt, st = partition.cast(
      _requantize_call, params, scale, payload,
      in_layouts=((("r", 1), ("c", MX_BLOCK // per_byte)),),
      layouts=((*cols, ("r", 4 * per_byte)), (*cols, ("r", MX_BLOCK))),
      block=(MX_BLOCK, MX_BLOCK // per_byte))
  qt = _lanes.words_to_bytes(qt)
  if not packed:
    qt = jax.lax.bitcast_convert_type(qt, jnp.float8_e4m3fn)
  return qt, st


def _requantize_call(shape: tuple[int, int], fmt: Format, rule: str,
                     hardware: bool, interpret: bool):
  """`mx_requantize`'s kernel for codes of ``shape`` bytes: a function of
  (scales, codes)."""
  pl, plt = _base.pallas()
  rows, byte_cols = shape
  b = MX_BLOCK
  packing = 2 if fmt is formats.E2M1 else 1
  cols = byte_cols * packing  # the values' columns
  per_word = 4 * packing  # codes per uint32 word of the copy
  return pl.pallas_call(
      functools.partial(_requantize_kernel, fmt=fmt, rule=rule,
                        interpret=interpret, hardware=hardware),
      grid=(rows // b, cols // b),
      in_specs=[pl.BlockSpec((b, 1), lambda i, j: (i, j)),
                pl.BlockSpec((b, b // packing), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((b, b // per_word), lambda i, j: (j, i)),
                 pl.BlockSpec((b, 1), lambda i, j: (j, i))],
      out_shape=[jax.ShapeDtypeStruct((cols, rows // per_word), jnp.uint32),
                 jax.ShapeDtypeStruct((cols, rows // b), jnp.uint8)],
      compiler_params=plt.CompilerParams(num_warps=1),
      interpret=interpret, name="qlayers_mx_requantize")


def nvfp4_amax(payload: jax.Array, scale: jax.Array) -> jax.Array:
  """`qlayers.blocks.amax` of the values of an NVFP4 copy in 16 x 16 blocks
  (codes ``payload (R, C / 2)`` packed two to a byte, FP32 block scales
  ``scale (R / 16, C / 16)``), from integer maxima of its codes: an E2M1
  magnitude's order is its code's, and a block's largest value is its
  largest magnitude times the block's scale, rounded (+Inf where a value
  is NaN or Inf, as `blocks.amax` gives it). XLA reads the codes once,
  without decoding each (on B200, 35 us of integer work for a 4096 x 14336
  weight, where this is a few)."""
  n = nvfp4.NV_BLOCK
  r, c = payload.shape
  codes = payload.astype(jnp.uint32)
  largest = jnp.maximum(codes & 7, (codes >> 4) & 7).reshape(
      r // n, n, c // (n // 2), n // 2).max(axis=(1, 3))
  magnitude = formats.decode(largest.astype(jnp.uint8), formats.E2M1,
                             jnp.float32)
  a = jnp.max(magnitude * jnp.abs(scale.astype(jnp.float32)))
  return jnp.where(jnp.isnan(a), jnp.float32(jnp.inf), a)


def _nvfp4_requantize_kernel(amax_ref, s_ref, t_ref, q_ref, sc_ref, *,
                             interpret: bool, hardware: bool):
  """One 32 x 32 tile of a stored NVFP4 copy in 16 x 16 blocks (its bytes,
  two E2M1 codes each, low nibble first; its blocks' FP32 scales, 2 x 2):
  its values, then the NVFP4 copy of their transpose in 16 x 16 blocks
  under the tensor amax ``amax_ref``."""
  codes = t_ref[...].astype(jnp.uint32)
  v = _lanes.join_last(list(_e2m1_pairs(codes, hardware))).reshape(
      codes.shape[0], 2 * codes.shape[1])
  # The transpose's scales: a block's for each of its 16 x 16 elements.
  n = nvfp4.NV_BLOCK
  s = s_ref[...].T
  rows = jnp.broadcast_to(s[:, None, :], (2, n, 2)).reshape(2 * n, 2)
  scale = jnp.broadcast_to(rows[:, :, None], (2 * n, 2, n)).reshape(
      2 * n, 2 * n)
  # `QTensor.dequantize`'s product, after the transpose (as above).
  y = v.T * scale
  levels = nvfp4._encode_scales(jnp.reshape(amax_ref[...], (1,)), interpret)  # pylint: disable=protected-access
  nvfp4.write_blocks(_lanes.split_last(y), q_ref, sc_ref, levels,
                     square=True, interpret=interpret, hardware=hardware)


@functools.partial(jax.jit, static_argnames=("interpret",))
def nvfp4_requantize(payload: jax.Array, scale: jax.Array, amax: jax.Array,
                     *, interpret: bool = False):
  """The NVFP4 copy in 16 x 16 blocks of the transpose of a stored one, from
  its codes: ``(qt, st)``.

  ``payload`` (E2M1 codes packed two to a byte, ``(R, C / 2)``) and
  ``scale`` (FP32 ``(R / 16, C / 16)``: each block's E4M3 scale times the
  tensor's ``S_dec``) are an ``(R, C)`` tensor's NVFP4 copy in 16 x 16
  blocks (`qlayers.scaling.quantize` with the ``nvfp4`` rule and ``block``
  granularity); ``amax`` is its dequantized values' amax (FP32 scalar).
  ``qt`` (packed ``(C, R / 2)``) and ``st`` (E4M3 ``(C / 16, R / 16)``) are
  the codes and block scales of `qlayers.scaling.quantize` of the
  dequantized ``(C, R)`` transpose: the copy `nvfp4_cast_transpose`
  (``square``) makes of it, bit for bit.

  Example:
    >>> import jax.numpy as jnp
    >>> from qlayers import blocks, scaling
    >>> from qlayers.recipe import QuantSpec
    >>> spec = QuantSpec(format="e2m1", granularity="block",
    ...                  scale_rule="nvfp4")
    >>> q = scaling.quantize(jnp.ones((64, 32)), spec, 1)
    >>> qt, st = nvfp4_requantize(q.payload, q.scale,
    ...                           blocks.amax(q.dequantize()), interpret=True)
    >>> qt.shape, st.shape, st.dtype
    ((32, 32), (2, 4), dtype(float8_e4m3fn))
  """
  shape = (payload.shape[0], 2 * payload.shape[-1])
  if (payload.ndim != 2 or payload.dtype != jnp.uint8
      or not _base.whole_tiles(shape, MX_BLOCK)):
    raise ValueError(f"nvfp4_requantize takes the 2-D packed E2M1 codes "
                     f"(uint8) of whole {MX_BLOCK} x {MX_BLOCK} tiles; got "
                     f"{payload.shape} {payload.dtype}.")
  n = nvfp4.NV_BLOCK
  if scale.shape != (shape[0] // n, shape[1] // n):
    raise ValueError(f"nvfp4_requantize takes one scale per {n} x {n} "
                     f"block: {(shape[0] // n, shape[1] // n)} for codes "
                     f"{payload.shape}, got {scale.shape}.")
  qt, st = partition.cast(
      _nvfp4_requantize_call,
      (_base.ptx_converts(formats.E2M1, interpret), interpret),
      jnp.reshape(jnp.asarray(amax, jnp.float32), (1,)),
      scale.astype(jnp.float32), payload,
      in_layouts=((), (("r", n), ("c", n // 2))),
      layouts=((("2c", 1), ("r", 8)), (("c", n // 2), ("r", n))),
      block=(MX_BLOCK, MX_BLOCK // 2))
  return _lanes.words_to_bytes(qt), st


def _nvfp4_requantize_call(shape: tuple[int, int], hardware: bool,
                           interpret: bool):
  """`nvfp4_requantize`'s kernel for codes of ``shape`` bytes: a function of
  (amax, scales, codes)."""
  pl, plt = _base.pallas()
  rows, byte_cols = shape
  b, n, cols = MX_BLOCK, nvfp4.NV_BLOCK, 2 * byte_cols
  return pl.pallas_call(
      functools.partial(_nvfp4_requantize_kernel, interpret=interpret,
                        hardware=hardware),
      grid=(rows // b, cols // b),
      in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)),
                pl.BlockSpec((b // n, b // n), lambda i, j: (i, j)),
                pl.BlockSpec((b, b // 2), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((b, b // 8), lambda i, j: (j, i)),
                 pl.BlockSpec((b // n, b // n), lambda i, j: (j, i))],
      out_shape=[jax.ShapeDtypeStruct((cols, rows // 8), jnp.uint32),
                 jax.ShapeDtypeStruct((cols // n, rows // n),
                                      jnp.float8_e4m3fn)],
      compiler_params=plt.CompilerParams(num_warps=1),
      interpret=interpret, name="qlayers_nvfp4_requantize")
