"""How the quantized GEMMs meet JAX's SPMD engine (jit + meshes, shard_map).

qlayers adds no collectives where XLA's serve; this module only says, while
a GEMM is traced, which kind of mesh it runs under and adapts to it:

* no mesh, or one device: nothing changes (the single-device program).
  A program sharded only through ``jax.jit``'s shardings (or the
  deprecated ``with mesh:``) looks the same while traced; on GPUs the
  one-pass cast kernels then cast each shard (`qlayers.partition.cast`).
* auto axes (``jax.set_mesh(mesh)`` with ``AxisType.Auto``, arrays placed
  with ``jax.device_put``): amaxes are reductions over the whole array, so
  XLA makes them global; quantized GEMMs run through `qlayers.partition`,
  whose partitioning rule gathers FP8 payloads, never wide weights.
* explicit axes (``AxisType.Explicit``, the mode of the Flax NNX sharding
  guide): the GEMM core runs in an auto-axes region (`auto_region`) whose
  outputs get the shardings the explicit-mode rules of ``lax.dot_general``
  give (inputs' free dims keep their specs), the new quantization state is
  replicated, and gradients take their primals' shardings.
* manual axes (inside ``jax.shard_map``): each device sees its shard, so a
  per-tensor amax is reduced with ``lax.pmax`` over the axes its operand
  varies over (`global_amax`), and a gradient of an operand that was
  implicitly broadcast over manual axes is summed over them
  (`sum_over_broadcast`).

The FP8 gather can be switched off for steps traced inside
``gather_payloads(False)``: XLA then places the gathers of the xla backend
itself (on CPU, where payloads are upcast before the dot, that gathers wide
data). The ffi backend always keeps its partitioning rule.
"""

from __future__ import annotations

import contextlib
import math
import threading

import jax
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

__all__ = ["context_mesh", "auto_mesh", "manual_axes", "explicit_axes",
           "quantized_gather", "gather_payloads", "auto_region", "global_amax",
           "sum_over_broadcast", "varying_axes", "replicated", "spec_of",
           "dot_spec", "unpartitioned", "unpartitioned_now", "local_scales",
           "local_scale_axes", "gathered_weights", "weight_shards",
           "reduce_scatter"]


def context_mesh():
  """The abstract mesh being traced under, or None (no mesh, one device)."""
  mesh = _abstract_mesh()
  if mesh is None or math.prod(mesh.axis_sizes) == 1:
    return None
  return mesh


def _abstract_mesh():
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def _axes_of(mesh, kind) -> tuple[str, ...]:
  """Every axis of ``kind``, those of size 1 included: an array's type names
  them in its spec all the same, and JAX's explicit-mode rules read them."""
  if mesh is None:
    return ()
  return tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types)
               if t == kind)


def manual_axes(mesh=None) -> tuple[str, ...]:
  """Manual (``shard_map``) axes of ``mesh`` (default: the abstract mesh
  being traced under, even of one device)."""
  return _axes_of(mesh or _abstract_mesh(), AxisType.Manual)


def explicit_axes(mesh=None) -> tuple[str, ...]:
  """Explicit axes of ``mesh`` (default: the abstract mesh being traced
  under, even of one device), those of size 1 included."""
  return _axes_of(mesh or _abstract_mesh(), AxisType.Explicit)


def auto_mesh():
  """The context mesh if its GEMMs can use a partitioning rule: more than one
  device and no manual axis. Explicit axes count as auto: `qlayers.gemm`
  runs every GEMM core under them in an auto-axes region (`auto_region`),
  so a plan made outside that region already sees the mesh."""
  mesh = context_mesh()
  if mesh is None or manual_axes(mesh):
    return None
  return mesh


_local = threading.local()


# Part of jax's tracing and compilation cache keys (see `gather_payloads`).
_GATHER = jax.make_user_context(default_value=True)


