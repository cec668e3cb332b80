"""Frozen quantized base weights: qlayers.freeze, FrozenKernel,
quantize(..., frozen=True)."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import qlayers
from qlayers import checkpoint, scaling
from qlayers.layers.frozen import CHECKPOINT_SPEC

from _support.helpers import Scanned


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint8 if x.dtype.itemsize == 1 else np.uint32)


X = jax.random.normal(jax.random.key(1), (4, 64), jnp.float32)


@nnx.jit
def apply(model, x):
  return model(x)


@pytest.mark.parametrize("recipe, bytes_per_weight", [
    ("fp8_current", 1 + 4 / (64 * 32)), ("mxfp8", 1 + 1 / 32),
    ("mxfp4", 0.5 + 1 / 32)])
def test_freeze_stores_payload_and_scales_only(recipe, bytes_per_weight):
  layer = qlayers.QuantDense(64, 32, recipe=recipe, rngs=nnx.Rngs(0))
  layer.bias[...] = jnp.arange(32, dtype=jnp.float32)
  before = apply(layer, X)
  assert qlayers.freeze(layer) == 1
  params = nnx.state(layer, nnx.Param)
  assert list(params) == ["bias"]  # no master kernel
  np.testing.assert_array_equal(layer.bias[...], np.arange(32))
  frozen = nnx.state(layer, qlayers.FrozenWeight)["kernel"]
  assert sorted(frozen) == ["payload", "scale"]
  assert layer.kernel.bytes_per_weight == bytes_per_weight
  assert layer.kernel.bytes_per_weight <= 0.55 * 2  # BF16: 2 bytes
  # The base GEMM runs on the stored payload: the MX recipes quantize the
  # dequantized kernel back to the same codes, so the output is the
  # unfrozen layer's bit for bit; per-tensor FP8 rescales within an ulp.
  after = apply(layer, X)
  if recipe.startswith("mx"):
    np.testing.assert_array_equal(_bits(after), _bits(before))
  else:
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8", "mxfp4",
                                    "fp8_delayed", "deepseek_v3"])
def test_recipe_format_requantizes_to_the_stored_values(recipe):
  layer = qlayers.QuantDense(256, 192, recipe=recipe, rngs=nnx.Rngs(0))
  qlayers.freeze(layer)
  deq = layer.kernel.dequantize()
  spec = layer.recipe.fprop.rhs
  again = scaling.quantize(deq.T, spec, axis=1).dequantize()
  np.testing.assert_array_equal(_bits(again.T), _bits(deq))


def test_no_gradient_and_no_optimizer_state_for_the_base(optax_promotion):
  layer = qlayers.QuantDense(64, 32, recipe="fp8_delayed", rngs=nnx.Rngs(0))
  qlayers.freeze(layer)
  payload = np.asarray(layer.kernel.payload[...]).copy()
  opt = qlayers.Optimizer(layer, optax.adam(1e-2))

  @nnx.jit
  def step(layer, opt, x):
    loss = lambda m: jnp.mean(m(x) ** 2)
    _, grads = qlayers.value_and_grad(loss)(layer)
    opt.update(layer, grads)
    return grads

  grads = step(layer, opt, X)
  assert list(nnx.state(grads, nnx.Param)) == ["bias"]
  shapes = {np.shape(x) for x in jax.tree.leaves(nnx.state(opt.opt_state))}
  assert (64, 32) not in shapes and (32, 64) not in shapes
  np.testing.assert_array_equal(_bits(layer.kernel.payload[...]),
                                payload.view(np.uint8))


def test_quantize_frozen_and_linear_general():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(64, 128, rngs=rngs)
      self.proj = nnx.LinearGeneral(128, (4, 32), rngs=rngs)

    def __call__(self, x):
      return self.proj(nnx.relu(self.up(x)))

  net = Net(nnx.Rngs(0))
  wide = apply(net, X)
  qlayers.quantize(net, "mxfp8", frozen=True)
  assert isinstance(net.up.kernel, qlayers.FrozenKernel)
  assert net.proj.kernel.shape == (128, 4, 32)
  assert net.proj.kernel.payload.shape == (128, 128)  # (N, K)
  assert sorted(nnx.state(net, nnx.Param)) == ["proj", "up"]  # biases
  assert all(list(v) == ["bias"] for v in nnx.state(net, nnx.Param).values())
  y = apply(net, X)
  assert y.shape == (4, 4, 32)
  assert float(jnp.abs(y - wide).max()) < 0.1 * float(jnp.abs(wide).max())


def test_quantize_frozen_refuses_a_wide_recipe_before_swapping():
  """A rule giving a layer a recipe that quantizes no weight cannot freeze
  it: refused before any layer is swapped (was: every layer swapped, none
  frozen, and a hint naming an argument quantize does not take)."""
  net = nnx.Sequential(nnx.Linear(64, 64, rngs=nnx.Rngs(0)),
                       nnx.Linear(64, 32, rngs=nnx.Rngs(1)))
  rules = [qlayers.Rule(pattern="^layers/1$", recipe="bf16")]
  with pytest.raises(ValueError, match=r"layers/1 \(bf16\).*nothing was"):
    qlayers.quantize(net, "fp8_current", rules, frozen=True)
  assert all(type(m) is nnx.Linear for m in net.layers)
  rules = [qlayers.Rule(pattern="^layers/1$", recipe=None)]  # stock, wide
  qlayers.quantize(net, "fp8_current", rules, frozen=True)
  assert isinstance(net.layers[0].kernel, qlayers.FrozenKernel)
  assert type(net.layers[1]) is nnx.Linear


def test_freeze_einsum():
  layer = qlayers.QuantEinsum("btd,dnh->btnh", (64, 4, 16), (4, 16),
                              recipe="mxfp8", rngs=nnx.Rngs(0))
  x = jnp.ones((2, 3, 64))
  before = apply(layer, x)
  assert qlayers.freeze(layer) == 1
  assert layer.kernel.payload.shape == (64, 64)  # (N, K)
  assert list(nnx.state(layer, nnx.Param)) == ["bias"]
  np.testing.assert_array_equal(_bits(apply(layer, x)), _bits(before))


def test_kernel_straight_from_an_fp8_checkpoint(tmp_path):
  w = np.asarray(jax.random.normal(jax.random.key(2), (192, 256)) * 0.1,
                 np.float32)  # (out, in) as HF stores it
  checkpoint.write_safetensors(tmp_path, {"proj.weight": w})
  raw = checkpoint.read_safetensors(tmp_path, quantized=True)["proj.weight"]
  layer = qlayers.QuantDense(256, 192, recipe="fp8_current", use_bias=False,
                             rngs=nnx.Rngs(0))
  layer.kernel = qlayers.FrozenKernel.from_qtensor(raw)
  assert layer.kernel.spec == CHECKPOINT_SPEC
  # Stored without the padding to whole 128 x 128 blocks (256 x 256).
  assert raw.payload.shape == (256, 256)
  assert layer.kernel.payload.shape == (192, 256)
  assert layer.kernel.bytes_per_weight == 1 + 4 * 2 * 2 / (192 * 256)
  np.testing.assert_array_equal(_bits(layer.kernel.payload[...]),
                                _bits(raw.payload[:192]))
  np.testing.assert_array_equal(_bits(layer.kernel.qtensor().payload),
                                _bits(raw.payload))
  deq = checkpoint.read_safetensors(tmp_path)["proj.weight"]
  np.testing.assert_array_equal(_bits(layer.kernel[...]), _bits(deq.T))
  wide = qlayers.QuantDense(256, 192, recipe="fp8_current", use_bias=False,
                            rngs=nnx.Rngs(0))
  wide.kernel[...] = jnp.asarray(deq.T)
  x = jnp.ones((2, 256), jnp.float32)
  np.testing.assert_array_equal(_bits(apply(layer, x)), _bits(apply(wide, x)))


def test_freeze_errors_and_checkpoint_round_trip(tmp_path):
  layer = qlayers.QuantDense(64, 32, recipe="bf16", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="recipe 'bf16' quantizes no weight"):
    qlayers.freeze(layer)
  assert qlayers.freeze(layer, spec=CHECKPOINT_SPEC) == 1
  @nnx.split_rngs(splits=3)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def stacked(rngs):
    return qlayers.QuantDense(64, 32, recipe="mxfp8", rngs=rngs)

  stack = stacked(nnx.Rngs(0))
  einsum = qlayers.QuantEinsum("bk,nk->bn", (32, 64), recipe="mxfp8",
                               rngs=nnx.Rngs(0))
  with pytest.warns(UserWarning, match=r"freeze: QuantEinsum \(QuantEinsum\)"
                                       r" keep their wide weights"):
    assert qlayers.freeze(einsum) == 0
  assert qlayers.freeze(stack) == 1 and stack.kernel.stack == (3,)
  layer = qlayers.QuantDense(64, 32, recipe="mxfp8", rngs=nnx.Rngs(0))
  qlayers.freeze(layer)
  with pytest.raises(ValueError, match=r"kernel shape \(3, 3\), expected"):
    layer.kernel.requantize(jnp.ones((3, 3)))
  d = checkpoint.save(tmp_path / "c", layer)
  other = qlayers.QuantDense(64, 32, recipe="mxfp8", rngs=nnx.Rngs(5))
  qlayers.freeze(other)
  checkpoint.restore(d, other)
  assert other.kernel.payload.dtype == ml_dtypes.float8_e4m3fn
  np.testing.assert_array_equal(_bits(other.kernel.payload[...]),
                                _bits(layer.kernel.payload[...]))
  np.testing.assert_array_equal(other.kernel.scale[...],
                                layer.kernel.scale[...])


def test_frozen_kernels_lists_the_frozen_layers():
  from qlayers.layers.frozen import frozen_kernels
  a = qlayers.QuantDense(64, 32, recipe="mxfp8", rngs=nnx.Rngs(0))
  b = qlayers.QuantDense(64, 32, recipe="mxfp8", rngs=nnx.Rngs(0))
  qlayers.freeze(a)
  assert [p for p, _ in frozen_kernels(nnx.List([a, b]))] == [(0,)]


def test_dequantize_model_gives_a_frozen_kernel_back_as_a_param():
  # It reported the layer converted to nnx.Linear, which still held the
  # FrozenKernel and had no kernel Param (a stock checkpoint could not load).
  model = nnx.Sequential(nnx.Linear(64, 32, rngs=nnx.Rngs(0),
                                    param_dtype=jnp.bfloat16))
  qlayers.quantize(model, "mxfp8", rules=(), frozen=True)
  frozen = model.layers[0].kernel.dequantize()
  qlayers.dequantize_model(model)
  layer = model.layers[0]
  assert type(layer) is nnx.Linear and isinstance(layer.kernel, nnx.Param)
  assert layer.kernel[...].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(layer.kernel[...], np.float32),
                                np.asarray(frozen, np.float32))
  assert sorted(nnx.state(model, nnx.Param)["layers"][0]) == ["bias",
                                                                "kernel"]


def test_a_frozen_kernel_restores_only_into_its_own_layout(tmp_path):
  # E3M2 and E2M3 payloads and scales have the same shapes and dtypes: an
  # E3M2 kernel restored into an E2M3 one decoded its bits as E2M3.
  def frozen(fmt):
    layer = qlayers.QuantDense(64, 32, recipe="mxfp6", rngs=nnx.Rngs(0))
    qlayers.freeze(layer, spec=scaling.QuantSpec(format=fmt,
                                                 granularity="mx"))
    return layer

  checkpoint.save(tmp_path / "c", frozen("e3m2"))
  target = frozen("e2m3")
  before = np.asarray(target.kernel.payload[...])
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match="(?s)frozen kernels stored in another layout.*e3m2"):
    checkpoint.restore(tmp_path / "c", target)
  np.testing.assert_array_equal(target.kernel.payload[...], before)
  assert checkpoint.restore(tmp_path / "c", frozen("e3m2"))["restored"] == \
      "full"


def test_a_bf16_layer_quantizes_a_checkpoint_kernel_from_its_stored_values(
    tmp_path):
  # FP32 block scales: the dequantized kernel rounded to the BF16 Param
  # dtype first was requantized off the stored codes (1.8e-3 relative).
  w = np.asarray(jax.random.normal(jax.random.key(0), (160, 200))
                 * jnp.linspace(0.01, 3, 160)[:, None], np.float32)
  d = checkpoint.write_safetensors(tmp_path / "c", {"fc.weight": w})
  tensors = checkpoint.read_safetensors(d, quantized=True)
  layer = qlayers.QuantDense(200, 160, recipe="deepseek_v3", use_bias=False,
                             param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  qlayers.hf.load_tensors(layer, tensors, {"kernel": "fc.weight"})
  stored = layer.kernel.dequantize(jnp.float32)
  ref = qlayers.QuantDense(200, 160, recipe="deepseek_v3", use_bias=False,
                           dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  ref.kernel.set_value(stored)
  x = jax.random.normal(jax.random.key(1), (4, 200), jnp.bfloat16)
  y = layer(x)
  assert y.dtype == jnp.bfloat16 and layer.kernel[...].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y, np.float32),
                                np.asarray(ref(x), np.float32))


def test_quantize_converts_a_stock_layer_holding_a_checkpoint_kernel(
    tmp_path):
  # load_tensors puts a FrozenKernel on a stock nnx.Linear too; quantize
  # then failed on its missing .ndim.
  w = np.asarray(jax.random.normal(jax.random.key(0), (32, 64)), np.float32)
  d = checkpoint.write_safetensors(tmp_path / "c", {"fc.weight": w})
  model = nnx.Dict(fc=nnx.Linear(64, 32, use_bias=False, rngs=nnx.Rngs(0)))
  qlayers.hf.load_tensors(model, checkpoint.read_safetensors(d,
                                                             quantized=True),
                          {"fc.kernel": "fc.weight"})
  x = jax.random.normal(jax.random.key(1), (4, 64))
  wide = model.fc(x)
  report = qlayers.quantize(model, "fp8_current", rules=())
  assert [c.path for c in report.converted] == ["fc"]
  assert type(model.fc.kernel).__name__ == "FrozenKernel"
  err = jnp.linalg.norm(model.fc(x) - wide) / jnp.linalg.norm(wide)
  assert 0 < err < 0.1


def test_freezing_a_delayed_layer_keeps_its_stored_codes_in_the_gemm():
  # The trained kernel's larger amaxes in the weight history scaled the
  # frozen kernel again: every stored code was rounded a second time.
  layer = qlayers.QuantDense(64, 32, recipe="fp8_delayed", rngs=nnx.Rngs(0))
  amax = float(jnp.max(jnp.abs(layer.kernel[...])))
  history = layer.quant.w_amax_history
  history.set_value(history[...].at[:3].set([1.5 * amax, 2 * amax, amax]))
  qlayers.freeze(layer)
  stored = layer.kernel.dequantize(jnp.float32)
  a = float(jnp.max(jnp.abs(stored)))
  np.testing.assert_array_equal(layer.quant.w_amax_history[...], a)
  spec = layer.recipe.fprop.rhs
  again = scaling.quantize(stored.T, spec, axis=1, amax=jnp.float32(a))
  np.testing.assert_array_equal(np.asarray(again.payload).view(np.uint8),
                                np.asarray(layer.kernel.payload[...]
                                           ).view(np.uint8))


def test_a_frozen_nvfp4_kernel_stores_the_codes_its_gemm_uses():
  # A quiet 16x16 block beside a large tensor amax has a subnormal E4M3
  # scale: the GEMM's requantization of the stored kernel moved 70 of 512
  # weights by 25%.
  w = np.zeros((32, 16), np.float32)
  w[0, 0] = 40.0
  w[16:, :] = np.linspace(-1, 1, 256).reshape(16, 16) * 2.79e-4
  layer = qlayers.QuantDense(32, 16, recipe="nvfp4", use_bias=False,
                             rngs=nnx.Rngs(0))
  layer.kernel[...] = jnp.asarray(w)
  qlayers.freeze(layer)
  stored = layer.kernel.dequantize(jnp.float32)
  used = scaling.quantize(stored.T, layer.recipe.fprop.rhs, 1).dequantize(
      jnp.float32).T
  np.testing.assert_array_equal(used, stored)
  assert float(jnp.abs(stored[16:]).max()) > 0  # the quiet block is kept


def test_merging_into_a_frozen_delayed_layer_keeps_the_codes_its_gemm_uses():
  # merge_lora stored a kernel of another amax under the old history: the
  # GEMM rounded every merged code again.
  layer = qlayers.QuantDense(64, 32, recipe="fp8_delayed", use_bias=False,
                             rngs=nnx.Rngs(0))
  qlayers.freeze(layer)
  qlayers.add_lora(layer, 4, rngs=nnx.Rngs(1))
  layer.lora.lora_b[...] = (0.05 * jax.random.normal(
      jax.random.key(2), layer.lora.lora_b.shape)).astype(
          layer.lora.lora_b.dtype)
  qlayers.merge_lora(layer)
  stored = layer.kernel.dequantize(jnp.float32)
  a = float(jnp.max(jnp.abs(stored)))
  np.testing.assert_array_equal(layer.quant.w_amax_history[...], a)


def test_a_stock_layer_running_a_quant_gemm_is_named_not_ignored():
  """nnx.Linear(dot_general=QuantGemm(...)) is no qlayers layer: freeze,
  add_lora and dequantize_model leave it, and now say so (they were
  silent, and add_lora said to quantize the model)."""
  model = nnx.Sequential(nnx.Linear(32, 32, rngs=nnx.Rngs(0),
                                    dot_general=qlayers.QuantGemm("mxfp8")))
  with pytest.warns(UserWarning, match="layers/0 \\(a stock layer running"):
    assert qlayers.freeze(model) == 0
  with pytest.raises(ValueError, match="layers.0 \\(a stock layer running"):
    qlayers.add_lora(model, 2, rngs=nnx.Rngs(1))
  report = qlayers.dequantize_model(model)
  assert [(s.path, s.reason.split(":")[0]) for s in report.skipped] == [
      ("layers/0", "runs a QuantGemm given it by hand")]


def _sub_jaxprs(params):
  for value in params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, jax.extend.core.ClosedJaxpr):
        yield v.jaxpr
      elif isinstance(v, jax.extend.core.Jaxpr):
        yield v


def _weight_uses_in_forward(layer, x):
  """The primitives that read the wide weight inside the GEMM's forward."""
  graph, state = nnx.split(layer)
  jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graph, s)(x))(state, x)
  todo, found = [jaxpr.jaxpr], []
  while todo:
    for eqn in todo.pop().eqns:
      if eqn.params.get("name") == "_qmm_forward":
        found.append(eqn.params["jaxpr"].jaxpr)
      todo.extend(_sub_jaxprs(eqn.params))
  inner, = found
  w = inner.invars[1]
  return {e.primitive.name for e in inner.eqns if w in e.invars}


