"""The quantized GEMM with its backward rule (Fprop, Dgrad, Wgrad).

`quantized_matmul` computes ``y = x @ w`` for ``x: (..., K)`` and
``w: (K, N)`` under a `Recipe`:

* Fprop ``y = x @ w``: x quantized along K, w along K.
* Dgrad ``dx = g @ w.T``: g along N, w along N.
* Wgrad ``dw = x.T @ g``: x along M (tokens), g along M.

Each operand is quantized from the high-precision tensor along the
contraction dim of the GEMM that consumes it (a per-tensor quantized copy is
shared between GEMMs, since its scale does not depend on the axis).
Accumulation is FP32; Fprop/Dgrad outputs are in the compute dtype, the
weight gradient in the weight's dtype (FP32 masters).

Delayed scaling keeps a `scaling.ScaleState` per operand role ``x``, ``w``,
``g``: the amax history of completed steps and ``amax``, the running max of
the current step. Each use of the op scales every operand of that role from
the history, for the operand's own format (or, while the history is still
empty, from the current amax; see `scaling.delayed_amax`), and
max-accumulates its amax into ``amax``: the forward returns the updated
``x``/``w`` states; the gradient's amax is only known in the backward pass, so
it leaves as the *cotangent of ``state["g"].amax``*, which a training step
writes back exactly (`qlayers.value_and_grad` and `qlayers.Optimizer` do).
Held in an extended dtype whose addition is ``max`` while differentiating (as
`qlayers.value_and_grad` does), the cotangents of several uses of one layer
combine by max, not sum. Once per step `update_scales` writes ``amax`` into
the history and clears it.

Under a mesh every amax is the amax of the whole tensor (see
`qlayers.sharding`): XLA reduces over shards under jit, ``lax.pmax`` does it
inside ``shard_map``; with explicit mesh axes the op runs in an auto-axes
region whose outputs get ``lax.dot_general``'s explicit-mode shardings.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.sharding import PartitionSpec as P

from qlayers import dispatch
from qlayers import hadamard
from qlayers import native_quantize
from qlayers import scaling
from qlayers import sharding
from qlayers.recipe import Recipe, recipe as load_recipe
from qlayers.scaling import QuantSpec, QTensor, ScaleState

__all__ = [
    "ROLES",
    "init_state",
    "update_scales",
    "quantized_matmul",
    "quantized_dot_general",
    "dot_general",
    "fake_quant_matmul",
]


ROLES = ("x", "w", "g")

# Name of the saved Wgrad input (see jax.checkpoint_policies).
WGRAD_INPUT_NAME = "qlayers_wgrad_x"


def init_state(recipe: Recipe | str, batch_shape: tuple[int, ...] = ()
               ) -> dict[str, ScaleState] | None:
  """Fresh delayed-scaling state ``{"x", "w", "g"}``, or None if stateless.

  ``batch_shape`` stacks it (one state per layer of an ``nnx.vmap`` stack).
  """
  recipe = load_recipe(recipe)
  if not recipe.delayed:
    return None
  return {role: scaling.init_scale_state(recipe.amax_history_len, batch_shape)
          for role in ROLES}


def update_scales(state: dict[str, ScaleState]) -> dict[str, ScaleState]:
  """Ends a step for every role (see `scaling.update_scales`).

  Call once per optimizer step (`qlayers.Optimizer` does, through
  `qlayers.update_scales`).
  """
  return {role: scaling.update_scales(st) for role, st in state.items()}


# ----------------------------------------------------------------------------
# Helpers


def _to_f32(v):
  """Reads state that may be held in an extended (max-combining) dtype."""
  if jax.dtypes.issubdtype(v.dtype, jax.dtypes.extended):
    return lax.convert_element_type(v, jnp.float32)
  return v


def _like(v, dtype):
  """``v`` (FP32) in ``dtype`` (FP32 or an extended dtype over FP32)."""
  if v.dtype == dtype:
    return v
  return lax.convert_element_type(v, dtype)


def _delayed(t, st: ScaleState, recipe: Recipe, backend=None):
  """(amax to scale ``t`` by now, updated running amax) for one role."""
  st = ScaleState(*map(_to_f32, st))
  current = sharding.global_amax(native_quantize.amax(t, backend=backend), t)
  stored = None
  if recipe.amax_compute_algo == "max":
    stored = native_quantize.history_max(st.amax_history, backend=backend)
  return scaling.delayed_amax(st, current, recipe.amax_compute_algo, stored)


def _delayed_operand(t, st: ScaleState, spec, axis, key, recipe: Recipe,
                     backend=None, rows: bool = True, hadamard: int = 0):
  """One delayed role's use: (`_operand_rows` of ``t``, or `_operand` of a
  2-D ``t`` without ``rows``, the amax it was scaled by, the updated running
  amax). One native kernel where it applies: a per-tensor copy of ``t`` as
  it is (no transpose, Hadamard transform or shard), unstacked state."""
  st = ScaleState(*map(_to_f32, st))
  if (spec is not None and not hadamard
      and not _transposes(spec, axis, backend)
      and not sharding.varying_axes(t)
      and native_quantize.fuses_delayed(t, spec, st.amax_history,
                                        recipe.amax_compute_algo, backend)):
    q, use, running = native_quantize.quantize_delayed(
        t, spec, st.amax_history, st.amax, -1 if rows else axis,
        backend=backend)
    return (_as_rows(q, axis) if rows else q), use, running
  use, running = _delayed(t, st, recipe, backend)
  if rows:
    return (_operand_rows(t, spec, axis, use, key, recipe, backend, hadamard),
            use, running)
  return _operand(t, spec, axis, use, key, recipe, backend), use, running


def _transposes(spec: QuantSpec, axis: int, backend=None) -> bool:
  """Packed formats, and operands for a TN-only backend, go contraction-last."""
  return axis != 1 and (spec.fmt.packed or dispatch.prefers_contraction_last(
      spec.granularity, backend))


def _quantize(t, spec: QuantSpec, axis: int, amax=None, key=None,
              backend=None) -> QTensor:
  """Quantizes a 2-D operand along ``axis`` (transposed first if needed)."""
  if _transposes(spec, axis, backend):
    q = _quantize_2d(t.T, spec, 1, amax, key, backend)
    return dataclasses.replace(q, transposed=True)
  return _quantize_2d(t, spec, axis, amax, key, backend)


def _quantize_2d(t, spec: QuantSpec, axis: int, amax, key, backend):
  if key is None:  # the native kernel where it applies (CPU, per tensor)
    return native_quantize.quantize(t, spec, axis, tensor_amax=amax,
                                    backend=backend)
  return scaling.quantize(t, spec, axis, tensor_amax=amax, key=key)


def _along(q, axis: int):
  """Operand ``q`` contracted over ``axis`` of the original 2-D layout.

  A copy made in that layout is relabelled (a per-tensor scale serves any
  axis); a transposed copy already has its contraction axis last.
  """
  if not isinstance(q, QTensor):
    return q, axis
  if q.granularity == "tensor" and not q.transposed and q.axis != axis:
    q = dataclasses.replace(q, axis=axis)
  return q, q.axis


def _run(a, b, axes, out_dtype, backend):
  (a, ca), (b, cb) = _along(a, axes[0]), _along(b, axes[1])
  return dispatch.gemm(a, b, axes=(ca, cb), out_dtype=out_dtype,
                       backend=backend)


def _shares(spec_a: QuantSpec | None, spec_b: QuantSpec | None,
            backend=None) -> bool:
  """True when one quantized copy can serve both specs: an axis-free
  (per-tensor) scale, in a layout the backend takes for both GEMMs."""
  return (spec_a is not None and spec_a == spec_b
          and spec_a.granularity == "tensor" and not spec_a.stochastic
          and not dispatch.prefers_contraction_last("tensor", backend))


def _keys(key, n):
  if key is None:
    return (None,) * n
  return tuple(jax.random.split(key, n))


def _data_key(t):
  """A PRNG key derived from the bits of ``t`` (for stateless callers)."""
  bits = lax.bitcast_convert_type(jnp.sum(t.astype(jnp.float32)), jnp.uint32)
  return jax.random.key(bits)


def _operand(t, spec, axis, amax, key, recipe: Recipe, backend=None):
  """Quantized copy, or ``t`` in the compute dtype when ``spec`` is None."""
  if spec is None:
    return t.astype(recipe.dtype)
  if spec.stochastic and key is None:
    key = _data_key(t)
  if amax is None and spec.granularity == "tensor" and sharding.varying_axes(t):
    # A shard_map shard: scale by the whole tensor's amax.
    amax = sharding.global_amax(native_quantize.amax(t, backend=backend), t)
  return _quantize(t, spec, axis, amax=amax,
                   key=key if spec.stochastic else None, backend=backend)


def _rows(t):
  """``t (..., K)`` as ``(M, K)``."""
  return t if t.ndim == 2 else t.reshape(-1, t.shape[-1])


def _operand_rows(t, spec, axis, amax, key, recipe: Recipe, backend=None,
                  hadamard: int = 0):
  """`_operand` of ``_rows(t)`` for ``t (..., C)``, Hadamard-transformed
  along ``axis`` of the rows first when ``hadamard`` is set.

  An elementwise quantization (per tensor, in the layout given: no
  transpose) is made of ``t`` itself and only its payload is flattened, so
  the GEMM's reshape does not sit between the caller's ops and the
  quantize chain (XLA's simplifier then moves it through that chain one op
  per round). Other granularities and layouts quantize ``_rows(t)``.
  """
  if t.ndim == 2 or spec is None or spec.granularity != "tensor" or (
      _transposes(spec, axis, backend) or spec.stochastic or hadamard):
    if spec is None:
      return _rows(t.astype(recipe.dtype))
    return _operand(_transformed(_rows(t), hadamard, axis), spec, axis, amax,
                    key, recipe, backend)
  if amax is None and sharding.varying_axes(t):
    amax = sharding.global_amax(native_quantize.amax(t, backend=backend),
                                t)  # see `_operand`
  return _as_rows(native_quantize.quantize(t, spec, -1, tensor_amax=amax,
                                           backend=backend), axis)


def _as_rows(q: QTensor, axis: int) -> QTensor:
  """A per-tensor copy of ``t (..., C)`` as the operand ``_rows(t)``
  contracted over ``axis``: only the payload is flattened."""
  rows = _rows(q.payload)
  return dataclasses.replace(q, payload=rows, axis=axis, shape=rows.shape)


def _transformed(t, size: int, axis: int):
  """A gradient-GEMM operand, Hadamard-transformed along its contraction
  ``axis`` when ``size`` is set (see `qlayers.hadamard`)."""
  return hadamard.transform(t, size, axis=axis) if size else t


def _values(tree):
  """The primal values of a tree of `CustomVJPPrimal` (see `_qmm_fwd`)."""
  return jax.tree.map(lambda p: p.value, tree,
                      is_leaf=lambda p: isinstance(p, CustomVJPPrimal))


_warned_uncollected = False


def _warn_if_gradient_amax_lost(recipe: Recipe, x, w, state) -> None:
  """Warns once when a delayed layer is differentiated but its gradient amax
  is not (so the gradient's delayed scale could never move)."""
  global _warned_uncollected
  if (_warned_uncollected or not recipe.delayed
      or not (x.perturbed or w.perturbed) or state["g"].amax.perturbed):
    return
  _warned_uncollected = True
  warnings.warn(
      f"A layer with the delayed-scaling recipe {recipe.name!r} is being "
      "differentiated without its gradient amax (QuantGradState): the "
      "output-gradient scale will never be updated. Use "
      "qlayers.value_and_grad (with qlayers.Optimizer), or "
      "nnx.value_and_grad(..., argnums=nnx.DiffState(0, (nnx.Param, "
      "qlayers.QuantGradState))) and call qlayers.update_scales(model, "
      "grads) after each optimizer update.", stacklevel=2)


# ----------------------------------------------------------------------------
# The custom_vjp core on x (..., K) and w (K, N)
#
# ``dtypes`` (static) is ``(x dtype, w dtype, vma, x shape)``: the backward
# rule returns the input gradients in the primal shapes and dtypes. ``vma``
# holds the manual mesh axes ``x`` and ``w`` vary over (inside shard_map;
# empty elsewhere), which their cotangents are reduced to.
# Symbolic zeros: the forward rule sees which inputs are differentiated,
# and the backward rule returns None (zero) for every state leaf but the
# gradient role's running amax.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _qmm(recipe, backend, out_dtype, dtypes, x, w, state, key):
  y, new_state, _ = _qmm_forward(recipe, backend, out_dtype, x, w, state, key)
  return y, new_state


def _qmm_forward(recipe: Recipe, backend, out_dtype, x, w, state, key):
  fx, fw = recipe.fprop.lhs, recipe.fprop.rhs
  wx = recipe.wgrad.lhs
  kx, kw, kwx, kb = _keys(key, 4)
  ax = aw = None
  new_state = state
  if recipe.delayed:
    qx, ax, run_x = _delayed_operand(x, state["x"], fx, 1, kx, recipe,
                                     backend)
    qw, aw, run_w = _delayed_operand(w, state["w"], fw, 0, kw, recipe,
                                     backend, rows=False)
    new_state = {
        "x": state["x"]._replace(amax=_like(run_x, state["x"].amax.dtype)),
        "w": state["w"]._replace(amax=_like(run_w, state["w"].amax.dtype)),
        "g": state["g"]}
  else:
    qx = _operand_rows(x, fx, 1, ax, kx, recipe, backend)
    qw = _operand(w, fw, 0, aw, kw, recipe, backend)
  y = _run(qx, qw, (1, 0), out_dtype, backend)
  y = y.reshape(*x.shape[:-1], y.shape[-1])

  # What Wgrad needs of x: the Fprop copy when it is axis-free, a copy
  # quantized along M now (from the wide x, Hadamard-transformed if the
  # recipe says so), or the wide x itself.
  rht = recipe.wgrad.hadamard
  if recipe.save_quantized_wgrad_input and wx is not None:
    if _shares(fx, wx, backend) and not rht:
      x_saved = qx
    else:
      x_saved = _operand_rows(x, wx, 0, ax, kwx, recipe, backend, rht)
  else:
    x_saved = x
  w_saved = (qw if _shares(fw, recipe.dgrad.rhs, backend)
             and not recipe.dgrad.hadamard else w)
  # Named, so a remat policy (save_only_these_names) can keep just this.
  x_saved = jax.tree.map(lambda t: checkpoint_name(t, WGRAD_INPUT_NAME),
                         x_saved)
  g_state = state["g"] if recipe.delayed else None
  res = (x_saved, w_saved, ax, aw, g_state, kb)
  return y, new_state, res


def _qmm_fwd(recipe, backend, out_dtype, dtypes, x, w, state, key):
  del dtypes
  if state is not None:
    _warn_if_gradient_amax_lost(recipe, x, w, state)
  y, new_state, res = _qmm_forward(recipe, backend, out_dtype, x.value,
                                   w.value, _values(state), _values(key))
  return (y, new_state), res


def _qmm_bwd(recipe: Recipe, backend, out_dtype, dtypes, res, cts):
  del out_dtype
  x_dtype, w_dtype, (x_vma, w_vma), x_shape = dtypes
  x_saved, w_saved, ax, aw, g_state, key = res
  g, _ = cts
  if isinstance(g, SymbolicZero):  # the output is not used
    return None, None, None, None
  dg, dw_gemm = recipe.dgrad, recipe.wgrad
  kd, kwg = _keys(key, 2)

  ag = None
  state_ct = None
  # Dgrad: dx = g @ w.T, contracted over N (both Hadamard-transformed along
  # N first if the recipe says so: (g Q.T) @ (w Q.T).T = g @ w.T).
  rht_n = dg.hadamard
  if recipe.delayed:
    qg, ag, run_g = _delayed_operand(g, g_state, dg.lhs, 1, kd, recipe,
                                     backend, hadamard=rht_n)
    # Only the gradient role's running amax leaves the backward pass; the
    # forward roles left through the output.
    state_ct = {"x": None, "w": None,
                "g": ScaleState(None, _like(run_g, g_state.amax.dtype))}
  else:
    qg = _operand_rows(g, dg.lhs, 1, ag, kd, recipe, backend, rht_n)
  if isinstance(w_saved, QTensor):
    qw = w_saved
  else:
    qw = _operand(_transformed(w_saved, rht_n, 1), dg.rhs, 1, aw, None,
                  recipe, backend)
  dx = _run(qg, qw, (1, 1), dg.out_dtype or x_dtype, backend)
  dx = dx.reshape(x_shape)

  # Wgrad: dw = x.T @ g, contracted over M (both Hadamard-transformed along
  # M first if the recipe says so: (Qx).T @ (Qg) = x.T @ g).
  rht = dw_gemm.hadamard
  if isinstance(x_saved, QTensor):
    qx = x_saved
  else:
    qx = _operand_rows(x_saved, dw_gemm.lhs, 0, ax, None, recipe, backend,
                       rht)
  if _shares(dg.lhs, dw_gemm.rhs, backend) and not (rht or rht_n):
    qg_w = qg
  else:
    qg_w = _operand_rows(g, dw_gemm.rhs, 0, ag, kwg, recipe, backend, rht)
  dw = _run(qx, qg_w, (0, 0), dw_gemm.out_dtype or jnp.float32, backend)
  dx = sharding.sum_over_broadcast(dx, x_vma)
  dw = sharding.sum_over_broadcast(dw, w_vma)
  return dx.astype(x_dtype), dw.astype(w_dtype), state_ct, None


_qmm.defvjp(_qmm_fwd, _qmm_bwd, symbolic_zeros=True)


# ----------------------------------------------------------------------------
# Public entry points


def _default_out_dtype(recipe: Recipe, x_dtype):
  """The recipe's Fprop out_dtype, else ``x``'s dtype unless it is narrower
  than 16 bits (an FP8 input must not make an FP8 output), else the recipe's
  compute dtype."""
  if recipe.fprop.out_dtype:
    return jnp.dtype(recipe.fprop.out_dtype)
  x_dtype = jnp.dtype(x_dtype)
  return x_dtype if x_dtype.itemsize >= 2 else jnp.dtype(recipe.dtype)


def quantized_matmul(x: jax.Array, w: jax.Array, recipe: Recipe | str,
                     state: dict[str, ScaleState] | None = None, *,
                     key: jax.Array | None = None,
                     out_dtype=None, backend: str | None = None):
  """``x @ w`` with every GEMM of forward and backward quantized by ``recipe``.

  A recipe that quantizes nothing (``"bf16"``) runs the same three GEMMs on
  operands cast to its compute dtype, with FP32 accumulation (the FP32
  weight gradient included).

  Args:
    x: activations ``(..., K)``.
    w: weight ``(K, N)``.
    recipe: a `Recipe` or a recipe name.
    state: delayed-scaling state from `init_state` (required for delayed
      recipes, ignored otherwise).
    key: PRNG key for stochastic rounding (derived from the data if omitted).
    out_dtype: output dtype (default: the recipe's Fprop out_dtype, else
      ``x.dtype`` when it has 16 bits or more, else the compute dtype).
    backend: force a GEMM backend (``xla`` or ``ffi``).

  Returns:
    ``(y, new_state)``: ``y`` of shape ``(..., N)``; ``new_state`` has the
    forward roles' running amax updated (``None`` for stateless recipes).
    Under differentiation the cotangent of ``state["g"].amax`` is the
    gradient role's running amax.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> x, w = jnp.ones((4, 64)), jnp.ones((64, 32))
    >>> y, _ = quantized_matmul(x, w, "mxfp8")
    >>> y.shape
    (4, 32)
  """
  recipe = load_recipe(recipe)
  if x.ndim < 1 or w.ndim != 2:
    raise ValueError(f"quantized_matmul expects x (..., K) and w (K, N); got "
                     f"{x.shape} and {w.shape}.")
  if x.shape[-1] != w.shape[0]:
    raise ValueError(f"Contraction mismatch: x has K={x.shape[-1]}, w has "
                     f"K={w.shape[0]}.")
  for name, t in (("x", x), ("w", w)):
    if not jnp.issubdtype(t.dtype, jnp.floating):
      raise TypeError(f"{name} must be floating point, got {t.dtype}.")
  out_dtype = jnp.dtype(out_dtype or _default_out_dtype(recipe, x.dtype))
  if recipe.delayed:
    if state is None:
      raise ValueError(f"Recipe {recipe.name!r} uses delayed scaling and "
                       "needs `state` (see init_state).")
    _check_state(state, recipe)
  else:
    state = None
  lead, n = x.shape[:-1], w.shape[1]
  if math.prod(lead) == 0 or n == 0 or w.shape[0] == 0:
    # Nothing to multiply (an empty batch): no amax to take, state unchanged.
    return jnp.zeros((*lead, n), out_dtype), state
  dtypes = (x.dtype, w.dtype,
            (sharding.varying_axes(x), sharding.varying_axes(w)), x.shape)

  def run(x, w, state, key):
    return _qmm(recipe, backend, out_dtype, dtypes, x, w, state, key)

  if _traces_once(recipe, dtypes, key):
    return _qmm_traced_once(recipe, backend, out_dtype, dtypes,
                            _trace_settings(), x, w, state, key)
  if sharding.explicit_axes():
    y_spec = sharding.dot_spec(sharding.spec_of(x)[:-1],
                               sharding.spec_of(w)[1:])
    run = sharding.auto_region(run, (y_spec, _replicated_specs(state)))
  return run(x, w, state, key)


def _traces_once(recipe: Recipe, dtypes, key) -> bool:
  """Whether the GEMM is traced once per distinct signature
  (`_qmm_traced_once`): for CPU programs only (XLA:GPU fuses the quantize
  of an operand behind the boundary differently: the deviceless sm_90
  MXFP8 step gained separate convert/reduce passes), outside any mesh,
  shard_map or explicit sharding, whose context a cached trace would not
  see, and not with stochastic rounding keyed by the data (`_data_key`: a
  sum whose rounding would then follow the fused program's order, not the
  caller's op-by-op one)."""
  data_keyed = key is None and any(
      s is not None and s.stochastic for s in recipe.specs().values())
  return (not data_keyed and not dispatch.targets_gpu()
          and not any(dtypes[2]) and not sharding.explicit_axes()
          and sharding.auto_mesh() is None)


def _trace_settings() -> tuple:
  """What else a trace of the GEMM reads: the ``QLAYERS_*`` switches (the
  forced backend, the native kernels, the GPU generation) and the device
  count. Part of `_qmm_traced_once`'s cache key."""
  return (tuple(sorted((k, v) for k, v in os.environ.items()
                       if k.startswith("QLAYERS_"))), jax.device_count())


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _qmm_traced_once(recipe, backend, out_dtype, dtypes, settings, x, w,
                     state, key):
  """`_qmm` behind a jit boundary: a model's layers of one shape and recipe
  (SmolLM2's 30 blocks) share one trace of the forward and backward GEMMs,
  their partial evaluation and transpose, and one lowered function, which
  XLA inlines again (the optimized program is the same)."""
  del settings  # a cache key only
  return _qmm(recipe, backend, out_dtype, dtypes, x, w, state, key)


def _replicated_specs(state):
  """Explicit specs of new quantization state: replicated."""
  return jax.tree.map(lambda v: P(*(None,) * v.ndim), state)


def _check_state(state, recipe: Recipe):
  if not isinstance(state, dict) or set(state) != set(ROLES):
    raise ValueError("Delayed-scaling state must be a dict with keys "
                     "'x', 'w', 'g' (see init_state).")
  for role, st in state.items():
    hist = st.amax_history
    if hist.shape != (recipe.amax_history_len,):
      raise ValueError(
          f"State {role!r} has an amax history of shape {hist.shape} but "
          f"recipe {recipe.name!r} keeps {recipe.amax_history_len}.")
    if st.amax.shape != ():
      raise ValueError(f"State {role!r} amax must be a scalar, got shape "
                       f"{st.amax.shape}.")


def quantized_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers,
                          recipe: Recipe | str,
                          state: dict[str, ScaleState] | None = None, *,
                          preferred_element_type=None,
                          key: jax.Array | None = None,
                          backend: str | None = None, matmul=None):
  """`lax.dot_general` of ``lhs`` and ``rhs``, quantized by ``recipe``.

  Any dimension numbers lower to the 2-D op: ``lhs``'s free dims then its
  contracting dims flatten into ``(M, K)``, ``rhs``'s contracting dims then
  its free dims into ``(K, N)``; the result has ``lhs``'s free dims, then
  ``rhs``'s, as ``lax.dot_general`` orders them. Batch dims map the op over
  each batch entry (each entry its own GEMM with its own scales), which a
  delayed recipe's single state cannot do, so it refuses them.

  ``matmul`` replaces `quantized_matmul` as the 2-D op (same signature).

  Returns:
    ``(out, new_state)`` as `quantized_matmul`.
  """
  recipe = load_recipe(recipe)
  matmul = matmul or quantized_matmul
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
  if len(lc) != len(rc) or len(lb) != len(rb):
    raise ValueError(f"Malformed dimension_numbers {dimension_numbers}.")
  out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
  if sharding.explicit_axes():
    ls, rs = sharding.spec_of(lhs), sharding.spec_of(rhs)
    lfree = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rfree = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    y_spec = sharding.dot_spec(tuple(ls[d] for d in (*lb, *lfree)),
                               tuple(rs[d] for d in rfree))
    def run(lhs, rhs, state, key):
      return quantized_dot_general(
          lhs, rhs, dimension_numbers, recipe, state,
          preferred_element_type=out_dtype, key=key, backend=backend)
    run = sharding.auto_region(run, (y_spec, _replicated_specs(state)))
    return run(lhs, rhs, state, key)
  if lb:
    if recipe.delayed:
      raise ValueError(
          f"Recipe {recipe.name!r} uses delayed scaling, whose single "
          "per-tensor state cannot scale a batched GEMM (dimension numbers "
          f"with batch dims {lb}, {rb}); use a current-scaling recipe.")
    inner = ((tuple(_shift(d, lb[0]) for d in lc),
              tuple(_shift(d, rb[0]) for d in rc)),
             (tuple(_shift(d, lb[0]) for d in lb[1:]),
              tuple(_shift(d, rb[0]) for d in rb[1:])))
    def one(a, b):
      return quantized_dot_general(a, b, inner, recipe,
                                   preferred_element_type=out_dtype,
                                   key=key, backend=backend,
                                   matmul=matmul)[0]
    with sharding.unpartitioned():
      return jax.vmap(one, in_axes=(lb[0], rb[0]))(lhs, rhs), state
  lfree = [d for d in range(lhs.ndim) if d not in lc]
  rfree = [d for d in range(rhs.ndim) if d not in rc]
  k = math.prod(lhs.shape[d] for d in lc)
  if [rhs.shape[d] for d in rc] != [lhs.shape[d] for d in lc]:
    raise ValueError(f"Contracting dims of shapes {lhs.shape} and "
                     f"{rhs.shape} do not match ({lc} vs {rc}).")
  a = _permute(lhs, lfree + list(lc))
  a = a.reshape(*(lhs.shape[d] for d in lfree), k)
  b = _permute(rhs, list(rc) + rfree).reshape(k, -1)
  y, new_state = matmul(a, b, recipe, state, key=key, out_dtype=out_dtype,
                        backend=backend)
  return y.reshape(*y.shape[:-1], *(rhs.shape[d] for d in rfree)), new_state


