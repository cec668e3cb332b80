"""What each GEMM of a quantized matmul consumes, measured (no Flax).

For ``y = x @ w`` under a `Recipe` the three GEMMs quantize each operand
role along their own contraction axis (see `qlayers.gemm`):

====  =====================  =====================
role  first GEMM (axis)      second GEMM (axis)
====  =====================  =====================
x     fprop ``x`` (K)        wgrad ``x`` (M)
w     fprop ``w`` (K)        dgrad ``w`` (N)
g     dgrad ``g`` (N)        wgrad ``g`` (M)
====  =====================  =====================

The functions here rebuild those quantized copies with the library's own
functions (`ops.operand` of a `dispatch.Operand`: the same spec, axis,
layout, delayed amax, Hadamard transform and stochastic-rounding key rule
as the op) and measure them
against the wide tensor: `operand_stats` (amax, scale, saturated and
flushed fractions, SQNR), `output_sqnr` (a GEMM of the dequantized copies
against the FP32 GEMM of the wide operands) and `history_stats` (delayed
scaling). Every result is a dict of JAX scalars, so it can be computed
inside a trace.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from qlayers import dispatch
from qlayers import hadamard
from qlayers import ops
from qlayers import scaling
from qlayers.recipe import Recipe
from qlayers.scaling import QuantSpec, QTensor, ScaleState

__all__ = ["Use", "uses", "operand_stats", "output_sqnr", "sqnr_db",
           "history_stats", "quantized_copy", "dequantized",
           "forward_stats", "backward_stats", "SATURATION_TOLERANCE"]

SATURATION_TOLERANCE = 2.0**-20
"""A value counts as saturated when its scaled magnitude exceeds the format's
max by more than this relative amount: the float32 rounding of ``x / scale``
at the amax itself (current scaling) stays far below it."""


class Use(NamedTuple):
  """One GEMM's use of an operand role: which spec, along which 2-D axis,
  after which Hadamard transform (block size, 0: none)."""

  gemm: str
  spec: QuantSpec | None
  axis: int
  hadamard: int


def uses(recipe: Recipe, role: str) -> tuple[Use, Use]:
  """The two GEMMs that consume ``role`` (``"x"``, ``"w"`` or ``"g"``)."""
  f, d, w = recipe.fprop, recipe.dgrad, recipe.wgrad
  table = {
      "x": (Use("fprop", f.lhs, 1, 0), Use("wgrad", w.lhs, 0, w.hadamard)),
      "w": (Use("fprop", f.rhs, 0, 0), Use("dgrad", d.rhs, 1, d.hadamard)),
      "g": (Use("dgrad", d.lhs, 1, d.hadamard),
            Use("wgrad", w.rhs, 0, w.hadamard)),
  }
  if role not in table:
    raise ValueError(f"Unknown operand role {role!r}; expected x, w or g.")
  return table[role]


# ----------------------------------------------------------------------------
# One quantized copy


def quantized_copy(t: jax.Array, use: Use, amax, recipe: Recipe,
                   backend=None) -> tuple[jax.Array, QTensor]:
  """``(operand, its quantized copy)``: the 2-D ``t`` Hadamard-transformed as
  ``use`` says, quantized exactly as `qlayers.gemm` quantizes it for that GEMM
  (``use.spec`` must not be None)."""
  del recipe
  # Made from ``t`` as the GEMM makes it (a stochastic rounding key drawn
  # from the untransformed data); the statistics read the transformed one.
  op = dispatch.Operand.make(use.spec, use.axis, use.hadamard,
                             backend=backend)
  q = ops.operand(t, op, amax=amax)
  if use.hadamard:
    t = hadamard.transform(t, use.hadamard, axis=use.axis)
  return t, q


def _cropped(v: jax.Array, q: QTensor) -> jax.Array:
  """``v`` (padded layout of ``q``) cropped to ``q.shape``."""
  return v[tuple(slice(0, n) for n in q.shape)]


def _in_layout(v: jax.Array, q: QTensor) -> jax.Array:
  """``v`` in the caller's layout (undoing a contraction-last transpose)."""
  return v.T if q.transposed else v


