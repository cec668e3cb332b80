"""Cases for tests/test_expert_parallel.py, run on 8 simulated CPU devices
(see multidevice.py): expert-parallel dispatch/combine against one device,
and the all_to_all bytes of the compiled programs."""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P

from qlayers import expert_parallel as ep
from qlayers import scaling
from qlayers import sharding
import multidevice

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

sys.path.insert(0, str(multidevice.ROOT / "benchmarks"))
sys.path.insert(0, str(multidevice.ROOT / "examples"))
import collectives  # noqa: E402  pylint: disable=g-import-not-at-top

cases = multidevice.Cases()
G, N, K, D, F = 8, 64, 2, 128, 32


def _mesh():
  return jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))


def _fsdp_mesh():  # experts over 4 devices, their kernels over 2 along K
  return jax.make_mesh((2, 4), ("fsdp", "expert"),
                       axis_types=(AxisType.Auto,) * 2)


def _inputs(dtype=jnp.float32):
  kx, kw, ki, kg = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(kx, (N, D), dtype)
  w = jax.random.normal(kw, (G, D, F), dtype) / 8
  # Skewed routing: experts 0 and 1 get most copies (and expert 7 none).
  ids = jnp.stack([jax.random.randint(ki, (N,), 0, 3),
                   jax.random.randint(kg, (N,), 3, 7)], axis=1)
  gates = jax.nn.softmax(jax.random.normal(kg, (N, K)), axis=-1)
  return x, w, ids.astype(jnp.int32), gates


def _experts(w, xs, sizes, out=jnp.float32):
  return jax.lax.ragged_dot(xs, w, sizes, preferred_element_type=out)


def _loss(mesh, transport=None, capacity=None, out=jnp.float32,
          experts=_experts, fsdp=None, param_specs=None):
  def loss(w, x, ids, gates):
    fn = functools.partial(experts, out=out)
    y = ep.run(fn, w, x, ids, gates, n_experts=G, mesh=mesh,
               transport=transport, capacity=capacity, fsdp=fsdp,
               param_specs=param_specs)
    return jnp.sum(y * jnp.cos(jnp.arange(F, dtype=jnp.float32))[None, :])
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


@cases
def matches_single_device():
  x, w, ids, gates = _inputs()
  one, (dw1, dx1) = _loss(None)(w, x, ids, gates)
  eight, (dw8, dx8) = _loss(_mesh())(w, x, ids, gates)
  # Explicit axes, the inputs unsharded (laid out on one device): `run`
  # moves them to its specs (shard_map refused them).
  explicit = jax.make_mesh((8,), ("expert",),
                           axis_types=(AxisType.Explicit,))
  with jax.set_mesh(explicit):
    put = lambda a: jax.device_put(a, P())  # noqa: E731
    placed, (dw_e, dx_e) = _loss(explicit)(*map(put, (w, x, ids, gates)))
  err = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
  return {"loss": [float(one), float(eight), float(placed)],
          "dw": max(err(dw8, dw1), err(dw_e, dw1)),
          "dx": max(err(dx8, dx1), err(dx_e, dx1))}


@cases
def explicit_axes_take_prefix_specs_and_mixed_meshes():
  """`run` on explicit axes with params a dict under one spec (a prefix, as
  shard_map takes it), and on a mesh whose other axis alone is explicit
  (no reshard there): both as one device."""
  x, w, ids, gates = _inputs()
  params = {"w": w, "scale": jnp.full((G, 1, 1), 0.5)}
  # No ragged_dot: jax infers no sharding for it under an explicit axis.
  fn = lambda p, xs, sizes: xs * p["scale"][0, 0, 0]  # noqa: E731
  def loss(mesh, **kw):
    return jax.jit(lambda p, x, i, g: jnp.sum(ep.run(
        fn, p, x, i, g, n_experts=G, mesh=mesh, **kw)))
  one = float(loss(None)(params, x, ids, gates))
  explicit = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(explicit):
    prefix = float(loss(explicit, param_specs=P("expert"))(
        params, x, ids, gates))
  mixed = jax.make_mesh((2, 4), ("data", "expert"),
                        axis_types=(AxisType.Explicit, AxisType.Auto))
  with jax.set_mesh(mixed):
    auto_expert = float(loss(mixed)(params, x, ids, gates))
  return [one, prefix, auto_expert]


