"""Optax wrappers for low-precision training, one job each.

* `master_weights`: wide (FP32) masters for narrow Params.
* `cast_moments`: the wrapped state stored narrow, computed in FP32.
* `skip_if_nonfinite`: a step with NaN/Inf gradients changes nothing but a
  counter.
* `dynamic_loss_scaling`: unscales gradients; the scale backs off on
  overflow and grows after a run of finite steps.
* `mixed_precision`: their composition (what `qlayers.Optimizer` uses).

Each takes any optax transformation ``inner`` and returns an
``optax.GradientTransformationExtraArgs`` whose state is a ``NamedTuple``
holding ``inner_state``. Leaves that need no state of their own (a wide
Param's master) are ``optax.MaskedNode()``, which has no arrays, so every
state array has the shape of the Param it belongs to and (under a mesh) its
sharding. Initialised with ``nnx.Variable`` trees, the state keeps each
Param's metadata.

The inner transformation runs under standard dtype promotion: optax mixes
int step counts and float decays, which strict promotion refuses.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["MasterWeightsState", "master_weights", "CastMomentsState",
           "cast_moments", "SkipState", "skip_if_nonfinite",
           "LossScaleState", "dynamic_loss_scaling", "mixed_precision",
           "finite_norm", "find_state", "needs_master"]

_COMPUTE = jnp.dtype(jnp.float32)  # what narrow state is computed in


def _masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


def _floating(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _inner(inner: optax.GradientTransformation):
  """``inner`` with extra-args support, run under standard promotion."""
  inner = optax.with_extra_args_support(inner)

  def init(params):
    with jax.numpy_dtype_promotion("standard"):
      return inner.init(params)

  def update(updates, state, params=None, **extra):
    with jax.numpy_dtype_promotion("standard"):
      return inner.update(updates, state, params, **extra)

  return init, update


def _float_dtype(dtype, what: str) -> jnp.dtype:
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{what} must be a floating dtype, got {dtype}.")
  return dtype


def needs_master(x, dtype) -> bool:
  """Whether the Param (or array) ``x`` is floating and narrower than
  ``dtype``, i.e. gets a master in `master_weights`."""
  return _floating(x) and jnp.finfo(x.dtype).bits < jnp.finfo(dtype).bits


def all_finite(tree) -> jax.Array:
  """True iff every element of ``tree``'s floating leaves is finite (for
  gradients of unknown scale: a loss-scaled gradient's norm may overflow
  FP32 where its elements do not)."""
  checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if _floating(x) and x.size]
  return functools.reduce(jnp.logical_and, checks, jnp.array(True))


def _step_finite(grads, extra) -> jax.Array:
  """A step's verdict: ``grads`` (unscaled) have a finite norm, and the
  ``grads_finite`` extra argument, where given (other parameter groups'
  gradients: `qlayers.Optimizer`), is True."""
  return finite_norm(grads) & jnp.asarray(extra.get("grads_finite", True))


def finite_norm(tree) -> jax.Array:
  """True iff the global L2 norm of ``tree``'s floating leaves is finite.

  A NaN or an Inf anywhere makes the norm NaN or Inf, and so does a norm
  past FP32's range (about 1.8e19), which no usable gradient has: such a
  step would be clipped to zero or to NaN. Leaves narrower than FP32 are
  widened first (an FP16 gradient of 256 squares past FP16's range), as
  `master_weights` widens the gradients it passes on.

  The norm is ``optax.tree.norm`` of those arrays, the one
  ``optax.clip_by_global_norm`` computes, so where the optimizer clips, XLA
  computes it once for the clip and this check (the per-leaf reductions
  are common subexpressions). Without a clip it costs one reduction per
  leaf (benchmarks/RESULTS.md, "The finiteness check as the clip's norm").

  Example:
    >>> import jax.numpy as jnp
    >>> finite_norm({"w": jnp.ones((2, 3)), "b": jnp.zeros(3)})
    Array(True, dtype=bool)
    >>> finite_norm({"w": jnp.array([[1.0, jnp.inf]]), "b": jnp.zeros(3)})
    Array(False, dtype=bool)
  """
  leaves = [x if jnp.finfo(x.dtype).bits >= 32 else x.astype(_COMPUTE)
            for x in jax.tree.leaves(tree) if _floating(x) and x.size]
  if not leaves:
    return jnp.array(True)
  return jnp.isfinite(optax.tree.norm(leaves))


def find_state(state, cls):
  """The outermost ``cls`` instance in the optimizer state ``state``, or None.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = mixed_precision(optax.sgd(0.1))
    >>> s = tx.init({"w": jnp.ones(2, jnp.bfloat16)})
    >>> find_state(s, MasterWeightsState).master["w"].dtype
    dtype('float32')
  """
  found = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, cls))
  return next((x for x in found if isinstance(x, cls)), None)


# ==========================================================================
# Master weights


class MasterWeightsState(NamedTuple):
  """State of `master_weights`.

  Attributes:
    master: the params tree with a ``dtype`` copy of each narrower floating
      Param and ``optax.MaskedNode()`` for the others.
    inner_state: the wrapped transformation's state, initialised from the
      masters (moments of narrow Params are therefore wide).
  """

  master: Any
  inner_state: Any


def master_weights(inner: optax.GradientTransformation, *,
                   dtype=jnp.float32) -> optax.GradientTransformationExtraArgs:
  """``inner`` run on ``dtype`` masters of the Params narrower than ``dtype``.

  ``inner`` sees the masters (and the gradients cast to ``dtype``) in place
  of the narrow Params, and the masters take its updates. The updates
  returned for a narrow Param are the narrowed new master minus the Param:
  ``optax.apply_updates`` reproduces the master's rounding only up to one
  rounding of ``p + u``; `qlayers.Optimizer` writes such Params from their
  masters instead. Wide Params pass through untouched.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = master_weights(optax.sgd(1e-3))
    >>> p = {"a": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2)}
    >>> s = tx.init(p)
    >>> s.master
    {'a': Array([1., 1.], dtype=float32), 'b': MaskedNode()}
    >>> u, s = tx.update({"a": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2)},
    ...                  s, p)
    >>> s.master["a"], u["a"]
    (Array([0.999, 0.999], dtype=float32), Array([0, 0], dtype=bfloat16))
  """
  dtype = _float_dtype(dtype, "master dtype")
  inner_init, inner_update = _inner(inner)
  narrow = functools.partial(needs_master, dtype=dtype)

  def init_fn(params):
    # A wide Variable (or array) is a leaf and becomes MaskedNode(); a narrow
    # Variable is entered, so its master is a Variable with its metadata.
    master = jax.tree.map(
        lambda p: p.astype(dtype) if narrow(p) else optax.MaskedNode(),
        params, is_leaf=lambda x: hasattr(x, "dtype") and not narrow(x))
    return MasterWeightsState(master, inner_init(_wide(master, params)))

  def update_fn(updates, state: MasterWeightsState, params=None, **extra):
    if params is None:
      raise ValueError("master_weights needs `params` in update().")
    master = state.master
    grads = jax.tree.map(lambda m, g: g if _masked(m) else g.astype(dtype),
                         master, updates, is_leaf=_masked)
    upd, inner_state = inner_update(grads, state.inner_state,
                                    _wide(master, params), **extra)
    new_master = jax.tree.map(
        lambda m, u: m if _masked(m) else m + u.astype(dtype),
        master, upd, is_leaf=_masked)
    out = jax.tree.map(
        lambda m, n, u, p: u if _masked(m) else n.astype(p.dtype) - p,
        master, new_master, upd, params, is_leaf=_masked)
    return out, MasterWeightsState(new_master, inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def resync_masters(state, params):
  """``state`` with each master whose narrow Param is not its rounding
  replaced by the Param: a Param set from outside (weights loaded into the
  model after the optimizer was made) wins over a master that no longer
  describes it. `qlayers.Optimizer` calls it before every update; after
  one, every narrow Param is its master's rounding."""
  def sync(s):
    if not isinstance(s, MasterWeightsState):
      return s
    master = jax.tree.map(
        lambda m, p: m if _masked(m) else jnp.where(
            _bits(m.astype(p.dtype)) == _bits(p), m, p.astype(m.dtype)),
        s.master, params, is_leaf=_masked)
    return s._replace(master=master)
  return jax.tree.map(sync, state,
                      is_leaf=lambda x: isinstance(x, MasterWeightsState))


