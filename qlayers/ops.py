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

Delayed scaling keeps a `ScaleState` per operand role ``x``, ``w``, ``g``:
the scale in use, the amax history of completed steps, and ``amax``, the
running max of the current step. Each use of the op quantizes with the stored
scale (or, while the history is still empty, with the current amax) and
max-accumulates its amax into ``amax``: the forward returns the updated
``x``/``w`` states; the gradient's amax is only known in the backward pass, so
it leaves as the *cotangent of ``state["g"].amax``*, which a training step
writes back exactly (`qlayers.value_and_grad` and `qlayers.Optimizer` do).
Held in an extended dtype whose addition is ``max`` while differentiating (as
`qlayers.value_and_grad` does), the cotangents of several uses of one layer
combine by max, not sum. Once per step `commit_state` writes ``amax`` into
the history, computes the next scale and clears ``amax``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from qlayers import dispatch
from qlayers import hadamard
from qlayers import scaling
from qlayers.recipe import Recipe, recipe as load_recipe
from qlayers.scaling import QuantSpec, QTensor

__all__ = [
    "ScaleState",
    "init_state",
    "commit_state",
    "quantized_matmul",
    "dot_general",
    "fake_quant_matmul",
]


class ScaleState(NamedTuple):
  """Delayed-scaling state of one operand role (plain FP32 arrays)."""

  scale: jax.Array  # () dequantization factor in use
  amax_history: jax.Array  # (history_len,) completed steps, [0] most recent
  amax: jax.Array  # () running max |x| of the current step


ROLES = ("x", "w", "g")

# Name of the saved Wgrad input (see jax.checkpoint_policies).
WGRAD_INPUT_NAME = "qlayers_wgrad_x"


def init_state(recipe: Recipe | str) -> dict[str, ScaleState] | None:
  """Fresh delayed-scaling state ``{"x", "w", "g"}``, or None if stateless."""
  recipe = load_recipe(recipe)
  if not recipe.delayed:
    return None
  def one():
    return ScaleState(jnp.ones((), jnp.float32),
                      jnp.zeros((recipe.amax_history_len,), jnp.float32),
                      jnp.zeros((), jnp.float32))
  return {role: one() for role in ROLES}


def role_specs(recipe: Recipe) -> dict[str, QuantSpec]:
  """The spec whose format/margin sets each role's per-tensor scale."""
  return {"x": recipe.fprop.lhs, "w": recipe.fprop.rhs, "g": recipe.dgrad.lhs}


def commit_state(state: dict[str, ScaleState],
                 recipe: Recipe | str) -> dict[str, ScaleState]:
  """Ends a step: amax -> history, next scale from the history, amax cleared.

  Call once per optimizer step (`qlayers.Optimizer` does). A step in which a
  role saw only non-finite values records 0 (see
  `scaling.update_amax_history`).
  """
  recipe = load_recipe(recipe)
  out = {}
  for role, spec in role_specs(recipe).items():
    st = state[role]
    hist = scaling.update_amax_history(st.amax_history, st.amax)
    scale = scaling.compute_scale(hist, st.scale, spec.fmt,
                                  algo=recipe.amax_compute_algo,
                                  margin=spec.margin, pow2=spec.pow2)
    out[role] = ScaleState(scale, hist, jnp.zeros_like(st.amax))
  return out


# ----------------------------------------------------------------------------
# Helpers


def _to_f32(v):
  """Reads state that may be held in an extended (max-combining) dtype."""
  if jax.dtypes.issubdtype(v.dtype, jax.dtypes.extended):
    return lax.convert_element_type(v, jnp.float32)
  return v


def _like(v, ref):
  """``v`` in the dtype of ``ref`` (FP32 or an extended dtype over FP32)."""
  if v.dtype == ref.dtype:
    return v
  return lax.convert_element_type(v, ref.dtype)


def _read_state(s: ScaleState) -> ScaleState:
  return ScaleState(*map(_to_f32, s))


def _delayed(t, st: ScaleState, spec: QuantSpec):
  """(scale to quantize with now, updated running amax) for one operand.

  The stored scale, unless no step has completed yet (empty history): then
  the amax seen so far this step, so the first step does not quantize with
  the initial scale of 1.
  """
  st = _read_state(st)
  a = scaling.amax(t)
  empty = jnp.all(st.amax_history == 0)
  current = scaling.te_scale(jnp.maximum(st.amax, a), st.scale, spec.fmt,
                             margin=spec.margin, pow2=spec.pow2)
  scale_now = jnp.where(empty, current, st.scale)
  running = jnp.where(jnp.isfinite(a), jnp.maximum(st.amax, a), st.amax)
  return scale_now, running


