"""A partitioning rule for the quantized 2-D GEMM: each device runs its
local GEMM on payload + scale shards.

`gemm` wraps a backend's GEMM of two `QTensor` operands in
``jax.experimental.custom_partitioning``. When XLA's SPMD partitioner
reaches it, it sees the operands' shardings and `_partition` decides:

* The lhs (always an activation or output gradient here: ``x``/``g`` of
  Fprop, Dgrad, Wgrad) keeps its layout: its contraction dim's mesh axes are
  the GEMM's, so activations are never gathered (the rhs is sliced to match
  where it is not sharded the same way).
* The rhs keeps the mesh axes of its free dim that the lhs does not use
  (tensor parallelism); every other axis it is sharded over (FSDP) is
  gathered, as the quantized payload and scales, before the local GEMM: one
  byte per element for FP8 (payloads travel as ``uint8``, which XLA:CPU
  gathers as is; it widens FP8 collectives to F16).
* A sharded contraction dim is summed with ``psum`` after the local GEMM in
  FP32, or with ``psum_scatter`` where the partitioner wants the result
  sharded over those axes (the FSDP weight gradient: a reduce-scatter).

A dim is kept sharded only if every shard holds whole scale blocks (MX 32,
tiles/blocks 128) and the mesh axes divide it; otherwise it is gathered.
An operand passed through `wire` once and given to two GEMMs (a per-tensor
weight's Fprop and Dgrad) is gathered once for both.
With one device or all axes manual, XLA inlines the GEMM unchanged.

`cast` puts each one-pass cast kernel (`qlayers.cast_transpose`) under a
rule of its own: each device casts its shard, with the global scales or
its own blocks' scales.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule
from jax.experimental.custom_partitioning import CompoundFactor
from jax.sharding import NamedSharding, PartitionSpec as P

from qlayers import formats
from qlayers.scaling import QTensor

__all__ = ["gemm", "wire", "gather", "cast", "LIKE_T", "LIKE_T_T"]


class _Meta(NamedTuple):
  """What a shard of a `QTensor` operand needs besides its arrays (static)."""

  format: str
  granularity: str
  block: tuple[int, ...] | None
  axis: int
  elements: tuple[int, ...]   # padded element shape (the payload's, unpacked)
  transposed: bool
  payload_dtype: str
  scale_shape: tuple[int, ...]
  levels: bool = False  # NVFP4's block_scale and tensor_scale travel too

  def qtensor(self, payload, scale, elements=None, levels=None) -> QTensor:
    """The operand (``elements``: a shard's element shape) as a `QTensor`;
    ``levels``: its (wired block_scale, tensor_scale), used if it has them."""
    payload = _unwire(payload, self.payload_dtype)
    more = {}
    if self.levels:
      more = dict(block_scale=_unwire(levels[0], "float8_e4m3fn"),
                  tensor_scale=levels[1])
    elements = tuple(elements or self.elements)
    block = self.block
    if self.granularity == "row":  # a row's scale spans the shard's row
      block = tuple(e if b == g else b
                    for b, g, e in zip(block, self.elements, elements))
    return QTensor(payload, scale, self.format, self.granularity, block,
                   self.axis, elements, self.transposed, **more)


def _meta(q: QTensor) -> _Meta:
  dtype = jnp.dtype(q.payload.dtype)
  fmt = formats.get_format(q.format)
  if dtype == jnp.uint8 and not fmt.packed:  # a `wire` copy
    dtype = jnp.dtype(fmt.dtype)
  return _Meta(q.format, q.granularity, q.block, q.axis, tuple(q.padded_shape),
               q.transposed, dtype.name, tuple(q.scale.shape),
               q.tensor_scale is not None)


def _levels(q: QTensor):
  """``q``'s NVFP4 (wired block_scale, tensor_scale), or two scalar zeros."""
  if q.tensor_scale is None:
    return jnp.zeros((), jnp.uint8), jnp.zeros((), jnp.float32)
  return _wire(q.block_scale), q.tensor_scale


def wire(q: QTensor) -> QTensor:
  """``q`` with its payload as the bytes `gemm` sends (uint8), for `gemm`
  only. Two GEMMs given one wired operand (Fprop's weight and the copy saved
  for Dgrad) take the same value, which the SPMD partitioner gathers once;
  each `gemm` call wiring the payload itself gathers it once per GEMM.

  Example:
    >>> import jax.numpy as jnp
    >>> from qlayers import scaling
    >>> q = scaling.quantize(jnp.ones((4, 8)), scaling.QuantSpec(), 0)
    >>> wire(q).payload.dtype, _meta(wire(q)).payload_dtype
    (dtype('uint8'), 'float8_e4m3fn')
  """
  return dataclasses.replace(q, payload=_wire(q.payload))


def _wire(payload):
  """FP8 payloads travel as their bytes (uint8): XLA:CPU widens FP8
  collectives to F16, and a gather of codes is exact on every platform."""
  if jnp.dtype(payload.dtype).itemsize == 1 and payload.dtype != jnp.uint8:
    return lax.bitcast_convert_type(payload, jnp.uint8)
  return payload


def _unwire(payload, dtype: str):
  dtype = jnp.dtype(dtype)
  if payload.dtype != dtype:
    return lax.bitcast_convert_type(payload, dtype)
  return payload


def gather(q: QTensor, axes: tuple[str, ...], dim: int = 0
           ) -> QTensor | None:
  """The whole 2-D tensor from ``q``, its shard inside ``shard_map``: split
  along dim ``dim`` (of the caller's layout) over the manual ``axes`` and
  quantized with the whole tensor's scales (an FSDP weight; see
  `qlayers.sharding.gathered_weights`). Payload (as the bytes `wire` sends:
  one per FP8 element) and scales are all-gathered, as this module's rule
  gathers them under jit. None where a shard's scale units are not its own
  (a row along ``dim``, blocks the shard does not hold whole): gather the
  wide tensor then."""
  pdim = 1 - dim if q.transposed else dim
  if q.block is not None and (q.shape[pdim] % q.block[pdim] or (
      q.granularity == "row" and q.axis == pdim)):
    return None
  def cat(t):
    if t is None or t.ndim == 0:
      return t
    moved = lax.all_gather(_wire(t), axes, axis=pdim, tiled=True)
    return _unwire(moved, t.dtype.name)
  shape = list(q.shape)
  shape[pdim] *= math.prod(lax.axis_size(a) for a in axes)
  return dataclasses.replace(q, payload=cat(q.payload), scale=cat(q.scale),
                             shape=tuple(shape),
                             block_scale=cat(q.block_scale))


# ----------------------------------------------------------------------------
# Local GEMMs (looked up by name, so the static arguments stay hashable)

_LOCAL: dict[str, Callable] = {}


def register_local(name: str, fn: Callable) -> None:
  """Registers ``fn(a, b, axes, out_dtype)`` as a local GEMM ``name``."""
  _LOCAL[name] = fn


# ----------------------------------------------------------------------------
# The partitioning rule


def _names(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _spec(sharding, mesh, shape) -> list[tuple[str, ...]]:
  """Mesh axes per dim of an array of ``shape`` laid out by ``sharding``.

  The partitioner hands over its own shardings, which may split a mesh axis
  into sub-axes (after a reshape, say) that no `PartitionSpec` names, or
  split a dim unevenly; such an operand counts as unsharded (it is then
  resharded to what the plan needs, which is always correct).
  """
  ndim = len(shape)
  if isinstance(sharding, NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return [_names(e) for e in spec]
  if sharding is None:
    return [()] * ndim
  try:
    local = sharding.shard_shape(shape)
  except ValueError:  # uneven (a dim the axes do not divide): unsharded too
    return [()] * ndim
  counts = [n // max(t, 1) for n, t in zip(shape, local)]
  for dims in _candidates(mesh, counts):
    named = NamedSharding(mesh, P(*map(_entry, dims)))
    if named.is_equivalent_to(sharding, ndim):
      return [tuple(d) for d in dims]
  return [()] * ndim


def _candidates(mesh, counts):
  """Assignments of mesh axes to dims splitting each dim ``counts[d]`` ways."""
  axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
  ndim = len(counts)
  for where in itertools.product(range(ndim + 1), repeat=len(axes)):
    groups = [[a for a, w in zip(axes, where) if w == d] for d in range(ndim)]
    if any(_size(mesh, g) != c for g, c in zip(groups, counts)):
      continue
    yield from itertools.product(*(itertools.permutations(g) for g in groups))


def _size(mesh, axes) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def _fits(meta: _Meta, dim: int, axes, mesh) -> bool:
  """Whether ``meta``'s operand can be split over ``axes`` along ``dim``."""
  n = _size(mesh, axes)
  size = meta.elements[dim]
  if size % n:
    return False
  if meta.granularity in ("tensor", "row"):
    return True  # one scale for the whole tensor, or for a whole row
  return (size // n) % meta.block[dim] == 0


def _prefix_fitting(meta, dim, axes, mesh, exclude=()) -> tuple[str, ...]:
  """The longest prefix of ``axes`` (skipping none) ``meta`` can split over."""
  out = []
  for a in axes:
    if a in exclude:
      break
    if not _fits(meta, dim, (*out, a), mesh):
      break
    out.append(a)
  return tuple(out)


def _entry(axes):
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _operand_specs(meta: _Meta, contraction, free):
  """Payload and scale specs of an operand with these mesh axes."""
  dims = [()] * 2
  dims[meta.axis] = contraction
  dims[1 - meta.axis] = free
  payload = P(*map(_entry, dims))
  if not meta.scale_shape:
    return payload, P()
  scale = P(*(_entry(d) if n > 1 else None
              for d, n in zip(dims, meta.scale_shape)))
  return payload, scale


class _Plan(NamedTuple):
  k: tuple[str, ...]        # contraction axes (summed after the local GEMM)
  m: tuple[str, ...]        # lhs free dim axes
  n: tuple[str, ...]        # rhs free dim axes
  scatter: tuple[tuple[str, ...], tuple[str, ...]]  # psum_scatter per out dim


def _plan(ma: _Meta, mb: _Meta, mesh, arg_shapes, result_shape) -> _Plan:
  sa = _spec(arg_shapes[0].sharding, mesh, arg_shapes[0].shape)
  sb = _spec(arg_shapes[2].sharding, mesh, arg_shapes[2].shape)
  out_shape = tuple(result_shape.shape)
  k = tuple(sa[ma.axis])
  while k and not (_fits(ma, ma.axis, k, mesh) and _fits(mb, mb.axis, k, mesh)):
    k = k[:-1]
  m = _prefix_fitting(ma, 1 - ma.axis, sa[1 - ma.axis], mesh, exclude=k)
  n = _prefix_fitting(mb, 1 - mb.axis, sb[1 - mb.axis], mesh,
                      exclude=k + m)
  # Axes of k the partitioner wants the result split over: reduce-scatter.
  want = _spec(result_shape.sharding, mesh, out_shape)
  scatter, left = [], set(k)
  for dim, have in ((0, m), (1, n)):
    extra = ()
    if tuple(want[dim][:len(have)]) == have:
      for a in want[dim][len(have):]:
        if a not in left or out_shape[dim] % _size(mesh, (*have, *extra, a)):
          break
        extra += (a,)
        left.discard(a)
    scatter.append(extra)
  return _Plan(k, m, n, tuple(scatter))


_NO_MESH = jax.sharding.AbstractMesh((), ())


def _partition(ma, mb, axes, out_dtype, local, mesh, arg_shapes,
               result_shape):
  plan = _plan(ma, mb, mesh, arg_shapes, result_shape)
  pa, sa = _operand_specs(ma, plan.k, plan.m)
  pb, sb = _operand_specs(mb, plan.k, plan.n)
  levels = lambda meta, s: (s if meta.levels else P(), P())  # noqa: E731
  arg_shardings = tuple(NamedSharding(mesh, s) for s in (
      pa, sa, pb, sb, *levels(ma, sa), *levels(mb, sb)))
  out_spec = P(_entry(plan.m + plan.scatter[0]),
               _entry(plan.n + plan.scatter[1]))
  summed = tuple(a for a in plan.k if a not in plan.scatter[0] + plan.scatter[1])
  local_fn = _LOCAL[local]

  def shard_elements(meta, contraction, free):
    dims = [0, 0]
    dims[meta.axis] = meta.elements[meta.axis] // _size(mesh, contraction)
    dims[1 - meta.axis] = meta.elements[1 - meta.axis] // _size(mesh, free)
    return tuple(dims)

  ea = shard_elements(ma, plan.k, plan.m)
  eb = shard_elements(mb, plan.k, plan.n)

  def lower(a_payload, a_scale, b_payload, b_scale, *levels):
    # Traced when XLA compiles, maybe under the caller's `jax.set_mesh`
    # (jax >= 0.11 keeps it); the shards are local, so no mesh.
    with jax.sharding.use_abstract_mesh(_NO_MESH):
      return local_gemm(a_payload, a_scale, b_payload, b_scale, *levels)

  def local_gemm(a_payload, a_scale, b_payload, b_scale, *levels):
    qa = ma.qtensor(a_payload, a_scale, ea, levels[:2])
    qb = mb.qtensor(b_payload, b_scale, eb, levels[2:])
    if not plan.k:
      return local_fn(qa, qb, axes, jnp.dtype(out_dtype))
    out = local_fn(qa, qb, axes, jnp.dtype(jnp.float32))
    for dim, names in enumerate(plan.scatter):
      if names:
        out = lax.psum_scatter(out, names, scatter_dimension=dim, tiled=True)
    if summed:
      out = lax.psum(out, summed)
    return out.astype(out_dtype)

  return mesh, lower, NamedSharding(mesh, out_spec), arg_shardings


def _sharding_rule(ma, mb, axes, out_dtype, local, mesh, value_types,
                   result_types):
  del axes, out_dtype, local, mesh, result_types
  a_shape, _, b_shape, _ = (tuple(t.shape) for t in value_types[:4])
  kb = "k" if a_shape[ma.axis] == b_shape[mb.axis] else "kb"

  def factors(meta, contraction, free):
    dims = [None, None]
    dims[meta.axis], dims[1 - meta.axis] = contraction, free
    return dims

  def scale(meta, shape, names, prefix):
    # A scale dim as long as its payload dim (no blocks along it) shares
    # the payload's factor; a dim of blocks has its own.
    return ArrayMapping(*(
        names[i] if n == shape[i] else f"{prefix}{i}"
        for i, n in enumerate(meta.scale_shape)))

  fa, fb = factors(ma, "k", "m"), factors(mb, kb, "n")
  sa, sb = scale(ma, a_shape, fa, "sa"), scale(mb, b_shape, fb, "sb")
  # NVFP4's E4M3 block scales lie like its scales; scalars otherwise.
  levels = lambda meta, s: (s if meta.levels else ArrayMapping(),  # noqa: E731
                            ArrayMapping())
  return SdyShardingRule(
      operand_mappings=(ArrayMapping(*fa), sa, ArrayMapping(*fb), sb,
                        *levels(ma, sa), *levels(mb, sb)),
      result_mappings=(ArrayMapping("m", "n"),),
      reduction_factors=("k",) if kb == "k" else ("k", "kb"))


def _local_gemm(ma, mb, axes, out_dtype, local, a_payload, a_scale,
                b_payload, b_scale, a_block, a_tensor, b_block, b_tensor):
  qa = ma.qtensor(a_payload, a_scale, levels=(a_block, a_tensor))
  qb = mb.qtensor(b_payload, b_scale, levels=(b_block, b_tensor))
  return _LOCAL[local](qa, qb, axes, jnp.dtype(out_dtype))


_gemm = custom_partitioning(_local_gemm, static_argnums=(0, 1, 2, 3, 4))
_gemm.def_partition(partition=_partition, sharding_rule=_sharding_rule,
                    decode_shardings=False)


def gemm(a: QTensor, b: QTensor, axes: tuple[int, int], out_dtype,
         local: str) -> jax.Array:
  """``local``'s GEMM of ``a`` and ``b`` (2-D, contracted over ``axes``)
  under a partitioning rule (see the module docstring).

  ``local`` names a GEMM registered with `register_local`; it is called on
  each device's shards, as `QTensor` of their local shapes (padded shapes:
  the result is cropped here).
  """
  # Mapped by jax.vmap, each GEMM of the batch is the local one: a
  # partitioning rule has no batching rule (as `cast`).
  static = (_meta(a), _meta(b), tuple(axes), jnp.dtype(out_dtype).name,
            local)
  run = custom_vmap(lambda *x: _gemm(*static, *x))

  @run.def_vmap
  def _mapped(axis_size, in_batched, *x):
    del axis_size
    out = jax.vmap(lambda *x: _local_gemm(*static, *x),
                   in_axes=[0 if b else None for b in in_batched])(*x)
    return out, True

  out = run(_wire(a.payload), a.scale, _wire(b.payload), b.scale,
            *_levels(a), *_levels(b))
  rows, cols = a.shape[1 - a.axis], b.shape[1 - b.axis]
  if out.shape != (rows, cols):
    out = out[:rows, :cols]
  return out


# --------------------------------------------------------------------------
# One-pass cast kernels under a partitioning rule
#
# A result's layout: per dim, ``(source, divisor)``: the dim is t's rows
# ("r") or columns ("c") divided by ``divisor`` (a packed payload, a scale
# grid), or twice them (``("2c", 1)``: each element of t two in turn there,
# packed E2M1 codes unpacked); ``()`` is a replicated scalar. `LIKE_T`,
# `LIKE_T_T` name t's own shape and its transpose's.

LIKE_T = (("r", 1), ("c", 1))
LIKE_T_T = (("c", 1), ("r", 1))


def _cast_rule(build, params, layouts, in_layouts, block, tile, origin,
               reduced, mesh, value_types, result_types):
  del build, params, block, tile, origin, reduced, mesh, result_types
  shape = dict(zip("rc", value_types[-1].shape))
  # Each dim of t is its shards times pieces, one per divisor a result
  # divides it by (largest first), so a divided dim's sharding follows t's.
  # A dim divided down to 1 is never split: a factor of its own.
  divisors = {src: sorted({d for layout in (*layouts, *in_layouts)
                           for s, d in layout
                           if s == src and d < shape[src]} | {1},
                          reverse=True)
              for src in "rc"}
  sizes, dims = {}, {(s, shape[s]): f"{s}_one" for s in "rc"}
  for src, ds in divisors.items():
    base = f"{src}0"  # alone, the dim divided by the largest divisor
    pieces = []
    for k, (outer, inner) in enumerate(zip(ds, ds[1:])):
      pieces.append(f"{src}{k + 1}")
      sizes[pieces[-1]] = outer // inner
    dims.update({(src, d): CompoundFactor(base, *pieces[:k]) if k else base
                 for k, d in enumerate(ds)})
    if any(s == f"2{src}" for layout in layouts for s, _ in layout):
      # Twice the dim: its own factors, then one of 2 that is never split.
      sizes[f"{src}_pairs"] = 2
      dims[f"2{src}", 1] = CompoundFactor(base, *pieces, f"{src}_pairs")
  scalars = iter(range(len(layouts) + len(value_types)))

  def mapping(layout):
    return (ArrayMapping(*(dims[d] for d in layout)) if layout
            else ArrayMapping(f"s{next(scalars)}"))

  inputs = in_layouts or ((),) * (len(value_types) - 1)
  return SdyShardingRule(
      operand_mappings=(*map(mapping, inputs),
                        ArrayMapping(dims["r", 1], dims["c", 1])),
      result_mappings=tuple(map(mapping, layouts)), **sizes)


def _cast_partition(build, params, layouts, in_layouts, block, tile, origin,
                    reduced, mesh, arg_shapes, result_shape):
  del result_shape
  t = arg_shapes[-1]
  axes = _spec(t.sharding, mesh, t.shape)
  # A dim stays split only where its shards hold whole blocks.
  axes = [_whole_blocks(mesh, a, n, b) for a, n, b in zip(axes, t.shape,
                                                          block)]
  by_src = dict(zip("rc", axes))
  whole = dict(zip("rc", t.shape))

  def spec(layout):  # a dim divided down to one element is not split
    return P(*(None if d == whole[src[-1]] else _entry(by_src[src[-1]])
               for src, d in layout))

  inputs = in_layouts or ((),) * (len(arg_shapes) - 1)

  def lower(*args):
    # Each device casts its shard: block scales are the shard's own
    # blocks', a per-tensor scale comes from the replicated scalars (the
    # global amax, the delayed state), so every shard gets the same one;
    # with ``origin`` the kernel learns where its shard lies in t (the
    # stochastic-rounding draws are indexed by the element's place in t).
    with jax.sharding.use_abstract_mesh(_NO_MESH):
      if origin:  # in place of the caller's (the whole of t: no offset)
        local = args[-1].shape
        first = [lax.axis_index(a) * n if a else 0 for a, n in
                 zip(axes, local)]
        args = (jnp.stack([jnp.asarray(v, jnp.uint32)
                           for v in (*first, *t.shape)]), *args[1:])
      outs = _padded(build, params, layouts, tile, *args)
      split = tuple(a for dim_axes in axes for a in dim_axes)
      if not (reduced and split):
        return outs
      # A result each shard finds for its own part (an atomic max over its
      # tiles): the whole tensor's, by max over the shards.
      return tuple(lax.pmax(o, split) if k in reduced else o
                   for k, o in enumerate(outs))

  return (mesh, lower,
          tuple(NamedSharding(mesh, spec(layout)) for layout in layouts),
          tuple(NamedSharding(mesh, spec(layout))
                for layout in (*inputs, LIKE_T)))


def _whole_blocks(mesh, axes, n: int, block: int) -> tuple[str, ...]:
  """The longest prefix of ``axes`` whose shards of ``n`` hold whole
  blocks."""
  axes = tuple(axes)
  while axes and (n % _size(mesh, axes) or (n // _size(mesh, axes)) % block):
    axes = axes[:-1]
  return axes


def _padded(build, params, layouts, tile, *args):
  """The kernel of a shard, padded with zeros to whole tiles and cropped
  after (zeros cast to zeros under a per-tensor scale; a block-scaled
  shard holds whole blocks, so ``tile`` is 1 there)."""
  *scalars, t = args
  rows, cols = t.shape
  pad = (-rows % tile, -cols % tile)
  if any(pad):
    t = jnp.pad(t, ((0, pad[0]), (0, pad[1])))
  outs = build(t.shape, *params)(*scalars, t)
  if not any(pad):
    return outs
  size = {"r": rows, "c": cols}
  return tuple(o[tuple(slice(size[s] // d) for s, d in layout)] if layout
               else o for o, layout in zip(outs, layouts))


@functools.partial(custom_partitioning,
                   static_argnums=(0, 1, 2, 3, 4, 5, 6, 7))
def _cast(build, params, layouts, in_layouts, block, tile, origin, reduced,
          *args):
  del in_layouts, origin, reduced  # the origin: the first of args
  return build(args[-1].shape, *params)(*args)


_cast.def_partition(partition=_cast_partition, sharding_rule=_cast_rule,
                    decode_shardings=False)


def cast(build: Callable, params: tuple, *args, layouts, in_layouts=(),
         block=(1, 1), tile: int = 1, origin: bool = False,
         reduced: tuple[int, ...] = ()):
  """``build(t.shape, *params)(*args)``, a one-pass cast kernel of ``t``
  (the last of ``args``; the others replicated scalars) whose results lie
  as ``layouts`` say (`LIKE_T`, `LIKE_T_T`, other per-dim ``(source,
  divisor)``, or ``()`` for a replicated scalar), under a partitioning
  rule: each device casts its shard of ``t``, and each result is sharded
  along the dims of ``t`` it comes from. ``in_layouts``: the same for the
  other arguments (default: all replicated; a dim divided down to one
  element, ``(source, its length)``, is not split).

  ``block``: per dim of ``t``, the length its shards must be a multiple of
  (the format's blocks, the kernel's tiles; elsewhere that dim is gathered
  first). ``tile``: without blocks, a shard that splits a ``tile`` of the
  kernel is padded with zeros and cropped. ``origin``: the kernel takes
  first a ``uint32 (4,)`` of its shard's first row and column in ``t`` and
  ``t``'s shape (zeros and its own shape on one device). ``reduced``: the
  indices of replicated scalar results that each device finds for its
  shard alone (a maximum); the rule combines them by ``pmax``.

  So a program sharded only through ``jax.jit``'s shardings, which qlayers
  does not see while tracing, does not gather ``t`` whole for the kernel.
  With one device XLA inlines the kernel unchanged. Under ``jax.vmap``
  (the experts' GEMMs, batched einsums) the kernel is mapped as it is: a
  partitioning rule has no batching rule, and the cast may be cached by a
  ``jax.jit`` traced unbatched first, so this is the call's own vmap rule
  (``jax.custom_batching.custom_vmap``), not a flag read while tracing."""
  if tile > 1 and any(d != 1 or len(s) > 1 for layout in layouts
                      for s, d in layout):
    raise ValueError("partition.cast pads shards to tiles only for results "
                     f"shaped as t or t.T; got layouts {layouts}.")
  if origin:
    args = (jnp.asarray([0, 0, *args[-1].shape], jnp.uint32), *args)
  static = (build, tuple(params), tuple(map(tuple, layouts)),
            tuple(map(tuple, in_layouts)), tuple(block), tile, origin,
            tuple(reduced))
  run = custom_vmap(lambda *a: _cast(*static, *a))

  @run.def_vmap
  def _mapped(axis_size, in_batched, *a):
    del axis_size
    outs = jax.vmap(lambda *a: build(a[-1].shape, *params)(*a),
                    in_axes=[0 if b else None for b in in_batched])(*a)
    return outs, jax.tree.map(lambda _: True, outs)

  return run(*args)
