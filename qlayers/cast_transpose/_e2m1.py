"""E2M1 codes in a kernel, eight to a uint32 word (the packed payload, low
nibble first): to nearest by PTX's conversion where the GPU has it, else,
and stochastically, by `qlayers.formats.grid_codes`' steps. Words, not
bytes: Triton widens each byte it stores to 16 and 32 bits first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qlayers import formats
from qlayers.cast_transpose import _lanes


def e2m1_codes(x, r=None, hardware: bool = False):
  """`qlayers.formats.cast` of FP32 ``x`` to E2M1 codes (uint32), rounding
  to nearest even, or stochastically with random bytes ``r``, in a kernel
  (`qlayers.formats.grid_codes`). ``hardware``: the steps are truncated by
  PTX's own conversion (`TRUNCATE_U32`) and the NaN test is left out: a
  kernel's ``x`` is NaN only in a block with a NaN scale, whose codes it
  writes as zeros (`_lanes.zero_where_nan_scale`). The same codes."""
  if not hardware:
    return formats.grid_codes(x, formats.E2M1, r)
  return formats.grid_codes(x, formats.E2M1, r, truncate=truncate_u32,
                            nan=False)


# PTX's float-to-integer conversions saturate (NaN gives 0; PTX ISA, cvt),
# where Pallas clamps the value first, in two more instructions.
TRUNCATE_U32 = "cvt.rzi.u32.f32 $0, $1;"


def truncate_u32(v):
  """FP32 ``v >= 0`` truncated to uint32 in a kernel, by `TRUNCATE_U32`."""
  from jax.experimental.pallas import triton as plgpu
  (k,) = plgpu.elementwise_inline_asm(
      TRUNCATE_U32, args=[v], constraints="=r,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, jnp.int32)])
  return jax.lax.bitcast_convert_type(k, jnp.uint32)


# PTX's two-value conversions put their first source in the high half of
# the result (PTX ISA, cvt: ".e2m1x2"), so the odd element goes first. NaN
# converts to the largest positive value (CUDA's cuda_fp4.hpp says so of
# its host twin); a kernel's NaN comes only from a block with a NaN scale,
# whose payload it writes as zeros (`_lanes.zero_where_nan_scale`).
E2M1X8 = ("{ .reg .b8 b0, b1, b2, b3; "
          "cvt.rn.satfinite.e2m1x2.f32 b0, $2, $1; "
          "cvt.rn.satfinite.e2m1x2.f32 b1, $4, $3; "
          "cvt.rn.satfinite.e2m1x2.f32 b2, $6, $5; "
          "cvt.rn.satfinite.e2m1x2.f32 b3, $8, $7; "
          "mov.b32 $0, {b0, b1, b2, b3}; }")


def e2m1_word(parts, r=None, hardware: bool = False):
  """E2M1 codes of eight FP32 arrays as one uint32 array, ``parts[j]``'s in
  bits ``4j`` to ``4j + 3`` (as bytes, the packed payload, low nibble
  first). Rounded to nearest even, or stochastically with random bytes
  ``r[j]`` (`qlayers.threefry.hash_bytes`; `qlayers.formats.grid_codes`).
  ``hardware``: to nearest by four PTX ``cvt.rn.satfinite.e2m1x2.f32``,
  which round to nearest even and saturate as `grid_codes` does (+-0 keeps
  its sign; NaN aside, see `E2M1X8`), the same words. Words, not bytes:
  Triton widens each byte to 16 and 32 bits to store it."""
  if not hardware or r is not None:
    r = r or [None] * 8
    return functools.reduce(jnp.bitwise_or, (
        e2m1_codes(part, r[j], hardware) << (4 * j)
        for j, part in enumerate(parts)))
  from jax.experimental.pallas import triton as plgpu
  (w,) = plgpu.elementwise_inline_asm(
      E2M1X8, args=list(parts), constraints="=r" + ",f" * 8, pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(parts[0].shape, jnp.int32)])
  return jax.lax.bitcast_convert_type(w, jnp.uint32)


def block_e2m1_words(parts, mult, r, hardware: bool):
  """The E2M1 words of blocks held apart (``parts``: their elements, one
  array each, `_lanes.split_last`) scaled by ``mult``, as a list: eight
  codes to a word (`e2m1_word`; ``r``: the elements' random bytes, one
  array each, or None), zeros where the scale is NaN
  (`_lanes.zero_where_nan_scale`)."""
  return [_lanes.zero_where_nan_scale(e2m1_word(
      [p * mult for p in parts[k:k + 8]], r and r[k:k + 8], hardware), mult)
          for k in range(0, len(parts), 8)]
