"""`collect`: one forward and backward pass that measures every quantized GEMM.

The pass runs under ``jax.jit`` (compiled anew for each call: nothing is
cached on the user's function or model) on a copy of the model made inside the trace
(``nnx.split`` outside, ``nnx.merge`` inside, nothing written back), so the
model's state does not change. While it traces, each `QuantGemm` runs its
GEMM through a tap (`qlayers.inspect._tap`) that

* runs the real op (`ops.quantized_matmul`), so the loss and every gradient
  are what a training step computes;
* sends the operands ``x`` and ``w`` (and the delayed-scaling state the GEMM
  scaled them by) out of the computation through ``jax.debug.callback``;
* passes the output through an identity whose backward rule sends the
  output gradient ``g`` out the same way.

The statistics are measured afterwards, one small jitted program per
distinct (operand shapes, recipe, backend) (`numerics.forward_stats`:
the same specs, axes, delayed scales from the stored history, Hadamard
transforms; `numerics.backward_stats`), kept by jax across calls: a model
of 30 identical blocks compiles them once, not 30 times inside the pass,
and a `Monitor` once per run, not at every record. The pass itself compiles
like a training step's forward and backward. The tap exists only during
that trace: a model that is not being inspected traces exactly as before.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qlayers import ops
from qlayers import ragged
from qlayers.inspect import _tap
from qlayers.inspect import numerics
from qlayers.inspect.report import Output, Report, Row
from qlayers.layers.core import QuantGemm
from qlayers.layers.frozen import frozen_kernels
from qlayers.recipe import Recipe
from qlayers.state import QuantGradState

__all__ = ["collect"]


@dataclasses.dataclass(frozen=True)
class _Site:
  """Static description of one call of one GEMM (sent with its records)."""

  path: str
  use: int
  order: tuple[int, ...]  # position of this call in the trace (execution
  # order), then the loop iteration and the expert, where there are several
  recipe: Recipe
  backend: str | None
  experts: bool = False  # an einsum over experts: one call each, its
  # expert last in the fingerprint


# ----------------------------------------------------------------------------
# The tap and the identity that sees the output gradient


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _probe(put: Callable, y, tag):
  del tag
  return y


def _probe_fwd(put, y, tag):
  del put
  return y, tag


def _probe_bwd(put, tag, g):
  jax.debug.callback(put, tag, g.reshape(-1, g.shape[-1]))
  return g, None


_probe.defvjp(_probe_fwd, _probe_bwd)


def _fingerprint(*arrays) -> jax.Array:
  """A few bits that tell one call's operands from another's: each array's
  FP32 bit patterns, times an odd weight per position, summed as integers
  (exact, so any order of summation gives the same value). A layer run in
  a loop transform (``nnx.scan``) is traced once but runs once per
  iteration, each time with other operands: the forward and backward
  records of one iteration carry the same fingerprint, those of two
  iterations (almost surely) not; iterations with the very same operands
  are measured once."""
  def one(a):
    bits = jax.lax.bitcast_convert_type(
        jax.lax.stop_gradient(a).astype(jnp.float32), jnp.uint32).ravel()
    weight = 2 * jax.lax.iota(jnp.uint32, bits.size) + 1
    return jnp.sum(bits * weight, dtype=jnp.uint32)
  return jnp.stack([one(a) for a in arrays])


class _Collector:
  """The tap of one `collect` call: counts the calls of each layer and keeps
  what the pass sends out, ``records``: ``(site, "fwd" | "bwd",
  fingerprint, host arrays)``; "fwd" holds (x, w, state) as the GEMM
  consumed them, "bwd" the gradient g; the fingerprint (`_fingerprint`)
  pairs them per loop iteration."""

  def __init__(self):
    self.calls: dict[str, int] = {}
    self.records: list[tuple[_Site, str, bytes, Any]] = []

  def _put(self, site: _Site, kind: str, tag, arrays) -> None:
    self.records.append((site, kind, np.asarray(tag).tobytes(),
                         jax.tree.map(np.asarray, arrays)))

  def __call__(self, site, x, w, recipe: Recipe, state, *,
               key=None, out_dtype=None, backend=None, group_sizes=None,
               capacity=None):
    kw = dict(key=key, out_dtype=out_dtype, backend=backend)
    y, new_state = (
        ops.quantized_matmul(x, w, recipe, state, **kw) if group_sizes is None
        else ragged.quantized_ragged_dot(x, w, group_sizes, recipe, state,
                                         capacity=capacity, **kw))
    path = _tap.path_of(site)
    expert = _tap.split(site)[1]  # an einsum over experts: one call each
    if path is None or not recipe.quantized or x.size == 0 or y.size == 0:
      return y, new_state
    use = self.calls.get(path, 0)
    self.calls[path] = use + 1
    site = _Site(path, use, (sum(self.calls.values()) - 1,), recipe, backend,
                 expert is not None)
    sg = jax.lax.stop_gradient
    operands = (sg(x.reshape(-1, x.shape[-1])), sg(w),
                numerics.plain_state(state))
    if group_sizes is not None:  # split per expert on the host (_experts)
      operands += (ragged.group_ids(group_sizes, x.shape[0], capacity),)
    tag = _fingerprint(x, w)
    if expert is not None:
      tag = jnp.append(tag, jnp.asarray(expert, jnp.uint32))
    jax.debug.callback(functools.partial(self._put, site, "fwd"), tag,
                       operands)
    return (_probe(functools.partial(self._put, site, "bwd"), y, tag),
            new_state)


def _pass(graphdef, loss_fn, collector, state, args, kwargs):
  model = nnx.merge(graphdef, state)
  _tap.label(model)

  def loss(m):
    out = loss_fn(m, *args, **kwargs)
    if not (isinstance(out, jax.Array) and out.shape == ()):
      raise TypeError("loss_fn must return a scalar array (the loss), got "
                      f"{type(out).__name__} {getattr(out, 'shape', '')}.")
    return out.astype(jnp.float32)

  wrt = nnx.DiffState(0, (nnx.Param, QuantGradState))
  with _tap.tapping(collector):
    value, _ = nnx.value_and_grad(loss, argnums=wrt)(model)
  return value


def _check(model, loss_fn):
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be an nnx.Module, got "
                    f"{type(model).__name__}.")
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
  leaves = jax.tree.leaves(nnx.as_pure(nnx.state(model)))
  if any(isinstance(v, jax.core.Tracer) for v in leaves):
    raise RuntimeError("qlayers.inspect runs the model itself (under its own "
                       "jit): call it outside jit/grad, on a concrete model.")
  if not _tap.gemm_paths(model):
    raise ValueError(
        "qlayers.inspect.collect measures quantized GEMMs and the model has "
        "none: measure a quantized copy (measured = nnx.clone(model); "
        "qlayers.quantize(measured, recipe)).")


def collect(model: nnx.Module, loss_fn: Callable[..., jax.Array], *args,
            **kwargs) -> Report:
  """One forward and backward pass of ``loss_fn(model, *args, **kwargs)``
  that measures every quantized GEMM; the model's state does not change.

  Per quantized layer and operand role (``x``, ``w``, ``g``) and for each
  GEMM that consumes it: amax, the scale used (for delayed scaling the one
  derived from the stored history, as a training step would use it), the
  fractions saturated and flushed to zero, the SQNR of the quantized operand
  and of each GEMM's output against the unquantized computation, and the
  amax-history statistics of delayed scaling. See `Report`.

  ``loss_fn`` returns a scalar. ``args`` and ``kwargs`` are traced (close
  over Python settings); the pass is compiled on every call (nothing is
  cached on ``loss_fn`` or the model: a global it reads is read anew, as
  an eager call would). Layers that
  run their GEMM outside `QuantGemm.matmul` / ``__call__`` (`QuantLogits`)
  or quantize nothing are listed in `Report.skipped`. The experts of a
  grouped GEMM (`qlayers.layers.QuantRaggedDot`: `QuantExperts`,
  `QuantExpertsEinsum`, experts converted by `qlayers.quantize`) are
  measured one by one, as ``path[e]`` for each expert ``e`` that got tokens
  (every expert of an einsum over capacity buffers; each expert's GEMMs
  are dense GEMMs of its own rows, with its own scales; one compilation of
  the statistics per distinct token count). A layer run inside a loop
  transform (``nnx.scan`` over a stack of layers, ``lax.map``) is measured
  once per iteration, as ``path[i]`` for the ``i``-th iteration run
  (layer ``i`` of the stack; layer ``L - 1 - i`` of one scanned with
  ``reverse=True``; experts ``path[i][e]``), each from its own x, w and g.
  The operands of every quantized GEMM (x, w, g) are copied to host memory
  until they are measured: about the model's weights plus two activations
  per layer. Under dynamic loss scaling a delayed layer's gradient history
  holds the scaled gradient's amaxes: measure the loss times the
  optimizer's loss scale for ``g`` to compare with it.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import qlayers
    >>> layer = qlayers.QuantDense(64, 32, recipe="mxfp8", rngs=nnx.Rngs(0))
    >>> loss_fn = lambda m, x: jnp.mean(m(x) ** 2)
    >>> report = qlayers.inspect.collect(layer, loss_fn, jnp.ones((8, 64)))
    >>> [(r.role, r.format, sorted(r.gemms)) for r in report.rows]
    [('x', 'e4m3', ['fprop', 'wgrad']), ('w', 'e4m3', ['dgrad', 'fprop']), ('g', 'e4m3', ['dgrad', 'wgrad'])]
    >>> report.row("(model)", "x").sqnr_db  # ones are exact in E4M3
    inf
  """
  _check(model, loss_fn)
  graphdef, state = nnx.split(model)
  collector = _Collector()
  run = jax.jit(functools.partial(_pass, graphdef, loss_fn, collector))
  loss = float(run(state, args, kwargs))
  jax.effects_barrier()
  # Emptied here: a trace of the loss function's own jit may hold the tap.
  records, collector.records = collector.records, []
  return _report(model, *_measure(records), loss)


# ----------------------------------------------------------------------------
# Records -> statistics -> Report


# One program per distinct (operand shapes and dtypes, recipe, backend, GPU
# target), in jax's cache of these two functions: the keys are arrays'
# shapes and qlayers' own values (a frozen `Recipe`, a backend name), never
# the user's model or loss function.
_forward_stats = jax.jit(numerics.forward_stats,
                         static_argnames=("recipe", "backend"))
_backward_stats = jax.jit(numerics.backward_stats,
                          static_argnames=("recipe", "backend"))


def _measure(records) -> tuple[dict, dict]:
  """The operands each site recorded -> ``(sites, stats)``, both keyed by
  ``(path, use)``; ``stats[key]`` holds ``"fwd"`` (and ``"bwd"`` when the
  gradient reached the layer) statistics.
  """
  sites, raw = _experts(*_iterations(records))
  stats = {}
  for key, got in raw.items():
    site = sites[key]
    if "fwd" not in got:
      continue
    x, w, state = got["fwd"]
    stats[key] = {"fwd": _forward_stats(x, w, recipe=site.recipe,
                                        state=state, backend=site.backend)}
    if "bwd" in got:
      stats[key]["bwd"] = _backward_stats(got["bwd"], x, w,
                                          recipe=site.recipe, state=state,
                                          backend=site.backend)
  stats = jax.tree.map(np.asarray, stats)
  return {key: sites[key] for key in stats}, stats


def _iterations(records) -> tuple[dict, dict]:
  """The records of each site, one entry per iteration it ran: the forward
  and backward records that carry one fingerprint are one iteration (a
  remat's recomputed forward is the same iteration again: the later record
  replaces the earlier). A site that ran once keeps its path; one run in a
  loop transform (``nnx.scan`` over stacked layers, ``lax.map``) several
  times is ``path[i]`` for the ``i``-th iteration (in execution order).
  The experts of an einsum (`QuantExpertsEinsum`) carry their index in the
  fingerprint: ``path[e]``, or ``path[i][e]`` in a loop. Where a site's
  gradient was recorded, a forward record without its
  gradient (a recomputed forward that differs in its last bits from the
  one the backward pass used) is dropped."""
  sites: dict[tuple[str, int], _Site] = {}
  runs: dict[tuple[str, int], dict[bytes, dict[str, Any]]] = {}
  for site, kind, tag, arrays in records:
    key = (site.path, site.use)
    sites[key] = site
    runs.setdefault(key, {}).setdefault(tag, {})[kind] = arrays
  out_sites, out_raw = {}, {}
  for key, by_tag in runs.items():
    site = sites[key]
    tagged = [(t, r) for t, r in by_tag.items() if "fwd" in r]
    if any("bwd" in r for _, r in tagged):
      tagged = [(t, r) for t, r in tagged if "bwd" in r]
    got = [r for _, r in tagged]
    if site.experts:  # the expert of each record is in its fingerprint
      seen = collections.Counter()
      index = []  # (iteration, expert): the expert's n-th record
      for t, _ in tagged:
        e = int(np.frombuffer(t, np.uint32)[-1])
        index.append((seen[e], e))
        seen[e] += 1
      if max(seen.values()) == 1:
        index = [(e,) for _, e in index]
    elif len(got) == 1:
      out_sites[key], out_raw[key] = site, got[0]
      continue
    else:
      index = [(i,) for i in range(len(got))]
    for ix, r in zip(index, got):
      name = (site.path + "".join(f"[{i}]" for i in ix), site.use)
      out_sites[name] = dataclasses.replace(site, path=name[0],
                                            order=(*site.order, *ix))
      out_raw[name] = r
  return out_sites, out_raw


def _experts(sites: dict, raw: dict) -> tuple[dict, dict]:
  """A grouped GEMM's records (``x [m, K]``, ``w [G, K, N]``, per-expert
  state, and each row's group) as one site per expert with tokens,
  ``path[e]``: each expert's GEMMs are the dense GEMMs of its own rows
  (`qlayers.ragged`), measured as such."""
  out_sites, out_raw = {}, {}
  for key, got in raw.items():
    site = sites[key]
    if "fwd" not in got or len(got["fwd"]) != 4:
      out_sites[key], out_raw[key] = site, got
      continue
    x, w, state, (gid, valid) = got["fwd"]
    for e in range(w.shape[0]):
      rows = valid & (gid == e)
      if not rows.any():
        continue
      st = jax.tree.map(lambda a, e=e: a[e], state)
      k = (f"{site.path}[{e}]", site.use)
      out_sites[k] = dataclasses.replace(site, path=k[0],
                                         order=(*site.order, e))
      out_raw[k] = {"fwd": (x[rows], w[e], st)}
      if "bwd" in got:
        out_raw[k]["bwd"] = got["bwd"][rows]
  return out_sites, out_raw


def _f(v) -> float:
  return float(np.asarray(v))


def _row(site: _Site, role: str, per_gemm: dict, history) -> Row:
  specs = {u.gemm: u.spec for u in numerics.uses(site.recipe, role)}
  gemms = {}
  for gemm, st in per_gemm.items():
    gemms[gemm] = {k: _f(v) for k, v in st.items()}
    gemms[gemm].update(format=specs[gemm].format,
                       granularity=specs[gemm].granularity)
  # Lowest SQNR; a tie within float summation noise goes to the first GEMM.
  worst = min(gemms, key=lambda k: (round(_nan_last(gemms[k]["sqnr_db"]), 3),
                                    list(gemms).index(k)))
  w = gemms[worst]
  return Row(path=site.path, role=role, amax=w["amax"], scale=w["scale"],
             saturated=w["saturated"], underflow=w["underflow"],
             sqnr_db=w["sqnr_db"], gemm=worst, format=w["format"],
             granularity=w["granularity"], recipe=site.recipe.name,
             use=site.use, scale_min=w["scale_min"], zeros=w["zeros"],
             gemms=gemms,
             history=None if history is None
             else {k: _f(v) for k, v in history.items()})


def _nan_last(v: float) -> float:
  return math.inf if math.isnan(v) else v


def _report(model, sites: dict, by_site: dict, loss: float) -> Report:
  rows, outputs = [], []
  # A frozen kernel gets no gradient: its layer runs no Wgrad GEMM.
  frozen = {"/".join(map(str, p)) or "(model)"
            for p, _ in frozen_kernels(model)}
  for key in sorted(by_site, key=lambda k: sites[k].order):
    site, got = sites[key], by_site[key]
    ran = lambda gemm: not (gemm == "wgrad"
                            and _tap.rule_path(site.path) in frozen)
    for kind, roles in (("fwd", ("x", "w")), ("bwd", ("g",))):
      if kind not in got:
        continue
      stats = got[kind]
      for role in roles:
        per_gemm = {k: v for k, v in stats[role].items() if ran(k)}
        if per_gemm:
          rows.append(_row(site, role, per_gemm,
                           stats["history"].get(role)))
      for gemm, v in stats["out"].items():
        if ran(gemm):
          outputs.append(Output(site.path, gemm, _f(v), site.use))
  rank = {key: sites[key].order for key in sites}
  rows.sort(key=lambda r: (rank[r.path, r.use], "xwg".index(r.role)))
  outputs.sort(key=lambda o: (rank[o.path, o.use],
                              ("fprop", "dgrad", "wgrad").index(o.gemm)))
  seen = {p.partition("[")[0] for p, _ in by_site}  # experts: path[e]
  skipped = [(p, _why(g)) for p, g in _tap.gemm_paths(model).items()
             if p not in seen]
  return Report(rows, outputs, loss, skipped)


def _why(gemm: QuantGemm) -> str:
  if not gemm.recipe.quantized:
    return f"recipe {gemm.recipe.name!r} quantizes nothing"
  return ("its GEMM did not run through QuantGemm in loss_fn (not called, "
          "called on an empty batch, which has nothing to measure, or a "
          "layer such as QuantLogits that runs the op itself)")
