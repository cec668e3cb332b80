"""What the cast kernels share: Pallas, the tile and format checks, FP32
arithmetic with XLA's bits, and E8M0 scales from magnitude bits.

Where Triton's own instruction rounds differently from XLA (its division is
``div.full.f32``) or costs more (a clamp before a conversion, a funnel
shift on the busy ALU pipe), a kernel uses PTX of its own as inline
assembly; in Pallas' interpreter (the CPU tests) the host's IEEE
operations, the same values. The block-scaled kernels convert FP32 with
PTX's ``cvt.rn.satfinite`` to two E4M3/E5M2/E2M3/E3M2/E2M1 values at once
where the GPU has it (`ptx_converts`), which round and saturate as
`qlayers.formats` does. The one difference, NaN (the conversions give FP4
and FP6 their largest code), never reaches a payload: a block holding Inf
or NaN has a NaN scale, and its FP4/FP6 codes are written as zeros, in
XLA's path too (`qlayers.scaling.quantize`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qlayers import formats
from qlayers import scale_rules
from qlayers import table
from qlayers.formats import Format


def pallas():
  """Pallas and its Triton parameters, imported when a kernel is built (they
  load Mosaic and Triton bindings that a CPU-only user never needs)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plt
  return pl, plt


def whole_tiles(shape: tuple[int, ...], tile: int) -> bool:
  """A 2-D ``shape`` of whole ``tile`` x ``tile`` tiles."""
  return len(shape) == 2 and all(d >= tile and d % tile == 0 for d in shape)


def is_fp8(fmt: Format) -> bool:
  """An unpacked signed 8-bit format (FP8)."""
  return (fmt.signed and not fmt.packed and fmt.dtype is not None
          and jnp.dtype(fmt.dtype).itemsize == 1)


def payload_dtype(fmt: Format):
  """The dtype a kernel writes ``fmt``'s values in: its own (FP8), or E4M3
  for FP6, which holds every E2M3 and E3M2 value (the widened payload of
  `qlayers.scaling.widened`)."""
  return jnp.float8_e4m3fn if fmt.bits == 6 else fmt.dtype


# The FP8 formats whose conversion from FP32 Triton compiles to PTX
# ``cvt.rn.satfinite.{e4m3,e5m2}x2.f32`` (sm_89 on): round to nearest even,
# +-Inf and overflow to +-max, NaN to NaN; `formats.cast`'s values.
SATFINITE = (formats.E4M3, formats.E5M2)


def saturating_cast(v, fmt: Format, interpret: bool):
  """`formats.cast` of FP32 ``v`` in a kernel: clip to [-max, max] (NaN
  stays NaN, said explicitly: the kernel's min/max need not propagate it),
  then round to nearest even. On the GPU, E4M3 and E5M2 leave the clipping
  to the conversion instruction, which saturates (`SATFINITE`); the
  interpreter's convert does not, so it clips."""
  if fmt in SATFINITE and not interpret:
    return v.astype(fmt.dtype)
  v = jnp.where(jnp.isnan(v), v, jnp.minimum(jnp.maximum(v, -fmt.max),
                                             fmt.max))
  return v.astype(fmt.dtype)


