"""Cases of test_sharding_auto.py, run on 8 simulated devices (see
multidevice.py): auto-axes meshes with arrays placed by ``jax.device_put``,
``shard_map``, and the ffi backend."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import qlayers
from qlayers import ops, scaling, sharding
from qlayers.scaling import QuantSpec

import multidevice
import sharded_training as st

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

case = multidevice.Cases()


def _run(recipe, layout, *, backend=None, steps=3):
  """Losses, final quantization state and collectives of one layout (None:
  one device)."""
  x, y = st.data()
  model = st.MLP(recipe, rngs=nnx.Rngs(0), backend=backend)
  opt = st.optimizer(model)
  if layout is None:
    losses, _ = st.train(model, opt, jnp.asarray(x), jnp.asarray(y), steps)
    return {"losses": losses, "state": st.quant_state(model)}
  mesh = st.mesh_for(layout)
  with jax.set_mesh(mesh):
    nnx.update((model, opt), st.place(nnx.state((model, opt)), mesh, layout))
    batch = NamedSharding(mesh, st.LAYOUTS[layout][2])
    xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
    losses, hlo = st.train(model, opt, xs, ys, steps)
    return {"losses": losses, "state": st.quant_state(model),
            "collectives": st.summary(hlo),
            "specs": st.specs(nnx.state(model))}


def _layouts(recipe, layouts, **kw):
  out = {"single": _run(recipe, None, **kw)}
  for layout in layouts:
    out[layout] = _run(recipe, layout, **kw)
  return out


@case
def train_fp8_delayed():
  return _layouts("fp8_delayed", st.LAYOUTS)


@case
def train_mxfp8():
  return _layouts("mxfp8", ("fsdp", "fsdp_tp"))


@case
def train_mxfp4():  # packed payloads, decoded inside each device's GEMM
  return _layouts("mxfp4", ("fsdp",))


@case
def train_bf16():
  return _layouts("bf16", ("fsdp",))


@case
def gather_switch_off():
  with sharding.gather_payloads(False):
    return {"fsdp": _run("fp8_delayed", "fsdp")}


@case
def ffi():
  # Compared with xla's single-device runs (train_fp8_delayed, train_mxfp8):
  # on one device the backends agree (test_dispatch.py::
  # test_layers_agree_across_backends), so ffi's own would add a compile each.
  return {"fp8_delayed": {layout: _run("fp8_delayed", layout, backend="ffi")
                          for layout in ("tp", "fsdp_tp")},
          "mxfp8": {"dp": _run("mxfp8", "dp", backend="ffi")},
          "mxfp8_xla_dp": _run("mxfp8", "dp")}


# ----------------------------------------------------------------------------
# The per-tensor cast kernel under a mesh (`qlayers.partition.cast`), run in
# Pallas' interpreter: the same training as XLA's copies, bit for bit.


def _kernel_run(recipe, layout, arch, kernel):
  """`_run` (or ``layout()`` where it is a function) traced for GPU
  ``arch``, the pairs made by the one-pass kernels with a partitioning rule
  (interpreted) where ``kernel``, else by XLA's ops."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  from qlayers import cast_transpose, history_roll, operands, table  # pylint: disable=g-import-not-at-top
  kernels, rolls = [], []
  names = ("cast_transpose", "mx_cast_transpose", "nvfp4_cast_transpose",
           "nvfp4_amaxes", "fp4_cast_transpose", "row_cast_transpose",
           "block_cast_transpose")
  original = operands.lax, *(getattr(cast_transpose, n) for n in names)
  roll_original = history_roll.lax, history_roll.roll

  def roll(*args, **kw):  # delayed scaling's end of step, interpreted
    rolls.append(len(args[0]))
    return roll_original[1](*args, interpret=True, **kw)

  def interpreted(fn):
    def run(t, *args, **kw):
      kernels.append(tuple(t.shape))
      return fn(t, *args, interpret=True, **kw)
    return run

  with table.target_arch(arch), contextlib.ExitStack() as undo:
    if kernel:
      operands.lax = history_roll.lax = types.SimpleNamespace(**{
          **vars(lax), "platform_dependent":
          lambda *a, cuda, **_: cuda(*a)})
      history_roll.roll = roll
      for n, fn in zip(names, original[1:]):
        setattr(cast_transpose, n, interpreted(fn))

      def restore():
        operands.lax = original[0]
        history_roll.lax, history_roll.roll = roll_original
        for n, fn in zip(names, original[1:]):
          setattr(cast_transpose, n, fn)
      undo.callback(restore)
    out = layout() if callable(layout) else _run(recipe, layout)
  out["kernels"], out["rolls"] = len(kernels), len(rolls)
  return out


