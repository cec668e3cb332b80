"""QuantDense: a drop-in quantized ``nnx.Linear``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qlayers import sharding
from qlayers.layers.core import QuantGemm, QuantLayer
from qlayers.recipe import Recipe

__all__ = ["QuantDense"]


def check_last_dim(where: str, x, features: int, what: str = "inputs"):
  """Raises if ``x`` is not ``(..., features)`` of a real dtype, naming
  ``where`` (a layer).

  A scalar gets the TypeError ``nnx.Linear`` users meet (``lax.dot_general``
  raises one); a wrong last dim a ValueError. ``features`` is read from the
  local kernel, so a layer whose kernel is split inside ``jax.shard_map``
  checks its shard's size, as ``nnx.Linear`` does.

  Example:
    >>> import jax.numpy as jnp
    >>> check_last_dim("QuantDense", jnp.ones((2, 8)), 8)
    >>> check_last_dim("QuantDense", jnp.float32(1), 8)
    Traceback (most recent call last):
    ...
    TypeError: QuantDense expects inputs of shape (..., 8), got a scalar; give it a feature axis (e.g. x[None]).
  """
  shape = jnp.shape(x)
  if not shape:
    raise TypeError(f"{where} expects {what} of shape (..., {features}), got "
                    "a scalar; give it a feature axis (e.g. x[None]).")
  if shape[-1] != features:
    raise ValueError(f"{where} expects {what} with last dim {features}, got "
                     f"shape {shape}.")
  check_real(where, x, what)


def check_real(where: str, x, what: str = "inputs"):
  """Raises for complex ``x`` (which ``nnx.Linear`` computes), naming
  ``where`` (a layer) and its shape."""
  if jnp.iscomplexobj(x):
    raise TypeError(f"{where} expects real {what}, got {jnp.result_type(x)} "
                    f"of shape {jnp.shape(x)}: a quantized GEMM has no "
                    "complex form (keep the layer stock).")


class QuantDense(QuantLayer, nnx.Linear):
  """``nnx.Linear`` whose GEMMs (forward and backward) run quantized.

  Same constructor, Params (``kernel (in, out)``, ``bias (out,)``), names,
  shapes and dtypes as ``nnx.Linear``, so checkpoints move between the two.
  Quantization is keyword-only and last: ``recipe`` (name, path or `Recipe`)
  and ``backend``. A recipe that quantizes nothing (``"bf16"``) runs the GEMMs
  on operands in its compute dtype with FP32 accumulation.

  The kernel is quantized from its stored (FP32 master) value; inputs are
  promoted to ``dtype`` first, as ``nnx.Linear`` does. ``precision`` is
  ignored (the recipe sets operand precision). The quantized GEMM and its
  state live in the `QuantGemm` at ``quant`` (`QuantState` /
  `QuantGradState` Variables, never Params); ``model.eval()`` stops it
  writing state. Stochastic rounding needs no RNG stream: it draws its keys
  from the data being rounded, or (``sr_key = "step"``, NVFP4) from a seed
  and a step counter in the state, the seed taken from the initial kernel
  (`QuantGemm.seed_from`; `qlayers.quantize` seeds by layer path).

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
    self._refuse_injected_op()
    self.quant = QuantGemm(recipe, backend=backend)
    self.quant.seed_from(self.kernel[...])

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    """Applies the quantized linear map along the last input dimension."""
    kernel, as_read = self.gemm_kernel()
    # An FSDP shard of the kernel (`sharding.gathered_weights`) takes the
    # whole K, as `ops.quantized_matmul` does.
    check_last_dim(type(self).__name__, inputs,
                   sharding.weight_shards(kernel)[1][0])
    bias = self.bias[...] if self.bias is not None else None
    # Promoted as nnx.Linear promotes them; the kernel is quantized from its
    # stored value (the promoted copy is not used).
    inputs, _, bias = self.promote_dtype((inputs, as_read, bias),
                                         dtype=self.dtype)
    y = self.quant.matmul(
        inputs, kernel, bias=bias,
        out_dtype=self.preferred_element_type,
        out_sharding=out_sharding, w_quantized=self.stored_kernel())
    lora = getattr(self, "lora", None)  # an adapter (see qlayers.add_lora)
    return y if lora is None else y + lora(inputs).astype(y.dtype)
