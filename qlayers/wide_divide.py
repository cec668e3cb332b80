"""A correctly rounded FP32 division for GPUs, made as one FP64 division.

XLA:GPU divides FP32 with PTX ``div.full.f32`` (within 2 ulp), not the IEEE
``div.rn.f32`` that Transformer Engine's ``__fdiv_rn`` is. An FP64 division
is IEEE on both GPU backends (PTX ``div.rn.f64``; AMDGPU's FP64 division
sequence), and its quotient rounded once more to FP32 is the FP32 quotient
when no FP32 rounding boundary lies between the two.

`rdivide_wide` binds one primitive whose lowering widens ``b``, divides and
narrows inside the compiled program: with JAX's 64-bit types off a traced
function cannot hold an FP64 value, but its lowering can. Four HLO
operations, where the integer long division of
`qlayers.scale_rules.rdivide_rn_integer` is some sixty, and XLA:GPU used to
compile those into each kernel that read a scale.

The numerator is widened as ``numerator * (1 + 2**-52)``. With the exact
numerator LLVM narrows ``fptrunc(fdiv(fpext a, fpext b))`` back to an FP32
``fdiv`` (legal, by the same double-rounding argument), which XLA:GPU then
emits as ``div.full.f32`` again. The nudge does not change the result: for a
numerator ``n * 2**k`` (``n`` odd, below 128, and the numerator at least 1)
and any FP32 ``b``, the exact quotient is at least ``2**-49`` (relative) away
from every FP32 rounding boundary, since ``M * sig - n * 2**a`` is a non-zero
integer for a boundary's odd significand ``M < 2**25`` and ``b``'s
significand ``sig < 2**24``; the nudge and the FP64 rounding move it by less
than ``2**-51``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import ad, batching, mlir


__all__ = ["rdivide_wide", "odd_part"]

_rdivide_wide_p = jcore.Primitive("qlayers_rdivide_wide")


def odd_part(value: float) -> tuple[int, int]:
  """(n, k) with ``value = n * 2**k`` and ``n`` odd, for a positive finite
  dyadic ``value`` (every FP32 number).

  Example:
    >>> odd_part(448.0)
    (7, 6)
  """
  num, den = float(value).as_integer_ratio()
  tz = (num & -num).bit_length() - 1
  return num >> tz, tz - (den.bit_length() - 1)


def _check_numerator(numerator: float) -> float:
  """``numerator`` as a float, if it is one `rdivide_wide` divides exactly."""
  value = float(numerator)
  if not (math.isfinite(value) and value >= 1.0):
    raise ValueError(f"rdivide_wide needs a finite numerator >= 1, got "
                     f"{numerator}")
  odd, _ = odd_part(value)
  if odd >= 128:
    raise ValueError(f"rdivide_wide needs a numerator whose odd part is below "
                     f"128 (448, 57344, 2688, 1.0, ...); {numerator} has {odd}")
  return value


def rdivide_wide(numerator: float, b: jax.Array) -> jax.Array:
  """``numerator / b`` in FP32, correctly rounded (RNE), for FP32 ``b``.

  Computed as an FP64 division rounded to FP32 in the compiled program, on
  every platform the program is lowered for. ``b`` = 0 gives a signed Inf,
  Inf gives a signed zero, NaN gives NaN.

  Args:
    numerator: a number >= 1 whose odd part is below 128 (every element
      format's max, their products, powers of two).
    b: FP32 array.

  Example:
    >>> import jax.numpy as jnp
    >>> rdivide_wide(448.0, jnp.float32(3.0))
    Array(149.33333, dtype=float32)
  """
  value = _check_numerator(numerator)
  b = jnp.asarray(b)
  if b.dtype != jnp.float32:
    raise TypeError(f"rdivide_wide divides float32, got {b.dtype}")
  return _rdivide_wide_p.bind(b, numerator=value)


@_rdivide_wide_p.def_abstract_eval
def _abstract(b, *, numerator):
  """Elementwise: ``b``'s own type (shape, dtype, sharding, and the manual
  axes it varies over under `jax.shard_map`)."""
  del numerator
  return b


def _lower(ctx, b, *, numerator):
  (aval,) = ctx.avals_in
  wide = ir.RankedTensorType.get(aval.shape, ir.F64Type.get())
  nudged = np.float64(numerator) * (1.0 + 2.0**-52)  # exact in FP64
  num = stablehlo.broadcast_in_dim(wide, mlir.ir_constant(nudged),
                                   mlir.dense_int_array([]))
  quotient = stablehlo.divide(num, stablehlo.convert(wide, b))
  return [stablehlo.convert(b.type, quotient)]


mlir.register_lowering(_rdivide_wide_p, _lower)
_rdivide_wide_p.def_impl(functools.partial(
    jax.interpreters.xla.apply_primitive, _rdivide_wide_p))
batching.defvectorized(_rdivide_wide_p)
ad.defjvp(_rdivide_wide_p,
          lambda g, b, *, numerator: -g * _rdivide_wide_p.bind(
              b, numerator=numerator) / b)
