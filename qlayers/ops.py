"""The quantized GEMM in JAX's signatures.

`quantized_matmul` (`qlayers.gemm`: the GEMM with its backward rule) as
``lax.dot_general`` (`quantized_dot_general`, and `dot_general`, a
stateless callable of its signature) and as ``lax.ragged_dot``, an MoE's
grouped GEMM (`quantized_ragged_dot`, `ragged_dot`; `qlayers.ragged`);
with them the names a user of one quantized GEMM needs: its state
(`init_state`), the operands (`operand`, `delayed_amax`) and the
fake-quantized reference (`fake_quant_matmul`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from qlayers import gemm
from qlayers import sharding
from qlayers.gemm import (  # noqa: F401  (re-exported)
    ROLES, WGRAD_INPUT_NAME, default_out_dtype, init_state, intercept,
    intercepting, quantized_matmul)
from qlayers.operands import (  # noqa: F401  (re-exported)
    delayed_amax, fake_quant_matmul, operand, operand_pair, pairable)
from qlayers.ragged import (  # noqa: F401  (re-exported)
    quantized_ragged_dot, ragged_dot)
from qlayers.recipe import Recipe, recipe as load_recipe
from qlayers.scaling import ScaleState

__all__ = [
    "ROLES", "init_state", "default_out_dtype", "delayed_amax", "operand",
    "quantized_matmul", "quantized_dot_general", "dot_general", "intercept",
    "intercepting",
    "fake_quant_matmul", "quantized_ragged_dot", "ragged_dot"
]


def quantized_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers,
                          recipe: Recipe | str,
                          state: dict[str, ScaleState] | None = None, *,
                          preferred_element_type=None,
                          key: jax.Array | None = None,
                          backend: str | None = None, site=None,
                          rhs_quantized=None):
  """`lax.dot_general` of ``lhs`` and ``rhs``, quantized by ``recipe``.

  Any dimension numbers lower to the 2-D op: ``lhs``'s free dims then its
  contracting dims flatten into ``(M, K)``, ``rhs``'s contracting dims then
  its free dims into ``(K, N)``; the result has ``lhs``'s free dims, then
  ``rhs``'s, as ``lax.dot_general`` orders them. Batch dims map the op over
  each batch entry (each entry its own GEMM with its own scales), which a
  delayed recipe's single state cannot do, so it refuses them.

  ``site`` is passed on to `quantized_matmul` (see `intercept`), and so is
  ``rhs_quantized`` as its ``w_quantized`` (``rhs``'s stored codes, of its
  ``(N, K)`` matrix) where ``rhs``'s contracting dims lead, in order, and
  no batch dims map the op.

  Returns:
    ``(out, new_state)`` as `quantized_matmul`.
  """
  recipe = load_recipe(recipe)
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
  if len(lc) != len(rc) or len(lb) != len(rb):
    raise ValueError(f"Malformed dimension_numbers {dimension_numbers}.")
  for name, t, dims in (("lhs", lhs, lc + lb), ("rhs", rhs, rc + rb)):
    if not all(0 <= d < t.ndim for d in dims):  # lax.dot_general's TypeError
      raise TypeError(f"dot_general: {name} {t.shape} has no dims {dims}.")
  out_dtype = preferred_element_type or default_out_dtype(
      recipe, jnp.result_type(lhs, rhs))
  if sharding.explicit_axes():
    ls, rs = sharding.spec_of(lhs), sharding.spec_of(rhs)
    lfree = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rfree = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    y_spec = sharding.dot_spec(tuple(ls[d] for d in (*lb, *lfree)),
                               tuple(rs[d] for d in rfree))
    def run(lhs, rhs, state, key):
      return quantized_dot_general(
          lhs, rhs, dimension_numbers, recipe, state,
          preferred_element_type=out_dtype, key=key, backend=backend,
          site=site)
    run = sharding.auto_region(run, (y_spec, gemm.replicated_specs(state)))
    return run(lhs, rhs, state, key)
  if lb:
    if recipe.delayed:
      raise ValueError(
          f"Recipe {recipe.name!r} uses delayed scaling, whose single "
          "per-tensor state cannot scale a batched GEMM (dimension numbers "
          f"with batch dims {lb}, {rb}); use a current-scaling recipe.")
    inner = ((tuple(_shift(d, lb[0]) for d in lc),
              tuple(_shift(d, rb[0]) for d in rc)),
             (tuple(_shift(d, lb[0]) for d in lb[1:]),
              tuple(_shift(d, rb[0]) for d in rb[1:])))
    def one(a, b):
      return quantized_dot_general(a, b, inner, recipe,
                                   preferred_element_type=out_dtype,
                                   key=key, backend=backend,
                                   site=site)[0]
    with sharding.unpartitioned():
      return jax.vmap(one, in_axes=(lb[0], rb[0]))(lhs, rhs), state
  lfree = [d for d in range(lhs.ndim) if d not in lc]
  rfree = [d for d in range(rhs.ndim) if d not in rc]
  k = math.prod(lhs.shape[d] for d in lc)
  if [rhs.shape[d] for d in rc] != [lhs.shape[d] for d in lc]:
    raise ValueError(f"Contracting dims of shapes {lhs.shape} and "
                     f"{rhs.shape} do not match ({lc} vs {rc}).")
  a = _permute(lhs, lfree + list(lc))
  a = a.reshape(*(lhs.shape[d] for d in lfree), k)
  # N spelled out: with K == 0, reshape(0, -1) cannot infer it (and
  # quantized_matmul returns the zeros lax.dot_general gives for K == 0).
  b = _permute(rhs, list(rc) + rfree).reshape(
      k, math.prod(rhs.shape[d] for d in rfree))
  if list(rc) != list(range(len(rc))):
    rhs_quantized = None  # b is a transpose of rhs, not its reshape
  y, new_state = quantized_matmul(a, b, recipe, state, key=key, site=site,
                                 out_dtype=out_dtype, backend=backend,
                                 w_quantized=rhs_quantized)
  return y.reshape(*y.shape[:-1], *(rhs.shape[d] for d in rfree)), new_state


def _permute(t, order):
  return t if list(order) == list(range(t.ndim)) else jnp.transpose(t, order)


def _shift(d, removed):  # d's index once the dim ``removed`` is gone
  return d - (d > removed)


def dot_general(recipe: Recipe | str, *, backend: str | None = None):
  """A stateless `lax.dot_general`-compatible callable quantized by ``recipe``.

  Plugs into ``nnx.Linear(dot_general=...)`` and
  ``jnp.einsum(..., _dot_general=...)``. Delayed-scaling recipes need state,
  so they are refused here: use `qlayers.QuantGemm`, a stateful callable of
  the same signature.

  Example:
    >>> import jax.numpy as jnp
    >>> dg = dot_general("fp8_current")
    >>> jnp.einsum("bk,kn->bn", jnp.ones((2, 16)), jnp.ones((16, 8)),
    ...            _dot_general=dg).shape
    (2, 8)
  """
  recipe = load_recipe(recipe)
  if recipe.delayed:
    raise ValueError(
        f"Recipe {recipe.name!r} uses delayed scaling, which needs per-layer "
        "state; use qlayers.QuantGemm (or qlayers.QuantDense, "
        "qlayers.quantize) instead of a stateless dot_general.")

  def fn(lhs, rhs, dimension_numbers, precision=None,
         preferred_element_type=None, out_sharding=None, **kwargs):
    del precision  # the recipe decides operand precision
    if kwargs:
      raise TypeError(f"Unsupported dot_general arguments: {sorted(kwargs)}.")
    out, _ = quantized_dot_general(
        lhs, rhs, dimension_numbers, recipe,
        preferred_element_type=preferred_element_type, backend=backend)
    if out_sharding is not None:
      out = jax.sharding.reshard(out, out_sharding)
    return out

  fn.recipe = recipe
  return fn
