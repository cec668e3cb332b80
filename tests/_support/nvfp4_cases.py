"""Cases of test_nvfp4_sharded.py, run on 8 simulated devices (see
multidevice.py): NVFP4 operands with stochastic rounding keyed by the step
are the same bits on one device and sharded, as is the per-tensor scale."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import qlayers
from qlayers import formats, operands
from qlayers.dispatch import Operand

import multidevice

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

case = multidevice.Cases()


def _bits(q):
  return {"payload": np.asarray(q.payload).tolist(),
          "scale": np.asarray(q.scale).view(np.uint32).tolist()}


@case
def sr_operand_layouts():
  """Wgrad's g (SR, 16-point RHT, 1 x 16 tiles along the tokens) of a
  (256, 64) gradient: single device, rows over 8 devices, 2 x 4 both dims."""
  spec = qlayers.recipe("nvfp4").wgrad.rhs
  op = Operand(spec, 0, True, 16)
  g = jax.random.normal(jax.random.key(0), (256, 64)) * jnp.exp2(
      jnp.arange(256, dtype=jnp.float32)[:, None] % 7)
  key = formats.rounding_key(jnp.uint32(7), jnp.uint32(3))
  make = jax.jit(lambda g, key: operands.operand(g, op, key=key))
  # The older rule: a key derived from the operand's bits (their FP32 sum).
  by_data = jax.jit(lambda g: operands.operand(g, op))
  out = {"single": _bits(make(g, key)), "single_data": _bits(by_data(g))}
  for name, shape, spec_ in (("rows", (8,), P("d")),
                             ("both", (2, 4), P("a", "b"))):
    names = ("d",) if len(shape) == 1 else ("a", "b")
    mesh = jax.make_mesh(shape, names)
    gs = jax.device_put(g, NamedSharding(mesh, spec_))
    out[name] = _bits(make(gs, key))
    out[name + "_data"] = _bits(by_data(gs))
  return out


@case
def shard_map_operand():
  """Inside shard_map (rows over 8 devices) each shard's 1 x 16 tiles are
  scaled under the whole tensor's amax: the shards' operands put together
  are the single-device operand."""
  spec = qlayers.recipe("nvfp4").fprop.lhs
  op = Operand(spec, 1)
  x = jax.random.normal(jax.random.key(1), (64, 64)) * jnp.exp2(
      jnp.arange(64, dtype=jnp.float32)[:, None] % 9)
  whole = jax.jit(lambda x: operands.operand(x, op))(x)
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  parts = jax.jit(jax.shard_map(
      lambda x: (lambda q: (q.payload, q.scale))(operands.operand(x, op)),
      mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P("d"))))(x)
  return {"single": _bits(whole),
          "shard_map": {"payload": np.asarray(parts[0]).tolist(),
                        "scale": np.asarray(parts[1]).view(
                            np.uint32).tolist()}}


@case
def shard_map_step_keys():
  """Inside shard_map every device's part is numbered from place 0: with
  one step key, data-parallel shards of identical rows drew the same bits
  (their rounding errors alike). Each device now folds its index into the
  key; a replicated tensor (a weight) rounds alike on every device."""
  spec = qlayers.recipe("nvfp4").dgrad.lhs  # g, rounded stochastically
  op = Operand(spec, 1)
  rows = jax.random.normal(jax.random.key(2), (8, 64))
  g = jnp.tile(rows, (8, 1))  # 8 identical row blocks, one per device
  key = formats.rounding_key(jnp.uint32(7), jnp.uint32(3))
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  def payload(in_spec):
    return np.asarray(jax.jit(jax.shard_map(
        lambda g: operands.operand(g, op, key=key).payload, mesh=mesh,
        in_specs=in_spec, out_specs=P("d")))(g if in_spec == P("d")
                                               else rows)).reshape(8, -1)
  split, replicated = payload(P("d")), payload(P())
  return {"split_alike": [bool(np.array_equal(split[0], split[i]))
                          for i in range(1, 8)],
          "replicated_alike": [bool(np.array_equal(replicated[0],
                                                   replicated[i]))
                               for i in range(1, 8)]}


if __name__ == "__main__":
  case.main()
