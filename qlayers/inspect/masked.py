"""A matmul whose operand roles are quantized one at a time (no Flax).

`masked_matmul` runs the three GEMMs of ``y = x @ w`` (Fprop, Dgrad, Wgrad)
with each operand role -- ``x``, ``w``, ``g`` -- either quantized as the
recipe says (the copy `qlayers.ops` would make: `numerics.quantized_copy`)
or kept in the recipe's compute dtype, as the unquantized recipes run it,
chosen by a traced ``mask``. A recipe cannot quantize one operand of a GEMM
(`qlayers.recipe.validate` refuses it), so this is emulated: dequantize, then
an FP32 GEMM, which is the numerical reference of every backend
(`qlayers.dispatch`). Because the mask is traced, one compilation measures
every combination (`qlayers.inspect.sensitivity`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qlayers import ops
from qlayers.inspect import numerics
from qlayers.recipe import Recipe

__all__ = ["masked_matmul", "ROLES"]

ROLES = ("x", "w", "g")


def _wide(t, recipe: Recipe):
  return t.astype(recipe.dtype).astype(jnp.float32)


def _operand(t, use, amax, on, recipe, backend):
  """``t`` as this GEMM takes it: its quantized copy (dequantized) where
  ``on``, else in the compute dtype (Hadamard-transformed, if the GEMM
  transforms)."""
  if use.spec is None:
    return _wide(t, recipe)
  op, q = numerics.quantized_copy(t, use, amax, recipe, backend)
  return jnp.where(on, numerics.dequantized(q), _wide(op, recipe))


def _gemm(a, b, uses, amaxes, ons, axes, recipe, backend):
  """One GEMM of ``a`` and ``b`` with each operand quantized where its
  ``on``. With a Hadamard transform, operands are transformed when either
  is quantized (so the product is unchanged) and used as they are when
  neither is (so an all-off mask is the unquantized GEMM)."""
  qa = _operand(a, uses[0], amaxes[0], ons[0], recipe, backend)
  qb = _operand(b, uses[1], amaxes[1], ons[1], recipe, backend)
  out = numerics._dot(qa, qb, axes)
  if uses[0].hadamard and uses[0].spec is not None:
    plain = numerics._dot(_wide(a, recipe), _wide(b, recipe), axes)
    out = jnp.where(ons[0] | ons[1], out, plain)
  return out


def _amax(t, state, role, recipe):
  """The amax a delayed scale comes from (None for current scaling)."""
  if not recipe.delayed:
    return None
  return numerics._amaxes(t, numerics.plain_state(state), role, recipe)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _mm(recipe, backend, out_dtype, dtypes, x, w, state, mask):
  return _forward(recipe, backend, out_dtype, x, w, state, mask)


def _forward(recipe, backend, out_dtype, x, w, state, mask):
  on = mask > 0
  ux, uw = numerics.uses(recipe, "x")[0], numerics.uses(recipe, "w")[0]
  amaxes = (_amax(x, state, "x", recipe), _amax(w, state, "w", recipe))
  y = _gemm(x, w, (ux, uw), amaxes, (on[0], on[1]), (1, 0), recipe, backend)
  return y.astype(out_dtype)


def _mm_fwd(recipe, backend, out_dtype, dtypes, x, w, state, mask):
  del dtypes
  return (_forward(recipe, backend, out_dtype, x, w, state, mask),
          (x, w, state, mask))


def _mm_bwd(recipe, backend, out_dtype, dtypes, res, g):
  del out_dtype
  x, w, state, mask = res
  on = mask > 0
  ax, aw, ag = (_amax(t, state, r, recipe)
                for t, r in ((x, "x"), (w, "w"), (g, "g")))
  gx, gw, gg = (numerics.uses(recipe, r) for r in ROLES)
  dx = _gemm(g, w, (gg[0], gw[1]), (ag, aw), (on[2], on[1]), (1, 1),
             recipe, backend)
  dw = _gemm(x, g, (gx[1], gg[1]), (ax, ag), (on[0], on[2]), (0, 0),
             recipe, backend)
  zero_state = jax.tree.map(jnp.zeros_like, state)
  return (dx.astype(dtypes[0]), dw.astype(dtypes[1]), zero_state,
          jnp.zeros_like(mask))


_mm.defvjp(_mm_fwd, _mm_bwd)


def masked_matmul(x: jax.Array, w: jax.Array, recipe: Recipe, state,
                  mask: jax.Array, *, out_dtype=None, backend=None):
  """``x (..., K) @ w (K, N)`` with the roles ``mask`` selects quantized.

  Args:
    x, w: the operands (as `qlayers.ops.quantized_matmul` takes them).
    recipe: the recipe whose specs quantize the selected roles.
    state: delayed-scaling state (its amax history sets the scales), or None.
    mask: FP32 ``(3,)``: roles ``x``, ``w``, ``g`` quantized where > 0, kept in
      ``recipe.dtype`` (with FP32 accumulation) elsewhere.
    out_dtype: output dtype (default as `qlayers.ops.quantized_matmul`).
    backend: the backend whose operand layout to reproduce.

  Returns:
    ``(y, state)``: ``y`` of shape ``(..., N)``; the state is returned as it
    came (nothing is recorded).

  Example:
    >>> import jax.numpy as jnp, qlayers
    >>> x, w = jnp.ones((4, 64)), jnp.ones((64, 8))
    >>> y, _ = masked_matmul(x, w, qlayers.recipe("mxfp4"), None,
    ...                      jnp.array([1.0, 0.0, 0.0]))
    >>> y.shape
    (4, 8)
  """
  out_dtype = jnp.dtype(out_dtype or ops.default_out_dtype(recipe, x.dtype))
  lead, k = x.shape[:-1], x.shape[-1]
  x2 = x.reshape(-1, k)
  y = _mm(recipe, backend, out_dtype, (x.dtype, w.dtype), x2, w, state,
          jnp.asarray(mask, jnp.float32))
  return y.reshape(*lead, w.shape[1]), state
