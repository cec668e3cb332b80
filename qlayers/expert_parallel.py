"""Expert parallelism on JAX's SPMD engine: token dispatch and combine.

An MoE layer sends each token to its top-k experts. `dispatch` sorts the
token copies by expert, so the experts run as grouped GEMMs
(``lax.ragged_dot`` with ``group_sizes``, or ``qlayers.ops.ragged_dot``);
`combine` brings their outputs back to the tokens, weighted by the gates.

Without ``axis_name`` both run on one device. Inside ``jax.shard_map`` with
``axis_name`` (the mesh axis the experts are sharded over, MaxText's
``expert`` axis), each device holds the tokens of its batch shard and the
experts ``[i * g_local, (i + 1) * g_local)``: `dispatch` sends every token
copy to the device of its expert with one ``lax.all_to_all`` of a
``[devices, capacity, d]`` buffer (the counts per expert go in a second,
tiny one), sorts what it receives by local expert, and `combine` reverses
the trip. Rows of a device's chunk past ``capacity`` are dropped (their
output is zero); the default capacity (every copy of the local batch) drops
nothing, so the result equals the single-device one.

``transport`` (a recipe) quantizes the rows that go to the experts, the
GEMM inputs: the tokens in the forward dispatch (Fprop ``x`` spec) and the
output gradients in the backward of the combine (Dgrad ``g`` spec).
Payload (1 byte per element for FP8/MXFP8) and scales travel in the
all_to_all and are dequantized on arrival, where the expert GEMM quantizes
them again: with a row, tile or MX spec with power-of-two scales that gives
back the same payload; a per-tensor recipe's rows travel per row (a row's
scale needs no other device) and are quantized per tensor again by the
GEMM. What comes back from the experts (outputs, input gradients) is no
GEMM input and travels wide, as the numerics contract keeps everything but
GEMM operands. Quantization in transit is straight-through for gradients.

`run` wraps the whole layer: ``shard_map`` over ``axis``, the experts'
parameters sharded over their leading (expert) dim. With ``fsdp`` (a
second mesh axis, the batch split over both) each expert's kernel is also
split over ``fsdp`` along K: qlayers' quantized GEMMs in the experts
quantize the local shard with the whole kernel's per-expert scale,
all-gather payload + scales over ``fsdp`` (1 byte per FP8 element) and
reduce-scatter the weight gradient back (`qlayers.sharding.
gathered_weights`).

Example (8 CPU devices: ``--xla_force_host_platform_device_count=8``)::

  import jax, jax.numpy as jnp
  from jax.sharding import AxisType, PartitionSpec as P
  from qlayers import expert_parallel as ep

  mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))
  x = jnp.ones((64, 32), jnp.bfloat16)                # tokens
  ids = jnp.arange(128, dtype=jnp.int32).reshape(64, 2) % 8
  gates = jnp.full((64, 2), 0.5)
  w = jnp.ones((8, 32, 16), jnp.bfloat16)             # 8 experts

  def experts(w, xs, group_sizes):
    return jax.lax.ragged_dot(xs, w, group_sizes)

  y = ep.run(experts, w, x, ids, gates, mesh=mesh, n_experts=8,
             transport="mxfp8")                       # f32 [64, 16]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from qlayers import scaling
from qlayers import sharding
from qlayers.recipe import Recipe, recipe as load_recipe
from qlayers.scaling import QuantSpec

__all__ = ["Route", "transport_spec", "dispatch", "combine", "run",
           "gather_weights"]

# Granularities whose units lie along one token row (sendable as they are).
_ROW_UNITS = ("row", "tile", "mx")


class Route(NamedTuple):
  """Where `dispatch` put each token copy, for `combine` (a pytree).

  ``order``: the flat ``(token, k)`` index of each sorted copy ``[n * k]``;
  ``dest``/``slot``: its device and row in the send buffer; ``recv_order``:
  the received rows sorted by local expert ``[devices * capacity]``
  (``dest``, ``slot`` and ``recv_order`` are None on one device, where
  ``routed`` says which sorted copies went to an expert).
  """

  order: jax.Array
  dest: jax.Array | None = None
  slot: jax.Array | None = None
  recv_order: jax.Array | None = None
  routed: jax.Array | None = None


def transport_spec(spec: QuantSpec | Recipe | str | None,
                   role: str = "x") -> QuantSpec | None:
  """The spec a buffer of token rows travels in, from a recipe or a spec.

  A recipe gives the spec of the GEMM operand the rows become: for
  ``role="x"`` (tokens sent to the experts) its Fprop ``x``, for ``"g"``
  (output gradients sent to the experts) its Dgrad ``g``. Row,
  tile and MX units are kept; a per-tensor spec becomes per row (one row's
  scale needs no other device); None (a wide recipe, or a granularity
  whose units span tokens) sends the buffer as it is. Stochastic rounding
  is turned off (the payload is a copy in transit).

  Example:
    >>> transport_spec("fp8_current").granularity
    'row'
    >>> transport_spec("mxfp8").block_size, transport_spec("bf16")
    (32, None)
    >>> transport_spec("fp8_current", "g").format
    'e5m2'
  """
  if spec is None:
    return None
  if not isinstance(spec, QuantSpec):
    r = load_recipe(spec)
    if role not in ("x", "g"):
      raise ValueError(f"role must be 'x' or 'g', got {role!r}.")
    spec = r.fprop.lhs if role == "x" else r.dgrad.lhs
    if spec is None:
      return None
  if spec.granularity == "tensor":
    return QuantSpec(format=spec.format, granularity="row")
  if spec.granularity not in _ROW_UNITS:
    return None
  return dataclasses.replace(spec, rounding="nearest")


def _a2a(x, axis_name):
  """``all_to_all`` over dim 0 of ``x``'s bits: floats under 32 bits travel
  as unsigned integers of their width (XLA:CPU would widen BF16 and FP8 to
  F32/F16 in the collective; a GPU sends them as they are)."""
  if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4:
    bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
    moved = lax.all_to_all(lax.bitcast_convert_type(x, bits), axis_name, 0, 0)
    return lax.bitcast_convert_type(moved, x.dtype)
  return lax.all_to_all(x, axis_name, 0, 0)


def _send(buf, axis_name, spec):
  if spec is None:
    return _a2a(buf, axis_name)
  q = scaling.quantize(buf, spec, axis=-1)
  moved = dataclasses.replace(q, payload=_a2a(q.payload, axis_name),
                              scale=_a2a(q.scale, axis_name))
  return moved.dequantize(buf.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _exchange(buf, axis_name, spec, ct_spec):
  """``all_to_all`` of ``buf [devices, capacity, d]`` over ``axis_name``
  (an exchange that is its own inverse), as payload + scales when ``spec``
  is set; its cotangent travels back the same way under ``ct_spec``."""
  return _send(buf, axis_name, spec)


def _exchange_fwd(buf, axis_name, spec, ct_spec):
  return _send(buf, axis_name, spec), None


def _exchange_bwd(axis_name, spec, ct_spec, _, ct):
  del spec  # straight-through: the quantization in transit has no gradient
  return (_send(ct, axis_name, ct_spec),)


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def _inverse(perm):
  return jnp.zeros_like(perm).at[perm].set(
      jnp.arange(perm.shape[0], dtype=perm.dtype))


def dispatch(x: jax.Array, expert_ids: jax.Array, *, n_experts: int,
             axis_name: str | None = None, capacity: int | None = None,
             transport: QuantSpec | Recipe | str | None = None):
  """Token copies sorted by expert, on the devices holding the experts.

  Args:
    x: tokens ``[n, d]`` (the local batch shard inside ``shard_map``).
    expert_ids: int ``[n, k]``, each token's experts in ``[0, n_experts)``;
      a copy sent elsewhere (``-1``, a common "no expert" mark) is dropped:
      sorted past the groups, it comes back from `combine` as 0, as a copy
      past the capacity does.
    n_experts: experts in all (``g``); must divide by the axis size.
    axis_name: the manual mesh axis the experts are sharded over; None:
      one device, no communication.
    capacity: rows each device may send to each other device, itself
      included (one device: to itself; default ``n * k``: nothing
      dropped); copies past it, in expert order, are dropped.
    transport: a `QuantSpec`, recipe or recipe name the buffer travels in
      (see `transport_spec`); None: ``x``'s dtype.

  Returns:
    ``(xs, group_sizes, route)``: ``xs [m, d]`` the copies sorted by
    (local) expert, ``group_sizes`` int32 ``[g_local]`` (rows of ``xs``
    past their sum are padding, zero), ``route`` for `combine`. On one
    device ``m = n * k`` and ``g_local = g``; with ``D`` devices ``m = D *
    capacity`` and ``g_local = g / D``.

  Example:
    >>> import jax.numpy as jnp
    >>> xs, sizes, route = dispatch(jnp.ones((4, 8)),
    ...     jnp.array([[0, 1], [1, 2], [2, 3], [3, 0]]), n_experts=4)
    >>> xs.shape, sizes.tolist()
    ((8, 8), [2, 2, 2, 2])
  """
  if x.ndim != 2 or expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
    raise ValueError(f"dispatch expects x [n, d] and expert_ids [n, k]; got "
                     f"{x.shape} and {expert_ids.shape}.")
  n, d = x.shape
  k = expert_ids.shape[1]
  flat = expert_ids.reshape(-1).astype(jnp.int32)
  # Out-of-range ids as ``n_experts``: sorted last, counted in no group.
  flat = jnp.where((flat >= 0) & (flat < n_experts), flat, n_experts)
  order = jnp.argsort(flat, stable=True)
  xs = x[order // k]
  counts = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
  cap = n * k if capacity is None else int(capacity)
  if cap < 1:
    raise ValueError(f"capacity must be >= 1, got {capacity}.")
  if axis_name is None:
    # One device sends to itself: as on a mesh, the copies past
    # ``capacity`` (in expert order) are dropped, and so are dropped ids.
    ends = jnp.minimum(jnp.cumsum(counts), cap)
    counts = jnp.diff(ends, prepend=0).astype(jnp.int32)
    routed = jnp.arange(n * k) < ends[-1]
    return (jnp.where(routed[:, None], xs, 0), counts,
            Route(order, routed=routed))

  devices = lax.axis_size(axis_name)
  if n_experts % devices:
    raise ValueError(f"n_experts={n_experts} experts do not split over the "
                     f"{devices} devices of mesh axis {axis_name!r}.")
  local = n_experts // devices
  dest = flat[order] // local
  per_dest = counts.reshape(devices, local)
  ends = jnp.cumsum(per_dest.sum(1))
  slot = jnp.arange(n * k, dtype=jnp.int32) - (ends - per_dest.sum(1))[dest]
  buf = jnp.zeros((devices, cap, d), x.dtype).at[dest, slot].set(
      xs, mode="drop")
  # Copies past the capacity are dropped: count only those sent, per expert.
  cum = jnp.cumsum(per_dest, axis=1)
  sent = jnp.minimum(cum, cap) - jnp.minimum(cum - per_dest, cap)
  recv = _exchange(buf, axis_name, transport_spec(transport), None)
  recv_counts = _a2a(sent, axis_name)  # [source, local]
  # Row c of source s's chunk belongs to the first local expert whose
  # running count exceeds c (``local``: padding, sorted last).
  bounds = jnp.cumsum(recv_counts, axis=1)
  row = jnp.arange(cap, dtype=jnp.int32)
  expert = jnp.sum(row[None, :, None] >= bounds[:, None, :], axis=-1)
  recv_order = jnp.argsort(expert.reshape(-1), stable=True)
  xs = recv.reshape(devices * cap, d)[recv_order]
  return xs, recv_counts.sum(0), Route(order, dest, slot, recv_order)


def combine(ys: jax.Array, route: Route, gates: jax.Array, *,
            axis_name: str | None = None, transport=None) -> jax.Array:
  """The expert outputs ``ys [m, d_out]`` (rows as `dispatch` returned
  them) summed per token with ``gates [n, k]``: float32 ``[n, d_out]``.

  ``axis_name`` must be the one `dispatch` was given. The outputs travel
  back wide; with a recipe (name) as ``transport``, their cotangents (the
  output gradient of the experts' last GEMM) travel to the experts in its
  Dgrad ``g`` spec (see `transport_spec`).

  Example:
    >>> import jax.numpy as jnp
    >>> ids = jnp.array([[0, 1], [1, 0]])
    >>> xs, sizes, route = dispatch(jnp.eye(2), ids, n_experts=2)
    >>> combine(xs, route, jnp.full((2, 2), 0.5)).tolist()
    [[1.0, 0.0], [0.0, 1.0]]
  """
  if gates.ndim != 2 or gates.size != route.order.shape[0]:
    raise ValueError(f"combine: gates {gates.shape} do not match the "
                     f"{route.order.shape[0]} token copies dispatch sent "
                     "(gates must be [n, k] as its expert_ids).")
  n, k = gates.shape
  if (route.dest is None) != (axis_name is None):
    raise ValueError("combine needs the axis_name dispatch was given.")
  if axis_name is not None:
    devices = lax.axis_size(axis_name)
    cap = ys.shape[0] // devices
    back = ys[_inverse(route.recv_order)].reshape(devices, cap, -1)
    back = _exchange(back, axis_name, None,
                     transport_spec(transport, "g")
                     if not isinstance(transport, QuantSpec) else None)
    kept = (route.slot < cap) & (route.dest < devices)
    ys = jnp.where(kept[:, None],
                   back[route.dest, jnp.minimum(route.slot, cap - 1)], 0)
  if route.routed is not None:  # one device: dropped copies give 0
    ys = jnp.where(route.routed[:, None], ys, 0)
  out = ys[_inverse(route.order)].reshape(n, k, -1).astype(jnp.float32)
  return jnp.einsum("nkd,nk->nd", out, gates.astype(jnp.float32))


@contextlib.contextmanager
def _experts_scope(axis: str, fsdp: tuple[str, ...]):
  with sharding.local_scales(axis), sharding.gathered_weights(*fsdp):
    yield


def _with_local_scales(fn: Callable, axis: str,
                       fsdp: tuple[str, ...] = ()) -> Callable:
  """``fn`` with its forward and backward traced under
  ``sharding.local_scales(axis)`` (a device's experts are its own tensors)
  and ``sharding.gathered_weights(*fsdp)`` (its weights FSDP shards).

  A context is left by the time JAX traces the backward pass, so the
  backward is the vjp the forward made, called back inside the context."""

  @jax.custom_vjp
  def f(*args):
    with _experts_scope(axis, fsdp):
      return fn(*args)

  def f_fwd(*args):
    with _experts_scope(axis, fsdp):
      return jax.vjp(fn, *args)

  def f_bwd(vjp, ct):
    with _experts_scope(axis, fsdp):
      return vjp(ct)

  f.defvjp(f_fwd, f_bwd)
  return f


def gather_weights(w: jax.Array, dim: int = 1) -> jax.Array:
  """``w``, an expert kernel ``[E_local, K, N]`` as `run` with ``fsdp``
  hands it to the experts (its shard along ``dim``, K), gathered whole and
  wide, for a GEMM that is not qlayers' (``lax.ragged_dot``; its gradient
  is reduce-scattered back). Unchanged where ``w`` is no such shard.
  qlayers' quantized GEMMs take the shard itself and gather it quantized.

  Example:
    >>> gather_weights(jnp.ones((2, 8, 4))).shape  # outside run: unchanged
    (2, 8, 4)
  """
  axes, _ = sharding.weight_shards(w, dim)
  return lax.all_gather(w, axes, axis=dim, tiled=True) if axes else w


def _axis_size(mesh, axis) -> int:
  if mesh is None or mesh.empty or axis is None:
    return 1
  return dict(zip(mesh.axis_names, mesh.axis_sizes)).get(axis, 1)


def _check_fsdp_specs(param_specs, fsdp: tuple[str, ...]) -> None:
  """Only K (dim 1 of a kernel ``[E, K, N]``) may be split over ``fsdp``:
  the GEMMs gather their weight shards along K."""
  leaves = jax.tree_util.tree_leaves_with_path(
      param_specs, is_leaf=lambda s: isinstance(s, P))
  for path, spec in leaves:
    for dim, entry in enumerate(spec):
      names = entry if isinstance(entry, tuple) else (entry,)
      if dim != 1 and set(names) & set(fsdp):
        raise ValueError(
            f"param_specs{jax.tree_util.keystr(path)} = {spec} splits dim "
            f"{dim} over {fsdp[0]!r}; expert kernels [E, K, N] are FSDP "
            "shards along K (dim 1) only.")


def run(fn: Callable, params, x: jax.Array, expert_ids: jax.Array,
        gates: jax.Array, *, n_experts: int, mesh=None, axis: str = "expert",
        capacity: int | None = None, transport=None, param_specs=None,
        updates: bool = False, fsdp: str | None = None):
  """An MoE layer's experts, expert-parallel over ``mesh``'s ``axis``.

  ``fn(params, xs, group_sizes) -> ys`` runs the local experts on their
  sorted rows (e.g. two ``ragged_dot`` with an activation between).
  Tokens ``x [n, d]``, ``expert_ids``/``gates [n, k]`` are split over
  ``axis`` (``n`` must divide by its size), ``params`` over their leading
  (expert) dim unless ``param_specs`` (a pytree of ``PartitionSpec``) says
  otherwise (on a mesh of explicit axes, inputs laid out otherwise are
  resharded to these specs first); other mesh axes stay automatic inside.
  Without a mesh (or with one device on ``axis``) it is `dispatch`, ``fn``,
  `combine` on one device. The experts' amaxes are their own device's
  (`qlayers.sharding.local_scales`): per-expert scales, as on one device.

  ``fsdp`` names a second mesh axis (FSDP of the experts): the tokens are
  split over ``(fsdp, axis)``, and every rank-3 parameter (a stacked
  kernel ``[E, K, N]``) over ``axis`` on E and ``fsdp`` on K unless
  ``param_specs`` says otherwise (only K may name ``fsdp``). ``fn`` gets
  those shards ``[E/D, K/F, N]``: qlayers' quantized GEMMs in it
  (``QuantRaggedDot``, ``ops.ragged_dot(recipe)``) quantize a shard with
  its expert's whole-kernel scale, all-gather payload + scales over
  ``fsdp`` before the GEMMs and reduce-scatter the weight gradient back;
  other GEMMs need `gather_weights` (wide). Each ``fsdp`` row of devices
  exchanges its tokens over ``axis`` alone.

  With ``updates=True``, ``fn`` returns ``(ys, params')``: the parameters
  after the call (an NNX module's state whose delayed-scaling amaxes the
  call updated), sharded as ``params``.

  Returns:
    float32 ``[n, d_out]``, the gate-weighted sum of each token's experts
    (and ``params'`` with ``updates=True``).

  Example: see the module docstring.
  """
  mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
  size = _axis_size(mesh, axis)
  fsdp = (fsdp,) if _axis_size(mesh, fsdp) > 1 and size > 1 else ()
  if size == 1:
    xs, sizes, route = dispatch(x, expert_ids, n_experts=n_experts,
                                capacity=capacity)
    out = fn(params, xs, sizes)
    ys, new_params = out if updates else (out, None)
    y = combine(ys, route, gates)
    return (y, new_params) if updates else y
  devices = size * _axis_size(mesh, fsdp[0] if fsdp else None)
  if x.shape[0] % devices:
    raise ValueError(f"{x.shape[0]} tokens do not split over the {devices} "
                     f"devices of mesh axes {(*fsdp, axis)}.")

  def body(params, x, expert_ids, gates):
    xs, sizes, route = dispatch(x, expert_ids, n_experts=n_experts,
                                axis_name=axis, capacity=capacity,
                                transport=transport)
    out = _with_local_scales(fn, axis, fsdp)(params, xs, sizes)
    ys, new_params = out if updates else (out, None)
    y = combine(ys, route, gates, axis_name=axis, transport=transport)
    return (y, new_params) if updates else y

  if param_specs is None:
    param_specs = jax.tree.map(
        lambda a: P(axis, *fsdp) if fsdp and jnp.ndim(a) == 3 else P(axis),
        params)
  _check_fsdp_specs(param_specs, fsdp)
  tokens = P((*fsdp, axis) if fsdp else axis)
  if {axis, *fsdp} <= set(sharding.explicit_axes(mesh)):
    # Explicit axes: inputs laid out otherwise move to the specs shard_map
    # takes (under automatic axes XLA moves them itself); a spec may stand
    # for a subtree of params, as shard_map takes it.
    def placed(spec, tree):
      return jax.tree.map(lambda a: jax.sharding.reshard(
          a, NamedSharding(mesh, spec)), tree)
    params = jax.tree.map(placed, param_specs, params,
                          is_leaf=lambda s: isinstance(s, P))
    x, expert_ids, gates = (placed(tokens, a) for a in (x, expert_ids, gates))
  return jax.shard_map(
      body, mesh=mesh, axis_names={axis, *fsdp},
      in_specs=(param_specs, tokens, tokens, tokens),
      out_specs=(tokens, param_specs) if updates else tokens,
  )(params, x, expert_ids, gates)
