"""Optimizer side: FP32 masters, narrow moments, non-finite skipping, loss
scaling (an optax wrapper), and `Optimizer`, which applies it to a model and
writes quantization state back exactly.

Only Params go through the optax transformation; quantization state never
does (running it through Adam silently corrupts it). ``optax.apply_updates``
only adds (``p + u``), which cannot write a value exactly (1e3 -> 1e-3 comes
back as 0.00097656 in FP32), so `Optimizer.update` writes narrow Params from
their masters, and the gradient-side quantization state is written by
`qlayers.update_scales`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from qlayers.layers.core import gemms, update_scales

__all__ = ["MixedPrecisionState", "mixed_precision", "Optimizer"]


class MixedPrecisionState(NamedTuple):
  """State of `mixed_precision`.

  Attributes:
    master: wide copies of Params stored narrower than ``master_dtype`` (a
      zero-size marker for Params already wide).
    inner_state: the wrapped transformation's state, floating arrays stored
      in ``moment_dtype``.
    skipped: number of steps skipped for non-finite gradients.
    loss_scale: current loss scale (1 without loss scaling).
    good_steps: finite steps since the loss scale last changed.
  """

  master: Any
  inner_state: Any
  skipped: jax.Array
  loss_scale: jax.Array
  good_steps: jax.Array


def _no_master(m) -> bool:
  return m.ndim == 1 and m.shape[0] == 0


def _floating(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _cast_moments(tree, dtype):
  """Casts floating arrays of rank >= 1 (moments, not scalar hyperparams)."""
  return jax.tree.map(
      lambda x: x.astype(dtype) if _floating(x) and x.ndim >= 1 else x, tree)


def mixed_precision(
    inner: optax.GradientTransformation, *,
    master_dtype=jnp.float32, moment_dtype=jnp.float32,
    skip_nonfinite: bool = True, dynamic_loss_scale: bool = False,
    init_loss_scale: float = 2.0**15, growth_interval: int = 2000,
    growth_factor: float = 2.0, backoff_factor: float = 0.5,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with master weights, moment dtype, skipping, loss scaling.

  * Params narrower than ``master_dtype`` (e.g. BF16) get a ``master_dtype``
    master copy; ``inner`` sees and updates the masters.
  * ``inner``'s floating state arrays are stored in ``moment_dtype`` (BF16
    moments as in DeepSeek-V3) and computed in FP32.
  * A step whose (unscaled) gradients hold NaN/Inf changes nothing but
    ``skipped`` (and backs off the loss scale).
  * With ``dynamic_loss_scale``, gradients arrive multiplied by
    ``loss_scale`` (see `qlayers.value_and_grad(loss_scale=...)`) and are
    unscaled here; the scale halves on overflow and doubles after
    ``growth_interval`` finite steps.

  The returned updates, added with ``optax.apply_updates``, reproduce the
  masters only approximately for narrow Params; `Optimizer` writes them
  exactly.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = mixed_precision(optax.sgd(0.5))
    >>> p = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> s = tx.init(p)
    >>> s.master["w"].dtype
    dtype('float32')
  """
  master_dtype = jnp.dtype(master_dtype)
  inner = optax.with_extra_args_support(inner)

  def masters(params, master):
    return jax.tree.map(
        lambda p, m: p.astype(master_dtype) if _no_master(m) else m,
        params, master)

  def init_fn(params):
    master = jax.tree.map(
        lambda p: jnp.zeros((0,), master_dtype) if p.dtype == master_dtype
        else p.astype(master_dtype), params)
    with jax.numpy_dtype_promotion("standard"):
      inner_state = inner.init(masters(params, master))
    inner_state = _cast_moments(inner_state, moment_dtype)
    return MixedPrecisionState(
        master=master, inner_state=inner_state,
        skipped=jnp.zeros((), jnp.int32),
        loss_scale=jnp.asarray(init_loss_scale if dynamic_loss_scale else 1.0,
                               jnp.float32),
        good_steps=jnp.zeros((), jnp.int32))

  def update_fn(grads, state: MixedPrecisionState, params=None, **extra):
    if params is None:
      raise ValueError("mixed_precision needs `params` in update().")
    inv = 1.0 / state.loss_scale
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) * inv, grads)
    finite = jnp.all(jnp.array(
        [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)] or [True]))
    wide = masters(params, state.master)
    inner_state = jax.tree.map(
        lambda x, ref: x.astype(jnp.float32) if _floating(x) and x.ndim >= 1
        and _floating(ref) else x, state.inner_state, state.inner_state)
    # optax mixes int counts and float decays (adam's bias correction), which
    # strict dtype promotion refuses; the wrapped update runs under standard.
    with jax.numpy_dtype_promotion("standard"):
      upd, new_inner = inner.update(grads, inner_state, wide, **extra)
    new_wide = optax.apply_updates(wide, upd)
    new_inner = _cast_moments(new_inner, moment_dtype)
    new_master = jax.tree.map(
        lambda m, n: m if _no_master(m) else n.astype(master_dtype),
        state.master, new_wide)
    # What the caller adds to its params: the inner update for wide params
    # (p + u is then exactly the new master), the narrowed difference else.
    out = jax.tree.map(
        lambda p, m, u, n: u.astype(p.dtype) if _no_master(m)
        else n.astype(p.dtype) - p, params, state.master, upd, new_wide)
    ok = finite if skip_nonfinite else jnp.array(True)
    keep = lambda new, old: jax.tree.map(
        lambda a, b: jnp.where(ok, a, b), new, old)
    out = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), out)
    loss_scale, good = state.loss_scale, state.good_steps
    if dynamic_loss_scale:
      good = jnp.where(finite, good + 1, 0)
      grow = good >= growth_interval
      loss_scale = jnp.where(
          finite, jnp.where(grow, loss_scale * growth_factor, loss_scale),
          jnp.maximum(loss_scale * backoff_factor, 1.0))
      good = jnp.where(grow, 0, good)
    new_state = MixedPrecisionState(
        master=keep(new_master, state.master),
        inner_state=keep(new_inner, state.inner_state),
        skipped=state.skipped + (~finite).astype(jnp.int32),
        loss_scale=loss_scale, good_steps=good)
    return out, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _wants_dynamic_loss_scale(model) -> bool:
  return any(g.recipe.loss_scaling == "dynamic" for _, g in gemms(model))