def _transposes(spec: QuantSpec, axis: int, backend=None) -> bool:
  """Packed formats, and operands for a TN-only backend, go contraction-last."""
  return axis != 1 and (spec.fmt.packed or dispatch.prefers_contraction_last(
      spec.granularity, backend))


def _quantize(t, spec: QuantSpec, axis: int, scale=None, key=None,
              backend=None) -> QTensor:
  """Quantizes a 2-D operand along ``axis`` (transposed first if needed)."""
  if _transposes(spec, axis, backend):
    q = scaling.quantize(t.T, spec, 1, scale=scale, key=key)
    return dataclasses.replace(q, transposed=True)
  return scaling.quantize(t, spec, axis, scale=scale, key=key)


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


def _operand(t, spec, axis, scale, key, backend=None):
  """Quantized copy, or the wide tensor when ``spec`` is None."""
  if spec is None:
    return t
  if spec.stochastic and key is None:
    key = _data_key(t)
  return _quantize(t, spec, axis, scale=scale,
                   key=key if spec.stochastic else None, backend=backend)


# ----------------------------------------------------------------------------
# The custom_vjp core on 2-D operands


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _qmm(recipe, backend, out_dtype, x, w, state, key):
  y, new_state, _ = _qmm_forward(recipe, backend, out_dtype, x, w, state, key)
  return y, new_state


def _qmm_forward(recipe: Recipe, backend, out_dtype, x, w, state, key):
  fx, fw = recipe.fprop.lhs, recipe.fprop.rhs
  wx = recipe.wgrad.lhs
  kx, kw, kwx, kb = _keys(key, 4)
  sx = sw = None
  new_state = state
  if recipe.delayed:
    sx, ax = _delayed(x, state["x"], fx)
    sw, aw = _delayed(w, state["w"], fw)
    new_state = {"x": state["x"]._replace(amax=_like(ax, state["x"].amax)),
                 "w": state["w"]._replace(amax=_like(aw, state["w"].amax)),
                 "g": state["g"]}
  qx = _operand(x, fx, 1, sx, kx, backend)
  qw = _operand(w, fw, 0, sw, kw, backend)
  y = _run(qx, qw, (1, 0), out_dtype, backend)

  # What Wgrad needs of x: the Fprop copy when it is axis-free, a copy
  # quantized along M now (from the wide x, Hadamard-transformed if the
  # recipe says so), or the wide x itself.
  rht = recipe.wgrad.hadamard
  if recipe.save_quantized_wgrad_input and wx is not None:
    if _shares(fx, wx, backend) and not rht:
      x_saved = qx
    else:
      x_saved = _operand(_transformed(x, rht, 0), wx, 0,
                         sx if recipe.delayed else None, kwx, backend)
  else:
    x_saved = x
  w_saved = (qw if _shares(fw, recipe.dgrad.rhs, backend)
             and not recipe.dgrad.hadamard else w)
  # Named, so a remat policy (save_only_these_names) can keep just this.
  x_saved = jax.tree.map(lambda t: checkpoint_name(t, WGRAD_INPUT_NAME),
                         x_saved)
  # Zero-size arrays carry dtypes to the backward rule: of the inputs, and of
  # the forward roles' state (whose values the backward does not need).
  dtypes = (_dtype_carrier(x), _dtype_carrier(w))
  xw_dtypes = None
  if recipe.delayed:
    xw_dtypes = jax.tree.map(_dtype_carrier, (state["x"], state["w"]))
  g_state = state["g"] if recipe.delayed else None
  res = (x_saved, w_saved, sx, sw, g_state, xw_dtypes, kb, dtypes)
  return y, new_state, res


def _transformed(t, size: int, axis: int):
  """A gradient-GEMM operand, Hadamard-transformed along its contraction
  ``axis`` when ``size`` is set (see `qlayers.hadamard`)."""
  return hadamard.transform(t, size, axis=axis) if size else t


def _dtype_carrier(v):
  return jnp.reshape(v, (-1,))[:0]


def _qmm_fwd(recipe, backend, out_dtype, x, w, state, key):
  y, new_state, res = _qmm_forward(recipe, backend, out_dtype, x, w, state,
                                   key)
  return (y, new_state), res


