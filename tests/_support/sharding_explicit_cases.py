"""Cases of test_sharding_explicit.py, run on 8 simulated devices (see
multidevice.py): explicit-axes meshes (``jax.set_mesh``), Params made with
sharding metadata as in the Flax NNX sharding guide."""

import contextlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import qlayers

import multidevice
import sharded_training as st

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

case = multidevice.Cases()


def _run(recipe, layout, steps=3):
  x, y = st.data()
  if layout is None:
    model = st.MLP(recipe, rngs=nnx.Rngs(0))
    opt = st.optimizer(model)
    losses, _ = st.train(model, opt, jnp.asarray(x), jnp.asarray(y), steps)
    return {"losses": losses, "state": st.quant_state(model)}
  with jax.set_mesh(st.mesh_for(layout, explicit=True)):
    model = st.MLP(recipe, rngs=nnx.Rngs(0), layout=layout)
    opt = st.optimizer(model)
    batch = st.LAYOUTS[layout][2]
    xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
    losses, hlo = st.train(model, opt, xs, ys, steps)
    return {"losses": losses, "state": st.quant_state(model),
            "collectives": st.summary(hlo), "optimizer": type(opt).__name__,
            "specs": st.specs(nnx.state(model))}


# No "dp": tp shards the batch over "data" as dp does (here the kernels over
# "model" too); replicated kernels are test_sharding_auto.py's dp.
EXPLICIT_LAYOUTS = ("fsdp", "tp", "fsdp_tp")


@case
def train_fp8_delayed():
  out = {"single": _run("fp8_delayed", None)}
  for layout in EXPLICIT_LAYOUTS:
    out[layout] = _run("fp8_delayed", layout)
  return out


@case
def train_mxfp8():
  return {"single": _run("mxfp8", None), "tp": _run("mxfp8", "tp"),
          "fsdp": _run("mxfp8", "fsdp")}


@case
def train_bf16():
  return {"single": _run("bf16", None), "fsdp": _run("bf16", "fsdp")}


# ----------------------------------------------------------------------------
# qlayers.Optimizer under a mesh, with narrow Params (real FP32 masters).


@case
def optimizer_shardings():
  with jax.set_mesh(st.mesh_for("fsdp_tp", explicit=True)):
    model = st.MLP("fp8_delayed", rngs=nnx.Rngs(0), layout="fsdp_tp",
                   param_dtype=jnp.bfloat16)
    opt = qlayers.Optimizer(model, optax.adam(st.LR))
    params = st.specs(nnx.state(model, nnx.Param))
    opt_specs = st.specs(opt.opt_state)
    x, y = st.data()
    x = jnp.asarray(x, jnp.bfloat16)
    losses, _ = st.train(model, opt, jax.device_put(x, P("fsdp")),
                         jax.device_put(y, P("fsdp")), 2)
  return {"params": params, "opt_state": opt_specs, "losses": losses}


# ----------------------------------------------------------------------------
# Every layer kind, and a converted stock model, under explicit axes.


class StockBlock(nnx.Module):
  """A stock NNX block whose Params carry sharding metadata (converted by
  qlayers.quantize)."""

  def __init__(self, rngs, sharded=True):
    init = nnx.initializers.lecun_normal()
    wp = nnx.with_partitioning if sharded else (lambda f, spec: f)
    self.attn = nnx.MultiHeadAttention(
        4, 64, qkv_features=64, decode=False, rngs=rngs,
        kernel_init=wp(init, (None, "model", None)),
        out_kernel_init=wp(init, ("model", None, None)))
    self.up = nnx.Linear(64, 256, rngs=rngs,
                         kernel_init=wp(init, (None, "model")),
                         bias_init=wp(nnx.initializers.zeros_init(),
                                      ("model",)))
    self.down = nnx.Einsum("bth,hd->btd", (256, 64), rngs=rngs,
                           kernel_init=wp(init, ("model", None)))

  def __call__(self, x):
    x = x + self.attn(x)
    return x + self.down(jax.nn.gelu(self.up(x)))


def _stock_loss(model, x, y):
  return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