@pytest.mark.parametrize("recipe", [
    "fp8_current", "fp8_delayed", "fp8_rowwise", "deepseek_v3",
    "deepseek_v3_ue8m0", "mxfp8", "mxfp6", "mxfp4", "mxfp4_rht", "nvfp4"])
def test_the_gemm_reads_a_frozen_kernel_as_stored(recipe, monkeypatch):
  # The GEMM quantized the frozen kernel's FP32 dequantization again on
  # every call (a 4-byte pass per weight where the codes are 1 byte or
  # less): it now reads the stored codes, the same bits.
  layer = qlayers.QuantDense(256, 96, recipe=recipe, rngs=nnx.Rngs(0))
  qlayers.freeze(layer)
  qlayers.add_lora(layer, 4, rngs=nnx.Rngs(1))
  layer.lora.lora_b[...] = jnp.full(layer.lora.lora_b.shape, 0.01,
                                    layer.lora.lora_b.dtype)
  x = jax.random.normal(jax.random.key(2), (16, 256), jnp.float32)
  reads = _weight_uses_in_forward(layer, x)
  # Only a delayed recipe's running amax still reads it (one reduction).
  assert reads <= ({"bitcast_convert_type", "abs", "reduce_max"}
                   if recipe == "fp8_delayed" else set()), reads

  def loss(model, x):
    return jnp.sum(model(x) ** 2)

  def grads():  # of a copy: a step-keyed rounding counter moves per call
    return nnx.grad(loss, argnums=(nnx.DiffState(
        0, (nnx.Param, qlayers.QuantGradState)), 1))(nnx.clone(layer), x)

  (lora, dx), y = grads(), nnx.clone(layer)(x)  # eager: traced anew
  monkeypatch.setattr(type(layer), "stored_kernel", lambda self: None)
  assert _weight_uses_in_forward(layer, x) - {"bitcast_convert_type"}
  (lora_0, dx_0), y_0 = grads(), nnx.clone(layer)(x)
  np.testing.assert_array_equal(_bits(y), _bits(y_0))
  np.testing.assert_array_equal(_bits(dx), _bits(dx_0))
  for a, b in zip(jax.tree.leaves(lora), jax.tree.leaves(lora_0)):
    np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("make, x_shape", [
    (lambda r: qlayers.QuantLinearGeneral(
        (8, 32), (4, 24), axis=(-2, -1), recipe=r, rngs=nnx.Rngs(0)),
     (2, 8, 32)),
    (lambda r: qlayers.QuantEinsum("btd,dnh->btnh", (256, 4, 24), recipe=r,
                                   rngs=nnx.Rngs(0)), (2, 8, 256))],
    ids=["linear_general", "einsum"])