def _qmm_bwd(recipe: Recipe, backend, out_dtype, res, cts):
  del out_dtype
  x_saved, w_saved, sx, sw, g_state, xw_dtypes, key, (x_like, w_like) = res
  x_dtype, w_dtype = x_like.dtype, w_like.dtype
  g, _ = cts
  dg, dw_gemm = recipe.dgrad, recipe.wgrad
  kd, kwg = _keys(key, 2)

  sg = None
  g_cotangent = None
  if recipe.delayed:
    sg, ag = _delayed(g, g_state, dg.lhs)
    g_cotangent = jax.tree.map(_zero_cotangent, g_state, g_state)._replace(
        amax=_like(ag, g_state.amax))

  # Dgrad: dx = g @ w.T, contracted over N (both Hadamard-transformed along
  # N first if the recipe says so: (g Q.T) @ (w Q.T).T = g @ w.T).
  rht_n = dg.hadamard
  qg = _operand(_transformed(g, rht_n, 1), dg.lhs, 1, sg, kd, backend)
  if isinstance(w_saved, QTensor):
    qw = w_saved
  else:
    qw = _operand(_transformed(w_saved, rht_n, 1), dg.rhs, 1,
                  sw if recipe.delayed else None, None, backend)
  dx = _run(qg, qw, (1, 1), dg.out_dtype or x_dtype, backend)

  # Wgrad: dw = x.T @ g, contracted over M (both Hadamard-transformed along
  # M first if the recipe says so: (Qx).T @ (Qg) = x.T @ g).
  rht = dw_gemm.hadamard
  if isinstance(x_saved, QTensor) or dw_gemm.lhs is None:
    qx = x_saved
  else:
    qx = _operand(_transformed(x_saved, rht, 0), dw_gemm.lhs, 0,
                  sx if recipe.delayed else None, None, backend)
  if _shares(dg.lhs, dw_gemm.rhs, backend) and not (rht or rht_n):
    qg_w = qg
  else:
    qg_w = _operand(_transformed(g, rht, 0), dw_gemm.rhs, 0, sg, kwg,
                    backend)
  dw = _run(qx, qg_w, (0, 0), dw_gemm.out_dtype or jnp.float32, backend)

  state_ct = None
  if recipe.delayed:
    # Only the gradient role's running amax leaves the backward pass; all
    # else gets a zero cotangent (the forward roles left through the output).
    x_ct, w_ct = (jax.tree.map(_zero_cotangent, g_state, d) for d in xw_dtypes)
    state_ct = {"x": x_ct, "w": w_ct, "g": g_cotangent}
  return dx.astype(x_dtype), dw.astype(w_dtype), state_ct, None


def _zero_cotangent(shape_like, dtype_like):
  """Zero cotangent of the shape of one array and the dtype of another."""
  shape, dtype = shape_like.shape, dtype_like.dtype
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    # The additive identity of a max-combining dtype is its lowest value.
    return lax.convert_element_type(
        jnp.full(shape, -jnp.inf, jnp.float32), dtype)
  return jnp.zeros(shape, dtype)


_qmm.defvjp(_qmm_fwd, _qmm_bwd)


# ----------------------------------------------------------------------------
# Public entry points


