"""How each operand of a quantized GEMM is made from its wide tensor (no
Flax): `operand` (rows, Hadamard transform, `scaling.quantize` in the
layout a `dispatch.Operand` says) and `delayed_amax` (the amax a delayed
role scales by). `qlayers.ops` runs them inside the GEMM's custom_vjp;
`qlayers.inspect` rebuilds the same copies with them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from qlayers import blocks
from qlayers import cast_transpose
from qlayers import formats
from qlayers import hadamard
from qlayers import partition
from qlayers import scale_rules
from qlayers import scaling
from qlayers import sharding
from qlayers import table
from qlayers.dispatch import Operand
from qlayers.recipe import Recipe, recipe as load_recipe
from qlayers.scaling import ScaleState

__all__ = ["operand", "operand_pair", "delayed_amax", "fake_quant_matmul"]


def delayed_amax(t, state: ScaleState, recipe: Recipe):
  """(amax to scale ``t`` by now, updated running amax) for one delayed role
  (`scaling.delayed_amax` of the whole tensor's amax)."""
  current = sharding.global_amax(scaling.amax(t), t)
  return scaling.delayed_amax(state, current, recipe.amax_compute_algo)


def _rows(t):
  """``t (..., K)`` as ``(M, K)``."""
  return t if t.ndim == 2 else t.reshape(-1, t.shape[-1])


def _data_key(t):
  """A PRNG key derived from the bits of ``t`` (for stateless callers)."""
  bits = lax.bitcast_convert_type(jnp.sum(t.astype(jnp.float32)), jnp.uint32)
  return jax.random.key(bits)


def operand(t: jax.Array, op: Operand, *, amax=None, key=None,
            dtype=jnp.float32, gather: tuple[str, ...] = ()):
  """The GEMM operand ``op`` (from a `dispatch.Plan`) made of ``t (..., C)``.

  The rows ``(M, C)`` of ``t``, Hadamard-transformed and quantized with
  `scaling.quantize` as ``op`` says (``amax``: the per-tensor amax to scale
  by; ``key``: stochastic rounding, derived from the data when omitted), or
  cast to ``dtype`` where ``op`` has no spec. Inside ``shard_map`` a
  per-tensor scale is the whole tensor's. ``gather``: manual axes over
  which 2-D ``t`` is a shard along dim 0 (an FSDP weight,
  `sharding.gathered_weights`): the operand of the whole tensor, quantized
  on the shard and gathered as payload + scales (`partition.gather`), or
  gathered wide first where a shard would not quantize as the whole does.

  An elementwise quantization (per tensor, in the layout given) is made of
  ``t`` itself and only its payload is flattened, so the GEMM's reshape does
  not sit between the caller's ops and the quantize chain.

  Example:
    >>> import jax.numpy as jnp, qlayers
    >>> from qlayers.dispatch import Operand
    >>> spec = qlayers.recipe("mxfp8").fprop.lhs
    >>> operand(jnp.ones((2, 3, 64)), Operand(spec, 1)).payload.shape
    (6, 64)
  """
  spec = op.spec
  if gather:
    return _gathered(t, op, gather, amax=amax, key=key, dtype=dtype)
  if spec is None:
    return _rows(t.astype(dtype))
  elementwise = (t.ndim > 2 and spec.granularity == "tensor"
                 and not (op.tn or spec.stochastic or op.hadamard))
  if not elementwise:
    t = _rows(t)
    if op.hadamard:
      t = hadamard.transform(t, op.hadamard, axis=op.axis)
  per_tensor = spec.granularity == "tensor" or spec.scale_rule == "nvfp4"
  if amax is None and per_tensor and sharding.varying_axes(t):
    amax = sharding.global_amax(scaling.amax(t), t)
  if elementwise:
    q = scaling.quantize(t, spec, -1, amax=amax)
    rows = _rows(q.payload)
    return dataclasses.replace(q, payload=rows, axis=op.axis, shape=rows.shape)
  if not spec.stochastic:
    key = None
  elif key is None:
    key = _data_key(t)
  if op.tn:
    q = scaling.quantize(t.T, spec, 1, amax=amax, key=key)
    return dataclasses.replace(q, transposed=True)
  return scaling.quantize(t, spec, op.axis, amax=amax, key=key)


def operand_pair(t: jax.Array, op: Operand, *, amax=None, key=None,
                 dtype=jnp.float32):
  """One per-tensor copy of ``t (..., C)`` for two GEMMs: ``(last, first)``,
  the `operand` ``op`` handed to the GEMM that contracts the last axis and
  to the one that contracts the rows.

  Both hold the same values. Where a program may run on an NVIDIA GPU whose
  FP8 GEMM takes only contraction-minor operands (Hopper, Ada:
  `qlayers.table.fp8_gemm_transposes`), per-tensor FP8 rows of whole
  `qlayers.cast_transpose.TILE` tiles are cast there by
  `qlayers.cast_transpose.cast_transpose`, one pass writing both layouts;
  ``first``'s payload is the transposed buffer seen as ``(M, C)``, the
  layout cuBLASLt takes for a contraction over M. Elsewhere, and for any
  other operand, both are the one copy `operand` makes. Not under a mesh:
  the kernel has no partitioning rule.

  Example:
    >>> import jax.numpy as jnp, qlayers
    >>> from qlayers.dispatch import Operand
    >>> spec = qlayers.recipe("fp8_current").fprop.lhs
    >>> last, first = operand_pair(jnp.ones((2, 64, 64)), Operand(spec, 1))
    >>> last.payload.shape == first.payload.shape == (128, 64)
    True
  """
  spec = op.spec
  rows = (math.prod(t.shape[:-1]), t.shape[-1])
  if not (spec is not None and spec.granularity == "tensor"
          and spec.scale_rule != "nvfp4" and not spec.stochastic
          and not op.hadamard and not op.tn and table.targets_gpu()
          and table.fp8_gemm_transposes(table.gpu_arch("cuda"))
          and cast_transpose.supported(rows, spec.fmt)
          and not sharding.varying_axes(t)
          and sharding.auto_mesh() is None):
    q = operand(t, op, amax=amax, key=key, dtype=dtype)
    return q, q
  a = blocks.amax(t) if amax is None else jnp.asarray(amax, jnp.float32)
  mult, scale = scale_rules.unit_scales(a, spec)

  def xla(t, mult):
    p = _rows(formats.cast(t.astype(jnp.float32) * mult, spec.fmt))
    return p, p.T

  def cuda(t, mult):
    return cast_transpose.cast_transpose(_rows(t), mult, spec.fmt)

  p, pt = lax.platform_dependent(t, mult, cuda=cuda, default=xla)
  last = scaling.QTensor(p, scale, spec.fmt.name, "tensor", None, op.axis,
                         rows)
  return last, dataclasses.replace(last, payload=pt.T)


def _gathered(t, op: Operand, axes, **kw):
  """`operand` of the whole of ``t``, a shard along dim 0 over ``axes``."""
  def whole(t):
    return lax.all_gather(t, axes, axis=0, tiled=True)
  if op.spec is None:
    return whole(t.astype(kw["dtype"]))
  if not (op.spec.stochastic or (op.hadamard and op.axis == 0)):
    q = partition.gather(operand(t, op, **kw), axes)
    if q is not None:
      return q
  return operand(whole(t), op, **kw)


def _qdq(t, spec, axis: int, amax=None):
  """Quantize-dequantize ``t`` (2-D) along ``axis``, in ``t``'s layout."""
  if spec is None:
    return t
  tn = axis != 1 and spec.fmt.packed
  d = operand(t, Operand(spec, axis, tn), amax=amax).dequantize(t.dtype)
  return d.T if tn else d


def fake_quant_matmul(x, w, recipe: Recipe | str, state=None):
  """Reference Fprop: quantize-dequantize both operands, then an FP32 dot.

  The casts are straight-through (identity gradient), so `jax.grad` of this
  function is the unquantized backward of the fake-quantized forward: the
  oracle the tests compare `quantized_matmul` against.
  """
  recipe = load_recipe(recipe)
  x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  w = w.astype(jnp.float32)
  fx, fw = recipe.fprop.lhs, recipe.fprop.rhs
  ax = aw = None
  if recipe.delayed:
    ax, _ = delayed_amax(x2, state["x"], recipe)
    aw, _ = delayed_amax(w, state["w"], recipe)

  def ste(t, spec, axis, amax):
    return t + lax.stop_gradient(_qdq(t, spec, axis, amax) - t)

  y = jnp.dot(ste(x2, fx, 1, ax), ste(w, fw, 0, aw),
              precision=lax.Precision.HIGHEST)
  return y.reshape(*x.shape[:-1], w.shape[1])