@contextlib.contextmanager
def gather_payloads(enabled: bool = True):
  """Whether quantized GEMMs of the xla backend traced in this block use the
  partitioning rule that gathers quantized payloads (`qlayers.partition`;
  default: yes). With ``False`` XLA places their gathers itself (wide ones
  on CPU, where payloads are upcast before the dot); the ffi backend keeps
  its rule. Read when a step is traced; part of jax's cache keys (as
  `qlayers.dispatch.target_arch`), so a jitted step retraces under it.

  Example:
    >>> from qlayers import sharding
    >>> with sharding.gather_payloads(False):
    ...   sharding.quantized_gather()
    False
    >>> sharding.quantized_gather()
    True
  """
  if not isinstance(enabled, bool):
    raise TypeError(f"gather_payloads(enabled) takes a bool, got "
                    f"{enabled!r}.")
  with _GATHER(enabled):
    yield


def quantized_gather() -> bool:
  """Whether the xla backend's quantized GEMMs being traced use the
  partitioning rule that gathers quantized payloads (see
  `gather_payloads`)."""
  return bool(_GATHER.value)


@contextlib.contextmanager
def unpartitioned():
  """GEMMs traced in this block skip the partitioning rule (it has no
  batching rule: `qlayers.ops` traces batched GEMMs under ``jax.vmap`` here)."""
  depth = getattr(_local, "depth", 0)
  _local.depth = depth + 1
  try:
    yield
  finally:
    _local.depth = depth


def unpartitioned_now() -> bool:
  return getattr(_local, "depth", 0) > 0


# ----------------------------------------------------------------------------
# Explicit axes


def spec_of(x) -> tuple:
  """The explicit-axes spec of ``x``, one entry per dim (None: unsharded)."""
  sharding = jax.typeof(x).sharding
  spec = tuple(sharding.spec) if sharding is not None else ()
  spec = spec + (None,) * (jax.typeof(x).ndim - len(spec))
  explicit = set(explicit_axes())
  def keep(entry):
    names = entry if isinstance(entry, tuple) else (entry,)
    names = tuple(n for n in names if n in explicit)
    if not names:
      return None
    return names[0] if len(names) == 1 else names
  return tuple(keep(e) for e in spec)


def explicit_shards(x, dim: int) -> int:
  """How many parts dim ``dim`` of ``x`` is split into over explicit mesh
  axes (1: none)."""
  names = _names(spec_of(x)[dim])
  mesh = _abstract_mesh()
  return math.prod(mesh.shape[n] for n in names) if names else 1