def _bits(x: jax.Array) -> jax.Array:
  """``x``'s bit patterns: compared as such, a narrowing convert cannot be
  elided as excess precision (XLA's ``xla_allow_excess_precision``)."""
  unsigned = jnp.dtype(f"uint{x.dtype.itemsize * 8}")
  return jax.lax.bitcast_convert_type(x, unsigned)


def _wide(master, params):
  """``params`` with each narrow Param replaced by its master."""
  return jax.tree.map(lambda m, p: p if _masked(m) else m, master, params,
                      is_leaf=_masked)


# ==========================================================================
# Moment dtype


class CastMomentsState(NamedTuple):
  """State of `cast_moments`.

  Attributes:
    inner_state: the wrapped transformation's state with every floating
      array of rank >= 1 (moments, not scalar hyperparameters or counts)
      stored in the storage dtype.
  """

  inner_state: Any


def _cast_moments(tree, dtype):
  return jax.tree.map(
      lambda x: x.astype(dtype) if _floating(x) and x.ndim >= 1 else x, tree)


def cast_moments(inner: optax.GradientTransformation,
                 dtype) -> optax.GradientTransformationExtraArgs:
  """``inner`` with its floating state arrays stored in ``dtype``.

  The stored arrays are cast to FP32 before ``inner.update`` and its new
  state back to ``dtype`` (BF16 moments as in DeepSeek-V3, arXiv:2412.19437
  section 3.3.2). Scalars (counts, injected hyperparameters) are left alone.
  ``dtype`` needs FP32's exponent range (float32, bfloat16): Adam's second
  moment (squared gradients, 1e-8 and below) underflows in float16.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = cast_moments(optax.adam(0.1), jnp.bfloat16)
    >>> s = tx.init({"w": jnp.ones(3)})
    >>> s.inner_state[0].mu["w"].dtype, s.inner_state[0].count.dtype
    (dtype(bfloat16), dtype('int32'))
  """
  dtype = _float_dtype(dtype, "moment dtype")
  if jnp.finfo(dtype).minexp > jnp.finfo(jnp.float32).minexp:
    raise ValueError(
        f"moment dtype {dtype} lacks FP32's exponent range: second moments "
        f"(squared gradients, 1e-8 and below) underflow in it; use "
        f"bfloat16.")
  inner_init, inner_update = _inner(inner)

  def init_fn(params):
    return CastMomentsState(_cast_moments(inner_init(params), dtype))

  def update_fn(updates, state: CastMomentsState, params=None, **extra):
    upd, inner_state = inner_update(
        updates, _cast_moments(state.inner_state, _COMPUTE), params, **extra)
    return upd, CastMomentsState(_cast_moments(inner_state, dtype))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ==========================================================================
