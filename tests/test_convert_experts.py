"""qlayers.quantize on mixture-of-experts blocks: experts holding their
grouped GEMM get a QuantRaggedDot, routers stay wide, stacked weights it
cannot reach are reported with what to do; dequantize_model undoes it."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import qlayers
from qlayers import ops
from qlayers.layers import QuantRaggedDot

E, D, H = 4, 64, 128
SIZES = jnp.array([3, 0, 4, 1], jnp.int32)


class Experts(nnx.Module):
  """Stacked experts written the usual way, the grouped GEMM an attribute."""

  def __init__(self, k, n, rngs):
    self.kernel = nnx.Param(jax.random.normal(rngs.params(), (E, k, n)) * 0.1)
    self.ragged_dot = jax.lax.ragged_dot

  def __call__(self, x, group_sizes):
    return self.ragged_dot(x, self.kernel[...], group_sizes)


class RawExperts(nnx.Module):
  """Stacked experts that call jax.lax.ragged_dot from their own code."""

  def __init__(self, rngs):
    self.w1 = nnx.Param(jnp.zeros((E, D, D)))

  def __call__(self, x, group_sizes):
    return jax.lax.ragged_dot(x, self.w1[...], group_sizes)


class MoE(nnx.Module):

  def __init__(self, rngs):
    self.router = nnx.Linear(D, E, rngs=rngs)
    self.up = Experts(D, H, rngs)
    self.down = Experts(H, D, rngs)
    self.raw = RawExperts(rngs)

  def __call__(self, x):  # tokens already sorted by expert
    return self.down(nnx.relu(self.up(x, SIZES)), SIZES)


def _kinds(report):
  return ({c.path: c.new_type for c in report.converted},
          {k.path: k.why for k in report.kept_wide},
          {s.path: s.reason for s in report.skipped})


def test_experts_converted_router_kept_wide_raw_reported():
  moe = MoE(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (8, D))
  rd = ops.ragged_dot("fp8_current")
  want = jax.jit(lambda x, up, down: rd(nnx.relu(rd(x, up, SIZES)), down,
                                        SIZES))(x, moe.up.kernel[...],
                                                moe.down.kernel[...])
  kernel = moe.up.kernel
  converted, kept, skipped = _kinds(qlayers.quantize(moe, "fp8_current"))
  assert converted == {"up": "QuantRaggedDot at .ragged_dot",
                       "down": "QuantRaggedDot at .ragged_dot"}
  assert kept == {"router": "router of the 4 experts at up (kept wide)"}
  assert "stacked expert weights 'w1' (4, 64, 64)" in skipped["raw"]
  assert "self.ragged_dot = jax.lax.ragged_dot" in skipped["raw"]
  assert type(moe.router) is nnx.Linear  # pylint: disable=unidiomatic-typecheck
  assert moe.up.kernel is kernel  # the same Param, in the same module
  np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(moe, x), want)
  again = qlayers.quantize(moe, "fp8_current")
  assert {s.path for s in again.already_quantized} == {"up", "down"}
  back = qlayers.dequantize_model(moe)
  assert {c.path for c in back.converted} == {"up", "down"}
  assert moe.up.ragged_dot is jax.lax.ragged_dot
  assert not nnx.state(moe, qlayers.QuantVariable)


def test_an_experts_module_that_is_the_model_converts_too():
  """The grouped GEMM is swapped on the module, so the module may be the
  model itself (a router beside the experts stays wide); and back."""

  class Flat(Experts):
    def __init__(self, rngs):
      super().__init__(D, H, rngs)
      self.router = nnx.Linear(D, E, rngs=rngs)

  for model in (Experts(D, H, nnx.Rngs(0)), Flat(nnx.Rngs(0))):
    x = jax.random.normal(jax.random.key(1), (8, D))
    want = ops.ragged_dot("fp8_current")(x, model.kernel[...], SIZES)
    converted, kept, _ = _kinds(qlayers.quantize(model, "fp8_current"))
    assert converted == {"": "QuantRaggedDot at .ragged_dot"}
    assert isinstance(model.ragged_dot, QuantRaggedDot)
    np.testing.assert_array_equal(model(x, SIZES), want)
    if isinstance(model, Flat):
      assert kept == {"router": "router of the 4 experts at (model) (kept "
                                "wide)"}
    qlayers.dequantize_model(model)
    assert model.ragged_dot is jax.lax.ragged_dot


def test_delayed_experts_train_with_per_expert_state():
  moe = MoE(nnx.Rngs(0))
  qlayers.quantize(moe, "fp8_delayed")
  assert isinstance(moe.up.ragged_dot, QuantRaggedDot)
  x = jax.random.normal(jax.random.key(1), (8, D))
  _, grads = nnx.jit(qlayers.value_and_grad(
      lambda m, x: jnp.sum(m(x) ** 2)))(moe, x)
  qlayers.update_scales(moe, grads)
  hist = moe.up.ragged_dot.x_amax_history[:, 0]
  assert hist.shape == (E,)
  assert float(hist[0]) == float(jnp.max(jnp.abs(x[:3])))
  assert float(hist[1]) == 0.0  # the empty expert saw nothing
  assert (np.asarray(moe.down.ragged_dot.g_amax_history[:, 0]) > 0).sum() == 3


def test_rules_decide_experts_and_routers():
  moe = MoE(nnx.Rngs(0))
  report = qlayers.quantize(moe, "fp8_current", [
      qlayers.Rule(pattern="^down$", recipe=None),
      qlayers.Rule(pattern="router", recipe="fp8_current")])
  converted, kept, _ = _kinds(report)
  assert set(converted) == {"up", "router"} and set(kept) == {"down"}


def test_what_cannot_be_converted_is_reported():
  moe = MoE(nnx.Rngs(0))
  moe.down.ragged_dot = jax.numpy.matmul  # a custom grouped GEMM
  report = qlayers.quantize(moe, "mxfp8")
  _, _, skipped = _kinds(report)
  assert skipped["down"] == ("a custom ragged_dot is injected; replacing it "
                             "would drop it")
  small = MoE(nnx.Rngs(0))
  small.up = Experts(16, H, nnx.Rngs(0))
  _, _, skipped = _kinds(qlayers.quantize(small, "mxfp8"))
  assert skipped["up"].startswith("K=16, N=128: smaller than one 32-element "
                                  "mx scaling block")


def test_einsum_experts_converted_router_kept_wide():
  class EinsumMoE(nnx.Module):
    def __init__(self, rngs):
      self.router = nnx.Linear(D, E, rngs=rngs)
      self.up = nnx.Einsum("ecd,edf->ecf", (E, D, H), rngs=rngs)
      self.mix = nnx.Einsum("ecd,fde->ecf", (H, D, E), rngs=rngs)
  moe = EinsumMoE(nnx.Rngs(0))
  kernel = moe.up.kernel
  converted, kept, skipped = _kinds(qlayers.quantize(moe, "fp8_delayed"))
  assert converted == {"up": "QuantExpertsEinsum"} and set(kept) == {"router"}
  assert "batch dims" in skipped["mix"]
  assert moe.up.kernel is kernel
  assert moe.up.quant.x_amax_history.shape == (E, 1024)
  back = qlayers.dequantize_model(moe)
  assert [c.new_type for c in back.converted] == ["Einsum"]
  assert type(moe.up) is nnx.Einsum  # pylint: disable=unidiomatic-typecheck


def test_model_built_with_quant_experts():
  class Built(nnx.Module):
    def __init__(self, rngs):
      self.router = nnx.Linear(D, E, rngs=rngs)
      self.up = qlayers.QuantExperts(E, D, H, recipe="mxfp8", rngs=rngs)
  report = qlayers.quantize(Built(nnx.Rngs(0)), "fp8_current")
  assert [(s.path, s.reason) for s in report.already_quantized] == [
      ("up", "already quantized (mxfp8); not requantized as fp8_current "
       "(it has no stock layer to return to: rebuild the model)")]
  assert [k.path for k in report.kept_wide] == ["router"]
  assert not report.converted and not report.skipped


class ScannedMoE(nnx.Module):
  """Two MoE layers made under nnx.vmap, run by nnx.scan: experts as a
  ragged_dot module and as an einsum, each beside its router."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return nnx.Dict(router=nnx.Linear(D, E, rngs=rngs),
                      up=Experts(D, D, rngs),
                      mix=nnx.Einsum("ecd,edf->ecf", (E, D, D), rngs=rngs))
    self.layers = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(layer, x):
      h = nnx.relu(layer.up(x, SIZES))
      return layer.mix(h.reshape(E, -1, D)).reshape(x.shape)
    return body(self.layers, x)