def _matmul(recipe, k=128, n=256):
  """One ``(2048, k) @ (k, n)`` matmul's loss and gradients under
  ``recipe``, data-parallel over the mesh: 256 tokens per device (whole
  amax tiles of NVFP4's kernels)."""
  r = qlayers.recipe(recipe)
  rng = np.random.default_rng(8)
  x = rng.normal(size=(2048, k)).astype(np.float32)
  w = rng.normal(size=(k, n)).astype(np.float32)

  def loss(x, w):
    y, _ = ops.quantized_matmul(x, w, r, key=qlayers.formats.rounding_key(
        jnp.uint32(5), jnp.uint32(0)))
    return jnp.sum(jnp.cos(y.astype(jnp.float32)))

  mesh = st.mesh_for("dp")
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    ws = jax.device_put(w, NamedSharding(mesh, P()))
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(
        xs, ws).compile()
    value, (dx, dw) = compiled(xs, ws)
  return {"losses": [float(value)],
          "grads": [np.asarray(g).tolist() for g in (dx, dw)],
          "state": {}, "collectives": st.summary(compiled.as_text())}


@case
def cast_kernel_under_mesh():
  out = {}
  for recipe, layout, arch in (("fp8_delayed", "fsdp_tp", "sm_90"),
                               ("fp8_current", "dp", "sm_90"),
                               # one layout, the roll kernel's histories
                               ("fp8_delayed", "dp", "sm_100"),
                               ("mxfp8", "fsdp", "sm_100")):
    out[f"{recipe}/{layout}/{arch}"] = {
        name: _kernel_run(recipe, layout, arch, kernel)
        for name, kernel in (("kernel", True), ("xla", False))}
  for recipe, arch, kw in (("nvfp4", "sm_100", {}),
                           ("mxfp4_rht", "sm_100", {}),
                           # whole 64 x 64 tiles over 8 devices both ways
                           ("fp8_rowwise", "sm_90", {"k": 512, "n": 512}),
                           # 1 x 128 tiles and 128 x 128 blocks, the same
                           ("deepseek_v3", "sm_90", {"k": 1024, "n": 1024})):
    out[f"{recipe}/dp/{arch}"] = {
        name: _kernel_run(recipe, functools.partial(_matmul, recipe, **kw),
                          arch, kernel)
        for name, kernel in (("kernel", True), ("xla", False))}
  # Hopper's MX copies (BF16 values) stay XLA's under a mesh.
  return {"runs": out, "without": {
      "mxfp8/sm_90": _kernel_run("mxfp8", "dp", "sm_90", True)["kernels"]}}


# ----------------------------------------------------------------------------
# Scales are global: a sharded operand quantizes to the single-device bits.

SPECS = {
    "tensor": QuantSpec(format="e4m3"),
    "row": QuantSpec(format="e4m3", granularity="row"),
    "tile": QuantSpec(format="e4m3", granularity="tile"),
    "block": QuantSpec(format="e4m3", granularity="block"),
    "mx": QuantSpec(format="e4m3", granularity="mx"),
    "mxfp4": QuantSpec(format="e2m1", granularity="mx"),
}


def _bits(q):
  return (np.asarray(lax.bitcast_convert_type(q.payload, jnp.uint8)
                     if q.payload.dtype.itemsize == 1 else q.payload).tolist(),
          np.asarray(q.scale).view(np.uint32 if q.scale.dtype == np.float32
                                   else np.uint8).tolist())