def dequantized(q: QTensor) -> jax.Array:
  """FP32 values of ``q`` in the layout of the tensor it was made from."""
  return _in_layout(q.dequantize(jnp.float32), q)


def _element_scales(q: QTensor) -> jax.Array:
  """The dequantization factor of every element of ``q`` (``q.shape``)."""
  s = q.scale_values()
  if q.block is None:
    return jnp.broadcast_to(s, q.shape)
  for axis, b in enumerate(q.block):
    if b != 1:
      s = jnp.repeat(s, b, axis=axis)
  return _cropped(s, q)


def sqnr_db(ref: jax.Array, approx: jax.Array) -> jax.Array:
  """``10 log10(sum ref^2 / sum (ref - approx)^2)`` in FP32; +inf when the
  two are equal (an exactly representable tensor)."""
  ref = ref.astype(jnp.float32)
  err = ref - approx.astype(jnp.float32)
  signal, noise = jnp.sum(ref * ref), jnp.sum(err * err)
  db = 10.0 * jnp.log10(signal / noise)
  return jnp.where(noise == 0, jnp.inf, db)


def operand_stats(t: jax.Array, q: QTensor) -> dict[str, jax.Array]:
  """How well ``q`` (a quantized copy of the 2-D ``t``) represents ``t``.

  Returns FP32 scalars:
    amax: ``max |t|``.
    scale: the largest dequantization factor in use (the only one, per
      tensor); ``scale_min``: the smallest over blocks holding a non-zero.
    saturated: fraction of elements whose scaled magnitude exceeds the
      format's max (clipped to it), see `SATURATION_TOLERANCE`.
    underflow: fraction of elements non-zero in ``t`` whose payload or
      scale is zero (flushed); ``zeros``: fraction already zero in ``t``.
    sqnr_db: `sqnr_db` of ``t`` against ``q`` dequantized.
  """
  tq = _in_layout(t, q).astype(jnp.float32)  # in q's layout
  s = _element_scales(q)
  scaled = jnp.abs(tq * (1.0 / s))
  limit = q.fmt.max * (1.0 + SATURATION_TOLERANCE)
  payload = _cropped(q.elements(jnp.float32), q)
  nonzero = tq != 0
  deq = _cropped(q.dequantize(jnp.float32), q)
  f32 = jnp.float32
  return {
      # NaN-propagating (XLA:CPU's vectorized max drops NaN): +Inf where
      # the data holds any, as the GEMM's own amax reads it.
      "amax": scaling.amax(tq),
      "scale": jnp.where(jnp.any(jnp.isnan(s)), jnp.nan,
                         jnp.max(s)).astype(f32),
      "scale_min": jnp.min(jnp.where(nonzero, s, jnp.inf)).astype(f32),
      # A block scale of 0 (NVFP4's E4M3 scale underflowed) flushes its
      # block whatever its payload: underflow, not saturation.
      "saturated": jnp.mean(((scaled > limit) & (s > 0)).astype(f32)),
      "underflow": jnp.mean((nonzero & ((payload == 0) | (s == 0))
                             ).astype(f32)),
      "zeros": jnp.mean((~nonzero).astype(f32)),
      "sqnr_db": sqnr_db(tq, deq),
  }


def _dot(a, b, axes):
  """FP32 product of 2-D ``a`` and ``b`` contracted over ``axes``."""
  return lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32),
                         ((axes[:1], axes[1:]), ((), ())),
                         precision=lax.Precision.HIGHEST)


def output_sqnr(a, b, qa, qb, axes) -> jax.Array:
  """SQNR of a GEMM of the dequantized ``qa``, ``qb`` (QTensor, or a wide
  operand used as it is) against the FP32 GEMM of the wide ``a``, ``b``.

  Copies made of Hadamard-transformed operands need no special case: the
  transform leaves the product unchanged in exact arithmetic, so the
  reference is the product of the untransformed operands.
  """
  da = dequantized(qa) if isinstance(qa, QTensor) else qa
  db = dequantized(qb) if isinstance(qb, QTensor) else qb
  return sqnr_db(_dot(a, b, axes), _dot(da, db, axes))