def test_stacked_experts_convert_with_per_layer_per_expert_state():
  # The state was made per expert only: nnx.scan refused it (or, with as
  # many layers as experts, sliced it to a scalar), and the router of a
  # stacked ragged module was quantized while its experts were skipped.
  model = ScannedMoE(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (8, D))
  wide = model(x)
  report = qlayers.quantize(model, "fp8_delayed")
  converted, kept, _ = _kinds(report)
  assert set(converted) == {"layers/up", "layers/mix"}
  assert "router of the 4 experts" in kept["layers/router"]
  for gemm in (model.layers.up.ragged_dot, model.layers.mix.quant):
    assert gemm.x_amax.shape == (2, E)
    assert gemm.x_amax_history.shape[:2] == (2, E)
  y = model(x)
  err = jnp.linalg.norm(y - wide) / jnp.linalg.norm(wide)
  assert 0 < err < 0.1
  amax = model.layers.up.ragged_dot.x_amax[...]
  np.testing.assert_array_equal(amax[0], [float(jnp.max(jnp.abs(x[:3]))), 0,
                                          float(jnp.max(jnp.abs(x[3:7]))),
                                          float(jnp.max(jnp.abs(x[7:])))])


def test_an_unstacked_kernel_of_rank_four_is_skipped_with_the_reason():
  # Without a router stacked alike, its leading dim was taken for a stack
  # and its second for the experts: converted, then failing at its call.
  class Experts4(nnx.Module):
    def __init__(self, rngs):
      self.kernel = nnx.Param(jax.random.normal(rngs.params(), (E, D, 2, 8)))
      self.ragged_dot = jax.lax.ragged_dot

    def __call__(self, x, sizes):
      return self.ragged_dot(x, self.kernel[...].reshape(E, D, 16), sizes)

  model = nnx.Dict(up=Experts4(nnx.Rngs(0)))
  report = qlayers.quantize(model, "fp8_delayed")
  assert "dims before [E, K, N]" in _kinds(report)[2]["up"]
  assert model.up.ragged_dot is jax.lax.ragged_dot