@cases
def fsdp_gathers_quantized_kernels():
  """Experts over ``expert`` (4) and their kernels over ``fsdp`` (2) along
  K: each quantized GEMM gathers its kernel shard as payload + scales
  (deepseek_v3: a 64-row shard holds no whole 128x128 block, so the wide
  shard is gathered); the step against one device, and the gathers' bytes
  by type from the HLO."""
  import qlayers  # pylint: disable=g-import-not-at-top
  x, w, ids, gates = _inputs()
  out = {}
  for name in ("fp8_current", "mxfp8", "deepseek_v3"):
    rd = qlayers.ops.ragged_dot(name)
    def experts(w, xs, sizes, out, rd=rd):
      return rd(xs, w, sizes, preferred_element_type=out)
    one, (dw1, dx1) = _loss(None, experts=experts)(w, x, ids, gates)
    step = _loss(_fsdp_mesh(), experts=experts, fsdp="fsdp")
    step = step.lower(w, x, ids, gates).compile()
    two, (dw2, dx2) = step(w, x, ids, gates)
    err = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    c = collectives.summary(step.as_text())
    out[name] = {"loss": [float(one), float(two)], "dw": err(dw2, dw1),
                 "dx": err(dx2, dx1), "dw_shape": list(dw2.shape),
                 "all_gather": c.get("all-gather", {}),
                 "reduce_scatter": c.get("reduce-scatter", {})}
    if name == "fp8_current":  # without fsdp=: that axis left automatic
      auto, (dwa, dxa) = _loss(_fsdp_mesh(), experts=experts)(w, x, ids, gates)
      out["auto_axis"] = {"loss": [float(one), float(auto)],
                          "dw": err(dwa, dw1), "dx": err(dxa, dx1)}
  # The layer QuantExperts takes a kernel shard too (forward only).
  from flax import nnx  # pylint: disable=g-import-not-at-top
  graphdef, state = nnx.split(qlayers.QuantExperts(
      G, D, F, recipe="fp8_current", rngs=nnx.Rngs(0)))
  layer = lambda state, xs, sizes: nnx.merge(graphdef, state)(xs, sizes)
  y1, y2 = (jax.jit(lambda s, *a, m=m: ep.run(
      layer, s, *a, n_experts=G, mesh=m, fsdp="fsdp"))(state, x, ids, gates)
            for m in (None, _fsdp_mesh()))
  out["quant_experts"] = float(jnp.max(jnp.abs(y1 - y2)) /
                               jnp.max(jnp.abs(y1)))
  try:  # a kernel split over fsdp along N: refused, naming the spec
    _loss(_fsdp_mesh(), fsdp="fsdp", param_specs=P("expert", None, "fsdp"))(
        w, x, ids, gates)
  except ValueError as e:
    out["along_n"] = str(e)
  return out


