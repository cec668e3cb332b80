"""Running an example over a device mesh: ``--mesh data=2,fsdp=4``.

Mesh axes (any subset, sizes multiplying to the number of devices):

* ``data``: the batch is split over it; weights are replicated.
* ``fsdp``: the batch is split over it too, and every weight matrix (and its
  optimizer moments) along one dim; each GEMM gathers it (qlayers layers
  gather the quantized payload: one byte per element for FP8).
* ``model``: tensor parallelism of the MLPs by layer name (Megatron):
  ``up`` and ``gate`` split their output features, ``down`` its input
  features; XLA adds the all-reduce after ``down``. Attention stays
  replicated over ``model``: the GPT's fused ``qkv`` kernel orders its
  columns (q/k/v, head, dim), so no split of its columns is a split of the
  heads.

The mesh has auto axes and arrays are placed with ``jax.device_put``; the
same flags work on 8 simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) and on a host with
8 GPUs. Quantization state and everything else is replicated.
"""

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "model")
COLUMN = ("up", "gate")
ROW = ("down",)


def parse_mesh(text: str) -> dict[str, int]:
  """``"data=2,fsdp=4"`` -> ``{"data": 2, "fsdp": 4}`` (ValueError if not)."""
  sizes = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    name, sep, value = item.partition("=")
    if not sep or name not in AXES or not value.isdigit() or int(value) < 1:
      raise ValueError(f"mesh axis {item!r} is not AXIS=SIZE with AXIS one "
                       f"of {AXES} and SIZE a positive integer")
    if name in sizes:
      raise ValueError(f"mesh axis {name!r} given twice")
    sizes[name] = int(value)
  if not sizes:
    raise ValueError("empty mesh; give e.g. data=2,fsdp=4")
  return sizes


def make_mesh(text: str) -> jax.sharding.Mesh:
  """The auto-axes mesh of ``--mesh`` over all devices."""
  sizes = parse_mesh(text)
  n = math.prod(sizes.values())
  if n != jax.device_count():
    raise ValueError(
        f"--mesh {text} has {n} devices but JAX sees {jax.device_count()} "
        "(on CPU, simulate more with XLA_FLAGS="
        f"--xla_force_host_platform_device_count={n})")
  return jax.make_mesh(tuple(sizes.values()), tuple(sizes),
                       axis_types=(AxisType.Auto,) * len(sizes))


def batch_axes(mesh) -> tuple[str, ...]:
  return tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)


def check_batch(mesh, batch_size: int) -> None:
  n = math.prod(mesh.shape[a] for a in batch_axes(mesh))
  if batch_size % n:
    raise ValueError(f"batch size {batch_size} does not split over the "
                     f"{n} devices of mesh axes {batch_axes(mesh)}")


def _names(path) -> list[str]:
  """The names along a pytree path, a Variable's ``value`` left out."""
  names = []
  for k in path:
    if isinstance(k, jax.tree_util.GetAttrKey):
      if k.name != "value":
        names.append(k.name)
    else:
      names.append(str(getattr(k, "key", getattr(k, "idx", k))))
  return names


def spec_for(path, shape, mesh) -> P:
  """Where one array goes: matrices by the rules of the module docstring,
  everything else (norms, biases, quantization state, counters) replicated."""
  names = _names(path)
  if len(shape) != 2 or not math.prod(shape):
    return P()
  layer = names[-2] if len(names) >= 2 else ""
  dims = [None, None]
  if "model" in mesh.axis_names:
    d = 1 if layer in COLUMN else 0 if layer in ROW else None
    if d is not None and shape[d] % mesh.shape["model"] == 0:
      dims[d] = "model"
  if "fsdp" in mesh.axis_names:
    for d in (0, 1):
      if dims[d] is None and shape[d] % mesh.shape["fsdp"] == 0:
        dims[d] = "fsdp"
        break
  return P(*dims)


def shard(tree, mesh):
  """``tree`` (an nnx state) placed on ``mesh`` by `spec_for`."""
  return jax.tree_util.tree_map_with_path(
      lambda p, v: jax.device_put(
          v, NamedSharding(mesh, spec_for(p, np.shape(v), mesh))), tree)


def shard_model(mesh, *nodes) -> None:
  """Places the state of ``nodes`` (model, optimizer) on ``mesh``."""
  nnx.update(nodes, shard(nnx.state(nodes), mesh))


def put_batch(mesh, *arrays):
  """Batch arrays split along their first dim over the batch axes."""
  sharding = NamedSharding(mesh, P(batch_axes(mesh)))
  out = tuple(jax.device_put(a, sharding) for a in arrays)
  return out if len(out) > 1 else out[0]
