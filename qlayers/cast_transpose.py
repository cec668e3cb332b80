"""One pass per operand on NVIDIA GPUs: a per-tensor FP8 cast that writes
the payload in both layouts (Transformer Engine's cast-transpose).

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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qlayers import formats
from qlayers.formats import Format

__all__ = ["TILE", "supported", "cast_transpose"]

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