# Skipping non-finite steps


class SkipState(NamedTuple):
  """State of `skip_if_nonfinite`.

  Attributes:
    inner_state: the wrapped transformation's state.
    skipped: int32, steps skipped for non-finite gradients so far.
  """

  inner_state: Any
  skipped: jax.Array


def _state_dtypes(old, new):
  """Raises if ``inner`` changed the shape or dtype of a state array."""
  if jax.tree.structure(old) != jax.tree.structure(new):
    raise ValueError(
        f"the wrapped transformation changed the structure of its state "
        f"from {jax.tree.structure(old)} to {jax.tree.structure(new)}; a "
        "skipped step must return the same structure.")
  paths = jax.tree_util.tree_leaves_with_path(old)
  for (path, a), b in zip(paths, jax.tree.leaves(new)):
    if (a.shape, jnp.dtype(a.dtype)) != (b.shape, jnp.dtype(b.dtype)):
      raise ValueError(
          f"the wrapped transformation changed its state "
          f"{jax.tree_util.keystr(path)} from {a.dtype}{list(a.shape)} to "
          f"{b.dtype}{list(b.shape)}; a skipped step must return the same "
          "types (store moments in one dtype, e.g. with cast_moments or "
          "master_weights). Gradients of another dtype than their Params "
          "do this (accumulate_grads sums BF16 gradients in FP32: cast the "
          "total to the Params' dtype, or keep FP32 masters).")


