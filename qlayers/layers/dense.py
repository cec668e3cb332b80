"""QuantDense: a drop-in quantized ``nnx.Linear``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qlayers import ops
from qlayers.recipe import Recipe, recipe as load_recipe
from qlayers.state import DelayedScaling

__all__ = ["QuantDense"]


class QuantDense(nnx.Linear):
  """``nnx.Linear`` whose GEMMs (forward and backward) run quantized.

  Same constructor, Params (``kernel (in, out)``, ``bias (out,)``), names,
  shapes and dtypes as ``nnx.Linear``, so checkpoints move between the two.
  Quantization is keyword-only and last: ``recipe`` (name, path or `Recipe`)
  and ``backend``. With a recipe that quantizes nothing (``"bf16"``) it
  computes exactly what ``nnx.Linear`` computes.

  The kernel is quantized from its stored (FP32 master) value; inputs are
  promoted to ``dtype`` first, as ``nnx.Linear`` does. ``precision`` only
  affects unquantized recipes. Delayed-scaling recipes keep their state in a
  `DelayedScaling` submodule ``scaling`` (`QuantState` / `QuantGradState`
  Variables, never Params). Stochastic rounding draws its keys from the data
  being rounded, so the layer needs no RNG stream.

  Args:
    in_features: the number of input features.
    out_features: the number of output features.
    recipe: the quantization recipe (default ``"fp8_delayed"``).
    backend: force a GEMM backend (``"xla"`` or ``"ffi"``); default: chosen
      per platform and format (see ``qlayers.backends()``).
    **kwargs: everything ``nnx.Linear`` takes (``use_bias``, ``dtype``,
      ``param_dtype``, ``precision``, ``kernel_init``, ``bias_init``,
      ``preferred_element_type``, ``rngs``, ...).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import qlayers
    >>> layer = qlayers.QuantDense(64, 32, recipe="mxfp8", rngs=nnx.Rngs(0))
    >>> jax.tree.map(jnp.shape, nnx.state(layer, nnx.Param))
    State({
      'bias': Param(
        value=(32,)
      ),
      'kernel': Param(
        value=(64, 32)
      )
    })
    >>> layer(jnp.ones((2, 64))).shape
    (2, 32)
  """

  def __init__(self, in_features: int, out_features: int, *,
               recipe: Recipe | str = "fp8_delayed",
               backend: str | None = None, **kwargs):
    super().__init__(in_features, out_features, **kwargs)
    self.recipe = load_recipe(recipe)
    self.backend = backend
    self.scaling = nnx.data(
        DelayedScaling(self.recipe) if self.recipe.delayed else None)

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    """Applies the quantized linear map along the last input dimension."""
    if inputs.shape[-1] != self.in_features:
      raise ValueError(f"{type(self).__name__} expects inputs with last dim "
                       f"{self.in_features}, got shape {inputs.shape}.")
    if not self.recipe.quantized:
      return super().__call__(inputs, out_sharding=out_sharding)
    kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
    inputs, _, bias = self.promote_dtype((inputs, kernel, bias),
                                         dtype=self.dtype)
    out_dtype = self.preferred_element_type or inputs.dtype
    state = self.scaling.read() if self.scaling is not None else None
    y, new_state = ops.quantized_matmul(inputs, kernel, self.recipe, state,
                                        out_dtype=out_dtype,
                                        backend=self.backend)
    if self.scaling is not None:
      self.scaling.write_forward(new_state)
    if bias is not None:
      y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,)).astype(y.dtype)
    if out_sharding is not None:
      y = jax.sharding.reshard(y, out_sharding)
    return y
