"""One pass per operand on NVIDIA GPUs: FP8 casts that write an operand's
two quantized copies at once (Transformer Engine's cast-transpose).

A per-tensor FP8 copy of ``t (R, C)`` feeds two GEMMs that contract
different axes: x is contracted over K in Fprop and over M in Wgrad, w over
K and N, g over N and M. cuBLASLt's FP8 GEMM takes only operands whose
contraction axis is the minor one, so XLA, given one payload, writes it in
one layout and transposes it for the other GEMM: a second kernel that reads
the payload again (``benchmarks/RESULTS.md``, "One pass per operand").
XLA does not fuse that transpose into the cast: the GEMMs' optimization
barriers (`qlayers.forms`) sit between them, and layout assignment places
the copy after the barrier.

`cast_transpose` is a Pallas (Triton) kernel that reads each tile of ``t``
once and writes the saturated, round-to-nearest-even cast of ``t * mult``
both as ``(R, C)`` and as ``(C, R)``, each row-major. Its values are those of
`qlayers.formats.cast` (the CPU tests run it in Pallas' interpreter and
compare bits); the transposed copy is handed to its GEMM as ``copy.T``, a
view XLA lays out over the kernel's buffer, so no transpose pass is left.

`mx_cast_transpose` does the same for MXFP8, whose two copies differ in
more than layout: one has a scale per 32 elements of a row, the other per
32 of a column. Each is otherwise a second pass over the wide tensor; the
kernel reads a 32 x 32 tile once and writes both copies (the column-blocked
one transposed, contraction-last as cuDNN's block-scaled GEMM takes it) and
their E8M0 scales, with `qlayers.scaling.quantize`'s values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qlayers import formats
from qlayers.formats import Format

__all__ = ["TILE", "supported", "cast_transpose", "mx_supported",
           "mx_cast_transpose"]

# Rows and columns of one tile; both dims of ``t`` must be multiples of it.
TILE = 64


def supported(shape: tuple[int, ...], fmt: Format) -> bool:
  """Whether `cast_transpose` takes a 2-D ``shape`` tensor cast to ``fmt``:
  whole tiles, an unpacked FP8 format."""
  return (len(shape) == 2 and fmt.signed and not fmt.packed
          and fmt.dtype is not None
          and jnp.dtype(fmt.dtype).itemsize == 1
          and all(d >= TILE and d % TILE == 0 for d in shape))


def _kernel(mult_ref, t_ref, q_ref, qt_ref, *, fmt: Format):
  v = t_ref[...].astype(jnp.float32) * mult_ref[0]
  # formats.saturate: clip to [-max, max], NaN stays NaN (said explicitly:
  # the kernel's min/max need not propagate it).
  v = jnp.where(jnp.isnan(v), v, jnp.minimum(jnp.maximum(v, -fmt.max),
                                             fmt.max))
  q = v.astype(fmt.dtype)
  q_ref[...] = q
  qt_ref[...] = q.T


def cast_transpose(t: jax.Array, mult: jax.Array, fmt: Format | str, *,
                   interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """``(cast(t * mult), cast(t * mult).T)`` for ``t (R, C)``, in one pass.

  Args:
    t: 2-D BF16/FP16/FP32 array, both dims multiples of `TILE`.
    mult: FP32 scalar, the quantization multiplier (``1 / scale``).
    fmt: an FP8 format (``"e4m3"``, ``"e5m2"``).
    interpret: run in Pallas' interpreter (any platform; for tests).
      Otherwise the kernel is lowered for NVIDIA GPUs only.

  Example:
    >>> import jax.numpy as jnp
    >>> q, qt = cast_transpose(jnp.ones((64, 128)), jnp.float32(2.0), "e4m3",
    ...                        interpret=True)
    >>> q.shape, qt.shape, float(qt[0, 0])
    ((64, 128), (128, 64), 2.0)
  """
  fmt = formats.get_format(fmt)
  if not supported(t.shape, fmt):
    raise ValueError(f"cast_transpose takes a 2-D tensor whose dims are "
                     f"multiples of {TILE} and an FP8 format; got "
                     f"{t.shape} and {fmt.name}.")
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import triton as plt  # pylint: disable=g-import-not-at-top
  rows, cols = t.shape
  tile = (TILE, TILE)
  call = pl.pallas_call(
      functools.partial(_kernel, fmt=fmt),
      grid=(rows // TILE, cols // TILE),
      in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)),
                pl.BlockSpec(tile, lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec(tile, lambda i, j: (i, j)),
                 pl.BlockSpec(tile, lambda i, j: (j, i))],
      out_shape=[jax.ShapeDtypeStruct((rows, cols), fmt.dtype),
                 jax.ShapeDtypeStruct((cols, rows), fmt.dtype)],
      compiler_params=plt.CompilerParams(num_warps=4),
      interpret=interpret, name="qlayers_cast_transpose")
  q, qt = call(jnp.reshape(mult.astype(jnp.float32), (1,)), t)
  return q, qt


def mx_supported(shape: tuple[int, ...], fmt: Format, block_size: int) -> bool:
  """Whether `mx_cast_transpose` takes a 2-D ``shape`` tensor: whole 32 x 32
  tiles, an unpacked FP8 element format, blocks of 32."""
  return (block_size == MX_BLOCK and len(shape) == 2 and fmt.signed
          and not fmt.packed and fmt.dtype is not None
          and jnp.dtype(fmt.dtype).itemsize == 1
          and all(d >= MX_BLOCK and d % MX_BLOCK == 0 for d in shape))


MX_BLOCK = 32


def _mx_copy(v, mag_max, fmt: Format, rule: str):
  """(payload, E8M0 codes) of FP32 ``v`` scaled by blocks whose magnitude
  bits max is ``mag_max`` (`qlayers.scale_rules.unit_scales` for MX)."""
  from qlayers import scale_rules  # pylint: disable=g-import-not-at-top
  codes = scale_rules.mx_scale_codes(
      jax.lax.bitcast_convert_type(mag_max, jnp.float32), fmt, rule)
  c = codes.astype(jnp.uint32)
  # 2**(127 - code) from its bits (code 0: the subnormal 2**-127), as
  # scale_rules.unit_scales; a NaN code multiplies by 0.
  mult = jax.lax.bitcast_convert_type(
      jnp.maximum((254 - c) << 23, jnp.uint32(0x400000)), jnp.float32)
  w = v * jnp.where(codes == 255, 0.0, mult)
  w = jnp.where(jnp.isnan(w), w, jnp.minimum(jnp.maximum(w, -fmt.max),
                                             fmt.max))
  return w.astype(fmt.dtype), codes


def _mx_kernel(t_ref, q_ref, s_ref, qt_ref, st_ref, *, fmt: Format,
               rule: str):
  v = t_ref[...].astype(jnp.float32)
  # Block amaxes from the magnitude bits, as qlayers.blocks does: exact, and
  # an Inf or NaN element gives the 0xFF code.
  mag = jax.lax.bitcast_convert_type(v, jnp.uint32) & 0x7FFFFFFF
  q, s = _mx_copy(v, jnp.max(mag, axis=1, keepdims=True), fmt, rule)
  q_ref[...] = q
  s_ref[...] = s
  qc, sc = _mx_copy(v, jnp.max(mag, axis=0, keepdims=True), fmt, rule)
  qt_ref[...] = qc.T
  st_ref[...] = sc.T


def mx_cast_transpose(t: jax.Array, fmt: Format | str, rule: str, *,
                      interpret: bool = False):
  """Both MX copies of ``t (R, C)`` in one pass: ``(q, s, qt, st)``.

  ``q (R, C)`` with codes ``s (R, C / 32)`` is ``t`` quantized along its
  rows' 32-blocks (`qlayers.scaling.quantize` along axis 1); ``qt (C, R)``
  with ``st (C, R / 32)`` is ``t`` quantized along its columns' 32-blocks
  (along axis 0), transposed.

  Args:
    t: 2-D BF16/FP16/FP32 array, both dims multiples of 32.
    fmt: an FP8 element format (``"e4m3"``, ``"e5m2"``).
    rule: the MX scale rule (``"mx_floor"``, ``"mx_rceil"``).
    interpret: run in Pallas' interpreter (any platform; for tests).

  Example:
    >>> import jax.numpy as jnp
    >>> q, s, qt, st = mx_cast_transpose(jnp.ones((32, 64)), "e4m3",
    ...                                  "mx_rceil", interpret=True)
    >>> s.shape, qt.shape, st.shape, int(s[0, 0])
    ((32, 2), (64, 32), (64, 1), 119)
  """
  fmt = formats.get_format(fmt)
  if not mx_supported(t.shape, fmt, MX_BLOCK):
    raise ValueError(f"mx_cast_transpose takes a 2-D tensor whose dims are "
                     f"multiples of {MX_BLOCK} and an FP8 format; got "
                     f"{t.shape} and {fmt.name}.")
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import triton as plt  # pylint: disable=g-import-not-at-top
  rows, cols = t.shape
  b = MX_BLOCK
  call = pl.pallas_call(
      functools.partial(_mx_kernel, fmt=fmt, rule=rule),
      grid=(rows // b, cols // b),
      in_specs=[pl.BlockSpec((b, b), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((b, b), lambda i, j: (i, j)),
                 pl.BlockSpec((b, 1), lambda i, j: (i, j)),
                 pl.BlockSpec((b, b), lambda i, j: (j, i)),
                 pl.BlockSpec((b, 1), lambda i, j: (j, i))],
      out_shape=[jax.ShapeDtypeStruct((rows, cols), fmt.dtype),
                 jax.ShapeDtypeStruct((rows, cols // b), jnp.uint8),
                 jax.ShapeDtypeStruct((cols, rows), fmt.dtype),
                 jax.ShapeDtypeStruct((cols, rows // b), jnp.uint8)],
      compiler_params=plt.CompilerParams(num_warps=4),
      interpret=interpret, name="qlayers_mx_cast_transpose")
  return tuple(call(t))
