"""cuDNN's block-scaled GEMM, with its per-tensor scale applied inside it.

XLA's ``__op$block_scaled_dot`` custom call takes two payloads and their
block scales (MX: E8M0 per 32 elements, NVFP4: E4M3 per 16), and a fifth
operand, a scalar "global scale" of the result's type, which XLA's
block-scaling rewriter passes into the cuDNN graph when cuDNN is 9.13 or
newer (older: a multiply after the call). `block_scaled_dot` binds that call
with or without the fifth operand: the MX GEMMs have no per-tensor scale,
and an NVFP4 GEMM's per-tensor scales are applied inside it, so its output
is written once, in its final type, as Transformer Engine's NVFP4 GEMM does
with cuBLASLt's alpha. (Checked in XLA's optimized HLO for sm_100, not yet
on a device.)

The scale has the output's type (XLA's rewriter requires it), so a BF16
output is scaled by the scale rounded to BF16, as most of `qlayers.forms`'
per-tensor FP8 GEMMs are; exact for power-of-two scales.

On other platforms the primitive lowers to its definition: each payload
times its block scales (repeated along K), an FP32 dot, the global scale,
one rounding to the output type. So the sm_100 GEMM forms run on CPU as
they are, and tests compare them with the emulation bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import batching
from jax.interpreters import mlir

__all__ = ["block_scaled_dot"]

_p = jcore.Primitive("qlayers_block_scaled_dot")

# XLA's custom-call target (xla/service/gpu/cublas_cudnn.h,
# kBlockScaledDotCustomCallTarget), the one `jax.nn.scaled_matmul` emits.
_TARGET = "__op$block_scaled_dot"


def block_scaled_dot(a: jax.Array, b: jax.Array, a_scale: jax.Array,
                     b_scale: jax.Array, global_scale: jax.Array | None,
                     out_dtype) -> jax.Array:
  """``(a * a_scale) @ (b * b_scale).T * global_scale`` per batch, in
  ``out_dtype``, FP32 accumulation.

  Args:
    a: ``(batch, m, k)`` payload (``float4_e2m1fn``, FP8).
    b: ``(batch, n, k)`` payload.
    a_scale, b_scale: ``(batch, m, k // block)`` / ``(batch, n, k //
      block)`` block scales (E4M3 for NVFP4, E8M0 for MX).
    global_scale: a scalar, cast to ``out_dtype`` (the type XLA's call
      takes), or None: no per-tensor scale (MX), four operands.
    out_dtype: BF16, F16 or F32.

  Example:
    >>> import jax.numpy as jnp
    >>> a = jnp.ones((1, 2, 32), jnp.float4_e2m1fn)
    >>> s = jnp.ones((1, 2, 2), jnp.float8_e4m3fn)
    >>> block_scaled_dot(a, a, s, s, jnp.float32(0.5), jnp.bfloat16)[0]
    Array([[16, 16],
           [16, 16]], dtype=bfloat16)
  """
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    raise TypeError(f"block_scaled_dot writes bfloat16, float16 or float32, "
                    f"got {out_dtype}")
  if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] \
      or a.shape[2] != b.shape[2]:
    raise ValueError(f"block_scaled_dot takes (batch, m, k) and (batch, n, k) "
                     f"payloads, got {a.shape} and {b.shape}")
  for x, s in ((a, a_scale), (b, b_scale)):
    if s.shape[:2] != x.shape[:2] or s.ndim != 3 or x.shape[2] % s.shape[2]:
      raise ValueError(f"block_scaled_dot needs scales (batch, rows, k // "
                       f"block) for a payload {x.shape}, got {s.shape}")
  if global_scale is None:
    return _p.bind(a, b, a_scale, b_scale, out_dtype=out_dtype)
  if jnp.shape(global_scale) != ():
    raise ValueError(f"block_scaled_dot's global scale is a scalar, got shape "
                     f"{jnp.shape(global_scale)}")
  return _p.bind(a, b, a_scale, b_scale,
                 jnp.asarray(global_scale).astype(out_dtype),
                 out_dtype=out_dtype)


@_p.def_abstract_eval
def _abstract(a, b, *scales, out_dtype):
  del scales
  return jax.core.ShapedArray((a.shape[0], a.shape[1], b.shape[1]), out_dtype)


def _definition(a, b, a_scale, b_scale, *global_scale, out_dtype):
  def wide(x, s):
    block = x.shape[2] // s.shape[2]
    return x.astype(jnp.float32) * jnp.repeat(s.astype(jnp.float32), block,
                                              axis=2)
  out = lax.dot_general(wide(a, a_scale), wide(b, b_scale),
                        (((2,), (2,)), ((0,), (0,))),
                        preferred_element_type=jnp.float32)
  for scale in global_scale:
    out = out * scale.astype(jnp.float32)
  return out.astype(out_dtype)


def _lower_cuda(ctx, *operands, out_dtype):
  (aval,) = ctx.avals_out
  result = ir.RankedTensorType.get(aval.shape,
                                   mlir.dtype_to_ir_type(aval.dtype))
  layout = lambda n: ir.DenseIntElementsAttr.get(  # noqa: E731
      np.arange(n - 1, -1, -1, dtype=np.int64),
      type=ir.IndexType.get())
  op = stablehlo.CustomCallOp(
      [result], operands, call_target_name=_TARGET,
      operand_layouts=ir.ArrayAttr.get(
          [layout(len(ir.RankedTensorType(v.type).shape)) for v in operands]),
      result_layouts=ir.ArrayAttr.get([layout(len(aval.shape))]))
  return op.results


def _batched(args, dims, *, out_dtype):
  """``jax.vmap`` of the GEMM (the experts' GEMMs are vmapped): the mapped
  axis joins the batch axis. A mapped global scale, one per batch, is
  applied after an FP32 GEMM, as the definition applies it. (An unmapped
  operand's dim is None.)"""
  size = next(x.shape[d] for x, d in zip(args, dims)
              if d is not None)

  def joined(x, d):
    x = (jnp.broadcast_to(x, (size, *x.shape)) if d is None
         else jnp.moveaxis(x, d, 0))
    return x.reshape(-1, *x.shape[2:])

  a, b, a_scale, b_scale = map(joined, args[:4], dims[:4])
  scales = args[4:]
  if scales and dims[4] is not None:
    out = _p.bind(a, b, a_scale, b_scale, out_dtype=jnp.dtype(jnp.float32))
    out = out.reshape(size, -1, *out.shape[1:])
    scale = jnp.moveaxis(scales[0], dims[4], 0).astype(jnp.float32)
    out = (out * scale[:, None, None, None]).astype(out_dtype)
  else:
    out = _p.bind(a, b, a_scale, b_scale, *scales, out_dtype=out_dtype)
    out = out.reshape(size, -1, *out.shape[1:])
  return out, 0


batching.primitive_batchers[_p] = _batched
mlir.register_lowering(_p, mlir.lower_fun(_definition, multiple_results=False))
mlir.register_lowering(_p, _lower_cuda, platform="cuda")
_p.def_impl(functools.partial(jax.interpreters.xla.apply_primitive, _p))