def test_general_layers_read_a_frozen_kernel_as_stored(make, x_shape,
                                                       monkeypatch):
  layer = make("mxfp8")
  qlayers.freeze(layer)
  x = jax.random.normal(jax.random.key(2), x_shape, jnp.float32)
  assert not _weight_uses_in_forward(layer, x)
  y = layer(x)  # eager: traced anew
  monkeypatch.setattr(type(layer), "stored_kernel", lambda self: None)
  assert _weight_uses_in_forward(layer, x)
  np.testing.assert_array_equal(_bits(y), _bits(layer(x)))


def test_a_stored_weight_of_another_shape_is_refused():
  w = jnp.ones((64, 32))
  q = scaling.quantize(w, qlayers.recipe("mxfp8").fprop.rhs, 1)
  with pytest.raises(ValueError, match=r"w_quantized must be a QTensor of "
                     r"w.T \(32, 64\)"):
    qlayers.ops.quantized_matmul(jnp.ones((2, 64)), w, "mxfp8",
                                 w_quantized=q)


def test_a_frozen_nvfp4_kernel_keeps_both_scale_levels(tmp_path):
  # Its scales were stored as their FP32 product, which NVFP4's GEMM cannot
  # take apart: the GEMM requantized the kernel on every call.
  layer = qlayers.QuantDense(64, 32, recipe="nvfp4", rngs=nnx.Rngs(0))
  qlayers.freeze(layer)
  k = layer.kernel
  want = scaling.quantize(k.dequantize().T, layer.recipe.fprop.rhs, 1)
  assert k.scale.dtype == jnp.float8_e4m3fn and k.tensor_scale.shape == ()
  assert k.bytes_per_weight == (64 * 32 / 2 + 4 * 2 + 4) / (64 * 32)
  q = k.qtensor()
  np.testing.assert_array_equal(_bits(q.block_scale), _bits(want.block_scale))
  np.testing.assert_array_equal(q.tensor_scale, want.tensor_scale)
  np.testing.assert_array_equal(q.scale, want.scale)
  d = checkpoint.save(tmp_path / "c", layer)
  other = qlayers.QuantDense(64, 32, recipe="nvfp4", rngs=nnx.Rngs(5))
  qlayers.freeze(other)
  checkpoint.restore(d, other)
  for a, b in zip(jax.tree.leaves(other.kernel.qtensor()),
                  jax.tree.leaves(q)):
    np.testing.assert_array_equal(_bits(a), _bits(b))


