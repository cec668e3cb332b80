"""Delayed scaling: the amax history of one operand role, and its step.

Per step (Transformer Engine's order): each use quantizes with the amax of
the stored history (`delayed_amax`; the current amax on the first step,
while the history is empty) and max-combines its own amax into the running
amax; the gradient's amax, known only in the backward pass, is written into
it with `merge_amax`; `update_scales` ends the step: the running amax enters
the history, which rolls. State is plain FP32 arrays that orbax saves; a
non-finite amax never enters it.

Example:
  >>> import jax.numpy as jnp
  >>> state = init_scale_state(history_len=4)
  >>> use, running = delayed_amax(state, jnp.float32(3.0))
  >>> float(use)  # step 0: the history is empty, so the current amax
  3.0
  >>> state = update_scales(state._replace(amax=running))
  >>> state.amax_history
  Array([3., 0., 0., 0.], dtype=float32)
  >>> float(delayed_amax(state, jnp.float32(5.0))[0])  # the history's
  3.0
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["ScaleState", "init_scale_state", "history_amax", "delayed_amax",
           "merge_amax", "update_scales"]


class ScaleState(NamedTuple):
  """Delayed-scaling state of one operand role: plain FP32 arrays.

  Attributes:
    amax_history: ``(..., history_len)`` amaxes of completed steps, index 0
      the most recent (0: a step that saw nothing finite). Leading axes stack
      the state of layers made under ``nnx.vmap``.
    amax: ``(...)`` running max |x| of the current step (every use of the
      role max-combines into it).

  The scale itself is not stored: each use derives it from the history for
  its own operand's format and margin (`delayed_amax`, then `quantize`), so
  two GEMMs that quantize one role to different formats each get their own.
  """

  amax_history: jax.Array
  amax: jax.Array


def init_scale_state(history_len: int,
                     batch_shape: tuple[int, ...] = ()) -> ScaleState:
  """A fresh `ScaleState` (empty history, zero running amax).

  Example:
    >>> state = init_scale_state(1024, batch_shape=(2,))  # 2 stacked layers
    >>> state.amax_history.shape, state.amax.shape
    ((2, 1024), (2,))
  """
  return ScaleState(jnp.zeros((*batch_shape, history_len), jnp.float32),
                    jnp.zeros(batch_shape, jnp.float32))


def history_amax(history: jax.Array, algo: str = "max") -> jax.Array:
  """The amax a delayed scale is computed from (0 while the history is empty).

  ``algo`` is ``max`` (over the whole history) or ``most_recent``: the most
  recent non-zero entry, so a step that recorded nothing keeps the scale of
  the step before (Transformer Engine keeps the previous scale then).

  Example:
    >>> import jax.numpy as jnp
    >>> history = jnp.array([0.0, 7.0, 9.0])
    >>> history_amax(history, "max"), history_amax(history, "most_recent")
    (Array(9., dtype=float32), Array(7., dtype=float32))
  """
  if algo == "max":
    return jnp.max(history, axis=-1)
  if algo == "most_recent":
    seen = history != 0
    first = jnp.argmax(seen, axis=-1)
    latest = jnp.take_along_axis(history, first[..., None], axis=-1)[..., 0]
    return jnp.where(jnp.any(seen, axis=-1), latest, 0.0)
  raise ValueError(f"Unknown amax_compute_algo {algo!r}.")


def delayed_amax(state: ScaleState, current: jax.Array,
                 algo: str = "max", stored: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
  """One use of a delayed-scaling role: ``(amax to scale by, new running amax)``.

  The amax to scale by comes from the history of completed steps; while the
  history is still empty (the first step), it is the running amax of this
  step including ``current``, so the first step does not quantize with a
  scale of 1 (which flushes small gradients in E5M2). A non-finite
  ``current`` (the operand holds Inf/NaN) is returned as the amax to scale
  by, which makes the quantized operand, and so its GEMM, non-finite, but it
  never enters the running amax. ``stored`` is `history_amax` of the
  state's history when the caller has it already.
  """
  current = jnp.asarray(current, jnp.float32)
  finite = jnp.isfinite(current)
  running = jnp.where(finite, jnp.maximum(state.amax, current), state.amax)
  if stored is None:
    stored = history_amax(state.amax_history, algo)
  use = jnp.where(stored > 0, stored, running)
  return jnp.where(finite, use, current), running


def merge_amax(running: jax.Array, gradient: jax.Array) -> jax.Array:
  """A running amax with a gradient amax written into it, by max; a
  non-finite gradient amax carries no information and reads as 0.

  Example:
    >>> import jax.numpy as jnp
    >>> merge_amax(jnp.array([3.0, 3.0]), jnp.array([5.0, jnp.nan]))
    Array([5., 3.], dtype=float32)
  """
  gradient = gradient.astype(running.dtype)
  return jnp.maximum(running, jnp.where(jnp.isfinite(gradient), gradient, 0.0))


def update_scales(state: ScaleState) -> ScaleState:
  """Ends a step: the running amax enters the history (rolled one step, index
  0 most recent) and is cleared.

  A non-finite running amax is recorded as 0 ("no information"), so one bad
  step cannot poison the next ``history_len`` scales. Leading axes (stacked
  layers) are batched.
  """
  a = jnp.asarray(state.amax, jnp.float32)
  a = jnp.where(jnp.isfinite(a), a, 0.0)
  # A shift (pad) and a select: one loop fusion per role (XLA:GPU fuses the
  # running amax's last step into it); a roll with an indexed set is a
  # scatter.
  h = state.amax_history
  shifted = jax.lax.pad(h[..., :-1], jnp.float32(0),
                        [(0, 0, 0)] * (h.ndim - 1) + [(1, 0, 0)])
  first = jax.lax.broadcasted_iota(jnp.int32, h.shape, h.ndim - 1) == 0
  history = jnp.where(first, a[..., None], shifted)
  return ScaleState(history, jnp.zeros_like(state.amax))
