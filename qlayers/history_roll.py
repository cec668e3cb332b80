"""Delayed scaling's end of step for one GEMM, as one kernel on NVIDIA GPUs.

`qlayers.update_scales` ends a step by writing the gradient role's amax into
its running amax (`qlayers.delayed.merge_amax`) and rolling each role's
amax history (`qlayers.delayed.update_scales`). As XLA ops that is a loop
fusion per role and a scalar fusion per gradient role: for a model of 49
GEMMs, 196 kernels of a few floats each, which XLA:GPU compiles one by one
(``benchmarks/RESULTS.md``, "Where fp8_delayed's GPU-target compile time
goes"). `end_step` does a GEMM's roles in one Pallas (Triton) kernel where
the program may run on an NVIDIA GPU; elsewhere, and for histories the
kernel does not take, XLA's ops as before. The values are the same bit for
bit (the CPU tests run the kernel in Pallas' interpreter).

Example:
  >>> import jax.numpy as jnp
  >>> from qlayers.delayed import init_scale_state
  >>> x = init_scale_state(4)._replace(amax=jnp.float32(3.0))
  >>> g = init_scale_state(4)._replace(amax=jnp.float32(1.0))
  >>> new = roll([x, g], [None, jnp.float32(5.0)], interpret=True)
  >>> [(st.amax_history.tolist(), float(st.amax)) for st in new]
  [([3.0, 0.0, 0.0, 0.0], 0.0), ([5.0, 0.0, 0.0, 0.0], 0.0)]
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
from jax import lax
import jax.numpy as jnp

from qlayers import delayed
from qlayers import sharding
from qlayers import table
from qlayers.delayed import ScaleState

__all__ = ["supported", "roll", "end_step"]


def supported(states: Sequence[ScaleState]) -> bool:
  """Whether `roll` takes these roles: one history each (no stacked layers)
  whose length is a power of two (a Triton block), and a scalar amax."""
  return bool(states) and all(
      st.amax_history.ndim == 1 and st.amax.ndim == 0
      and (n := st.amax_history.shape[0]) > 0 and not n & (n - 1)
      for st in states)


def _kernel(*refs, merges: tuple[bool, ...], gated: bool, load):
  n = len(merges)
  amax_refs, history_refs = refs[:n], refs[n:2 * n]
  out_refs, cleared_refs = refs[-2 * n:-n], refs[-n:]
  inputs = refs[2 * n:-2 * n]
  update_refs = iter(inputs[:len(inputs) - gated])
  applied = inputs[-1][...] != 0 if gated else True
  for merge, amax_ref, history_ref, out_ref, cleared_ref in zip(
      merges, amax_refs, history_refs, out_refs, cleared_refs):
    a = amax_ref[...]
    if merge:  # `delayed.merge_amax`
      u = next(update_refs)[...]
      a = jnp.maximum(a, jnp.where(jnp.isfinite(u), u, 0.0))
    a = jnp.where(jnp.isfinite(a) & applied, a, 0.0)  # `_gate`, then
    # `delayed.update_scales`
    i = lax.broadcasted_iota(jnp.int32, history_ref.shape, 0)
    shifted = load(history_ref.at[jnp.maximum(i - 1, 0)])  # h[i - 1]
    out_ref[...] = jnp.where(i == 0, a, shifted)
    cleared_ref[...] = jnp.zeros_like(a)  # the next step's running amax


# Jitted with ``interpret`` static, as the cast kernels are: a train step
# calls it once per GEMM, and jit lowers one kernel per signature instead of
# one per call.
@functools.partial(jax.jit, static_argnames=("interpret",))
def roll(states: Sequence[ScaleState],
         updates: Sequence[jax.Array | None] | None = None,
         applied: jax.Array | None = None, *,
         interpret: bool = False) -> list[ScaleState]:
  """``states`` after `delayed.update_scales`, in one kernel: each role's
  running amax, max-combined first with its entry of ``updates`` where one
  is given (`delayed.merge_amax`: the gradient role's amax from the
  backward pass), enters its history at index 0, and the running amax
  restarts at 0. The kernel writes the zeros too: as a constant, XLA would
  copy each into the state's donated buffer, one more operation per role.

  Args:
    states: the roles of one GEMM (`supported`).
    updates: per role, an amax to merge into the running one, or None.
    applied: whether the step was applied (None: it was); where not, each
      history records 0 for it (`end_step`).
    interpret: run in Pallas' interpreter (any platform; for tests).
      Otherwise the kernel is lowered for NVIDIA GPUs only.
  """
  if not supported(states):
    raise ValueError(
        "roll takes 1-D histories whose length is a power of two and "
        f"scalar amaxes; got {[st.amax_history.shape for st in states]}, "
        f"{[st.amax.shape for st in states]}.")
  updates = list(updates or [None] * len(states))
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plt

  def scalar(a):
    return jnp.reshape(jnp.asarray(a, jnp.float32), (1,))

  merges = tuple(u is not None for u in updates)
  gated = applied is not None
  out = pl.pallas_call(
      functools.partial(_kernel, merges=merges, gated=gated, load=plt.load),
      out_shape=[jax.ShapeDtypeStruct(st.amax_history.shape, jnp.float32)
                 for st in states] + [jax.ShapeDtypeStruct((1,), jnp.float32)
                                      for st in states],
      compiler_params=plt.CompilerParams(num_warps=4),
      interpret=interpret, name="qlayers_history_roll",
  )(*(scalar(st.amax) for st in states),
    *(jnp.asarray(st.amax_history, jnp.float32) for st in states),
    *(scalar(u) for u in updates if u is not None),
    *([scalar(applied)] if gated else []))
  n = len(states)
  return [ScaleState(h, a.reshape(())) for h, a in zip(out[:n], out[n:])]


def _under_mesh(mesh) -> bool:
  """Whether the kernel pays under ``mesh``: auto axes only (it has no
  partitioning rule, so XLA runs it on every device with the state
  replicated, as the state is). The per-tensor cast kernel, which runs
  under such a mesh too (`qlayers.operands`), reads the rolled histories
  itself (8-GPU B200 fp8_delayed: 271 kernels with XLA's roll, 236 with
  this one; benchmarks/RESULTS.md)."""
  return not (sharding.manual_axes(mesh) or sharding.explicit_axes(mesh))


def end_step(states: Sequence[ScaleState],
             updates: Sequence[jax.Array | None] | None = None,
             applied: jax.Array | None = None) -> list[ScaleState]:
  """``states`` (one GEMM's roles) at the end of a step: each entry of
  ``updates`` (or None) merged into its role's running amax
  (`delayed.merge_amax`), then `delayed.update_scales`; where ``applied``
  (a bool, None: True) is False, a step the optimizer skipped, each history
  records 0 instead (`_gate`). One `roll` kernel
  where the program may run on an NVIDIA GPU, on one device or under a
  mesh where it pays (`_under_mesh`); XLA's ops elsewhere, with the same
  values. Jitted as a trace cache: the GEMMs of a model share a few
  signatures, each traced and lowered once (inlined into the caller's
  program)."""
  return _end_step(list(states), list(updates or [None] * len(states)),
                   None if applied is None else jnp.asarray(applied, bool))


def _gate(amax: jax.Array, applied: jax.Array | None) -> jax.Array:
  """A skipped step's running amax: 0, "no information" (its batch's
  finite amaxes would set the next scales)."""
  return amax if applied is None else jnp.where(applied, amax, 0.0)


@jax.jit
def _end_step(states: list[ScaleState], updates: list[jax.Array | None],
              applied: jax.Array | None) -> list[ScaleState]:
  def xla(states):
    return [delayed.update_scales(st._replace(amax=_gate(
        st.amax if u is None else delayed.merge_amax(st.amax, u), applied)))
            for st, u in zip(states, updates)]

  mesh = sharding.context_mesh()
  if not (supported(states) and table.targets_gpu() and (
      mesh is None or _under_mesh(mesh))):
    return xla(states)

  def cuda(states):
    return roll(states, updates, applied)

  return lax.platform_dependent(list(states), cuda=cuda, default=xla)