@case
def scales_global():
  rng = np.random.default_rng(1)
  x = (rng.standard_normal((256, 256)) *
       rng.uniform(0.01, 100, (256, 1))).astype(np.float32)
  mesh = st.mesh_for("fsdp_tp")
  keys = [(name, axis) for name, spec in SPECS.items() for axis in (0, 1)
          if not (spec.fmt.packed and axis == 0)]
  # One program quantizes x every way: one compile per layout, not one per
  # (spec, axis, layout); each quantization is still its own computation.
  f = jax.jit(lambda t: {f"{n}/axis{a}": scaling.quantize(t, SPECS[n], a)
                         for n, a in keys})
  ref = {k: _bits(q) for k, q in f(jnp.asarray(x)).items()}
  out = {k: {} for k in ref}
  with jax.set_mesh(mesh):
    for layout, sp in (("fsdp", P("fsdp", None)), ("model", P(None, "model")),
                       ("both", P("fsdp", "model"))):
      got = f(jax.device_put(x, NamedSharding(mesh, sp)))
      for k, q in got.items():
        out[k][layout] = _bits(q) == ref[k]
  # Delayed scaling: the amax recorded from a sharded step is the global one.
  r = qlayers.recipe("fp8_delayed", amax_history_len=4)
  w = rng.standard_normal((256, 128)).astype(np.float32)

  def fwd(x, w):
    _, new = ops.quantized_matmul(x, w, r, ops.init_state(r))
    return new["x"].amax, new["w"].amax

  ref = [float(a) for a in jax.jit(fwd)(x, w)]
  with jax.set_mesh(mesh):
    got = jax.jit(fwd)(jax.device_put(x, NamedSharding(mesh, P("fsdp"))),
                       jax.device_put(w, NamedSharding(mesh,
                                                       P(None, "model"))))
  out["delayed_amax"] = {"single": ref, "sharded": [float(a) for a in got],
                         "true": [float(np.max(np.abs(x))),
                                  float(np.max(np.abs(w)))]}
  return out


@case
def uneven_shards():
  """Rows the mesh axis does not divide (60 over 8): the GEMM's
  partitioning rule gathers them, with one device's values."""
  rng = np.random.default_rng(2)
  x = rng.standard_normal((60, 64)).astype(np.float32)
  w = rng.standard_normal((64, 32)).astype(np.float32)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(
      jax.sharding.AxisType.Auto,))
  out = {}
  for recipe in ("fp8_current", "mxfp8"):
    def loss(x, w, recipe=recipe):
      y, _ = ops.quantized_matmul(x, w, recipe)
      return jnp.sum(y.astype(jnp.float32) ** 2), y
    vg = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (_, y0), g0 = jax.jit(vg)(jnp.asarray(x), jnp.asarray(w))
    with jax.set_mesh(mesh):
      (_, y1), g1 = jax.jit(lambda x, w: vg(
          jax.lax.with_sharding_constraint(x, P("data")), w))(x, w)
    out[recipe] = {"y": bool(np.array_equal(y0, y1)), "grads": max(
        float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
        for a, b in zip(g0, g1))}
  return out


@case
def vmap_under_mesh():
  """A user's jax.vmap over a quantized GEMM under a mesh (the GEMM's
  partitioning rule has no batching rule): each item's gradients are the
  unbatched call's, bit for bit."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((2, 32, 128)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((2, 128, 64)), jnp.bfloat16)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(
      jax.sharding.AxisType.Auto,))
  out = {}
  for recipe in ("fp8_current", "mxfp8"):
    def grads(x, w, recipe=recipe):
      def loss(x, w):
        y, _ = ops.quantized_matmul(x, w, recipe, out_dtype=jnp.bfloat16)
        return jnp.sum(y.astype(jnp.float32) ** 2)
      return jax.grad(loss, argnums=(0, 1))(x, w)
    with jax.set_mesh(mesh):
      got = jax.jit(jax.vmap(grads))(x, w)
    want = [jnp.stack(t) for t in zip(*(grads(x[i], w[i]) for i in range(2)))]
    out[recipe] = all(bool(np.array_equal(np.asarray(a, np.float32),
                                          np.asarray(b, np.float32)))
                      for a, b in zip(got, want))
  return out


@case
def frozen_under_mesh():
  """A frozen kernel's stored codes read as the GEMM's weight under a mesh
  (its payload and scales sharded along N, the batch over the devices):
  the output and the adapter's gradients are one device's."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((32, 128)), jnp.float32)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(
      jax.sharding.AxisType.Auto,))

  def loss(layer, x):
    return jnp.sum(layer(x) ** 2)

  step = nnx.jit(nnx.value_and_grad(loss))
  out = {}
  for recipe in ("fp8_current", "mxfp8", "mxfp4"):
    layer = qlayers.QuantDense(128, 64, recipe=recipe, rngs=nnx.Rngs(0))
    qlayers.freeze(layer)
    # FP32 adapters: BF16 gradients summed over the shards round apart
    # from one device's (0.5% on jax 0.12).
    qlayers.add_lora(layer, 4, rngs=nnx.Rngs(1), param_dtype=jnp.float32)
    layer.lora.lora_b[...] = jnp.full(layer.lora.lora_b.shape, 0.01,
                                      layer.lora.lora_b.dtype)
    assert layer.stored_kernel() is not None
    want_loss, want = step(layer, x)
    with jax.set_mesh(mesh):
      kernel = layer.kernel
      for v in (kernel.payload, kernel.scale):
        spec = P("data") if v[...].ndim else P()
        v.set_value(jax.device_put(v[...], NamedSharding(mesh, spec)))
      got_loss, got = step(layer, jax.device_put(
          x, NamedSharding(mesh, P("data"))))
    rel = [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
           for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    out[recipe] = {"loss": [float(want_loss), float(got_loss)],
                   "grad_rel": max(rel)}
  return out


# ----------------------------------------------------------------------------
# Inside shard_map: local shards, global amaxes (lax.pmax), summed gradients.


@case
def shard_map_ops():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(64, 128)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(128, 256)), jnp.float32)
  mesh = st.mesh_for("tp")
  recipes = {name: qlayers.recipe(name)
             for name in ("fp8_delayed", "fp8_current", "mxfp8", "bf16")}
  states = {name: ops.init_state(r) for name, r in recipes.items()}

  def loss(x, w, s, r):
    y, new = ops.quantized_matmul(x, w, r, s)
    return jnp.sum(y.astype(jnp.float32) ** 2), new

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)

  # Every recipe in one program (one compile on one device, one under
  # shard_map); each recipe's step is still its own computation.
  def grads(x, w, states):
    return {name: grad(x, w, states[name], r) for name, r in recipes.items()}

  def body(x, w, states):
    out = {}
    for name, ((l, n), g) in grads(x, w, states).items():
      out[name] = (lax.psum(l, ("data", "model")), n, g)
    return out

  ref = jax.jit(grads)(x, w, states)
  f = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(P("data", None), P(None, "model"), P()),
      out_specs={name: (P(), P(), (P("data", None), P(None, "model"), P()))
                 for name in recipes}))
  sharded = f(x, w, states)
  rel = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
  out = {}
  for name in recipes:
    (l0, n0), g0 = ref[name]
    l1, n1, g1 = sharded[name]
    item = {"loss": [float(l0), float(l1)], "dx": rel(g0[0], g1[0]),
            "dw": rel(g0[1], g1[1])}
    if n0 is not None:
      item["amax"] = [[float(n0[k].amax), float(n1[k].amax)]
                      for k in ("x", "w")]
      item["g_amax"] = [float(g0[2]["g"].amax), float(g1[2]["g"].amax)]
    out[name] = item
  return out