def test_a_checkpoint_kernel_is_read_with_its_own_codes(monkeypatch):
  # Codes that are not the fixed point of the recipe's quantization (a
  # block whose largest code is 320, not 448): read as stored, the GEMM
  # multiplies the checkpoint's own weights; requantized, every code moves.
  rng = np.random.default_rng(0)
  w = rng.standard_normal((128, 128)).astype(np.float32)
  codes = (w / np.abs(w).max() * 320).astype(ml_dtypes.float8_e4m3fn)
  qt = scaling.QTensor(jnp.asarray(codes), jnp.full((1, 1), 1e-3),
                       "e4m3", "block", (128, 128), 1, (128, 128))
  layer = qlayers.QuantDense(128, 128, use_bias=False, recipe="deepseek_v3",
                             rngs=nnx.Rngs(0))
  layer.kernel = qlayers.FrozenKernel.from_qtensor(qt)
  x = jnp.ones((2, 128), jnp.float32)  # its 1x128 tiles quantize exactly
  exact = np.asarray(x) @ np.asarray(layer.kernel[...], np.float64)
  np.testing.assert_allclose(layer(x), exact, rtol=2e-6, atol=1e-6)
  monkeypatch.setattr(type(layer), "stored_kernel", lambda self: None)
  assert np.abs(np.asarray(layer(x)) - exact).max() > 1e-3