def _names(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return entry if isinstance(entry, tuple) else (entry,)


def dot_spec(lhs_free: tuple, rhs_free: tuple) -> P:
  """Output spec of a GEMM whose free dims have these specs: the lhs's kept,
  the rhs's minus mesh axes the lhs already uses (as an explicit-axes
  ``dot_general`` with its contracting dims gathered gives)."""
  used = {n for e in lhs_free for n in _names(e)}
  out = list(lhs_free)
  for e in rhs_free:
    names = tuple(n for n in _names(e) if n not in used)
    used.update(names)
    out.append(None if not names else names[0] if len(names) == 1 else names)
  return P(*out)


def auto_region(fn, out_specs):
  """``fn`` run with the context mesh's explicit axes made auto.

  ``out_specs`` (a pytree of `PartitionSpec` matching ``fn``'s outputs) are
  the explicit shardings its outputs get. Without explicit axes, ``fn``
  itself.
  """
  axes = explicit_axes()
  if not axes:
    return fn
  return jax.sharding.auto_axes(fn, axes=axes, out_sharding=out_specs)


# ----------------------------------------------------------------------------
# Manual axes (shard_map)


def varying_axes(x) -> tuple[str, ...]:
  """Manual mesh axes over which ``x`` holds different values per device."""
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return tuple(sorted(mat.varying)) if mat is not None else ()


# Manual axes whose shards are different tensors (see `local_scales`).
_LOCAL = jax.make_user_context(default_value=())


@contextlib.contextmanager
def local_scales(*axes: str):
  """Amaxes traced in this block are not reduced over the manual ``axes``:
  each device's shard along them is a tensor of its own (expert
  parallelism: the experts a device holds and the tokens sent to them), so
  its scales are its own. `qlayers.expert_parallel` runs the experts so.

  Example:
    >>> from qlayers import sharding
    >>> with sharding.local_scales("expert"):
    ...   sharding.local_scale_axes()
    ('expert',)
  """
  with _LOCAL(tuple(_LOCAL.value) + tuple(axes)):
    yield


def local_scale_axes() -> tuple[str, ...]:
  """The axes of the enclosing `local_scales` blocks."""
  return tuple(_LOCAL.value)


# Manual axes the GEMM weights are FSDP shards over (see `gathered_weights`).
_GATHERED = jax.make_user_context(default_value=())


@contextlib.contextmanager
def gathered_weights(*axes: str):
  """Quantized GEMMs traced in this block take a weight ``w (K, N)`` that
  varies over the manual ``axes`` as its shard along K (FSDP inside
  ``shard_map``): each quantizes its shard with the whole weight's scales,
  all-gathers payload + scales over those axes before the local GEMM
  (`qlayers.partition.gather`; wide where a shard would not quantize as
  the whole does) and reduce-scatters the weight gradient back.
  `qlayers.expert_parallel.run` runs FSDP experts so.

  Example:
    >>> from qlayers import sharding
    >>> with sharding.gathered_weights("fsdp"):
    ...   sharding.weight_shards(jax.numpy.ones((4, 2)))
    ((), (4, 2))
  """
  with _GATHERED(tuple(_GATHERED.value) + tuple(axes)):
    yield


def weight_shards(w, dim: int = 0) -> tuple[tuple[str, ...], tuple]:
  """``(axes, shape)``: the `gathered_weights` axes ``w`` varies over (its
  shards along ``dim``) and the whole weight's shape; ``((), w.shape)``
  outside such a block."""
  axes = tuple(a for a in varying_axes(w) if a in _GATHERED.value)
  shape = list(jax.typeof(w).shape)
  if axes:
    shape[dim] *= math.prod(lax.axis_size(a) for a in axes)
  return axes, tuple(shape)


def reduce_scatter(ct, axes: tuple[str, ...]):
  """``ct``, the cotangent of a whole weight gathered over ``axes`` along
  dim 0, summed over them (in FP32) and each device's shard kept (the FSDP
  weight gradient). Unchanged for no axes."""
  if not axes:
    return ct
  out = lax.psum_scatter(ct.astype(jax.numpy.float32), axes,
                         scatter_dimension=0, tiled=True)
  return out.astype(ct.dtype)


def global_amax(a, t):
  """``a``, the amax of ``t``'s local values, made the amax of the whole
  tensor: under ``shard_map``, the max over the axes ``t`` varies over (each
  device holds one shard) but those of `local_scales`. Elsewhere (no manual
  axes) ``a`` unchanged."""
  axes = tuple(x for x in varying_axes(t) if x not in _LOCAL.value)
  return lax.pmax(a, axes) if axes else a


def sum_over_broadcast(ct, axes: tuple[str, ...]):
  """Cotangent ``ct`` of a primal that varies over ``axes`` only: summed over
  the other manual axes ``ct`` varies over (the transpose of the implicit
  broadcast of that primal to them)."""
  extra = tuple(a for a in varying_axes(ct) if a not in axes)
  if not extra:
    return ct
  if ct.dtype.itemsize < 4:  # summed in FP32, as the GEMMs accumulate
    return lax.psum(ct.astype(jax.numpy.float32), extra).astype(ct.dtype)
  return lax.psum(ct, extra)


# ----------------------------------------------------------------------------
# State placement


def replicated(x):
  """``x`` replicated over the context mesh (as a value of its own: no spec
  it could inherit from an operand). Unchanged without a mesh."""
  mesh = context_mesh()
  if mesh is None or manual_axes(mesh):
    return x
  spec = P(*(None,) * jax.typeof(x).ndim)
  if not isinstance(x, jax.core.Tracer):
    try:
      concrete = jax.sharding.get_mesh()
    except ValueError:  # made under a transform (nnx.vmap's init): no
      pass  # concrete mesh to place it on; constrained as a traced value
    else:
      if concrete is None or concrete.empty:
        return x
      return jax.device_put(x, NamedSharding(concrete, spec))
  if explicit_axes(mesh):
    return jax.sharding.reshard(x, spec)
  return lax.with_sharding_constraint(x, spec)
