"""Shared helpers of the layer, grad and optimizer tests."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import qlayers

# Forward SQNR floors (dB) vs nnx.Linear: DESIGN.md's public floors, and for
# MXFP6/MXFP4 (none published) a little under their element precision.
DENSE_FLOORS = {"fp8_delayed": 18, "fp8_current": 18, "fp8_rowwise": 18,
                "deepseek_v3": 25, "mxfp8": 26, "mxfp6": 22, "mxfp4": 12,
                "mxfp4_rht": 12}
DEFAULT_FLOOR = 10  # a recipe added later without a floor of its own here


def delayed(history_len=4, **kw):
  return qlayers.recipe("fp8_delayed", amax_history_len=history_len, **kw)


def pure(tree):
  """{"a/b/c": np.ndarray} of an nnx.State (or any pytree of Variables)."""
  leaves = jax.tree_util.tree_leaves_with_path(nnx.as_pure(tree))
  return {"/".join(str(getattr(k, "key", getattr(k, "name", k)))
                   for k in path): np.asarray(v) for path, v in leaves}


def param_signature(module):
  return {k: (v.shape, v.dtype) for k, v in pure(nnx.state(module,
                                                            nnx.Param)).items()}


def optax_rules():
  """optax.adam computes ``decay ** count`` (float ** int32), which the strict
  dtype promotion of this suite refuses: run optimizer updates under the
  standard rules."""
  return jax.numpy_dtype_promotion("standard")


def train_step(loss_fn):
  @nnx.jit
  def step(model, opt, *args):
    loss, grads = qlayers.value_and_grad(loss_fn)(model, *args)
    opt.update(model, grads)  # Optimizer runs optax under standard promotion
    return loss
  return step


def weighted_sum(y, c):
  """sum(y * c): its gradient w.r.t. ``y`` is exactly ``c``."""
  return jnp.sum(y.astype(jnp.float32) * c)


class Scanned(nnx.Module):
  """Layers made by ``make(rngs)`` under nnx.vmap (``layers`` of them),
  applied with nnx.scan through tanh: a model scanned over its layers."""

  def __init__(self, make, rngs, layers=3):
    self.layers = nnx.split_rngs(splits=layers)(
        nnx.vmap(make, in_axes=0, out_axes=0))(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(layer, x):
      return jnp.tanh(layer(x))
    return body(self.layers, x)