@pytest.mark.parametrize("stored, spec", [("fp8", "nvfp4"), ("nvfp4", "fp8")])
def test_requantize_into_a_spec_of_other_scale_levels(stored, spec):
  # A kernel stored with one scale level requantized into NVFP4's two (or
  # back) had nowhere to keep the tensor scale, or read one it lacked.
  nv = qlayers.recipe("nvfp4").fprop.rhs
  specs = {"fp8": CHECKPOINT_SPEC, "nvfp4": nv}
  w = jax.random.normal(jax.random.key(0), (256, 128))
  k = qlayers.FrozenKernel.from_qtensor(
      scaling.quantize(w.T, specs[stored], 1), spec=specs[spec])
  k.requantize(w)
  want = qlayers.FrozenKernel.quantize(w, specs[spec])
  np.testing.assert_array_equal(k.dequantize(), want.dequantize())
  assert (k.tensor_scale is None) == (spec == "fp8")


@pytest.mark.parametrize("arch", ["cpu", "sm_100"])
def test_a_differentiated_call_reads_the_same_stored_codes(arch):
  # NVFP4 codes that are not the fixed point of its quantization (every
  # E2M1 6 made 4): a training forward planned for B200, whose pair kernel
  # makes Dgrad's copy, requantized them, so it ran on other weights than
  # the eval forward.
  from qlayers import table
  spec = qlayers.recipe("nvfp4").fprop.rhs
  w = jax.random.normal(jax.random.key(0), (128, 64))
  qt = scaling.quantize(w.T, spec, 1)
  p = np.asarray(qt.payload)
  lo, hi = p & 15, p >> 4
  six_to_four = lambda n: np.where(n & 7 == 7, n - 1, n)  # noqa: E731
  qt = dataclasses.replace(qt, payload=jnp.asarray(
      (six_to_four(lo) | six_to_four(hi) << 4).astype(np.uint8)))
  layer = qlayers.QuantDense(128, 64, recipe="nvfp4", use_bias=False,
                             rngs=nnx.Rngs(0))
  layer.kernel = qlayers.FrozenKernel.from_qtensor(qt, spec=spec)
  x = jax.random.normal(jax.random.key(1), (8, 128))

  def loss(model, x):
    y = model(x)
    return jnp.sum(y ** 2), y

  with (table.target_arch(arch) if arch != "cpu"
        else contextlib.nullcontext()):
    y_eval = nnx.clone(layer)(x)
    (_, y_train), _ = nnx.value_and_grad(loss, argnums=1, has_aux=True)(
        nnx.clone(layer), x)
  np.testing.assert_array_equal(_bits(y_train), _bits(y_eval))