def quantized_matmul(x: jax.Array, w: jax.Array, recipe: Recipe | str,
                     state: dict[str, ScaleState] | None = None, *,
                     key: jax.Array | None = None,
                     out_dtype=None, backend: str | None = None):
  """``x @ w`` with every GEMM of forward and backward quantized by ``recipe``.

  Args:
    x: activations ``(..., K)``.
    w: weight ``(K, N)``.
    recipe: a `Recipe` or a recipe name.
    state: delayed-scaling state from `init_state` (required for delayed
      recipes, ignored otherwise).
    key: PRNG key for stochastic rounding (derived from the data if omitted).
    out_dtype: output dtype (default: the recipe's Fprop out_dtype or
      ``x.dtype``).
    backend: force a GEMM backend (``xla`` or ``ffi``).

  Returns:
    ``(y, new_state)``: ``y`` of shape ``(..., N)``; ``new_state`` has the
    forward roles updated (``None`` for stateless recipes). Under
    differentiation the cotangent of ``state["g"]`` is the updated gradient
    state.

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
  out_dtype = jnp.dtype(out_dtype or recipe.fprop.out_dtype or x.dtype)
  lead = x.shape[:-1]
  x2 = x.reshape(-1, x.shape[-1])
  if not recipe.quantized:
    y = lax.dot_general(x2, w, (((1,), (0,)), ((), ())),
                        preferred_element_type=jnp.float32)
    return y.astype(out_dtype).reshape(*lead, w.shape[1]), state
  if recipe.delayed:
    if state is None:
      raise ValueError(f"Recipe {recipe.name!r} uses delayed scaling and "
                       "needs `state` (see init_state).")
    _check_state(state, recipe)
  else:
    state = None
  y, new_state = _qmm(recipe, backend, out_dtype, x2, w, state, key)
  return y.reshape(*lead, w.shape[1]), new_state


def _check_state(state, recipe: Recipe):
  if not isinstance(state, dict) or set(state) != {"x", "w", "g"}:
    raise ValueError("Delayed-scaling state must be a dict with keys "
                     "'x', 'w', 'g' (see init_state).")
  for role, st in state.items():
    hist = st.amax_history
    if hist.shape != (recipe.amax_history_len,):
      raise ValueError(
          f"State {role!r} has an amax history of shape {hist.shape} but "
          f"recipe {recipe.name!r} keeps {recipe.amax_history_len}.")
    if st.scale.shape != () or st.amax.shape != ():
      raise ValueError(f"State {role!r} scale and amax must be scalars, got "
                       f"shapes {st.scale.shape} and {st.amax.shape}.")


def dot_general(recipe: Recipe | str, *, backend: str | None = None):
  """A `lax.dot_general`-compatible callable quantized by ``recipe``.

  Plugs into ``nnx.Linear(dot_general=...)`` and
  ``jnp.einsum(..., _dot_general=...)``. Stateless: delayed-scaling recipes
  need the layer state that `qlayers.QuantDense` keeps, so they are refused.

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
        "state; use qlayers.QuantDense (or qlayers.quantize) instead of a "
        "stateless dot_general.")

  def fn(lhs, rhs, dimension_numbers, precision=None,
         preferred_element_type=None, out_sharding=None, **kwargs):
    del precision  # the recipe decides operand precision
    if kwargs:
      raise TypeError(f"Unsupported dot_general arguments: {sorted(kwargs)}.")
    out = _general(recipe, backend, lhs, rhs, dimension_numbers,
                   preferred_element_type)
    if out_sharding is not None:
      out = jax.sharding.reshard(out, out_sharding)
    return out

  fn.recipe = recipe
  return fn


def _general(recipe, backend, lhs, rhs, dimension_numbers,
             preferred_element_type):
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
  if lb:
    # Batch dims: map the 2-D core over them (outermost first).
    inner = ((tuple(_shift(d, lb[0]) for d in lc),
              tuple(_shift(d, rb[0]) for d in rc)),
             (tuple(_shift(d, lb[0]) for d in lb[1:]),
              tuple(_shift(d, rb[0]) for d in rb[1:])))
    f = functools.partial(_general, recipe, backend,
                          dimension_numbers=inner,
                          preferred_element_type=preferred_element_type)
    return jax.vmap(lambda a, b: f(a, b), in_axes=(lb[0], rb[0]))(lhs, rhs)
  lfree = [d for d in range(lhs.ndim) if d not in lc]
  rfree = [d for d in range(rhs.ndim) if d not in rc]
  k = 1
  for d in lc:
    k *= lhs.shape[d]
  a = jnp.transpose(lhs, lfree + list(lc)).reshape(-1, k)
  b = jnp.transpose(rhs, list(rc) + rfree).reshape(k, -1)
  out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
  y, _ = quantized_matmul(a, b, recipe, out_dtype=out_dtype, backend=backend)
  return y.reshape([lhs.shape[d] for d in lfree] +
                   [rhs.shape[d] for d in rfree])


def _shift(d, removed):
  return d - 1 if d > removed else d


def _qdq(t, spec: QuantSpec | None, axis: int, scale=None, key=None):
  """Quantize-dequantize ``t`` (2-D) along ``axis``, in ``t``'s layout."""
  if spec is None:
    return t
  d = _quantize(t, spec, axis, scale=scale, key=key).dequantize(t.dtype)
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
  sx = sw = None
  if recipe.delayed:
    sx, _ = _delayed(x2, state["x"], fx)
    sw, _ = _delayed(w, state["w"], fw)

  def ste(t, spec, axis, scale):
    return t + lax.stop_gradient(_qdq(t, spec, axis, scale) - t)

  y = jnp.dot(ste(x2, fx, 1, sx), ste(w, fw, 0, sw),
              precision=lax.Precision.HIGHEST)
  return y.reshape(*x.shape[:-1], w.shape[1])
