"""The quantized grouped GEMM of a mixture of experts: ``lax.ragged_dot``.

``y = ragged_dot(x [M, K], w [G, K, N], group_sizes [G])``: the rows of ``x``
are sorted by expert, the first ``group_sizes[0]`` go through ``w[0]``, the
next ``group_sizes[1]`` through ``w[1]``, and so on; rows past the last group
give 0. Each expert's three GEMMs are exactly those of `ops.quantized_matmul`
on its own tokens:

* Fprop ``y_e = x_e @ w[e]``, Dgrad ``dx_e = g_e @ w[e].T``, Wgrad
  ``dw[e] = x_e.T @ g_e``, each operand quantized from the wide tensor along
  the GEMM's contraction dim as the recipe says;
* scales per expert: a weight's (per tensor, per row, 128x128 blocks, MX
  along K) are its expert's own; an activation's or gradient's per-tensor
  scale is the amax of that expert's tokens, its rows/tiles/MX blocks along
  K are per token anyway;
* Wgrad's operands are blocked along the tokens of one expert: each group is
  copied to the top of a zero buffer first, so a scaling block (tile, MX)
  never crosses a group boundary (the padding is inside the op);
* delayed scaling keeps one amax history per expert and role (state with a
  leading ``G`` axis, `init_state`); an expert given no tokens leaves its
  state as it was, as the dense op does for an empty batch.

So each expert's quantized operands and scales are bit-identical to those
of a loop over experts of ``ops.dot_general(recipe)`` on each expert's
slice of tokens (forward and both gradients), and so are the results
wherever the backend's batched GEMM sums in the 2-D GEMM's order (XLA:CPU
does at the tests' sizes; at K = 512 a few outputs differ by one FP32
rounding), which the tests check for every recipe; stochastically
rounded gradients draw their noise per expert buffer, so they are equal in
distribution, not in bits.

How it runs: the groups are gathered into per-expert buffers ``[G, M, K]``
(row ``r`` of expert ``e`` is token ``start[e] + r``, zero past the group)
and `ops.quantized_matmul` is mapped over the experts with ``jax.vmap``; the
result is gathered back to token order. That is G times the activation
bytes and FLOPs: the same masked dense form XLA's CPU backend gives
``lax.ragged_dot`` itself, but not a native grouped kernel. A ``capacity``
(the most tokens one expert takes, as a capacity-bounded dispatch has)
shrinks the buffers to ``[G, capacity, K]``: about ``capacity_factor``
times the activation instead of G times.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from qlayers import gemm
from qlayers import sharding
from qlayers.recipe import Recipe, recipe as load_recipe
from qlayers.scaling import ScaleState

__all__ = ["init_state", "quantized_ragged_dot", "ragged_dot", "group_ids"]


def init_state(recipe: Recipe | str, num_groups: int
               ) -> dict[str, ScaleState] | None:
  """Fresh delayed-scaling state with one amax history per expert (a leading
  ``num_groups`` axis), or None for a stateless recipe.

  Example:
    >>> s = init_state("fp8_delayed", 4)
    >>> s["w"].amax_history.shape, s["g"].amax.shape
    ((4, 1024), (4,))
  """
  return gemm.init_state(recipe, (num_groups,))


def _layout(group_sizes: jax.Array, m: int):
  """``(starts, sizes)`` of the groups, clipped to the ``m`` rows."""
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  cum = jnp.cumsum(sizes)
  starts = jnp.minimum(cum - sizes, m)
  return starts, jnp.minimum(cum, m) - starts


def to_groups(t: jax.Array, starts: jax.Array, sizes: jax.Array,
              rows: int | None = None) -> jax.Array:
  """``t [M, C]`` as per-group buffers ``[G, rows, C]`` (default ``rows``:
  ``M``): group ``e``'s rows at the top of buffer ``e``, zeros below (the
  padding that keeps every scaling block inside one group); a group's rows
  past ``rows`` are left out."""
  r = jnp.arange(rows or t.shape[0], dtype=jnp.int32)
  valid = r[None, :] < sizes[:, None]
  idx = jnp.where(valid, starts[:, None] + r[None, :], 0)
  return jnp.where(valid[..., None], t[idx], jnp.zeros((), t.dtype))


def group_ids(group_sizes: jax.Array, m: int, capacity: int | None = None):
  """``(gid [m], valid [m])``: the group of each of ``m`` sorted rows, and
  whether the row belongs to a group at all (rows past the last do not, nor
  a group's rows past ``capacity``).

  Example:
    >>> import jax.numpy as jnp
    >>> gid, valid = group_ids(jnp.array([2, 0, 1]), 4)
    >>> gid.tolist(), valid.tolist()
    ([0, 0, 2, 2], [True, True, True, False])
  """
  starts, sizes = _layout(jnp.asarray(group_sizes), m)
  gid, valid, _ = _ids(starts, sizes, m, capacity or m)
  return gid, valid


def _ids(starts, sizes, m, rows):
  """``(gid, valid, pos)``: each row's group, whether it is in a buffer of
  ``rows`` rows, and its row there."""
  i = jnp.arange(m, dtype=jnp.int32)
  ends = starts + sizes
  # searchsorted(ends, i, side="right") as a count: jnp.searchsorted fails
  # inside a shard_map that leaves another mesh axis automatic.
  gid = jnp.minimum(jnp.sum(ends[None, :] <= i[:, None], axis=1,
                            dtype=jnp.int32), sizes.shape[0] - 1)
  pos = i - starts[gid]
  valid = (i < ends[-1]) & (pos < rows)
  return gid, valid, jnp.where(valid, pos, 0)


def from_groups(b: jax.Array, starts: jax.Array, sizes: jax.Array, m: int
                ) -> jax.Array:
  """The inverse of `to_groups`: buffers ``[G, rows, C]`` back to ``[m, C]``
  in token order; rows in no buffer are 0."""
  gid, valid, pos = _ids(starts, sizes, m, b.shape[1])
  return jnp.where(valid[:, None], b[gid, pos], jnp.zeros((), b.dtype))


def _known(x) -> bool:
  """Whether array ``x``'s values can be read here (not traced, and on
  this process)."""
  return not isinstance(x, jax.core.Tracer) and getattr(
      x, "is_fully_addressable", True)


def _check(lhs, rhs, group_sizes, recipe: Recipe, state):
  if lhs.ndim != 2 or rhs.ndim != 3:
    raise ValueError(f"ragged_dot expects lhs [m, k] and rhs [g, k, n]; got "
                     f"{lhs.shape} and {rhs.shape}.")
  k = sharding.weight_shards(rhs, 1)[1][1]  # an FSDP shard's whole K
  if lhs.shape[1] != k:
    raise ValueError(f"ragged_dot: lhs has k={lhs.shape[1]}, rhs "
                     f"{rhs.shape} has k={k}.")
  if jnp.shape(group_sizes) != rhs.shape[:1] or not jnp.issubdtype(
      jnp.result_type(group_sizes), jnp.integer):
    raise ValueError(f"ragged_dot: group_sizes must be integers of shape "
                     f"({rhs.shape[0]},) (one per group of rhs {rhs.shape}); "
                     f"got {jnp.shape(group_sizes)} "
                     f"{jnp.result_type(group_sizes)}.")
  if _known(group_sizes) and np.any(np.asarray(group_sizes) < 0):
    # (traced sizes, unknown until run, are clipped to 0)
    raise ValueError(f"ragged_dot: group_sizes must not be negative; got "
                     f"{np.asarray(group_sizes).tolist()}.")
  if not recipe.delayed:
    return
  if state is None:
    raise ValueError(f"Recipe {recipe.name!r} uses delayed scaling and needs "
                     "`state`, one amax history per expert (see "
                     "qlayers.ragged.init_state).")
  g = rhs.shape[0]
  for role, st in state.items():
    if st.amax.shape != (g,):
      raise ValueError(
          f"Delayed-scaling state {role!r} has amax of shape {st.amax.shape}; "
          f"a grouped GEMM of {g} experts keeps one per expert, ({g},) (see "
          "qlayers.ragged.init_state).")


def quantized_ragged_dot(lhs: jax.Array, rhs: jax.Array,
                         group_sizes: jax.Array, recipe: Recipe | str,
                         state: dict[str, ScaleState] | None = None, *,
                         key: jax.Array | None = None, out_dtype=None,
                         backend: str | None = None,
                         capacity: int | None = None, site=None):
  """``lax.ragged_dot(lhs, rhs, group_sizes)`` with every GEMM quantized.

  Args:
    lhs: tokens ``[M, K]``, sorted by group.
    rhs: stacked expert weights ``[G, K, N]``.
    group_sizes: ``[G]`` integers, the number of rows of each group; a
      negative one is a ValueError where the sizes are known when called
      (under ``jax.jit`` they are not, and count as 0).
    recipe: a `Recipe` or a recipe name.
    state: delayed-scaling state with one history per expert (`init_state`);
      required for delayed recipes, ignored otherwise.
    key: PRNG key for stochastic rounding (split per expert), or one key
      per expert ``[G]``; derived from each expert's data if omitted.
    out_dtype: output dtype (as `ops.quantized_matmul`).
    backend: force a GEMM backend (``xla``; see `ops.quantized_matmul`).
    capacity: the most rows of one group the op holds (its buffers are
      ``[G, capacity, K]`` instead of ``[G, M, K]``); a group's rows past it
      are dropped (output 0, no gradient), as by a capacity-bounded
      dispatch. Default: ``M`` (nothing dropped).
    site: what `qlayers.ops.intercept` is told the call comes from (a
      `qlayers.layers.QuantRaggedDot`), which gets ``group_sizes=`` and
      ``capacity=`` among its keywords; None: never intercepted.

  Returns:
    ``(y [M, N], new_state)``: as `ops.quantized_matmul`, per expert (the
    gradient amax leaves as the cotangent of ``state["g"].amax``, ``[G]``).

  Example:
    >>> import jax.numpy as jnp
    >>> x, w = jnp.ones((5, 64)), jnp.ones((3, 64, 32))
    >>> y, _ = quantized_ragged_dot(x, w, jnp.array([2, 0, 3]), "mxfp8")
    >>> y.shape, float(y[0, 0])
    ((5, 32), 64.0)
  """
  recipe = load_recipe(recipe)
  if isinstance(group_sizes, (list, tuple)):  # sizes given as Python ints
    group_sizes = jnp.asarray(group_sizes, jnp.int32)
  _check(lhs, rhs, group_sizes, recipe, state)
  tap = gemm.interceptor(site)
  if tap is not None:
    return tap(site, lhs, rhs, recipe, state, group_sizes=group_sizes,
               key=key, out_dtype=out_dtype, backend=backend,
               capacity=capacity)
  if not recipe.delayed:
    state = None
  out_dtype = jnp.dtype(out_dtype or gemm.default_out_dtype(recipe, lhs.dtype))
  m, g = lhs.shape[0], rhs.shape[0]
  if m == 0 or g == 0 or rhs.shape[2] == 0 or lhs.shape[1] == 0:
    return jnp.zeros((m, rhs.shape[2]), out_dtype), state
  if capacity is not None and (not isinstance(capacity, numbers.Integral)
                               or isinstance(capacity, bool) or capacity < 1):
    raise ValueError(f"ragged_dot: capacity must be a positive int, got "
                     f"{capacity!r}.")
  rows = min(int(capacity or m), m)
  starts, sizes = _layout(jnp.asarray(group_sizes), m)
  keys = key
  typed = key is not None and jax.dtypes.issubdtype(key.dtype,
                                                    jax.dtypes.prng_key)
  if key is not None and jnp.ndim(key) == (0 if typed else 1):
    keys = jax.random.split(key, g)  # one key, not one per expert

  def one(x, w, st, k):
    return gemm.quantized_matmul(x, w, recipe, st, key=k,
                                 out_dtype=out_dtype, backend=backend)

  # The partitioning rule has no batching rule: under a mesh each expert's
  # GEMM is left to XLA's partitioner (as ops' batched dot_general does).
  with sharding.unpartitioned():
    y, new_state = jax.vmap(one)(to_groups(lhs, starts, sizes, rows), rhs,
                                 state, keys)
  if state is not None:
    # An expert with no tokens leaves its state as it was, as
    # `quantized_matmul` of an empty batch does (its zero buffer's GEMM
    # would record its weight's amax and an x amax of 0). Under shard_map,
    # no tokens on any device whose amaxes its own are combined with.
    # The forward roles only: the gradient's state passes through the
    # forward unchanged, and a select on it would add (not max-combine) the
    # cotangents of an idle expert's uses.
    busy = sharding.global_amax(sizes, sizes) > 0
    new_state = {role: st if role == "g" else jax.tree.map(
        lambda new, old: jnp.where(
            busy.reshape((-1,) + (1,) * (new.ndim - 1)), new, old),
        st, state[role]) for role, st in new_state.items()}
  return from_groups(y, starts, sizes, m), new_state


def ragged_dot(recipe: Recipe | str, *, backend: str | None = None,
               capacity: int | None = None):
  """A stateless `lax.ragged_dot`-compatible callable quantized by ``recipe``.

  ``fn(lhs [m, k], rhs [g, k, n], group_sizes [g], precision=None,
  preferred_element_type=None, group_offset=None)``, every GEMM quantized
  per expert as `quantized_ragged_dot` does. Delayed-scaling recipes need
  state per expert, so they are refused here: use `qlayers.QuantExperts` or
  `qlayers.layers.QuantRaggedDot` (a stateful callable of this signature).
  ``precision`` is ignored (the recipe sets operand precision);
  ``group_offset`` (a shard of the groups) is refused: pass the local
  groups' sizes and weights instead. ``capacity``: see
  `quantized_ragged_dot`.

  Example:
    >>> import jax.numpy as jnp
    >>> rd = ragged_dot("fp8_current")
    >>> rd(jnp.ones((6, 16)), jnp.ones((2, 16, 8)), jnp.array([4, 2])).shape
    (6, 8)
  """
  recipe = load_recipe(recipe)
  if recipe.delayed:
    raise ValueError(
        f"Recipe {recipe.name!r} uses delayed scaling, which needs per-expert "
        "state; use qlayers.QuantExperts or qlayers.layers.QuantRaggedDot "
        "instead of a stateless ragged_dot.")

  def fn(lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
         group_offset=None):
    del precision  # the recipe decides operand precision
    if group_offset is not None:
      raise NotImplementedError(
          "qlayers ragged_dot does not take group_offset (a shard of the "
          "groups); pass the local groups' rhs and group_sizes.")
    out_dtype = preferred_element_type or gemm.default_out_dtype(
        recipe, jnp.result_type(lhs, rhs))
    return quantized_ragged_dot(lhs, rhs, group_sizes, recipe,
                                out_dtype=out_dtype, backend=backend,
                                capacity=capacity)[0]

  fn.recipe = recipe
  return fn