def _permute(t, order):
  return t if list(order) == list(range(t.ndim)) else jnp.transpose(t, order)


def _shift(d, removed):
  return d - 1 if d > removed else d


def dot_general(recipe: Recipe | str, *, backend: str | None = None):
  """A stateless `lax.dot_general`-compatible callable quantized by ``recipe``.

  Plugs into ``nnx.Linear(dot_general=...)`` and
  ``jnp.einsum(..., _dot_general=...)``. Delayed-scaling recipes need state,
  so they are refused here: use `qlayers.QuantGemm`, a stateful callable of
  the same signature.

  Example:
    >>> import jax.numpy as jnp
    >>> dg = dot_general("fp8_current")
    >>> jnp.einsum("bk,kn->bn", jnp.ones((2, 16)), jnp.ones((16, 8)),
    ...            _dot_general=dg).shape
    (2, 8)
  """
  recipe = load_recipe(recipe)
  if recipe.delayed:
    raise ValueError(
        f"Recipe {recipe.name!r} uses delayed scaling, which needs per-layer "
        "state; use qlayers.QuantGemm (or qlayers.QuantDense, "
        "qlayers.quantize) instead of a stateless dot_general.")

  def fn(lhs, rhs, dimension_numbers, precision=None,
         preferred_element_type=None, out_sharding=None, **kwargs):
    del precision  # the recipe decides operand precision
    if kwargs:
      raise TypeError(f"Unsupported dot_general arguments: {sorted(kwargs)}.")
    out, _ = quantized_dot_general(
        lhs, rhs, dimension_numbers, recipe,
        preferred_element_type=preferred_element_type, backend=backend)
    if out_sharding is not None:
      out = jax.sharding.reshard(out, out_sharding)
    return out

  fn.recipe = recipe
  return fn