@case
def quantize_stock_model():
  rng = np.random.default_rng(4)
  x = rng.normal(size=(16, 8, 64)).astype(np.float32)
  y = rng.normal(size=(16, 8, 64)).astype(np.float32)
  out = {}
  for sharded in (False, True):
    mesh = st.mesh_for("tp", explicit=True)
    with jax.set_mesh(mesh) if sharded else contextlib.nullcontext():
      model = StockBlock(nnx.Rngs(0), sharded)
      report = qlayers.quantize(model, "fp8_delayed")
      opt = st.optimizer(model)
      xs = jax.device_put(x, P("data")) if sharded else jnp.asarray(x)
      ys = jax.device_put(y, P("data")) if sharded else jnp.asarray(y)
      losses, hlo = st.train(model, opt, xs, ys, 2, loss_fn=_stock_loss)
      key = "tp" if sharded else "single"
      out[key] = {"losses": losses, "converted": len(report.converted)}
      if sharded:
        out[key]["specs"] = st.specs(nnx.state(model, nnx.Param))
        out[key]["metadata"] = {
            p: str(v.get_metadata().get("out_sharding"))
            for p, v in (("up/kernel", model.up.kernel),
                         ("attn/query/kernel", model.attn.query.kernel),
                         ("down/kernel", model.down.kernel))}
        out[key]["collectives"] = st.summary(hlo)
  return out


@case
def layers_explicit():
  tokens = np.random.default_rng(3).integers(0, 128, (16, 9)).astype(np.int32)
  out = {}
  for sharded in (False, True):
    ctx = jax.set_mesh(st.mesh_for("tp", explicit=True)) if sharded else (
        contextlib.nullcontext())
    with ctx:
      model = _block(sharded)
      opt = st.optimizer(model)
      t = jax.device_put(tokens, P("data")) if sharded else jnp.asarray(
          tokens)
      losses, _ = st.train(model, opt, t, None, 2,
                           loss_fn=lambda m, t, _: _block_loss(m, t))
      out["tp" if sharded else "single"] = {"losses": losses}
  return out


class _Block(nnx.Module):

  def __init__(self, rngs, sharded):
    m = (lambda spec: {"out_sharding": spec}) if sharded else (
        lambda spec: {})
    self.embed = nnx.Embed(128, 64, rngs=rngs)
    self.attn = qlayers.QuantAttentionProj(
        64, 4, 16, rngs=rngs,
        kernel_metadata=m((None, "model", None)),
        out_kernel_metadata=m(("model", None, None)))
    self.mlp = qlayers.QuantEinsum("btd,dh->bth", (64, 256), (256,),
                                   rngs=rngs, kernel_metadata=m((None, "model")),
                                   bias_metadata=m(("model",)))
    self.proj = qlayers.QuantLinearGeneral(256, 64, rngs=rngs,
                                           kernel_metadata=m(("model", None)))
    self.head = qlayers.QuantLogits(64, 128, rngs=rngs, recipe="fp8_delayed",
                                    kernel_metadata=m((None, "model")))
    self.sharded = sharded

  def __call__(self, tokens):
    # An explicit-axes gather needs its output sharding spelled out.
    h = self.embed(tokens, out_sharding=P("data") if self.sharded else None)
    q, k, v = self.attn.qkv(h)
    h = h + self.attn.out(self.attn.attend(q, k, v, is_causal=True))
    return h + self.proj(jax.nn.gelu(self.mlp(h)))


def _block(sharded):
  return _Block(nnx.Rngs(0), sharded)


def _block_loss(model, tokens):
  return model.head.loss(model(tokens[:, :-1]), tokens[:, 1:], chunk_size=4)


# ----------------------------------------------------------------------------
# A mesh axis of size 1 named in a spec (Gemma's and MiniGPT's annotations on
# meshes such as (8, 1) or (1, 8)): the stock model trains, so must ours.


class _Pair(nnx.Module):
  """A stock Linear (converted by qlayers.quantize) and a QuantDense whose
  kernels name both mesh axes (no annotations without a mesh)."""

  def __init__(self, rngs, quantized, sharded):
    init = nnx.initializers.lecun_normal()
    wp = nnx.with_partitioning if sharded else (lambda f, spec: f)
    self.up = nnx.Linear(64, 128, rngs=rngs,
                         kernel_init=wp(init, (None, "tp")))
    if quantized:
      meta = {"out_sharding": (None, "tp")} if sharded else {}
      self.down = qlayers.QuantDense(128, 64, rngs=rngs, kernel_metadata=meta,
                                     recipe="fp8_current")
      qlayers.quantize(self, "fp8_current", rules=())
    else:
      self.down = nnx.Linear(128, 64, rngs=rngs,
                             kernel_init=wp(init, (None, "tp")))

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


