"""LoRA adapters beside frozen quantized base weights: add_lora, training
LoRAParams only, adapter checkpoints, merge_lora + requantize + export."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qlayers
from qlayers import checkpoint, safetensors
from qlayers.layers.frozen import CHECKPOINT_SPEC, FrozenKernel

from _support.helpers import Scanned


class Net(nnx.Module):
  def __init__(self, recipe, rngs):
    self.up = qlayers.QuantDense(64, 128, recipe=recipe, rngs=rngs)
    self.norm = nnx.RMSNorm(128, rngs=rngs)
    self.down = qlayers.QuantDense(128, 32, recipe=recipe, rngs=rngs)

  def __call__(self, x):
    return self.down(self.norm(nnx.relu(self.up(x))))


def _net(recipe="fp8_delayed"):
  net = Net(recipe, nnx.Rngs(0))
  qlayers.freeze(net)
  assert qlayers.add_lora(net, 4, rngs=nnx.Rngs(1)) == 2
  return net


def _bits(x):
  x = np.asarray(x)
  return x.view(f"u{x.dtype.itemsize}")


X = jax.random.normal(jax.random.key(1), (8, 64), jnp.float32)
Y = jax.random.normal(jax.random.key(2), (8, 32), jnp.float32)


@nnx.jit
def train_step(net, opt, x, y):
  loss_fn = lambda m: jnp.mean((m(x) - y) ** 2)
  loss, grads = qlayers.value_and_grad(loss_fn, wrt=nnx.LoRAParam)(net)
  opt.update(net, grads)
  return loss, grads


def test_lora_only_training(optax_promotion, tmp_path):
  net = _net()
  assert net.up.lora.lora_a.dtype == jnp.bfloat16
  frozen = {p: np.asarray(v.get_value()).copy() for p, v in
            nnx.to_flat_state(nnx.state(net, qlayers.FrozenWeight))}
  # Biases and the norm's scale: Params, but not trained.
  others = {p: np.array(v.get_value()) for p, v in nnx.to_flat_state(
      nnx.state(net, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))}
  opt = qlayers.Optimizer(net, optax.adam(3e-2), wrt=nnx.LoRAParam)
  losses = []
  for _ in range(6):
    loss, grads = train_step(net, opt, X, Y)
    losses.append(float(loss))
  # Gradients reach only the adapters (and the gradient amax state).
  assert {p[-1] for p, _ in nnx.to_flat_state(nnx.state(grads, nnx.Param))
          } == {"lora_a", "lora_b"}
  assert losses[-1] < 0.9 * losses[0], losses
  for p, v in nnx.to_flat_state(nnx.state(net, qlayers.FrozenWeight)):
    np.testing.assert_array_equal(_bits(v.get_value()), _bits(frozen[p]))
  assert len(others) == 3
  for p, v in nnx.to_flat_state(nnx.state(
      net, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))):
    np.testing.assert_array_equal(v.get_value(), others[p])
  assert float(jnp.abs(net.up.lora.lora_b[...]).max()) > 0  # it moved
  # The whole training state (frozen base, adapters, their optimizer) goes
  # through an orbax checkpoint too.
  d = checkpoint.save(tmp_path / "c", net, optimizer=opt)
  net2 = _net()
  opt2 = qlayers.Optimizer(net2, optax.adam(3e-2), wrt=nnx.LoRAParam)
  assert checkpoint.restore(d, net2, optimizer=opt2)["restored"] == "full"
  for a, b in zip(jax.tree.leaves(nnx.state((net, opt))),
                  jax.tree.leaves(nnx.state((net2, opt2)))):
    np.testing.assert_array_equal(_bits(a), _bits(b))


def test_adapter_checkpoint_round_trip(tmp_path):
  net = _net("mxfp8")
  for _, layer in qlayers.lora.lora_layers(net):
    layer.lora.lora_b[...] = jax.random.normal(
        jax.random.key(3), layer.lora.lora_b.shape, jnp.bfloat16)
  f = checkpoint.save_adapters(tmp_path / "adapters.safetensors", net)
  assert sorted(safetensors.read_file(f)) == [
      "down.lora.lora_a", "down.lora.lora_b", "up.lora.lora_a",
      "up.lora.lora_b"]
  other = Net("mxfp8", nnx.Rngs(0))
  qlayers.freeze(other)
  qlayers.add_lora(other, 4, rngs=nnx.Rngs(7))
  assert checkpoint.load_adapters(f, other)[0] == "down.lora.lora_a"
  for (p, a), (_, b) in zip(
      nnx.to_flat_state(nnx.state(net, nnx.LoRAParam)),
      nnx.to_flat_state(nnx.state(other, nnx.LoRAParam))):
    assert a.dtype == b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bits(a.get_value()), _bits(b.get_value()))
  wrong = Net("mxfp8", nnx.Rngs(0))
  qlayers.add_lora(wrong, 2, rngs=nnx.Rngs(7))
  with pytest.raises(ValueError, match=r"up.lora.lora_a: file bfloat16\[64, "
                                       r"4\], model bfloat16\[64, 2\]"):
    checkpoint.load_adapters(f, wrong)


def test_merge_requantizes_and_exports(tmp_path):
  w = np.asarray(jax.random.normal(jax.random.key(4), (160, 256)) * 0.1,
                 np.float32)  # (out, in)
  checkpoint.write_safetensors(tmp_path / "base", {"proj.weight": w})
  layer = qlayers.QuantDense(256, 160, recipe="fp8_current", use_bias=False,
                             rngs=nnx.Rngs(0))
  layer.kernel = FrozenKernel.from_qtensor(
      checkpoint.read_safetensors(tmp_path / "base", quantized=True)[
          "proj.weight"])
  qlayers.add_lora(layer, 8, rngs=nnx.Rngs(1))
  layer.lora.lora_b[...] = jax.random.normal(jax.random.key(5), (8, 160),
                                             jnp.bfloat16)
  base = layer.kernel.dequantize()
  a = layer.lora.lora_a[...].astype(jnp.float32)
  b = layer.lora.lora_b[...].astype(jnp.float32)
  want = FrozenKernel.quantize(base + a @ b, CHECKPOINT_SPEC)
  assert qlayers.merge_lora(layer) == 1
  assert not hasattr(layer, "lora")
  np.testing.assert_array_equal(_bits(layer.kernel.payload[...]),
                                _bits(want.payload[...]))
  np.testing.assert_array_equal(layer.kernel.scale[...], want.scale[...])
  # Shipped back in the FP8 layout, and read back exactly.
  checkpoint.write_safetensors(tmp_path / "merged",
                               {"proj.weight": layer.kernel.qtensor()})
  got = checkpoint.read_safetensors(tmp_path / "merged")["proj.weight"]
  np.testing.assert_array_equal(got, np.asarray(want.dequantize()).T)


def test_stock_nnx_loop_trains_the_adapters_only(optax_promotion):
  net = _net("fp8_current")
  payload = np.asarray(net.up.kernel.payload[...]).copy()
  opt = nnx.Optimizer(net, optax.sgd(0.5), wrt=nnx.LoRAParam)

  @nnx.jit
  def step(net, opt):
    loss_fn = lambda m: jnp.mean((m(X) - Y) ** 2)
    loss, grads = nnx.value_and_grad(
        loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(net)
    opt.update(net, grads)
    return loss

  first = step(net, opt)
  for _ in range(3):
    last = step(net, opt)
  assert float(last) < float(first)
  np.testing.assert_array_equal(_bits(net.up.kernel.payload[...]),
                                _bits(payload))


def test_attention_and_einsum_projections_take_adapters():
  """QuantLinearGeneral (attention's projections) and QuantEinsum get
  adapters over their GEMM's flattened K and N: the output adds exactly the
  einsum of a kernel delta lora_a @ lora_b, and merge_lora folds that delta
  into the kernel; what cannot take one is named, and a model with nothing
  to adapt is an error."""
  rngs = nnx.Rngs(0)
  attn = qlayers.QuantAttentionProj(32, 4, 8, recipe="bf16", rngs=rngs)
  ein = qlayers.QuantEinsum("btd,dnh->bnth", (32, 4, 8), recipe="bf16",
                            rngs=rngs)
  model = nnx.Dict(attn=attn, ein=ein)
  assert qlayers.add_lora(model, 2, rngs=nnx.Rngs(1),
                          param_dtype=jnp.float32) == 5
  x = jax.random.normal(jax.random.key(3), (2, 6, 32))
  for layer in (attn.query, attn.out, ein):
    layer.lora.lora_b[...] = jax.random.normal(
        jax.random.key(4), layer.lora.lora_b.shape)
  q, _, _ = attn.qkv(x)
  heads = jax.random.normal(jax.random.key(5), (2, 6, 4, 8))
  cases = [(attn.query, x, q), (attn.out, heads, attn.out(heads)),
           (ein, x, ein(x))]
  for layer, inp, got in cases:
    delta = (layer.lora.lora_a[...] @ layer.lora.lora_b[...]).reshape(
        layer.kernel.shape)
    lora = layer.lora
    del layer.lora
    base = layer(inp)
    layer.kernel[...] = layer.kernel[...] + delta
    want = layer(inp)
    layer.kernel[...] = layer.kernel[...] - delta
    layer.lora = lora
    np.testing.assert_allclose(got - base, want - base, rtol=0.05, atol=0.05)
    assert float(jnp.abs(got - base).max()) > 0.1
  y = ein(x)
  assert qlayers.merge_lora(model) == 5
  np.testing.assert_allclose(ein(x), y, rtol=0.03, atol=0.03)

  experts = qlayers.QuantExperts(4, 32, 16, recipe="fp8_current", rngs=rngs)
  mixed = nnx.Dict(dense=qlayers.QuantDense(32, 16, rngs=rngs),
                   experts=experts)
  with pytest.warns(UserWarning, match=r"left without an adapter: experts "
                    r"\(QuantExperts\)"):
    assert qlayers.add_lora(mixed, 2, rngs=nnx.Rngs(1)) == 1
  with pytest.raises(ValueError, match="no quantized layer to adapt"):
    qlayers.add_lora(nnx.Dict(plain=nnx.Linear(4, 4, rngs=rngs)), 2,
                     rngs=nnx.Rngs(1))
  # Experts modules holding their grouped GEMM (quantize converts their
  # ragged_dot) were named neither here nor by freeze: they kept their
  # wide weights and no adapter in silence.
  class Experts(nnx.Module):
    def __init__(self):
      self.kernel = nnx.Param(jnp.ones((4, 32, 32)))
      self.ragged_dot = jax.lax.ragged_dot

  moe = nnx.Dict(up=Experts(), dense=nnx.Linear(32, 32, rngs=rngs))
  with pytest.warns(UserWarning, match=r"freeze: up \(experts: a grouped "
                    r"GEMM\) keep their wide weights"):
    qlayers.quantize(moe, "fp8_current", frozen=True)
  with pytest.warns(UserWarning, match=r"left without an adapter: up "
                    r"\(experts: a grouped GEMM\)"):
    assert qlayers.add_lora(moe, 2, rngs=nnx.Rngs(1)) == 1
  with pytest.raises(ValueError, match=r"no quantized layer to adapt; up "
                     r"\(experts: a grouped GEMM\)"):
    qlayers.add_lora(nnx.Dict(up=moe.up), 2, rngs=nnx.Rngs(1))


def test_dequantize_model_keeps_a_layer_whose_adapter_is_not_merged():
  # The stock layer kept .lora but never called it: the trained adapter
  # silently stopped counting.
  net = _net("fp8_current")
  net.up.lora.lora_b[...] = jnp.ones_like(net.up.lora.lora_b[...])
  before = net(X)
  report = qlayers.dequantize_model(net)
  assert {s.path for s in report.skipped} == {"up", "down"}
  assert "merge_lora" in str(report)
  assert isinstance(net.up, qlayers.QuantDense)
  np.testing.assert_array_equal(net(X), before)


def _linear(rngs):
  return nnx.Linear(64, 64, rngs=rngs)


def test_qlora_of_a_model_scanned_over_its_layers(tmp_path):
  """A stack made under nnx.vmap gets an adapter per layer (it got one
  unstacked adapter, then was refused), trained under nnx.scan beside the
  frozen codes, saved and loaded exactly, and merged layer by layer."""
  model = Scanned(_linear, nnx.Rngs(0))
  qlayers.quantize(model, "fp8_current", frozen=True)
  before = model(X)
  assert qlayers.add_lora(model, 2, rngs=nnx.Rngs(1)) == 1
  lora = model.layers.lora
  assert lora.lora_a.shape == (3, 64, 2) and lora.lora_b.shape == (3, 2, 64)
  a = np.asarray(lora.lora_a[...], np.float32)
  assert not np.array_equal(a[0], a[1]) and not np.array_equal(a[1], a[2])
  np.testing.assert_array_equal(_bits(model(X)), _bits(before))
  codes = np.asarray(model.layers.kernel.payload[...])
  opt = qlayers.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)

  @nnx.jit
  def step(model, opt):
    loss, grads = qlayers.value_and_grad(
        lambda m: jnp.mean((m(X) - 0.5) ** 2), wrt=nnx.LoRAParam)(model)
    opt.update(model, grads)
    return loss

  losses = [float(step(model, opt)) for _ in range(3)]
  assert losses[-1] < losses[0]
  b = np.asarray(lora.lora_b[...], np.float32)
  assert all(np.abs(b[i]).max() > 0 for i in range(3))
  np.testing.assert_array_equal(_bits(model.layers.kernel.payload[...]),
                                _bits(codes))
  trained = model(X)
  path = qlayers.lora.save_adapters(tmp_path / "a.safetensors", model)
  other = Scanned(_linear, nnx.Rngs(0))
  qlayers.quantize(other, "fp8_current", frozen=True)
  qlayers.add_lora(other, 2, rngs=nnx.Rngs(7))
  qlayers.lora.load_adapters(path, other)
  np.testing.assert_array_equal(_bits(other(X)), _bits(trained))
  # Merged: layer i's codes are its own kernel plus its own adapter's.
  stored = model.layers.kernel.dequantize(jnp.float32)
  a = lora.lora_a[...].astype(jnp.float32)
  assert qlayers.merge_lora(model) == 1
  for i in range(3):
    want = FrozenKernel.quantize(stored[i] + a[i] @ b[i],
                                 model.layers.kernel.spec)
    np.testing.assert_array_equal(
        _bits(model.layers.kernel.payload[...][i]), _bits(want.payload[...]))


def test_add_lora_takes_a_pattern_and_names_a_bad_rank():
  """``where`` as a regular expression on the /-joined path (as a Rule's
  pattern), and a float or bool rank refused by name (was: 'str' object is
  not callable, and nnx.LoRA's shape error)."""
  model = nnx.Sequential(
      qlayers.QuantDense(16, 16, recipe="fp8_current", rngs=nnx.Rngs(0)),
      qlayers.QuantDense(16, 16, recipe="fp8_current", rngs=nnx.Rngs(1)))
  assert qlayers.add_lora(model, 2, rngs=nnx.Rngs(2), where=r"^layers/1$") == 1
  assert getattr(model.layers[0], "lora", None) is None
  assert model.layers[1].lora is not None
  for bad in (2.0, True):
    with pytest.raises(ValueError, match="rank must be a positive int"):
      qlayers.add_lora(model, bad, rngs=nnx.Rngs(2))
  with pytest.raises(TypeError, match="rngs must be an nnx.Rngs"):
    qlayers.add_lora(model, 2, rngs=None)
  with pytest.raises(ValueError, match="that `where` accepts"):
    qlayers.add_lora(model, 2, rngs=nnx.Rngs(2), where=re.compile("nope"))
  # A shared layer is taken where `where` names any of its paths, as a Rule
  # decides it (it saw only the first path).
  model.tied = model.layers[0]  # after "layers": its second path
  assert qlayers.add_lora(model, 2, rngs=nnx.Rngs(2), where=r"^tied$") == 1
  assert model.layers[0].lora is not None


def test_merge_into_a_delayed_param_kernel_settles_its_weight_history():
  """The merged kernel's amax replaces the trained weight history (which
  scaled it by the old amax: saturated, and in eval mode for good)."""
  layer = qlayers.QuantDense(16, 8, recipe="fp8_delayed", rngs=nnx.Rngs(0))
  layer.quant.w_amax_history[...] = jnp.full_like(
      layer.quant.w_amax_history[...], 0.01)  # a trained, smaller kernel
  qlayers.add_lora(layer, 2, rngs=nnx.Rngs(1))
  layer.lora.lora_b[...] = jnp.ones_like(layer.lora.lora_b[...])
  qlayers.merge_lora(layer)
  amax = float(jnp.max(jnp.abs(layer.kernel[...])))
  np.testing.assert_array_equal(layer.quant.w_amax_history[...],
                                np.full_like(layer.quant.w_amax_history[...],
                                             amax))
  assert float(layer.quant.w_amax[...]) == amax


@pytest.mark.parametrize("recipe", ["fp8_current", "nvfp4"])
def test_non_finite_kernels_are_refused_before_anything_is_stored(recipe):
  # freeze and merge_lora stored NaN scales or codes for a kernel holding
  # an Inf (or an adapter making one): the weights, and with them the
  # frozen base, were gone in silence.
  model = nnx.Dict(a=qlayers.QuantDense(64, 32, recipe=recipe,
                                        rngs=nnx.Rngs(0)),
                   b=qlayers.QuantDense(64, 32, recipe=recipe,
                                        rngs=nnx.Rngs(1)))
  model.b.kernel[...] = model.b.kernel[...].at[3, 4].set(jnp.inf)
  kernels = [np.asarray(m.kernel[...]) for m in (model.a, model.b)]
  with pytest.raises(ValueError, match=r"freeze: NaN or Inf .* b \(1 of "
                     r"2048 values\)"):
    qlayers.freeze(model, key=jax.random.key(0))
  for m, want in zip((model.a, model.b), kernels):
    assert isinstance(m.kernel, nnx.Param)
    np.testing.assert_array_equal(m.kernel[...], want)
  model.b.kernel[...] = jnp.asarray(kernels[0])
  qlayers.freeze(model, key=jax.random.key(0))
  qlayers.add_lora(model, 4, rngs=nnx.Rngs(2))
  model.b.lora.lora_b[...] = model.b.lora.lora_b[...].at[0, 5].set(jnp.nan)
  codes = [np.asarray(m.kernel.payload) for m in (model.a, model.b)]
  with pytest.raises(ValueError, match=r"merge_lora: .* b \(64 of 2048"):
    qlayers.merge_lora(model, key=jax.random.key(1))
  for m, want in zip((model.a, model.b), codes):
    np.testing.assert_array_equal(m.kernel.payload, want)
    assert m.lora is not None