def skip_if_nonfinite(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """``inner``, except that a step with NaN/Inf gradients changes nothing.

  The check is `finite_norm`: the gradients' global norm, which an
  ``optax.clip_by_global_norm`` inside ``inner`` shares. On a skipped step
  the updates are ``-0.0`` (``p + -0.0 == p`` bit for bit for every ``p``,
  signed zeros included: IEEE 754-2019 section 6.3), the inner state is
  returned as it was, and ``skipped`` counts the step; an extra argument
  ``grads_finite=False`` (other parameter groups' gradients were not:
  `qlayers.Optimizer` passes it) skips it too. Traced (under
  ``jit``), the step is computed either way and a ``where`` per array
  keeps the old values (XLA fuses it into the step's own kernels); called
  eagerly, a Python ``if`` chooses, so an eager update compiles nothing new
  after its first call.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = skip_if_nonfinite(optax.sgd(1.0))
    >>> p = {"w": jnp.ones(2)}
    >>> s = tx.init(p)
    >>> u, s = tx.update({"w": jnp.array([1.0, jnp.nan])}, s, p)
    >>> u["w"], int(s.skipped)
    (Array([-0., -0.], dtype=float32), 1)
  """
  inner_init, inner_update = _inner(inner)

  def init_fn(params):
    return SkipState(inner_init(params), jnp.zeros((), jnp.int32))

  def update_fn(updates, state: SkipState, params=None, **extra):
    finite = _step_finite(updates, extra)

    def step():
      return inner_update(updates, state.inner_state, params, **extra)

    if not isinstance(finite, jax.core.Tracer):
      # Called eagerly: a Python branch, as nnx.Optimizer's eager update
      # runs op by op (a traced choice would compile per call).
      if not finite:
        upd_type = jax.eval_shape(step)[0]
        return (jax.tree.map(lambda t: jnp.full_like(t, -0.0), upd_type),
                _skip_state(state.inner_state, state, finite))
      upd, inner_state = step()
      _state_dtypes(state.inner_state, inner_state)
      return upd, _skip_state(inner_state, state, finite)
    # Traced: the step is computed either way and `where` keeps the old
    # values. Inside a `lax.cond` branch an optax.clip_by_global_norm's norm
    # could not be shared with the check (XLA:CPU keeps the cond).
    upd, inner_state = step()
    _state_dtypes(state.inner_state, inner_state)
    upd = jax.tree.map(lambda u: jnp.where(finite, u, jnp.full_like(u, -0.0)),
                       upd)
    inner_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                               inner_state, state.inner_state)
    return upd, _skip_state(inner_state, state, finite)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _skip_state(inner_state, state: SkipState, finite) -> SkipState:
  return SkipState(inner_state, state.skipped + (~finite).astype(jnp.int32))


# ==========================================================================
# Dynamic loss scaling


# The largest loss scale: far above what FP16 gradients need (2**24 lifts
# FP16's smallest subnormal to 1), far below where 1 / scale stops being a
# normal FP32 (2**-126), which XLA flushes to 0.
_MAX_LOSS_SCALE = 2.0**64