def test_quantize_frozen_of_a_model_with_nothing_to_freeze():
  """quantize(..., frozen=True) where nothing freezable is converted (only
  experts, whose kernels freeze does not take; or every layer kept wide)
  returns its report (an early form of freeze's new check raised there,
  after the swap: found by review)."""
  class Experts(nnx.Module):
    def __init__(self):
      self.kernel = nnx.Param(jnp.ones((2, 64, 32)) * 0.1)
      self.ragged_dot = jax.lax.ragged_dot
    def __call__(self, x):
      return self.ragged_dot(x, self.kernel[...], jnp.array([2, 2]))
  model = nnx.Sequential(Experts())
  with pytest.warns(UserWarning, match=r"layers/0 \(experts: a grouped "
                    r"GEMM\) keep their wide weights"):
    report = qlayers.quantize(model, "mxfp8", frozen=True)
  assert [c.path for c in report.converted] == ["layers/0"]
  assert isinstance(model.layers[0].kernel, nnx.Param)  # experts: not frozen
  model = nnx.Sequential(nnx.Linear(64, 32, rngs=nnx.Rngs(0)))
  report = qlayers.quantize(model, "mxfp8", frozen=True,
                            rules=[qlayers.Rule(pattern="", recipe=None)])
  assert not report.converted


def test_freeze_refuses_what_it_would_not_freeze():
  """freeze returned 0 in silence for a model without qlayers layers, for
  something not a module, and for a spec its frozen kernels were not
  stored in; a kernel of no weights failed on a division by zero."""
  with pytest.raises(TypeError, match="takes an nnx.Module, got str"):
    qlayers.freeze("model")
  with pytest.raises(ValueError, match="no qlayers layer to freeze"):
    qlayers.freeze(nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0))))
  layer = qlayers.QuantDense(64, 32, recipe="mxfp8", rngs=nnx.Rngs(0))
  assert qlayers.freeze(layer) == 1
  assert qlayers.freeze(layer) == 0  # frozen already, as asked
  mxfp4 = qlayers.recipe("mxfp4").fprop.rhs
  with pytest.raises(ValueError, match="frozen already as .*dequantize_model"):
    qlayers.freeze(layer, spec=mxfp4)
  assert layer.kernel.spec == qlayers.recipe("mxfp8").fprop.rhs
  empty = qlayers.QuantDense(0, 8, recipe="mxfp8", rngs=nnx.Rngs(0),
                             kernel_init=nnx.initializers.zeros)
  with pytest.raises(ValueError, match=r"shape \(0, 8\) has no weights"):
    qlayers.freeze(empty)