@case
def size_one_axes():
  x, y = st.data()
  out = {}
  for shape in (None, (8, 1), (1, 8)):
    for quantized in (False, True):
      mesh = shape and jax.make_mesh(shape, ("fsdp", "tp"), axis_types=(
          jax.sharding.AxisType.Explicit,) * 2)
      with jax.set_mesh(mesh) if mesh else contextlib.nullcontext():
        model = _Pair(nnx.Rngs(0), quantized, mesh is not None)
        opt = st.optimizer(model, "nnx")
        xs = jax.device_put(x, P("fsdp")) if mesh else jnp.asarray(x)
        ys = jax.device_put(y, P("fsdp")) if mesh else jnp.asarray(y)
        losses, _ = st.train(model, opt, xs, ys, 2,
                             loss_fn=_stock_loss)
      out[f"{shape}/{'quantized' if quantized else 'stock'}"] = losses
  return out


class _Stack(nnx.Module):
  """Three fp8_delayed layers made under nnx.vmap, applied with nnx.scan."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return qlayers.QuantDense(16, 16, recipe="fp8_delayed", rngs=rngs)
    self.layers = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(layer, x):
      return jnp.tanh(layer(x))
    return body(self.layers, x)


@case
def stacked_delayed_built_under_a_mesh():
  """Built under the mesh (its state placed from inside nnx.vmap), the
  stack trains as off the mesh."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 16)),
                  jnp.float32)
  loss = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731
  out = {}
  for name in ("single", "mesh"):
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(
        jax.sharding.AxisType.Explicit,)) if name == "mesh" else None
    with jax.set_mesh(mesh) if mesh else contextlib.nullcontext():
      model = _Stack(nnx.Rngs(0))
      opt = qlayers.Optimizer(model, optax.sgd(0.1))
      xs = jax.device_put(x, P("fsdp")) if mesh else x

      @nnx.jit
      def step(model, opt, x):
        value, grads = qlayers.value_and_grad(loss)(model, x)
        opt.update(model, grads)
        return value
      out[name] = {"losses": [float(step(model, opt, xs)) for _ in range(2)],
                   "x_amax": np.asarray(model.layers.quant.x_amax[...]).tolist(),
                   "spec": str(jax.typeof(
                       model.layers.quant.x_amax_history[...]).sharding.spec)}
  return out


# ----------------------------------------------------------------------------
# Checkpoints of a sharded model and optimizer (qlayers.checkpoint as is).


@case
def checkpoint_roundtrip():
  x, y = st.data()
  with jax.set_mesh(st.mesh_for("fsdp_tp", explicit=True)):
    model = st.MLP("fp8_delayed", rngs=nnx.Rngs(0), layout="fsdp_tp")
    opt = st.optimizer(model)
    xs, ys = jax.device_put(x, P("fsdp")), jax.device_put(y, P("fsdp"))
    # One compiled step serves the trained model and the restored one (which
    # it takes only if the restored arrays have the same shardings).
    step, state = st.compile_step(model, opt, xs, ys)
    for _ in range(2):
      _, state = step(state, xs, ys)
    nnx.update((model, opt), state)
    path = tempfile.mkdtemp() + "/ckpt"
    qlayers.checkpoint.save(path, model, optimizer=opt)
    fresh = st.MLP("fp8_delayed", rngs=nnx.Rngs(1), layout="fsdp_tp")
    fresh_opt = st.optimizer(fresh)
    qlayers.checkpoint.restore(path, fresh, optimizer=fresh_opt)
    same = all(
        bool(np.array_equal(np.asarray(a), np.asarray(b)))
        for a, b in zip(jax.tree.leaves(nnx.state((model, opt))),
                        jax.tree.leaves(nnx.state((fresh, fresh_opt)))))
    a, _ = step(nnx.state((model, opt)), xs, ys)
    b, _ = step(nnx.state((fresh, fresh_opt)), xs, ys)
    return {"same_state": same, "next_loss": [float(a), float(b)],
            "specs": st.specs(nnx.state(fresh, nnx.Param))}