@case
def shard_map_layer():
  """A QuantDense trained inside shard_map (data parallel): replicated state
  in, replicated state out, the same amaxes as on one device."""
  x, y = (jnp.asarray(a) for a in st.data())
  mesh = st.mesh_for("dp")

  def grads(model, x, y):
    return qlayers.value_and_grad(st.mse)(model, x, y)

  def one_device():
    model = qlayers.QuantDense(st.D, st.D, rngs=nnx.Rngs(0))
    loss, g = nnx.jit(grads)(model, x, y)
    return model, loss, g

  ref_model, ref_loss, ref_g = one_device()
  model = qlayers.QuantDense(st.D, st.D, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)

  def global_mse(m, x, y):  # each device holds 1/8 of the batch
    return lax.pmean(st.mse(m, x, y), "data")

  def body(state, x, y):
    m = nnx.merge(graphdef, state)
    loss, g = qlayers.value_and_grad(global_mse)(m, x, y)
    return loss, g["kernel"][...], g["quant"]["g_amax"][...], nnx.state(m)

  f = jax.jit(jax.shard_map(body, mesh=mesh,
                            in_specs=(P(), P("data"), P("data")),
                            out_specs=(P(), P(), P(), P())))
  loss, kernel, g_amax, new_state = f(state, x, y)
  nnx.update(model, new_state)
  rel = float(jnp.max(jnp.abs(kernel - ref_g["kernel"][...]))
              / jnp.max(jnp.abs(ref_g["kernel"][...])))
  return {"loss": [float(ref_loss), float(loss)], "dkernel": rel,
          "g_amax": [float(ref_g["quant"]["g_amax"][...]), float(g_amax)],
          "x_amax": [float(ref_model.quant.x_amax[...]),
                     float(model.quant.x_amax[...])],
          "w_amax": [float(ref_model.quant.w_amax[...]),
                     float(model.quant.w_amax[...])]}