def test_a_stochastically_rounded_kernel_freezes_with_a_key():
  """A spec rounding stochastically asked for a `key` freeze could not
  take; it now takes one, and each layer draws from its own fold."""
  spec = dataclasses.replace(qlayers.recipe("mxfp4").fprop.rhs,
                             rounding="stochastic")
  def model():
    return nnx.Sequential(
        qlayers.QuantDense(64, 32, recipe="mxfp4", rngs=nnx.Rngs(0)),
        qlayers.QuantDense(64, 32, recipe="mxfp4", rngs=nnx.Rngs(0)))
  m = model()
  with pytest.raises(ValueError, match="stochastic rounding.*key="):
    qlayers.freeze(m, spec=spec)
  assert isinstance(m.layers[0].kernel, nnx.Param)  # nothing frozen
  assert qlayers.freeze(m, spec=spec, key=jax.random.key(3)) == 2
  again = model()
  qlayers.freeze(again, spec=spec, key=jax.random.key(3))
  a, b = (l.kernel.payload[...] for l in m.layers)
  np.testing.assert_array_equal(_bits(a), _bits(again.layers[0].kernel
                                                .payload[...]))
  assert not np.array_equal(_bits(a), _bits(b))  # one weight, two draws
  nearest = qlayers.QuantDense(64, 32, recipe="mxfp4", rngs=nnx.Rngs(0))
  qlayers.freeze(nearest)
  assert not np.array_equal(_bits(a), _bits(nearest.kernel.payload[...]))
  mixed = nnx.Sequential(nearest, m.layers[1])
  qlayers.add_lora(mixed, 2, rngs=nnx.Rngs(1))
  before = _bits(nearest.kernel.payload[...])
  with pytest.raises(ValueError, match="layers/1 .*stochastic rounding.*key="):
    qlayers.merge_lora(mixed)
  # Nothing merged before the refusal (was: layer 0 merged, then it raised).
  assert all(l.lora is not None for l in mixed.layers)
  np.testing.assert_array_equal(_bits(nearest.kernel.payload[...]), before)
  assert qlayers.merge_lora(mixed, key=jax.random.key(4)) == 2
  base = qlayers.recipe("mxfp4")
  drawn = base.replace(fprop=dataclasses.replace(base.fprop, rhs=spec))
  stock = nnx.Sequential(nnx.Linear(64, 32, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="stochastic rounding.*nothing was "
                     "changed.*freeze\\(model, key="):
    qlayers.quantize(stock, drawn, frozen=True)
  assert type(stock.layers[0]) is nnx.Linear
  # A layer quantized so already is checked too, before any swap.
  stock = nnx.Sequential(
      qlayers.QuantDense(64, 32, recipe=drawn, rngs=nnx.Rngs(0)),
      nnx.Linear(64, 32, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="layers/0 .*nothing was changed"):
    qlayers.quantize(stock, "mxfp4", frozen=True)
  assert type(stock.layers[1]) is nnx.Linear


def test_quantize_frozen_stores_stacks_and_leaves_batched_kernels():
  # A model with nnx.vmap-stacked layers was refused; a batched
  # LinearGeneral (batch_axis) is no stack: it stays stock, as unfrozen.
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(64, 128, rngs=rngs)

  @nnx.split_rngs(splits=3)
  @nnx.vmap(in_axes=0, out_axes=0)
  def stack(rngs):
    return Block(rngs)

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.blocks = stack(rngs)
      self.batched = nnx.LinearGeneral(64, 128, batch_axis={0: 3},
                                       rngs=rngs)

  model = Model(nnx.Rngs(1))
  report = qlayers.quantize(model, "fp8_current", frozen=True)
  assert [c.path for c in report.converted] == ["blocks/up"]
  assert "batch_axis" in str(report)
  assert model.blocks.up.kernel.shape == (3, 64, 128)
  assert model.blocks.up.kernel.payload.shape == (3, 128, 64)
  assert type(model.batched) is nnx.LinearGeneral
  # Not stacks: an embedding a rule quantizes (no kernel), the experts'
  # batched einsum (freeze leaves both as they are).
  class Other(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(256, 64, rngs=rngs)
      self.experts = nnx.Einsum("ecd,edf->ecf", (4, 64, 64), rngs=rngs)
      self.up = nnx.Linear(64, 64, rngs=rngs)

  other = Other(nnx.Rngs(0))
  with pytest.warns(UserWarning, match="experts .*keep their wide weights"):
    qlayers.quantize(other, "fp8_current", frozen=True, rules=[
        qlayers.Rule(pattern="embed", recipe="fp8_current")])
  assert isinstance(other.up.kernel, qlayers.FrozenKernel)
  assert type(other.embed).__name__ == "QuantEmbed"
  assert type(other.experts).__name__ == "QuantExpertsEinsum"


@pytest.mark.parametrize("recipe, make", [
    ("mxfp4", lambda rngs: nnx.Linear(64, 64, rngs=rngs)),
    ("nvfp4", lambda rngs: nnx.Linear(64, 64, rngs=rngs)),
    ("fp8_delayed", lambda rngs: nnx.Einsum("bd,df->bf", (64, 64), (64,),
                                            rngs=rngs))])
def test_a_stack_of_layers_freezes_layer_by_layer(recipe, make):
  """A model scanned over its layers (was refused; a stacked einsum was
  once frozen with its stack dim as its input): each layer's codes and
  scales are what freezing it alone stores, and nnx.scan runs each layer's
  GEMM on its own codes, bit for bit the GEMM of their dequantized
  values."""
  model = Scanned(make, nnx.Rngs(0))
  wide = np.asarray(model.layers.kernel[...])
  qlayers.quantize(model, recipe, frozen=True)
  kernel = model.layers.kernel
  assert isinstance(kernel, qlayers.FrozenKernel)
  assert kernel.stack == (3,) and kernel.shape == (3, 64, 64)
  levels = [v for v in (kernel.payload, kernel.scale, kernel.tensor_scale)
            if v is not None]
  for i in range(3):
    alone = qlayers.FrozenKernel.quantize(wide[i], kernel.spec)
    assert alone.bytes_per_weight == kernel.bytes_per_weight
    mine = [alone.payload, alone.scale, alone.tensor_scale]
    for got, want in zip(levels, mine):
      np.testing.assert_array_equal(_bits(got[...][i]), _bits(want[...]))
  stored = kernel.dequantize(jnp.float32)
  assert stored.shape == (3, 64, 64)
  with pytest.raises(ValueError, match=r"stack of layers \(3, 64, 64\)"):
    kernel.qtensor()
  if recipe == "fp8_delayed":  # each layer's weight amax, its own
    np.testing.assert_array_equal(model.layers.quant.w_amax[...],
                                  jnp.max(jnp.abs(stored), axis=(1, 2)))
  # The scan, against the same stack with its dequantized kernel as Params.
  reference = Scanned(make, nnx.Rngs(0))
  qlayers.quantize(reference, recipe)
  reference.layers.kernel[...] = stored
  np.testing.assert_array_equal(_bits(apply(model, X)),
                                _bits(apply(reference, X)))
  # Its own codes are a fixed point: requantized, nothing changes.
  before = [np.asarray(v[...]) for v in levels]
  kernel.requantize(stored)
  for v, b in zip(levels, before):
    np.testing.assert_array_equal(_bits(v[...]), _bits(b))
  back = qlayers.dequantize_model(model)
  assert back.converted and isinstance(model.layers.kernel, nnx.Param)
  np.testing.assert_array_equal(model.layers.kernel[...], stored)


def test_a_stack_rounded_stochastically_draws_per_layer():
  """Three equal layers stored with stochastic rounding draw their own
  bits each (one key per layer), and the stack's names lead its codes'."""
  spec = scaling.QuantSpec(format="e2m1", granularity="mx",
                           rounding="stochastic")
  mesh = jax.make_mesh((1, 1), ("layers", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)

  @nnx.split_rngs(splits=3)
  @nnx.vmap(in_axes=0, out_axes=0,
            transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make(rngs):
    return qlayers.QuantDense(
        64, 64, recipe="mxfp4", rngs=nnx.Rngs(0),
        kernel_metadata={"out_sharding": (None, "model")})

  with jax.set_mesh(mesh):
    stack = make(nnx.Rngs(0))
  same = np.asarray(stack.kernel[...])
  np.testing.assert_array_equal(same[0], same[1])
  with pytest.raises(ValueError, match="PRNG key"):
    qlayers.freeze(stack, spec=spec)
  qlayers.freeze(stack, spec=spec, key=jax.random.key(7))
  codes = _bits(stack.kernel.payload[...])
  assert not np.array_equal(codes[0], codes[1])
  assert not np.array_equal(codes[1], codes[2])
  specs = nnx.get_partition_spec(nnx.state(stack))["kernel"]
  assert specs["payload"].get_value() == jax.P("layers", "model", None)
  assert specs["scale"].get_value() == jax.P("layers", "model", None)


def test_a_frozen_kernel_keeps_its_sharding_names(tmp_path):
  """The payload (N, K) and a scale per row of K's blocks carry the
  kernel's mesh axis names, reversed (they had none: a sharding-guide
  reshard or an abstract restore replicated the frozen base)."""
  mesh = jax.make_mesh((1, 1), ("fsdp", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    dense = qlayers.QuantDense(
        64, 32, recipe="mxfp8", rngs=nnx.Rngs(0),
        kernel_metadata={"out_sharding": ("fsdp", "model")})
    general = qlayers.QuantLinearGeneral(
        (4, 16), (2, 16), axis=(-2, -1), recipe="fp8_current",
        rngs=nnx.Rngs(0),
        kernel_metadata={"out_sharding": ("fsdp", None, "model", None)})
    blocks = qlayers.QuantDense(
        256, 256, recipe="deepseek_v3", rngs=nnx.Rngs(0),
        kernel_metadata={"out_sharding": (None, "model")})
  for layer in (dense, general, blocks):
    qlayers.freeze(layer)
  specs = nnx.get_partition_spec(nnx.state(dense))["kernel"]
  assert specs["payload"].get_value() == jax.P("model", "fsdp")
  assert specs["scale"].get_value() == jax.P("model", None)
  specs = nnx.get_partition_spec(nnx.state(general))["kernel"]
  assert specs["payload"].get_value() == jax.P("model", "fsdp")
  assert specs["scale"].get_value() == jax.P()  # per tensor
  specs = nnx.get_partition_spec(nnx.state(blocks))["kernel"]
  assert specs["payload"].get_value() == jax.P("model", None)
  assert specs["scale"].get_value() == jax.P()  # 128 x 128 blocks: few
  # A NamedSharding as the names (was: not iterable); a flattened dim named
  # by a minor dim only is not split as the kernel was: left unnamed.
  named = qlayers.QuantDense(
      64, 32, recipe="mxfp8", rngs=nnx.Rngs(0),
      kernel_metadata={"out_sharding": jax.sharding.NamedSharding(
          mesh, jax.P("fsdp", "model"))})
  with jax.set_mesh(mesh):
    minor = qlayers.QuantLinearGeneral(
        64, (2, 16), axis=-1, recipe="mxfp8", rngs=nnx.Rngs(0),
        kernel_metadata={"out_sharding": ("fsdp", None, "model")})
  for layer in (named, minor):
    qlayers.freeze(layer)
  spec = nnx.get_partition_spec(nnx.state(named))["kernel"]["payload"]
  assert spec.get_value() == jax.P("model", "fsdp")
  spec = nnx.get_partition_spec(nnx.state(minor))["kernel"]["payload"]
  assert spec.get_value() == jax.P(None, "fsdp")
  # A kernel loaded straight from a checkpoint keeps them too, and so does
  # a requantized one (merge_lora).
  from qlayers import hf
  w = np.asarray(jax.random.normal(jax.random.key(0), (128, 256)) * 0.1,
                 np.float32)
  d = checkpoint.write_safetensors(tmp_path / "w", {"fc.weight": w},
                                   fp8_block=(128, 128))
  with jax.set_mesh(mesh):
    loaded = qlayers.QuantDense(
        256, 128, recipe="deepseek_v3", use_bias=False, rngs=nnx.Rngs(0),
        kernel_metadata={"out_sharding": ("fsdp", "model")})
  hf.load_tensors(loaded, checkpoint.read_safetensors(d, quantized=True),
                  {"kernel": "fc.weight"})
  assert isinstance(loaded.kernel, qlayers.FrozenKernel)
  qlayers.add_lora(loaded, 2, rngs=nnx.Rngs(1))
  qlayers.merge_lora(loaded)
  spec = nnx.get_partition_spec(nnx.state(loaded))["kernel"]["payload"]
  assert spec.get_value() == jax.P("model", "fsdp")