def _qdq(t, spec: QuantSpec | None, axis: int, amax=None):
  """Quantize-dequantize ``t`` (2-D) along ``axis``, in ``t``'s layout."""
  if spec is None:
    return t
  d = _quantize(t, spec, axis, amax=amax).dequantize(t.dtype)
  return d.T if _transposes(spec, axis) else d


def fake_quant_matmul(x, w, recipe: Recipe | str, state=None):
  """Reference Fprop: quantize-dequantize both operands, then an FP32 dot.

  The casts are straight-through (identity gradient), so `jax.grad` of this
  function is the unquantized backward of the fake-quantized forward: the
  oracle the tests compare `quantized_matmul` against.
  """
  recipe = load_recipe(recipe)
  x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  w = w.astype(jnp.float32)
  fx, fw = recipe.fprop.lhs, recipe.fprop.rhs
  ax = aw = None
  if recipe.delayed:
    ax, _ = _delayed(x2, state["x"], recipe)
    aw, _ = _delayed(w, state["w"], recipe)

  def ste(t, spec, axis, amax):
    return t + lax.stop_gradient(_qdq(t, spec, axis, amax) - t)

  y = jnp.dot(ste(x2, fx, 1, ax), ste(w, fw, 0, aw),
              precision=lax.Precision.HIGHEST)
  return y.reshape(*x.shape[:-1], w.shape[1])