def reciprocal(s, interpret: bool):
  """``1 / s`` correctly rounded, in a kernel: PTX ``rcp.rn.f32`` (a Triton
  division is ``div.full.f32``, within 2 ulp); in the interpreter the host's
  IEEE division."""
  if interpret:
    return 1.0 / s
  from jax.experimental.pallas import triton as plgpu
  (r,) = plgpu.elementwise_inline_asm(
      "rcp.rn.f32 $0, $1;", args=[s], constraints="=f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(s.shape, jnp.float32)])
  return r


def divide(numerator: float, b, interpret: bool):
  """``numerator / b`` correctly rounded, in a kernel: PTX ``div.rn.f32`` (a
  Triton division is ``div.full.f32``); in the interpreter
  `scale_rules.rdivide_rn`."""
  if interpret:
    return scale_rules.rdivide_rn(numerator, b)
  from jax.experimental.pallas import triton as plgpu
  (q,) = plgpu.elementwise_inline_asm(
      "div.rn.f32 $0, $1, $2;", args=[jnp.full_like(b, numerator), b],
      constraints="=f,f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(b.shape, jnp.float32)])
  return q


def fp32_bits(v):
  return jax.lax.bitcast_convert_type(v, jnp.uint32) & 0x7FFFFFFF


def doubled_bits(v):
  """`fp32_bits` shifted up one: the sign dropped by a multiply, which
  runs on the FMA pipe where the mask would take the ALU's; ordered as
  the magnitudes, so a block's max shifted back down is their max's."""
  return jax.lax.bitcast_convert_type(v, jnp.uint32) * jnp.uint32(2)


def ptx_converts(fmt: Format, interpret: bool) -> bool:
  """Whether a kernel casts FP32 to ``fmt`` with PTX conversions of its own
  (`qlayers.cast_transpose.blockwise`, `_e2m1.e2m1_word`): compiled for a GPU
  (`qlayers.table.gpu_arch`) that has them, sm_89 for FP8, sm_100 (its
  ``a`` features) for FP6 and FP4. The interpreter and an unknown GPU take
  Triton's casts and `qlayers.formats`' FP32 steps, the same values."""
  sm = 0 if interpret else table.sm_version(table.gpu_arch("cuda"))
  return sm >= (89 if fmt.bits == 8 else 100)


# A Threefry rotation as one wide multiply and an or: x * 2**d in 64 bits
# holds x << d in its low word and x >> (32 - d) in its high one. The
# multiply runs on the FMA pipe, the funnel shift it replaces on the ALU
# pipe that the stochastic kernels' other integer work fills (SASS counts,
# benchmarks/RESULTS.md); the xor after it folds the or into one LOP3.
ROTL_WIDE = ("{ .reg .b64 w; .reg .b32 lo, hi; mul.wide.u32 w, $1, %d; "
             "mov.b64 {lo, hi}, w; or.b32 $0, lo, hi; }")


def rotl_wide(x, d: int):
  """uint32 ``x`` rotated left by ``d`` bits in a kernel, by `ROTL_WIDE`:
  `qlayers.threefry`'s rotation, the same bits."""
  from jax.experimental.pallas import triton as plgpu
  (k,) = plgpu.elementwise_inline_asm(
      ROTL_WIDE % (1 << d), args=[jax.lax.bitcast_convert_type(x, jnp.int32)],
      constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.int32)])
  return jax.lax.bitcast_convert_type(k, jnp.uint32)


# DeepSeek-V3's floor on a tile's amax, as FP32 bits (a positive float's
# order is its bits' order).
DEEPSEEK_FLOOR_BITS = int(np.float32(
    scale_rules.DEEPSEEK_AMAX_FLOOR).view(np.uint32))


def pow2_multiplier(mag_max, fmt: Format, rule: str):
  """(multiplier, E8M0 code as uint32) of blocks whose magnitude-bits max is
  ``mag_max`` under an MX rule or ``deepseek_pow2``
  (`qlayers.cast_transpose.blockwise`)."""
  deepseek = rule == "deepseek_pow2"
  if deepseek:
    mag_max = jnp.maximum(mag_max, jnp.uint32(DEEPSEEK_FLOOR_BITS))
  # uint32 codes: Triton widens uint8 arithmetic through 16 bits.
  c = scale_rules.mx_scale_codes(
      jax.lax.bitcast_convert_type(mag_max, jnp.float32), fmt,
      "mx_rceil" if deepseek else rule, dtype=jnp.uint32)
  # 2**(127 - code) from its bits (code 0: the subnormal 2**-127), as
  # scale_rules.unit_scales.
  mult = jax.lax.bitcast_convert_type(
      jnp.maximum((254 - c) << 23, jnp.uint32(0x400000)), jnp.float32)
  return jnp.where(c == 255, jnp.nan if deepseek else 0.0, mult), c


def scales_out(codes, rule: str):
  """What the QTensor stores of `pow2_multiplier`'s uint32 codes, or of
  ``deepseek``'s FP32 scales: E8M0 codes (MX), FP32 ``2**(code - 127)``
  (NaN for code 255) for DeepSeek-V3's power-of-two scales, the scales
  themselves (``deepseek``)."""
  if rule == "deepseek":
    return codes
  if rule != "deepseek_pow2":
    return codes.astype(jnp.uint8)
  return jnp.where(codes == 255, jnp.nan,
                   jax.lax.bitcast_convert_type(codes << 23, jnp.float32))