@functools.lru_cache(maxsize=64)
def _wrap_cached(tx, master_dtype, moment_dtype, **kwargs):
  return mixed_precision(tx, master_dtype=master_dtype,
                         moment_dtype=moment_dtype, **kwargs)


def _cached_mixed_precision(tx, *, master_dtype, moment_dtype, **kwargs):
  """`mixed_precision`, the same object for the same ``tx`` and settings.

  The wrapper is a static attribute of `Optimizer`, so ``nnx.jit`` compares
  it by equality: building a fresh closure per optimizer would recompile the
  train step for every new optimizer around the same ``tx``.
  """
  master_dtype, moment_dtype = jnp.dtype(master_dtype), jnp.dtype(moment_dtype)
  try:
    return _wrap_cached(tx, master_dtype, moment_dtype, **kwargs)
  except TypeError:  # an unhashable tx or setting: no caching
    return mixed_precision(tx, master_dtype=master_dtype,
                           moment_dtype=moment_dtype, **kwargs)


class Optimizer(nnx.Optimizer):
  """``nnx.Optimizer`` for quantized models (same ``update(model, grads)``).

  Applies ``tx`` wrapped in `mixed_precision` to the ``wrt`` Params; writes
  narrow Params exactly from their FP32 masters; then ends the step of every
  quantized GEMM with `qlayers.update_scales` (the gradient amaxes returned
  by `qlayers.value_and_grad` are written, by max and never through ``tx``,
  and every amax history rolls once).

  Args:
    model: the model.
    tx: any optax transformation.
    wrt: the Params to optimize (default ``nnx.Param``).
    master_dtype, moment_dtype, skip_nonfinite: see `mixed_precision`.
    loss_scaling: ``"dynamic"``, ``"none"``, or ``None`` to follow the
      model's recipes (FP16 recipes ask for dynamic loss scaling).
    **loss_scale_kwargs: ``init_loss_scale``, ``growth_interval``, ...

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
    >>> int(opt.step[...])
    1
  """

  def __init__(self, model, tx: optax.GradientTransformation, *,
               wrt=nnx.Param, master_dtype=jnp.float32,
               moment_dtype=jnp.float32, skip_nonfinite: bool = True,
               loss_scaling: str | None = None, **loss_scale_kwargs):
    if loss_scaling is None:
      loss_scaling = "dynamic" if _wants_dynamic_loss_scale(model) else "none"
    if loss_scaling not in ("dynamic", "none"):
      raise ValueError(f"loss_scaling must be 'dynamic', 'none' or None, got "
                       f"{loss_scaling!r}.")
    wrapped = _cached_mixed_precision(
        tx, master_dtype=master_dtype, moment_dtype=moment_dtype,
        skip_nonfinite=skip_nonfinite,
        dynamic_loss_scale=loss_scaling == "dynamic", **loss_scale_kwargs)
    super().__init__(model, wrapped, wrt=wrt)
    self.loss_scaling = loss_scaling

  @property
  def loss_scale(self) -> jax.Array:
    """The current loss scale (pass it to `qlayers.value_and_grad`)."""
    return self.opt_state.loss_scale[...]

  @property
  def skipped_steps(self) -> jax.Array:
    """How many updates were skipped for non-finite gradients."""
    return self.opt_state.skipped[...]

  def update(self, model, grads, /, **kwargs):
    """Applies one step; see the class docstring."""
    params = nnx.as_pure(nnx.state(model, self.wrt))
    param_grads = nnx.as_pure(nnx.state(grads, self.wrt))
    if jax.tree.structure(params) != jax.tree.structure(param_grads):
      raise ValueError(
          "grads do not match the model's optimized Variables; compute them "
          "with qlayers.value_and_grad (or nnx.grad) using the same `wrt`.")
    opt_state = nnx.as_pure(self.opt_state)
    updates, new_state = self.tx.update(param_grads, opt_state, params,
                                        **nnx.as_pure(kwargs))
    new_params = optax.apply_updates(params, updates)
    new_params = jax.tree.map(
        lambda p, m, n: n if _no_master(m) else m.astype(p.dtype),
        params, new_state.master, new_params)
    nnx.update(model, new_params)
    nnx.update(self.opt_state, nnx.state(new_state))
    self.step[...] += 1
    update_scales(model, grads)
    return updates