def history_stats(st: ScaleState, current, algo: str) -> dict[str, jax.Array]:
  """Delayed scaling of one role: the amax its scale came from (``used``),
  the current amax over it (``ratio``: > 1 saturates), how many of its
  entries hold an amax (``filled``: a step that recorded 0 is not
  counted), its max and its most recent entry."""
  used, _ = scaling.delayed_amax(st, current, algo)
  hist = st.amax_history
  return {
      "used": used,
      "ratio": jnp.asarray(current, jnp.float32) / used,
      "filled": jnp.sum((hist > 0).astype(jnp.float32)),
      "max": jnp.max(hist),
      "recent": hist[0],
  }


# ----------------------------------------------------------------------------
# Every operand of a matmul


def plain_state(state):
  """Delayed state as plain FP32 constants (or None)."""
  if state is None:
    return None
  return {role: lax.stop_gradient(ScaleState(*st))
          for role, st in state.items()}


def _amaxes(t, state, role, recipe: Recipe):
  """(the amax delayed scaling quantizes ``t`` by, its `history_stats`), or
  (None, None) for current scaling."""
  if not recipe.delayed:
    return None, None
  h = history_stats(state[role], scaling.amax(t), recipe.amax_compute_algo)
  return h["used"], h


def _role_stats(t, role, amax, recipe, backend, only=None):
  """({gemm: operand_stats}, {gemm: QTensor}) for the GEMMs that quantize
  ``role`` (those named in ``only``, if given)."""
  stats, copies = {}, {}
  for use in uses(recipe, role):
    if use.spec is None or (only is not None and use.gemm not in only):
      continue
    op, q = quantized_copy(t, use, amax, recipe, backend)
    stats[use.gemm] = operand_stats(op, q)
    copies[use.gemm] = q
  return stats, copies


def forward_stats(x: jax.Array, w: jax.Array, recipe: Recipe, state=None,
                  backend=None) -> dict:
  """Statistics of ``x (M, K)`` and ``w (K, N)`` as the GEMMs consume them.

  Returns ``{"x": {gemm: stats}, "w": {gemm: stats}, "out": {"fprop":
  SQNR}, "history": {role: history_stats} or {}}``.
  """
  x, w = lax.stop_gradient(x), lax.stop_gradient(w)
  state = plain_state(state)
  ax, hx = _amaxes(x, state, "x", recipe)
  aw, hw = _amaxes(w, state, "w", recipe)
  sx, cx = _role_stats(x, "x", ax, recipe, backend)
  sw, cw = _role_stats(w, "w", aw, recipe, backend)
  out = {}
  if recipe.fprop.quantized:
    out["fprop"] = output_sqnr(x, w, cx["fprop"], cw["fprop"], (1, 0))
  history = {} if hx is None else {"x": hx, "w": hw}
  return {"x": sx, "w": sw, "out": out, "history": history}


def backward_stats(g: jax.Array, x: jax.Array, w: jax.Array, recipe: Recipe,
                   state=None, backend=None) -> dict:
  """Statistics of the output gradient ``g (M, N)`` as Dgrad and Wgrad
  consume it, and of both GEMMs' outputs (``x``, ``w``: the forward
  operands). Returns ``{"g": {gemm: stats}, "out": {gemm: SQNR},
  "history": {"g": history_stats} or {}}``."""
  g, x, w = (lax.stop_gradient(t) for t in (g, x, w))
  state = plain_state(state)
  ag, hg = _amaxes(g, state, "g", recipe)
  ax, _ = _amaxes(x, state, "x", recipe)
  aw, _ = _amaxes(w, state, "w", recipe)
  sg, cg = _role_stats(g, "g", ag, recipe, backend)
  _, cx = _role_stats(x, "x", ax, recipe, backend, only=("wgrad",))
  _, cw = _role_stats(w, "w", aw, recipe, backend, only=("dgrad",))
  out = {}
  if recipe.dgrad.quantized:
    out["dgrad"] = output_sqnr(g, w, cg["dgrad"], cw["dgrad"], (1, 1))
  if recipe.wgrad.quantized:
    out["wgrad"] = output_sqnr(x, g, cx["wgrad"], cg["wgrad"], (0, 0))
  history = {} if hg is None else {"g": hg}
  return {"g": sg, "out": out, "history": history}