def test_one_ragged_dot_for_two_weights_keeps_no_shared_state():
  # An experts module running both its weights through its one ragged_dot
  # was converted (once one was named 'kernel', as the skip said) with one
  # delayed history for both: each weight scaled by the other's amax.
  class TwoWeights(nnx.Module):
    def __init__(self, rngs):
      self.kernel = nnx.Param(jnp.full((E, D, H), 1e-3))
      self.wo = nnx.Param(jnp.full((E, H, D), 30.0))
      self.ragged_dot = jax.lax.ragged_dot

  model = nnx.Dict(experts=TwoWeights(nnx.Rngs(0)))
  _, _, skipped = _kinds(qlayers.quantize(model, "fp8_delayed"))
  assert skipped["experts"].startswith(
      "holds several stacked weights (kernel, wo) that its one ragged_dot "
      "would serve with one delayed-scaling state")
  assert model.experts.ragged_dot is jax.lax.ragged_dot
  # Without state, one GEMM may serve both; each must fit the blocks.
  converted, _, _ = _kinds(qlayers.quantize(model, "fp8_current"))
  assert converted == {"experts": "QuantRaggedDot at .ragged_dot"}
  small = nnx.Dict(experts=TwoWeights(nnx.Rngs(0)))
  small.experts.wo = nnx.Param(jnp.ones((E, H, 16)))
  _, _, skipped = _kinds(qlayers.quantize(small, "mxfp8"))
  assert skipped["experts"].startswith("wo: K=128, N=16: smaller than one")