@cases
def capacity_drops_copies():
  # With the capacity of the fullest (source, destination) pair nothing is
  # dropped; one less drops copies, whose tokens then lose that expert.
  x, w, ids, gates = _inputs()
  mesh = _mesh()
  per_pair = np.zeros((8, 8), int)
  for t, e in np.ndindex(N, K):
    per_pair[t // (N // 8), int(ids[t, e]) // (G // 8)] += 1
  fullest = int(per_pair.max())
  outs = [np.asarray(jax.jit(lambda *a, c=c: ep.run(
      _experts, *a, n_experts=G, mesh=mesh, capacity=c))(w, x, ids, gates))
          for c in (None, fullest, fullest - 1)]
  changed = [int(np.sum(np.abs(o - outs[0]).max(axis=1) > 1e-4))
             for o in outs[1:]]
  return {"fullest": fullest, "changed": changed}


@cases
def ids_out_of_range_are_dropped():
  # A copy routed to -1 or past the last expert comes back as 0 (it joined
  # expert 0, or came back from a clamped index), on one device and on 8.
  x, w, ids, gates = _inputs()
  bad = ids.at[::3, 1].set(-1).at[1::3, 0].set(G)
  valid = (bad >= 0) & (bad < G)
  kept = jnp.where(valid, gates, 0.0)
  run = lambda mesh, ids, gates: np.asarray(jax.jit(lambda *a: ep.run(
      _experts, *a, n_experts=G, mesh=mesh))(w, x, ids, gates))
  # The reference: the dropped copies sent to expert 0 with gate 0.
  want = run(None, jnp.where(valid, bad, 0), kept)
  err = lambda a: float(np.max(np.abs(a - want)) / np.max(np.abs(want)))
  return {"one": err(run(None, bad, gates)), "eight": err(run(_mesh(), bad,
                                                               gates))}


@cases
def quantized_transport():
  x, w, ids, gates = _inputs(jnp.bfloat16)
  mesh = _mesh()
  out = {}
  for name in ("bf16", "fp8_current", "mxfp8"):
    step = _loss(mesh, transport=name, out=jnp.bfloat16)
    step = step.lower(w, x, ids, gates).compile()
    text = step.as_text()
    _, (dw, dx) = step(w, x, ids, gates)
    a2a = collectives.summary(text).get("all-to-all", {})
    out[name] = {"step_bytes": sum(a2a.values()), "by_dtype": a2a,
                 "finite": bool(jnp.isfinite(dw).all() & jnp.isfinite(dx).all())}
    spec = ep.transport_spec(name)
    if spec is not None:
      out[name]["vs_one_device"] = _arrive_as_one_device(
          mesh, spec, name, w, x, ids, gates)

    def fwd(x, ids, name=name):  # the dispatch all_to_all alone
      def body(x, ids):
        return ep.dispatch(x, ids, n_experts=G, axis_name="expert",
                           transport=name)[0]
      return jax.shard_map(body, mesh=mesh, in_specs=(P("expert"),) * 2,
                           out_specs=P("expert"))(x, ids)
    text = jax.jit(fwd).lower(x, ids).compile().as_text()
    out[name]["dispatch_bytes"] = collectives.total_bytes(text, "all-to-all")
  return out


def _arrive_as_one_device(mesh, spec, name, w, x, ids, gates):
  """The tokens' rows arrive as the single-device run quantizes and
  dequantizes them (a row's units never span devices)."""
  xq = scaling.quantize(x, spec).dequantize(x.dtype)
  y = jax.jit(lambda *a: ep.run(
      _experts, *a, n_experts=G, mesh=mesh, transport=name))(w, x, ids, gates)
  return float(jnp.max(jnp.abs(y - _one_device(w, xq, ids, gates))))


@jax.jit  # one compile for every recipe's comparison
def _one_device(w, x, ids, gates):
  return ep.run(_experts, w, x, ids, gates, n_experts=G)


@cases
def local_scales_keep_amax_per_device():
  mesh = _mesh()
  x = jnp.arange(8.0)[:, None] * jnp.ones((1, 4))

  def amax(x, local):
    def body(x):
      a = jnp.max(jnp.abs(x))
      if not local:
        return sharding.global_amax(a, x)[None]
      with sharding.local_scales("expert"):
        return sharding.global_amax(a, x)[None]
    return jax.shard_map(body, mesh=mesh, in_specs=P("expert"),
                         out_specs=P("expert"))(x)
  return {"global": amax(x, False).tolist(), "local": amax(x, True).tolist()}


def _moe_step(recipe, mesh):
  """One training step of the example MoE GPT (under ``mesh``: experts over
  its ``expert`` axis, their kernels over ``fsdp`` along K, the batch over
  both)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import qlayers  # pylint: disable=g-import-not-at-top
  from _common import moe  # pylint: disable=g-import-not-at-top
  config = moe.MoEConfig(vocab_size=32, max_len=8, d_model=32, n_layers=1,
                         n_heads=2, d_ff=64, dtype=jnp.bfloat16)
  model = moe.MoEGPT(config, rngs=nnx.Rngs(0))
  if recipe:
    qlayers.quantize(model, recipe)
  tokens = jax.random.randint(jax.random.key(1), (8, 9), 0, 32)

  @nnx.jit
  def step(model, tokens):
    (loss, _), grads = qlayers.value_and_grad(moe.loss_fn, has_aux=True)(
        model, tokens[:, :-1], tokens[:, 1:])
    qlayers.update_scales(model)
    return loss, grads

  if mesh is None:
    loss, grads = step(model, tokens)
  else:
    with jax.set_mesh(mesh):
      loss, grads = step(model, tokens)
  hist = {role: [np.asarray(v[...]).tolist()
                 for path, v in nnx.iter_graph(model)
                 if isinstance(v, nnx.Variable)
                 and path[-1] == f"{role}_amax_history"] for role in "xw"}
  return float(loss), grads, hist


@cases
def moe_gpt_matches_single_device():
  out = {}
  for recipe in (None, "fp8_delayed"):
    l1, g1, h1 = _moe_step(recipe, None)
    l8, g8, h8 = _moe_step(recipe, _fsdp_mesh())
    rel = [float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a))
           for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8))]
    hist = {r: [float(np.max(np.abs(np.array(a) - np.array(b)))
                      / np.max(np.abs(np.array(a))))
                for a, b in zip(h1[r], h8[r])] for r in h1}
    out[recipe or "bf16"] = {
        "loss": [l1, l8], "grad_rel": max(rel),
        "histories": {r: len(h) for r, h in h1.items()},
        "hist_rel": {r: max(h or [0.0]) for r, h in hist.items()}}
  return out


if __name__ == "__main__":
  cases.main()
