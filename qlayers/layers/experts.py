"""The experts of a mixture of experts, quantized: `QuantExperts` (a layer of
stacked expert kernels) and `QuantRaggedDot` (a stateful
``lax.ragged_dot``-compatible callable, as `QuantGemm` is for
``lax.dot_general``).

Both run `qlayers.ops.quantized_ragged_dot`: every expert's three GEMMs
quantized with its own scales, and for a delayed-scaling recipe one amax
history per expert and role (the `QuantGemm` state with a leading axis of
``num_groups``), which `qlayers.update_scales`, `qlayers.value_and_grad`
and `qlayers.Optimizer` handle like any other layer's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qlayers import ragged
from qlayers.layers.core import QuantGemm, QuantLayer
from qlayers.recipe import Recipe

__all__ = ["QuantExperts", "QuantRaggedDot", "default_kernel_init"]

default_kernel_init = nnx.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
    batch_axis=(0,))
"""LeCun normal per expert: fan-in is ``in_features``, not ``E * in``."""


class QuantRaggedDot(QuantGemm):
  """A `QuantGemm` with ``lax.ragged_dot``'s signature, one per stacked
  expert weight: an MoE module that takes its grouped GEMM as an attribute
  (``self.ragged_dot = jax.lax.ragged_dot``) takes this instead, and
  `qlayers.quantize` puts one there.

  Args:
    recipe: a recipe name, TOML path or `Recipe`.
    num_groups: the number of experts (the state's leading axis).
    backend: force a GEMM backend (see `QuantGemm`).
    use_running_average: start in eval mode.

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
               use_running_average: bool = False):
    super().__init__(recipe, backend=backend, batch_shape=(num_groups,),
                     use_running_average=use_running_average)
    self.num_groups = num_groups

  def ragged(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
             out_dtype=None) -> jax.Array:
    """``lax.ragged_dot(x [m, k], w [g, k, n], group_sizes)``, quantized
    (``w`` is quantized from the value given: pass the FP32 master).

    ``w`` may hold a shard of the experts (inside ``shard_map``, with this
    module's state sharded alike): a delayed recipe's state must have one
    entry per expert of ``w``."""
    y, new_state = ragged.quantized_ragged_dot(
        x, w, group_sizes, self.recipe, self.read(), out_dtype=out_dtype,
        backend=self.backend)
    self.write(new_state)
    return y

  def __call__(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
               precision=None, preferred_element_type=None,
               group_offset=None) -> jax.Array:
    """`lax.ragged_dot`, quantized; ``precision`` is ignored (the recipe sets
    operand precision) and ``group_offset`` refused (pass the local groups)."""
    del precision
    if group_offset is not None:
      raise NotImplementedError(
          "QuantRaggedDot does not take group_offset (a shard of the groups); "
          "pass the local groups' rhs and group_sizes.")
    return self.ragged(lhs, rhs, group_sizes,
                       out_dtype=preferred_element_type
                       or jnp.result_type(lhs, rhs))


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
    rngs: the random number generators.
    recipe: the quantization recipe (default ``"fp8_delayed"``).
    backend: force a GEMM backend (see `QuantGemm`).

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
               bias_init=nnx.initializers.zeros_init(), rngs: nnx.Rngs,
               recipe: Recipe | str = "fp8_delayed",
               backend: str | None = None):
    shape = (num_experts, in_features, out_features)
    self.kernel = nnx.Param(kernel_init(rngs.params(), shape, param_dtype))
    self.bias = (nnx.Param(bias_init(rngs.params(),
                                     (num_experts, out_features),
                                     param_dtype))
                 if use_bias else nnx.data(None))
    self.num_experts = num_experts
    self.in_features = in_features
    self.out_features = out_features
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.quant = QuantRaggedDot(recipe, num_groups=num_experts,
                                backend=backend)

  def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``x [m, in_features]`` (sorted by expert), ``group_sizes
    [num_experts]`` -> ``[m, out_features]``; rows past the groups give 0."""
    kernel = self.kernel[...]
    if x.ndim != 2 or x.shape[1] != kernel.shape[1]:
      raise ValueError(f"QuantExperts expects tokens of shape (m, "
                       f"{kernel.shape[1]}), got {x.shape}.")
    bias = self.bias[...] if self.bias is not None else None
    x, _, bias = nnx.nn.dtypes.promote_dtype((x, kernel, bias),
                                             dtype=self.dtype)
    y = self.quant.ragged(x, kernel, group_sizes, out_dtype=x.dtype)
    if bias is not None:
      gid, valid = ragged.group_ids(group_sizes, x.shape[0])
      y = y + jnp.where(valid[:, None], bias[gid], 0).astype(y.dtype)
    return y
