"""NNX Variable types for quantization state, and the per-GEMM state module.

Quantization state is never an ``nnx.Param``: ``nnx.state(model, nnx.Param)``
and ``nnx.Optimizer(..., wrt=nnx.Param)`` ignore it, and checkpoints carry it
as plain FP32 arrays.

* `QuantState`: state written in the forward pass (scales, amax histories,
  the running amax of activations and weights).
* `QuantGradState`: the gradient's running amax, known only in the backward
  pass. `qlayers.value_and_grad` returns its new value in the gradients, and
  `qlayers.Optimizer` writes it back exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qlayers import ops
from qlayers.recipe import Recipe

__all__ = ["QuantVariable", "QuantState", "QuantGradState", "DelayedScaling",
           "commit_scales"]


class QuantVariable(nnx.Variable):
  """Base of all quantization state (filter on it to select all of it)."""


class QuantState(QuantVariable):
  """Quantization state written in the forward pass."""


class QuantGradState(QuantVariable):
  """Quantization state written from the backward pass (gradient amax)."""


class DelayedScaling(nnx.Module):
  """Delayed-scaling state of one quantized GEMM: roles ``x``, ``w``, ``g``.

  For each role: ``{role}_scale`` (dequantization factor in use),
  ``{role}_amax_history`` (completed steps, index 0 most recent) and
  ``{role}_amax`` (running max of the current step). All are `QuantState`
  except ``g_amax``, a `QuantGradState`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import qlayers
    >>> s = DelayedScaling(qlayers.recipe("fp8_delayed", amax_history_len=16))
    >>> jax.tree.map(jnp.shape, nnx.state(s))['x_amax_history']
    QuantState(
      value=(16,)
    )
  """

  def __init__(self, recipe: Recipe, batch_shape: tuple[int, ...] = ()):
    """Fresh state; ``batch_shape`` stacks it (layers made under nnx.vmap)."""
    self.recipe = recipe
    def stacked(v):
      return jnp.broadcast_to(v, (*batch_shape, *v.shape))
    for role, st in ops.init_state(recipe).items():
      setattr(self, f"{role}_scale", QuantState(stacked(st.scale)))
      setattr(self, f"{role}_amax_history",
              QuantState(stacked(st.amax_history)))
      kind = QuantGradState if role == "g" else QuantState
      setattr(self, f"{role}_amax", kind(stacked(st.amax)))

  def read(self) -> dict[str, ops.ScaleState]:
    """The state as `ops.ScaleState` per role (values as stored)."""
    return {role: ops.ScaleState(getattr(self, f"{role}_scale")[...],
                                 getattr(self, f"{role}_amax_history")[...],
                                 getattr(self, f"{role}_amax")[...])
            for role in ops.ROLES}

  def write_forward(self, new: dict[str, ops.ScaleState]) -> None:
    """Stores the running amax of the forward roles returned by the op."""
    for role in ("x", "w"):
      value = jax.lax.stop_gradient(new[role].amax)
      getattr(self, f"{role}_amax").set_value(value)

  def commit(self) -> None:
    """Ends a step: histories roll, next scales computed, running amax reset."""
    new = ops.commit_state(self.read(), self.recipe)
    for role, st in new.items():
      getattr(self, f"{role}_scale").set_value(st.scale)
      getattr(self, f"{role}_amax_history").set_value(st.amax_history)
      getattr(self, f"{role}_amax").set_value(st.amax)


def _modules(model):
  for _, node in nnx.iter_graph(model):
    if isinstance(node, DelayedScaling):
      yield node


def commit_scales(model: nnx.Module) -> int:
  """Commits every `DelayedScaling` in ``model``; returns how many.

  `qlayers.Optimizer.update` calls this once per step. Call it yourself when
  training with another optimizer, or the amax histories never move.
  """
  n = 0
  for m in _modules(model):
    m.commit()
    n += 1
  return n


def write_grad_state(model: nnx.Module, grads: nnx.State) -> None:
  """Writes gradient-side state from ``grads`` into ``model`` by max.

  ``grads`` holds, at each `QuantGradState` path, the running amax that left
  the backward pass. A value of -inf (an unused layer under max-combining)
  or any non-finite value carries no information and is ignored.
  """
  updates = nnx.state(grads, QuantGradState)
  current = nnx.state(model, QuantGradState)
  def merge(old, new):
    new = jnp.asarray(new, jnp.float32)
    new = jnp.where(jnp.isfinite(new), new, 0.0)
    return jnp.maximum(old, new)
  merged = jax.tree.map(merge, current, updates)
  nnx.update(model, merged)