class LossScaleState(NamedTuple):
  """State of `dynamic_loss_scaling`.

  Attributes:
    inner_state: the wrapped transformation's state.
    loss_scale: float32, the scale the next gradients are multiplied by.
    good_steps: int32, finite steps since the scale last changed.
  """

  inner_state: Any
  loss_scale: jax.Array
  good_steps: jax.Array


def dynamic_loss_scaling(
    inner: optax.GradientTransformation, *, init_scale: float = 2.0**15,
    growth_interval: int = 2000, growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
) -> optax.GradientTransformationExtraArgs:
  """``inner`` fed gradients divided by a dynamic loss scale.

  The gradients arrive multiplied by ``loss_scale`` (see
  `qlayers.value_and_grad(loss_scale=...)`); they are unscaled in at least
  FP32 and passed on. A step with non-finite gradients multiplies the scale
  by ``backoff_factor`` (never below 1); ``growth_interval`` finite steps in
  a row multiply it by ``growth_factor`` (the FP16 recipe of Micikevicius et
  al., arXiv:1710.03740 section 3.2), up to 2**64 (gradients that need more
  are not narrow; past 2**126 the scale's reciprocal would leave FP32's
  normal range and unscale to 0). The scale and its factors are powers of
  two, so that scaling and unscaling are exact in any float format (a loss
  scale of 3000 in a BF16 loss is 3008). An extra argument
  ``grads_finite=False`` backs off as a non-finite step does. Wrap a
  `skip_if_nonfinite` inside so
  that the overflowing step itself is not applied. The gradients are passed
  on in FP32, so narrow Params need `master_weights` inside it.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = dynamic_loss_scaling(optax.sgd(1.0), init_scale=4.0)
    >>> s = tx.init({"w": jnp.ones(1)})
    >>> u, s = tx.update({"w": jnp.array([jnp.inf])}, s)
    >>> float(s.loss_scale)
    2.0
  """
  if not 1.0 <= init_scale <= _MAX_LOSS_SCALE:
    raise ValueError(f"init_scale must be in [1, 2**64], got {init_scale}.")
  for name, v in (("init_scale", init_scale), ("growth_factor", growth_factor),
                  ("backoff_factor", backoff_factor)):
    if math.frexp(v)[0] != 0.5:
      raise ValueError(f"{name} must be a power of two (scaling by it is "
                       f"then exact), got {v}.")
  if int(growth_interval) != growth_interval or growth_interval < 1:
    raise ValueError(f"growth_interval must be an integer >= 1, got "
                     f"{growth_interval}.")
  if not growth_factor > 1.0:
    raise ValueError(f"growth_factor must be > 1, got {growth_factor}.")
  if not 0.0 < backoff_factor < 1.0:
    raise ValueError(f"backoff_factor must be in (0, 1), got "
                     f"{backoff_factor}.")
  inner_init, inner_update = _inner(inner)

  def init_fn(params):
    return LossScaleState(inner_init(params),
                          jnp.asarray(init_scale, jnp.float32),
                          jnp.zeros((), jnp.int32))

  def unscale(g, inv):
    if not _floating(g):
      return g
    if jnp.finfo(g.dtype).bits < _COMPUTE.itemsize * 8:
      g = g.astype(_COMPUTE)
    return g * inv.astype(g.dtype)

  def update_fn(updates, state: LossScaleState, params=None, **extra):
    inv = 1.0 / state.loss_scale
    grads = jax.tree.map(lambda g: unscale(g, inv), updates)
    finite = _step_finite(grads, extra)
    upd, inner_state = inner_update(grads, state.inner_state, params,
                                    **extra)
    good = jnp.where(finite, state.good_steps + 1, 0)
    grow = good >= growth_interval
    grown = jnp.minimum(state.loss_scale * growth_factor, _MAX_LOSS_SCALE)
    scale = jnp.where(
        finite, jnp.where(grow, grown, state.loss_scale),
        jnp.maximum(state.loss_scale * backoff_factor, 1.0))
    return upd, LossScaleState(inner_state, scale,
                               jnp.where(grow, 0, good).astype(jnp.int32))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ==========================================================================