def test_routers_are_the_layers_beside_experts_that_score_their_inputs():
  # Any linear layer under the experts' parent with E outputs was kept wide
  # as a router (attention projections of width E, a block elsewhere), and
  # a rank-4 einsum's router was quantized (its expert count read as D).
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.router = nnx.Linear(D, E, rngs=rngs)
      self.up = Experts(D, H, rngs)
      self.attn = nnx.Dict(k=nnx.Linear(D, E, rngs=rngs))
      self.other = nnx.Linear(H, E, rngs=rngs)  # E outputs, not D inputs

  class Einsum4(nnx.Module):
    def __init__(self, rngs):
      self.router = nnx.Linear(D, E, rngs=rngs)
      self.up = nnx.Einsum("ecd,edhf->echf", (E, D, 2, 16), rngs=rngs)

  converted, kept, _ = _kinds(qlayers.quantize(Block(nnx.Rngs(0)),
                                               "fp8_current"))
  assert set(kept) == {"router"}
  assert {"attn/k", "other", "up"} <= set(converted)
  converted, kept, _ = _kinds(qlayers.quantize(Einsum4(nnx.Rngs(0)),
                                               "fp8_current"))
  assert converted == {"up": "QuantExpertsEinsum"}
  assert kept == {"router": "router of the 4 experts at up (kept wide)"}


def test_routers_wrapped_or_beside_a_container_and_stacked_biases():
  # A router wrapped in a module of its own, or beside a container of
  # experts (Mixtral's gate beside its experts), was quantized; stacked
  # under nnx.vmap its experts were skipped ("no router beside"); and a
  # stacked per-expert bias [L, E, N] was taken for a second weight.
  class BiasedExperts(Experts):
    def __init__(self, k, n, rngs):
      super().__init__(k, n, rngs)
      self.bias = nnx.Param(jnp.zeros((E, n)))

  class Wrapped(nnx.Module):
    def __init__(self, rngs):
      self.router = nnx.Dict(proj=nnx.Linear(D, E, rngs=rngs))
      self.up = BiasedExperts(D, H, rngs)

  class Mixtral(nnx.Module):
    def __init__(self, rngs):
      self.gate = nnx.Linear(D, E, rngs=rngs)
      self.experts = nnx.Dict(w1=Experts(D, H, rngs), w2=Experts(H, D, rngs))

  class GatedAttention(nnx.Module):  # a per-head gate as wide as E
    def __init__(self, rngs):
      self.attn = nnx.Dict(gate=nnx.Linear(D, E, rngs=rngs))
      self.moe = nnx.Dict(router=nnx.Param(jnp.zeros((D, E))),
                          up=Experts(D, H, rngs))

  @nnx.split_rngs(splits=2)
  @nnx.vmap(in_axes=0, out_axes=0)
  def stack(rngs):
    return Wrapped(rngs)

  converted, kept, _ = _kinds(qlayers.quantize(Wrapped(nnx.Rngs(0)),
                                               "fp8_current"))
  assert set(converted) == {"up"} and set(kept) == {"router/proj"}
  converted, kept, _ = _kinds(qlayers.quantize(Mixtral(nnx.Rngs(0)),
                                               "fp8_current"))
  assert set(converted) == {"experts/w1", "experts/w2"}
  assert set(kept) == {"gate"}
  converted, kept, _ = _kinds(qlayers.quantize(
      nnx.Dict(block=GatedAttention(nnx.Rngs(0))), "fp8_current"))
  assert set(converted) == {"block/attn/gate", "block/moe/up"} and not kept
  for recipe in ("mxfp8", "fp8_delayed"):
    model = nnx.Dict(layers=stack(nnx.Rngs(0)))
    converted, kept, skipped = _kinds(qlayers.quantize(model, recipe))
    assert set(converted) == {"layers/up"} and not skipped
    assert set(kept) == {"layers/router/proj"}
  assert model.layers.up.ragged_dot.x_amax.shape == (2, E)  # fp8_delayed