@case
def freeze_and_abstract_restore():
  """freeze of a kernel whose blocks its explicit shards split: an error
  naming it, nothing frozen; a checkpoint restored into an nnx.eval_shape
  target made under the mesh (was: reported as corrupt)."""
  out, whole = {}, {}
  for recipe in ("deepseek_v3", "nvfp4"):  # frozen on one device
    layer = qlayers.QuantDense(256, 512, recipe=recipe, rngs=nnx.Rngs(0))
    qlayers.freeze(layer)
    whole[recipe] = jax.tree.leaves(nnx.state(layer))
  with jax.set_mesh(st.mesh_for("fsdp_tp", explicit=True)):
    layer = qlayers.QuantDense(
        128, 256, recipe="deepseek_v3", rngs=nnx.Rngs(0),
        kernel_metadata={"out_sharding": ("fsdp", "model")})
    try:
      qlayers.freeze(layer)
      out["freeze"] = "frozen"
    except ValueError as e:
      out["freeze"] = str(e)
    out["still_param"] = isinstance(layer.kernel, nnx.Param)
    # Whole 128 x 128 and 16 x 16 blocks on every shard: frozen in place,
    # the unsharded freeze's codes (was: refused, a two-dim reshape).
    for recipe in ("deepseek_v3", "nvfp4"):
      sharded = qlayers.QuantDense(
          256, 512, recipe=recipe, rngs=nnx.Rngs(0),
          kernel_metadata={"out_sharding": ("fsdp", "model")})
      qlayers.freeze(sharded)
      out[f"in_place_{recipe}"] = all(
          bool(np.array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                              np.asarray(b).reshape(-1).view(np.uint8)))
          for a, b in zip(jax.tree.leaves(nnx.state(sharded)), whole[recipe]))
  # A per-tensor amax over any split: 16 of K = 128 per device (its
  # 32-element chunks crossed devices: refused as "cannot be quantized in
  # place").
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top
  layer = qlayers.QuantDense(128, 64, recipe="fp8_current", rngs=nnx.Rngs(0))
  qlayers.freeze(layer)
  whole["fp8_current"] = jax.tree.leaves(nnx.state(layer))
  with jax.set_mesh(jax.make_mesh((8,), ("fsdp",),
                                  axis_types=(AxisType.Explicit,))):
    sharded = qlayers.QuantDense(
        128, 64, recipe="fp8_current", rngs=nnx.Rngs(0),
        kernel_metadata={"out_sharding": ("fsdp", None)})
    qlayers.freeze(sharded)
    out["in_place_fp8_current"] = all(
        bool(np.array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                            np.asarray(b).reshape(-1).view(np.uint8)))
        for a, b in zip(jax.tree.leaves(nnx.state(sharded)),
                        whole["fp8_current"]))
  with jax.set_mesh(st.mesh_for("fsdp_tp", explicit=True)):
    model = st.MLP("fp8_delayed", rngs=nnx.Rngs(0), layout="fsdp_tp")
    path = tempfile.mkdtemp() + "/ckpt"
    qlayers.checkpoint.save(path, model)
    target = nnx.eval_shape(
        lambda: st.MLP("fp8_delayed", rngs=nnx.Rngs(1), layout="fsdp_tp"))
    qlayers.checkpoint.restore(path, target)
    out["same_state"] = all(
        bool(np.array_equal(np.asarray(a), np.asarray(b)))
        for a, b in zip(jax.tree.leaves(nnx.state(model)),
                        jax.tree.leaves(nnx.state(target))))
    out["specs"] = st.specs(nnx.state(target, nnx.Param))
  return out


@case
def frozen_lora_on_explicit_shards():
  """A LoRA step on frozen kernels (frozen before sharding, as README
  says), their codes sharded over explicit axes along K: the single-device
  input gradient, and planned for B200 the GEMM reads the codes and makes
  Dgrad's copy from them (was: NVFP4's 16 x 16 blocks failed to
  dequantize, a reshape JAX cannot shard; the codes were ignored)."""
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top
  import cast_kernels  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
  out = {r: cast_kernels.frozen_lora_dgrad_under(mesh, r)
         for r in ("mxfp8", "nvfp4")}
  return out


if __name__ == "__main__":
  case.main()