@case
def fsdp_layer_in_shard_map():
  """A QuantDense whose kernel is an FSDP shard along K inside shard_map
  (`sharding.gathered_weights`): the whole K gathered as payloads, the
  weight gradient reduce-scattered; as on one device."""
  x, y = (jnp.asarray(a) for a in st.data())
  mesh = st.mesh_for("dp")
  make = lambda: qlayers.QuantDense(st.D, st.D, use_bias=False,  # noqa: E731
                                    rngs=nnx.Rngs(0))
  ref_loss, ref_g = nnx.jit(qlayers.value_and_grad(st.mse))(make(), x, y)
  graphdef, state = nnx.split(make())
  spec = lambda p, v: P("data", None) if "kernel" in str(p) else P()  # noqa
  specs = jax.tree_util.tree_map_with_path(spec, state)

  def body(state, x, y):
    with sharding.gathered_weights("data"):
      m = nnx.merge(graphdef, state)
      loss, g = qlayers.value_and_grad(
          lambda m, x, y: lax.pmean(st.mse(m, x, y), "data"))(m, x, y)
    return loss, g["kernel"][...]

  loss, kernel = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(specs, P("data"), P("data")),
      out_specs=(P(), P("data", None))))(state, x, y)
  want = ref_g["kernel"][...]
  return {"loss": [float(ref_loss), float(loss)],
          "dkernel": float(jnp.max(jnp.abs(kernel - want))
                           / jnp.max(jnp.abs(want)))}


# ----------------------------------------------------------------------------
# Every layer kind, under tensor parallelism on an auto mesh.


class Block(nnx.Module):
  """Attention projections, an einsum MLP and a tied-free logits head."""

  def __init__(self, recipe, rngs):
    self.embed = nnx.Embed(128, 64, rngs=rngs)
    self.attn = qlayers.QuantAttentionProj(64, 4, 16,
                                           recipe=recipe, rngs=rngs)
    self.mlp = qlayers.QuantEinsum("btd,dh->bth", (64, 256), (256,),
                                   recipe=recipe, rngs=rngs)
    self.proj = qlayers.QuantLinearGeneral(256, 64, recipe=recipe, rngs=rngs)
    self.head = qlayers.QuantLogits(64, 128, recipe=recipe, rngs=rngs)

  def __call__(self, tokens):
    h = self.embed(tokens)
    q, k, v = self.attn.qkv(h)
    h = h + self.attn.out(self.attn.attend(q, k, v, is_causal=True))
    h = h + self.proj(jax.nn.gelu(self.mlp(h)))
    return h


BLOCK_SPECS = {
    "attn/query/kernel": P(None, "model", None),
    "attn/key/kernel": P(None, "model", None),
    "attn/value/kernel": P(None, "model", None),
    "attn/out/kernel": P("model", None, None),
    "mlp/kernel": P(None, "model"), "mlp/bias": P("model"),
    "proj/kernel": P("model", None),
    "head/kernel": P(None, "model"),
}


def block_loss(model, tokens):
  return model.head.loss(model(tokens[:, :-1]), tokens[:, 1:], chunk_size=4)


def place_block(tree, mesh):
  def f(path, v):
    name = st._path(path)  # pylint: disable=protected-access
    for key, spec in BLOCK_SPECS.items():
      if name.endswith(key) and v.ndim == len(spec):
        return jax.device_put(v, NamedSharding(mesh, spec))
    return jax.device_put(v, NamedSharding(mesh, P()))
  return jax.tree_util.tree_map_with_path(f, tree)


@case
def layers_tp():
  """MX only: its block scales run along each layer kind's own contraction
  dims. Per-tensor fp8_delayed has one amax per tensor whatever the layer
  (train_fp8_delayed's tp; every layer kind under explicit axes with it:
  test_sharding_explicit.py::test_every_layer_kind)."""
  tokens = np.random.default_rng(3).integers(0, 128, (16, 9)).astype(np.int32)
  out = {}
  for recipe in ("mxfp8",):
    res = {}
    for sharded in (False, True):
      model = Block(recipe, nnx.Rngs(0))
      opt = st.optimizer(model)
      if not sharded:
        res["single"], _ = st.train(model, opt, jnp.asarray(tokens), None, 2,
                                    loss_fn=lambda m, t, _: block_loss(m, t))
        continue
      mesh = st.mesh_for("tp")
      with jax.set_mesh(mesh):
        nnx.update((model, opt), place_block(nnx.state((model, opt)), mesh))
        t = jax.device_put(tokens, NamedSharding(mesh, P("data")))
        res["tp"], hlo = st.train(model, opt, t, None, 2,
                                  loss_fn=lambda m, t, _: block_loss(m, t))
        res["collectives"] = st.summary(hlo)
    out[recipe] = res
  return out


if __name__ == "__main__":
  case.main()
