"""The experts of a mixture of experts, quantized: `QuantExperts` (a layer of
stacked expert kernels, tokens sorted by expert), `QuantExpertsEinsum` (an
``nnx.Einsum`` batched over experts, e.g. ``"ecd,edf->ecf"`` after a
one-hot dispatch into per-expert capacity buffers) and `QuantRaggedDot` (a
stateful ``lax.ragged_dot``-compatible callable, as `QuantGemm` is for
``lax.dot_general``).

All run every expert's three GEMMs quantized with its own scales
(`qlayers.ops.quantized_ragged_dot`, or `ops.quantized_dot_general` per
expert), and for a delayed-scaling recipe one amax
history per expert and role (the `QuantGemm` state with a leading axis of
``num_groups``), which `qlayers.update_scales`, `qlayers.value_and_grad`
and `qlayers.Optimizer` handle like any other layer's.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from qlayers import formats
from qlayers import ops
from qlayers import ragged
from qlayers import sharding
from qlayers.layers.core import QuantGemm, QuantLayer
from qlayers.layers.dense import check_real
from qlayers.layers.general import einsum_gemm_plan
from qlayers.recipe import Recipe

__all__ = ["QuantExperts", "QuantExpertsEinsum", "QuantRaggedDot",
           "default_kernel_init", "expert_einsum"]

default_kernel_init = nnx.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
    batch_axis=(0,))
"""LeCun normal per expert: fan-in is ``in_features``, not ``E * in``."""


class ExpertSite(NamedTuple):
  """What an expert's GEMM of `QuantRaggedDot.dot_general` tells
  `qlayers.ops.intercept` it comes from: the layer's GEMM and the expert
  (traced: the experts run under ``jax.vmap``)."""

  gemm: "QuantRaggedDot"
  expert: jax.Array


class QuantRaggedDot(QuantGemm):
  """A `QuantGemm` with ``lax.ragged_dot``'s signature, one per stacked
  expert weight: an MoE module that takes its grouped GEMM as an attribute
  (``self.ragged_dot = jax.lax.ragged_dot``) takes this instead, and
  `qlayers.quantize` puts one there.

  Args:
    recipe: a recipe name, TOML path or `Recipe`.
    num_groups: the number of experts (the state's leading axis).
    backend: force a GEMM backend (see `QuantGemm`).
    capacity: the most tokens of one expert the GEMM holds; more are dropped
      (see `qlayers.ops.quantized_ragged_dot`). Default: no limit.
    use_running_average: start in eval mode.
    stack: leading dims of a stack of expert layers made under ``nnx.vmap``
      and run by ``nnx.scan`` (`qlayers.quantize` sets it): the state is
      ``(*stack, num_groups)``, and each layer of the stack sees its own.

  Example:
    >>> import jax.numpy as jnp
    >>> rd = QuantRaggedDot("fp8_delayed", num_groups=2)
    >>> rd(jnp.ones((3, 16)), jnp.ones((2, 16, 8)), jnp.array([1, 2])).shape
    (3, 8)
    >>> rd.x_amax_history.shape, rd.x_amax[...].tolist()
    ((2, 1024), [1.0, 1.0])
  """

  def __init__(self, recipe: Recipe | str = "fp8_delayed", *,
               num_groups: int, backend: str | None = None,
               capacity: int | None = None,
               use_running_average: bool = False,
               stack: tuple[int, ...] = ()):
    super().__init__(recipe, backend=backend,
                     batch_shape=(*stack, num_groups),
                     use_running_average=use_running_average)
    self.num_groups = num_groups
    self.capacity = capacity

  def _check_experts(self, n: int | None) -> None:
    """Refuses weights of ``n`` experts where this module keeps per-expert
    state (delayed scaling, step-keyed rounding) for another number (its
    local shard's inside ``shard_map``)."""
    state = self.read()
    per_expert = (state["x"].amax if state is not None
                  else self.sr_seed if self.recipe.sr_key == "step" else None)
    have = None if per_expert is None else (
        per_expert.shape[-1] if per_expert.ndim else 0)
    if n is not None and have is not None and have != n:
      raise ValueError(
          f"QuantRaggedDot keeps state for {have} experts (num_groups="
          f"{self.num_groups}), but the weights hold {n}.")

  def rounding_key(self) -> jax.Array | None:
    """One stochastic-rounding key per expert (``sr_key = "step"``; None
    otherwise): `QuantGemm.rounding_key` of each expert's seed."""
    if self.recipe.sr_key != "step":
      return None
    step = self.sr_step[...]
    if not self.use_running_average:
      self.sr_step.set_value(step + jnp.uint32(1))
    return jax.vmap(formats.rounding_key)(self.sr_seed[...], step)

  def ragged(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
             out_dtype=None, capacity: int | None = None) -> jax.Array:
    """``lax.ragged_dot(x [m, k], w [g, k, n], group_sizes)``, quantized
    (``w`` is quantized from the value given: pass the FP32 master);
    ``capacity``: this call's, instead of ``self.capacity``.

    ``w`` may hold a shard of the experts (inside ``shard_map``, with this
    module's state sharded alike): a delayed recipe's state must have one
    entry per expert of ``w``. Inside `qlayers.ops.intercept` the GEMM goes
    to the intercepting function, with ``group_sizes=`` and ``capacity=``
    added to its keywords (`qlayers.inspect` measures experts this way)."""
    self._check_experts(jnp.shape(w)[0] if jnp.ndim(w) == 3 else None)
    with self.writing_state("ragged"):
      y, new_state = ragged.quantized_ragged_dot(
          x, w, group_sizes, self.recipe, self.read(),
          key=self.rounding_key(), out_dtype=out_dtype, backend=self.backend,
          capacity=self.capacity if capacity is None else capacity, site=self)
      self.write(new_state)
    return y

  def __call__(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
               precision=None, preferred_element_type=None,
               group_offset=None) -> jax.Array:
    """`lax.ragged_dot`, quantized; ``precision`` is ignored (the recipe sets
    operand precision) and ``group_offset`` refused (pass the local groups)."""
    del precision
    check_real(type(self).__name__, lhs)
    if group_offset is not None:
      raise NotImplementedError(
          "QuantRaggedDot does not take group_offset (a shard of the groups); "
          "pass the local groups' rhs and group_sizes.")
    return self.ragged(lhs, rhs, group_sizes,
                       out_dtype=preferred_element_type
                       or ops.default_out_dtype(self.recipe,
                                                jnp.result_type(lhs, rhs)))


  def dot_general(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers,
                  precision=None, preferred_element_type=None,
                  out_sharding=None) -> jax.Array:
    """`lax.dot_general` batched over one dim, the experts: each batch entry
    is its own quantized GEMM with its expert's scales and state (what
    ``jnp.einsum(..., _dot_general=rd.dot_general)`` passes for
    ``"ecd,edf->ecf"``; jnp.einsum runs it under its own jit, where a
    recipe with state, delayed or step-keyed rounding, cannot write it:
    call this method directly then, or use `QuantExpertsEinsum`)."""
    del precision
    (lc, rc), (lb, rb) = dimension_numbers
    if len(lb) != 1:
      raise ValueError(f"QuantRaggedDot.dot_general maps one batch dim (the "
                       f"experts); got batch dims {lb}, {rb}.")
    inner = tuple(tuple(d - (d > b) for d in dims)
                  for dims, b in ((lc, lb[0]), (rc, rb[0])))
    out = preferred_element_type or ops.default_out_dtype(
        self.recipe, jnp.result_type(lhs, rhs))

    def one(a, b, st, key, expert):
      return ops.quantized_dot_general(
          a, b, (inner, ((), ())), self.recipe, st, key=key,
          preferred_element_type=out, backend=self.backend,
          site=ExpertSite(self, expert))

    if lhs.shape[lb[0]] != rhs.shape[rb[0]]:
      raise ValueError(
          f"QuantRaggedDot.dot_general: the input has {lhs.shape[lb[0]]} "
          f"experts (dim {lb[0]} of {lhs.shape}), the weights "
          f"{rhs.shape[rb[0]]} (dim {rb[0]} of {rhs.shape}).")
    self._check_experts(rhs.shape[rb[0]])
    state = self.read()
    with self.writing_state("dot_general"), sharding.unpartitioned():
      y, new_state = jax.vmap(one, in_axes=(lb[0], rb[0], 0, 0, 0))(
          lhs, rhs, state, self.rounding_key(),
          jnp.arange(rhs.shape[rb[0]], dtype=jnp.int32))
      self.write(new_state)
    if out_sharding is not None:
      y = jax.sharding.reshard(y, out_sharding)
    return y


def expert_einsum(einsum_str: str) -> str:
  """The expert index of an ``Einsum`` batched over its kernel's leading
  index (in the input, the kernel and the output), each expert one GEMM:
  ``"ecd,edf->ecf"`` -> ``"e"``. Raises ValueError saying why not.

  Example:
    >>> expert_einsum("ecd,edf->ecf")
    'e'
  """
  eq = einsum_str.replace(" ", "")
  ins, _, out = eq.partition("->")
  lhs, _, rhs = ins.partition(",")
  e = rhs[:1]
  if not e or e not in lhs or e not in out or "." in eq:
    raise ValueError(f"Einsum {einsum_str!r} is not batched over the "
                     "kernel's leading (expert) index.")
  drop = lambda t: t.replace(e, "")  # noqa: E731
  einsum_gemm_plan(f"{drop(lhs)},{drop(rhs)}->{drop(out)}")
  return e


class QuantExpertsEinsum(QuantLayer, nnx.Einsum):
  """``nnx.Einsum`` batched over experts, every expert's GEMMs quantized.

  The equation is batched over the kernel's leading index, the experts
  (``"ecd,edf->ecf"``: per-expert capacity buffers after a one-hot
  dispatch), and is one GEMM per expert (see `expert_einsum`). Same
  constructor, Params, names and shapes as ``nnx.Einsum``; each expert's
  GEMMs get their own scales and, for a delayed recipe, their own amax
  history (the `QuantRaggedDot` at ``quant``). The kernel is quantized after
  ``nnx.Einsum``'s dtype promotion (from the master in the default FP32).

  Args:
    einsum_str: the equation.
    kernel_shape: ``(E, ...)``.
    bias_shape: as ``nnx.Einsum``.
    recipe: the quantization recipe (default ``"fp8_delayed"``).
    backend: force a GEMM backend (see `QuantGemm`).
    **kwargs: everything else ``nnx.Einsum`` takes.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> layer = QuantExpertsEinsum("ecd,edf->ecf", (4, 64, 32),
    ...                            recipe="fp8_current", rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((4, 8, 64))).shape
    (4, 8, 32)
  """

  def __init__(self, einsum_str: str, kernel_shape, bias_shape=None, *,
               recipe: Recipe | str = "fp8_delayed",
               backend: str | None = None, **kwargs):
    expert_einsum(einsum_str)
    super().__init__(einsum_str, kernel_shape, bias_shape, **kwargs)
    self._refuse_injected_op()
    self.quant = QuantRaggedDot(recipe, num_groups=kernel_shape[0],
                                backend=backend)
    self.quant.seed_from(self.kernel[...])

  def __call__(self, inputs: jax.Array, einsum_str: str | None = None,
               out_sharding=None) -> jax.Array:
    """Applies the equation, quantized per expert."""
    check_real(type(self).__name__, inputs)
    eq = (einsum_str or self.einsum_str).replace(" ", "")
    e = expert_einsum(eq)
    inputs, kernel, bias = self.promote_dtype(
        (inputs, self.kernel[...],
         self.bias[...] if self.bias is not None else None), dtype=self.dtype)
    (lhs, rhs), out = eq.split("->")[0].split(","), eq.split("->")[1]
    summed = [c for c in rhs if c in lhs and c not in out]
    dn = (([lhs.index(c) for c in summed], [rhs.index(c) for c in summed]),
          ((lhs.index(e),), (0,)))
    y = self.quant.dot_general(
        inputs, kernel, dn, preferred_element_type=self.preferred_element_type,
        out_sharding=None)
    made = [e] + [c for c in lhs + rhs if c != e and c not in summed]
    y = jnp.transpose(y, [made.index(c) for c in out])
    if bias is not None:
      y = y + jnp.reshape(bias, self._infer_broadcasted_bias_shape(
          eq, inputs, kernel))
    if out_sharding is not None:
      y = jax.sharding.reshard(y, out_sharding)
    return y


class QuantExperts(QuantLayer, nnx.Module):
  """Stacked expert kernels applied to tokens sorted by expert, quantized.

  ``y = lax.ragged_dot(x, kernel, group_sizes) [+ bias[expert of row]]``
  with every GEMM (forward and backward) quantized per expert by ``recipe``.
  Params: ``kernel [num_experts, in_features, out_features]`` and, with
  ``use_bias``, ``bias [num_experts, out_features]``: the names and shapes
  of a stock MoE's stacked experts, so checkpoints move between the two.
  Inputs are promoted to ``dtype`` as ``nnx.Linear`` does; the kernel is
  quantized from its stored (FP32 master) value. State (delayed recipes:
  one amax history per expert) lives in the `QuantRaggedDot` at ``quant``.

  Args:
    num_experts: the number of experts ``E``.
    in_features: ``K``.
    out_features: ``N``.
    use_bias: whether each expert adds a bias.
    dtype: the computation dtype (default: inferred from the input).
    param_dtype: the Params' dtype.
    kernel_init: initializer of the ``(E, K, N)`` kernel (default: LeCun
      normal per expert).
    bias_init: initializer of the ``(E, N)`` bias.
    kernel_metadata, bias_metadata: metadata of the Params (e.g.
      ``{"out_sharding": ("expert", None, "model")}``), as nnx's layers take.
    rngs: the random number generators.
    recipe: the quantization recipe (default ``"fp8_delayed"``).
    backend: force a GEMM backend (see `QuantGemm`).
    capacity: the most tokens one expert takes (the GEMM's buffers are
      ``[E, capacity, K]``); more are dropped: output 0, no gradient.
      Default: no limit (buffers ``[E, m, K]``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import qlayers
    >>> experts = qlayers.QuantExperts(4, 64, 32, recipe="mxfp8",
    ...                                rngs=nnx.Rngs(0))
    >>> jax.tree.map(jnp.shape, nnx.state(experts, nnx.Param))
    State({
      'kernel': Param(
        value=(4, 64, 32)
      )
    })
    >>> x = jnp.ones((10, 64))  # tokens sorted by expert
    >>> experts(x, jnp.array([3, 0, 5, 2])).shape
    (10, 32)
  """

  def __init__(self, num_experts: int, in_features: int, out_features: int,
               *, use_bias: bool = False, dtype=None,
               param_dtype=jnp.float32, kernel_init=default_kernel_init,
               bias_init=nnx.initializers.zeros_init(),
               kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
               bias_metadata: Mapping[str, Any] = MappingProxyType({}),
               rngs: nnx.Rngs, recipe: Recipe | str = "fp8_delayed",
               backend: str | None = None, capacity: int | None = None):
    shape = (num_experts, in_features, out_features)
    self.kernel = nnx.Param(kernel_init(rngs.params(), shape, param_dtype),
                            **kernel_metadata)
    self.bias = (nnx.Param(bias_init(rngs.params(),
                                     (num_experts, out_features),
                                     param_dtype), **bias_metadata)
                 if use_bias else nnx.data(None))
    self.num_experts = num_experts
    self.in_features = in_features
    self.out_features = out_features
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.quant = QuantRaggedDot(recipe, num_groups=num_experts,
                                backend=backend, capacity=capacity)
    self.quant.seed_from(self.kernel[...])

  def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``x [m, in_features]`` (sorted by expert), ``group_sizes
    [num_experts]`` -> ``[m, out_features]``; rows past the groups give 0."""
    check_real(type(self).__name__, x)
    kernel = self.kernel[...]
    k = sharding.weight_shards(kernel, 1)[1][1]  # an FSDP shard's whole K
    if x.ndim != 2 or x.shape[1] != k:
      raise ValueError(f"QuantExperts expects tokens of shape (m, {k}), "
                       f"got {x.shape}.")
    bias = self.bias[...] if self.bias is not None else None
    x, _, bias = nnx.nn.dtypes.promote_dtype((x, kernel, bias),
                                             dtype=self.dtype)
    y = self.quant.ragged(x, kernel, group_sizes)
    if bias is not None:
      gid, valid = ragged.group_ids(group_sizes, x.shape[0],
                                    self.quant.capacity)
      y = y + jnp.where(valid[:, None], bias[gid], 0).astype(y.dtype)
    return y
