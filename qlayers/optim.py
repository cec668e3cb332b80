"""`Optimizer`: the optax wrappers of `qlayers.optim_wrappers` applied to a
model, with the Params and the quantization state written back exactly.

Only Params go through the optax transformation; quantization state never
does (running it through Adam silently corrupts it). ``optax.apply_updates``
only adds (``p + u``), which cannot write a value exactly (1e3 -> 1e-3 comes
back as 0.00097656 in FP32), so `Optimizer.update` writes narrow Params from
their masters, and the gradient-side quantization state is written by
`qlayers.update_scales`.

The optax pieces are re-exported here: `mixed_precision` (their
composition), `master_weights`, `cast_moments`, `skip_if_nonfinite`,
`dynamic_loss_scaling`, their states and `find_state`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from qlayers.grad import check_wrt
from qlayers.layers.core import (check_gemm_sharing, gemms,
                                 merge_grad_amaxes, update_scales)
from qlayers.layers.frozen import FrozenWeight
from qlayers.optim_wrappers import (CastMomentsState, LossScaleState,
                                    MasterWeightsState, SkipState,
                                    all_finite, cast_moments,
                                    dynamic_loss_scaling, find_state,
                                    finite_norm, master_weights,
                                    mixed_precision, needs_master,
                                    resync_masters, skip_if_nonfinite)
from qlayers.state import QuantGradState

__all__ = ["Optimizer", "mixed_precision", "master_weights", "cast_moments",
           "skip_if_nonfinite", "dynamic_loss_scaling", "MasterWeightsState",
           "CastMomentsState", "SkipState", "LossScaleState", "find_state",
           "finite_norm", "needs_master"]


def _wants_dynamic_loss_scale(model) -> bool:
  return any(g.recipe.loss_scaling == "dynamic" for _, g in gemms(model))


class Optimizer(nnx.Optimizer):
  """``nnx.Optimizer`` for quantized models (same ``update(model, grads)``).

  Applies ``tx`` wrapped in `mixed_precision` to the ``wrt`` Params (without
  `master_weights` when no Param is narrower than ``master_dtype``); writes
  narrow Params exactly from their FP32 masters (a narrow Param changed
  from outside, by loading weights after the Optimizer was made, first
  replaces its master: `resync_masters`); then ends the step of every
  quantized GEMM with `qlayers.update_scales` (the gradient amaxes returned
  by `qlayers.value_and_grad` are written, by max and never through ``tx``,
  and every amax history rolls once, recording 0 for a step skipped for
  non-finite gradients; see ``end_step``). Masters and
  moments are Variables with their Params' metadata, so they follow the
  Params' shardings.

  ``tx`` is kept as given (a static attribute, as in ``nnx.Optimizer``: a
  jitted step traces once for the Optimizers around one ``tx``); the
  wrapper is built from it and the settings where it runs (`wrapped_tx`),
  so nothing caches the user's objects.

  Args:
    model: the model.
    tx: any optax transformation.
    wrt: the Params to optimize (default ``nnx.Param``).
    master_dtype, moment_dtype, skip_nonfinite: see `mixed_precision`.
    loss_scaling: ``"dynamic"``, ``"none"``, or ``None`` to follow the
      model's recipes (FP16 recipes ask for dynamic loss scaling).
    end_step: end the step of every quantized GEMM in ``update`` (the
      model's, whatever ``wrt``). With several Optimizers on one model
      (parameter groups), pass ``False`` to all but one and update that one
      last: the others write their gradients' amaxes without ending the
      step, where each update would roll every amax history again. Groups
      decide together: a step whose gradients are not all finite (any
      group's, in the ``grads`` passed) is skipped by every group, so
      groups made with the same settings keep one loss scale.
    **loss_scale_kwargs: ``init_loss_scale``, ``growth_interval``, ... (of
      dynamic loss scaling only: an error without it).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import qlayers
    >>> model = qlayers.QuantDense(8, 4, recipe="fp8_delayed",
    ...                            rngs=nnx.Rngs(0))
    >>> opt = qlayers.Optimizer(model, optax.adam(1e-3))
    >>> loss_fn = lambda m, x: jnp.mean(m(x) ** 2)
    >>> loss, grads = qlayers.value_and_grad(loss_fn)(model, jnp.ones((2, 8)))
    >>> _ = opt.update(model, grads)
    >>> int(opt.step[...]), int(opt.skipped_steps)
    (1, 0)
  """

  def __init__(self, model, tx: optax.GradientTransformation, *,
               wrt=nnx.Param, master_dtype=jnp.float32, moment_dtype=None,
               skip_nonfinite: bool = True,
               loss_scaling: str | None = None, end_step: bool = True,
               **loss_scale_kwargs):
    if not isinstance(model, nnx.Module):
      raise TypeError(f"qlayers.Optimizer(model, tx): model must be an "
                      f"nnx.Module, got {type(model).__name__}.")
    if not (callable(getattr(tx, "init", None))
            and callable(getattr(tx, "update", None))):
      hint = (" (pass the optax transformation itself, not an "
              "nnx.Optimizer)" if isinstance(tx, nnx.Optimizer) else "")
      raise TypeError(f"qlayers.Optimizer(model, tx): tx must be an optax "
                      f"GradientTransformation, got {type(tx).__name__}"
                      f"{hint}.")
    check_wrt(model, wrt, "qlayers.Optimizer")
    check_gemm_sharing(model)
    if not jax.tree.leaves(nnx.state(model, wrt)):
      frozen = any(isinstance(v, FrozenWeight) for _, v in nnx.iter_graph(
          model))
      raise ValueError(
          f"qlayers.Optimizer: wrt={wrt!r} selects no Variable of the model, "
          "so training would change nothing" + (
              "; its kernels are frozen (FrozenWeight, not Params): add "
              "adapters with qlayers.add_lora and train wrt=nnx.LoRAParam"
              if frozen else "") + ".")
    if loss_scaling is None:
      loss_scaling = "dynamic" if _wants_dynamic_loss_scale(model) else "none"
    if loss_scaling not in ("dynamic", "none"):
      raise ValueError(f"loss_scaling must be 'dynamic', 'none' or None, got "
                       f"{loss_scaling!r}.")
    if loss_scale_kwargs and loss_scaling == "none":
      raise ValueError(
          f"qlayers.Optimizer: {', '.join(sorted(loss_scale_kwargs))} set "
          "the dynamic loss scale, and loss scaling is off (no FP16 recipe "
          "in the model, or loss_scaling='none'); pass "
          "loss_scaling='dynamic' to scale the loss.")
    if master_dtype is not None and not any(
        needs_master(p, master_dtype)
        for p in jax.tree.leaves(nnx.state(model, wrt))):
      master_dtype = None  # nothing narrow: no master_weights at all
    wrapping = tuple(sorted(dict(
        master_dtype=master_dtype, moment_dtype=moment_dtype,
        skip_nonfinite=skip_nonfinite,
        dynamic_loss_scale=loss_scaling == "dynamic",
        **loss_scale_kwargs).items()))
    super().__init__(model, mixed_precision(tx, **dict(wrapping)), wrt=wrt)
    self.tx = tx  # as given: static, compared by identity as in nnx
    self.wrt_structure = jax.tree.structure(
        nnx.as_pure(nnx.state(model, wrt)))
    self.wrapping = wrapping
    self.loss_scaling = loss_scaling
    self.end_step = bool(end_step)

  @property
  def wrapped_tx(self) -> optax.GradientTransformationExtraArgs:
    """``tx`` wrapped in `mixed_precision` (built where it is used)."""
    return mixed_precision(self.tx, **dict(self.wrapping))

  @property
  def loss_scale(self) -> jax.Array:
    """The current loss scale (pass it to `qlayers.value_and_grad`)."""
    s = find_state(self.opt_state, LossScaleState)
    return jnp.float32(1.0) if s is None else s.loss_scale[...]

  @property
  def skipped_steps(self) -> jax.Array:
    """How many updates were skipped for non-finite gradients."""
    s = find_state(self.opt_state, SkipState)
    return jnp.int32(0) if s is None else s.skipped[...]

  def update(self, model, grads, /, **kwargs):
    """Applies one step; see the class docstring."""
    if not isinstance(model, nnx.Module) or not isinstance(grads, nnx.State):
      raise TypeError(
          f"Optimizer.update(model, grads) takes the model, then its "
          f"gradients (an nnx.State); got {type(model).__name__}, "
          f"{type(grads).__name__}" + (" (swapped?)" if isinstance(
              model, nnx.State) else "") + ".")
    params = nnx.as_pure(nnx.state(model, self.wrt))
    param_grads = nnx.as_pure(nnx.state(grads, self.wrt))
    if jax.tree.structure(params) != jax.tree.structure(param_grads):
      raise ValueError(
          "grads do not match the model's optimized Variables; compute them "
          "with qlayers.value_and_grad (or nnx.grad) using the same `wrt`.")
    if self.wrt_structure != jax.tree.structure(params):
      raise ValueError(
          "Optimizer.update: the model's optimized Variables changed since "
          "this Optimizer was made (qlayers.freeze, add_lora or merge_lora "
          "after it?); make the Optimizer after changing the model.")
    kwargs = nnx.as_pure(kwargs)
    # Other parameter groups' gradients in ``grads``: a step is skipped by
    # every group or none (and their loss scales move together).
    others = nnx.as_pure(nnx.state(grads, nnx.All(
        nnx.Not(self.wrt), nnx.Not(QuantGradState))))
    if jax.tree.leaves(others):
      kwargs["grads_finite"] = all_finite(others)
    opt_state = resync_masters(nnx.as_pure(self.opt_state), params)
    skip = find_state(opt_state, SkipState)
    updates, new_state = self.wrapped_tx.update(
        param_grads, opt_state, params, **kwargs)
    masters = find_state(new_state, MasterWeightsState)
    masked = lambda x: isinstance(x, optax.MaskedNode)
    if masters is None:
      new_params = optax.apply_updates(params, updates)
    else:  # narrow Params are the rounded masters, never p + u
      new_params = jax.tree.map(
          lambda m, p, u: optax.apply_updates(p, u) if masked(m)
          else m.astype(p.dtype), masters.master, params, updates,
          is_leaf=masked)
    nnx.update(model, new_params)
    nnx.update(self.opt_state, nnx.state(new_state))
    self.step[...] += 1
    if self.end_step:  # a skipped step enters the histories as 0
      update_scales(model, grads, applied=True if skip is None else (
          find_state(new_state, SkipState).skipped == skip.skipped))
    else:
      merge_grad_amaxes(model, grads)
    return updates
