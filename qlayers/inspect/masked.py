"""A quantized matmul with chosen GEMMs left wide (no Flax, no custom_vjp).

`masked_matmul` runs ``y = x @ w`` through `qlayers.ops.quantized_matmul`,
the library's own op, under a `variant` of the recipe in which the GEMMs
(Fprop, Dgrad, Wgrad) that a traced ``mask`` turns off quantize nothing:
their operands are cast to the recipe's compute dtype and multiplied with
FP32 accumulation, as an unquantized recipe runs them. A recipe quantizes
both operands of a GEMM or neither (`qlayers.recipe.validate`), so the GEMM
is the smallest part of a layer a recipe can keep wide, and the part
measured here. The variants (all eight, or the ``masks`` a caller uses)
are the branches of one ``lax.switch`` on the mask: one compilation
measures every combination (`qlayers.inspect.sensitivity`), and a call runs
only its own branch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from qlayers import ops
from qlayers import ragged
from qlayers.recipe import GemmRecipe, Recipe

__all__ = ["masked_matmul", "variant", "GEMMS", "MASKS"]

GEMMS = ("fprop", "dgrad", "wgrad")

# Every mask, in the order of their branches.
MASKS = tuple(tuple(i >> g & 1 for g in range(len(GEMMS))) for i in range(8))


def variant(recipe: Recipe, on) -> Recipe:
  """``recipe`` with every GEMM whose entry of ``on`` (three bools, in
  `GEMMS` order) is false unquantized (its ``out_dtype`` kept).

  Example:
    >>> import qlayers
    >>> r = variant(qlayers.recipe("mxfp8"), (True, False, False))
    >>> r.fprop.quantized, r.dgrad.quantized, r.wgrad.quantized
    (True, False, False)
  """
  changes = {name: GemmRecipe(out_dtype=getattr(recipe, name).out_dtype)
             for name, keep in zip(GEMMS, on) if not keep}
  kept = [getattr(recipe, n) for n, keep in zip(GEMMS, on) if keep]
  if recipe.sr_key == "step" and not any(
      s is not None and s.stochastic for g in kept for s in (g.lhs, g.rhs)):
    changes["sr_key"] = "data"  # no stochastic operand left to key
  return dataclasses.replace(recipe, **changes)


def masked_matmul(x: jax.Array, w: jax.Array, recipe: Recipe, state,
                  mask: jax.Array, *, key=None, out_dtype=None, backend=None,
                  masks=MASKS, group_sizes=None, capacity=None):
  """``x (..., K) @ w (K, N)`` with the GEMMs ``mask`` selects quantized
  (with ``group_sizes``: the grouped GEMM ``x [m, K]``, ``w [G, K, N]`` of
  `qlayers.ragged.quantized_ragged_dot`, ``capacity`` as it takes it).

  Args:
    x, w, state, key, backend: as `qlayers.ops.quantized_matmul` takes them.
    recipe: the recipe whose GEMMs ``mask`` selects.
    mask: ``(3,)``: Fprop, Dgrad, Wgrad quantized by ``recipe`` where > 0,
      unquantized elsewhere (see `variant`).
    out_dtype: output dtype (default as `qlayers.ops.quantized_matmul`).
    masks: the values ``mask`` may take (0/1 triples), one branch each; a
      mask not among them is a ValueError, or under a trace a NaN output.

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

  def branch(on):
    r = variant(recipe, [bool(b) for b in on])
    def run(x, w, state, key):
      if group_sizes is not None:
        return ragged.quantized_ragged_dot(
            x, w, group_sizes, r, state, key=key, out_dtype=out_dtype,
            backend=backend, capacity=capacity)[0]
      return ops.quantized_matmul(x, w, r, state, key=key,
                                  out_dtype=out_dtype, backend=backend)[0]
    return run

  on = jnp.asarray(mask) > 0
  hits = [jnp.all(on == jnp.array(m, bool)) for m in masks]
  if not isinstance(on, jax.core.Tracer) and not any(bool(h) for h in hits):
    raise ValueError(f"mask {mask} is not among the masks {masks}.")
  index = sum(i * h.astype(jnp.int32) for i, h in enumerate(hits))
  y = lax.switch(index, [branch(m) for m in masks], x, w, state, key)
  # A traced mask outside ``masks`` gives NaN, never another branch's value.
  return jnp.where(jnp.any(jnp.stack(hits)), y, jnp.nan).astype(y.dtype), state
