"""NNX Variable types of quantization state.

Quantization state is never an ``nnx.Param``: ``nnx.state(model, nnx.Param)``
and ``nnx.Optimizer(..., wrt=nnx.Param)`` ignore it, and checkpoints carry it
as plain FP32 arrays.

* `QuantState`: state written in the forward pass (amax histories, the
  running amax of inputs and weights).
* `QuantGradState`: the output gradient's running amax, known only in the
  backward pass. `qlayers.value_and_grad` returns its new value in the
  gradients, and `qlayers.update_scales` (which `qlayers.Optimizer` calls)
  writes it back exactly.
"""

from __future__ import annotations

from flax import nnx

__all__ = ["QuantVariable", "QuantState", "QuantGradState"]


class QuantVariable(nnx.Variable):
  """Base of all quantization state (filter on it to select all of it)."""


class QuantState(QuantVariable):
  """Quantization state written in the forward pass."""


class QuantGradState(QuantVariable):
  """Quantization state written from the backward pass (gradient amax)."""