# The composition


def mixed_precision(
    inner: optax.GradientTransformation, *,
    master_dtype=jnp.float32, moment_dtype=None,
    skip_nonfinite: bool = True, dynamic_loss_scale: bool = False,
    init_loss_scale: float = 2.0**15, growth_interval: int = 2000,
    growth_factor: float = 2.0, backoff_factor: float = 0.5,
) -> optax.GradientTransformationExtraArgs:
  """``inner`` with master weights, moment dtype, skipping, loss scaling.

  The composition, outermost first: `dynamic_loss_scaling` (with
  ``dynamic_loss_scale``), `skip_if_nonfinite` (with ``skip_nonfinite``),
  `master_weights` (unless ``master_dtype`` is None), `cast_moments` (when
  ``moment_dtype`` is given), ``inner``. So the scale still backs off on a
  skipped step, a skipped step leaves masters and moments as they were, and
  the masters are never narrowed.

  Args:
    inner: any optax transformation.
    master_dtype: Params narrower than this get masters of it (None: none).
    moment_dtype: storage dtype of ``inner``'s floating state (None: as
      ``inner`` keeps it).
    skip_nonfinite: skip steps whose gradients hold NaN/Inf (`finite_norm`:
      their global norm, which ``optax.clip_by_global_norm`` in ``inner``
      shares; without a clip it adds a reduction per leaf to the step).
    dynamic_loss_scale: unscale the gradients by a dynamic loss scale
      (needs ``skip_nonfinite``: an overflowing step must not be applied).
    init_loss_scale, growth_interval, growth_factor, backoff_factor: see
      `dynamic_loss_scaling`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = mixed_precision(optax.sgd(0.5), dynamic_loss_scale=True)
    >>> s = tx.init({"w": jnp.ones(2, jnp.bfloat16)})
    >>> float(find_state(s, LossScaleState).loss_scale)
    32768.0
  """
  if dynamic_loss_scale and not skip_nonfinite:
    raise ValueError("dynamic_loss_scale needs skip_nonfinite=True: the "
                     "steps that overflow would otherwise write NaN/Inf "
                     "into the Params.")
  tx = inner
  if moment_dtype is not None:
    tx = cast_moments(tx, moment_dtype)
  if master_dtype is not None:
    tx = master_weights(tx, dtype=master_dtype)
  if skip_nonfinite:
    tx = skip_if_nonfinite(tx)
  if dynamic_loss_scale:
    tx = dynamic_loss_scaling(
        tx, init_scale=init_loss_scale, growth_interval=growth_interval,
        growth_factor=growth_factor, backoff_factor=backoff_factor)
    if master_dtype is None:
      tx = _wide_params_only(tx)
  return optax.with_extra_args_support(tx)


def _wide_params_only(tx: optax.GradientTransformation):
  """``tx`` refusing Params narrower than FP32 at init: loss scaling
  without masters hands its FP32 gradients to a state kept in the Params'
  dtype."""

  def init_fn(params):
    narrow = sorted({jnp.dtype(p.dtype).name for p in jax.tree.leaves(params)
                     if _floating(p) and jnp.dtype(p.dtype).itemsize < 4})
    if narrow:
      raise ValueError(
          f"dynamic loss scaling without master weights (master_dtype=None) "
          f"on {'/'.join(narrow)} Params: the unscaled gradients are FP32 "
          f"(narrowed back, the small ones underflow, which loss scaling "
          f"exists to prevent); keep FP32 masters (master_dtype=jnp.float32, "
          f"the default).")
    return tx.init(params)

  return tx._replace(init=init_fn)
